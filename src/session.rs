//! A decoding session: the KV cache (allocated once for its capacity), the
//! activation buffers, and the recorded forward pass. The decode position
//! and the token sequence live on the GPU (the argmax writes the next token
//! where the next step's embedding reads it), so decode steps are queued
//! ahead of the caller: while the caller handles token N, the GPU already
//! runs the steps after it, and each step's 4-byte token comes back through
//! its own small readback buffer without stalling the queue.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{mpsc, Arc};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Timestamps};
use crate::kernels::{Kernels, LaunchKind, ARGMAX_CHUNK, ATTENTION_CHUNK};
use crate::model::GpuWeights;
use crate::qwen3::Forward;
use crate::weights::QUANT_GROUP;

/// Decode steps queued on the GPU ahead of the caller by default (see
/// [`Session::set_lookahead`]). Enough to hide the host's encoding and
/// readback behind the GPU's work; each costs at most one wasted step when
/// the caller stops early.
pub const DEFAULT_LOOKAHEAD: usize = 4;

/// Prompt tokens run through the layers together (one launch per kernel
/// for the whole batch; the activation buffers hold this many rows, and the
/// attention partials this many per chunk of the capacity: 8 KiB per
/// position of capacity for the 0.6B model, 7% of its KV cache). 256
/// measured best on the H200 short of 512 (BENCHMARKS.md).
pub const PREFILL_BATCH: usize = 256;
const _: () = assert!(PREFILL_BATCH.is_multiple_of(crate::kernels::MATMUL_TOKENS_PER_WG as usize));

/// Buffers of one session.
pub struct SessionBuffers {
    pub capacity: usize,
    /// Token rows of the activation buffers ([`PREFILL_BATCH`]); decode
    /// uses row 0.
    pub batch: usize,
    /// The token sequence (u32), `capacity + 1` entries: prompt tokens are
    /// written by the host, the rest by the argmax (`tokens[pos + 1]`).
    pub tokens: wgpu::Buffer,
    /// `{pos, fill_end}`: the position being processed (advanced by the
    /// argmax) and the first position the argmax may write a token to.
    pub step: wgpu::Buffer,
    pub x: wgpu::Buffer,
    pub qkv: wgpu::Buffer,
    pub q: wgpu::Buffer,
    pub attn: wgpu::Buffer,
    pub h: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    /// Per-chunk argmax results (value, index).
    pub part_val: wgpu::Buffer,
    pub part_idx: wgpu::Buffer,
    /// Chunks of positions attention splits the context into.
    pub attention_chunks: usize,
    /// Per (head, chunk): softmax max and sum, and the weighted V sum.
    pub attn_ml: wgpu::Buffer,
    pub attn_acc: wgpu::Buffer,
    /// RoPE (cos, sin) table, `[capacity][head_dim / 2]`.
    pub rope: wgpu::Buffer,
    /// Per layer, f16 pairs packed in u32: `[kv_head][capacity][head_dim/2]`.
    pub k_cache: Vec<wgpu::Buffer>,
    pub v_cache: Vec<wgpu::Buffer>,
}

/// `n` rounded up to the quant group: the row length of every activation
/// buffer (a consuming matvec reads its input in whole groups).
pub(crate) fn padded(n: usize) -> usize {
    n.div_ceil(QUANT_GROUP) * QUANT_GROUP
}

impl SessionBuffers {
    fn new(gpu: &Gpu, cfg: &ModelConfig, capacity: usize) -> Result<Self> {
        let f = |label: &str, n: usize| gpu.storage(label, 4 * n);
        let kv_words = cfg.num_key_value_heads * capacity * cfg.head_dim / 2;
        let chunks = capacity.div_ceil(ATTENTION_CHUNK as usize);
        // Short contexts need no more rows than they have, rounded up to
        // the tiled prefill matvec's tokens per workgroup (it reads and
        // writes whole tiles; the groups of 4 tokens of the per-token
        // matvec and of attention_prefill divide them).
        let batch =
            PREFILL_BATCH.min(capacity.next_multiple_of(crate::kernels::MATMUL_TOKENS_PER_WG as usize));
        let rows = |n: usize| batch * padded(n);
        Ok(SessionBuffers {
            capacity,
            batch,
            tokens: f("tokens", capacity + 1),
            step: f("step", 2),
            // Rows are padded to the quant group; the padding stays zero.
            x: f("x", rows(cfg.hidden_size)),
            qkv: f("qkv", rows(cfg.qkv_rows())),
            q: f("q", batch * cfg.q_dim()),
            attn: f("attn", rows(cfg.q_dim())),
            h: f("h", rows(cfg.intermediate_size)),
            logits: f("logits", cfg.vocab_size),
            part_val: f("part_val", cfg.vocab_size.div_ceil(ARGMAX_CHUNK as usize)),
            part_idx: f("part_idx", cfg.vocab_size.div_ceil(ARGMAX_CHUNK as usize)),
            attention_chunks: chunks,
            attn_ml: f("attn_ml", batch * 2 * cfg.num_attention_heads * chunks),
            attn_acc: f("attn_acc", batch * cfg.num_attention_heads * chunks * cfg.head_dim),
            rope: gpu.storage_init(
                "rope",
                bytemuck::cast_slice(&crate::qwen3::rope_table(cfg.head_dim, capacity, cfg.rope_theta)),
            )?,
            k_cache: (0..cfg.num_hidden_layers).map(|_| f("k_cache", kv_words)).collect(),
            v_cache: (0..cfg.num_hidden_layers).map(|_| f("v_cache", kv_words)).collect(),
        })
    }
}

/// A token on its way back from the GPU: the readback slot it is copied
/// into and the signal that the slot is mapped.
struct InFlight {
    slot: usize,
    /// The submit that carries the step (a wait waits for it alone).
    submission: wgpu::SubmissionIndex,
    mapped: mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    /// The mapping's outcome once seen (by a non-blocking check).
    done: Option<std::result::Result<(), wgpu::BufferAsyncError>>,
}

/// What a session shares with its model.
pub(crate) struct ModelGpu {
    pub gpu: Gpu,
    pub kernels: std::sync::Arc<Kernels>,
    pub config: ModelConfig,
    pub weights: GpuWeights,
}

/// Refuses an empty prompt or a token id outside the vocabulary (naming
/// the first bad id and its position).
pub(crate) fn check_prompt(ids: &[u32], vocab_size: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    match ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab_size) {
        Some((position, &id)) => Err(Error::InvalidTokenId { id, position, vocab_size }),
        None => Ok(()),
    }
}

/// Where one decode step's time went (see [`Session::timed_step`]).
#[derive(Debug, Clone, Copy)]
pub struct StepTiming {
    /// CPU time to record the step's commands, microseconds.
    pub encode_us: f64,
    /// GPU time of the forward pass, microseconds (None without timestamp queries).
    pub gpu_us: Option<f64>,
    /// Wall time of the whole step, readback included, microseconds.
    pub wall_us: f64,
}

/// Each launch of a step with its GPU times in microseconds (one per run;
/// see [`Session::profile_gpu`]).
pub type LaunchTimes = Vec<(LaunchKind, Vec<f64>)>;

/// A decoding session over a loaded model: feed tokens, get greedy tokens.
///
/// The KV cache is allocated once, for `capacity` positions, and never grows.
/// [`next_token`](Self::next_token) keeps up to
/// [`lookahead`](Self::set_lookahead) decode steps queued on the GPU, so the
/// GPU never waits for the caller; when the caller stops (an end-of-text
/// token, a token budget) or feeds new tokens, the queued steps past the
/// last token it took are discarded: their KV entries lie past the valid
/// length and are overwritten before anything reads them.
pub struct Session {
    model: Arc<ModelGpu>,
    bufs: SessionBuffers,
    forward: Forward,
    /// Positions consumed: the KV cache is valid below `len`.
    len: usize,
    /// Greedy prediction after the last consumed position (`tokens[len]`).
    pending: Option<u32>,
    /// Next position the GPU runs (`len` plus the steps queued ahead).
    gpu_pos: usize,
    /// Steps queued ahead, oldest first: the step at position `len + i`
    /// yields `tokens[len + i + 1]`.
    queued: VecDeque<InFlight>,
    /// One 4-byte readback buffer per step that can be in flight.
    slots: Vec<wgpu::Buffer>,
    free_slots: Vec<usize>,
    lookahead: usize,
}

impl Session {
    pub(crate) fn new(model: Arc<ModelGpu>, capacity: usize) -> Result<Self> {
        let cfg = &model.config;
        let (bufs, forward) = model.gpu.scoped(
            || {
                let bufs = SessionBuffers::new(&model.gpu, cfg, capacity)?;
                let forward = crate::qwen3::forward(&model.gpu, &model.kernels, cfg, &model.weights, &bufs);
                Ok((bufs, forward))
            },
            |reason| Error::GpuDeviceFailed { reason: format!("creating session: {reason}") },
        )?;
        let mut session = Session {
            model,
            bufs,
            forward,
            len: 0,
            pending: None,
            gpu_pos: 0,
            queued: VecDeque::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            lookahead: 0,
        };
        session.set_lookahead(DEFAULT_LOOKAHEAD);
        Ok(session)
    }

    /// KV-cache capacity in positions.
    pub fn capacity(&self) -> usize {
        self.bufs.capacity
    }

    /// Positions already in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before any token was fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets how many decode steps [`next_token`](Self::next_token) keeps
    /// queued on the GPU (at least 1; 1 means a wait on every token; at
    /// most the capacity, as no more steps can ever be queued).
    pub fn set_lookahead(&mut self, steps: usize) {
        // Each step that can be in flight holds a readback buffer.
        self.lookahead = steps.clamp(1, self.bufs.capacity.max(1));
        while self.slots.len() < self.lookahead + 1 {
            self.free_slots.push(self.slots.len());
            self.slots.push(self.model.gpu.readback("token readback", 8));
        }
    }

    /// GPU memory this session allocated (KV cache, activations, scratch,
    /// launch parameters), bytes.
    pub fn buffer_bytes(&self) -> u64 {
        let b = &self.bufs;
        let fixed = [
            &b.tokens,
            &b.step,
            &b.x,
            &b.qkv,
            &b.q,
            &b.attn,
            &b.h,
            &b.logits,
            &b.part_val,
            &b.part_idx,
            &b.attn_ml,
            &b.attn_acc,
            &b.rope,
        ];
        let caches = b.k_cache.iter().chain(&b.v_cache);
        fixed.into_iter().chain(caches).map(|buf| buf.size()).sum::<u64>() + self.forward.uniform_bytes
    }

    /// Kernel launches (dispatches) of the next decode step (at the
    /// current context length: attention takes one launch per layer while
    /// the context fits one chunk of positions, two after).
    pub fn dispatches_per_token(&self) -> usize {
        self.forward.step_at(self.len).count()
    }

    /// The greedy prediction after the last token fed, if any.
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Runs `ids` through the model (appending them to the context) and
    /// returns the greedy next token. Checks every id and the capacity
    /// before touching the GPU. All but the last token run through the
    /// layers in batches of [`PREFILL_BATCH`] (one launch per kernel per
    /// batch, causal attention within it); the last runs the whole step,
    /// whose argmax is the returned token.
    pub fn feed(&mut self, ids: &[u32]) -> Result<u32> {
        check_prompt(ids, self.model.config.vocab_size)?;
        self.check_room(ids.len())?;
        self.discard_queued()?;
        let gpu = self.model.gpu.clone();
        gpu.queue.write_buffer(&self.bufs.tokens, 4 * self.len as u64, bytemuck::cast_slice(ids));
        let end = self.len + ids.len();
        // No waits in between: each batch's position is written before its
        // submit (writes and submits run in queue order).
        let mut at = self.len;
        while at + 1 < end {
            let n = (end - 1 - at).min(self.bufs.batch);
            self.write_step_at(at, end);
            let mut enc = self.encoder();
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("prefill"),
                    timestamp_writes: None,
                });
                for l in &self.forward.prefill {
                    l.record_batch(&mut pass, &self.model.kernels, n as u32);
                }
            }
            gpu.queue.submit([enc.finish()]);
            at += n;
        }
        self.write_step_at(end - 1, end);
        let mut enc = self.encoder();
        self.record(&mut enc, end - 1..end, None);
        let slot = self.queue_readback(&mut enc, end)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos = end;
        self.len = end - 1;
        self.take_queued()
    }

    /// Feeds the pending greedy token back in and returns the next one
    /// (the streaming step). Fails with `empty_prompt` before any `feed`.
    pub fn next_token(&mut self) -> Result<u32> {
        self.queue_ahead()?;
        self.take_queued()
    }

    /// [`next_token`](Self::next_token) that never waits for the GPU: it
    /// queues steps the same way and returns `Ok(None)` while the next
    /// token is still on its way (call again later, e.g. next frame: a host
    /// that renders keeps its frame rate). The tokens are those
    /// `next_token` would return.
    ///
    /// ```no_run
    /// # fn frame(session: &mut qwen3_wgpu::Session) -> qwen3_wgpu::Result<()> {
    /// if let Some(token) = session.try_next_token()? {
    ///     println!("{token}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn try_next_token(&mut self) -> Result<Option<u32>> {
        self.queue_ahead()?;
        let gpu = &self.model.gpu;
        gpu.device
            .poll(wgpu::PollType::Poll)
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
        gpu.check_fault()?;
        let Some(front) = self.queued.front_mut() else {
            return Err(Error::GpuDeviceFailed { reason: "no decode step in flight".into() });
        };
        if front.done.is_none() {
            match front.mapped.try_recv() {
                Ok(r) => front.done = Some(r),
                Err(mpsc::TryRecvError::Empty) => return Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(Error::GpuDeviceFailed { reason: "map_async callback never ran".into() })
                }
            }
        }
        self.take_queued().map(Some)
    }

    /// Checks that a token can follow, then keeps between half the
    /// lookahead and the lookahead of decode steps queued (never past the
    /// capacity): once at most half are left, the steps up to the
    /// lookahead go in submits of half the lookahead (each submit costs
    /// the host and the driver a round of work, so several steps share
    /// one).
    fn queue_ahead(&mut self) -> Result<()> {
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        if self.queued.len() > self.lookahead / 2 {
            return Ok(());
        }
        let n = (self.lookahead - self.queued.len()).min(self.bufs.capacity - self.gpu_pos);
        // At most half the lookahead per submit: filling an empty queue
        // takes two submits, so the second still runs when the first's
        // tokens come back and the host queues more (a single submit left
        // the GPU idle ~0.9 ms at the start of every decode on an H200).
        let per_submit = (self.lookahead / 2).max(1);
        let mut left = n;
        while left > 0 {
            let k = left.min(per_submit);
            self.submit_steps(k)?;
            left -= k;
        }
        Ok(())
    }

    /// Submits the next `n` decode steps, each with its token's readback.
    fn submit_steps(&mut self, n: usize) -> Result<()> {
        let mut enc = self.encoder();
        self.record(&mut enc, self.gpu_pos..self.gpu_pos + n, None);
        // Each step's token is read back once the whole submit is done
        // anyway, so the copies can all follow the one pass.
        let mut slots = Vec::with_capacity(n);
        for i in 0..n {
            slots.push(self.queue_readback(&mut enc, self.gpu_pos + i + 1)?);
        }
        self.submit_with_readbacks(enc, &slots);
        self.gpu_pos += n;
        Ok(())
    }

    /// Whether `n` more positions fit (checked: `n` may be any caller's count).
    fn check_room(&self, n: usize) -> Result<()> {
        match self.len.checked_add(n) {
            Some(needed) if needed <= self.bufs.capacity => Ok(()),
            needed => Err(Error::ContextOverflow {
                needed: needed.unwrap_or(usize::MAX),
                capacity: self.bufs.capacity,
            }),
        }
    }

    fn encoder(&self) -> wgpu::CommandEncoder {
        let gpu = &self.model.gpu;
        gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode") })
    }

    /// Records the decode steps at `positions`, in order, in one compute
    /// pass (optionally timestamped at its start and end): a pass per step
    /// cost ~40 µs of GPU time per step on an H200 (BENCHMARKS.md).
    fn record(
        &self,
        enc: &mut wgpu::CommandEncoder,
        positions: Range<usize>,
        timestamps: Option<&Timestamps>,
    ) {
        let timestamp_writes = timestamps.map(Timestamps::pass_writes);
        let mut pass =
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("forward"), timestamp_writes });
        for pos in positions {
            for l in self.forward.step_at(pos) {
                l.record(&mut pass, &self.model.kernels);
            }
        }
    }

    /// Sets the GPU's position to `len` (the next step reads `tokens[len]`);
    /// the argmax may write tokens from position `fill_end` on.
    fn write_step(&self, fill_end: usize) {
        self.write_step_at(self.len, fill_end);
    }

    fn write_step_at(&self, pos: usize, fill_end: usize) {
        let step = [pos as u32, fill_end as u32];
        self.model.gpu.queue.write_buffer(&self.bufs.step, 0, bytemuck::cast_slice(&step));
    }

    /// Records a copy of `tokens[at]` into a free readback slot; once the
    /// commands are submitted, [`Self::submit_with_readbacks`] maps it.
    fn queue_readback(&mut self, enc: &mut wgpu::CommandEncoder, at: usize) -> Result<usize> {
        let slot = self
            .free_slots
            .pop()
            .ok_or_else(|| Error::GpuDeviceFailed { reason: "no free token readback slot".into() })?;
        enc.copy_buffer_to_buffer(&self.bufs.tokens, 4 * at as u64, &self.slots[slot], 0, 4);
        Ok(slot)
    }

    /// Submits `enc`, whose last command copies a token into `slot`, and
    /// queues the slot's mapping (a buffer pending a map cannot be used by
    /// a submit, so the map comes after).
    fn submit_with_readback(&mut self, enc: wgpu::CommandEncoder, slot: usize) {
        self.submit_with_readbacks(enc, &[slot]);
    }

    /// [`Self::submit_with_readback`] for an encoder holding several steps,
    /// each copying its token into one of `slots`, in order.
    fn submit_with_readbacks(&mut self, enc: wgpu::CommandEncoder, slots: &[usize]) {
        let submission = self.model.gpu.queue.submit([enc.finish()]);
        for &slot in slots {
            let (tx, mapped) = mpsc::channel();
            self.slots[slot].slice(..).map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            self.queued.push_back(InFlight { slot, submission: submission.clone(), mapped, done: None });
        }
    }

    /// Waits for the oldest queued step's token, consumes its position and
    /// makes the token the pending prediction.
    fn take_queued(&mut self) -> Result<u32> {
        let q = self
            .queued
            .pop_front()
            .ok_or_else(|| Error::GpuDeviceFailed { reason: "no decode step in flight".into() })?;
        let token = self.wait_slot(q)?;
        self.len += 1;
        if token as usize >= self.model.config.vocab_size {
            return Err(Error::GpuDeviceFailed {
                reason: format!("argmax returned {token} (non-finite logits?)"),
            });
        }
        self.pending = Some(token);
        Ok(token)
    }

    /// Waits until a slot is mapped, reads its token and frees the slot.
    fn wait_slot(&mut self, q: InFlight) -> Result<u32> {
        let gpu = &self.model.gpu;
        let mapped = loop {
            if let Some(r) = q.done {
                break r;
            }
            match q.mapped.try_recv() {
                Ok(r) => break r,
                Err(mpsc::TryRecvError::Empty) => {
                    // Only this step's submit: the steps queued after it
                    // keep the GPU busy meanwhile.
                    let wait =
                        wgpu::PollType::Wait { submission_index: Some(q.submission.clone()), timeout: None };
                    gpu.device
                        .poll(wait)
                        .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
                    gpu.check_fault()?;
                }
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(Error::GpuDeviceFailed { reason: "map_async callback never ran".into() })
                }
            }
        };
        mapped.map_err(|e| Error::GpuDeviceFailed { reason: format!("map_async: {e}") })?;
        let buf = &self.slots[q.slot];
        let token = {
            let view = buf
                .slice(..)
                .get_mapped_range()
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("reading back: {e}") })?;
            u32::from_le_bytes([view[0], view[1], view[2], view[3]])
        };
        buf.unmap();
        self.free_slots.push(q.slot);
        Ok(token)
    }

    /// Drops the steps queued past `len` (waiting for their slots) and puts
    /// the GPU's position back at `len`, whose token (`pending`) is intact:
    /// queued steps only write tokens after it.
    fn discard_queued(&mut self) -> Result<()> {
        while let Some(q) = self.queued.pop_front() {
            self.wait_slot(q)?;
        }
        if self.gpu_pos != self.len {
            self.write_step(self.len + 1);
            self.gpu_pos = self.len;
        }
        Ok(())
    }

    /// Like [`next_token`](Self::next_token), and reports where the time
    /// went: CPU encoding, GPU time of the pass (from timestamp queries,
    /// when the device has them), and the whole step's wall time. Runs the
    /// step alone (nothing queued ahead), so the figures are one step's.
    pub fn timed_step(&mut self) -> Result<StepTiming> {
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        self.discard_queued()?;
        let gpu = self.model.gpu.clone();
        let timestamps = gpu
            .device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
            .then(|| Timestamps::new(&gpu, "step timestamps", 2));
        let t0 = std::time::Instant::now();
        let mut enc = self.encoder();
        self.record(&mut enc, self.len..self.len + 1, timestamps.as_ref());
        let encode_us = t0.elapsed().as_secs_f64() * 1e6;
        if let Some(t) = &timestamps {
            t.resolve(&mut enc);
        }
        let slot = self.queue_readback(&mut enc, self.len + 1)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos += 1;
        self.take_queued()?;
        let wall_us = t0.elapsed().as_secs_f64() * 1e6;
        let gpu_us = match &timestamps {
            Some(t) => t.intervals_us(&gpu)?.first().copied(),
            None => None,
        };
        Ok(StepTiming { encode_us, gpu_us, wall_us })
    }

    /// Runs one decode step with a GPU timestamp after every launch (needs
    /// `TIMESTAMP_QUERY_INSIDE_PASSES`) and returns each launch's GPU time
    /// (kernel, microseconds per run). `None` when the device cannot time
    /// inside a pass. With `repeats > 1` every launch runs that many times
    /// back to back (its later runs find their inputs in cache): a
    /// diagnostic whose step results are not the model's (residual adds run
    /// repeatedly), so use a throwaway session for it. Advances the session
    /// by one position like [`next_token`](Self::next_token).
    #[doc(hidden)]
    pub fn profile_gpu(&mut self, repeats: u32) -> Result<Option<LaunchTimes>> {
        let gpu = self.model.gpu.clone();
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        let repeats = repeats.max(1);
        let launches: Vec<crate::kernels::Launch> = self.forward.step_at(self.len).cloned().collect();
        // One timestamp per launch run, plus the first: a query set holds at most 4096.
        let n = u32::try_from(launches.len())
            .ok()
            .and_then(|l| l.checked_mul(repeats)?.checked_add(1))
            .filter(|&n| n <= wgpu::QUERY_SET_MAX_QUERIES)
            .ok_or_else(|| {
                let most = (wgpu::QUERY_SET_MAX_QUERIES - 1) as usize / launches.len().max(1);
                Error::invalid_argument(
                    "repeats",
                    format!("{repeats} runs of {} launches need more timestamps than a query set holds; at most {most}", launches.len()),
                )
            })?;
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        self.discard_queued()?;
        let ts = Timestamps::new(&gpu, "launch timestamps", n);
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&ts.set, 0);
            let mut q = 1;
            for l in &launches {
                for _ in 0..repeats {
                    l.record(&mut pass, &self.model.kernels);
                    pass.write_timestamp(&ts.set, q);
                    q += 1;
                }
            }
        }
        ts.resolve(&mut enc);
        let slot = self.queue_readback(&mut enc, self.len + 1)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos += 1;
        self.take_queued()?;
        if repeats > 1 {
            // argmax_final advanced the GPU's position once per run.
            self.gpu_pos = usize::MAX;
            self.discard_queued()?;
        }
        let us = ts.intervals_us(&gpu)?;
        Ok(Some(
            launches
                .iter()
                .zip(us.chunks(repeats as usize))
                .map(|(l, runs)| (l.kind(), runs.to_vec()))
                .collect(),
        ))
    }

    /// Runs one prompt batch of `ids` (at most the batch size) through the
    /// layers with a GPU timestamp after every launch and returns each
    /// launch's GPU time (kernel, microseconds). `None` when the device
    /// cannot time inside a pass. A diagnostic: appends the tokens to the
    /// context like [`feed`](Self::feed) minus its last step (no pending
    /// prediction is made).
    #[doc(hidden)]
    pub fn profile_prefill(&mut self, ids: &[u32]) -> Result<Option<LaunchTimes>> {
        let gpu = self.model.gpu.clone();
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        check_prompt(ids, self.model.config.vocab_size)?;
        self.check_room(ids.len())?;
        let n = ids.len().min(self.bufs.batch);
        self.discard_queued()?;
        gpu.queue.write_buffer(&self.bufs.tokens, 4 * self.len as u64, bytemuck::cast_slice(&ids[..n]));
        self.write_step_at(self.len, self.len + n);
        let launches = &self.forward.prefill;
        let ts = Timestamps::new(&gpu, "prefill timestamps", launches.len() as u32 + 1);
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&ts.set, 0);
            for (i, l) in launches.iter().enumerate() {
                l.record_batch(&mut pass, &self.model.kernels, n as u32);
                pass.write_timestamp(&ts.set, i as u32 + 1);
            }
        }
        ts.resolve(&mut enc);
        gpu.queue.submit([enc.finish()]);
        let us = ts.intervals_us(&gpu)?;
        self.len += n;
        self.gpu_pos = self.len;
        self.pending = None;
        Ok(Some(launches.iter().zip(us).map(|(l, t)| (l.kind(), vec![t])).collect()))
    }

    /// GPU time per step (microseconds) of `n` decode steps recorded back to
    /// back in one pass, as decode records a submit's steps, with no
    /// readbacks (timestamps at the pass's start and end): the GPU's own
    /// rate, to set beside the rate a caller sees. Leaves the session as it
    /// was (the steps' tokens and KV entries lie past its length). `None`
    /// without timestamps.
    #[doc(hidden)]
    pub fn gpu_time_of_steps(&mut self, n: usize) -> Result<Option<f64>> {
        let gpu = self.model.gpu.clone();
        if n == 0 {
            return Ok(None);
        }
        // The count is checked on every device, with timestamps or without.
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(n)?;
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Ok(None);
        }
        self.discard_queued()?;
        let ts = Timestamps::new(&gpu, "steps timestamps", 2);
        let mut enc = self.encoder();
        self.record(&mut enc, self.len..self.len + n, Some(&ts));
        ts.resolve(&mut enc);
        gpu.queue.submit([enc.finish()]);
        let us = ts.intervals_us(&gpu)?;
        // argmax_final advanced the GPU's position n times: put it back.
        self.gpu_pos = usize::MAX;
        self.discard_queued()?;
        Ok(us.first().map(|t| t / n as f64))
    }

    /// GPU time (microseconds, from timestamps at the start and end of one
    /// pass) of the step's launches for which `keep` is true, run in order
    /// without the others: how much a kind of launch costs in sequence,
    /// with no timestamps between launches. A diagnostic: the launches run
    /// on whatever their inputs hold, so the session's results after it are
    /// not the model's (use a throwaway session). `None` without timestamps.
    #[doc(hidden)]
    pub fn gpu_time_of(&mut self, keep: impl Fn(LaunchKind) -> bool) -> Result<Option<f64>> {
        let gpu = self.model.gpu.clone();
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Ok(None);
        }
        self.discard_queued()?;
        let ts = Timestamps::new(&gpu, "subset timestamps", 2);
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("subset"),
                timestamp_writes: Some(ts.pass_writes()),
            });
            for l in self.forward.step_at(self.len).filter(|l| keep(l.kind())) {
                l.record(&mut pass, &self.model.kernels);
            }
        }
        ts.resolve(&mut enc);
        gpu.queue.submit([enc.finish()]);
        let us = ts.intervals_us(&gpu)?;
        // Whatever the subset did to the position, put it back.
        self.write_step(self.len + 1);
        Ok(us.first().copied())
    }

    /// Runs one decode step with a wait after every launch and returns the
    /// wall time of each (kind, microseconds): a coarse per-kernel profile
    /// for adapters without timestamp queries inside passes. Advances the
    /// session by one position like [`next_token`](Self::next_token).
    #[doc(hidden)]
    pub fn profile_step(&mut self) -> Result<Vec<(LaunchKind, f64)>> {
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        self.discard_queued()?;
        let gpu = self.model.gpu.clone();
        let mut out = Vec::new();
        for l in self.forward.step_at(self.len) {
            let t = std::time::Instant::now();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                l.record(&mut pass, &self.model.kernels);
            }
            gpu.queue.submit([enc.finish()]);
            gpu.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
            out.push((l.kind(), t.elapsed().as_secs_f64() * 1e6));
        }
        let mut enc = self.encoder();
        let slot = self.queue_readback(&mut enc, self.len + 1)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos += 1;
        self.take_queued()?;
        Ok(out)
    }

    /// Copies a session buffer back (tests and diagnostics).
    #[doc(hidden)]
    pub fn debug_logits(&self) -> Result<Vec<f32>> {
        let n = self.model.config.vocab_size;
        let bytes = self.model.gpu.download(&self.bufs.logits, 4 * n)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

#[cfg(test)]
mod tests {
    use crate::{AdapterPolicy, CachePolicy, Engine, LoadOptions};

    /// Counts past the capacity are refused whatever their size (no
    /// wrapping `len + n`, no readback buffer per requested step), and
    /// leave the session as it was.
    #[test]
    fn huge_counts_are_refused_not_wrapped() {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
        let model = engine.load(fixture, &options).unwrap();
        let decode = |lookahead: Option<usize>| {
            let mut s = model.session_with_capacity(6).unwrap();
            if let Some(steps) = lookahead {
                s.set_lookahead(steps);
                assert!(s.slots.len() <= s.capacity() + 1, "{} readbacks", s.slots.len());
            }
            let mut tokens = vec![s.feed(&[1, 2]).unwrap()];
            let e = s.gpu_time_of_steps(usize::MAX).unwrap_err();
            assert_eq!(e.code(), "context_overflow", "{e}");
            assert_eq!(s.len(), 2);
            while s.len() < s.capacity() {
                tokens.push(s.next_token().unwrap());
            }
            assert_eq!(s.next_token().unwrap_err().code(), "context_overflow");
            tokens
        };
        assert_eq!(decode(Some(usize::MAX)), decode(None));
        let mut s = model.session_with_capacity(6).unwrap();
        s.feed(&[1, 2]).unwrap();
        let e = s.profile_gpu(u32::MAX).unwrap_err();
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains("repeats"), "{e}");
        assert_eq!(s.len(), 2);
    }
}
