//! Several sessions of one model decoding in one GPU step: a [`Batch`] owns
//! a KV pool (per layer one K and one V buffer of `slots` regions), hands
//! out sessions whose caches are its regions, and steps any of them
//! together. A step reads every weight matrix once for all its sessions;
//! each session attends over its own region at its own position and gets
//! its own token, the very token it would get stepping alone (each row runs
//! its session's one-token arithmetic; a greedy row takes the batch's
//! argmax, a sampling row its session's own sampler launches). A step's
//! commands depend on its rows (their sessions, positions and token
//! choices), not on its input tokens: those and each row's position as the
//! kernels read it are buffers written at the submit, so
//! [`Batch::try_step`] records the next step of the same sessions, one
//! position on, ahead on a thread of the batch's own.

mod pool;
mod record;
mod step;
mod submit;
mod warm_up;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::recorder::Recorder;
use super::Session;
use crate::buffers::{kv_region_bytes, KvRegion, SessionBuffers};
use crate::error::{Error, Result};
use crate::gpu_weights::ModelGpu;
use crate::kernels::KernelSource;
use crate::kv_cache::KvFormat;
use crate::qwen3::BatchForward;
use pool::KvPool;
pub(crate) use pool::SlotLease;
use record::PrerecordedStep;
use submit::InFlightStep;
use warm_up::WarmUp;
pub use warm_up::WARM_UP_MAX_ROWS;

/// How [`Model::batch`](crate::Model::batch) sizes a batch.
///
/// ```no_run
/// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
/// use qwen3_wgpu::BatchOptions;
/// let batch = model.batch(&BatchOptions::default().slots(4).capacity_per_slot(512))?;
/// # let _ = batch;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchOptions {
    /// Sessions the batch can hold at once (default 8).
    pub slots: usize,
    /// KV-cache capacity of each session, in positions (default 1024).
    pub capacity_per_slot: usize,
    /// How every session's KV cache stores its rows (default
    /// [`KvFormat::F16`]).
    pub kv_cache: KvFormat,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions { slots: 8, capacity_per_slot: 1024, kv_cache: KvFormat::F16 }
    }
}

impl BatchOptions {
    /// Sets [`Self::slots`].
    pub fn slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }

    /// Sets [`Self::capacity_per_slot`].
    pub fn capacity_per_slot(mut self, capacity: usize) -> Self {
        self.capacity_per_slot = capacity;
        self
    }

    /// Sets [`Self::kv_cache`].
    pub fn kv_cache(mut self, format: KvFormat) -> Self {
        self.kv_cache = format;
        self
    }
}

/// Sessions of one model stepped together: see [`Model::batch`](crate::Model::batch).
///
/// Sessions made by [`Batch::session`] are ordinary [`Session`]s (feed,
/// `next_token`, truncate, fork, save all work on each alone); their KV
/// caches are regions of the batch's pool, and a dropped session gives its
/// slot back. [`Batch::step`] advances any of them by one token each, in
/// one GPU submit; which sessions a call passes is up to the caller, so
/// sessions join and leave between steps (continuous batching).
///
/// ```no_run
/// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
/// use qwen3_wgpu::BatchOptions;
/// let mut batch = model.batch(&BatchOptions::default().slots(2).capacity_per_slot(256))?;
/// let mut a = batch.session()?;
/// let mut b = batch.session()?;
/// let first = (a.feed(&[785, 6722, 315])?, b.feed(&[9707])?);
/// for _ in 0..16 {
///     let tokens = batch.step(&mut [&mut a, &mut b])?; // one token each
///     println!("{tokens:?}");
/// }
/// # let _ = first;
/// # Ok(())
/// # }
/// ```
///
/// Each session chooses its token under its own [`SamplingParams`](crate::SamplingParams)
/// ([`Session::set_sampling`]): greedy rows through the batch's argmax,
/// sampling rows through their session's sampler (same seed, same tokens as
/// alone); a session reporting log-probabilities is refused. On the MSL kernels (which have no batched
/// variants) a step runs each session's own step in turn: the same tokens,
/// without the shared weight reads.
pub struct Batch {
    model: Arc<ModelGpu>,
    pool: Arc<KvPool>,
    slots: usize,
    capacity: usize,
    /// The rows' activations; `tokens` holds one word, then each row's
    /// token: the embedding reads row z's at `embed_step.pos + z` = 1 + z,
    /// the argmax writes it at `step.pos + 1 + z` with `step.pos` = 0.
    bufs: SessionBuffers,
    /// Per row: position and KV offset (vec4 words), as attention reads them.
    rows: wgpu::Buffer,
    /// `{pos: 1, fill_end: 0}`.
    embed_step: wgpu::Buffer,
    /// `None` on the MSL kernels (each session steps alone there).
    forward: Option<Arc<BatchForward>>,
    /// The rows' tokens, read back after each step: two, for the step
    /// waited on and the one queued behind it.
    readbacks: [wgpu::Buffer; 2],
    /// The step submitted for the sessions of the last call as they are
    /// now: queued ahead by [`Batch::step`], or waited for by
    /// [`Batch::try_step`].
    ahead: Option<InFlightStep>,
    /// The step queued behind `ahead` for the same sessions, one position
    /// further on (a [`Batch::try_step`] still waiting for `ahead`'s tokens
    /// has queued it already).
    behind: Option<InFlightStep>,
    /// Waits on the GPU so far (a [`Batch::try_step`] never adds one).
    blocking_waits: u64,
    /// The thread recording the next step of [`Batch::try_step`]'s
    /// sessions ahead (started on first use; `None` before, or if the
    /// system refused a thread).
    recorder: Option<Recorder>,
    /// The next step's commands, recorded ahead.
    prerecorded: Option<PrerecordedStep>,
    /// Steps submitted so far with commands recorded on the caller's
    /// thread, and with commands recorded ahead.
    recordings: (u64, u64, u64),
    /// Building the row pipelines of every session count ahead of the
    /// steps (`None` on the MSL kernels, or if no thread could start).
    warm_up: Option<WarmUp>,
    /// How long the batch's thread waits before each submit handed to it
    /// (tests of what must wait for those submits; `None` in use).
    debug_submit_delay: Option<std::time::Duration>,
    /// Steps handed to the batch's thread to submit, so far.
    submits_on_thread: u64,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("slots", &self.slots)
            .field("free_slots", &self.free_slots())
            .field("capacity_per_slot", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Batch {
    pub(crate) fn new(model: Arc<ModelGpu>, options: &BatchOptions) -> Result<Self> {
        Self::new_with(model, options, true)
    }

    /// [`Self::new`]; `warm_up`: whether its thread builds the row
    /// pipelines ahead (tests of steps whose pipelines are missing pass
    /// false).
    pub(crate) fn new_with(model: Arc<ModelGpu>, options: &BatchOptions, warm_up: bool) -> Result<Self> {
        let cfg = &model.config;
        let gpu = &model.gpu;
        let (slots, capacity) = (options.slots, options.capacity_per_slot);
        let max = cfg.max_position_embeddings;
        if capacity == 0 || capacity > max {
            return Err(Error::ContextOverflow { needed: capacity, capacity: max });
        }
        if slots == 0 {
            return Err(Error::invalid_argument("slots", "a batch needs at least one slot"));
        }
        let kv_format = options.kv_cache;
        model.kernels.prepare_kv(gpu, kv_format, cfg.head_dim)?;
        let region_bytes = kv_region_bytes(cfg, capacity, kv_format);
        let limits = gpu.device.limits();
        let limit = limits.max_buffer_size.min(limits.max_storage_buffer_binding_size);
        let pool_bytes =
            (slots as u64).checked_mul(region_bytes).filter(|&b| b <= limit).ok_or_else(|| {
                Error::invalid_argument(
                    "slots",
                    format!(
                        "{slots} slots of {capacity} positions need {region_bytes} bytes each per layer, \
                     past the device's largest storage binding ({limit} bytes)"
                    ),
                )
            })?;
        let built = gpu.scoped(
            || {
                let layer = |label| -> Vec<wgpu::Buffer> {
                    (0..cfg.num_hidden_layers).map(|_| gpu.storage(label, pool_bytes as usize)).collect()
                };
                let (k, v) = (layer("k_pool"), layer("v_pool"));
                let whole = KvRegion { k: k.clone(), v: v.clone(), offset: 0, bytes: pool_bytes };
                let bufs = SessionBuffers::for_rows(gpu, cfg, capacity, kv_format, slots, whole)?;
                let rows = gpu.storage("batch rows", 8 * slots);
                let embed_step = gpu.storage_init("batch embed step", bytemuck::cast_slice(&[1u32, 0]))?;
                let batched = model.kernels.source != KernelSource::Msl;
                let forward = batched
                    .then(|| {
                        crate::qwen3::batch_forward(
                            gpu,
                            &model.kernels,
                            cfg,
                            &model.weights,
                            &bufs,
                            &rows,
                            &embed_step,
                        )
                        .map(Arc::new)
                    })
                    .transpose()?;
                Ok((k, v, bufs, rows, embed_step, forward))
            },
            |reason| Error::GpuDeviceFailed { reason: format!("creating a batch: {reason}") },
        )?;
        let (k, v, bufs, rows, embed_step, forward) = built;
        let warm_up =
            forward.as_ref().filter(|_| warm_up).and_then(|f| WarmUp::start(model.clone(), f, slots));
        let free = Mutex::new((0..slots).rev().collect());
        Ok(Batch {
            pool: Arc::new(KvPool {
                k,
                v,
                region_bytes,
                free,
                leases: AtomicU64::new(0),
                submits_away: AtomicUsize::new(0),
            }),
            slots,
            capacity,
            bufs,
            rows,
            embed_step,
            forward,
            readbacks: [gpu.readback("batch tokens", 4 * slots), gpu.readback("batch tokens", 4 * slots)],
            ahead: None,
            behind: None,
            blocking_waits: 0,
            recorder: None,
            prerecorded: None,
            recordings: (0, 0, 0),
            warm_up,
            debug_submit_delay: None,
            submits_on_thread: 0,
            model,
        })
    }

    /// Whether the batch's pipelines are ready: from its creation, a
    /// thread of its own builds and proves the pipelines of steps of every
    /// session count up to its slots (at most [`WARM_UP_MAX_ROWS`]), the
    /// full count first. Until then a step whose pipelines are not ready
    /// gives the same tokens, more slowly ([`Batch::try_step`] runs its
    /// rows in a larger count's pipelines where one is built, else each
    /// row through the one-token pipelines; [`Batch::step`] builds what it
    /// needs first). Dropping the batch stops the thread after the
    /// pipeline in progress, and waits for that one. A host with a loading
    /// screen can wait for them:
    ///
    /// ```no_run
    /// # fn f(batch: &qwen3_wgpu::Batch) {
    /// while !batch.pipelines_ready() {
    ///     // ... render a loading frame ...
    /// #   break;
    /// }
    /// # }
    /// ```
    pub fn pipelines_ready(&self) -> bool {
        self.warm_up.as_ref().is_none_or(WarmUp::is_done)
    }

    /// Waits until [`Batch::pipelines_ready`] (for benchmarks and tests).
    #[doc(hidden)]
    pub fn debug_wait_for_pipelines(&mut self) {
        if let Some(w) = self.warm_up.as_mut() {
            w.wait();
        }
    }

    /// Sessions the batch can hold at once.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots free for [`Batch::session`].
    pub fn free_slots(&self) -> usize {
        self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// KV-cache capacity of each session, in positions.
    pub fn capacity_per_slot(&self) -> usize {
        self.capacity
    }

    /// GPU memory the batch allocated (the KV pool of every slot, the
    /// rows' activations and scratch, launch parameters), bytes. Its
    /// sessions' own buffers come on top ([`Session::buffer_bytes`]).
    pub fn buffer_bytes(&self) -> u64 {
        let [r0, r1] = &self.readbacks;
        let extra = [&self.rows, &self.embed_step, r0, r1].iter().map(|b| b.size()).sum::<u64>();
        self.bufs.bytes() + self.forward.as_ref().map_or(0, |f| f.uniform_bytes) + extra
    }

    /// A new empty session in a free slot (its KV cache is the slot's
    /// region; dropping the session frees the slot).
    ///
    /// Errors: [`Error::InvalidArgument`] naming `batch` when every slot
    /// holds a session; a GPU failure creating the session's buffers.
    pub fn session(&self) -> Result<Session> {
        let slot = self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).pop().ok_or_else(|| {
            Error::invalid_argument(
                "batch",
                format!("all {} slots hold sessions: drop one to free its slot", self.slots),
            )
        })?;
        let number = self.pool.leases.fetch_add(1, Ordering::Relaxed);
        let lease = SlotLease { pool: self.pool.clone(), slot, number };
        Session::new_in(self.model.clone(), self.capacity, self.bufs.kv_layout.format, Some(lease))
    }

    /// Waits on the GPU by this batch so far (a [`Batch::try_step`] never
    /// adds one): for tests that check that it never waits.
    #[doc(hidden)]
    pub fn debug_blocking_waits(&self) -> u64 {
        self.blocking_waits
    }

    /// Steps submitted by this batch so far whose commands were recorded
    /// on the caller's thread, and whose commands were recorded ahead on
    /// the batch's recorder; and recordings started ahead (those not
    /// submitted were dropped): for tests that check which steps were
    /// recorded where, and that none is recorded in vain.
    #[doc(hidden)]
    pub fn debug_step_recordings(&self) -> (u64, u64, u64) {
        self.recordings
    }

    /// Delays each submit handed to the batch's thread by `delay`: for
    /// tests that check that a member's own calls come after it.
    #[doc(hidden)]
    pub fn debug_delay_submits(&mut self, delay: std::time::Duration) {
        self.debug_submit_delay = Some(delay);
    }

    /// Matvec launches recorded so far while a step's own session count
    /// had no pipeline built yet: through a larger count's pipeline, and
    /// through the one-token pipeline once per row (see
    /// [`Batch::try_step`]): for the frame loop's report and tests.
    #[doc(hidden)]
    pub fn debug_stand_in_launches(&self) -> (u64, u64) {
        self.forward.as_ref().map_or((0, 0), |f| f.stand_in_launches())
    }

    /// Steps handed to the batch's thread to submit so far (a
    /// [`Batch::try_step`] submits none on the caller's thread): for tests.
    #[doc(hidden)]
    pub fn debug_submits_on_thread(&self) -> u64 {
        self.submits_on_thread
    }
}

#[cfg(test)]
mod tests {
    use crate::{AdapterPolicy, BatchOptions, CachePolicy, Engine, LoadOptions, Session};

    /// A new batch builds and proves the row pipelines of every session
    /// count up to its slots on its own thread, before a step needs them
    /// (and none past its slots).
    #[test]
    fn a_new_batch_builds_its_row_pipelines_ahead_of_its_steps() {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
        let model = engine.load(fixture, &options).unwrap();
        let mut batch = model.batch(&BatchOptions::default().slots(3).capacity_per_slot(32)).unwrap();
        batch.debug_wait_for_pipelines();
        assert!(batch.pipelines_ready());
        let specs = batch.forward.as_ref().expect("the WGSL kernels have batched rows").matvec_specs();
        // qkv, o and down (one shape in this model), gate/up and the LM
        // head: the layers share them.
        assert_eq!(specs.len(), 4, "{specs:?}");
        let kernels = batch.model.kernels.clone();
        let ready = |rows| {
            specs.iter().all(|&(k, split, shape, f)| kernels.rows_pipeline_ready(k, split, shape, f, rows))
        };
        assert!((1..=3).all(ready), "a count up to the slots has no pipeline");
        assert!(!ready(4), "a count past the slots was built");
        // Steps of one and of three sessions then take the ready pipelines.
        let (mut a, mut b, mut c) =
            (batch.session().unwrap(), batch.session().unwrap(), batch.session().unwrap());
        for s in [&mut a, &mut b, &mut c] {
            s.feed(&[1, 2, 3]).unwrap();
        }
        batch.step(&mut [&mut a]).unwrap();
        batch.step(&mut [&mut a, &mut b, &mut c]).unwrap();
        assert!(!ready(4));
    }

    /// A step whose session count has no pipelines built yet runs its
    /// rows in a larger count's built pipelines (the extra rows computing
    /// values nobody reads), not each row through the one-token pipelines,
    /// and each session's tokens are still those it takes alone.
    #[test]
    fn a_step_runs_its_rows_in_a_larger_counts_pipelines_while_its_own_build() {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
        let model = engine.load(fixture, &options).unwrap();
        let prompts: [&[u32]; 2] = [&[1, 2, 3], &[7, 5, 9, 4, 11]];
        let n = 5;
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut s = model.session_with_capacity(32).unwrap();
                let first = s.feed(p).unwrap();
                std::iter::once(first).chain((1..n).map(|_| s.next_token().unwrap())).collect()
            })
            .collect();
        assert_ne!(alone[0], alone[1]);

        let mut batch =
            model.batch_without_warm_up(&BatchOptions::default().slots(4).capacity_per_slot(32)).unwrap();
        let specs = batch.forward.as_ref().expect("the WGSL kernels have batched rows").matvec_specs();
        let (gpu, kernels) = (batch.model.gpu.clone(), batch.model.kernels.clone());
        let ready = |rows| {
            specs.iter().all(|&(k, split, shape, f)| kernels.rows_pipeline_ready(k, split, shape, f, rows))
        };
        for &(k, split, shape, f) in &specs {
            assert!(kernels.matvec_rows_pipeline(&gpu, k, split, shape, f, 4).is_some());
        }
        assert!(ready(4) && !ready(2) && !ready(3));
        let (mut a, mut b) = (batch.session().unwrap(), batch.session().unwrap());
        let mut got = vec![vec![a.feed(prompts[0]).unwrap()], vec![b.feed(prompts[1]).unwrap()]];
        let sessions: &mut [&mut Session] = &mut [&mut a, &mut b];
        while got[0].len() < n {
            if let Some(tokens) = batch.try_step(sessions).unwrap() {
                for (g, t) in got.iter_mut().zip(tokens) {
                    g.push(t);
                }
            }
        }
        assert_eq!(got, alone);
        let (padded, per_row) = batch.debug_stand_in_launches();
        assert!(padded > 0, "no step ran in the 4-row pipelines");
        assert_eq!(per_row, 0, "a step ran its rows one at a time with 4-row pipelines built");
    }

    /// Which larger count a step of `rows` rows runs in: the smallest
    /// built one, up to the batch's rows and at most 4 times its own.
    #[test]
    fn a_step_takes_the_smallest_built_count_within_four_times_its_rows() {
        use crate::qwen3::padded_rows;
        let built = |counts: &'static [u32]| move |r| counts.contains(&r);
        assert_eq!(padded_rows(2, 16, built(&[16])), None, "16 rows cost more than two one-token passes");
        assert_eq!(padded_rows(2, 16, built(&[8, 16])), Some(8));
        assert_eq!(padded_rows(3, 16, built(&[5, 8, 16])), Some(5));
        assert_eq!(padded_rows(5, 16, built(&[16])), Some(16));
        assert_eq!(padded_rows(5, 8, built(&[16])), None, "past the batch's rows");
        assert_eq!(padded_rows(1, 16, built(&[2, 4])), None, "one row runs the one-token pipeline itself");
        assert_eq!(padded_rows(4, 16, built(&[4])), None, "only larger counts");
    }

    /// A `try_step` submits at most one step: the first call for some
    /// sessions submits theirs alone, and the step behind it goes with
    /// the next call (a frame pays for one step's recording).
    #[test]
    fn try_step_submits_one_step_a_call() {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
        let model = engine.load(fixture, &options).unwrap();
        let mut batch = model.batch(&BatchOptions::default().slots(2).capacity_per_slot(32)).unwrap();
        let (mut a, mut b) = (batch.session().unwrap(), batch.session().unwrap());
        a.feed(&[1, 2, 3]).unwrap();
        b.feed(&[4, 5]).unwrap();
        let in_flight = |batch: &super::Batch| (batch.ahead.is_some(), batch.behind.is_some());
        let sessions: &mut [&mut Session] = &mut [&mut a, &mut b];
        // The first calls only wait for the first step's recording; the
        // call that finds it recorded submits it, and only it.
        for _ in 0..10_000 {
            if in_flight(&batch) != (false, false) {
                break;
            }
            assert!(batch.try_step(sessions).unwrap().is_none());
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        assert_eq!(
            in_flight(&batch),
            (true, false),
            "the first submitting call submitted more than its step"
        );
        // The next call queues the step behind it, whether or not the
        // first step's tokens are back.
        let tokens = batch.try_step(sessions).unwrap();
        match tokens {
            None => assert_eq!(in_flight(&batch), (true, true)),
            Some(_) => assert_eq!(in_flight(&batch), (true, false)),
        }
    }
}
