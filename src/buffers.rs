//! The GPU buffers a session decodes in: the token sequence and the
//! step position, the activations (rows padded to the quant group), the
//! attention and argmax scratch, the RoPE table and the KV cache. The graph
//! (`qwen3`) launches kernels over them; the session owns them.

use crate::config::ModelConfig;
use crate::converted::QUANT_GROUP;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::kernels::{mask, sample, ATTENTION_CHUNK, MATMUL_TOKENS_PER_WG, SAMPLE_CHUNK};
use crate::kv_cache::{KvFormat, KvLayout};

/// Prompt tokens run through the layers together (one launch per kernel
/// for the whole batch; the activation buffers hold this many rows, and the
/// attention partials this many per chunk of the capacity: 8 KiB per
/// position of capacity for the 0.6B model, 7% of its KV cache). 256
/// measured best on the H200 short of 512 (BENCHMARKS.md).
pub const PREFILL_BATCH: usize = 256;
const _: () = assert!(PREFILL_BATCH.is_multiple_of(MATMUL_TOKENS_PER_WG as usize));

/// Buffers of one session.
pub struct SessionBuffers {
    pub(crate) capacity: usize,
    /// Token rows of the activation buffers ([`PREFILL_BATCH`]); decode
    /// uses row 0.
    pub(crate) batch: usize,
    /// The token sequence (u32), `capacity + 1` entries: prompt tokens are
    /// written by the host, the rest by the argmax (`tokens[pos + 1]`).
    pub(crate) tokens: wgpu::Buffer,
    /// `{pos, fill_end}`: the position being processed (advanced by the
    /// argmax) and the first position the argmax may write a token to.
    pub(crate) step: wgpu::Buffer,
    pub(crate) x: wgpu::Buffer,
    /// A prompt batch's last row of x, copied out for the LM head that
    /// predicts the token after the prompt (one row).
    pub(crate) x_last: wgpu::Buffer,
    /// `{pos, fill_end}` of the token choice after a prompt batch, copied
    /// into `step` between the batch and its choice.
    pub(crate) step_last: wgpu::Buffer,
    /// x's f16 copy, two values per word, where the decode matvecs keep it
    /// (`MatvecSplit::x16`).
    pub(crate) x16: wgpu::Buffer,
    pub(crate) qkv: wgpu::Buffer,
    pub(crate) q: wgpu::Buffer,
    pub(crate) attn: wgpu::Buffer,
    pub(crate) h: wgpu::Buffer,
    pub(crate) logits: wgpu::Buffer,
    /// Per-chunk argmax (or sampler draw) results (value, index).
    pub(crate) part_val: wgpu::Buffer,
    pub(crate) part_idx: wgpu::Buffer,
    /// The sampler's per-chunk maxima, select state and histograms.
    pub(crate) sample_scratch: wgpu::Buffer,
    /// A constraint's token mask, one bit per token (`logits_mask`),
    /// written by the host before each constrained step.
    pub(crate) token_mask: wgpu::Buffer,
    /// The log-probabilities' buffers, once asked for
    /// (`Session::set_logprobs`).
    pub(crate) logprobs: Option<LogprobBuffers>,
    /// Chunks of positions attention splits the context into.
    pub(crate) attention_chunks: usize,
    /// Per (head, chunk): softmax max and sum, and the weighted V sum.
    pub(crate) attn_ml: wgpu::Buffer,
    pub(crate) attn_acc: wgpu::Buffer,
    /// RoPE (cos, sin) table, `[capacity][head_dim / 2]`.
    pub(crate) rope: wgpu::Buffer,
    /// Per layer, laid out as `kv_layout` says, at byte `kv_offset` of the
    /// buffer (0, or the session's slot in a batch's pool), `kv_bytes`
    /// long.
    pub(crate) k_cache: Vec<wgpu::Buffer>,
    pub(crate) v_cache: Vec<wgpu::Buffer>,
    pub(crate) kv_offset: u64,
    pub(crate) kv_bytes: u64,
    pub(crate) kv_layout: KvLayout,
}

/// The K and V buffers (one per layer) a session's cache lies in, and
/// where: a batch's pool and the session's slot region.
pub(crate) struct KvRegion {
    pub k: Vec<wgpu::Buffer>,
    pub v: Vec<wgpu::Buffer>,
    /// Byte offset of the region in each buffer.
    pub offset: u64,
    /// Bytes of the region.
    pub bytes: u64,
}

/// Bytes of one layer's K (or V) cache for `capacity` positions in
/// `format`, rounded up to 256 so that regions of a pool start where a
/// binding may (the largest storage-buffer offset alignment wgpu allows).
pub(crate) fn kv_region_bytes(cfg: &ModelConfig, capacity: usize, format: KvFormat) -> u64 {
    KvLayout::new(cfg, capacity, format).bytes().next_multiple_of(256)
}

/// The buffers of the log-probabilities, allocated when first asked for.
pub(crate) struct LogprobBuffers {
    /// The logits before the penalties (copied only when a penalty is on).
    pub(crate) raw_logits: wgpu::Buffer,
    /// One record per token position (`capacity + 1`), written by
    /// `logprob_final` at the chosen token's position.
    pub(crate) records: wgpu::Buffer,
}

impl LogprobBuffers {
    pub(crate) fn new(gpu: &Gpu, cfg: &ModelConfig, capacity: usize) -> Self {
        let words = (capacity + 1) * sample::LOGPROB_RECORD_WORDS as usize;
        LogprobBuffers {
            raw_logits: gpu.storage("raw_logits", 4 * cfg.vocab_size),
            records: gpu.storage("logprob_records", 4 * words),
        }
    }
}

/// `n` rounded up to the quant group: the row length of every activation
/// buffer (a consuming matvec reads its input in whole groups).
pub(crate) fn padded(n: usize) -> usize {
    n.div_ceil(QUANT_GROUP) * QUANT_GROUP
}

impl SessionBuffers {
    /// A session's buffers, its KV cache in buffers of its own or in `kv`.
    pub(crate) fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        capacity: usize,
        kv_format: KvFormat,
        kv: Option<KvRegion>,
    ) -> Result<Self> {
        // Short contexts need no more rows than they have, rounded up to
        // the tiled prefill matvec's tokens per workgroup (it reads and
        // writes whole tiles; the groups of 4 tokens of the per-token
        // matvec and of attention_prefill divide them).
        let batch = PREFILL_BATCH.min(capacity.next_multiple_of(MATMUL_TOKENS_PER_WG as usize));
        let layout = KvLayout::new(cfg, capacity, kv_format);
        Self::build(gpu, cfg, layout, batch, capacity + 1, 1, kv)
    }

    /// The buffers of a batch of sessions' decode steps: `rows` activation
    /// and logits rows, `tokens` holding a word before the rows' tokens
    /// (see `Batch`), and the pool `kv` whole.
    pub(crate) fn for_rows(
        gpu: &Gpu,
        cfg: &ModelConfig,
        capacity: usize,
        kv_format: KvFormat,
        rows: usize,
        kv: KvRegion,
    ) -> Result<Self> {
        let layout = KvLayout::new(cfg, capacity, kv_format);
        Self::build(gpu, cfg, layout, rows, rows + 1, rows, Some(kv))
    }

    fn build(
        gpu: &Gpu,
        cfg: &ModelConfig,
        kv_layout: KvLayout,
        batch: usize,
        token_words: usize,
        logit_rows: usize,
        kv: Option<KvRegion>,
    ) -> Result<Self> {
        let f = |label: &str, n: usize| gpu.storage(label, 4 * n);
        let capacity = kv_layout.capacity;
        let chunks = capacity.div_ceil(ATTENTION_CHUNK as usize);
        let rows = |n: usize| batch * padded(n);
        let kv = kv.unwrap_or_else(|| {
            let bytes = kv_layout.bytes().next_multiple_of(4);
            let own =
                |label| (0..cfg.num_hidden_layers).map(|_| gpu.storage(label, bytes as usize)).collect();
            KvRegion { k: own("k_cache"), v: own("v_cache"), offset: 0, bytes }
        });
        let parts = sample::part_slots(cfg.vocab_size as u32, SAMPLE_CHUNK);
        Ok(SessionBuffers {
            capacity,
            batch,
            tokens: f("tokens", token_words),
            step: f("step", 2),
            // Rows are padded to the quant group; the padding stays zero.
            x: f("x", rows(cfg.hidden_size)),
            x_last: f("x_last", padded(cfg.hidden_size)),
            step_last: f("step_last", 2),
            x16: f("x16", rows(cfg.hidden_size) / 2),
            qkv: f("qkv", rows(cfg.qkv_rows())),
            q: f("q", batch * cfg.q_dim()),
            attn: f("attn", rows(cfg.q_dim())),
            h: f("h", rows(cfg.intermediate_size)),
            logits: f("logits", logit_rows * cfg.vocab_size),
            part_val: f("part_val", logit_rows * parts),
            part_idx: f("part_idx", logit_rows * parts),
            sample_scratch: f("sample_scratch", sample::scratch_words(cfg.vocab_size as u32, SAMPLE_CHUNK)),
            token_mask: f("token_mask", mask::words(cfg.vocab_size as u32)),
            logprobs: None,
            attention_chunks: chunks,
            attn_ml: f("attn_ml", batch * 2 * cfg.num_attention_heads * chunks),
            attn_acc: f("attn_acc", batch * cfg.num_attention_heads * chunks * cfg.head_dim),
            rope: gpu.storage_init(
                "rope",
                bytemuck::cast_slice(&rope_table(cfg.head_dim, capacity, cfg.rope_theta)),
            )?,
            k_cache: kv.k,
            v_cache: kv.v,
            kv_offset: kv.offset,
            kv_bytes: kv.bytes,
            kv_layout,
        })
    }

    /// Bytes of every buffer (of the caches, the session's region).
    pub(crate) fn bytes(&self) -> u64 {
        let fixed = [
            &self.tokens,
            &self.step,
            &self.x,
            &self.x_last,
            &self.step_last,
            &self.x16,
            &self.qkv,
            &self.q,
            &self.attn,
            &self.h,
            &self.logits,
            &self.part_val,
            &self.part_idx,
            &self.sample_scratch,
            &self.token_mask,
            &self.attn_ml,
            &self.attn_acc,
            &self.rope,
        ];
        let logprobs = self.logprobs.iter().flat_map(|l| [&l.raw_logits, &l.records]);
        let caches = (self.k_cache.len() + self.v_cache.len()) as u64 * self.kv_bytes;
        fixed.into_iter().chain(logprobs).map(|buf| buf.size()).sum::<u64>() + caches
    }
}

/// RoPE's (cos, sin) for every position below `capacity` and frequency
/// `d < head_dim / 2` (angle `pos * theta^(-2d/head_dim)`), computed in f64.
pub fn rope_table(head_dim: usize, capacity: usize, theta: f32) -> Vec<f32> {
    let half = head_dim / 2;
    let mut t = Vec::with_capacity(capacity * head_dim);
    for pos in 0..capacity {
        for d in 0..half {
            let a = pos as f64 * (theta as f64).powf(-((2 * d) as f64) / head_dim as f64);
            t.push(a.cos() as f32);
            t.push(a.sin() as f32);
        }
    }
    t
}
