//! Several sessions of one model decoding in one GPU step: a [`Batch`] owns
//! a KV pool (per layer one K and one V buffer of `slots` regions), hands
//! out sessions whose caches are its regions, and steps any of them
//! together. A step reads every weight matrix once for all its sessions;
//! each session attends over its own region at its own position and gets
//! its own greedy token, the very token it would get stepping alone (each
//! row runs its session's one-token arithmetic).

use std::sync::{mpsc, Arc, Mutex};

use super::Session;
use crate::buffers::{kv_region_bytes, KvRegion, SessionBuffers};
use crate::error::{Error, Result};
use crate::gpu_weights::ModelGpu;
use crate::kernels::{KernelSource, ATTENTION_CHUNK};
use crate::qwen3::BatchForward;
use crate::sampling::SamplingParams;

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
}

/// A session's hold on one slot of a batch's KV pool, given back when the
/// session is dropped.
pub(crate) struct SlotLease {
    pool: Arc<KvPool>,
    slot: usize,
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
/// Steps are greedy; a session sampling under other
/// [`SamplingParams`] is refused. On the MSL kernels (which have no batched
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
    forward: BatchForward,
    /// The rows' tokens, read back after each step.
    readback: wgpu::Buffer,
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
        let limit = limits.max_buffer_size.min(limits.max_storage_buffer_binding_size as u64);
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
                let forward = crate::qwen3::batch_forward(
                    gpu,
                    &model.kernels,
                    cfg,
                    &model.weights,
                    &bufs,
                    &rows,
                    &embed_step,
                )?;
                Ok((k, v, bufs, rows, embed_step, forward))
            },
            |reason| Error::GpuDeviceFailed { reason: format!("creating a batch: {reason}") },
        )?;
        let (k, v, bufs, rows, embed_step, forward) = built;
        let free = Mutex::new((0..slots).rev().collect());
        Ok(Batch {
            pool: Arc::new(KvPool { k, v, region_bytes, free }),
            slots,
            capacity,
            bufs,
            rows,
            embed_step,
            forward,
            readback: gpu.readback("batch tokens", 4 * slots),
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
        let extra = [&self.rows, &self.embed_step, &self.readback].iter().map(|b| b.size()).sum::<u64>();
        self.bufs.bytes() + self.forward.uniform_bytes + extra
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
        let lease = SlotLease { pool: self.pool.clone(), slot };
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
    /// Errors, before anything runs (no session changes):
    /// [`Error::InvalidArgument`] naming `sessions` for an empty list or a
    /// session that holds no slot of this batch (made by another batch, or
    /// by [`Model::session`](crate::Model::session)), naming `sampling` for
    /// a session that samples (steps are greedy), naming `session` for one
    /// with a [`Session::begin_feed`] in progress; `no_pending_token` for a
    /// session never fed; `context_overflow` for a full one. Then a GPU
    /// failure.
    pub fn step(&mut self, sessions: &mut [&mut Session]) -> Result<Vec<u32>> {
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
            if s.sampling != SamplingParams::default() {
                return Err(Error::invalid_argument(
                    "sampling",
                    format!("session {i} samples; batched steps are greedy only"),
                ));
            }
            s.check_can_step(1)?;
        }
        if self.model.kernels.source == KernelSource::Msl {
            // The MSL twins have no batched variants: each session's own
            // step (its arithmetic is that of the pipelines it runs alone).
            return sessions.iter_mut().map(|s| s.next_token()).collect();
        }
        for s in sessions.iter_mut() {
            s.discard_queued()?;
        }
        let n = sessions.len();
        let gpu = self.model.gpu.clone();
        let mut rows = Vec::with_capacity(2 * n);
        let mut tokens = vec![0u32];
        for s in sessions.iter() {
            let slot = s.kv_slot.as_ref().map_or(0, |l| l.slot) as u64;
            rows.extend([s.len as u32, (slot * self.pool.region_bytes / 16) as u32]);
            tokens.push(s.pending.ok_or(Error::NoPendingToken)?);
        }
        gpu.queue.write_buffer(&self.rows, 0, bytemuck::cast_slice(&rows));
        gpu.queue.write_buffer(&self.bufs.tokens, 0, bytemuck::cast_slice(&tokens));
        gpu.queue.write_buffer(&self.bufs.step, 0, bytemuck::cast_slice(&[0u32, 0]));
        let chunk = ATTENTION_CHUNK as usize;
        let short = sessions.iter().any(|s| s.len < chunk);
        let long = sessions.iter().any(|s| s.len >= chunk);
        let mut enc =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("batch step"),
                timestamp_writes: None,
            });
            self.forward.record(&mut pass, &gpu, &self.model.kernels, n as u32, short, long);
        }
        // Each row's token where its session's next step reads it.
        for (z, s) in sessions.iter().enumerate() {
            let at = 4 * (s.len as u64 + 1);
            enc.copy_buffer_to_buffer(&self.bufs.tokens, 4 * (1 + z as u64), &s.bufs.tokens, at, 4);
        }
        enc.copy_buffer_to_buffer(&self.bufs.tokens, 4, &self.readback, 0, 4 * n as u64);
        let submission = gpu.queue.submit([enc.finish()]);
        let (tx, mapped) = mpsc::channel();
        self.readback.slice(..4 * n as u64).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let wait = wgpu::PollType::Wait { submission_index: Some(submission), timeout: None };
        gpu.device.poll(wait).map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
        gpu.check_fault()?;
        let out: Vec<u32> = match mapped.try_recv() {
            Ok(Ok(())) => {
                let view = self
                    .readback
                    .slice(..4 * n as u64)
                    .get_mapped_range()
                    .map_err(|e| Error::GpuDeviceFailed { reason: format!("reading back: {e}") })?;
                let tokens = bytemuck::cast_slice(&view).to_vec();
                drop(view);
                self.readback.unmap();
                tokens
            }
            Ok(Err(e)) => return Err(Error::GpuDeviceFailed { reason: format!("map_async: {e}") }),
            Err(_) => {
                return Err(Error::GpuDeviceFailed { reason: "the batch's tokens never arrived".into() })
            }
        };
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = out.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::GpuDeviceFailed {
                reason: format!("argmax returned {bad} (non-finite logits?)"),
            });
        }
        for (s, &token) in sessions.iter_mut().zip(&out) {
            s.len += 1;
            s.pending = Some(token);
            s.reset_gpu_position();
        }
        Ok(out)
    }
}
