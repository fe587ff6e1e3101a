//! Decode steps on their way to the GPU: keeping the lookahead filled,
//! recording the next submit ahead on the session's recorder, submitting
//! decode steps and prompt batches, and the position the GPU reads.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::buffers::padded;
use crate::error::{Error, Result};
use crate::gpu::Timestamps;
use crate::kernels::sample::LOGPROB_RECORD_WORDS;

use super::recorder::{self, StepPart};
use super::Session;

impl Session {
    /// Checks that a token can follow, then keeps between half the
    /// lookahead and the lookahead of decode steps queued (never past the
    /// capacity): once at most half are left, the steps up to the
    /// lookahead go in submits of half the lookahead (each submit costs
    /// the host and the driver a round of work, so several steps share
    /// one), at most `max_submits` of them in this call. Then the next
    /// submit's steps are recorded ahead.
    pub(super) fn queue_ahead(&mut self, max_submits: usize) -> Result<()> {
        self.check_can_step(1)?;
        self.submit_forward_ahead(max_submits > 1 || self.queued.is_empty());
        if self.queued.len() <= self.effective_lookahead() / 2 {
            // At most half the lookahead per submit: filling an empty queue
            // takes two submits, so the second still runs when the first's
            // tokens come back and the host queues more (a single submit
            // left the GPU idle ~0.9 ms at the start of every decode on an
            // H200).
            let mut submits = 0;
            while submits < max_submits
                && self.queued.len() < self.effective_lookahead()
                && self.gpu_pos < self.bufs.capacity
            {
                let k = (self.effective_lookahead() - self.queued.len())
                    .min(self.steps_per_submit())
                    .min(self.bufs.capacity - self.gpu_pos);
                // A call that need not wait leaves a submit still being
                // recorded for a later call, while steps remain queued.
                let wait = max_submits > 1 || self.queued.is_empty();
                if !self.submit_steps(k, wait)? {
                    break;
                }
                submits += 1;
                self.submit_forward_ahead(max_submits > 1);
            }
        }
        self.record_ahead();
        Ok(())
    }

    /// True while the session submits each step's forward pass ahead of
    /// its token choice: a constraint is awake, so each choice waits for
    /// the mask after the token before it, and the GPU runs the next
    /// forward pass meanwhile (its input token is the choice already
    /// queued: nothing of the host's).
    pub(super) fn splits_steps(&self) -> bool {
        !self.whole_steps_only && self.constraint_awake()
    }

    /// Makes every step a whole one (`false`; the default `true` splits
    /// constrained steps): for tests that compare the two.
    #[doc(hidden)]
    pub fn debug_split_steps(&mut self, on: bool) {
        self.whole_steps_only = !on;
    }

    /// Forward passes submitted ahead of their token choice so far.
    #[doc(hidden)]
    pub fn debug_forward_ahead_submits(&self) -> u64 {
        self.forward_ahead_submits
    }

    /// The position whose forward pass is on the GPU ahead of its token
    /// choice (always `gpu_pos` when valid: any write of the GPU's
    /// position clears it).
    pub(super) fn forward_ahead(&self) -> Option<usize> {
        self.forward_ahead.load(Ordering::Relaxed).checked_sub(1)
    }

    /// While [`Self::splits_steps`], submits the forward pass of the step
    /// at `gpu_pos` unless it is queued already (recorded ahead, or here
    /// if `wait`; otherwise left to a later call while it is being
    /// recorded). Whatever is queued before it writes its input token.
    pub(super) fn submit_forward_ahead(&mut self, wait: bool) {
        let pos = self.gpu_pos;
        if !self.splits_steps() || self.forward_ahead() == Some(pos) || pos >= self.bufs.capacity {
            return;
        }
        let launches = self.step_launches();
        let recorded = match self.prerecorded_forward.take() {
            Some(p) if p.positions.start == pos && Arc::ptr_eq(&p.launches, &launches) => {
                match p.take(wait) {
                    Some(commands) => Some(commands),
                    None => {
                        self.prerecorded_forward = Some(p);
                        return;
                    }
                }
            }
            _ => None,
        };
        let commands = match recorded {
            Some(commands) => commands,
            None if wait => self.steps_job(pos..pos + 1, &[], StepPart::Forward).encode(),
            None => return,
        };
        self.model.gpu.queue.submit([commands]);
        self.forward_ahead.store(pos + 1, Ordering::Relaxed);
        self.forward_ahead_submits += 1;
    }

    /// The part of the step at `gpu_pos` a submit records: its choice
    /// alone when its forward pass is queued already.
    fn first_part(&self) -> StepPart {
        if self.forward_ahead() == Some(self.gpu_pos) {
            StepPart::Choice
        } else {
            StepPart::Whole
        }
    }

    /// Steps per submit of [`Self::queue_ahead`].
    pub(super) fn steps_per_submit(&self) -> usize {
        (self.effective_lookahead() / 2).max(1)
    }

    /// Starts recording the next submit's steps, unless one is recorded
    /// already, none fits, or too few readback slots are free.
    pub(super) fn record_ahead(&mut self) {
        if self.splits_steps() && self.prerecorded_forward.is_none() {
            // The forward pass submitted next: at `gpu_pos` unless queued.
            let pos = self.gpu_pos + usize::from(self.forward_ahead() == Some(self.gpu_pos));
            if pos < self.bufs.capacity && self.started_recorder().is_some() {
                self.prerecorded_forward =
                    Some(self.record_on_thread(pos..pos + 1, Vec::new(), StepPart::Forward));
            }
        }
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
        // A split step's choice follows its forward pass, queued by then.
        let first = if self.splits_steps() { StepPart::Choice } else { StepPart::Whole };
        self.prerecorded = Some(self.record_on_thread(positions, slots, first));
    }

    /// The steps at `positions` sent to the session's thread to record
    /// (recorded on the caller's thread when taken, if it has none).
    pub(super) fn record_on_thread(
        &mut self,
        positions: std::ops::Range<usize>,
        slots: Vec<usize>,
        first: StepPart,
    ) -> recorder::Prerecorded {
        let job = self.steps_job(positions.clone(), &slots, first);
        let commands = match &self.recorder {
            Some(rec) => rec.record(job.clone()),
            // A receiver whose sender is gone: taking it records inline.
            None => std::sync::mpsc::channel().1,
        };
        recorder::Prerecorded { positions, launches: job.launches.clone(), slots, job, commands }
    }

    /// The session's recorder, started on first use (`None` when the
    /// system refuses a thread).
    pub(super) fn started_recorder(&mut self) -> Option<&recorder::Recorder> {
        if self.recorder.is_none() {
            self.recorder = recorder::Recorder::start();
        }
        self.recorder.as_ref()
    }

    /// The launches of a decode step, shared with the recorder.
    pub(super) fn step_launches(&mut self) -> Arc<recorder::StepLaunches> {
        self.step_launches.get_or_insert_with(|| Arc::new(recorder::StepLaunches::of(&self.forward))).clone()
    }

    /// The recording of the steps at `positions`, each copying its token
    /// into the matching one of `slots`.
    pub(super) fn steps_job(
        &mut self,
        positions: std::ops::Range<usize>,
        slots: &[usize],
        first: StepPart,
    ) -> recorder::StepsJob {
        recorder::StepsJob {
            model: self.model.clone(),
            launches: self.step_launches(),
            copies: self.readback_copies(positions.start, slots),
            positions,
            first,
        }
    }

    /// The copies of the tokens of the steps from position `start` on (and
    /// their log-probability records), one step's into each of `slots`.
    fn readback_copies(&self, start: usize, slots: &[usize]) -> Vec<recorder::ReadbackCopy> {
        let mut copies = Vec::with_capacity(2 * slots.len());
        for (i, &slot) in slots.iter().enumerate() {
            let at = (start + i + 1) as u64;
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
        copies
    }

    /// A prompt's submits over positions `start..end` (`end > start`): its
    /// prompt batches, each with its first position, then its last job,
    /// with its first position: the last batch, which holds the last
    /// position and chooses the token after it (a prompt of two positions
    /// or more), or the decode step at the last position (a prompt of one,
    /// or a session without [`Forward::last_row_head`](crate::qwen3::Forward::last_row_head):
    /// the batches then end before it). The last job
    /// copies its token into `slot` (if any). Their submits write the step
    /// buffer at each first position ([`Self::write_step_at`]) and, for a
    /// last batch, [`Self::write_last_step`].
    pub(super) fn prompt_jobs(
        &mut self,
        start: usize,
        end: usize,
        slot: Option<usize>,
    ) -> (Vec<(usize, recorder::PrefillJob)>, usize, recorder::LastJob) {
        let in_batch = end - start >= 2 && self.forward.last_row_head.is_some();
        // Whole batches first; the last job takes the rest (in a batch, 1
        // to a whole batch of positions; else the last position).
        let batch = self.prompt_batch;
        let last_at = if in_batch { start + (end - start - 1) / batch * batch } else { end - 1 };
        let mut batches = Vec::new();
        let mut at = start;
        while at < last_at {
            let n = (last_at - at).min(batch);
            batches.push((at, self.prefill_job(n)));
            at += n;
        }
        (batches, at, self.last_job(at, end, slot, in_batch))
    }

    /// A prompt's last job from position `at` to `end` ([`Self::prompt_jobs`]):
    /// with `batch`, the batch of those positions choosing the token after
    /// them; otherwise the decode step at `at` (= `end - 1`).
    pub(super) fn last_job(
        &mut self,
        at: usize,
        end: usize,
        slot: Option<usize>,
        batch: bool,
    ) -> recorder::LastJob {
        let slots: Vec<usize> = slot.into_iter().collect();
        if !batch {
            return recorder::LastJob::Step(recorder::StepsJob {
                model: self.model.clone(),
                launches: self.step_launches(),
                copies: self.readback_copies(end - 1, &slots),
                positions: end - 1..end,
                first: StepPart::Whole,
            });
        }
        let n = end - at;
        let row_bytes = 4 * padded(self.model.config.hidden_size) as u64;
        let copy = |src: &wgpu::Buffer, src_offset, dst: &wgpu::Buffer, size| recorder::ReadbackCopy {
            src: src.clone(),
            src_offset,
            dst: dst.clone(),
            dst_offset: 0,
            size,
        };
        let tail = recorder::PrefillTail {
            head: self.forward.last_row_head.clone().unwrap_or_default(),
            steps: self.step_launches(),
            pos: end - 1,
            moves: [
                copy(&self.bufs.x, (n - 1) as u64 * row_bytes, &self.bufs.x_last, row_bytes),
                copy(&self.bufs.step_last, 0, &self.bufs.step, 8),
            ],
            copies: self.readback_copies(end - 1, &slots),
        };
        recorder::LastJob::Batch(self.prefill_job(n), tail)
    }

    /// Sets the position of the token choice after a prompt's last batch
    /// (`end - 1`; copied into the step buffer after the batch).
    pub(super) fn write_last_step(&self, end: usize) {
        let step = [(end - 1) as u32, end as u32];
        self.model.gpu.queue.write_buffer(&self.bufs.step_last, 0, bytemuck::cast_slice(&step));
    }

    /// Decode submits so far (steps queued ahead by
    /// [`next_token`](Self::next_token) and
    /// [`try_next_token`](Self::try_next_token); not prompts): for tests
    /// that count the submits of a call.
    #[doc(hidden)]
    pub fn debug_decode_submits(&self) -> u64 {
        self.decode_submits
    }

    /// Drops what is recorded ahead, unsubmitted (the steps and a forward
    /// pass), and frees the slots.
    pub(super) fn drop_prerecorded(&mut self) {
        self.drop_prerecorded_steps();
        self.prerecorded_forward = None;
    }

    /// Drops the steps recorded ahead (not a forward pass recorded ahead
    /// of its choice) and frees their slots.
    pub(super) fn drop_prerecorded_steps(&mut self) {
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
        let first = self.first_part();
        let ahead = match self.prerecorded.take() {
            Some(p)
                if p.positions == positions
                    && p.job.first == first
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
                self.drop_prerecorded_steps();
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
                let commands = self.steps_job(positions, &slots, first).encode();
                (commands, slots)
            }
        };
        self.submit_commands_with_readbacks([commands], &slots);
        self.decode_submits += 1;
        self.gpu_pos += n;
        self.forward_ahead.store(0, Ordering::Relaxed);
        Ok(true)
    }

    /// Whether `n` decode steps can run now: a token is pending (a `feed`
    /// came first) and `n` more positions fit.
    pub(super) fn check_can_step(&self, n: usize) -> Result<()> {
        self.check_no_feed()?;
        if self.pending.is_none() {
            return Err(Error::NoPendingToken);
        }
        // (Forced tokens come first: the mask is the one after them.)
        if let Some(c) = self.constraint.as_ref().filter(|_| self.forced.is_empty()) {
            let vocab = self.model.config.vocab_size;
            if !c.allows_any_below(vocab) {
                return Err(no_token_below(c.kind(), vocab));
            }
        }
        self.check_room(n)
    }

    /// Whether `n` more positions fit (checked: `n` may be any caller's count).
    pub(super) fn check_room(&self, n: usize) -> Result<()> {
        match self.len.checked_add(n) {
            Some(needed) if needed <= self.bufs.capacity => Ok(()),
            needed => Err(Error::ContextOverflow {
                needed: needed.unwrap_or(usize::MAX),
                capacity: self.bufs.capacity,
            }),
        }
    }

    /// The recording of a prompt batch of `n` positions.
    pub(super) fn prefill_job(&self, n: usize) -> recorder::PrefillJob {
        recorder::PrefillJob {
            model: self.model.clone(),
            launches: self.forward.prefill.clone(),
            tokens: n as u32,
        }
    }

    pub(super) fn encoder(&self) -> wgpu::CommandEncoder {
        let gpu = &self.model.gpu;
        gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode") })
    }

    /// Records the decode steps at `positions`, in order, in one compute
    /// pass (optionally timestamped at its start and end): a pass per step
    /// cost ~40 µs of GPU time per step on an H200 (BENCHMARKS.md).
    pub(super) fn record(
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
    pub(super) fn write_step(&self, fill_end: usize) {
        self.write_step_at(self.len, fill_end);
    }

    pub(super) fn write_step_at(&self, pos: usize, fill_end: usize) {
        let (buffer, offset, step) = self.step_write_at(pos, fill_end);
        self.model.gpu.queue.write_buffer(&buffer, offset, bytemuck::cast_slice(&step));
    }

    /// [`Self::write_step_at`]'s write, for another thread to make in its
    /// queue order: (buffer, byte offset, words).
    pub(super) fn step_write_at(&self, pos: usize, fill_end: usize) -> (wgpu::Buffer, u64, Vec<u32>) {
        // A forward pass queued ahead ran at the position this replaces.
        self.forward_ahead.store(0, Ordering::Relaxed);
        (self.bufs.step.clone(), 0, vec![pos as u32, fill_end as u32])
    }
}

/// A constraint allows no token among the model's `vocab` logits.
pub(super) fn no_token_below(kind: &str, vocab: usize) -> Error {
    Error::invalid_argument(
        kind,
        format!(
            "the constraint allows no token among the model's {vocab} here (only tokens past them, such as an \
             end-of-text token of a larger vocabulary, would follow)"
        ),
    )
}
