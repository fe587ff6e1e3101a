//! The public API: an [`Engine`] (a GPU device and compiled kernels), a
//! loaded [`Model`], sessions, and the one-call [`decode`].

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::cache::CachePolicy;
use crate::config::{ModelConfig, ShapeProfile};
use crate::error::{Error, Result};
use crate::gpu::{AdapterPolicy, Gpu};
use crate::gpu_weights::{GpuWeights, ModelGpu};
use crate::kernels::{KernelChoice, KernelReport, KernelSource, Kernels, MatvecLayout};
use crate::load::{load_model_with, LoadReport};
use crate::progress::{LoadProgress, LoadProgressFn, Progress};
use crate::sampling::SamplingParams;
use crate::session::{check_prompt, Batch, BatchOptions, Session};
use crate::stop::StopMatcher;
use crate::tokenizer::Tokenizer;

/// KV-cache capacity (positions) of [`Model::session`], capped by the
/// model's `max_position_embeddings`. [`Model::generate`] and [`decode`]
/// size their session to the prompt and the token budget instead.
pub const DEFAULT_CAPACITY: usize = 4096;

/// Environment variable read when the caller does not set
/// [`EngineBuilder::cooperative_matrices`]: `on` (the default) runs prompt
/// batches on cooperative matrices where the device offers them, `off`
/// keeps them on the f32 program.
pub const COOPERATIVE_MATRICES_ENV: &str = "QWEN3_WGPU_COOPERATIVE_MATRICES";

/// Builds an [`Engine`].
#[derive(Default)]
pub struct EngineBuilder {
    policy: Option<AdapterPolicy>,
    device: Option<(wgpu::Device, wgpu::Queue)>,
    no_subgroups: bool,
    kernels: Option<KernelChoice>,
    matvec_layout: Option<MatvecLayout>,
    msl_off_metal: bool,
    cooperative_matrices: Option<bool>,
    /// [`EngineBuilder::emulate_cooperative_matrices`]'s row threshold.
    emulate_coop_min_rows: Option<u32>,
}

impl EngineBuilder {
    /// Sets the adapter policy. Without it: the `QWEN3_WGPU_BACKEND`
    /// environment variable if set, else [`AdapterPolicy::MetalOnly`].
    pub fn policy(mut self, policy: AdapterPolicy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Runs on a device the host application already owns (its renderer's,
    /// say) instead of creating one. The policy still applies.
    pub fn device(mut self, device: wgpu::Device, queue: wgpu::Queue) -> Self {
        self.device = Some((device, queue));
        self
    }

    /// Uses the workgroup-memory reductions even where subgroup operations
    /// exist (for comparison and testing; slower).
    pub fn without_subgroups(mut self) -> Self {
        self.no_subgroups = true;
        self
    }

    /// Chooses the kernels: [`KernelChoice::Auto`] (the hand-written MSL
    /// twins on Metal, WGSL elsewhere) or [`KernelChoice::Wgsl`]. Without
    /// it: the `QWEN3_WGPU_KERNELS` environment variable (`wgsl` or `auto`)
    /// if set, else `Auto`.
    pub fn kernels(mut self, choice: KernelChoice) -> Self {
        self.kernels = Some(choice);
        self
    }

    /// Forces the WGSL matvec's work split (for comparison and testing).
    /// Without it: `QWEN3_WGPU_MATVEC_LAYOUT` (`rows` or `split`) if set,
    /// else the device's ([`MatvecLayout::for_device`]). The MSL twin has
    /// one layout of its own.
    pub fn matvec_layout(mut self, layout: MatvecLayout) -> Self {
        self.matvec_layout = Some(layout);
        self
    }

    /// Whether prompt batches may run on cooperative matrices where the
    /// device offers the 16x16 f16 ones with 32-lane subgroups (NVIDIA
    /// through Vulkan): the weights and inputs of each product are staged
    /// as f16 (11 significant bits; the sums stay f32) and multiplied on
    /// tensor cores (`int8_matmul_coop`), 1.5-2.1x the f32 program's
    /// prefill on an H200 (BENCHMARKS.md 2026-12-02).
    /// Checked at start-up like every kernel, with the f32 program as
    /// fallback ([`KernelReport::cooperative_matrices`]); the MLX
    /// comparisons (tests/it/e2e_mlx.rs) pass with them on that device. Decode
    /// steps never use them. Memory: the model's first session makes a
    /// staging buffer of its largest matrix at 2 bytes a value plus a
    /// prompt batch of its inputs (13.1 MB for the 0.6B model, 101 MB for
    /// the 4B, 203 MB for the 8B), shared by its sessions. Without this call: the
    /// `QWEN3_WGPU_COOPERATIVE_MATRICES` environment variable (`on` or
    /// `off`) if set, else on. An adopted device ([`Self::device`]) never
    /// uses them (the engine cannot ask for the features there).
    pub fn cooperative_matrices(mut self, on: bool) -> Self {
        self.cooperative_matrices = Some(on);
        self
    }

    /// Runs the cooperative-matrix prompt-batch path where the device has f16
    /// but no cooperative matrices (Mesa's lavapipe), with a scalar product
    /// in place of the tensor-core one, for every product of at least
    /// `min_rows` rows: drives the f16 staging, its launches and its
    /// fidelity in tests. Where the device has cooperative matrices it runs
    /// the real product with the same row threshold.
    #[doc(hidden)]
    pub fn emulate_cooperative_matrices(mut self, min_rows: u32) -> Self {
        self.emulate_coop_min_rows = Some(min_rows);
        self
    }

    /// Attempts the MSL twins whatever the adapter (wgpu rejects them off
    /// Metal): drives the fallback through wgpu's own error route in tests.
    #[doc(hidden)]
    pub fn attempt_msl_on_any_adapter(mut self) -> Self {
        self.msl_off_metal = true;
        self
    }

    /// Picks (or adopts) the device, compiles every kernel and runs the
    /// start-up self-check ([`Engine::kernel_report`]).
    pub fn build(self) -> Result<Engine> {
        // Every setting is read before the device is touched: a bad value
        // fails fast, whatever else is wrong.
        let policy = match self.policy {
            Some(p) => p,
            None => AdapterPolicy::from_env()?.unwrap_or_default(),
        };
        let choice = match self.kernels {
            Some(c) => c,
            None => KernelChoice::from_env()?.unwrap_or_default(),
        };
        let matvec_layout = match self.matvec_layout {
            Some(l) => Some(l),
            None => MatvecLayout::from_env()?,
        };
        let coop = match self.cooperative_matrices {
            Some(on) => on,
            None => crate::settings::env_choice(COOPERATIVE_MATRICES_ENV, &[("on", true), ("off", false)])?
                .unwrap_or(true),
        };
        let mut gpu = match self.device {
            Some((device, queue)) => Gpu::from_device(device, queue, policy)?,
            None => Gpu::new_with(policy, coop, self.emulate_coop_min_rows.is_some())?,
        };
        gpu.subgroups &= !self.no_subgroups;
        gpu.coop &= gpu.subgroups;
        gpu.probe()?;
        let check = crate::self_check::CHECKER;
        let mut kernels = if self.msl_off_metal && choice == KernelChoice::Auto {
            Kernels::new_with(&gpu, true, matvec_layout, check)?
        } else {
            Kernels::new(&gpu, choice, matvec_layout, check)?
        };
        if let (true, Some(rows)) = (kernels.coop, self.emulate_coop_min_rows) {
            kernels.coop_min_rows = rows;
        }
        let kernels = Arc::new(kernels);
        Ok(Engine { gpu, kernels })
    }
}

/// A GPU device with the engine's kernels compiled for it. Cheap to share
/// by reference; load any number of models on it.
///
/// ```no_run
/// use qwen3_wgpu::{AdapterPolicy, Engine, LoadOptions};
/// let engine = Engine::builder().policy(AdapterPolicy::Portable).build()?;
/// let model = engine.load("./qwen3-0.6b-base", &LoadOptions::default())?;
/// let mut session = model.session()?;
/// let mut token = session.feed(&[785, 6722, 315, 9625, 374])?;
/// for _ in 0..8 {
///     print!("{token} ");
///     token = session.next_token()?;
/// }
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
pub struct Engine {
    gpu: Gpu,
    kernels: Arc<Kernels>,
}

impl Engine {
    /// An engine with the default policy (see [`EngineBuilder::policy`]).
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// Starts configuring an engine.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// The adapter in use.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.gpu.info
    }

    /// Where the hot kernels came from: the MSL twins or WGSL.
    pub fn kernel_source(&self) -> KernelSource {
        self.kernels.source
    }

    /// How the kernels were chosen and checked at start-up: the source in
    /// use, the self-check's result and time, and why the MSL twins were
    /// rejected if they were.
    ///
    /// ```no_run
    /// let engine = qwen3_wgpu::Engine::new()?;
    /// let report = engine.kernel_report();
    /// println!("{} kernels, self-check ok: {} ({:.1} ms)", report.source.as_str(), report.self_check.ok, report.self_check.ms);
    /// if let Some((kernel, reason)) = &report.fallback {
    ///     eprintln!("MSL rejected ({kernel}): {reason}");
    /// }
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    pub fn kernel_report(&self) -> &KernelReport {
        &self.kernels.report
    }

    /// The features to request on `adapter` for the engine's full-speed
    /// path (subgroup reductions, timestamps, and on Metal passthrough
    /// shaders for the MSL twins), for a host creating the device it will
    /// share ([`EngineBuilder::device`]). Only what the adapter offers.
    pub fn required_features(adapter: &wgpu::Adapter) -> wgpu::Features {
        crate::gpu::engine_features(adapter)
    }

    /// The limits to request on `adapter` for a shared device: the
    /// defaults, raised to the adapter's own where the engine uses more
    /// (buffer and binding sizes for the embedding and LM head, workgroup
    /// memory for the prefill tiles).
    pub fn required_limits(adapter: &wgpu::Adapter) -> wgpu::Limits {
        crate::gpu::engine_limits(adapter)
    }

    /// True when the kernels use subgroup reductions.
    pub fn uses_subgroups(&self) -> bool {
        self.gpu.subgroups
    }

    /// The device plumbing (for tests and tools).
    #[doc(hidden)]
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Loads a Hugging Face Qwen3 checkpoint directory: validates it,
    /// converts it to int8 (or loads the cached conversion), and uploads it,
    /// reporting progress to [`LoadOptions::on_progress`]'s callback.
    ///
    /// Errors: see [`Error`]; [`Error::Cancelled`] when the progress
    /// callback cancels (no cache file or temporary file is left behind).
    pub fn load(&self, checkpoint_dir: impl AsRef<Path>, options: &LoadOptions) -> Result<Model> {
        let t0 = Instant::now();
        let progress = Progress::new(options.progress.as_deref());
        let (converted, report) =
            load_model_with(checkpoint_dir.as_ref(), options.profile, &options.cache, &progress)?;
        let weights = GpuWeights::upload_with(&self.gpu, &converted, &progress)?;
        let config = converted.config.clone();
        // Hashed on a thread of its own, which drops the converted weights.
        let fingerprint = crate::fingerprint::WeightsFingerprint::start(converted);
        let inner =
            ModelGpu { gpu: self.gpu.clone(), kernels: self.kernels.clone(), config, weights, fingerprint };
        Ok(Model { inner: Arc::new(inner), report, load_ms: t0.elapsed().as_secs_f64() * 1e3 })
    }
}

/// How to load a checkpoint.
#[derive(Clone)]
pub struct LoadOptions {
    /// Which shapes to accept ([`ShapeProfile::AnyQwen3`] by default;
    /// [`ShapeProfile::Qwen3_0_6B`] demands the exact 0.6B shape).
    pub profile: ShapeProfile,
    /// Where converted weights are cached.
    pub cache: CachePolicy,
    /// Called with the load's progress; see [`on_progress`](Self::on_progress).
    pub progress: Option<Arc<LoadProgressFn>>,
}

impl LoadOptions {
    /// Calls `callback` as the load progresses: each phase
    /// ([`LoadPhase`](crate::LoadPhase): hashing, reading the cache or
    /// converting and writing the cache, uploading) is reported first with
    /// 0 bytes done, then as its bytes get done (never going back), and,
    /// unless the load fails, last with all of its bytes done. The callback
    /// may run on the load's worker threads, one call at a time. Returning
    /// [`ControlFlow::Break`] cancels the load: [`Engine::load`] returns
    /// [`Error::Cancelled`] and leaves no cache or temporary file behind.
    ///
    /// ```no_run
    /// use std::ops::ControlFlow;
    /// use qwen3_wgpu::{Engine, LoadOptions};
    /// let options = LoadOptions::default().on_progress(|p| {
    ///     eprintln!("{}: {} of {} bytes", p.phase.as_str(), p.bytes_done, p.bytes_total);
    ///     ControlFlow::Continue(())
    /// });
    /// let model = Engine::new()?.load("./qwen3-0.6b-base", &options)?;
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    pub fn on_progress(
        mut self,
        callback: impl Fn(LoadProgress) -> ControlFlow<()> + Send + Sync + 'static,
    ) -> Self {
        self.progress = Some(Arc::new(callback));
        self
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { profile: ShapeProfile::AnyQwen3, cache: CachePolicy::Default, progress: None }
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("profile", &self.profile)
            .field("cache", &self.cache)
            .field("progress", &self.progress.as_ref().map(|_| "callback"))
            .finish()
    }
}

/// A model on the GPU. Clones share the weights.
#[derive(Clone)]
pub struct Model {
    inner: Arc<ModelGpu>,
    report: LoadReport,
    load_ms: f64,
}

impl Model {
    /// The checkpoint's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.inner.config
    }

    /// Whether this load converted the checkpoint or used the cache, and timings.
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// Wall time of [`Engine::load`] (conversion or cache load, plus upload), ms.
    pub fn load_ms(&self) -> f64 {
        self.load_ms
    }

    /// GPU memory the weights occupy, bytes.
    pub fn weight_bytes(&self) -> u64 {
        self.inner.weights.bytes
    }

    /// A session with the default KV-cache capacity.
    pub fn session(&self) -> Result<Session> {
        self.session_with_capacity(DEFAULT_CAPACITY.min(self.config().max_position_embeddings))
    }

    /// A session whose KV cache holds `capacity` positions (1 up to the
    /// model's `max_position_embeddings`, else `context_overflow`);
    /// allocated once, never grown.
    pub fn session_with_capacity(&self, capacity: usize) -> Result<Session> {
        let max = self.config().max_position_embeddings;
        if capacity == 0 || capacity > max {
            return Err(Error::ContextOverflow { needed: capacity, capacity: max });
        }
        Session::new(self.inner.clone(), capacity)
    }

    /// A batch: up to `options.slots` sessions, each with a KV cache of
    /// `options.capacity_per_slot` positions, that [`Batch::step`] advances
    /// together, one GPU step reading every weight matrix once for all of
    /// them (see [`Batch`]). The KV pool is allocated here, once.
    ///
    /// Errors: `context_overflow` for a capacity of 0 or past the model's
    /// `max_position_embeddings`; [`Error::InvalidArgument`] naming `slots`
    /// for 0 slots or a pool larger than the device can bind; a GPU failure
    /// allocating the pool.
    pub fn batch(&self, options: &BatchOptions) -> Result<Batch> {
        Batch::new(self.inner.clone(), options)
    }

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
    /// Errors (before the GPU runs): those of [`Session::feed`] for the
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
        let mut session = self.session_with_capacity(needed)?;
        result.kv_capacity = session.capacity();
        if options.sampling != SamplingParams::default() {
            session.set_sampling(&options.sampling)?;
        }
        if options.logprobs > 0 {
            session.set_logprobs(options.logprobs)?;
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
    stop: Option<StopStrings>,
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
            stop: None,
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
}

impl StopReason {
    /// Stable name: `max_new_tokens`, `end_of_text`, `stop_string` or
    /// `callback`.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::MaxNewTokens => "max_new_tokens",
            StopReason::EndOfText => "end_of_text",
            StopReason::StopString(_) => "stop_string",
            StopReason::Callback => "callback",
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

/// Weights fingerprint and session files ([`Session::save`] writes them).
impl Model {
    /// What identifies this model's converted weights: 32 hex digits
    /// hashing its configuration and every byte of its int8 weights
    /// (hashed on a thread of its own after the load, so the first call may
    /// wait for it: a fraction of a second for Qwen3-0.6B). Loads of the same checkpoint share it,
    /// converted or from the cache; a session file is restored only into a
    /// model of the same fingerprint.
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) {
    /// println!("weights {}", model.fingerprint());
    /// # }
    /// ```
    pub fn fingerprint(&self) -> &str {
        self.inner.fingerprint.get()
    }

    /// Restores a session [`Session::save`] wrote, with the capacity it had.
    /// The restored session holds the same positions and pending token, so
    /// it continues exactly as the saved one would have.
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// let mut session = model.session()?;
    /// session.feed(&[785, 6722, 315, 9625, 374])?;
    /// session.save("npc-mira.q3s")?;
    /// // Later, or in another process that loaded the same weights:
    /// let mut restored = model.restore_session("npc-mira.q3s")?;
    /// let next = restored.next_token()?; // as session.next_token() would give
    /// # let _ = next;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Any file is safe to pass: only a regular file is read (a FIFO, a
    /// device such as a link to `/dev/zero`, or a directory is
    /// [`Error::SessionFileInvalid`] at once), and the header is checked
    /// against the file's length and this model before anything it sizes
    /// is allocated, so a crafted, truncated or damaged file is an error,
    /// never an abort. Host memory stays bounded by one layer's KV rows at
    /// the session's positions; a file that is not restored is only read
    /// through its checksum.
    ///
    /// Errors: [`Error::SessionIo`] when the file cannot be opened or read;
    /// [`Error::SessionFileInvalid`] when it is not a regular file or not an
    /// intact session file of this format version (magic, version, a
    /// length other than the header implies, flags, checksum, token ids, or
    /// this model's fingerprint with another shape);
    /// [`Error::SessionModelMismatch`] for an intact file saved from another
    /// model; [`Error::ContextOverflow`] when the saved capacity exceeds
    /// this model's `max_position_embeddings`; [`Error::OutOfMemory`] when
    /// the host cannot allocate the staging for one layer's rows.
    pub fn restore_session(&self, path: impl AsRef<Path>) -> Result<Session> {
        crate::session::restore(&self.inner, path.as_ref(), None)
    }

    /// [`restore_session`](Self::restore_session) into a session of
    /// `capacity` positions instead of the saved one (larger to continue
    /// further, or smaller to save memory). A capacity below the saved
    /// positions is [`Error::ContextOverflow`] (`needed`: the saved
    /// positions), after the file is verified; nothing is allocated then.
    pub fn restore_session_with_capacity(&self, path: impl AsRef<Path>, capacity: usize) -> Result<Session> {
        crate::session::restore(&self.inner, path.as_ref(), Some(capacity))
    }
}
