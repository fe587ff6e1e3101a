//! Fast-forward: the tokens a constraint forces after a chosen one (a
//! JSON key and its quotes after the value before it) run through the
//! model as one prompt batch, with the choice after the last of them, and
//! the calls that return them take no step each and never wait. The
//! constraint consumed them when it computed its mask (the mask on the
//! GPU is the one after them); the session returns them one per call.
//!
//! While forced tokens remain, the step queued is the choice after the last
//! of them: the step at `len + forced.len()`. A discard (new sampling, a
//! batch taking the session back) drops the GPU's work but keeps the
//! tokens, which the constraint has consumed: the next call feeds them
//! again. A feed, a truncate or a new constraint drops them with the reply.

use std::sync::atomic::Ordering;

use crate::error::{Error, Result};

use super::readback::{Away, AwayReadback, InFlight, Mapping};
use super::recorder::LastJob;
use super::Session;

impl Session {
    /// The token id below which a constraint fast-forwards (0: never).
    /// Not while the session reports log-probabilities (each token has its
    /// record). A batch's member fast-forwards too: [`crate::Batch::step`]
    /// leaves it out of the rows while it returns its forced tokens and
    /// the choice after them, as alone.
    pub(super) fn fast_forward_below(&self) -> usize {
        if self.logprobs > 0 {
            0
        } else {
            self.model.config.vocab_size
        }
    }

    /// Moves the tokens the constraint forced after its last token to the
    /// session's, to be returned next.
    pub(super) fn take_forced_from_constraint(&mut self) {
        if let Some(c) = &mut self.constraint {
            self.forced.extend(c.take_forced());
        }
    }

    /// The next forced token, if any: its position's forward pass and the
    /// rest's are submitted first (once), then the token becomes the
    /// pending one without waiting for the GPU.
    pub(super) fn take_forced(&mut self) -> Result<Option<u32>> {
        if self.forced.is_empty() {
            return Ok(None);
        }
        if !self.forced_feed {
            self.submit_forced_feed()?;
        }
        let Some(token) = self.forced.pop_front() else { return Ok(None) };
        self.len += 1;
        self.pending = Some(token);
        self.last_logprobs = None;
        self.forced_tokens += 1;
        Ok(Some(token))
    }

    /// A batch's member returning its forced tokens, or the choice after
    /// them, by itself ([`crate::Batch::step`] leaves it out of the rows
    /// meanwhile): what [`Self::next_token`] (or, `polled`,
    /// [`Self::try_next_token`], `None` while the choice is on its way)
    /// returns, but nothing of its own is queued after them, neither a
    /// step nor a forward pass: the batch steps the member next, as a row.
    pub(crate) fn serve_forced(&mut self, polled: bool) -> Result<Option<u32>> {
        if let Some(token) = self.take_forced()? {
            return Ok(Some(token));
        }
        if !self.settle_forced(!polled)? {
            return Ok(None);
        }
        if polled && self.queued_front_arrived()? != Some(true) {
            return Ok(None);
        }
        self.take_queued(polled).map(Some)
    }

    /// Feeds the pending token and the forced ones as a prompt (its
    /// batches, the last choosing the token after them, whose readback is
    /// queued; [`Self::prompt_jobs`]), from `len`. The recording and the submits run on
    /// the session's thread (a prompt batch's recording takes milliseconds
    /// of a frame); the choice's readback comes back from there
    /// ([`Self::settle_forced`]).
    fn submit_forced_feed(&mut self) -> Result<()> {
        let pending = self.pending.ok_or(Error::NoPendingToken)?;
        self.discard_queued()?;
        let ids: Vec<u32> = std::iter::once(pending).chain(self.forced.iter().copied()).collect();
        self.check_room(ids.len())?;
        self.edits += 1;
        let gpu = self.model.gpu.clone();
        gpu.queue.write_buffer(&self.bufs.tokens, 4 * self.len as u64, bytemuck::cast_slice(&ids));
        let end = self.len + ids.len();
        let slot = self.free_slots.pop().ok_or_else(|| Error::internal("no free token readback slot"))?;
        let (batches, last_at, last) = self.prompt_jobs(self.len, end, Some(slot));
        let in_batch = matches!(last, LastJob::Batch(..));
        // As `write_step_at`: the position a forward pass ran ahead at is gone.
        self.forward_ahead.store(0, Ordering::Relaxed);
        self.gpu_pos = end;
        self.forced_feed = true;
        let (queue, step, step_last, slot_buffer) = (
            gpu.queue.clone(),
            self.bufs.step.clone(),
            self.bufs.step_last.clone(),
            self.slots[slot].clone(),
        );
        let task = move || {
            for (at, batch) in batches {
                queue.write_buffer(&step, 0, bytemuck::cast_slice(&[at as u32, end as u32]));
                queue.submit([batch.encode()]);
            }
            queue.write_buffer(&step, 0, bytemuck::cast_slice(&[last_at as u32, end as u32]));
            if in_batch {
                queue.write_buffer(&step_last, 0, bytemuck::cast_slice(&[(end - 1) as u32, end as u32]));
            }
            let submission = queue.submit([last.encode()]);
            Mapping::start(slot_buffer.slice(..), submission)
        };
        match self.started_recorder() {
            Some(rec) => self.forced_away = Some(AwayReadback::start(rec, slot, task)),
            None => {
                self.inline_feed_recordings += 1;
                let mapping = task();
                self.queued.push_back(InFlight::new(slot, mapping));
            }
        }
        Ok(())
    }

    /// Takes back the forced tokens' feed from the session's thread (its
    /// choice's readback joins the queued steps), waiting for it if `wait`:
    /// false while it is still on its way.
    pub(super) fn settle_forced(&mut self, wait: bool) -> Result<bool> {
        let Some(away) = &self.forced_away else { return Ok(true) };
        match away.settle(wait) {
            Away::Pending => Ok(false),
            Away::Submitted(readback) => {
                self.forced_away = None;
                self.queued.push_back(readback);
                Ok(true)
            }
            Away::Lost(slot) => {
                self.forced_away = None;
                self.free_slots.push(slot);
                self.forced_feed = false;
                Err(Error::internal("the session's thread ended without submitting the forced tokens"))
            }
        }
    }

    /// Tokens returned as forced by a constraint (fed in one batch, not
    /// chosen by a step each) so far.
    #[doc(hidden)]
    pub fn debug_forced_tokens(&self) -> u64 {
        self.forced_tokens
    }
}
