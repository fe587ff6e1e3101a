//! The public API: an [`Engine`] (a GPU device and compiled kernels), a
//! loaded [`Model`], sessions, and the one-call [`decode`].

mod builder;
mod generate;

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::cache::CachePolicy;
use crate::config::{ModelConfig, ShapeProfile};
use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::gpu_weights::{GpuWeights, ModelGpu};
use crate::kernels::{KernelReport, KernelSource, Kernels, SelfCheck, WeightKernels};
use crate::kv_cache::KvFormat;
use crate::load::{load_model_with, LoadReport};
use crate::progress::{LoadProgress, LoadProgressFn, Progress};
use crate::session::{Batch, BatchOptions, Session, SessionOptions};
pub use builder::{EngineBuilder, COOPERATIVE_MATRICES_ENV};
pub use generate::{decode, decode_with, DecodeResult, GenerateOptions, StopReason};

/// KV-cache capacity (positions) of [`Model::session`], capped by the
/// model's `max_position_embeddings`. [`Model::generate`] and [`decode`]
/// size their session to the prompt and the token budget instead.
pub const DEFAULT_CAPACITY: usize = 4096;

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

    /// Where the kernels that read and write a KV cache in `format` come
    /// from: for f16 [`Self::kernel_source`]; for another format, once
    /// [`Self::prepare_kv_cache`] (or its first session) has proven them,
    /// WGSL where its MSL twins failed to build or to match.
    ///
    /// ```no_run
    /// use qwen3_wgpu::{Engine, KvFormat};
    /// let engine = Engine::new()?;
    /// engine.prepare_kv_cache(KvFormat::Int8)?;
    /// println!("int8 KV cache: {} kernels", engine.kv_cache_source(KvFormat::Int8).as_str());
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    pub fn kv_cache_source(&self, format: KvFormat) -> KernelSource {
        self.kernels.kv_source(format)
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

    /// Builds and proves the matrix-product pipelines over layer weights
    /// in `format`. The start-up self-check covers the default format
    /// (int8); another format's pipelines are built, run on known answers
    /// and compared with the CPU reference when the first model in it
    /// loads ([`Self::load`] calls this), so that an engine that never
    /// loads one pays nothing for them. Call it ahead (behind a loading
    /// screen, say) to take that cost earlier; later calls return the
    /// first one's report at once. Where the MSL twins over `format` fail
    /// to build or to match, that format's products run on WGSL
    /// ([`WeightKernels::fallback`] says why).
    ///
    /// Errors: [`Error::GpuDeviceFailed`] when the WGSL pipelines fail the
    /// check too, or the device fails during it.
    ///
    /// ```no_run
    /// use qwen3_wgpu::{Engine, WeightFormat};
    /// let engine = Engine::new()?;
    /// let int4 = engine.prepare_weights(WeightFormat::Int4)?;
    /// println!("int4 products: {} kernels, {} pipelines checked", int4.source.as_str(), int4.self_check.pipelines);
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    pub fn prepare_weights(&self, format: WeightFormat) -> Result<WeightKernels> {
        self.kernels.prepare_format(&self.gpu, format)
    }

    /// Builds and proves the pipelines that read and write a KV cache in
    /// `format` ([`KvFormat`]) and returns their self-check: what the
    /// first session or batch in that format does otherwise, on the
    /// caller's thread (tens of milliseconds; a frame loop calls this at
    /// load instead). Later calls return the first one's check at once;
    /// for f16 it is the start-up check. Where the MSL twins over the
    /// format fail to build or to match, its kernels run on WGSL (logged).
    ///
    /// Errors: [`Error::GpuDeviceFailed`] when the WGSL pipelines fail the
    /// check, or the device fails during it.
    ///
    /// ```no_run
    /// use qwen3_wgpu::{Engine, KvFormat};
    /// let engine = Engine::new()?;
    /// let check = engine.prepare_kv_cache(KvFormat::Int8)?;
    /// println!("int8 KV cache: {} pipelines checked in {:.1} ms", check.pipelines, check.ms);
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    pub fn prepare_kv_cache(&self, format: KvFormat) -> Result<SelfCheck> {
        self.kernels.prove_kv(&self.gpu, format)
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

    /// Whether decode steps over a KV cache in `kv` run two query heads a
    /// workgroup from the packing start on: the packed pipeline was asked
    /// for (by a session or batch reaching that start) and proven (tests).
    #[doc(hidden)]
    pub fn debug_packs_attention(&self, kv: KvFormat) -> bool {
        self.kernels.packed_attention_in_use(kv)
    }

    /// Loads a Hugging Face Qwen3 checkpoint directory: validates it,
    /// converts it to the [`WeightFormat`] of [`LoadOptions::weights`] (or
    /// loads the cached conversion), and uploads it, reporting progress to
    /// [`LoadOptions::on_progress`]'s callback.
    ///
    /// Errors: see [`Error`]; [`Error::Cancelled`] when the progress
    /// callback cancels (no cache file or temporary file is left behind);
    /// [`Error::InvalidArgument`] when the options leave the format to
    /// [`WEIGHTS_ENV`](crate::WEIGHTS_ENV) and it names none.
    pub fn load(&self, checkpoint_dir: impl AsRef<Path>, options: &LoadOptions) -> Result<Model> {
        let t0 = Instant::now();
        let format = options.weight_format()?;
        self.kernels.prepare_format(&self.gpu, format)?;
        let progress = Progress::new(options.progress.as_deref());
        let (converted, report) =
            load_model_with(checkpoint_dir.as_ref(), options.profile, &options.cache, format, &progress)?;
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
    /// The format of the layers' weights; `None` (the default): the one
    /// [`WEIGHTS_ENV`](crate::WEIGHTS_ENV) names, else
    /// [`WeightFormat::Int8`]. See [`weights`](Self::weights).
    pub weights: Option<WeightFormat>,
}

impl LoadOptions {
    /// Converts the layers' linear weights to `format`
    /// ([`WeightFormat::Int4`]: half their GPU memory), whatever
    /// [`WEIGHTS_ENV`](crate::WEIGHTS_ENV) says. The cache keeps each
    /// format's conversion of a checkpoint apart.
    ///
    /// ```no_run
    /// use qwen3_wgpu::{Engine, LoadOptions, WeightFormat};
    /// let model = Engine::new()?.load("./qwen3-4b", &LoadOptions::default().weights(WeightFormat::Int4))?;
    /// # Ok::<(), qwen3_wgpu::Error>(())
    /// ```
    pub fn weights(mut self, format: WeightFormat) -> Self {
        self.weights = Some(format);
        self
    }

    /// The format a load converts to: [`Self::weights`]'s, else
    /// [`WEIGHTS_ENV`](crate::WEIGHTS_ENV)'s, else int8.
    pub(crate) fn weight_format(&self) -> Result<WeightFormat> {
        match self.weights {
            Some(format) => Ok(format),
            None => Ok(WeightFormat::from_env()?.unwrap_or_default()),
        }
    }

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
        LoadOptions {
            profile: ShapeProfile::AnyQwen3,
            cache: CachePolicy::Default,
            progress: None,
            weights: None,
        }
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("profile", &self.profile)
            .field("cache", &self.cache)
            .field("progress", &self.progress.as_ref().map(|_| "callback"))
            .field("weights", &self.weights)
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

    /// The format of the layers' weights ([`LoadOptions::weights`]).
    pub fn weight_format(&self) -> WeightFormat {
        self.inner.weights.format
    }

    /// A session with the default KV-cache capacity.
    pub fn session(&self) -> Result<Session> {
        self.session_with_capacity(DEFAULT_CAPACITY.min(self.config().max_position_embeddings))
    }

    /// A session whose KV cache holds `capacity` positions (1 up to the
    /// model's `max_position_embeddings`, else `context_overflow`);
    /// allocated once, never grown.
    pub fn session_with_capacity(&self, capacity: usize) -> Result<Session> {
        self.session_with(&SessionOptions::default().capacity(capacity))
    }

    /// A session as `options` say: its capacity (as
    /// [`Self::session_with_capacity`]) and KV-cache format.
    ///
    /// Errors: `context_overflow` for a capacity of 0 or past the model's
    /// `max_position_embeddings`; [`Error::InvalidArgument`] naming
    /// `kv_cache` for a format the model's `head_dim` does not fit (int8:
    /// a multiple of 16); a GPU failure allocating the session.
    pub fn session_with(&self, options: &SessionOptions) -> Result<Session> {
        let max = self.config().max_position_embeddings;
        let capacity = options.capacity.unwrap_or(DEFAULT_CAPACITY.min(max));
        if capacity == 0 || capacity > max {
            return Err(Error::ContextOverflow { needed: capacity, capacity: max });
        }
        Session::new(self.inner.clone(), capacity, options.kv_cache)
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

    /// [`Self::batch`] without the thread building its row pipelines
    /// ahead (tests of steps whose pipelines are missing).
    #[cfg(test)]
    pub(crate) fn batch_without_warm_up(&self, options: &BatchOptions) -> Result<Batch> {
        Batch::new_with(self.inner.clone(), options, false)
    }
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
