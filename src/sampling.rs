//! Sampling parameters: temperature, top-k, top-p, min-p, penalties over a
//! window of recent tokens, and a seed. The sampling itself runs on the GPU
//! inside each decode step (see the sampler kernels,
//! `src/kernels/sample.rs`).

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::kernels::argmax::{self, ArgmaxFinalParams, ArgmaxPartialParams};
use crate::kernels::sample::{
    logprob_region, LOGPROB_RECORD_WORDS, MAX_LOGPROBS, TOPK_COPY_RAW, TOPK_MAX_CHUNK, TOPK_STATS,
};
use crate::kernels::{
    grid, sample, Kernel, SampleParams, TopkParams, ARGMAX_CHUNK, MAX_PENALTY_WINDOW, SAMPLE_TOP_K_MAX,
};

/// How the next token is chosen from the logits: greedy (temperature 0,
/// the default) or sampled. Applied in Hugging Face's order: penalties,
/// temperature, top-k, top-p (over the top-k set, renormalised), min-p,
/// then the draw. Each filter keeps the logits at or above a threshold, so
/// logits tied at a threshold are all kept (as Hugging Face's top-k does;
/// its top-p keeps an arbitrary part of such a tie).
///
/// The draw is Gumbel-max with a counter-based random number per (seed,
/// position, token id): the same seed gives the same tokens on every run,
/// whatever the lookahead. Top-p sums the masses `exp((l - max) / T)` in
/// fixed point (units of 2^-31 of the top token's), exactly and in any
/// order, so a token whose mass is below 2^-31 of the top token's counts
/// as zero there.
///
/// Extreme values are bounded so that no overflow, infinity or NaN can
/// decide a token: a temperature below
/// [`SamplingParams::MIN_SAMPLING_TEMPERATURE`] (1e-5, as vLLM) is greedy
/// (dividing logits by it would overflow f32, and the draw's noise, less
/// than 20 wide, times such a temperature is below the spacing of f32
/// logits of ordinary size, so the argmax is what sampling converges to);
/// the penalties are refused beyond [`SamplingParams::MAX_PENALTY`]; a
/// `top_p` below the smallest normal f32 keeps what any tiny `top_p` keeps,
/// the top logit (and its ties).
///
/// ```
/// use qwen3_wgpu::SamplingParams;
/// let params = SamplingParams::default().temperature(0.7).top_k(20).top_p(0.95).seed(7);
/// assert!(!params.is_greedy());
/// params.validate()?;
/// assert_eq!(SamplingParams::default().temperature(-1.0).validate().unwrap_err().code(), "invalid_argument");
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// Temperature: 0 is greedy (argmax, the default), and so is any
    /// temperature below [`SamplingParams::MIN_SAMPLING_TEMPERATURE`];
    /// otherwise the logits are divided by it before the draw.
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (0: off).
    pub top_k: u32,
    /// Keep the smallest set of largest logits whose probability reaches
    /// `top_p` (1: off); in (0, 1].
    pub top_p: f32,
    /// Keep the tokens whose probability is at least `min_p` times the top
    /// token's (0: off); in [0, 1].
    pub min_p: f32,
    /// Hugging Face's repetition penalty (1: off), once per distinct token
    /// of the window: a logit `l` becomes `l * r` when negative, `l / r`
    /// otherwise. In [1 / [`SamplingParams::MAX_PENALTY`],
    /// [`SamplingParams::MAX_PENALTY`]].
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty (0: off): subtracted once from the logit
    /// of every token in the window. At most
    /// [`SamplingParams::MAX_PENALTY`] in magnitude.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty (0: off): subtracted from a token's
    /// logit once per occurrence in the window. At most
    /// [`SamplingParams::MAX_PENALTY`] in magnitude.
    pub frequency_penalty: f32,
    /// The penalties look at the last `penalty_window` tokens of the
    /// context (prompt included), as llama.cpp's `repeat_last_n` does.
    /// Default [`SamplingParams::DEFAULT_PENALTY_WINDOW`]; at most
    /// [`SamplingParams::MAX_PENALTY_WINDOW`].
    pub penalty_window: u32,
    /// The seed of the draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: Self::DEFAULT_PENALTY_WINDOW,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// The default penalty window (llama.cpp's `repeat_last_n`).
    pub const DEFAULT_PENALTY_WINDOW: u32 = 64;

    /// The longest penalty window (the GPU holds the window in workgroup
    /// memory).
    pub const MAX_PENALTY_WINDOW: u32 = MAX_PENALTY_WINDOW;

    /// The least temperature that samples: below it (0 included) the next
    /// token is the argmax, as vLLM treats temperatures below 1e-5. Logits
    /// divided by a smaller temperature can overflow f32 (and one below
    /// 1.2e-38 is a subnormal that GPUs may flush to 0), while Gumbel-max
    /// at such a temperature already picks the argmax unless logits lie
    /// within 2e-4 of the top.
    pub const MIN_SAMPLING_TEMPERATURE: f32 = 1e-5;

    /// The largest magnitude of `presence_penalty` and `frequency_penalty`,
    /// and the largest `repetition_penalty` (whose least is its
    /// reciprocal). Logits are within a few tens of 0, so a penalty this
    /// large already bans or forces a token; larger ones could push a
    /// penalised logit, or one divided by the temperature, past f32's
    /// range, where infinities would tie and decide the token.
    pub const MAX_PENALTY: f32 = 1e6;

    /// Greedy decoding (the default).
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Sets the temperature (0, or below
    /// [`Self::MIN_SAMPLING_TEMPERATURE`]: greedy).
    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }

    /// Sets top-k (0: off).
    pub fn top_k(mut self, k: u32) -> Self {
        self.top_k = k;
        self
    }

    /// Sets top-p (1: off).
    pub fn top_p(mut self, p: f32) -> Self {
        self.top_p = p;
        self
    }

    /// Sets min-p (0: off).
    pub fn min_p(mut self, p: f32) -> Self {
        self.min_p = p;
        self
    }

    /// Sets the repetition penalty (1: off).
    pub fn repetition_penalty(mut self, r: f32) -> Self {
        self.repetition_penalty = r;
        self
    }

    /// Sets the presence penalty (0: off).
    pub fn presence_penalty(mut self, p: f32) -> Self {
        self.presence_penalty = p;
        self
    }

    /// Sets the frequency penalty (0: off).
    pub fn frequency_penalty(mut self, p: f32) -> Self {
        self.frequency_penalty = p;
        self
    }

    /// Sets the penalty window, in tokens.
    pub fn penalty_window(mut self, n: u32) -> Self {
        self.penalty_window = n;
        self
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether the next token is the argmax: a temperature below
    /// [`Self::MIN_SAMPLING_TEMPERATURE`] (0 included).
    pub fn is_greedy(&self) -> bool {
        self.temperature < Self::MIN_SAMPLING_TEMPERATURE
    }

    /// Whether any penalty is on.
    pub fn has_penalties(&self) -> bool {
        self.penalty_window > 0
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Checks every field.
    ///
    /// Errors: [`Error::InvalidArgument`] naming the field: a negative,
    /// infinite or NaN `temperature`; `top_p` outside (0, 1]; `min_p`
    /// outside [0, 1]; a `repetition_penalty` outside
    /// [1 / [`Self::MAX_PENALTY`], [`Self::MAX_PENALTY`]] (or NaN); a
    /// `presence_penalty` or `frequency_penalty` beyond
    /// [`Self::MAX_PENALTY`] in magnitude (or NaN); a `penalty_window`
    /// above [`Self::MAX_PENALTY_WINDOW`]. The message names the bound.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, reason: String| Err(Error::invalid_argument(name, reason));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", format!("{} is not a finite value >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} is outside (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} is outside [0, 1]", self.min_p));
        }
        let max = Self::MAX_PENALTY;
        if !(1.0 / max..=max).contains(&self.repetition_penalty) {
            return bad(
                "repetition_penalty",
                format!("{} is outside [1/{max}, {max}]", self.repetition_penalty),
            );
        }
        for (name, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-max..=max).contains(&value) {
                return bad(name, format!("{value} is outside [-{max}, {max}]"));
            }
        }
        if self.penalty_window > Self::MAX_PENALTY_WINDOW {
            return bad(
                "penalty_window",
                format!(
                    "{} tokens is more than the {} supported",
                    self.penalty_window,
                    Self::MAX_PENALTY_WINDOW
                ),
            );
        }
        Ok(())
    }

    /// The checkpoint's own sampling settings, from `dir/generation_config.json`
    /// as Hugging Face's `generate` reads them: `do_sample` false or absent
    /// is greedy; otherwise `temperature` (default 1.0), `top_k` (default
    /// 50), `top_p` (default 1.0) and `min_p` (default off). A
    /// `repetition_penalty` applies either way (default 1.0). Other fields
    /// are ignored. A checkpoint without the file gets the defaults of
    /// [`SamplingParams::default`] (greedy), as Hugging Face falls back to
    /// its defaults.
    ///
    /// Errors: [`Error::CheckpointInvalid`] for malformed JSON, a field of
    /// the wrong type, a value out of range (see [`Self::validate`]), or a
    /// file that cannot be read.
    pub fn from_generation_config(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join("generation_config.json");
        let Some(bytes) = crate::config::read_optional(&path)? else { return Ok(Self::default()) };
        Self::parse_generation_config(&bytes).map_err(|reason| Error::invalid(&path, reason))
    }

    fn parse_generation_config(bytes: &[u8]) -> std::result::Result<Self, String> {
        let json: Value = serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
        let obj = json.as_object().ok_or("not a JSON object")?;
        let float = |name: &str, default: f32| -> std::result::Result<f32, String> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => {
                    v.as_f64().map(|x| x as f32).ok_or_else(|| format!("`{name}` is not a number: {v}"))
                }
            }
        };
        let do_sample = match obj.get("do_sample") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(format!("`do_sample` is not a boolean: {v}")),
        };
        let mut params = Self::default().repetition_penalty(float("repetition_penalty", 1.0)?);
        if do_sample {
            let top_k = match obj.get("top_k") {
                None | Some(Value::Null) => 50,
                Some(v) => v
                    .as_u64()
                    .and_then(|k| u32::try_from(k).ok())
                    .ok_or_else(|| format!("`top_k` is not a token count: {v}"))?,
            };
            params = params
                .temperature(float("temperature", 1.0)?)
                .top_k(top_k)
                .top_p(float("top_p", 1.0)?)
                .min_p(float("min_p", 0.0)?);
        }
        params.validate().map_err(|e| e.to_string())?;
        Ok(params)
    }
}

/// The log-probabilities that came with one token
/// ([`Session::set_logprobs`](crate::Session::set_logprobs)): of the
/// model's raw distribution, `log_softmax(logits)` before penalties,
/// temperature and filters, computed on the GPU in f32.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TokenLogprobs {
    /// The token chosen.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely
    /// first; equal logits by lowest id (at the last place too).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Decodes a record of the `logprob_final` kernel (its words: the
    /// token, its log-probability's bits, the entry count, a spare word,
    /// then (token, log-probability bits) per entry; see
    /// kernels/wgsl/logprob_final.wgsl).
    /// A record shorter than its header decodes as no token (`u32::MAX`,
    /// log-probability NaN, no entries); entries past its end are left out.
    pub fn from_record(words: &[u32]) -> Self {
        let word = |i: usize| words.get(i).copied();
        let pairs = words.len().saturating_sub(4) / 2;
        let count = (word(2).unwrap_or(0) as usize).min(pairs);
        let top = (0..count).map(|i| (words[4 + 2 * i], f32::from_bits(words[5 + 2 * i]))).collect();
        TokenLogprobs {
            token: word(0).unwrap_or(u32::MAX),
            logprob: word(1).map_or(f32::NAN, f32::from_bits),
            top,
        }
    }
}

/// One launch of the token choice: kernel, parameters, grid. The buffers
/// each kernel binds are named by its binding order.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedLaunch {
    /// The kernel launched.
    pub kernel: Kernel,
    /// Its parameters (the uniform's bytes).
    pub params: Vec<u8>,
    /// Its grid.
    pub workgroups: [u32; 3],
}

/// Whether `s` takes the sampler's two-launch top-k path: sampled, with
/// top-k on (`0 < k < n`) and `k <= SAMPLE_TOP_K_MAX` (128).
pub fn takes_top_k_path(s: &SamplingParams, n: u32) -> bool {
    !s.is_greedy() && s.top_k > 0 && s.top_k < n && s.top_k <= SAMPLE_TOP_K_MAX
}

/// [`plan`], and with `logprobs` > 0 (at most [`MAX_LOGPROBS`]) the
/// log-probabilities of each step: `sample_topk` with k = `logprobs` over
/// the raw logits first (before the penalties; it copies them when a
/// penalty is on), `logprob_final` last (it reads the chosen token).
pub fn plan_with_logprobs(
    s: &SamplingParams,
    n: u32,
    n_tokens: u32,
    chunk: u32,
    logprobs: u32,
) -> Vec<PlannedLaunch> {
    debug_assert!(logprobs <= MAX_LOGPROBS);
    let mut out = Vec::new();
    let region = logprob_region(n, chunk) as u32;
    let flags = TOPK_STATS | if s.has_penalties() { TOPK_COPY_RAW } else { 0 };
    let stats = TopkParams { k: logprobs, region, flags, ..topk_params(s, n, n_tokens, chunk) };
    if logprobs > 0 {
        out.push(PlannedLaunch {
            kernel: Kernel::SampleTopk,
            params: bytemuck::bytes_of(&stats).to_vec(),
            workgroups: grid(sample::parts(n, chunk)),
        });
    }
    out.extend(plan(s, n, n_tokens, chunk));
    if logprobs > 0 {
        out.push(PlannedLaunch {
            kernel: Kernel::LogprobFinal,
            params: bytemuck::bytes_of(&stats).to_vec(),
            workgroups: grid(1),
        });
    }
    out
}

/// `s.top_p`, at least the smallest normal f32: GPUs may flush a
/// subnormal to 0, which no mass fails to reach. Any `top_p` this small
/// keeps the top logit's group alone (its mass is at least 2^31 units, the
/// whole at most 2^31 per token), as a smaller one does.
fn top_p_floored(s: &SamplingParams) -> f32 {
    s.top_p.max(f32::MIN_POSITIVE)
}

/// The top-k path's parameters under `s` (records from scratch word 0).
fn topk_params(s: &SamplingParams, n: u32, n_tokens: u32, chunk: u32) -> TopkParams {
    let min_p_on = s.min_p > 0.0;
    TopkParams {
        n,
        chunk,
        parts: sample::parts(n, chunk),
        k: s.top_k,
        region: 0,
        flags: 0,
        temperature: s.temperature,
        top_p: top_p_floored(s),
        top_p_on: (s.top_p < 1.0) as u32,
        min_p_on: min_p_on as u32,
        min_p_offset: if min_p_on { s.temperature * s.min_p.ln() } else { 0.0 },
        seed_lo: s.seed as u32,
        seed_hi: (s.seed >> 32) as u32,
        n_tokens,
        record_words: LOGPROB_RECORD_WORDS,
    }
}

/// The launches that choose the next token from `n` logits under `s`
/// (`n_tokens`: length of the token buffer; `chunk`: logits per workgroup
/// of the chunked sampler launches, at most 4,096). Temperature 0 is
/// greedy: the argmax launches (after `sample_penalty` when a penalty is
/// on), exactly those of a session without sampling. With top-k on and
/// `k <= SAMPLE_TOP_K_MAX`, two launches ([`takes_top_k_path`]):
/// `sample_topk`, `sample_topk_final`. Otherwise the radix path: the
/// filters that are on, each a logit threshold: top-k (`0 < k < n`), top-p
/// (`p < 1`), min-p (`min_p > 0`), then the draw. Both paths keep the same
/// tokens and draw the same token for the same seed.
pub fn plan(s: &SamplingParams, n: u32, n_tokens: u32, chunk: u32) -> Vec<PlannedLaunch> {
    plan_path(s, n, n_tokens, chunk, takes_top_k_path(s, n))
}

/// [`plan`] on the radix path whatever top-k is (tests compare the paths).
pub fn plan_radix(s: &SamplingParams, n: u32, n_tokens: u32, chunk: u32) -> Vec<PlannedLaunch> {
    plan_path(s, n, n_tokens, chunk, false)
}

fn plan_path(s: &SamplingParams, n: u32, n_tokens: u32, chunk: u32, top_k_path: bool) -> Vec<PlannedLaunch> {
    debug_assert!(chunk <= TOPK_MAX_CHUNK);
    let parts = sample::parts(n, chunk);
    let top_k_on = s.top_k > 0 && s.top_k < n;
    let top_p_on = s.top_p < 1.0;
    let min_p_on = s.min_p > 0.0;
    let k_passes = if top_k_on { sample::PASSES_PER_FILTER } else { 0 };
    let passes = k_passes + if top_p_on { sample::PASSES_PER_FILTER } else { 0 };
    let need_max = top_p_on || min_p_on;
    let base = SampleParams {
        n,
        chunk,
        parts,
        select_pass: 0,
        passes,
        k_passes,
        top_k: s.top_k,
        top_p: top_p_floored(s),
        min_p_on: min_p_on as u32,
        min_p_offset: if min_p_on { s.temperature * s.min_p.ln() } else { 0.0 },
        temperature: s.temperature,
        seed_lo: s.seed as u32,
        seed_hi: (s.seed >> 32) as u32,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        window: s.penalty_window,
        n_tokens,
        need_max: need_max as u32,
    };
    let launch = |kernel, p: &SampleParams, workgroups| PlannedLaunch {
        kernel,
        params: bytemuck::bytes_of(p).to_vec(),
        workgroups,
    };
    let mut out = Vec::new();
    if s.has_penalties() {
        out.push(launch(Kernel::SamplePenalty, &base, grid(1)));
    }
    if s.is_greedy() {
        let argmax_parts = argmax::parts(n, ARGMAX_CHUNK);
        let partial = ArgmaxPartialParams { n, chunk: ARGMAX_CHUNK };
        out.push(PlannedLaunch {
            kernel: Kernel::ArgmaxPartial,
            params: bytemuck::bytes_of(&partial).to_vec(),
            workgroups: grid(argmax_parts),
        });
        let last = ArgmaxFinalParams { n: argmax_parts, n_tokens };
        out.push(PlannedLaunch {
            kernel: Kernel::ArgmaxFinal,
            params: bytemuck::bytes_of(&last).to_vec(),
            workgroups: argmax::FINAL_GRID,
        });
        return out;
    }
    if top_k_path {
        let p = topk_params(s, n, n_tokens, chunk);
        let params = bytemuck::bytes_of(&p).to_vec();
        out.push(PlannedLaunch {
            kernel: Kernel::SampleTopk,
            params: params.clone(),
            workgroups: grid(parts),
        });
        out.push(PlannedLaunch { kernel: Kernel::SampleTopkFinal, params, workgroups: grid(1) });
        return out;
    }
    if need_max {
        out.push(launch(Kernel::SampleMax, &base, grid(parts)));
    }
    for pass in 0..=passes {
        out.push(launch(Kernel::SampleSelect, &SampleParams { select_pass: pass, ..base }, grid(parts)));
    }
    let last = ArgmaxFinalParams { n: parts, n_tokens };
    out.push(PlannedLaunch {
        kernel: Kernel::ArgmaxFinal,
        params: bytemuck::bytes_of(&last).to_vec(),
        workgroups: argmax::FINAL_GRID,
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> std::result::Result<SamplingParams, String> {
        SamplingParams::parse_generation_config(text.as_bytes())
    }

    #[test]
    fn qwen3_generation_config_is_read_as_hugging_face_does() {
        let qwen = r#"{"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
            "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}"#;
        let want = SamplingParams::default().temperature(0.6).top_k(20).top_p(0.95);
        assert_eq!(parse(qwen).unwrap(), want);
        assert_eq!(
            parse(r#"{"do_sample": true}"#).unwrap(),
            SamplingParams::default().temperature(1.0).top_k(50)
        );
        let greedy = r#"{"do_sample": false, "temperature": 0.6, "repetition_penalty": 1.1}"#;
        assert_eq!(parse(greedy).unwrap(), SamplingParams::default().repetition_penalty(1.1));
        assert_eq!(parse("{}").unwrap(), SamplingParams::default());
        for bad in [
            "[1]",
            "{",
            r#"{"do_sample": "yes"}"#,
            r#"{"do_sample": true, "top_k": -1}"#,
            r#"{"do_sample": true, "top_p": 1.5}"#,
            r#"{"temperature": "hot", "do_sample": true}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn logprob_records_decode_whole_or_short() {
        let lp = TokenLogprobs::from_record(&[
            7,
            0.5f32.to_bits(),
            2,
            0,
            7,
            (-0.1f32).to_bits(),
            3,
            (-2.0f32).to_bits(),
        ]);
        assert_eq!(lp, TokenLogprobs { token: 7, logprob: 0.5, top: vec![(7, -0.1), (3, -2.0)] });
        // A count past the record's end, and records shorter than a header.
        assert_eq!(TokenLogprobs::from_record(&[7, 0, 9, 0, 1, 0]).top, [(1, 0.0)]);
        for short in [&[][..], &[7], &[7, 0, 5]] {
            assert!(TokenLogprobs::from_record(short).top.is_empty());
        }
    }

    #[test]
    fn every_bad_field_is_named() {
        let d = SamplingParams::default;
        let cases = [
            (d().temperature(-0.1), "temperature"),
            (d().temperature(f32::NAN), "temperature"),
            (d().temperature(f32::INFINITY), "temperature"),
            (d().top_p(0.0), "top_p"),
            (d().top_p(1.01), "top_p"),
            (d().top_p(f32::NAN), "top_p"),
            (d().min_p(-0.01), "min_p"),
            (d().min_p(1.5), "min_p"),
            (d().repetition_penalty(0.0), "repetition_penalty"),
            (d().repetition_penalty(-1.0), "repetition_penalty"),
            (d().presence_penalty(f32::NAN), "presence_penalty"),
            (d().frequency_penalty(f32::INFINITY), "frequency_penalty"),
            (d().penalty_window(SamplingParams::MAX_PENALTY_WINDOW + 1), "penalty_window"),
        ];
        for (params, field) in cases {
            match params.validate() {
                Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, field, "{params:?}"),
                other => panic!("{params:?}: {other:?}"),
            }
        }
        let edge = d().top_p(1.0).min_p(1.0).penalty_window(SamplingParams::MAX_PENALTY_WINDOW);
        edge.validate().unwrap();
    }

    /// Penalties that would push logits past f32's range are refused by
    /// name, with the bound in the message; the bounds themselves pass.
    #[test]
    fn extreme_penalties_are_refused_naming_the_bound() {
        let d = SamplingParams::default;
        let cases = [
            (d().presence_penalty(-3.4e38), "presence_penalty"),
            (d().presence_penalty(1.0e7), "presence_penalty"),
            (d().frequency_penalty(3.4e38), "frequency_penalty"),
            (d().frequency_penalty(-1.0e7), "frequency_penalty"),
            (d().repetition_penalty(3.4e38), "repetition_penalty"),
            (d().repetition_penalty(1.0e-30), "repetition_penalty"),
            (d().repetition_penalty(f32::NAN), "repetition_penalty"),
        ];
        for (params, field) in cases {
            match params.validate() {
                Err(Error::InvalidArgument { name, reason }) => {
                    assert_eq!(name, field, "{params:?}");
                    assert!(reason.contains("1000000"), "{field}: {reason}");
                }
                other => panic!("{params:?}: {other:?}"),
            }
        }
        for ok in [
            d().presence_penalty(-1.0e6).frequency_penalty(1.0e6).repetition_penalty(1.0e6),
            d().presence_penalty(1.0e6).frequency_penalty(-1.0e6).repetition_penalty(1.0e-6),
        ] {
            ok.validate().unwrap();
        }
    }

    /// A top-p below f32's normal range reaches the kernels as the least
    /// normal f32 (a GPU may flush a subnormal to 0, a target every mass
    /// reaches); ordinary values pass as they are.
    #[test]
    fn subnormal_top_p_reaches_the_kernels_as_a_normal_value() {
        let (n, n_tokens, chunk) = (5000, 64, 4096);
        for (top_p, want) in [(1e-40, f32::MIN_POSITIVE), (f32::MIN_POSITIVE, f32::MIN_POSITIVE), (0.5, 0.5)]
        {
            let params = SamplingParams::default().temperature(0.8).top_p(top_p);
            let radix = plan(&params, n, n_tokens, chunk);
            let select = radix.iter().find(|l| l.kernel == Kernel::SampleSelect).unwrap();
            assert_eq!(bytemuck::from_bytes::<SampleParams>(&select.params).top_p, want, "{top_p:e}");
            let top_k = plan(&params.clone().top_k(20), n, n_tokens, chunk);
            assert_eq!(top_k[0].kernel, Kernel::SampleTopk);
            assert_eq!(bytemuck::from_bytes::<TopkParams>(&top_k[0].params).top_p, want, "{top_p:e}");
        }
    }

    /// A temperature too small to divide logits by plans exactly the
    /// greedy launches; the least sampling temperature plans a draw.
    #[test]
    fn tiny_temperatures_plan_the_greedy_launches() {
        let (n, n_tokens, chunk) = (151_936, 64, 4096);
        let greedy = plan(&SamplingParams::greedy(), n, n_tokens, chunk);
        for t in [1e-40, f32::MIN_POSITIVE, 1e-30, 9.99e-6] {
            let params = SamplingParams::default().temperature(t).top_k(20).top_p(0.9).seed(5);
            params.validate().unwrap();
            assert!(params.is_greedy(), "{t}");
            assert_eq!(plan(&params, n, n_tokens, chunk), greedy, "{t}");
        }
        let least = SamplingParams::default().temperature(1e-5);
        assert!(!least.is_greedy());
        assert!(plan(&least, n, n_tokens, chunk).iter().any(|l| l.kernel == Kernel::SampleSelect));
    }
}
