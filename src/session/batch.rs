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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use super::recorder::{take_recorded, ReadbackCopy, Recordable, Recorder};
use super::{Mapping, Session};
use crate::buffers::{kv_region_bytes, KvRegion, SessionBuffers};
use crate::error::{Error, Result};
use crate::gpu::Timestamps;
use crate::gpu_weights::ModelGpu;
use crate::kernels::{KernelSource, Launch, LaunchKind, ATTENTION_CHUNK};
use crate::qwen3::BatchForward;

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
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions { slots: 8, capacity_per_slot: 1024 }
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
}

/// The KV buffers of a batch and which of their regions are free.
struct KvPool {
    k: Vec<wgpu::Buffer>,
    v: Vec<wgpu::Buffer>,
    /// Bytes of one slot's region (a multiple of 256: a binding offset).
    region_bytes: u64,
    free: Mutex<Vec<usize>>,
    /// Leases handed out so far (each lease's number: a session's identity
    /// in the batch, never reused, unlike its slot).
    leases: AtomicU64,
}

/// A session's hold on one slot of a batch's KV pool, given back when the
/// session is dropped.
pub(crate) struct SlotLease {
    pool: Arc<KvPool>,
    slot: usize,
    /// This lease's number in its pool.
    number: u64,
}

impl SlotLease {
    /// Where the slot's cache lies.
    pub(crate) fn region(&self) -> KvRegion {
        let p = &self.pool;
        KvRegion {
            k: p.k.clone(),
            v: p.v.clone(),
            offset: self.slot as u64 * p.region_bytes,
            bytes: p.region_bytes,
        }
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.slot);
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
    recordings: (u64, u64),
}

/// What a session must hold for a step to be its next one: (its lease's
/// number, feeds and truncations, length, pending token). The lease, not
/// the slot: a slot freed and taken again holds another session.
type RowKey = (u64, u64, usize, Option<u32>);

/// What a batch step's commands depend on per row besides the row count
/// and order: (its session's lease number, feeds, truncations and changes
/// of how it chooses its token, position). Not the pending token: a step's
/// input tokens are written at its submit.
type RecordingKey = (u64, u64, usize);

/// Everything the commands of one batch step depend on (shared handles),
/// so that they can be recorded on another thread: see [`Batch::step_job`].
#[derive(Clone)]
struct StepJob {
    model: Arc<ModelGpu>,
    forward: Option<Arc<BatchForward>>,
    rows: u32,
    /// Whether any row's context fits one chunk of positions / needs more.
    short: bool,
    long: bool,
    /// Build row pipelines missing now (see [`BatchForward::record`]).
    wait: bool,
    /// The batch's logits (rows `vocab_size` apart).
    logits: wgpu::Buffer,
    /// The rows that choose their token with their session's launches.
    choices: Vec<RowChoice>,
    /// Each row's token to where it goes next, then the tokens to the
    /// readback buffer.
    copies: Vec<ReadbackCopy>,
}

/// A row choosing its token with its session's own launches.
#[derive(Clone)]
struct RowChoice {
    row: usize,
    /// Its session's logits, where its launches read them.
    logits: wgpu::Buffer,
    launches: Vec<Launch>,
}

impl StepJob {
    /// Records the step, with a GPU timestamp after each launch of the
    /// batch's pass into `timestamps` (query 0 before the first; each
    /// launch's kind pushed to its list) when given.
    fn encode_timed(
        &self,
        mut timestamps: Option<(&Timestamps, &mut Vec<LaunchKind>)>,
    ) -> wgpu::CommandBuffer {
        let gpu = &self.model.gpu;
        let kernels = &self.model.kernels;
        let (rows, short, long, wait) = (self.rows, self.short, self.long, self.wait);
        let mut enc =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("batch step"),
                timestamp_writes: None,
            });
            if let Some(forward) = &self.forward {
                match timestamps.as_mut() {
                    Some((ts, kinds)) => {
                        pass.write_timestamp(&ts.set, 0);
                        let mut q = 1;
                        let mut after = |pass: &mut wgpu::ComputePass<'_>, kind| {
                            pass.write_timestamp(&ts.set, q);
                            kinds.push(kind);
                            q += 1;
                        };
                        forward.record_each(&mut pass, gpu, kernels, rows, short, long, wait, &mut after);
                    }
                    None => forward.record(&mut pass, gpu, kernels, rows, short, long, wait),
                }
            }
        }
        // A row that samples (or applies penalties) chooses its token with
        // its session's own launches over its session's buffers: its logits
        // row copied there, at its own position (the draw is keyed by it),
        // so it draws the very token it would draw alone.
        let row_bytes = 4 * self.model.config.vocab_size as u64;
        for choice in &self.choices {
            enc.copy_buffer_to_buffer(
                &self.logits,
                choice.row as u64 * row_bytes,
                &choice.logits,
                0,
                row_bytes,
            );
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("batch row's token choice"),
                timestamp_writes: None,
            });
            for l in &choice.launches {
                l.record(&mut pass, kernels);
            }
        }
        for c in &self.copies {
            enc.copy_buffer_to_buffer(&c.src, c.src_offset, &c.dst, c.dst_offset, c.size);
        }
        if let Some((ts, _)) = &timestamps {
            ts.resolve(&mut enc);
        }
        enc.finish()
    }
}

impl Recordable for StepJob {
    fn encode(&self) -> wgpu::CommandBuffer {
        self.encode_timed(None)
    }
}

/// A batch step whose commands are recorded (or being recorded) ahead.
struct PrerecordedStep {
    /// Per row, what the commands were recorded for.
    rows: Vec<RecordingKey>,
    /// The readback buffer its tokens are copied to.
    readback: usize,
    /// The job, kept to record it on the caller's thread should the
    /// recorder be gone.
    job: StepJob,
    commands: mpsc::Receiver<wgpu::CommandBuffer>,
    /// The commands, once [`Self::is_ready`] has seen them arrive.
    arrived: Option<wgpu::CommandBuffer>,
}

impl PrerecordedStep {
    /// Whether the commands can be submitted without waiting for the
    /// recorder: recorded, or the recorder gone (they are then recorded
    /// on the caller's thread).
    fn is_ready(&mut self) -> bool {
        if self.arrived.is_none() {
            match self.commands.try_recv() {
                Ok(commands) => self.arrived = Some(commands),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => {}
            }
        }
        true
    }

    /// The commands, waiting for the recorder if need be.
    fn take(self) -> wgpu::CommandBuffer {
        match self.arrived {
            Some(commands) => commands,
            None => {
                take_recorded(&self.commands, true, || self.job.encode()).unwrap_or_else(|| self.job.encode())
            }
        }
    }
}

/// A batch step on the GPU.
struct InFlightStep {
    /// Per row, its session's [`RowKey`]. The pending token of a step
    /// queued ahead is known once the step before it is read back.
    rows: Vec<RowKey>,
    readback: usize,
    mapping: Mapping,
}

impl InFlightStep {
    /// Whether the step's tokens are mapped (`Ok(true)`), not yet
    /// (`Ok(false)`), or never will be (a failed mapping), without waiting.
    fn arrived(&mut self) -> Result<bool> {
        if !self.mapping.arrived()? {
            return Ok(false);
        }
        self.mapping.check()?;
        Ok(true)
    }
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
        let region_bytes = kv_region_bytes(cfg, capacity);
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
                let bufs = SessionBuffers::for_rows(gpu, cfg, capacity, slots, whole)?;
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
        let free = Mutex::new((0..slots).rev().collect());
        Ok(Batch {
            pool: Arc::new(KvPool { k, v, region_bytes, free, leases: AtomicU64::new(0) }),
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
            recordings: (0, 0),
            model,
        })
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
        Session::new_in(self.model.clone(), self.capacity, Some(lease))
    }

    /// Advances each of `sessions` by one token, in one GPU step, and
    /// returns their new tokens in order: for each session, exactly what
    /// [`Session::next_token`] would return, and the session is left as
    /// that call would leave it (the token pending, the previous one in its
    /// KV cache). Steps the sessions had queued ahead alone are discarded
    /// first. Each call passes any sessions of this batch, so sessions join
    /// and leave between calls.
    ///
    /// Before waiting for its tokens, a call queues the next step for the
    /// same sessions, so the GPU runs it while the caller handles these
    /// tokens: the next call with the same sessions, in the same order and
    /// untouched in between, gets its tokens without a step's wait. Any
    /// other call drops it (waiting for it first); what it wrote lies past
    /// each session's length, as for a session's own steps queued ahead.
    /// A call after a [`Batch::try_step`] that returned `None` for the same
    /// sessions waits for that step and returns its tokens.
    ///
    /// Errors, before anything runs (no session changes):
    /// [`Error::InvalidArgument`] naming `sessions` for an empty list or a
    /// session that holds no slot of this batch (made by another batch, or
    /// by [`Model::session`](crate::Model::session)), naming `logprobs` for one
    /// reporting log-probabilities, naming `session` for one
    /// with a [`Session::begin_feed`] in progress; `no_pending_token` for a
    /// session never fed; `context_overflow` for a full one. Then a GPU
    /// failure.
    pub fn step(&mut self, sessions: &mut [&mut Session]) -> Result<Vec<u32>> {
        self.check_step(sessions)?;
        if self.forward.is_none() {
            // The MSL twins have no batched variants: each session's own
            // step (its arithmetic is that of the pipelines it runs alone).
            return sessions.iter_mut().map(|s| s.next_token()).collect();
        }
        let rows: Vec<RowKey> = sessions.iter().map(|s| row_key(s, 0)).collect();
        // The step queued ahead by the last call serves when the sessions
        // are those it ran for, in the same order and state; otherwise it
        // is dropped (what it wrote lies past each session's length).
        let mut current = match self.ahead.take() {
            Some(ahead) if ahead.rows == rows => ahead,
            other => {
                self.ahead = other;
                self.drop_stale_steps()?;
                for s in sessions.iter_mut() {
                    s.discard_queued()?;
                }
                let pending: Vec<u32> = rows.iter().map(|r| r.3.unwrap_or(0)).collect();
                self.submit(sessions, 0, Some(&pending), 0, true)
            }
        };
        // Steps a session queued alone since are discarded (they ran after
        // the batch's and wrote the same values).
        for s in sessions.iter_mut() {
            if let Err(e) = s.discard_queued() {
                self.ahead = Some(current); // in flight: the next call drops it
                return Err(e);
            }
        }
        // The next step for the same sessions, queued before waiting (a
        // try_step may have queued it already): the GPU runs it while the
        // host handles this one's tokens. Its inputs are this step's
        // tokens, already on the GPU.
        let room = sessions.iter().all(|s| s.len + 2 <= s.bufs.capacity);
        let next = match self.behind.take() {
            Some(next) => Some(next),
            None => room.then(|| self.submit(sessions, 1, None, 1 - current.readback, true)),
        };
        let out = self.wait(&mut current).and_then(|()| self.read_tokens(current.readback, sessions.len()));
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                // Leave no readback buffer with a mapping pending.
                if let Some(mut next) = next {
                    if self.wait(&mut next).is_ok() {
                        self.readbacks[next.readback].unmap();
                    }
                }
                return Err(e);
            }
        };
        self.advance(sessions, &out, next);
        Ok(out)
    }

    /// [`Batch::step`] that never waits for the GPU (a host that renders
    /// calls it once a frame and keeps its frame rate): `Ok(None)` while
    /// the step's tokens are on their way, leaving every session as it was
    /// (its length, pending token and context); then `Ok(Some(tokens))`,
    /// the tokens [`Batch::step`] returns, each session advanced as `step`
    /// advances it.
    ///
    /// ```no_run
    /// # fn frame(batch: &mut qwen3_wgpu::Batch, a: &mut qwen3_wgpu::Session, b: &mut qwen3_wgpu::Session) -> qwen3_wgpu::Result<()> {
    /// if let Some(tokens) = batch.try_step(&mut [a, b])? {
    ///     println!("{tokens:?}"); // one token each, in order
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// A call submits at most one step. The first call for some sessions
    /// starts recording their step on a thread of the batch's own and
    /// returns `None`; the first call that finds it recorded submits it
    /// (and returns `None`); calls with the same
    /// sessions, in the same order and untouched in between, submit the
    /// next step behind it (as `step` does) and poll the device until the
    /// step's tokens are back (the call that returns them leaves the next
    /// step in flight, so the following call may find its tokens at once).
    /// A call with other sessions, another order, or a session changed in
    /// between (fed, truncated, stepped alone,
    /// dropped) drops the steps in flight once they have finished (they
    /// advanced no session, so no token is lost; what they wrote lies past
    /// each session's length) and returns `None` until then; then it
    /// records and submits the step of its own sessions as a first call
    /// does. Steps a session queued alone
    /// are discarded once they have finished, in the same way.
    /// [`Batch::step`] and `try_step` mix freely: either one takes over
    /// the step the other left in flight for the same sessions (`step`
    /// waits for it). Each session count has its own pipelines; `try_step`
    /// never builds them on the caller's thread: their build starts on a
    /// thread of its own, and until it is done that count's steps run each
    /// row through the one-token pipelines (the same tokens).
    ///
    /// Nor does it record steps on the caller's thread: right after a call
    /// submits a step, the commands of the next one for the same sessions
    /// are recorded on the batch's thread, so the call that submits it only
    /// writes the rows' positions and submits them (waiting for that
    /// recording only if it is not done yet, at most one step's
    /// recording). Commands recorded for sessions that changed since
    /// (another list or order, a session fed, truncated, given other
    /// sampling parameters or dropped) are dropped unsubmitted, and the
    /// step is recorded anew there as a first call's. Only where no thread
    /// can be started is a step recorded on the caller's thread.
    ///
    /// Errors: those of [`Batch::step`], before anything is submitted;
    /// then a GPU failure.
    pub fn try_step(&mut self, sessions: &mut [&mut Session]) -> Result<Option<Vec<u32>>> {
        self.check_step(sessions)?;
        if self.forward.is_none() {
            return try_step_each(sessions);
        }
        self.poll()?;
        let rows: Vec<RowKey> = sessions.iter().map(|s| row_key(s, 0)).collect();
        let mut current = match self.ahead.take() {
            Some(ahead) if ahead.rows == rows => ahead,
            other => {
                self.ahead = other;
                if !self.try_drop_stale_steps()? || !own_steps_arrived(sessions)? {
                    return Ok(None);
                }
                // Nothing of theirs is in flight: discarding waits for nothing.
                for s in sessions.iter_mut() {
                    s.discard_queued()?;
                }
                // Nor is a step of this list recorded yet: its recording
                // starts on the batch's recorder and a later call submits
                // it (a frame's call never records a step itself).
                if !self.first_step_ready(sessions) {
                    return Ok(None);
                }
                // This call submits the step; later calls submit the next
                // one behind it and poll for its tokens (one submit a
                // call: a frame pays for one step's recording).
                let pending: Vec<u32> = rows.iter().map(|r| r.3.unwrap_or(0)).collect();
                self.ahead = Some(self.submit(sessions, 0, Some(&pending), 0, false));
                return Ok(None);
            }
        };
        // The next step behind this one, as `step` queues it (unless a
        // call queued it already).
        let room = sessions.iter().all(|s| s.len + 2 <= s.bufs.capacity);
        if self.behind.is_none() && room {
            self.behind = Some(self.submit(sessions, 1, None, 1 - current.readback, false));
        }
        // A failed mapping drops the step (its buffer is not mapped); the
        // one behind it is dropped as stale by the next call.
        if !current.arrived()? || !own_steps_arrived(sessions)? {
            self.ahead = Some(current);
            return Ok(None);
        }
        for s in sessions.iter_mut() {
            if let Err(e) = s.discard_queued() {
                self.ahead = Some(current); // mapped: the next call unmaps it
                return Err(e);
            }
        }
        let out = self.read_tokens(current.readback, sessions.len())?;
        let next = self.behind.take();
        self.advance(sessions, &out, next);
        Ok(Some(out))
    }

    /// Runs one step of `sessions` (as [`Batch::step`], nothing queued
    /// ahead) with a GPU timestamp after each launch of the batch's pass,
    /// and returns each launch's kind and GPU time in microseconds; `None`
    /// where the device cannot time inside a pass or the kernels have no
    /// batched variants. A diagnostic for the `profile` tool.
    #[doc(hidden)]
    pub fn profile_step(&mut self, sessions: &mut [&mut Session]) -> Result<Option<Vec<(LaunchKind, f64)>>> {
        self.check_step(sessions)?;
        let gpu = self.model.gpu.clone();
        let Some(forward) = &self.forward else { return Ok(None) };
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        let short = sessions.iter().any(|s| s.len < ATTENTION_CHUNK as usize);
        let long = sessions.iter().any(|s| s.len >= ATTENTION_CHUNK as usize);
        let count = forward.launch_count(short, long) as u32 + 1;
        self.drop_stale_steps()?;
        for s in sessions.iter_mut() {
            s.discard_queued()?;
        }
        let ts = Timestamps::new(&gpu, "batch launch timestamps", count);
        let mut kinds = Vec::new();
        let pending: Vec<u32> = sessions.iter().map(|s| s.pending.unwrap_or(0)).collect();
        self.prerecorded = None;
        self.recordings.0 += 1;
        let commands = self.step_job(sessions, 0, 0, true).encode_timed(Some((&ts, &mut kinds)));
        let mut step = self.submit_commands(sessions, 0, Some(&pending), 0, commands);
        self.wait(&mut step)?;
        let out = self.read_tokens(step.readback, sessions.len())?;
        self.advance(sessions, &out, None);
        let us = ts.intervals_us(&gpu)?;
        Ok(Some(kinds.into_iter().zip(us).collect()))
    }

    /// Waits on the GPU by this batch so far (a [`Batch::try_step`] never
    /// adds one): for tests that check that it never waits.
    #[doc(hidden)]
    pub fn debug_blocking_waits(&self) -> u64 {
        self.blocking_waits
    }

    /// Steps submitted by this batch so far whose commands were recorded
    /// on the caller's thread, and whose commands were recorded ahead on
    /// the batch's recorder: for tests that check which steps were
    /// recorded where.
    #[doc(hidden)]
    pub fn debug_step_recordings(&self) -> (u64, u64) {
        self.recordings
    }

    /// Checks the sessions of a step ([`Batch::step`]'s errors), changing
    /// nothing.
    fn check_step(&self, sessions: &[&mut Session]) -> Result<()> {
        if sessions.is_empty() {
            return Err(Error::invalid_argument("sessions", "an empty batch: pass at least one session"));
        }
        for (i, s) in sessions.iter().enumerate() {
            match &s.kv_slot {
                Some(lease) if Arc::ptr_eq(&lease.pool, &self.pool) => {}
                _ => {
                    return Err(Error::invalid_argument(
                        "sessions",
                        format!("session {i} holds no slot of this batch (make it with Batch::session)"),
                    ))
                }
            }
            if s.logprobs > 0 {
                return Err(Error::invalid_argument(
                    "logprobs",
                    format!("session {i} reports log-probabilities; batched steps do not compute them"),
                ));
            }
            s.check_can_step(1)?;
        }
        Ok(())
    }

    /// Gives each session its token (the pending one before it is now in
    /// its KV cache) and makes `next`, if any, the step ahead, its rows'
    /// pending tokens now known.
    fn advance(&mut self, sessions: &mut [&mut Session], tokens: &[u32], next: Option<InFlightStep>) {
        for (s, &token) in sessions.iter_mut().zip(tokens) {
            s.len += 1;
            s.pending = Some(token);
            s.reset_gpu_position();
        }
        self.ahead = next.map(|mut next| {
            for (row, s) in next.rows.iter_mut().zip(sessions.iter()) {
                row.3 = s.pending;
            }
            next
        });
    }

    /// Drops the steps in flight for an earlier call (what they wrote lies
    /// past each session's length), waiting for each: a readback buffer
    /// must not be reused while its mapping is pending.
    fn drop_stale_steps(&mut self) -> Result<()> {
        let mut result = Ok(());
        for mut stale in [self.ahead.take(), self.behind.take()].into_iter().flatten() {
            match self.wait(&mut stale) {
                Ok(()) => self.readbacks[stale.readback].unmap(),
                Err(e) => result = result.and(Err(e)),
            }
        }
        result
    }

    /// [`Self::drop_stale_steps`] without waiting: `Ok(false)` while one of
    /// them is still running (those not finished stay in flight).
    fn try_drop_stale_steps(&mut self) -> Result<bool> {
        for slot in [&mut self.ahead, &mut self.behind] {
            if let Some(step) = slot {
                match step.arrived() {
                    Ok(false) => return Ok(false),
                    Ok(true) => self.readbacks[step.readback].unmap(),
                    // A failed mapping leaves nothing mapped.
                    Err(e) => {
                        *slot = None;
                        return Err(e);
                    }
                }
                *slot = None;
            }
        }
        Ok(true)
    }

    /// Polls the device without waiting: mappings of finished steps complete.
    fn poll(&self) -> Result<()> {
        let gpu = &self.model.gpu;
        gpu.device
            .poll(wgpu::PollType::Poll)
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
        gpu.check_fault()
    }

    /// Submits one step of `sessions` at their lengths plus `offset`, each
    /// row's input token from `tokens` (or, without, the previous step's
    /// on the GPU), its token copied to its session's token sequence and to
    /// readback buffer `readback`. `wait`: the row pipelines of this
    /// session count are built now if not yet (a blocking step); otherwise
    /// they are built on another thread meanwhile (see
    /// [`BatchForward::record`]), the commands recorded ahead for this very
    /// step serve if there are any (waiting for their recording to end if
    /// need be: it started a submit earlier), and the next step's are
    /// recorded ahead once this one is submitted.
    fn submit(
        &mut self,
        sessions: &[&mut Session],
        offset: usize,
        tokens: Option<&[u32]>,
        readback: usize,
        wait: bool,
    ) -> InFlightStep {
        let key = recording_key(sessions, offset);
        // Commands recorded for other rows, positions or token choices
        // are dropped unsubmitted.
        let recorded = self.prerecorded.take().filter(|p| !wait && p.rows == key && p.readback == readback);
        let commands = match recorded {
            Some(p) => {
                self.recordings.1 += 1;
                p.take()
            }
            None => {
                self.recordings.0 += 1;
                self.step_job(sessions, offset, readback, wait).encode()
            }
        };
        let step = self.submit_commands(sessions, offset, tokens, readback, commands);
        if !wait {
            self.record_ahead(sessions, offset + 1, 1 - readback);
        }
        step
    }

    /// Whether the first step of `sessions` (a list with no step in
    /// flight) is recorded and can be submitted without waiting: if no
    /// recording of it is under way, one starts on the batch's recorder.
    /// True where no recorder thread can run (the step is then recorded on
    /// the caller's thread).
    fn first_step_ready(&mut self, sessions: &[&mut Session]) -> bool {
        let key = recording_key(sessions, 0);
        match &mut self.prerecorded {
            Some(p) if p.rows == key && p.readback == 0 => p.is_ready(),
            _ => {
                self.record_ahead(sessions, 0, 0);
                self.prerecorded.is_none()
            }
        }
    }

    /// Starts recording the step of `sessions` at their lengths plus
    /// `offset` (the one after the step just submitted: the next submit
    /// for the same sessions), its tokens to readback buffer `readback`,
    /// on the batch's recorder, unless it would not fit.
    fn record_ahead(&mut self, sessions: &[&mut Session], offset: usize, readback: usize) {
        if !sessions.iter().all(|s| s.len + offset < s.bufs.capacity) {
            return;
        }
        if self.recorder.is_none() {
            self.recorder = Recorder::start();
        }
        let job = self.step_job(sessions, offset, readback, false);
        let Some(recorder) = &self.recorder else { return };
        let commands = recorder.record(job.clone());
        let rows = recording_key(sessions, offset);
        self.prerecorded = Some(PrerecordedStep { rows, readback, job, commands, arrived: None });
    }

    /// What the commands of the step of `sessions` at their lengths plus
    /// `offset` record (see [`Self::submit`]): the batch's launches for
    /// the row count and the rows' positions, each row's own token choice
    /// where it samples, and the copies of the tokens. The rows' positions
    /// and input tokens are buffer contents, written at the submit
    /// ([`Self::submit_commands`]).
    fn step_job(&self, sessions: &[&mut Session], offset: usize, readback: usize, wait: bool) -> StepJob {
        let n = sessions.len();
        let chunk = ATTENTION_CHUNK as usize;
        let choices = sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| chooses_alone(s))
            .map(|(row, s)| RowChoice {
                row,
                logits: s.bufs.logits.clone(),
                launches: s.forward.choose.clone(),
            })
            .collect();
        // Each row's token where its session's next step reads it (a row
        // choosing alone: from where its choice wrote it, to the batch's
        // row, which the readback and the next batch step read).
        let mut copies = Vec::with_capacity(n + 1);
        for (z, s) in sessions.iter().enumerate() {
            let at = 4 * (s.len + offset + 1) as u64;
            let row = 4 * (1 + z as u64);
            let (batch, own) = (self.bufs.tokens.clone(), s.bufs.tokens.clone());
            copies.push(if chooses_alone(s) {
                ReadbackCopy { src: own, src_offset: at, dst: batch, dst_offset: row, size: 4 }
            } else {
                ReadbackCopy { src: batch, src_offset: row, dst: own, dst_offset: at, size: 4 }
            });
        }
        copies.push(ReadbackCopy {
            src: self.bufs.tokens.clone(),
            src_offset: 4,
            dst: self.readbacks[readback].clone(),
            dst_offset: 0,
            size: 4 * n as u64,
        });
        StepJob {
            model: self.model.clone(),
            forward: self.forward.clone(),
            rows: n as u32,
            short: sessions.iter().any(|s| s.len + offset < chunk),
            long: sessions.iter().any(|s| s.len + offset >= chunk),
            wait,
            logits: self.bufs.logits.clone(),
            choices,
            copies,
        }
    }

    /// Writes what the step of `sessions` at their lengths plus `offset`
    /// reads from the host (each row's position and KV offset, the input
    /// tokens when given, each sampling row's position), then submits its
    /// `commands` (recorded by [`Self::step_job`] for the same step) and
    /// starts mapping readback buffer `readback`.
    fn submit_commands(
        &self,
        sessions: &[&mut Session],
        offset: usize,
        tokens: Option<&[u32]>,
        readback: usize,
        commands: wgpu::CommandBuffer,
    ) -> InFlightStep {
        let n = sessions.len();
        let gpu = &self.model.gpu;
        let mut rows = Vec::with_capacity(2 * n);
        for s in sessions {
            let slot = s.kv_slot.as_ref().map_or(0, |l| l.slot) as u64;
            rows.extend([(s.len + offset) as u32, (slot * self.pool.region_bytes / 16) as u32]);
        }
        // Written before the submit, after the submits before it (queue order).
        gpu.queue.write_buffer(&self.rows, 0, bytemuck::cast_slice(&rows));
        if let Some(tokens) = tokens {
            gpu.queue.write_buffer(&self.bufs.tokens, 4, bytemuck::cast_slice(tokens));
        }
        gpu.queue.write_buffer(&self.bufs.step, 0, bytemuck::cast_slice(&[0u32, 0]));
        for s in sessions.iter().filter(|s| chooses_alone(s)) {
            // Its choice reads tokens[pos] back through the penalty window
            // and writes tokens[pos + 1].
            let pos = s.len + offset;
            s.write_step_at(pos, pos + 1);
        }
        let submission = gpu.queue.submit([commands]);
        let buf = &self.readbacks[readback];
        let mapping = Mapping::start(buf.slice(..4 * n as u64), submission);
        let rows = sessions.iter().map(|s| row_key(s, offset)).collect();
        InFlightStep { rows, readback, mapping }
    }

    /// Waits until `step`'s tokens are mapped (at once when they are).
    fn wait(&mut self, step: &mut InFlightStep) -> Result<()> {
        step.mapping.wait(&self.model.gpu, &mut self.blocking_waits)?;
        step.mapping.check()
    }

    /// The `n` tokens of mapped readback buffer `readback` (then unmapped),
    /// checked against the vocabulary.
    fn read_tokens(&self, readback: usize, n: usize) -> Result<Vec<u32>> {
        let buf = &self.readbacks[readback];
        let out: Vec<u32> = {
            let view = buf
                .slice(..4 * n as u64)
                .get_mapped_range()
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("reading back: {e}") })?;
            bytemuck::cast_slice(&view).to_vec()
        };
        buf.unmap();
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = out.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::GpuDeviceFailed {
                reason: format!("argmax returned {bad} (non-finite logits?)"),
            });
        }
        Ok(out)
    }
}

/// Whether `s` chooses its token with its own launches in a batch step
/// (it samples or applies penalties) rather than by the batch's argmax.
fn chooses_alone(s: &Session) -> bool {
    !s.sampling.is_greedy() || s.sampling.has_penalties()
}

/// `s`'s key as a step `offset` positions on from now finds it (the pending
/// token of a later step is not known yet).
fn row_key(s: &Session, offset: usize) -> RowKey {
    let lease = s.kv_slot.as_ref().map_or(u64::MAX, |l| l.number);
    (lease, s.edits, s.len + offset, if offset == 0 { s.pending } else { None })
}

/// Per row, the key of the commands of the step `offset` positions on
/// from now (see [`RecordingKey`]).
fn recording_key(sessions: &[&mut Session], offset: usize) -> Vec<RecordingKey> {
    sessions.iter().map(|s| row_key(s, offset)).map(|(lease, edits, pos, _)| (lease, edits, pos)).collect()
}

/// Whether every step the sessions queued alone has its token back (so
/// discarding them waits for nothing).
fn own_steps_arrived(sessions: &mut [&mut Session]) -> Result<bool> {
    for s in sessions.iter_mut() {
        for q in s.queued.iter_mut() {
            if !q.arrived()? {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// [`Batch::try_step`] on kernels without batched variants: each session's
/// own steps are queued, and the tokens taken once every session's has
/// arrived (all or none: a `None` leaves every session as it was).
fn try_step_each(sessions: &mut [&mut Session]) -> Result<Option<Vec<u32>>> {
    for s in sessions.iter_mut() {
        s.queue_ahead(1)?;
    }
    if let Some(s) = sessions.first() {
        let gpu = &s.model.gpu;
        gpu.device
            .poll(wgpu::PollType::Poll)
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
        gpu.check_fault()?;
    }
    for s in sessions.iter_mut() {
        let front = s.queued.front_mut().ok_or_else(super::no_step_in_flight)?;
        if !front.arrived()? {
            return Ok(None);
        }
    }
    sessions.iter_mut().map(|s| s.take_queued()).collect::<Result<Vec<u32>>>().map(Some)
}

#[cfg(test)]
mod tests {
    use crate::{AdapterPolicy, BatchOptions, CachePolicy, Engine, LoadOptions, Session};

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
