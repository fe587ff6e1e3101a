//! Feeding a prompt without blocking: [`Session::begin_feed`] starts it and
//! [`Session::poll_feed`] advances it by at most one prompt batch per call,
//! never waiting for the GPU, so a host that renders on the same queue
//! keeps its frame rate: at most one polled prompt submit is on the GPU at
//! a time, whichever session (or model) on the device it serves, so a frame
//! submitted meanwhile never queues behind a backlog of prompt work.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::readback::{Away, AwayReadback, Mapping};
use super::recorder::{Ahead, LastJob, PrefillJob};
use super::{check_prompt, InFlight, Session};
use crate::error::{Error, Result};
use crate::gpu::PromptTicket;

/// What [`Session::poll_feed`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FeedStatus {
    /// The feed is under way: `fed` of its `total` positions are done
    /// (`total` counts the ids given plus the pending token committed ahead
    /// of them, if any).
    Pending {
        /// Positions the GPU has finished.
        fed: usize,
        /// Positions this feed runs.
        total: usize,
    },
    /// The feed is done: the prediction after its last id, now the
    /// session's pending token (as [`Session::feed`] returns it).
    Ready(u32),
}

/// A feed in progress.
pub(super) struct FeedProgress {
    /// The session's length when the feed began: its first position.
    start: usize,
    /// One past the last position fed.
    end: usize,
    /// The first position whose batch is not submitted yet.
    next: usize,
    /// Positions below this are done on the GPU.
    done: usize,
    /// The batch on the GPU: the position it ends at, and the flag the queue
    /// sets once it is done.
    in_flight: Option<(usize, Arc<AtomicBool>)>,
    /// The prompt's last submit (with its token's readback) is submitted:
    /// its readback is the front of the session's queue.
    final_submitted: bool,
    /// Steps that were queued ahead when the feed began, discarded: their
    /// readback slots come back as their mappings arrive.
    discarded: Vec<InFlight>,
    /// Submits so far (tests check that each call adds at most one).
    submits: usize,
    /// The prompt batches not submitted yet, in order, recorded (or being
    /// recorded) on the session's recorder, which also submits them: a
    /// frame that polls the feed pays neither for recording ~300 launches
    /// per batch nor for their submit.
    batches: VecDeque<Ahead<PrefillJob>>,
    /// The prompt's last submit ([`Session::prompt_jobs`]), recorded
    /// likewise, with the copy of its token into `last_slot` (without, if
    /// no slot was free: the copy is then recorded at its submit); `None`
    /// once submitted.
    last: Option<Ahead<LastJob>>,
    /// Its first position, and whether it is a prompt batch (else the
    /// decode step of a one-position prompt).
    last_at: usize,
    last_is_batch: bool,
    /// The readback slot the last step's token goes to, taken at
    /// `begin_feed` (returned if the feed fails before its submit).
    last_slot: Option<usize>,
    /// The last submit handed to the session's thread: its slot, and the
    /// slot's mapping, sent back once submitted (then it joins the
    /// session's queue).
    last_away: Option<AwayReadback>,
}

impl FeedProgress {
    fn status(&self) -> FeedStatus {
        FeedStatus::Pending { fed: self.done - self.start, total: self.end - self.start }
    }
}

impl Session {
    /// Starts feeding `ids` without blocking: checks them as
    /// [`feed`](Self::feed) does (every id, the capacity, the pending token
    /// committed first), hands the prompt batches' commands (the last one
    /// choosing the token after the prompt) to the session's recording
    /// thread and returns: a frame that starts or polls a feed pays for
    /// neither recording nor submitting them (that thread does both). Then call [`poll_feed`](Self::poll_feed) (say once a frame) until it
    /// returns [`FeedStatus::Ready`] with the prediction after the last id,
    /// the token [`feed`](Self::feed) would return. Neither call ever waits
    /// for the GPU, and at most one batch of [`PREFILL_BATCH`](crate::PREFILL_BATCH)
    /// positions of any polled feed on the device is on the GPU at a time
    /// (feeds begun together take turns, a batch each), so a renderer
    /// sharing the queue never waits behind a backlog of prompt work. Steps queued ahead by
    /// [`next_token`](Self::next_token) are discarded without waiting.
    ///
    /// While a feed is in progress, every other call that runs the model or
    /// changes the context ([`feed`](Self::feed), `begin_feed`,
    /// [`next_token`](Self::next_token), [`try_next_token`](Self::try_next_token),
    /// [`truncate`](Self::truncate), [`fork`](Self::fork),
    /// [`save`](Self::save)) fails with [`Error::InvalidArgument`] naming
    /// `session`, and leaves the feed as it was.
    ///
    /// ```no_run
    /// # fn f(session: &mut qwen3_wgpu::Session, prompt: &[u32]) -> qwen3_wgpu::Result<()> {
    /// use qwen3_wgpu::FeedStatus;
    /// session.begin_feed(prompt)?;
    /// loop {
    ///     // ... render a frame ...
    ///     match session.poll_feed()? {
    ///         FeedStatus::Pending { fed, total } => println!("prompt {fed}/{total}"),
    ///         FeedStatus::Ready(token) => {
    ///             println!("first token {token}");
    ///             break;
    ///         }
    ///         _ => {}
    ///     }
    /// }
    /// // Then `try_next_token` streams the rest without blocking either.
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: those of [`feed`](Self::feed), before anything is submitted.
    pub fn begin_feed(&mut self, ids: &[u32]) -> Result<()> {
        self.settle_batch();
        self.check_no_feed()?;
        self.settle_choice_quietly();
        check_prompt(ids, self.model.config.vocab_size)?;
        let ids: Vec<u32> = self.pending.into_iter().chain(ids.iter().copied()).collect();
        self.check_room(ids.len())?;
        // The steps queued ahead only write positions past `len`, which
        // the feed overwrites after them in queue order: no need to wait.
        let discarded = self.queued.drain(..).collect();
        // A submit recorded ahead serves positions the feed moves past.
        self.drop_prerecorded();
        self.restart_constraint()?;
        self.edits += 1;
        let start = self.len;
        self.model.gpu.queue.write_buffer(&self.bufs.tokens, 4 * start as u64, bytemuck::cast_slice(&ids));
        self.pending = None;
        self.gpu_pos = start;
        let end = start + ids.len();
        // A slot is free: at most `lookahead` steps are ever queued (now
        // discarded), and there is one slot more.
        let last_slot = self.free_slots.pop();
        // Every submit's commands, sent to the recorder now, in order.
        let (prefill_jobs, last_at, last_job) = self.prompt_jobs(start, end, last_slot);
        let last_is_batch = matches!(last_job, LastJob::Batch(..));
        let recorder = self.started_recorder();
        let batches = prefill_jobs.into_iter().map(|(_, job)| Ahead::record(recorder, job)).collect();
        let last = Some(Ahead::record(recorder, last_job));
        let mut progress = FeedProgress {
            start,
            end,
            next: start,
            done: start,
            in_flight: None,
            final_submitted: false,
            discarded,
            submits: 0,
            batches,
            last,
            last_at,
            last_is_batch,
            last_slot,
            last_away: None,
        };
        self.submit_feed_work(&mut progress);
        self.feed_progress = Some(progress);
        Ok(())
    }

    /// Advances the feed [`begin_feed`](Self::begin_feed) started, without
    /// waiting: when the batch on the GPU is done (or none was submitted
    /// yet), has the session's thread submit the next one once it is
    /// recorded (or submits the last batch, once recorded); when its token has arrived,
    /// returns it as [`FeedStatus::Ready`] and the feed is over (the session
    /// then holds the ids, and the token is pending, exactly as after
    /// [`feed`](Self::feed)). Otherwise [`FeedStatus::Pending`] with the
    /// progress.
    ///
    /// Errors: [`Error::InvalidArgument`] naming `session` when no feed is
    /// in progress; a GPU failure (the session is then rewound to where the
    /// feed began, without the pending token).
    pub fn poll_feed(&mut self) -> Result<FeedStatus> {
        self.settle_batch();
        let mut progress = self.feed_progress.take().ok_or_else(|| {
            Error::invalid_argument("session", "no feed in progress: call begin_feed first")
        })?;
        match self.advance_feed(&mut progress) {
            Ok(FeedStatus::Ready(token)) => Ok(FeedStatus::Ready(token)),
            Ok(status) => {
                self.feed_progress = Some(progress);
                Ok(status)
            }
            Err(e) => {
                // A prompt batch handed to the session's thread is
                // submitted (its position written) before the rewind's.
                if let Some(rec) = &self.recorder {
                    rec.finish_queued();
                }
                // The last submit, if handed to that thread, is in flight:
                // reclaimed as the rest (its slot back once it arrives).
                if let Some(away) = progress.last_away.take() {
                    match away.settle(false) {
                        Away::Submitted(readback) => self.queued.push_back(readback),
                        Away::Pending | Away::Lost(_) => self.free_slots.push(away.slot()),
                    }
                }
                // Rewind to where the feed began; what is still in flight
                // is reclaimed by the next call that discards queued steps.
                self.queued.extend(progress.discarded.drain(..));
                self.free_slots.extend(progress.last_slot.take());
                self.len = progress.start;
                self.pending = None;
                self.reset_gpu_position();
                Err(e)
            }
        }
    }

    /// Whether a feed begun by [`begin_feed`](Self::begin_feed) is still in
    /// progress (until [`poll_feed`](Self::poll_feed) returns
    /// [`FeedStatus::Ready`] or an error).
    pub fn is_feeding(&self) -> bool {
        self.feed_progress.is_some()
    }

    /// Takes the device's polled-prompt ticket, if free, until the returned
    /// value is dropped: while it is held no polled feed on the device
    /// submits (tests of the feeds taking turns).
    #[doc(hidden)]
    pub fn debug_hold_prompt_ticket(&self) -> Option<Box<dyn std::any::Any + Send>> {
        let ticket = self.model.gpu.try_prompt_ticket()?;
        Some(Box::new(ticket))
    }

    /// (Submits of the feed in progress, waits on the GPU in this session
    /// so far): for tests that check that feeding never waits.
    #[doc(hidden)]
    pub fn debug_feed_counts(&self) -> (usize, u64) {
        (self.feed_progress.as_ref().map_or(0, |p| p.submits), self.blocking_waits)
    }

    /// Prompt submits (batches and a feed's last step) so far whose
    /// commands were recorded on the caller's thread: a blocking
    /// [`feed`](Self::feed)'s, and a polled feed's only when the recording
    /// thread is gone. For tests that check where a feed is recorded.
    #[doc(hidden)]
    pub fn debug_inline_feed_recordings(&self) -> u64 {
        self.inline_feed_recordings
    }

    /// Prompt submits (batches and a feed's last submit) so far made on
    /// the caller's thread: a blocking [`feed`](Self::feed)'s, and a
    /// polled feed's only when the session's thread is gone. For tests
    /// that check that polling a feed leaves submits to that thread.
    #[doc(hidden)]
    pub fn debug_inline_feed_submits(&self) -> u64 {
        self.inline_feed_submits
    }

    /// The named error of a call made while a feed is in progress.
    pub(super) fn check_no_feed(&self) -> Result<()> {
        match &self.feed_progress {
            None => Ok(()),
            Some(_) => Err(Error::invalid_argument(
                "session",
                "a feed begun with begin_feed is in progress: call poll_feed until it returns Ready",
            )),
        }
    }

    fn advance_feed(&mut self, progress: &mut FeedProgress) -> Result<FeedStatus> {
        let gpu = self.model.gpu.clone();
        gpu.poll_once()?;
        self.reclaim_discarded(progress, false)?;
        if let Some((end, done)) = &progress.in_flight {
            if !done.load(Ordering::Acquire) {
                return Ok(progress.status());
            }
            progress.done = *end;
            progress.in_flight = None;
        }
        if !progress.final_submitted {
            self.submit_feed_work(progress);
            return Ok(progress.status());
        }
        if let Some(away) = &progress.last_away {
            match away.settle(false) {
                Away::Pending => return Ok(progress.status()),
                Away::Submitted(readback) => self.queued.push_back(readback),
                Away::Lost(slot) => {
                    progress.last_away = None;
                    self.free_slots.push(slot);
                    return Err(Error::internal(
                        "the session's thread ended without submitting the prompt's last step",
                    ));
                }
            }
            progress.last_away = None;
        }
        let front =
            self.queued.front_mut().ok_or_else(|| Error::internal("the feed's last step is not queued"))?;
        if !front.arrived()? {
            return Ok(progress.status());
        }
        // Every earlier submit is done once the last step's token is back,
        // so the discarded steps' slots are all mapped by now.
        self.reclaim_discarded(progress, true)?;
        // A batch's member leaves the mask after the feed's token to
        // rayon's threads (its batch's next step settles it): a frame with
        // several conversations restarting computed each on the caller's.
        self.take_queued(self.kv_slot.is_some()).map(FeedStatus::Ready)
    }

    /// Frees the readback slots of the discarded steps whose mappings have
    /// arrived (all of them with `all`).
    fn reclaim_discarded(&mut self, progress: &mut FeedProgress, all: bool) -> Result<()> {
        let mut i = 0;
        while i < progress.discarded.len() {
            if all || progress.discarded[i].arrived()? {
                let step = progress.discarded.swap_remove(i);
                self.wait_slot(step)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Hands the feed's next prompt batch to the session's thread, which
    /// writes its position and submits it once recorded (a submit costs
    /// the caller a driver's round of work, ~0.1-0.4 ms; several
    /// conversations restarting in one frame paid for each). Nothing else
    /// of the session's is queued until the batch is done (the poll that
    /// sees it done submits the next).
    fn submit_batch_on_thread(&mut self, progress: &mut FeedProgress, ticket: PromptTicket) {
        let (Some(batch), Some(rec)) = (progress.batches.pop_front(), &self.recorder) else { return };
        let (at, end) = (progress.next, progress.end);
        let n = batch.job.tokens as usize;
        // As `write_step_at`: the position a forward pass ran ahead at is gone.
        self.forward_ahead.store(0, Ordering::Relaxed);
        let done = Arc::new(AtomicBool::new(false));
        let (queue, step, flag) = (self.model.gpu.queue.clone(), self.bufs.step.clone(), done.clone());
        rec.run(move || {
            let commands = batch.take_waiting();
            queue.write_buffer(&step, 0, bytemuck::cast_slice(&[at as u32, end as u32]));
            queue.submit([commands]);
            queue.on_submitted_work_done(move || {
                flag.store(true, Ordering::Release);
                drop(ticket);
            });
        });
        progress.submits += 1;
        progress.next = at + n;
        progress.in_flight = Some((at + n, done));
    }

    /// Submits the feed's next prompt batch, or its last submit (the last
    /// batch and the token choice after it, with the token's readback) once
    /// every other batch is done, unless its
    /// commands are still being recorded (a later poll submits them).
    ///
    /// Nothing is submitted while another polled feed's submit (this
    /// session's or any other's on the device) is in flight: a later poll
    /// submits it ([`PromptTicket`]).
    fn submit_feed_work(&mut self, progress: &mut FeedProgress) {
        let gpu = self.model.gpu.clone();
        let Some(ticket) = gpu.try_prompt_ticket() else { return };
        let end = progress.end;
        if progress.next < progress.last_at {
            let at = progress.next;
            if self.recorder.is_some() && !progress.batches.is_empty() {
                self.submit_batch_on_thread(progress, ticket);
                return;
            }
            let (commands, n, inline) = match progress.batches.front() {
                Some(batch) => match batch.take() {
                    Some((commands, inline)) => (commands, batch.job.tokens as usize, inline),
                    None => return,
                },
                // Unreachable (one job per batch); record here.
                None => {
                    let n = (progress.last_at - at).min(self.prompt_batch);
                    (self.prefill_job(n).encode(), n, true)
                }
            };
            progress.batches.pop_front();
            self.inline_feed_recordings += u64::from(inline);
            self.inline_feed_submits += 1;
            self.write_step_at(at, end);
            gpu.queue.submit([commands]);
            progress.submits += 1;
            let done = Arc::new(AtomicBool::new(false));
            let flag = done.clone();
            gpu.queue.on_submitted_work_done(move || {
                flag.store(true, Ordering::Release);
                drop(ticket);
            });
            progress.next = at + n;
            progress.in_flight = Some((at + n, done));
            return;
        }
        let launches = self.step_launches();
        // Recorded ahead with the launches the session steps with now.
        let recorded = match &progress.last {
            Some(last) if Arc::ptr_eq(last.job.steps(), &launches) => match last.take() {
                Some(recorded) => Some(recorded),
                None => return,
            },
            _ => None,
        };
        progress.last = None;
        let (last_at, batch) = (progress.last_at, progress.last_is_batch);
        self.write_step_at(last_at, end);
        if batch {
            self.write_last_step(end);
        }
        match progress.last_slot.take() {
            Some(slot) => {
                let (commands, inline) = recorded
                    .unwrap_or_else(|| (self.last_job(last_at, end, Some(slot), batch).encode(), true));
                self.inline_feed_recordings += u64::from(inline);
                match &self.recorder {
                    // Submitted on the session's thread, as the prompt's
                    // batches are (a submit is a driver's round of work,
                    // ~0.1-0.5 ms of a frame); the token's mapping comes
                    // back from there. Its step positions, written above,
                    // precede it in queue order.
                    Some(rec) => {
                        let (queue, buffer) = (gpu.queue.clone(), self.slots[slot].clone());
                        progress.last_away = Some(AwayReadback::start(rec, slot, move || {
                            let submission = queue.submit([commands]);
                            queue.on_submitted_work_done(move || drop(ticket));
                            Mapping::start(buffer.slice(..), submission)
                        }));
                        self.finish_last_submit(progress, end);
                        return;
                    }
                    None => {
                        self.inline_feed_submits += 1;
                        self.submit_commands_with_readbacks([commands], &[slot]);
                    }
                }
            }
            None => {
                // No slot was free at begin_feed (unreachable by the count
                // there): the token's copy is recorded here.
                let (commands, inline) =
                    recorded.unwrap_or_else(|| (self.last_job(last_at, end, None, batch).encode(), true));
                self.inline_feed_recordings += u64::from(inline);
                self.inline_feed_submits += 1;
                let mut copy = self.encoder();
                match self.queue_readback(&mut copy, end) {
                    Ok(slot) => self.submit_commands_with_readbacks([commands, copy.finish()], &[slot]),
                    // Fails the next poll cleanly.
                    Err(_) => {
                        gpu.queue.submit([commands, copy.finish()]);
                    }
                }
            }
        }
        gpu.queue.on_submitted_work_done(move || drop(ticket));
        self.finish_last_submit(progress, end);
    }

    /// The session and the feed after the prompt's last submit.
    fn finish_last_submit(&mut self, progress: &mut FeedProgress, end: usize) {
        progress.submits += 1;
        self.gpu_pos = end;
        self.len = end - 1;
        progress.next = end;
        progress.final_submitted = true;
    }
}
