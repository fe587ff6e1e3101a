//! The decode runtime: a session owns its buffers ([`crate::buffers`], the
//! KV cache allocated once for its capacity) and the forward pass recorded
//! over them ([`crate::qwen3`]), and queues decode steps. The decode position
//! and the token sequence live on the GPU (the argmax writes the next token
//! where the next step's embedding reads it), so decode steps are queued
//! ahead of the caller: while the caller handles token N, the GPU already
//! runs the steps after it, and each step's 4-byte token comes back through
//! its own small readback buffer without stalling the queue. The next
//! submit's steps are recorded ahead on a thread of the session's own
//! (`recorder`), so a call that queues steps only submits them.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{mpsc, Arc};

mod batch;
mod diagnostics;
mod feed;
mod recorder;
mod state;

use crate::buffers::SessionBuffers;
pub use crate::buffers::PREFILL_BATCH;
use crate::error::{Error, Result};
use crate::gpu::Timestamps;
use crate::gpu_weights::ModelGpu;
use crate::kernels::sample::{LOGPROB_RECORD_WORDS, MAX_LOGPROBS};
use crate::qwen3::Forward;
use crate::sampling::{SamplingParams, TokenLogprobs};
pub use batch::{Batch, BatchOptions};
pub use diagnostics::{LaunchTimes, StepTiming};
pub use feed::FeedStatus;
pub(crate) use state::restore;
pub use state::SESSION_FORMAT_VERSION;

/// Decode steps queued on the GPU ahead of the caller by default (see
/// [`Session::set_lookahead`]). Enough to hide the host's encoding and
/// readback behind the GPU's work; each costs at most one wasted step when
/// the caller stops early.
pub const DEFAULT_LOOKAHEAD: usize = 4;

/// A readback buffer's mapping on its way: the submit that fills the
/// buffer and the `map_async` signal, with its outcome once seen. The one
/// place a readback signal is read (a session's tokens and a batch's).
struct Mapping {
    /// The submit that fills the buffer (a wait waits for it alone).
    submission: wgpu::SubmissionIndex,
    signal: mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    /// The outcome once seen (by a non-blocking check).
    outcome: Option<std::result::Result<(), wgpu::BufferAsyncError>>,
}

impl Mapping {
    /// Maps `slice` for reading once `submission` (already submitted) is
    /// done.
    fn start(slice: wgpu::BufferSlice<'_>, submission: wgpu::SubmissionIndex) -> Self {
        let (tx, signal) = mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        Mapping { submission, signal, outcome: None }
    }

    /// Whether the mapping has completed (successfully or not: see
    /// [`Self::check`]), without waiting.
    fn arrived(&mut self) -> Result<bool> {
        if self.outcome.is_none() {
            match self.signal.try_recv() {
                Ok(r) => self.outcome = Some(r),
                Err(mpsc::TryRecvError::Empty) => return Ok(false),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(Error::GpuDeviceFailed { reason: "map_async callback never ran".into() })
                }
            }
        }
        Ok(true)
    }

    /// The failed mapping's error, once it has arrived.
    fn check(&self) -> Result<()> {
        match &self.outcome {
            Some(Err(e)) => Err(Error::GpuDeviceFailed { reason: format!("map_async: {e}") }),
            _ => Ok(()),
        }
    }

    /// Waits (polling the device for this submit alone) until the mapping
    /// has completed; counts the wait in `waits`.
    fn wait(&mut self, gpu: &crate::gpu::Gpu, waits: &mut u64) -> Result<()> {
        while !self.arrived()? {
            let wait =
                wgpu::PollType::Wait { submission_index: Some(self.submission.clone()), timeout: None };
            *waits += 1;
            gpu.device.poll(wait).map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
            gpu.check_fault()?;
        }
        Ok(())
    }
}

/// A token on its way back from the GPU: the readback slot it is copied
/// into and the slot's mapping.
struct InFlight {
    slot: usize,
    mapping: Mapping,
}

impl InFlight {
    /// Whether the slot's mapping has completed (successfully or not),
    /// without waiting.
    fn arrived(&mut self) -> Result<bool> {
        self.mapping.arrived()
    }
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

/// A decoding session over a loaded model: feed tokens, get greedy tokens.
/// Its context is everything fed and every token returned, in order: the
/// last token returned stays pending until the next step or `feed` commits
/// it.
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
    /// A prompt being fed without blocking ([`Session::begin_feed`]).
    feed_progress: Option<feed::FeedProgress>,
    /// Waits on the GPU so far (a feed in progress never adds one).
    blocking_waits: u64,
    /// How tokens are chosen (the launches: `forward.choose`).
    sampling: SamplingParams,
    /// Log-probabilities per token (0: off; see [`Session::set_logprobs`]).
    logprobs: u32,
    /// The log-probabilities of the last token returned, when on.
    last_logprobs: Option<TokenLogprobs>,
    /// The batch slot whose KV region this session's cache is (freed when
    /// the session is dropped); `None`: buffers of its own.
    kv_slot: Option<batch::SlotLease>,
    /// Feeds, truncations and changes of how tokens are chosen so far: a
    /// batch step queued ahead for this session serves only while this is
    /// unchanged.
    edits: u64,
    /// The decode step's launches as the recorder records them (made on
    /// first use, dropped when the token choice is rebuilt).
    step_launches: Option<Arc<recorder::StepLaunches>>,
    /// The thread recording submits ahead (started on first use; `None`
    /// before, or if the system refused a thread).
    recorder: Option<recorder::Recorder>,
    /// The next submit's steps, recorded ahead.
    prerecorded: Option<recorder::Prerecorded>,
    /// Decode submits so far (steps queued ahead; not prompts).
    decode_submits: u64,
    /// Prompt submits whose commands were recorded on the caller's thread
    /// (a blocking feed's; a polled feed's only when the recorder is gone).
    inline_feed_recordings: u64,
}

impl Session {
    pub(crate) fn new(model: Arc<ModelGpu>, capacity: usize) -> Result<Self> {
        Self::new_in(model, capacity, None)
    }

    /// A session whose KV cache is `kv_slot`'s region of a batch's pool
    /// (or, without one, buffers of its own).
    fn new_in(model: Arc<ModelGpu>, capacity: usize, kv_slot: Option<batch::SlotLease>) -> Result<Self> {
        let cfg = &model.config;
        let (bufs, forward) = model.gpu.scoped(
            || {
                let kv = kv_slot.as_ref().map(batch::SlotLease::region);
                let bufs = SessionBuffers::new(&model.gpu, cfg, capacity, kv)?;
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
            feed_progress: None,
            blocking_waits: 0,
            sampling: SamplingParams::default(),
            logprobs: 0,
            last_logprobs: None,
            kv_slot,
            edits: 0,
            step_launches: None,
            recorder: None,
            prerecorded: None,
            decode_submits: 0,
            inline_feed_recordings: 0,
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
        // Each step that can be in flight holds a readback buffer, and so
        // does each step of the next submit, recorded ahead; never more
        // than the capacity's steps are in flight or recorded.
        self.lookahead = steps.clamp(1, self.bufs.capacity.max(1));
        let wanted = (self.lookahead + 1 + self.steps_per_submit()).min(self.bufs.capacity + 1);
        while self.slots.len() < wanted {
            self.free_slots.push(self.slots.len());
            self.slots.push(self.model.gpu.readback("token readback", self.readback_bytes()));
        }
    }

    /// GPU memory this session allocated (KV cache, activations, scratch,
    /// launch parameters), bytes.
    pub fn buffer_bytes(&self) -> u64 {
        self.bufs.bytes() + self.forward.uniform_bytes + self.forward.choose_uniform_bytes
    }

    /// Sets how the next tokens are chosen (greedy by default): from the
    /// next token on, every step samples under `params` on the GPU (see
    /// [`SamplingParams`]). Steps already queued ahead are discarded, so
    /// the next token uses the new parameters; the pending token stays.
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// use qwen3_wgpu::SamplingParams;
    /// let mut session = model.session()?;
    /// session.set_sampling(&SamplingParams::default().temperature(0.7).top_p(0.9).seed(42))?;
    /// let first = session.feed(&[785, 6722, 315])?; // sampled
    /// let second = session.next_token()?;
    /// # let _ = (first, second);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: those of [`SamplingParams::validate`] (the session is left
    /// as it was); [`Error::InvalidArgument`] naming `session` while a
    /// [`begin_feed`](Self::begin_feed) is in progress; a GPU failure while
    /// waiting for the discarded steps.
    pub fn set_sampling(&mut self, params: &SamplingParams) -> Result<()> {
        self.check_no_feed()?;
        params.validate()?;
        self.discard_queued()?;
        self.rebuild_choose(params, self.logprobs)?;
        self.sampling = params.clone();
        self.edits += 1;
        Ok(())
    }

    /// Rebuilds the launches choosing the token (and computing the
    /// log-probabilities of the `logprobs` most likely tokens).
    fn rebuild_choose(&mut self, params: &SamplingParams, logprobs: u32) -> Result<()> {
        let model = &self.model;
        let (choose, bytes) = model.gpu.scoped(
            || {
                Ok(crate::qwen3::choose_launches(
                    &model.gpu,
                    &model.kernels,
                    &model.config,
                    &self.bufs,
                    params,
                    logprobs,
                ))
            },
            |reason| Error::GpuDeviceFailed { reason: format!("setting sampling: {reason}") },
        )?;
        self.forward.choose = choose;
        self.forward.choose_uniform_bytes = bytes;
        self.step_launches = None;
        Ok(())
    }

    /// Computes the log-probabilities of the `n` most likely tokens, and of
    /// the token chosen, with every token from the next one on (0, the
    /// default: off, and no extra launch or readback). They are of the
    /// model's raw distribution, `log_softmax(logits)`, before penalties,
    /// temperature and filters (as mlx-lm returns them), computed on the
    /// GPU inside the step and read back with the token, so steps still
    /// queue ahead. Get them with [`last_logprobs`](Self::last_logprobs).
    /// Steps already queued ahead are discarded (as by
    /// [`set_sampling`](Self::set_sampling)).
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// let mut session = model.session()?;
    /// session.set_logprobs(5)?;
    /// let token = session.feed(&[785, 6722, 315])?;
    /// let lp = session.last_logprobs().expect("on");
    /// assert_eq!(lp.token, token);
    /// for (id, logprob) in &lp.top {
    ///     println!("{id}: {logprob:.3}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] naming `logprobs` above 20
    /// (OpenAI's bound), or naming `session` while a
    /// [`begin_feed`](Self::begin_feed) is in progress (the session is left
    /// as it was); a GPU failure while waiting for the discarded steps.
    pub fn set_logprobs(&mut self, n: u32) -> Result<()> {
        self.check_no_feed()?;
        if n > MAX_LOGPROBS {
            return Err(Error::invalid_argument(
                "logprobs",
                format!("{n} is more than the {MAX_LOGPROBS} supported"),
            ));
        }
        self.discard_queued()?;
        if n > 0 && self.bufs.logprobs.is_none() {
            let cfg = &self.model.config;
            self.bufs.logprobs =
                Some(crate::buffers::LogprobBuffers::new(&self.model.gpu, cfg, self.bufs.capacity));
        }
        let params = self.sampling.clone();
        self.rebuild_choose(&params, n)?;
        self.logprobs = n;
        self.last_logprobs = None;
        // Every slot is free after the discard: resize them for the records.
        self.slots.clear();
        self.free_slots.clear();
        self.set_lookahead(self.lookahead);
        Ok(())
    }

    /// The log-probabilities of the last token returned (by
    /// [`feed`](Self::feed), [`next_token`](Self::next_token) or
    /// [`try_next_token`](Self::try_next_token)), when
    /// [`set_logprobs`](Self::set_logprobs) is on; `None` otherwise.
    pub fn last_logprobs(&self) -> Option<&TokenLogprobs> {
        self.last_logprobs.as_ref()
    }

    /// Bytes of one readback slot: the token, and the log-probability
    /// record when on.
    fn readback_bytes(&self) -> usize {
        if self.logprobs > 0 {
            8 + 4 * LOGPROB_RECORD_WORDS as usize
        } else {
            8
        }
    }

    /// How tokens are chosen (see [`set_sampling`](Self::set_sampling)).
    pub fn sampling(&self) -> &SamplingParams {
        &self.sampling
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
    ///
    /// The pending token ([`pending`](Self::pending): the last one `feed`
    /// or [`next_token`](Self::next_token) returned, not yet in the KV
    /// cache) is committed first, ahead of `ids`: after a generation, the
    /// next turn's text follows the whole reply, and the KV cache holds the
    /// whole conversation (it takes one position more than `ids`). To drop
    /// it instead (a reply cut before its last token), call
    /// [`truncate`](Self::truncate)`(len())` first.
    pub fn feed(&mut self, ids: &[u32]) -> Result<u32> {
        self.check_no_feed()?;
        check_prompt(ids, self.model.config.vocab_size)?;
        let ids: std::borrow::Cow<[u32]> = match self.pending {
            Some(token) => std::iter::once(token).chain(ids.iter().copied()).collect(),
            None => ids.into(),
        };
        let ids = &ids[..];
        self.check_room(ids.len())?;
        self.discard_queued()?;
        self.edits += 1;
        let gpu = self.model.gpu.clone();
        gpu.queue.write_buffer(&self.bufs.tokens, 4 * self.len as u64, bytemuck::cast_slice(ids));
        let end = self.len + ids.len();
        // No waits in between: each batch's position is written before its
        // submit (writes and submits run in queue order).
        let mut at = self.len;
        while at + 1 < end {
            at += self.submit_prefill_batch(at, end);
        }
        self.write_step_at(end - 1, end);
        let mut enc = self.encoder();
        self.record(&mut enc, end - 1..end, None);
        self.inline_feed_recordings += 1;
        let slot = self.queue_readback(&mut enc, end)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos = end;
        self.len = end - 1;
        self.take_queued()
    }

    /// Rewinds the session to its first `len` positions: the KV cache keeps
    /// positions below `len`, the steps queued ahead are discarded, and the
    /// next [`feed`](Self::feed) continues from `len` (as if only those
    /// positions had ever been fed). The pending prediction is dropped too
    /// (it followed the last position, not position `len - 1`), so
    /// [`next_token`](Self::next_token) fails with `no_pending_token` until
    /// the next `feed`. Nothing is copied or freed: the rows past `len` are
    /// overwritten before anything reads them.
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// let mut session = model.session()?;
    /// session.feed(&[785, 6722, 315])?; // a shared beginning
    /// let start = session.len();
    /// let a = session.feed(&[9625, 374])?;
    /// session.truncate(start)?; // forget the second part
    /// let b = session.feed(&[17689, 374])?; // as if fed [785, 6722, 315, 17689, 374]
    /// # let _ = (a, b);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] naming `len` when `len` exceeds
    /// [`len()`](Self::len) (the session is left as it was); a GPU failure
    /// while waiting for the discarded steps.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.check_no_feed()?;
        if len > self.len {
            return Err(Error::invalid_argument(
                "len",
                format!("{len} is past the {} positions the session holds", self.len),
            ));
        }
        self.discard_queued()?;
        self.edits += 1;
        self.len = len;
        self.pending = None;
        self.last_logprobs = None;
        self.reset_gpu_position();
        Ok(())
    }

    /// Feeds the pending greedy token back in and returns the next one
    /// (the streaming step). Fails with `no_pending_token` before any `feed`.
    pub fn next_token(&mut self) -> Result<u32> {
        self.queue_ahead(usize::MAX)?;
        self.take_queued()
    }

    /// [`next_token`](Self::next_token) that never waits for the GPU: it
    /// queues steps the same way and returns `Ok(None)` while the next
    /// token is still on its way (call again later, e.g. next frame: a host
    /// that renders keeps its frame rate). The tokens are those
    /// `next_token` would return. A call submits at most one batch of
    /// steps (half the lookahead), recorded ahead of time on a thread of
    /// the session's own, so the caller's thread pays for the submit and
    /// the readback, not for recording.
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
        self.queue_ahead(1)?;
        let front = self.queued.front_mut().ok_or_else(no_step_in_flight)?;
        if !front.arrived()? {
            // Polling only when the token is not there yet: one poll maps
            // every step of a submit.
            let gpu = &self.model.gpu;
            gpu.device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
            gpu.check_fault()?;
            let front = self.queued.front_mut().ok_or_else(no_step_in_flight)?;
            if !front.arrived()? {
                return Ok(None);
            }
        }
        self.take_queued().map(Some)
    }

    /// Checks that a token can follow, then keeps between half the
    /// lookahead and the lookahead of decode steps queued (never past the
    /// capacity): once at most half are left, the steps up to the
    /// lookahead go in submits of half the lookahead (each submit costs
    /// the host and the driver a round of work, so several steps share
    /// one), at most `max_submits` of them in this call. Then the next
    /// submit's steps are recorded ahead.
    fn queue_ahead(&mut self, max_submits: usize) -> Result<()> {
        self.check_can_step(1)?;
        if self.queued.len() <= self.lookahead / 2 {
            // At most half the lookahead per submit: filling an empty queue
            // takes two submits, so the second still runs when the first's
            // tokens come back and the host queues more (a single submit
            // left the GPU idle ~0.9 ms at the start of every decode on an
            // H200).
            let mut submits = 0;
            while submits < max_submits
                && self.queued.len() < self.lookahead
                && self.gpu_pos < self.bufs.capacity
            {
                let k = (self.lookahead - self.queued.len())
                    .min(self.steps_per_submit())
                    .min(self.bufs.capacity - self.gpu_pos);
                // A call that need not wait leaves a submit still being
                // recorded for a later call, while steps remain queued.
                let wait = max_submits > 1 || self.queued.is_empty();
                if !self.submit_steps(k, wait)? {
                    break;
                }
                submits += 1;
            }
        }
        self.record_ahead();
        Ok(())
    }

    /// Steps per submit of [`Self::queue_ahead`].
    fn steps_per_submit(&self) -> usize {
        (self.lookahead / 2).max(1)
    }

    /// Starts recording the next submit's steps, unless one is recorded
    /// already, none fits, or too few readback slots are free.
    fn record_ahead(&mut self) {
        if self.prerecorded.is_some() {
            return;
        }
        let k = self.steps_per_submit().min(self.bufs.capacity - self.gpu_pos);
        if k == 0 || self.free_slots.len() < k {
            return;
        }
        if self.started_recorder().is_none() {
            return;
        }
        let positions = self.gpu_pos..self.gpu_pos + k;
        let slots: Vec<usize> = (0..k).filter_map(|_| self.free_slots.pop()).collect();
        let job = self.steps_job(positions.clone(), &slots);
        let Some(rec) = &self.recorder else { return };
        let commands = rec.record(job.clone());
        self.prerecorded =
            Some(recorder::Prerecorded { positions, launches: job.launches.clone(), slots, job, commands });
    }

    /// The session's recorder, started on first use (`None` when the
    /// system refuses a thread).
    fn started_recorder(&mut self) -> Option<&recorder::Recorder> {
        if self.recorder.is_none() {
            self.recorder = recorder::Recorder::start();
        }
        self.recorder.as_ref()
    }

    /// The launches of a decode step, shared with the recorder.
    fn step_launches(&mut self) -> Arc<recorder::StepLaunches> {
        self.step_launches.get_or_insert_with(|| Arc::new(recorder::StepLaunches::of(&self.forward))).clone()
    }

    /// The recording of the steps at `positions`, each copying its token
    /// into the matching one of `slots`.
    fn steps_job(&mut self, positions: std::ops::Range<usize>, slots: &[usize]) -> recorder::StepsJob {
        let mut copies = Vec::with_capacity(2 * slots.len());
        for (i, &slot) in slots.iter().enumerate() {
            let at = (positions.start + i + 1) as u64;
            copies.push(recorder::ReadbackCopy {
                src: self.bufs.tokens.clone(),
                src_offset: 4 * at,
                dst: self.slots[slot].clone(),
                dst_offset: 0,
                size: 4,
            });
            if let (true, Some(lp)) = (self.logprobs > 0, &self.bufs.logprobs) {
                let record = 4 * LOGPROB_RECORD_WORDS as u64;
                copies.push(recorder::ReadbackCopy {
                    src: lp.records.clone(),
                    src_offset: at * record,
                    dst: self.slots[slot].clone(),
                    dst_offset: 8,
                    size: record,
                });
            }
        }
        recorder::StepsJob { model: self.model.clone(), launches: self.step_launches(), positions, copies }
    }

    /// Decode submits so far (steps queued ahead by
    /// [`next_token`](Self::next_token) and
    /// [`try_next_token`](Self::try_next_token); not prompts): for tests
    /// that count the submits of a call.
    #[doc(hidden)]
    pub fn debug_decode_submits(&self) -> u64 {
        self.decode_submits
    }

    /// Drops the submit recorded ahead, unsubmitted, and frees its slots.
    fn drop_prerecorded(&mut self) {
        if let Some(p) = self.prerecorded.take() {
            self.free_slots.extend(p.slots);
        }
    }

    /// Submits the next `n` decode steps, each with its token's readback:
    /// the commands recorded ahead for them, or else recorded here. While
    /// those are still being recorded, returns `false` without submitting
    /// unless `wait`.
    fn submit_steps(&mut self, n: usize, wait: bool) -> Result<bool> {
        let positions = self.gpu_pos..self.gpu_pos + n;
        let ahead = match self.prerecorded.take() {
            Some(p)
                if p.positions == positions
                    && self.step_launches.as_ref().is_some_and(|l| Arc::ptr_eq(l, &p.launches)) =>
            {
                let commands = p.take(wait);
                match commands {
                    Some(commands) => Some((commands, p.slots)),
                    None => {
                        self.prerecorded = Some(p);
                        return Ok(false);
                    }
                }
            }
            other => {
                self.prerecorded = other;
                self.drop_prerecorded();
                None
            }
        };
        let (commands, slots) = match ahead {
            Some(recorded) => recorded,
            None => {
                let slots = (0..n)
                    .map(|_| {
                        self.free_slots.pop().ok_or_else(|| Error::internal("no free token readback slot"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let commands = self.steps_job(positions, &slots).encode();
                (commands, slots)
            }
        };
        self.submit_commands_with_readbacks([commands], &slots);
        self.decode_submits += 1;
        self.gpu_pos += n;
        Ok(true)
    }

    /// Whether `n` decode steps can run now: a token is pending (a `feed`
    /// came first) and `n` more positions fit.
    fn check_can_step(&self, n: usize) -> Result<()> {
        self.check_no_feed()?;
        if self.pending.is_none() {
            return Err(Error::NoPendingToken);
        }
        self.check_room(n)
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

    /// Submits the prompt batch from position `at` (up to a batch of the
    /// positions before `end - 1`, whose full step comes after) and returns
    /// how many positions it runs.
    fn submit_prefill_batch(&mut self, at: usize, end: usize) -> usize {
        let n = (end - 1 - at).min(self.bufs.batch);
        self.write_step_at(at, end);
        let commands = self.prefill_job(n).encode();
        self.inline_feed_recordings += 1;
        self.model.gpu.queue.submit([commands]);
        n
    }

    /// The recording of a prompt batch of `n` positions.
    fn prefill_job(&self, n: usize) -> recorder::PrefillJob {
        recorder::PrefillJob {
            model: self.model.clone(),
            launches: self.forward.prefill.clone(),
            tokens: n as u32,
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
        let slot = self.free_slots.pop().ok_or_else(|| Error::internal("no free token readback slot"))?;
        enc.copy_buffer_to_buffer(&self.bufs.tokens, 4 * at as u64, &self.slots[slot], 0, 4);
        if let (true, Some(lp)) = (self.logprobs > 0, &self.bufs.logprobs) {
            let record = 4 * LOGPROB_RECORD_WORDS as u64;
            enc.copy_buffer_to_buffer(&lp.records, at as u64 * record, &self.slots[slot], 8, record);
        }
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
        self.submit_commands_with_readbacks([enc.finish()], slots);
    }

    /// [`Self::submit_with_readbacks`] for finished commands.
    fn submit_commands_with_readbacks(
        &mut self,
        commands: impl IntoIterator<Item = wgpu::CommandBuffer>,
        slots: &[usize],
    ) {
        let submission = self.model.gpu.queue.submit(commands);
        for &slot in slots {
            let mapping = Mapping::start(self.slots[slot].slice(..), submission.clone());
            self.queued.push_back(InFlight { slot, mapping });
        }
    }

    /// Waits for the oldest queued step's token, consumes its position and
    /// makes the token the pending prediction.
    fn take_queued(&mut self) -> Result<u32> {
        let q = self.queued.pop_front().ok_or_else(no_step_in_flight)?;
        let (token, logprobs) = self.read_slot(q)?;
        self.last_logprobs = logprobs;
        self.len += 1;
        if token as usize >= self.model.config.vocab_size {
            return Err(Error::GpuDeviceFailed {
                reason: format!("argmax returned {token} (non-finite logits?)"),
            });
        }
        self.pending = Some(token);
        // The next submit is recorded from here on, so the call that
        // queues it (the first after a feed included) finds it ready. Not
        // for a batch's session: its batch steps it (if it queues steps
        // alone, they are recorded ahead from its second submit on).
        if self.kv_slot.is_none() {
            self.record_ahead();
        }
        Ok(token)
    }

    /// Waits until a slot is mapped, reads its token and frees the slot.
    fn wait_slot(&mut self, q: InFlight) -> Result<u32> {
        self.read_slot(q).map(|(token, _)| token)
    }

    /// [`Self::wait_slot`], with the token's log-probabilities when on.
    fn read_slot(&mut self, mut q: InFlight) -> Result<(u32, Option<TokenLogprobs>)> {
        // Only this step's submit: the steps queued after it keep the GPU
        // busy meanwhile.
        q.mapping.wait(&self.model.gpu, &mut self.blocking_waits)?;
        q.mapping.check()?;
        let buf = &self.slots[q.slot];
        let (token, logprobs) = {
            let view = buf
                .slice(..)
                .get_mapped_range()
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("reading back: {e}") })?;
            let token = u32::from_le_bytes([view[0], view[1], view[2], view[3]]);
            let logprobs = (self.logprobs > 0 && view.len() > 8)
                .then(|| TokenLogprobs::from_record(&bytemuck::pod_collect_to_vec::<u8, u32>(&view[8..])));
            (token, logprobs)
        };
        buf.unmap();
        self.free_slots.push(q.slot);
        Ok((token, logprobs))
    }

    /// Drops the steps queued past `len` (waiting for their slots) and puts
    /// the GPU's position back at `len`, whose token (`pending`) is intact:
    /// queued steps only write tokens after it.
    fn discard_queued(&mut self) -> Result<()> {
        self.drop_prerecorded();
        while let Some(q) = self.queued.pop_front() {
            self.wait_slot(q)?;
        }
        if self.gpu_pos != self.len {
            self.reset_gpu_position();
        }
        Ok(())
    }

    /// Writes the GPU's position back to `len` (and the first position the
    /// argmax may fill to `len + 1`), whatever steps ran since: the host's
    /// count is the truth after launches that advanced it an unknown
    /// number of times.
    fn reset_gpu_position(&mut self) {
        self.write_step(self.len + 1);
        self.gpu_pos = self.len;
    }
}

/// A step was expected on the GPU and none is: a bookkeeping bug.
fn no_step_in_flight() -> Error {
    Error::internal("no decode step in flight")
}

#[cfg(test)]
mod tests {
    use crate::{AdapterPolicy, CachePolicy, Engine, LoadOptions, Model};

    fn fixture_model() -> Model {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
        engine.load(fixture, &options).unwrap()
    }

    /// A non-blocking call submits at most one batch of steps (a frame
    /// pays for one submit per call, not for refilling the whole
    /// lookahead), the next submit is recorded ahead meanwhile, and the
    /// tokens are those of blocking calls, whatever the lookahead.
    #[test]
    fn try_next_token_submits_at_most_once_per_call_and_records_ahead() {
        let model = fixture_model();
        let prompt = [1u32, 2, 3];
        let mut blocking = model.session_with_capacity(40).unwrap();
        let mut want = vec![blocking.feed(&prompt).unwrap()];
        while blocking.len() < blocking.capacity() {
            want.push(blocking.next_token().unwrap());
        }
        for lookahead in [1, 2, 4, 8] {
            let mut s = model.session_with_capacity(40).unwrap();
            s.set_lookahead(lookahead);
            let mut got = vec![s.feed(&prompt).unwrap()];
            // The first submit after the feed is being recorded already.
            let first = s.prerecorded.as_ref().map(|p| p.positions.clone());
            assert_eq!(first, Some(s.gpu_pos..s.gpu_pos + s.steps_per_submit()), "lookahead {lookahead}");
            let waits = s.debug_feed_counts().1;
            let mut recorded_ahead = false;
            while s.len() < s.capacity() {
                let before = s.debug_decode_submits();
                let token = s.try_next_token().unwrap();
                assert!(
                    s.debug_decode_submits() <= before + 1,
                    "lookahead {lookahead}: several submits in one call"
                );
                // Once steps are queued, the next submit is being recorded
                // (unless the capacity leaves no room for one).
                if let Some(p) = &s.prerecorded {
                    assert_eq!(p.positions.start, s.gpu_pos, "lookahead {lookahead}");
                    recorded_ahead = true;
                }
                match token {
                    Some(t) => got.push(t),
                    None => std::thread::sleep(std::time::Duration::from_micros(200)),
                }
            }
            assert!(recorded_ahead, "lookahead {lookahead}: nothing recorded ahead");
            assert_eq!(got, want, "lookahead {lookahead}");
            assert_eq!(s.debug_feed_counts().1, waits, "lookahead {lookahead}: a non-blocking call waited");
        }
    }

    /// The recorder's launches are the forward pass's at every position:
    /// one attention launch per layer within the first chunk, chunks and
    /// their reduction past it.
    #[test]
    fn recorded_steps_are_the_forward_pass_steps() {
        let model = fixture_model();
        let s = model.session_with_capacity(8).unwrap();
        let launches = super::recorder::StepLaunches::of(&s.forward);
        let chunk = crate::kernels::ATTENTION_CHUNK as usize;
        for pos in [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk] {
            let want: Vec<_> = s.forward.step_at(pos).map(|l| (l.kind(), l.workgroups)).collect();
            let got: Vec<_> = launches.at(pos).iter().map(|l| (l.kind(), l.workgroups)).collect();
            assert_eq!(got, want, "position {pos}");
        }
        assert_ne!(launches.at(0).len(), launches.at(chunk).len());
    }

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
