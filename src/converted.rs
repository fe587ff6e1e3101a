//! The engine's converted weights: int8 matrices with per-group f32 scales
//! and f32 norm vectors, all living in one byte blob (in memory after a
//! conversion, memory-mapped when loaded from the cache).

use crate::config::ModelConfig;

/// Input elements that share one scale. Rows are zero-padded to a multiple
/// of this, so a group never straddles two rows.
pub const QUANT_GROUP: usize = 64;

/// Alignment of every array inside the blob (bytes).
pub const BLOB_ALIGN: usize = 64;

/// A byte range inside the blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ByteRange {
    pub offset: usize,
    pub len: usize,
}

/// An int8 matrix `[rows, cols]`: row-major `int8` data with row stride
/// `padded_cols()` (zero padded), and `rows * groups()` f32 scales
/// (`w[r][c] = data[r][c] * scales[r][c / QUANT_GROUP]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuantMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: ByteRange,
    pub scales: ByteRange,
}

impl QuantMatrix {
    /// Row stride of `data` in elements (= bytes).
    pub fn padded_cols(&self) -> usize {
        self.cols.div_ceil(QUANT_GROUP) * QUANT_GROUP
    }
    /// Scales per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(QUANT_GROUP)
    }
}

/// One decoder layer. `qkv` stacks q_proj, k_proj, v_proj rows (in that
/// order); `gate_up` interleaves gate_proj and up_proj rows (gate row i at
/// 2i, up row i at 2i + 1), the layout of the SwiGLU matvec epilogue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerWeights {
    pub input_norm: ByteRange,
    pub qkv: QuantMatrix,
    pub q_norm: ByteRange,
    pub k_norm: ByteRange,
    pub o_proj: QuantMatrix,
    pub post_norm: ByteRange,
    pub gate_up: QuantMatrix,
    pub down: QuantMatrix,
}

/// Where every tensor of a converted model lives inside its blob.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WeightIndex {
    pub embed: QuantMatrix,
    /// `None` when the LM head is tied to `embed`.
    pub lm_head: Option<QuantMatrix>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: ByteRange,
}

/// Backing storage of the blob.
pub enum Blob {
    Owned(Vec<u8>),
    Mapped(memmap2::Mmap),
}

impl std::ops::Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Blob::Owned(v) => v,
            Blob::Mapped(m) => m,
        }
    }
}

/// A converted model, ready to upload.
pub struct ConvertedModel {
    pub config: ModelConfig,
    pub index: WeightIndex,
    pub blob: Blob,
    /// Byte offset of the blob's start inside `blob` (the cache file's header
    /// precedes it when memory-mapped).
    pub blob_start: usize,
}

impl ConvertedModel {
    /// The bytes of one range.
    pub fn bytes(&self, r: ByteRange) -> &[u8] {
        &self.blob[self.blob_start + r.offset..self.blob_start + r.offset + r.len]
    }
    /// An f32 array (norm weights, scales).
    pub fn f32s(&self, r: ByteRange) -> &[f32] {
        bytemuck::cast_slice(self.bytes(r))
    }
    /// The matrix used as LM head (the embedding when tied).
    pub fn lm_head(&self) -> &QuantMatrix {
        self.index.lm_head.as_ref().unwrap_or(&self.index.embed)
    }
}
