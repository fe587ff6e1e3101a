//! Tokens on their way back from the GPU: each readback slot's mapping,
//! the copy of a step's token into a slot, waiting for and reading the
//! oldest queued token, and discarding the steps no longer wanted.

use std::sync::mpsc;

use crate::error::{Error, Result};
use crate::kernels::sample::LOGPROB_RECORD_WORDS;
use crate::sampling::TokenLogprobs;

use super::Session;

/// A readback buffer's mapping on its way: the submit that fills the
/// buffer and the `map_async` signal, with its outcome once seen. The one
/// place a readback signal is read (a session's tokens and a batch's).
pub(super) struct Mapping {
    /// The submit that fills the buffer (a wait waits for it alone).
    submission: wgpu::SubmissionIndex,
    signal: mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    /// The outcome once seen (by a non-blocking check).
    outcome: Option<std::result::Result<(), wgpu::BufferAsyncError>>,
}

impl Mapping {
    /// Maps `slice` for reading once `submission` (already submitted) is
    /// done.
    pub(super) fn start(slice: wgpu::BufferSlice<'_>, submission: wgpu::SubmissionIndex) -> Self {
        let (tx, signal) = mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        Mapping { submission, signal, outcome: None }
    }

    /// Whether the mapping has completed (successfully or not: see
    /// [`Self::check`]), without waiting.
    pub(super) fn arrived(&mut self) -> Result<bool> {
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
    pub(super) fn check(&self) -> Result<()> {
        match &self.outcome {
            Some(Err(e)) => Err(Error::GpuDeviceFailed { reason: format!("map_async: {e}") }),
            _ => Ok(()),
        }
    }

    /// Waits (polling the device for this submit alone) until the mapping
    /// has completed; counts the wait in `waits`.
    pub(super) fn wait(&mut self, gpu: &crate::gpu::Gpu, waits: &mut u64) -> Result<()> {
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
pub(super) struct InFlight {
    slot: usize,
    mapping: Mapping,
}

impl InFlight {
    pub(super) fn new(slot: usize, mapping: Mapping) -> Self {
        InFlight { slot, mapping }
    }

    /// Whether the slot's mapping has completed (successfully or not),
    /// without waiting.
    pub(super) fn arrived(&mut self) -> Result<bool> {
        self.mapping.arrived()
    }
}
/// A submit handed to the session's thread, whose token readback's
/// mapping comes back from there once it is submitted, and the slot it
/// copies into (a feed's last submit, forced tokens' feed).
pub(super) struct AwayReadback {
    slot: usize,
    done: mpsc::Receiver<Mapping>,
}

/// Where an [`AwayReadback`] stands.
pub(super) enum Away {
    /// Not submitted yet.
    Pending,
    /// Submitted: the slot's readback, to join the session's queue.
    Submitted(InFlight),
    /// The thread ended without submitting it: the slot is free again.
    Lost(usize),
}

impl AwayReadback {
    /// Runs `submit` (which submits and maps `slot`) on `recorder`.
    pub(super) fn start(
        recorder: &super::recorder::Recorder,
        slot: usize,
        submit: impl FnOnce() -> Mapping + Send + 'static,
    ) -> Self {
        let (tx, done) = mpsc::channel();
        recorder.run(move || {
            let _ = tx.send(submit());
        });
        AwayReadback { slot, done }
    }

    /// The slot its token is copied into.
    pub(super) fn slot(&self) -> usize {
        self.slot
    }

    /// Where it stands, waiting for the submit if `wait`.
    pub(super) fn settle(&self, wait: bool) -> Away {
        let got = if wait {
            self.done.recv().map_err(|_| mpsc::TryRecvError::Disconnected)
        } else {
            self.done.try_recv()
        };
        match got {
            Ok(mapping) => Away::Submitted(InFlight::new(self.slot, mapping)),
            Err(mpsc::TryRecvError::Empty) => Away::Pending,
            Err(mpsc::TryRecvError::Disconnected) => Away::Lost(self.slot),
        }
    }
}

impl Session {
    /// Records a copy of `tokens[at]` into a free readback slot; once the
    /// commands are submitted, [`Self::submit_with_readbacks`] maps it.
    pub(super) fn queue_readback(&mut self, enc: &mut wgpu::CommandEncoder, at: usize) -> Result<usize> {
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
    pub(super) fn submit_with_readback(&mut self, enc: wgpu::CommandEncoder, slot: usize) {
        self.submit_with_readbacks(enc, &[slot]);
    }

    /// [`Self::submit_with_readback`] for an encoder holding several steps,
    /// each copying its token into one of `slots`, in order.
    fn submit_with_readbacks(&mut self, enc: wgpu::CommandEncoder, slots: &[usize]) {
        self.submit_commands_with_readbacks([enc.finish()], slots);
    }

    /// [`Self::submit_with_readbacks`] for finished commands.
    pub(super) fn submit_commands_with_readbacks(
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
    /// makes the token the pending prediction; `polled` (a call that must
    /// not wait) hands the next constrained choice to the session's thread
    /// where it can.
    pub(super) fn take_queued(&mut self, polled: bool) -> Result<u32> {
        let q = self.queued.pop_front().ok_or_else(no_step_in_flight)?;
        // The choice after forced tokens, if they were fed: a step as any.
        self.forced_feed = false;
        let (token, logprobs) = self.read_slot(q)?;
        self.last_logprobs = logprobs;
        self.len += 1;
        if token as usize >= self.model.config.vocab_size {
            return Err(Error::GpuDeviceFailed {
                reason: format!("argmax returned {token} (non-finite logits?)"),
            });
        }
        self.pending = Some(token);
        if polled && self.kv_slot.is_some() {
            // A batch's member that served itself (the choice after its
            // forced tokens): its batch steps it next, so no forward pass
            // of its own, and its next mask goes to rayon's threads, as
            // the batch's rows' do (the batch's next step settles it). A
            // frame's call neither records a pass nor computes a mask.
            let mut tasks = Vec::new();
            let consumed = self.consume_constraint_on_worker(token, &mut tasks);
            super::choice_worker::spawn_mask_tasks(tasks);
            self.after_constraint_consumed(consumed)?;
        } else if !(polled && self.choose_on_worker(token)?) {
            self.advance_constraint(token)?;
        }
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
    pub(super) fn wait_slot(&mut self, q: InFlight) -> Result<u32> {
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
    pub(super) fn discard_queued(&mut self) -> Result<()> {
        self.settle_choice_quietly();
        self.drop_prerecorded();
        // Forced tokens not yet returned stay (the constraint is past
        // them); their prompt batch is fed again.
        let forced = self.settle_forced(true);
        self.forced_feed = false;
        while let Some(q) = self.queued.pop_front() {
            self.wait_slot(q)?;
        }
        if self.gpu_pos != self.len {
            self.reset_gpu_position();
        }
        forced.map(|_| ())
    }

    /// Writes the GPU's position back to `len` (and the first position the
    /// argmax may fill to `len + 1`), whatever steps ran since: the host's
    /// count is the truth after launches that advanced it an unknown
    /// number of times.
    pub(super) fn reset_gpu_position(&mut self) {
        self.write_step(self.len + 1);
        self.gpu_pos = self.len;
    }
}

/// A step was expected on the GPU and none is: a bookkeeping bug.
pub(super) fn no_step_in_flight() -> Error {
    Error::internal("no decode step in flight")
}
