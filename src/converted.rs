//! The engine's converted weights: int8 or int4 matrices with per-group
//! scales (f32 for int8, bf16 for int4) and f32 norm vectors, all living
//! in one byte blob (in memory after a conversion, memory-mapped when
//! loaded from the cache).

use crate::config::ModelConfig;
use crate::error::Result;

/// Input elements that share one scale, in either [`WeightFormat`]. Rows
/// are zero-padded to a multiple of this, so a group never straddles two
/// rows.
///
/// int4 keeps the int8 group of 64 (one layout of padding and activation
/// rows for both formats) with a bf16 scale: 4.25 bits a weight, against
/// 4.5 for Q4_0's 32 with an f16 one. A bf16 scale is exact for every
/// weight of the form `q * s` taken from a bf16 checkpoint (the dtype
/// Qwen3 ships in: `s` is a bf16 weight / -8), where an f16 one is not
/// below 6.1e-5 or above 65504.
pub const QUANT_GROUP: usize = 64;

/// How the converted layer weights are stored: the linear weights of every
/// decoder layer (q, k, v, o, gate, up, down). The embedding and the LM
/// head are int8 in either format (the output projection is the matrix most
/// sensitive to quantisation).
///
/// Both are symmetric, with one scale per [`QUANT_GROUP`] inputs of a
/// row. [`WeightFormat::Int8`] (the default) rounds to `[-127, 127]` times
/// the group's largest magnitude / 127 (an f32 scale).
/// [`WeightFormat::Int4`] halves the layers' bytes (Qwen3-4B: 2.3 GB of
/// GPU weights instead of 4.3): it rounds to `[-8, 7]` times the group's
/// value of largest magnitude / -8 (as llama.cpp's Q4_0) rounded to bf16,
/// which is lossless for weights of the form `q * s` with `q` in `[-8, 7]`,
/// -8 present in each group and `s` a bf16 value (as it is in every bf16
/// checkpoint).
///
/// ```no_run
/// use qwen3_wgpu::{Engine, LoadOptions, WeightFormat};
/// let options = LoadOptions::default().weights(WeightFormat::Int4);
/// let model = Engine::new()?.load("./qwen3-4b", &options)?;
/// println!("{} bytes of weights on the GPU ({})", model.weight_bytes(), model.weight_format());
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
///
/// ```
/// use qwen3_wgpu::WeightFormat;
/// assert_eq!(WeightFormat::from_name("--weights", "INT4")?, WeightFormat::Int4);
/// assert_eq!(WeightFormat::default().name(), "int8");
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum WeightFormat {
    /// 8 bits a weight.
    #[default]
    Int8,
    /// 4 bits a weight, in the layers' linear weights.
    Int4,
}

/// Environment variable naming the [`WeightFormat`] of a load whose
/// [`LoadOptions`](crate::LoadOptions) leave it unset: `int8` or `int4`.
pub const WEIGHTS_ENV: &str = "QWEN3_WGPU_WEIGHTS";

impl WeightFormat {
    /// Every format.
    pub const ALL: [WeightFormat; 2] = [WeightFormat::Int8, WeightFormat::Int4];

    /// The names [`Self::from_name`] accepts, and [`Self::name`] gives.
    pub const NAMES: [(&'static str, WeightFormat); 2] =
        [("int8", WeightFormat::Int8), ("int4", WeightFormat::Int4)];

    /// `int8` or `int4`.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Int8 => "int8",
            WeightFormat::Int4 => "int4",
        }
    }

    /// The format named `int8` or `int4` (any case); anything else is
    /// `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        crate::settings::parse_choice(what, value, &Self::NAMES)
    }

    /// The format [`WEIGHTS_ENV`] names: `None` when it is unset or empty,
    /// `invalid_argument` when it names no format.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(WEIGHTS_ENV, &Self::NAMES)
    }

    /// Bits per stored weight.
    pub fn bits(self) -> usize {
        match self {
            WeightFormat::Int8 => 8,
            WeightFormat::Int4 => 4,
        }
    }
}

/// Bytes of one stored group scale in `format`: an f32 (int8) or a bf16
/// (int4; `group_scale` in int8_common.wgsl and f16_stage.wgsl, and the
/// MSL twins' `group_scale`, read it from the low half of a word for an
/// even group index and from the high half for an odd one).
pub fn scale_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Int8 => 4,
        WeightFormat::Int4 => 2,
    }
}

/// `scale` as `format` stores it (int4: rounded to the nearest bf16, ties
/// to even).
pub fn stored_scale(format: WeightFormat, scale: f32) -> f32 {
    match format {
        WeightFormat::Int8 => scale,
        WeightFormat::Int4 => half::bf16::from_f32(scale).to_f32(),
    }
}

/// Writes `scale` (as [`stored_scale`] rounds it) into `out`
/// ([`scale_bytes`] long), native-endian.
pub fn write_scale(format: WeightFormat, scale: f32, out: &mut [u8]) {
    match format {
        WeightFormat::Int8 => out.copy_from_slice(&scale.to_ne_bytes()),
        WeightFormat::Int4 => out.copy_from_slice(&half::bf16::from_f32(scale).to_bits().to_ne_bytes()),
    }
}

/// The scale stored in `bytes` ([`scale_bytes`] long).
pub fn read_scale(format: WeightFormat, bytes: &[u8]) -> f32 {
    match format {
        WeightFormat::Int8 => f32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
        WeightFormat::Int4 => half::bf16::from_bits(u16::from_ne_bytes([bytes[0], bytes[1]])).to_f32(),
    }
}

/// `scales` as `format` stores them, zero-padded to whole 4-byte words (a
/// storage binding's size must be one).
pub fn scale_blob(format: WeightFormat, scales: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; scales_len(format, scales.len())];
    for (s, o) in scales.iter().zip(out.chunks_exact_mut(scale_bytes(format))) {
        write_scale(format, *s, o);
    }
    out
}

/// Bytes of `count` scales stored in `format`, padded to whole 4-byte words.
pub fn scales_len(format: WeightFormat, count: usize) -> usize {
    (count * scale_bytes(format)).next_multiple_of(4)
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where value `col` of an int4 row lies: its byte, and whether it is that
/// byte's high nibble. Each u32 word holds 8 consecutive values, byte `b`
/// value `b` in its low nibble and `b + 4` in its high one, so a kernel
/// gets a word's first four values from its low nibbles and the last four
/// from its high ones, in the same vector operations (`i4x8` in
/// int8_math.wgsl). Nibbles are two's complement, so a zero
/// byte (the blob's padding) is two zero weights.
pub fn int4_position(col: usize) -> (usize, bool) {
    ((col / 8) * 4 + col % 4, col % 8 >= 4)
}

/// Alignment of every array inside the blob (bytes).
pub const BLOB_ALIGN: usize = 64;

/// A byte range inside the blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ByteRange {
    pub offset: usize,
    pub len: usize,
}

/// A quantised matrix `[rows, cols]`: row-major data of `format` with
/// row stride `padded_cols()` values (zero padded; `row_bytes()` bytes),
/// and `rows * groups()` scales (`w[r][c] = q[r][c] *
/// scales[r][c / QUANT_GROUP]`; f32 for int8, bf16 for int4, zero-padded
/// to whole words: [`scale_bytes`]). int8 values are bytes;
/// int4 values are nibbles placed as [`int4_position`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuantMatrix {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub data: ByteRange,
    pub scales: ByteRange,
}

impl QuantMatrix {
    /// Row stride of `data` in values.
    pub fn padded_cols(&self) -> usize {
        self.cols.div_ceil(QUANT_GROUP) * QUANT_GROUP
    }
    /// Row stride of `data` in bytes.
    pub fn row_bytes(&self) -> usize {
        self.padded_cols() * self.format.bits() / 8
    }
    /// Scales per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(QUANT_GROUP)
    }
    /// Bytes of one row's scales.
    pub fn row_scale_bytes(&self) -> usize {
        self.groups() * scale_bytes(self.format)
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
    /// The format of the layers' linear weights (each matrix also says its own).
    pub weights: WeightFormat,
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
    /// An f32 array (norm weights).
    pub fn f32s(&self, r: ByteRange) -> &[f32] {
        bytemuck::cast_slice(self.bytes(r))
    }
    /// The scales of `m`, row after row, as f32.
    pub fn scales(&self, m: &QuantMatrix) -> Vec<f32> {
        let bytes = self.bytes(m.scales).chunks_exact(scale_bytes(m.format));
        bytes.take(m.rows * m.groups()).map(|b| read_scale(m.format, b)).collect()
    }
    /// The matrix used as LM head (the embedding when tied).
    pub fn lm_head(&self) -> &QuantMatrix {
        self.index.lm_head.as_ref().unwrap_or(&self.index.embed)
    }
}
