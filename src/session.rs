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
use std::sync::Arc;

mod batch;
mod choice_worker;
mod choosing;
mod diagnostics;
mod feed;
mod forced;
mod options;
mod readback;
mod recorder;
mod state;
mod submit;
#[cfg(test)]
mod tests;

use crate::buffers::SessionBuffers;
pub use crate::buffers::PREFILL_BATCH;
use crate::error::{Error, Result};
use crate::gpu_weights::ModelGpu;
use crate::kernels::sample::{LOGPROB_RECORD_WORDS, MAX_LOGPROBS};
use crate::kv_cache::KvFormat;
use crate::qwen3::Forward;
use crate::sampling::{SamplingParams, TokenLogprobs};
pub use batch::{Batch, BatchOptions, WARM_UP_MAX_ROWS};
pub use diagnostics::{LaunchTimes, StepTiming};
pub use feed::FeedStatus;
pub use options::SessionOptions;
pub(crate) use state::restore;
pub use state::SESSION_FORMAT_VERSION;

use choice_worker::spawn_mask_tasks;
use readback::{no_step_in_flight, InFlight, Mapping};

/// Decode steps queued on the GPU ahead of the caller by default (see
/// [`Session::set_lookahead`]). Enough to hide the host's encoding and
/// readback behind the GPU's work; each costs at most one wasted step when
/// the caller stops early.
pub const DEFAULT_LOOKAHEAD: usize = 4;

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
    /// The most positions one prompt batch holds ([`Session::set_prompt_batch`]).
    prompt_batch: usize,
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
    /// The output constraint of the reply being generated, if any: every
    /// token returned advances it, and its mask is on the GPU before the
    /// step that chooses the next.
    /// (`None` while the choice on the session's thread holds it.)
    constraint: Option<crate::constraint::ConstraintState>,
    /// A polled constrained step's token choice on the session's thread
    /// (which computes the mask first), until the next call settles it.
    choice_on_worker: Option<choice_worker::ChoiceOnWorker>,
    /// Token choices handed to the session's thread so far.
    choices_on_worker: u64,
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
    /// The next forward pass submitted ahead of its choice, recorded ahead
    /// (while [`Self::splits_steps`]).
    prerecorded_forward: Option<recorder::Prerecorded>,
    /// One more than the position whose forward pass is queued ahead of
    /// its token choice (0: none); atomic so that writes of the GPU's
    /// position through `&self` clear it.
    forward_ahead: std::sync::atomic::AtomicUsize,
    /// Forward passes submitted ahead of their choice so far.
    forward_ahead_submits: u64,
    /// Never split a step (tests comparing split and whole steps).
    whole_steps_only: bool,
    /// Decode submits so far (steps queued ahead; not prompts).
    decode_submits: u64,
    /// Prompt submits whose commands were recorded on the caller's thread
    /// (a blocking feed's; a polled feed's only when the recorder is gone).
    inline_feed_recordings: u64,
    /// Prompt submits made on the caller's thread (a blocking feed's; a
    /// polled feed's only without a recording thread): for tests.
    inline_feed_submits: u64,
    /// Tokens the constraint forced after the pending one, not yet
    /// returned: the next calls return them without a step each.
    forced: VecDeque<u32>,
    /// The forced tokens' prompt batch is on the GPU: the queued step is
    /// the choice after the last of them.
    forced_feed: bool,
    /// The forced tokens' feed while the session's thread submits it.
    forced_away: Option<readback::AwayReadback>,
    /// Tokens returned from [`Self::forced`] so far.
    forced_tokens: u64,
}

impl Session {
    pub(crate) fn new(model: Arc<ModelGpu>, capacity: usize, kv_format: KvFormat) -> Result<Self> {
        Self::new_in(model, capacity, kv_format, None)
    }

    /// A session whose KV cache is `kv_slot`'s region of a batch's pool
    /// (or, without one, buffers of its own), in `kv_format`.
    fn new_in(
        model: Arc<ModelGpu>,
        capacity: usize,
        kv_format: KvFormat,
        kv_slot: Option<batch::SlotLease>,
    ) -> Result<Self> {
        let cfg = &model.config;
        model.kernels.prepare_kv(&model.gpu, kv_format, cfg.head_dim)?;
        let (bufs, forward) = model.gpu.scoped(
            || {
                let kv = kv_slot.as_ref().map(batch::SlotLease::region);
                let bufs = SessionBuffers::new(&model.gpu, cfg, capacity, kv_format, kv)?;
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
            prompt_batch: 0,
            feed_progress: None,
            blocking_waits: 0,
            sampling: SamplingParams::default(),
            logprobs: 0,
            last_logprobs: None,
            constraint: None,
            choice_on_worker: None,
            choices_on_worker: 0,
            kv_slot,
            edits: 0,
            step_launches: None,
            recorder: None,
            prerecorded: None,
            prerecorded_forward: None,
            forward_ahead: std::sync::atomic::AtomicUsize::new(0),
            forward_ahead_submits: 0,
            whole_steps_only: false,
            decode_submits: 0,
            inline_feed_recordings: 0,
            inline_feed_submits: 0,
            forced: VecDeque::new(),
            forced_feed: false,
            forced_away: None,
            forced_tokens: 0,
        };
        session.prompt_batch = session.bufs.batch;
        session.set_lookahead(DEFAULT_LOOKAHEAD);
        Ok(session)
    }

    /// KV-cache capacity in positions.
    pub fn capacity(&self) -> usize {
        self.bufs.capacity
    }

    /// How the KV cache stores its rows ([`SessionOptions::kv_cache`]).
    pub fn kv_format(&self) -> KvFormat {
        self.bufs.kv_layout.format
    }

    /// Positions already in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before any token was fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waits until the steps of this session's batch handed to the batch's
    /// thread are submitted (at once when none is, or the session is no
    /// batch's): every public call that queues or reads anything on the
    /// GPU calls it first, so that it comes after them in queue order.
    fn settle_batch(&self) {
        if let Some(lease) = &self.kv_slot {
            lease.settle_batch_submits();
        }
    }

    /// Sets how many decode steps [`next_token`](Self::next_token) keeps
    /// queued on the GPU (at least 1; 1 means a wait on every token; at
    /// most the capacity, as no more steps can ever be queued).
    pub fn set_lookahead(&mut self, steps: usize) {
        self.settle_batch();
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

    /// Sets the most prompt positions one batch of a feed runs
    /// ([`feed`](Self::feed), [`begin_feed`](Self::begin_feed)): 1 up to
    /// [`PREFILL_BATCH`](crate::PREFILL_BATCH) (or the capacity, if
    /// smaller), the default. Each batch reads every weight once, so smaller
    /// batches feed a prompt more slowly, but a polled feed puts at most one
    /// batch of GPU work ahead of a renderer sharing the queue: 256 positions
    /// of the 0.6B are ~8 ms of an H100, 64 ~2 ms. The tokens do not depend
    /// on it beyond rounding (each position's sums are its own). Takes
    /// effect at the next feed. Anything else is [`Error::InvalidArgument`]
    /// naming `prompt_batch` (the setting is left as it was).
    ///
    /// ```no_run
    /// # fn f(session: &mut qwen3_wgpu::Session) -> qwen3_wgpu::Result<()> {
    /// // A game feeding prompts while it renders: about 2 ms of GPU a frame.
    /// session.set_prompt_batch(64)?;
    /// assert_eq!(session.prompt_batch(), 64);
    /// # Ok(())
    /// # }
    /// ```
    pub fn set_prompt_batch(&mut self, positions: usize) -> Result<()> {
        if positions == 0 || positions > self.bufs.batch {
            return Err(Error::invalid_argument(
                "prompt_batch",
                format!("{positions} positions; this session's batches hold 1 to {}", self.bufs.batch),
            ));
        }
        self.prompt_batch = positions;
        Ok(())
    }

    /// The most prompt positions one batch of a feed runs
    /// ([`set_prompt_batch`](Self::set_prompt_batch)).
    pub fn prompt_batch(&self) -> usize {
        self.prompt_batch
    }

    /// GPU memory this session allocated (KV cache, activations, scratch,
    /// launch parameters), bytes.
    pub fn buffer_bytes(&self) -> u64 {
        self.bufs.bytes() + self.forward.uniform_bytes + self.forward.choose_uniform_bytes
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
    /// before touching the GPU. The tokens run through the layers in
    /// batches of [`PREFILL_BATCH`] (one launch per kernel per batch,
    /// causal attention within it); after the last batch the LM head runs
    /// over its last row and the token choice gives the returned token (a
    /// single position runs the decode step instead).
    ///
    /// The pending token ([`pending`](Self::pending): the last one `feed`
    /// or [`next_token`](Self::next_token) returned, not yet in the KV
    /// cache) is committed first, ahead of `ids`: after a generation, the
    /// next turn's text follows the whole reply, and the KV cache holds the
    /// whole conversation (it takes one position more than `ids`). To drop
    /// it instead (a reply cut before its last token), call
    /// [`truncate`](Self::truncate)`(len())` first.
    pub fn feed(&mut self, ids: &[u32]) -> Result<u32> {
        self.settle_batch();
        self.check_no_feed()?;
        check_prompt(ids, self.model.config.vocab_size)?;
        let ids: std::borrow::Cow<[u32]> = match self.pending {
            Some(token) => std::iter::once(token).chain(ids.iter().copied()).collect(),
            None => ids.into(),
        };
        let ids = &ids[..];
        self.check_room(ids.len())?;
        self.discard_queued()?;
        self.restart_constraint()?;
        self.edits += 1;
        let gpu = self.model.gpu.clone();
        gpu.queue.write_buffer(&self.bufs.tokens, 4 * self.len as u64, bytemuck::cast_slice(ids));
        let end = self.len + ids.len();
        let slot = self.free_slots.pop().ok_or_else(|| Error::internal("no free token readback slot"))?;
        let (batches, last_at, last) = self.prompt_jobs(self.len, end, Some(slot));
        // No waits in between: each batch's position is written before its
        // submit (writes and submits run in queue order).
        for (at, batch) in batches {
            self.write_step_at(at, end);
            self.inline_feed_recordings += 1;
            self.inline_feed_submits += 1;
            gpu.queue.submit([batch.encode()]);
        }
        self.write_step_at(last_at, end);
        if matches!(last, recorder::LastJob::Batch(..)) {
            self.write_last_step(end);
        }
        self.inline_feed_recordings += 1;
        self.inline_feed_submits += 1;
        self.submit_commands_with_readbacks([last.encode()], &[slot]);
        self.gpu_pos = end;
        self.len = end - 1;
        self.take_queued(false)
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
        self.settle_batch();
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
        self.restart_constraint()
    }

    /// Feeds the pending greedy token back in and returns the next one
    /// (the streaming step). Fails with `no_pending_token` before any `feed`.
    pub fn next_token(&mut self) -> Result<u32> {
        self.settle_batch();
        if let Some(settled) = self.settle_choice(true) {
            settled?;
        }
        if let Some(token) = self.take_forced()? {
            return Ok(token);
        }
        self.settle_forced(true)?;
        self.queue_ahead(usize::MAX)?;
        self.take_queued(false)
    }

    /// [`next_token`](Self::next_token) that never waits for the GPU: it
    /// queues steps the same way and returns `Ok(None)` while the next
    /// token is still on its way (call again later, e.g. next frame: a host
    /// that renders keeps its frame rate). The tokens are those
    /// `next_token` would return. A call submits at most one batch of
    /// steps (half the lookahead), recorded ahead of time on a thread of
    /// the session's own, so the caller's thread pays for the submit and
    /// the readback, not for recording. Under a constraint
    /// ([`set_constraint`](Self::set_constraint)), the call that returns a
    /// token leaves the next mask and the next token's choice to that
    /// thread too; the next call returns `None` until they are submitted,
    /// and any other call of the session's waits for them first. A failure
    /// of that mask (the constraint allowing no token) is the next call's
    /// error.
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
        self.settle_batch();
        match self.settle_choice(false) {
            // The mask after the last token is still being computed.
            None if self.choice_on_worker.is_some() => return Ok(None),
            Some(Err(e)) => return Err(e),
            _ => {}
        }
        if let Some(token) = self.take_forced()? {
            return Ok(Some(token));
        }
        if !self.settle_forced(false)? {
            return Ok(None);
        }
        self.queue_ahead(1)?;
        match self.queued_front_arrived()? {
            None => Err(no_step_in_flight()),
            Some(false) => Ok(None),
            Some(true) => self.take_queued(true).map(Some),
        }
    }

    /// Whether the oldest queued step's token is back, polling the device
    /// once when it is not yet (one poll maps every step of a submit);
    /// `None` when no step is queued.
    pub(crate) fn queued_front_arrived(&mut self) -> Result<Option<bool>> {
        let Some(front) = self.queued.front_mut() else { return Ok(None) };
        if front.arrived()? {
            return Ok(Some(true));
        }
        self.model.gpu.poll_once()?;
        match self.queued.front_mut() {
            Some(front) => front.arrived().map(Some),
            None => Ok(None),
        }
    }
}
