//! Converted weights on the GPU: one buffer per quantised matrix (and its
//! scales), bound in row chunks when a matrix exceeds the device's storage
//! binding limit (Qwen3's 151936 x 1024 table does on lavapipe), and the
//! loaded model its sessions share (device, kernels, config, weights).

use std::sync::Arc;

use crate::buffers::PREFILL_BATCH;
use crate::config::ModelConfig;
use crate::converted::{scale_bytes, ByteRange, ConvertedModel, QuantMatrix, WeightFormat, QUANT_GROUP};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::{chunk_rows, Kernels};
use crate::progress::{LoadPhase, Progress};

/// A run of rows bound as one range.
#[derive(Debug, Clone, Copy)]
pub struct RowChunk {
    pub row_start: usize,
    pub rows: usize,
}

/// A quantised matrix on the GPU.
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    /// How its values are stored (the kernels that read it follow).
    pub format: WeightFormat,
    /// Padded row length / 4: the input's u32 words at int8 (the kernels'
    /// `k_words`, whatever the format).
    pub k_words: usize,
    pub groups: usize,
    pub data: wgpu::Buffer,
    pub scales: wgpu::Buffer,
    pub chunks: Vec<RowChunk>,
}

impl GpuMatrix {
    fn upload(
        gpu: &Gpu,
        model: &ConvertedModel,
        m: &QuantMatrix,
        label: &str,
        progress: &Progress<'_>,
    ) -> Result<Self> {
        let row_bytes = m.row_bytes();
        let max_binding = gpu.device.limits().max_storage_buffer_binding_size;
        let per_chunk = chunk_rows(row_bytes, max_binding);
        let chunks = (0..m.rows)
            .step_by(per_chunk)
            .map(|row_start| RowChunk { row_start, rows: per_chunk.min(m.rows - row_start) })
            .collect();
        Ok(GpuMatrix {
            rows: m.rows,
            cols: m.cols,
            format: m.format,
            k_words: m.padded_cols() / 4,
            groups: m.groups(),
            data: upload_range(gpu, model, m.data, label, progress)?,
            scales: upload_range(gpu, model, m.scales, label, progress)?,
            chunks,
        })
    }

    /// Bytes of one row's data.
    pub fn row_bytes(&self) -> usize {
        self.k_words * 4 * self.format.bits() / 8
    }

    /// The data range of a chunk, for binding.
    pub fn data_range(&self, c: &RowChunk) -> wgpu::BindingResource<'_> {
        let row = self.row_bytes() as u64;
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.data,
            offset: c.row_start as u64 * row,
            size: std::num::NonZeroU64::new(c.rows as u64 * row),
        })
    }

    /// The scales range of a chunk, for binding: whole words (a chunk's
    /// rows are a multiple of [`chunk_rows`]'s 128 but the last, and the
    /// buffer's padding completes the last word).
    pub fn scales_range(&self, c: &RowChunk) -> wgpu::BindingResource<'_> {
        let row = (self.groups * scale_bytes(self.format)) as u64;
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.scales,
            offset: c.row_start as u64 * row,
            size: std::num::NonZeroU64::new((c.rows as u64 * row).next_multiple_of(4)),
        })
    }
}

/// One decoder layer's weights on the GPU.
pub struct GpuLayer {
    pub input_norm: wgpu::Buffer,
    pub qkv: GpuMatrix,
    /// The q norm weight, then the k norm weight (one binding for both).
    pub qk_norm: wgpu::Buffer,
    pub o_proj: GpuMatrix,
    pub post_norm: wgpu::Buffer,
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
}

/// The whole model on the GPU.
pub struct GpuWeights {
    /// Bytes of weights uploaded (quantised data, scales, norm vectors).
    pub bytes: u64,
    /// The format of the layers' linear weights.
    pub format: WeightFormat,
    pub embed: GpuMatrix,
    /// `None` when tied to `embed`.
    pub lm_head: Option<GpuMatrix>,
    pub layers: Vec<GpuLayer>,
    pub final_norm: wgpu::Buffer,
    /// Where cooperative-matrix prompt batches stage a launch's weights and
    /// inputs as f16 ([`Self::staging`]): made for the first session on
    /// such a device.
    staged: std::sync::OnceLock<wgpu::Buffer>,
}

impl GpuLayer {
    /// The layer's matrices (the prompt-batch products' weights).
    pub fn matrices(&self) -> [&GpuMatrix; 4] {
        [&self.qkv, &self.o_proj, &self.gate_up, &self.down]
    }
}

impl GpuWeights {
    /// Uploads every tensor straight into buffers mapped at creation (no
    /// staging copies pile up in the queue).
    pub fn upload(gpu: &Gpu, model: &ConvertedModel) -> Result<Self> {
        Self::upload_with(gpu, model, &Progress::none())
    }

    /// [`upload`](Self::upload), reporting [`LoadPhase::Uploading`] through
    /// `progress` (bytes: the converted ranges uploaded, without the
    /// padding added on the GPU). [`Error::Cancelled`] when it cancels; the
    /// buffers made so far are then freed.
    pub fn upload_with(gpu: &Gpu, model: &ConvertedModel, progress: &Progress<'_>) -> Result<Self> {
        let ix = &model.index;
        progress.begin(LoadPhase::Uploading, upload_bytes(ix))?;
        // Norm weights, zero-padded to whole quant groups: the fused-norm
        // matvec reads them as far as the padded row length; then the same
        // values as f16 (what decode steps that keep an f16 residual read:
        // exact for weights that came from bf16 within f16's range).
        let vec = |r: ByteRange, label: &str| {
            let mut bytes = model.bytes(r).to_vec();
            bytes.resize(bytes.len().div_ceil(4 * QUANT_GROUP) * 4 * QUANT_GROUP, 0);
            let bytes = crate::reference::norm_weight_bytes(&bytemuck::pod_collect_to_vec(&bytes));
            let buffer = gpu.storage_init(label, &bytes)?;
            progress.advance(r.len as u64)?;
            Ok::<_, Error>(buffer)
        };
        let qk_norm = |l: &crate::converted::LayerWeights| {
            let buffer =
                gpu.storage_init("qk_norm", &[model.bytes(l.q_norm), model.bytes(l.k_norm)].concat())?;
            progress.advance((l.q_norm.len + l.k_norm.len) as u64)?;
            Ok::<_, Error>(buffer)
        };
        let matrix = |m: &QuantMatrix, label: &str| GpuMatrix::upload(gpu, model, m, label, progress);
        let weights = gpu.scoped(
            || {
                let mut layers = Vec::with_capacity(ix.layers.len());
                for (i, l) in ix.layers.iter().enumerate() {
                    layers.push(GpuLayer {
                        input_norm: vec(l.input_norm, "input_norm")?,
                        qkv: matrix(&l.qkv, &format!("layers.{i}.qkv"))?,
                        qk_norm: qk_norm(l)?,
                        o_proj: matrix(&l.o_proj, &format!("layers.{i}.o_proj"))?,
                        post_norm: vec(l.post_norm, "post_norm")?,
                        gate_up: matrix(&l.gate_up, &format!("layers.{i}.gate_up"))?,
                        down: matrix(&l.down, &format!("layers.{i}.down"))?,
                    });
                }
                let mut w = GpuWeights {
                    bytes: 0,
                    format: ix.weights,
                    embed: matrix(&ix.embed, "embed_tokens")?,
                    lm_head: match &ix.lm_head {
                        Some(m) => Some(matrix(m, "lm_head")?),
                        None => None,
                    },
                    layers,
                    final_norm: vec(ix.final_norm, "final_norm")?,
                    staged: std::sync::OnceLock::new(),
                };
                w.bytes = w.buffers().map(|b| b.size()).sum();
                Ok(w)
            },
            |reason| Error::GpuDeviceFailed { reason: format!("uploading weights: {reason}") },
        )?;
        progress.end()?;
        Ok(weights)
    }

    /// The buffer cooperative-matrix prompt batches stage a launch's
    /// weights and inputs in as f16 (made on first call): room for the
    /// largest bound chunk of a layer matrix of at least `min_rows` rows
    /// (the launches that stage), its rows rounded up to a tile, and a
    /// batch of [`PREFILL_BATCH`] inputs of its row length, at 2 bytes a
    /// value (the 0.6B model's gate/up: 12.6 + 0.5 MB; the 4B model's:
    /// 100 + 1.3 MB). Every session of the model shares it: a product
    /// stages its operands and reads them back in one pass, and wgpu orders
    /// passes that write a buffer.
    pub fn staging(&self, gpu: &Gpu, min_rows: u32) -> wgpu::Buffer {
        self.staged
            .get_or_init(|| {
                let bytes = self
                    .layers
                    .iter()
                    .flat_map(|l| l.matrices())
                    .flat_map(|m| m.chunks.iter().map(move |c| (c.rows, m.k_words)))
                    .filter(|(rows, _)| *rows >= min_rows as usize)
                    .map(|(rows, k_words)| crate::kernels::matmul::staged_bytes(rows, k_words, PREFILL_BATCH))
                    .max()
                    .unwrap_or(0);
                gpu.storage("f16 staging", bytes as usize)
            })
            .clone()
    }

    /// Every buffer the weights occupy.
    fn buffers(&self) -> impl Iterator<Item = &wgpu::Buffer> {
        let matrices = std::iter::once(&self.embed)
            .chain(self.lm_head.as_ref())
            .chain(self.layers.iter().flat_map(|l| l.matrices()));
        let vectors = self.layers.iter().flat_map(|l| [&l.input_norm, &l.qk_norm, &l.post_norm]);
        matrices.flat_map(|m| [&m.data, &m.scales]).chain(vectors).chain(std::iter::once(&self.final_norm))
    }

    /// The matrix used as LM head (the embedding when tied).
    pub fn lm_head(&self) -> &GpuMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// A buffer holding the range `r` of `model`, counted as uploaded.
fn upload_range(
    gpu: &Gpu,
    model: &ConvertedModel,
    r: ByteRange,
    label: &str,
    progress: &Progress<'_>,
) -> Result<wgpu::Buffer> {
    let buffer = gpu.storage_init(label, model.bytes(r))?;
    progress.advance(r.len as u64)?;
    Ok(buffer)
}

/// The bytes [`GpuWeights::upload_with`] reports for `ix`: every range of
/// the index once (the embedding once when the LM head is tied to it).
fn upload_bytes(ix: &crate::converted::WeightIndex) -> u64 {
    let matrix = |m: &QuantMatrix| (m.data.len + m.scales.len) as u64;
    let layers: u64 = ix
        .layers
        .iter()
        .map(|l| {
            let norms =
                [l.input_norm, l.q_norm, l.k_norm, l.post_norm].iter().map(|r| r.len as u64).sum::<u64>();
            norms + matrix(&l.qkv) + matrix(&l.o_proj) + matrix(&l.gate_up) + matrix(&l.down)
        })
        .sum();
    matrix(&ix.embed) + ix.lm_head.as_ref().map_or(0, matrix) + layers + ix.final_norm.len as u64
}

/// A loaded model on the GPU: what its sessions share.
pub(crate) struct ModelGpu {
    pub gpu: Gpu,
    pub kernels: Arc<Kernels>,
    pub config: ModelConfig,
    pub weights: GpuWeights,
    /// What identifies the converted weights (see
    /// [`Model::fingerprint`](crate::Model::fingerprint)): a session file
    /// is restored only into a model of the same fingerprint.
    pub fingerprint: crate::fingerprint::WeightsFingerprint,
}
