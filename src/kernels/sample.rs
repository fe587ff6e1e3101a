//! The sampler family: sampling with temperature, top-k, top-p, min-p and
//! penalties inside the decode step, in place of the argmax launches, so
//! steps still queue ahead and the host never reads logits.
//!
//! Launches, in order (only those the parameters need, see
//! `crate::sampling::plan`):
//! `sample_penalty` (one workgroup: the penalties, in place on the logits),
//! `sample_max` (per-chunk maxima: M, for top-p's masses and min-p),
//! `sample_select` passes (radix select of top-k's, then top-p's threshold,
//! 8 bits of the logits' sort key per pass, four passes per filter; each
//! pass's workgroups reduce the previous pass's per-chunk histograms
//! themselves), the drawing `sample_select` pass (Gumbel-max over the kept
//! logits, keyed by seed, position and token id), then `argmax_final`,
//! which writes the token and advances the position as in greedy decoding.
//!
//! With top-k on and `k <= SAMPLE_TOP_K_MAX` (Qwen3's own top_k 20, and
//! the usual 40, 50 and 100), the token choice takes two launches instead
//! (each GPU launch costs microseconds of fixed latency; the data is small):
//! `sample_topk` (each chunk's exact top-k candidates) and
//! `sample_topk_final` (one workgroup: the merge, top-p, min-p, the same
//! draw, the token and the position). The log-probabilities
//! (`logprob_final`) reuse `sample_topk` with k = N.
//! The kernels run as WGSL on every backend (no MSL twins: the self-check
//! runs them like the others).

use super::abi::gpu_struct;
use super::{Bind, ARGMAX_CHUNK};

gpu_struct! {
    /// The uniform of every sampler kernel.
    "Params" pub struct SampleParams {
        /// Logits (the vocabulary).
        pub n: u32,
        /// Logits per workgroup of `sample_max` and `sample_select`.
        pub chunk: u32,
        /// Workgroups of those launches (chunks).
        pub parts: u32,
        /// Which `sample_select` pass this is (`passes`: the draw).
        pub select_pass: u32,
        /// Select passes before the draw.
        pub passes: u32,
        /// Select passes of top-k (0 or 4; top-p's follow).
        pub k_passes: u32,
        /// Top-k's k (when on).
        pub top_k: u32,
        /// Top-p's p (when on).
        pub top_p: f32,
        /// 1 when min-p is on.
        pub min_p_on: u32,
        /// T ln(min_p): min-p keeps logits at least M plus this.
        pub min_p_offset: f32,
        /// T (> 0).
        pub temperature: f32,
        /// The seed, low and high 32 bits.
        pub seed_lo: u32,
        pub seed_hi: u32,
        /// Repetition penalty (1: off).
        pub repetition_penalty: f32,
        /// Presence penalty (0: off).
        pub presence_penalty: f32,
        /// Frequency penalty (0: off).
        pub frequency_penalty: f32,
        /// Tokens of the penalty window.
        pub window: u32,
        /// Length of `tokens` (capacity + 1).
        pub n_tokens: u32,
        /// 1 when `sample_max` ran (M is needed).
        pub need_max: u32,
    }
}

gpu_struct! {
    /// The uniform of `sample_topk`, `sample_topk_final` and `logprob_final`.
    "Params" pub struct TopkParams {
        /// Logits (the vocabulary).
        pub n: u32,
        /// Logits per `sample_topk` workgroup (at most 16 x WG).
        pub chunk: u32,
        /// `sample_topk`'s workgroups (chunks).
        pub parts: u32,
        /// Candidates per chunk (top-k's k, or N of the log-probabilities).
        pub k: u32,
        /// First word of the chunks' records in the scratch buffer.
        pub region: u32,
        /// `sample_topk`: bit 0 writes each chunk's maximum and sum of
        /// exponentials, bit 1 copies the logits to `raw`.
        pub flags: u32,
        /// T (> 0).
        pub temperature: f32,
        /// Top-p's p.
        pub top_p: f32,
        /// 1 when top-p is on.
        pub top_p_on: u32,
        /// 1 when min-p is on.
        pub min_p_on: u32,
        /// T ln(min_p): min-p keeps logits at least M plus this.
        pub min_p_offset: f32,
        /// The seed, low and high 32 bits.
        pub seed_lo: u32,
        pub seed_hi: u32,
        /// Length of `tokens` (capacity + 1).
        pub n_tokens: u32,
        /// Words of one log-probability record.
        pub record_words: u32,
    }
}

/// What the merging kernels (`sample_topk_final`, `logprob_final`) share
/// in WGSL, after [`SAMPLE_COMMON`].
pub const SAMPLE_MERGE: &str = include_str!("../../kernels/wgsl/sample_merge.wgsl");

/// The largest top-k the two-launch path takes (larger ones take the radix
/// path): the merge gathers and sorts the top entries in workgroup memory,
/// one per invocation. Covers the usual settings (Qwen3's 20, 40, 50, 100).
pub const SAMPLE_TOP_K_MAX: u32 = super::abi::SAMPLE_TOP_K_MAX;
const _: () = assert!(SAMPLE_TOP_K_MAX <= super::WG);

/// The most logits one `sample_topk` workgroup takes (each invocation holds
/// at most 16 sort keys in registers).
pub const TOPK_MAX_CHUNK: u32 = 16 * super::WG;

/// `sample_topk`'s `flags`: the chunk's maximum and sum of exponentials.
pub const TOPK_STATS: u32 = 1;
/// `sample_topk`'s `flags`: copy the logits to `raw`.
pub const TOPK_COPY_RAW: u32 = 2;

/// The most log-probabilities per token (OpenAI's bound).
pub const MAX_LOGPROBS: u32 = 20;

/// Words of one log-probability record (`logprob_final`): the chosen
/// token and its log-probability, the entry count, a spare word, then
/// (token, log-probability) per entry.
pub const LOGPROB_RECORD_WORDS: u32 = 4 + 2 * MAX_LOGPROBS;

/// Binding order of `sample_topk`: params, logits, scratch, raw.
pub const TOPK_BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];

/// Binding order of `sample_topk_final`: params, logits, scratch, tokens,
/// step.
pub const TOPK_FINAL_BINDINGS: &[Bind] =
    &[Bind::Uniform, Bind::Read, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];

/// Binding order of `logprob_final`: params, src (the logits before the
/// penalties), scratch, tokens, step, records.
pub const LOGPROB_FINAL_BINDINGS: &[Bind] =
    &[Bind::Uniform, Bind::Read, Bind::Read, Bind::Read, Bind::Read, Bind::ReadWrite];

/// Words of the chunk records of `sample_topk` with `k` candidates each.
pub fn topk_words(n: u32, chunk: u32, k: u32) -> usize {
    parts(n, chunk) as usize * (8 + 2 * k as usize)
}

/// Where the log-probabilities' chunk records start in the scratch buffer
/// (after the radix path's and the top-k path's, which a step may also
/// run).
pub fn logprob_region(n: u32, chunk: u32) -> usize {
    radix_words(n, chunk).max(topk_words(n, chunk, SAMPLE_TOP_K_MAX))
}

/// What the sampler kernels share in WGSL: the logits' sort key and the
/// counter-based draw.
pub const SAMPLE_COMMON: &str = include_str!("../../kernels/wgsl/sample_common.wgsl");

/// Logits per `sample_max` / `sample_select` workgroup in a session: 38
/// workgroups over Qwen3's 151,936 logits. Every workgroup of a select pass
/// reads every workgroup's histogram of the pass before, so that traffic
/// grows with the square of the workgroups (38: 38 x 38 x 3 KiB = 4.4 MB
/// of cached reads per top-p pass, 17 MB at 2,048 per workgroup), while a
/// workgroup's histogram atomics serialise where its logits share a bin.
pub const SAMPLE_CHUNK: u32 = 4096;

/// Bins of one radix-select digit (8 bits).
pub const SELECT_BINS: u32 = 256;

// `sample_select` gives each invocation one bin.
const _: () = assert!(super::WG == SELECT_BINS);

/// Select passes per threshold (32-bit keys, 8 bits per pass).
pub const PASSES_PER_FILTER: u32 = 4;

/// Words of `sample_select`'s state slots (8 words, one slot per pass).
const STATE_WORDS: u32 = 9 * 8;

/// Binding order of `sample_penalty`: params, tokens, step, logits.
pub const PENALTY_BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::Read, Bind::ReadWrite];

/// Binding order of `sample_max`: params, logits, scratch.
pub const MAX_BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::ReadWrite];

/// Binding order of `sample_select`: params, logits, scratch, step,
/// part_val, part_idx.
pub const SELECT_BINDINGS: &[Bind] =
    &[Bind::Uniform, Bind::Read, Bind::ReadWrite, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];

/// Chunks (workgroups) of the chunked sampler launches over `n` logits.
pub fn parts(n: u32, chunk: u32) -> u32 {
    n.div_ceil(chunk)
}

/// u32 words of the radix path's scratch over `n` logits: the per-chunk
/// maxima, the state slots, and two regions of per-chunk histograms
/// (count, mass low and high word per bin).
fn radix_words(n: u32, chunk: u32) -> usize {
    let parts = parts(n, chunk) as usize;
    parts + STATE_WORDS as usize + 2 * parts * SELECT_BINS as usize * 3
}

/// u32 words of the sampler's scratch buffer over `n` logits: the radix
/// path's or the top-k path's records (from word 0), then the
/// log-probabilities' records ([`logprob_region`]).
pub fn scratch_words(n: u32, chunk: u32) -> usize {
    logprob_region(n, chunk) + topk_words(n, chunk, MAX_LOGPROBS)
}

/// Part slots (`part_val` / `part_idx` entries) the token choice needs:
/// the argmax's or the sampler's, whichever is more.
pub fn part_slots(n: u32, chunk: u32) -> usize {
    parts(n, ARGMAX_CHUNK).max(parts(n, chunk)) as usize
}
