//! Generating text with a model: [`Model::generate`], its options, why it
//! stopped and what it returns, and the one-call [`decode`].

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use super::{Engine, LoadOptions, Model};
use crate::constraint::Constraint;
use crate::error::{Error, Result};
use crate::kv_cache::KvFormat;
use crate::sampling::SamplingParams;
use crate::session::{check_prompt, SessionOptions};
use crate::stop::StopMatcher;
use crate::tokenizer::Tokenizer;

impl Model {
    /// Greedy decoding of up to `max_new_tokens` after `prompt_ids`, calling
    /// `on_token` with each new token as soon as it is known. Stops early at
    /// an end-of-text id. Everything is checked before the GPU runs.
    /// [`generate_with`](Self::generate_with) with only a token budget.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        max_new_tokens: usize,
        mut on_token: impl FnMut(u32),
    ) -> Result<DecodeResult> {
        let options = GenerateOptions::default().max_new_tokens(max_new_tokens);
        self.generate_with(prompt_ids, &options, |token| {
            on_token(token);
            ControlFlow::Continue(())
        })
    }

    /// Decoding (greedy, or sampled under [`GenerateOptions::sampling`])
    /// after `prompt_ids` until one of `options`' limits:
    /// an end-of-text id (the checkpoint's, from config.json and
    /// generation_config.json, and [`GenerateOptions::eos_token_ids`]), a
    /// stop string ([`GenerateOptions::stop_strings`], matched on the decoded
    /// text across token boundaries), `on_token` returning
    /// [`ControlFlow::Break`], or the token budget. `on_token` sees each new
    /// token as soon as it is known; every token it saw is in the result.
    /// [`DecodeResult::stop_reason`] says which limit ended it (checked on
    /// each token in that order: end of text, stop string, callback,
    /// budget). The session
    /// holds the prompt and the budget ([`DecodeResult::kv_capacity`]), up
    /// to the model's `max_position_embeddings`. Everything is checked
    /// before the GPU runs.
    ///
    /// ```no_run
    /// use std::ops::ControlFlow;
    /// use qwen3_wgpu::{Engine, GenerateOptions, LoadOptions, StopReason, Tokenizer};
    /// let engine = Engine::new()?;
    /// let model = engine.load("./qwen3-0.6b-base", &LoadOptions::default())?;
    /// let tokenizer = Tokenizer::from_checkpoint("./qwen3-0.6b-base".as_ref())?;
    /// let options = GenerateOptions::default().max_new_tokens(64).stop_strings(&tokenizer, ["\nPlayer:"]);
    /// let prompt = tokenizer.encode("Blacksmith: Welcome!\nPlayer: Hello.\nBlacksmith:")?;
    /// let mut seen = 0;
    /// let out = model.generate_with(&prompt, &options, |_token| {
    ///     seen += 1;
    ///     if seen < 48 { ControlFlow::Continue(()) } else { ControlFlow::Break(()) }
    /// })?;
    /// println!("{} ({})", out.text.unwrap_or_default(), out.stop_reason.as_str());
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    ///
    /// Errors (before the GPU runs): those of [`Session::feed`](crate::Session::feed) for the
    /// prompt; [`Error::InvalidArgument`] naming `eos_token_ids` for an id
    /// outside the vocabulary, or `stop` for an empty stop string;
    /// [`Error::ContextOverflow`] when the prompt and the budget exceed
    /// `max_position_embeddings`.
    pub fn generate_with(
        &self,
        prompt_ids: &[u32],
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<DecodeResult> {
        let cfg = self.config();
        check_prompt(prompt_ids, cfg.vocab_size)?;
        options.sampling.validate()?;
        let max_logprobs = crate::kernels::sample::MAX_LOGPROBS;
        if options.logprobs > max_logprobs {
            let reason = format!("{} is more than the {max_logprobs} supported", options.logprobs);
            return Err(Error::invalid_argument("logprobs", reason));
        }
        if let Some(&id) = options.eos_token_ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(Error::invalid_argument(
                "eos_token_ids",
                format!("{id} is outside the vocabulary of {} tokens", cfg.vocab_size),
            ));
        }
        let mut stops = match &options.stop {
            Some(s) => Some((s.tokenizer.stream(), StopMatcher::new(s.stops.iter().cloned())?)),
            None => None,
        };
        let max_new_tokens = options.max_new_tokens;
        // The session holds what this generation needs and no more: the
        // last new token is never fed back, so it needs no cache slot.
        // Saturating: a count near usize::MAX must not wrap into a small one.
        let needed = prompt_ids.len().saturating_add(max_new_tokens.saturating_sub(1));
        if needed > cfg.max_position_embeddings {
            return Err(Error::ContextOverflow { needed, capacity: cfg.max_position_embeddings });
        }
        let mut result = DecodeResult {
            token_ids: prompt_ids.to_vec(),
            n_prompt: prompt_ids.len(),
            decode_tokens_per_sec: 0.0,
            prefill_ms: 0.0,
            load_ms: self.load_ms,
            converted: self.report.converted,
            stop_reason: StopReason::MaxNewTokens,
            text: stops.as_ref().map(|_| String::new()),
            kv_capacity: 0,
            logprobs: Vec::new(),
        };
        if max_new_tokens == 0 {
            return Ok(result);
        }
        let is_eos = |token: &u32| cfg.eos_token_ids.contains(token) || options.eos_token_ids.contains(token);
        let mut session =
            self.session_with(&SessionOptions::default().capacity(needed).kv_cache(options.kv_cache))?;
        result.kv_capacity = session.capacity();
        if options.sampling != SamplingParams::default() {
            session.set_sampling(&options.sampling)?;
        }
        if options.logprobs > 0 {
            session.set_logprobs(options.logprobs)?;
        }
        if let Some(constraint) = &options.constraint {
            session.set_constraint(Some(constraint))?;
        }
        let t0 = Instant::now();
        let mut token = session.feed(prompt_ids)?;
        result.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let mut steps = 0usize;
        let mut stopped_by_string = false;
        loop {
            result.token_ids.push(token);
            result.logprobs.extend(session.last_logprobs().cloned());
            let flow = on_token(token);
            if is_eos(&token) {
                result.stop_reason = StopReason::EndOfText;
                break;
            }
            if let (Some((stream, matcher)), Some(text)) = (stops.as_mut(), result.text.as_mut()) {
                let step = matcher.push(&stream.push(token)?);
                text.push_str(&step.text);
                if let Some(index) = step.stopped {
                    result.stop_reason = StopReason::StopString(index);
                    stopped_by_string = true;
                    break;
                }
            }
            if flow.is_break() {
                result.stop_reason = StopReason::Callback;
                break;
            }
            if session.constraint_complete() {
                result.stop_reason = StopReason::ConstraintComplete;
                break;
            }
            if result.token_ids.len() - result.n_prompt >= max_new_tokens {
                break;
            }
            token = session.next_token()?;
            steps += 1;
        }
        let secs = t1.elapsed().as_secs_f64();
        if steps > 0 && secs > 0.0 {
            result.decode_tokens_per_sec = steps as f64 / secs;
        }
        // Stopped otherwise: the text still held back (an incomplete
        // character, the start of a stop string) is final, unless it
        // completes a stop string after all.
        if let (false, Some((stream, matcher)), Some(text)) =
            (stopped_by_string, stops.as_mut(), result.text.as_mut())
        {
            let step = matcher.push(&stream.finish()?);
            text.push_str(&step.text);
            match step.stopped {
                Some(index) => result.stop_reason = StopReason::StopString(index),
                None => text.push_str(&matcher.finish()),
            }
        }
        Ok(result)
    }
}

/// What [`Model::generate_with`] generates and when it stops. Build it from
/// the default with the builder methods:
///
/// ```
/// use qwen3_wgpu::GenerateOptions;
/// let options = GenerateOptions::default().max_new_tokens(32).eos_token_ids([13]);
/// assert_eq!(options.max_new_tokens, 32);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct GenerateOptions {
    /// Most new tokens to generate (the token budget). Default
    /// [`GenerateOptions::DEFAULT_MAX_NEW_TOKENS`].
    pub max_new_tokens: usize,
    /// End-of-text ids honoured besides the checkpoint's own (config.json's
    /// and generation_config.json's `eos_token_id`, always honoured).
    pub eos_token_ids: Vec<u32>,
    /// How tokens are chosen (default greedy): see [`SamplingParams`].
    pub sampling: SamplingParams,
    /// Log-probabilities of the most likely tokens to return with each
    /// generated token (0, the default: none; at most 20): see
    /// [`Session::set_logprobs`](crate::Session::set_logprobs).
    pub logprobs: u32,
    /// How the generation's KV cache stores its rows (default
    /// [`KvFormat::F16`]; see [`KvFormat`]).
    pub kv_cache: KvFormat,
    stop: Option<StopStrings>,
    constraint: Option<Constraint>,
}

/// Stop strings and the tokenizer that turns tokens into the text they are
/// matched on.
#[derive(Clone)]
struct StopStrings {
    tokenizer: Tokenizer,
    stops: Vec<String>,
}

impl GenerateOptions {
    /// The default token budget.
    pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

    /// Constrains the generated tokens to what `constraint` allows (see
    /// [`Session::set_constraint`](crate::Session::set_constraint)):
    /// generation stops with [`StopReason::ConstraintComplete`] once the
    /// output is a whole match, or at the token budget (an incomplete
    /// match: [`DecodeResult::stop_reason`] is then `MaxNewTokens`).
    pub fn constraint(mut self, constraint: &Constraint) -> Self {
        self.constraint = Some(constraint.clone());
        self
    }

    /// The constraint set by [`constraint`](Self::constraint), if any.
    pub fn constraint_in_use(&self) -> Option<&Constraint> {
        self.constraint.as_ref()
    }

    /// Sets the token budget.
    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.max_new_tokens = n;
        self
    }

    /// Adds end-of-text ids (besides the checkpoint's own). The id is kept
    /// in the result; generation stops after it.
    pub fn eos_token_ids(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.eos_token_ids.extend(ids);
        self
    }

    /// Stops when the generated text contains one of `stops` (matched on the
    /// text `tokenizer` decodes, across token boundaries, with
    /// [`StopMatcher`]): [`DecodeResult::text`] then ends before it, and
    /// [`StopReason::StopString`] gives its index in `stops`. The token
    /// that completed it is the last of `token_ids`. Replaces stop strings
    /// set before; keeps a (cheap) clone of the tokenizer. An empty stop
    /// string makes [`Model::generate_with`] fail with `invalid_argument`
    /// (`stop`).
    pub fn stop_strings<I, S>(mut self, tokenizer: &Tokenizer, stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let stops = stops.into_iter().map(Into::into).collect();
        self.stop = Some(StopStrings { tokenizer: tokenizer.clone(), stops });
        self
    }

    /// Sets how tokens are chosen (default greedy).
    ///
    /// ```
    /// use qwen3_wgpu::{GenerateOptions, SamplingParams};
    /// let options = GenerateOptions::default().sampling(SamplingParams::default().temperature(0.8).seed(7));
    /// assert_eq!(options.sampling.seed, 7);
    /// ```
    pub fn sampling(mut self, params: SamplingParams) -> Self {
        self.sampling = params;
        self
    }

    /// Returns the log-probabilities of the `n` most likely tokens (and of
    /// the token chosen) with each generated token, in
    /// [`DecodeResult::logprobs`] (0: none; more than 20 is refused by
    /// the generation as `invalid_argument`).
    pub fn logprobs(mut self, n: u32) -> Self {
        self.logprobs = n;
        self
    }

    /// Sets [`Self::kv_cache`].
    pub fn kv_cache(mut self, format: KvFormat) -> Self {
        self.kv_cache = format;
        self
    }

    /// The stop strings, in the order given (empty when none are set).
    pub fn stops(&self) -> &[String] {
        self.stop.as_ref().map_or(&[], |s| &s.stops)
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: Self::DEFAULT_MAX_NEW_TOKENS,
            eos_token_ids: Vec::new(),
            sampling: SamplingParams::default(),
            logprobs: 0,
            kv_cache: KvFormat::F16,
            stop: None,
            constraint: None,
        }
    }
}

impl std::fmt::Debug for GenerateOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerateOptions")
            .field("max_new_tokens", &self.max_new_tokens)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("sampling", &self.sampling)
            .field("logprobs", &self.logprobs)
            .field("stops", &self.stops())
            .field("constraint", &self.constraint.as_ref().map(Constraint::kind))
            .finish()
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// `max_new_tokens` were generated.
    MaxNewTokens,
    /// An end-of-text id was generated (it is included in `token_ids`).
    EndOfText,
    /// The stop string of this index (in [`GenerateOptions::stop_strings`]'s
    /// order) appeared in the generated text; [`DecodeResult::text`] ends
    /// before it.
    StopString(usize),
    /// The `on_token` callback returned [`ControlFlow::Break`] (the token
    /// it was given is included in `token_ids`).
    Callback,
    /// The output matches the whole [`GenerateOptions::constraint`]: only
    /// end-of-text could follow (it is not generated).
    ConstraintComplete,
}

impl StopReason {
    /// Stable name: `max_new_tokens`, `end_of_text`, `stop_string`,
    /// `callback` or `constraint_complete`.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::MaxNewTokens => "max_new_tokens",
            StopReason::EndOfText => "end_of_text",
            StopReason::StopString(_) => "stop_string",
            StopReason::Callback => "callback",
            StopReason::ConstraintComplete => "constraint_complete",
        }
    }
}

/// The outcome of [`decode`] / [`Model::generate`] / [`Model::generate_with`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DecodeResult {
    /// The prompt followed by the generated ids.
    pub token_ids: Vec<u32>,
    /// How many of `token_ids` are the prompt.
    pub n_prompt: usize,
    /// Generated tokens per second after the first (each one a full forward
    /// pass plus its 4-byte readback).
    pub decode_tokens_per_sec: f64,
    /// Time to run the prompt and get the first new token, ms.
    pub prefill_ms: f64,
    /// Time to load the model (conversion or cache, upload), ms.
    pub load_ms: f64,
    /// True when loading converted the checkpoint (no valid cache existed).
    pub converted: bool,
    /// Why generation stopped.
    pub stop_reason: StopReason,
    /// The generated text, when stop strings were set
    /// ([`GenerateOptions::stop_strings`]): it ends before the stop string
    /// that matched, and leaves out an end-of-text token. `None` otherwise.
    pub text: Option<String>,
    /// KV-cache positions of the session the generation ran on: the prompt
    /// plus the token budget less one (the last new token is never fed
    /// back), allocated once; 0 when no token was asked for.
    pub kv_capacity: usize,
    /// With [`GenerateOptions::logprobs`]: the log-probabilities of each
    /// generated token, in order (one per generated id); empty otherwise.
    pub logprobs: Vec<crate::TokenLogprobs>,
}

impl DecodeResult {
    /// The generated ids alone.
    pub fn generated_ids(&self) -> &[u32] {
        &self.token_ids[self.n_prompt..]
    }
}

/// Loads `checkpoint_dir` (default [`LoadOptions`]) and greedily decodes up
/// to `max_new_tokens` after `prompt_ids`.
///
/// ```no_run
/// let engine = qwen3_wgpu::Engine::new()?; // Metal by default
/// let out = qwen3_wgpu::decode(&engine, "./qwen3-0.6b-base", &[785, 6722, 315, 9625, 374], 16)?;
/// println!("{:?} at {:.0} tok/s", out.generated_ids(), out.decode_tokens_per_sec);
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
pub fn decode(
    engine: &Engine,
    checkpoint_dir: impl AsRef<Path>,
    prompt_ids: &[u32],
    max_new_tokens: usize,
) -> Result<DecodeResult> {
    decode_with(engine, checkpoint_dir, prompt_ids, max_new_tokens, &LoadOptions::default())
}

/// [`decode`] with explicit [`LoadOptions`].
pub fn decode_with(
    engine: &Engine,
    checkpoint_dir: impl AsRef<Path>,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    options: &LoadOptions,
) -> Result<DecodeResult> {
    // Cheap input checks first: no conversion or upload for a bad prompt.
    if prompt_ids.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let model = engine.load(checkpoint_dir, options)?;
    model.generate(prompt_ids, max_new_tokens, |_| {})
}
