//! The Qwen3 decoder forward pass for one token, as the list of kernel
//! launches the GPU runs in order (mirrors mlx-lm's `qwen3.py`):
//!
//! ```text
//! x = embed(token)
//! for each layer:
//!     q, k, v = split(qkv_proj(rms_norm(x, input_norm)))     # norm fused into the matvec
//!     q, k = rope(rms_norm(q, q_norm)), rope(rms_norm(k, k_norm)); cache k, v   # } one launch at
//!     attn = attention(q, k_cache, v_cache)                                      # } short contexts
//!     x += o_proj(attn)                                      # add fused into the matvec
//!     h = silu(gate) * up, [gate; up] = gate_up_proj(rms_norm(x, post_attention_norm))   # one launch
//!     x += down(h)
//! token = argmax(lm_head(rms_norm(x, norm)))   # on the GPU; feeds the next step
//!                                              # (or sampled: see kernels::sample)
//! ```
//! Built once per session. The position lives on the GPU (`step`, advanced
//! by the argmax), so steps can be queued without the host reading anything
//! in between; the host still knows each queued step's position, which
//! picks the attention launches (one chunk: one launch; more: the chunks,
//! then their reduce). Prompt batches run the layers with the q/k norm,
//! RoPE and cache write as a launch of their own (a token's attention reads
//! the K/V the batch's other tokens write); the last batch of a prompt
//! then runs the LM head over its last row and the token choice.

mod builder;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::bytes_of;

pub use crate::buffers::rope_table;
use crate::buffers::{padded, SessionBuffers};
use crate::config::ModelConfig;
use crate::converted::WeightFormat;
use crate::error::Result;
use crate::gpu::{Gpu, UniformPages};
use crate::gpu_weights::{GpuMatrix, GpuWeights};
use crate::kernels::argmax::{self, ArgmaxFinalParams, ArgmaxPartialParams};
use crate::kernels::attention;
use crate::kernels::{
    grid, Kernel, Kernels, Launch, LaunchKind, MatvecShape, MatvecSplit, ARGMAX_CHUNK, ATTENTION_CHUNK,
    SAMPLE_CHUNK,
};
use crate::sampling::SamplingParams;
use builder::{whole, Builder, Matvec};

/// One launch of the decode step, or the attention of one layer, whose
/// launches depend on the step's position.
// Built once per session, ~150 of them: boxing the larger variant would
// save little memory and add an indirection per recorded launch.
#[allow(clippy::large_enum_variant)]
enum StepLaunch {
    Always(Launch),
    /// `direct` when the context (position + 1) fits one chunk of
    /// [`ATTENTION_CHUNK`] positions; otherwise `chunks` (`packed` from
    /// the session's packing start on, where it has one), then `reduce`.
    Attention {
        direct: Launch,
        chunks: Launch,
        packed: Option<Launch>,
        reduce: Launch,
    },
}

/// The launches of one decode step, and those running the embedding and
/// the decoder layers for a batch of prompt tokens
/// (`Launch::record_batch`: token z of the batch in grid z, at position
/// `step.pos + z`).
pub struct Forward {
    /// The step up to the logits.
    step: Vec<StepLaunch>,
    /// The launches choosing the token from the logits (greedy, or the
    /// sampler's: see [`choose_launches`]), replaced when the sampling
    /// parameters change.
    pub choose: Vec<Launch>,
    /// The launches of a prompt batch, in order (shared with the
    /// session's recorder thread).
    pub prefill: std::sync::Arc<Vec<Launch>>,
    /// The LM head over a prompt batch's last row (copied to `x_last`):
    /// with `choose` after it, the token after the prompt, so a prompt
    /// needs no decode step at its last position. `None` where its f32
    /// pipeline could not be built and proven on a device whose decode
    /// steps read an f16 copy of x (the general pipeline would read
    /// `x_last` as f16): prompts then end with a decode step.
    pub last_row_head: Option<std::sync::Arc<Vec<Launch>>>,
    /// Bytes of the buffers holding the parameters of every launch but
    /// `choose`.
    pub uniform_bytes: u64,
    /// Bytes of the buffers holding `choose`'s parameters.
    pub choose_uniform_bytes: u64,
    /// The first position whose attention runs two query heads a workgroup
    /// (`HeadParams::pack_from`); `None`: no step does.
    pack_from: Option<usize>,
}

impl Forward {
    /// The decode step at position `pos`, in order.
    pub fn step_at(&self, pos: usize) -> impl Iterator<Item = &Launch> + '_ {
        let one_chunk = pos < ATTENTION_CHUNK as usize;
        let packs = self.pack_from.is_some_and(|from| pos >= from);
        let layers = self.step.iter().flat_map(move |l| {
            let (first, then) = match l {
                StepLaunch::Always(l) => (l, None),
                StepLaunch::Attention { direct, .. } if one_chunk => (direct, None),
                StepLaunch::Attention { packed: Some(packed), reduce, .. } if packs => (packed, Some(reduce)),
                StepLaunch::Attention { chunks, reduce, .. } => (chunks, Some(reduce)),
            };
            std::iter::once(first).chain(then)
        });
        layers.chain(&self.choose)
    }

    /// The first position whose step runs two query heads a workgroup (its
    /// attention launches differ from the position before's); `None`: no
    /// step does.
    pub fn pack_from(&self) -> Option<usize> {
        self.pack_from
    }
}

/// The pipeline running decode attention two query heads a workgroup from
/// the packing start on ([`Kernels::attention_packed_pipeline`]), for the
/// steps over `s`: where its capacity reaches that start and the query
/// heads of a KV head come in pairs; `None` otherwise, or where there is
/// none (the unpacked launches serve).
fn packed_attention(
    gpu: &Gpu,
    kernels: &Kernels,
    cfg: &ModelConfig,
    s: &SessionBuffers,
) -> Option<wgpu::ComputePipeline> {
    let reaches = s.capacity > kernels.attention_pack_from as usize;
    let pairs = attention::heads_per_workgroup(cfg.num_attention_heads, cfg.num_key_value_heads) == 2;
    (reaches && pairs).then(|| kernels.attention_packed_pipeline(gpu, s.kv_layout.format)).flatten()
}

/// Builds the launches of one decode step and of a prompt batch over
/// `weights` and the session buffers `s`.
pub fn forward(
    gpu: &Gpu,
    kernels: &Kernels,
    cfg: &ModelConfig,
    weights: &GpuWeights,
    s: &SessionBuffers,
) -> Forward {
    use Matvec::{Accumulate, Normed, NormedSwiglu};
    // Cooperative-matrix prompt batches stage their operands as f16 in the
    // model's buffer (one launch's weights and inputs at a time).
    let staging = kernels.coop.then(|| weights.staging(gpu, kernels.coop_min_rows));
    let b = Builder { gpu, kernels, cfg, s, uniforms: RefCell::new(UniformPages::new(gpu)), staging };
    let always = |v: Vec<Launch>| v.into_iter().map(StepLaunch::Always);
    let packed_pipeline = packed_attention(gpu, kernels, cfg, s);
    let embed = b.embed(&weights.embed, &s.step);
    let mut step: Vec<StepLaunch> = always(embed.clone()).collect();
    let mut prefill = embed;
    for (l, layer) in weights.layers.iter().enumerate() {
        let norms = &layer.qk_norm;
        let qkv = b.matvec(&layer.qkv, &s.x, &s.qkv, Normed(&layer.input_norm));
        let mlp = [
            b.matvec(&layer.o_proj, &s.attn, &s.x, Accumulate),
            b.matvec(&layer.gate_up, &s.x, &s.h, NormedSwiglu(&layer.post_norm)),
            b.matvec(&layer.down, &s.h, &s.x, Accumulate),
        ]
        .concat();
        // A prompt batch: q/k norm, RoPE and the cache write for the whole
        // batch first, then attention.
        prefill.extend(qkv.iter().cloned());
        prefill.push(b.qk_norm_rope(norms, l));
        let reduce = b.attention_reduce(); // the same launch for both
        prefill.push(b.attention(Kernel::AttentionPartial, norms, l));
        prefill.push(reduce.clone());
        prefill.extend(mlp.iter().cloned());
        // A decode step: the norm and RoPE folded into attention.
        step.extend(always(qkv));
        let chunks = b.attention(Kernel::AttentionStep, norms, l);
        let packed = packed_pipeline.as_ref().map(|p| {
            let mut packed = chunks.clone();
            packed.decode_pipeline = Some(p.clone());
            packed
        });
        step.push(StepLaunch::Attention {
            direct: b.attention(Kernel::AttentionStepDirect, norms, l),
            chunks,
            packed,
            reduce,
        });
        step.extend(always(mlp));
    }
    step.extend(always(b.matvec(weights.lm_head(), &s.x, &s.logits, Normed(&weights.final_norm))));
    let last_row_head =
        Some(b.matvec_f32_input(weights.lm_head(), &s.x_last, &s.logits, Normed(&weights.final_norm)))
            .filter(|head| !kernels.matvec_layout.x16() || head.iter().all(|l| l.decode_pipeline.is_some()))
            .map(std::sync::Arc::new);
    let uniform_bytes = b.uniforms.borrow().bytes();
    let (choose, choose_uniform_bytes) =
        choose_launches(gpu, kernels, cfg, s, &SamplingParams::default(), 0, false);
    Forward {
        step,
        choose,
        prefill: std::sync::Arc::new(prefill),
        last_row_head,
        uniform_bytes,
        choose_uniform_bytes,
        pack_from: packed_pipeline.is_some().then_some(kernels.attention_pack_from as usize),
    }
}

/// One launch of a batch step (see [`BatchForward`]).
// As `StepLaunch`: ~150 per batch, boxing would add an indirection per
// recorded launch for little memory.
#[allow(clippy::large_enum_variant)]
enum RowLaunch {
    /// A matvec: each workgroup runs every row (the pipeline for the row
    /// count is picked at record time from the launch's shape).
    Matvec { launch: Launch, shape: MatvecShape },
    /// Row z in grid z.
    Grid(Launch),
    /// A layer's attention: `chunks` then `reduce` for the rows past one
    /// chunk of positions, then `direct` for the rows within one (each row
    /// runs the launches its session's step alone would).
    Attention { direct: Launch, chunks: Launch, reduce: Launch },
}

/// The launches of one decode step of a batch of sessions (the rows), over
/// the batch's buffers: the layer matvecs read each matrix once for every
/// row, attention reads each row's own KV region at its own position, and
/// the argmax writes each row's greedy token. Each row's arithmetic is that
/// of its session's step alone, so its tokens are the same.
pub struct BatchForward {
    launches: Vec<RowLaunch>,
    /// Rows the batch's buffers hold (its slots): a step of fewer rows may
    /// run a larger count's matvec pipelines, up to this many.
    max_rows: u32,
    /// Matvec launches recorded so far through a larger count's pipeline,
    /// and through the one-token pipeline once per row (see
    /// [`BatchForward::record`]): for tests and the frame loop's report.
    padded_launches: AtomicU64,
    per_row_launches: AtomicU64,
    /// Bytes of the buffers holding the launches' parameters.
    pub uniform_bytes: u64,
}

/// A step of `rows` rows whose own count's matvec pipeline is not built
/// may run a larger count's (`ready` tells which are built) up to
/// `max_rows`, the extra rows computing values nobody reads: every row of
/// a batched pipeline computes exactly what the one-token pipeline
/// computes (each is proven so), so the real rows' bits do not change.
/// The smallest such count, where it costs less than a pass over the
/// weights per row: at most [`PADDED_ROWS_PER_ROW`] times the rows (a
/// batched launch costs about one one-token launch per 4 rows, BENCHMARKS.md
/// 2026-12-06 03:54); `None`: the rows run one at a time.
pub fn padded_rows(rows: u32, max_rows: u32, ready: impl Fn(u32) -> bool) -> Option<u32> {
    if rows < 2 {
        return None;
    }
    let most = max_rows.min(rows.saturating_mul(PADDED_ROWS_PER_ROW));
    (rows + 1..=most).find(|&r| ready(r))
}

/// How many times its rows a step may run in a larger count's pipeline
/// ([`padded_rows`]).
pub const PADDED_ROWS_PER_ROW: u32 = 4;

impl BatchForward {
    /// Records one step of `rows` rows; `short` / `long`: whether any row's
    /// context fits one chunk of positions / needs more.
    /// `wait`: a rows pipeline not built yet is built now; otherwise its
    /// build starts on another thread and this step runs the decode
    /// pipeline over a grid of rows (the same results).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        gpu: &Gpu,
        kernels: &Kernels,
        rows: u32,
        short: bool,
        long: bool,
        wait: bool,
    ) {
        self.record_each(pass, gpu, kernels, rows, short, long, wait, &mut |_, _| {});
    }

    /// [`Self::record`], calling `after` after each launch with its kind
    /// (the profiler writes a timestamp there).
    #[allow(clippy::too_many_arguments)]
    pub fn record_each(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        gpu: &Gpu,
        kernels: &Kernels,
        rows: u32,
        short: bool,
        long: bool,
        wait: bool,
        after: &mut dyn FnMut(&mut wgpu::ComputePass<'_>, LaunchKind),
    ) {
        for l in &self.launches {
            match l {
                RowLaunch::Matvec { launch, shape } => {
                    let split = launch.matvec_split.expect("a matvec launch has a split");
                    let (kernel, format) = (launch.kernel, launch.format);
                    let mut run = rows;
                    let mut all_rows = if wait {
                        kernels.matvec_rows_pipeline(gpu, kernel, split, *shape, format, rows)
                    } else {
                        kernels.matvec_rows_pipeline_or_start(gpu, kernel, split, *shape, format, rows)
                    };
                    if all_rows.is_none() && rows > 1 {
                        let built = |r| kernels.built_rows_pipeline(kernel, split, *shape, format, r);
                        all_rows = padded_rows(rows, self.max_rows, |r| built(r).is_some()).and_then(|r| {
                            run = r;
                            built(r)
                        });
                        let counter =
                            if all_rows.is_some() { &self.padded_launches } else { &self.per_row_launches };
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    launch.record_rows(pass, all_rows.as_ref(), run);
                    after(pass, launch.kind());
                }
                RowLaunch::Grid(launch) => {
                    launch.record_rows(pass, None, rows);
                    after(pass, launch.kind());
                }
                RowLaunch::Attention { direct, chunks, reduce } => {
                    if long {
                        chunks.record_rows(pass, None, rows);
                        after(pass, chunks.kind());
                        reduce.record_rows(pass, None, rows);
                        after(pass, reduce.kind());
                    }
                    if short {
                        direct.record_rows(pass, None, rows);
                        after(pass, direct.kind());
                    }
                }
            }
        }
    }

    /// Matvec launches recorded so far through a larger count's pipeline
    /// and, one launch a row, through the one-token pipeline (both while
    /// a step's own count's pipeline was not built yet).
    pub fn stand_in_launches(&self) -> (u64, u64) {
        (self.padded_launches.load(Ordering::Relaxed), self.per_row_launches.load(Ordering::Relaxed))
    }

    /// What picks each matvec launch's batched-row pipeline (kernel,
    /// split, shape, weight format), each once: the pipelines a step of
    /// some number of rows needs, with that number.
    pub fn matvec_specs(&self) -> Vec<(Kernel, MatvecSplit, MatvecShape, WeightFormat)> {
        let mut specs = Vec::new();
        for l in &self.launches {
            if let RowLaunch::Matvec { launch, shape } = l {
                let split = launch.matvec_split.expect("a matvec launch has a split");
                let spec = (launch.kernel, split, *shape, launch.format);
                if !specs.contains(&spec) {
                    specs.push(spec);
                }
            }
        }
        specs
    }

    /// Launches one step of `rows` rows records (as [`Self::record`]).
    pub fn launch_count(&self, short: bool, long: bool) -> usize {
        self.launches
            .iter()
            .map(|l| match l {
                RowLaunch::Attention { .. } => 2 * long as usize + short as usize,
                _ => 1,
            })
            .sum()
    }
}

/// Builds the launches of a batch step over the batch's buffers `s`
/// (`SessionBuffers::for_rows`): `rows` holds each row's position and KV
/// offset (see `attention_common.wgsl`), `embed_step` the step whose
/// position the embedding adds to the row index (see `crate::session::batch`).
pub fn batch_forward(
    gpu: &Gpu,
    kernels: &Kernels,
    cfg: &ModelConfig,
    weights: &GpuWeights,
    s: &SessionBuffers,
    rows: &wgpu::Buffer,
    embed_step: &wgpu::Buffer,
) -> Result<BatchForward> {
    use Matvec::{Accumulate, Normed, NormedSwiglu};
    let b = Builder { gpu, kernels, cfg, s, uniforms: RefCell::new(UniformPages::new(gpu)), staging: None };
    let matvec = |w: &GpuMatrix, x, y, what: Matvec<'_>, stride| {
        b.matvec_strided(w, x, y, what, stride)
            .into_iter()
            .map(|(launch, shape)| RowLaunch::Matvec { launch, shape })
    };
    let mut launches: Vec<RowLaunch> =
        b.embed(&weights.embed, embed_step).into_iter().map(RowLaunch::Grid).collect();
    let out_stride = padded(cfg.q_dim()) as u32;
    // Rows from the packing start on run two query heads a workgroup (the
    // kernel decides by each row's position), as their sessions' steps
    // alone do (packing changes no bits either way).
    let packs = packed_attention(gpu, kernels, cfg, s).is_some();
    for (l, layer) in weights.layers.iter().enumerate() {
        let norms = &layer.qk_norm;
        launches.extend(matvec(&layer.qkv, &s.x, &s.qkv, Normed(&layer.input_norm), padded(layer.qkv.rows)));
        let attention = |kernel, packed| -> Result<Launch> {
            let mut l = b.attention_with_step(kernel, norms, l, rows);
            l.decode_pipeline =
                Some(kernels.attention_rows_pipeline(gpu, kernel, out_stride, s.kv_layout.format, packed)?);
            Ok(l)
        };
        launches.push(RowLaunch::Attention {
            direct: attention(Kernel::AttentionStepDirect, false)?,
            chunks: attention(Kernel::AttentionStep, packs)?,
            reduce: b.attention_reduce(),
        });
        launches.extend(matvec(&layer.o_proj, &s.attn, &s.x, Accumulate, padded(layer.o_proj.rows)));
        let h_stride = padded(layer.gate_up.rows / 2);
        launches.extend(matvec(&layer.gate_up, &s.x, &s.h, NormedSwiglu(&layer.post_norm), h_stride));
        launches.extend(matvec(&layer.down, &s.h, &s.x, Accumulate, padded(layer.down.rows)));
    }
    // Logits rows are vocab_size apart, as the argmax reads them.
    let vocab = cfg.vocab_size as u32;
    launches.extend(matvec(weights.lm_head(), &s.x, &s.logits, Normed(&weights.final_norm), vocab as usize));
    let parts = argmax::parts(vocab, ARGMAX_CHUNK);
    let partial = ArgmaxPartialParams { n: vocab, chunk: ARGMAX_CHUNK };
    let bufs = [whole(&s.logits), whole(&s.part_val), whole(&s.part_idx)];
    launches.push(RowLaunch::Grid(b.launch(Kernel::ArgmaxPartial, bytes_of(&partial), &bufs, grid(parts))));
    let last = ArgmaxFinalParams { n: parts, n_tokens: (s.batch + 1) as u32 };
    let bufs = [whole(&s.part_val), whole(&s.part_idx), whole(&s.tokens), whole(&s.step)];
    launches.push(RowLaunch::Grid(b.launch(Kernel::ArgmaxFinal, bytes_of(&last), &bufs, argmax::FINAL_GRID)));
    let uniform_bytes = b.uniforms.borrow().bytes();
    Ok(BatchForward {
        launches,
        max_rows: s.batch as u32,
        padded_launches: AtomicU64::new(0),
        per_row_launches: AtomicU64::new(0),
        uniform_bytes,
    })
}

/// The launches that choose the next token from the logits under `params`
/// ([`crate::sampling::plan`]: the argmax when greedy), with the
/// log-probabilities of the `logprobs` most likely tokens when not 0 (the
/// session's logprob buffers must exist then), over the session buffers
/// `s`, and the bytes of their parameter buffers.
pub fn choose_launches(
    gpu: &Gpu,
    kernels: &Kernels,
    cfg: &ModelConfig,
    s: &SessionBuffers,
    params: &SamplingParams,
    logprobs: u32,
    masked: bool,
) -> (Vec<Launch>, u64) {
    let b = Builder { gpu, kernels, cfg, s, uniforms: RefCell::new(UniformPages::new(gpu)), staging: None };
    let n_tokens = (s.capacity + 1) as u32;
    let n = cfg.vocab_size as u32;
    // The logits before the penalties: their copy when a penalty edits
    // them. `sample_topk` writes `raw` only then; otherwise an unused
    // buffer stands in.
    let lp = s.logprobs.as_ref();
    let raw = lp.map_or(&s.part_val, |l| &l.raw_logits);
    let src = if params.has_penalties() { raw } else { &s.logits };
    // A constraint's mask goes first: every later launch sees -inf for
    // the tokens it forbids.
    let mask = masked.then(|| {
        let bufs = [whole(&s.token_mask), whole(&s.logits)];
        b.launch(
            Kernel::LogitsMask,
            bytes_of(&crate::kernels::mask::params(n)),
            &bufs,
            crate::kernels::mask::grid(n),
        )
    });
    let chosen = crate::sampling::plan_with_logprobs(params, n, n_tokens, SAMPLE_CHUNK, logprobs)
        .into_iter()
        .map(|l| {
            let bufs = match l.kernel {
                Kernel::ArgmaxPartial => vec![whole(&s.logits), whole(&s.part_val), whole(&s.part_idx)],
                Kernel::ArgmaxFinal => {
                    vec![whole(&s.part_val), whole(&s.part_idx), whole(&s.tokens), whole(&s.step)]
                }
                Kernel::SamplePenalty => vec![whole(&s.tokens), whole(&s.step), whole(&s.logits)],
                Kernel::SampleMax => vec![whole(&s.logits), whole(&s.sample_scratch)],
                Kernel::SampleSelect => vec![
                    whole(&s.logits),
                    whole(&s.sample_scratch),
                    whole(&s.step),
                    whole(&s.part_val),
                    whole(&s.part_idx),
                ],
                Kernel::SampleTopk => vec![whole(&s.logits), whole(&s.sample_scratch), whole(raw)],
                Kernel::SampleTopkFinal => {
                    vec![whole(&s.logits), whole(&s.sample_scratch), whole(&s.tokens), whole(&s.step)]
                }
                Kernel::LogprobFinal => vec![
                    whole(src),
                    whole(&s.sample_scratch),
                    whole(&s.tokens),
                    whole(&s.step),
                    whole(&lp.expect("logprob buffers before logprob launches").records),
                ],
                other => unreachable!("{other:?} chooses no token"),
            };
            b.launch(l.kernel, &l.params, &bufs, l.workgroups)
        });
    let launches = mask.into_iter().chain(chosen).collect();
    let bytes = b.uniforms.borrow().bytes();
    (launches, bytes)
}
