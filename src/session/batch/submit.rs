//! Steps on the GPU: submitting a step's commands, waiting for and reading
//! back its tokens, and dropping the steps a call no longer wants.

use std::sync::mpsc;

use super::record::{chooses_alone, recording_key, row_key, PrerecordedStep, RowKey};
use super::Batch;
use crate::error::{Error, Result};
use crate::session::recorder::Recordable;
use crate::session::recorder::Recorder;
use crate::session::{Mapping, Session};

/// A batch step on the GPU, or on its way there from the batch's thread.
pub(super) struct InFlightStep {
    /// Per row, its session's [`RowKey`]. The pending token of a step
    /// queued ahead is known once the step before it is read back.
    pub(super) rows: Vec<RowKey>,
    pub(super) readback: usize,
    mapping: StepMapping,
}

/// A step's readback mapping: started here, or by the batch's thread once
/// it has submitted the step (sent back then).
enum StepMapping {
    Here(Mapping),
    Away(mpsc::Receiver<Mapping>),
}

impl InFlightStep {
    /// Whether the step's tokens are mapped (`Ok(true)`), not yet
    /// (`Ok(false)`), or never will be (a failed mapping), without waiting.
    pub(super) fn arrived(&mut self) -> Result<bool> {
        if let StepMapping::Away(away) = &self.mapping {
            match away.try_recv() {
                Ok(mapping) => self.mapping = StepMapping::Here(mapping),
                Err(mpsc::TryRecvError::Empty) => return Ok(false),
                Err(mpsc::TryRecvError::Disconnected) => return Err(submit_lost()),
            }
        }
        let StepMapping::Here(mapping) = &mut self.mapping else { return Ok(false) };
        if !mapping.arrived()? {
            return Ok(false);
        }
        mapping.check()?;
        Ok(true)
    }

    /// The mapping, once the batch's thread has submitted the step
    /// (waiting for that).
    fn mapping_here(&mut self) -> Result<&mut Mapping> {
        if let StepMapping::Away(away) = &self.mapping {
            self.mapping = StepMapping::Here(away.recv().map_err(|_| submit_lost())?);
        }
        match &mut self.mapping {
            StepMapping::Here(mapping) => Ok(mapping),
            StepMapping::Away(_) => Err(submit_lost()),
        }
    }
}

/// The batch's thread ended without submitting a step handed to it.
fn submit_lost() -> Error {
    Error::internal("the batch's thread ended without submitting a step")
}

impl Batch {
    /// Drops the steps in flight for an earlier call (what they wrote lies
    /// past each session's length), waiting for each: a readback buffer
    /// must not be reused while its mapping is pending.
    pub(super) fn drop_stale_steps(&mut self) -> Result<()> {
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
    pub(super) fn try_drop_stale_steps(&mut self) -> Result<bool> {
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
    pub(super) fn poll(&self) -> Result<()> {
        self.model.gpu.poll_once()
    }

    /// Submits one step of `sessions` at their lengths plus `offset`, each
    /// row's input token from `tokens` (or, without, the previous step's
    /// on the GPU), its token copied to its session's token sequence and to
    /// readback buffer `readback`. `wait`: the row pipelines of this
    /// session count are built now if not yet (a blocking step); otherwise
    /// they are built on another thread meanwhile (see
    /// [`BatchForward::record`](crate::qwen3::BatchForward::record)), the commands recorded ahead for this very
    /// step serve if there are any (taken on the batch's thread, which
    /// submits the step behind their recording), and the next step's are
    /// recorded ahead once this one is handed over.
    pub(super) fn submit(
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
                StepCommands::Recorded(p)
            }
            None => {
                self.recordings.0 += 1;
                StepCommands::Ready(self.step_job(sessions, offset, readback, wait).encode())
            }
        };
        let submit = self.step_submit(sessions, offset, tokens, readback, commands);
        let mapping = if wait { self.submit_here(submit) } else { self.submit_on_thread(submit) };
        let step = InFlightStep { rows: row_keys(sessions, offset), readback, mapping };
        if !wait {
            // The next submit for the same sessions: the step behind this
            // one (the other readback buffer), or, where none is queued
            // behind it, the first step of the next call (readback 0).
            let next = if steps_behind(sessions, offset) { 1 - readback } else { 0 };
            self.record_ahead(sessions, offset + 1, next);
        }
        step
    }

    /// Writes what the step of `sessions` at their lengths plus `offset`
    /// reads from the host (each row's position and KV offset, the input
    /// tokens when given, each sampling row's position), then submits its
    /// `commands` (recorded by [`Self::step_job`] for the same step) and
    /// starts mapping readback buffer `readback`, on the caller's thread.
    pub(super) fn submit_commands(
        &self,
        sessions: &[&mut Session],
        offset: usize,
        tokens: Option<&[u32]>,
        readback: usize,
        commands: wgpu::CommandBuffer,
    ) -> InFlightStep {
        let submit = self.step_submit(sessions, offset, tokens, readback, StepCommands::Ready(commands));
        InFlightStep { rows: row_keys(sessions, offset), readback, mapping: self.submit_here(submit) }
    }

    /// Runs `submit` on the caller's thread, after every step handed to
    /// the batch's thread (queue order).
    fn submit_here(&self, submit: StepSubmit) -> StepMapping {
        self.pool.settle_submits();
        StepMapping::Here(submit.run())
    }

    /// Hands `submit` to the batch's thread (runs it here should the
    /// thread be gone): a submit is a driver's round of work, ~0.1-0.3 ms
    /// of a frame. Its writes go with it, in the thread's order; until it
    /// is made, every call of a member session of its own waits for it
    /// ([`KvPool::settle_submits`](super::pool::KvPool::settle_submits)),
    /// so nothing a session queues later runs before it.
    fn submit_on_thread(&mut self, submit: StepSubmit) -> StepMapping {
        if self.recorder.is_none() {
            self.recorder = Recorder::start();
        }
        let Some(recorder) = &self.recorder else { return self.submit_here(submit) };
        let (tx, away) = mpsc::channel();
        let handed_off = self.pool.hand_off();
        let delay = self.debug_submit_delay;
        self.submits_on_thread += 1;
        recorder.run(move || {
            if let Some(delay) = delay {
                std::thread::sleep(delay);
            }
            let _ = tx.send(submit.run());
            drop(handed_off);
        });
        StepMapping::Away(away)
    }

    /// What submitting the step of `sessions` at their lengths plus
    /// `offset` takes (see [`Self::submit_commands`]), owned, so that it
    /// can run on another thread.
    fn step_submit(
        &self,
        sessions: &[&mut Session],
        offset: usize,
        tokens: Option<&[u32]>,
        readback: usize,
        commands: StepCommands,
    ) -> StepSubmit {
        let n = sessions.len();
        let mut rows = Vec::with_capacity(2 * n);
        for s in sessions {
            let slot = s.kv_slot.as_ref().map_or(0, |l| l.slot) as u64;
            rows.extend([(s.len + offset) as u32, (slot * self.pool.region_bytes / 16) as u32]);
        }
        let mut writes = vec![(self.rows.clone(), 0, rows), (self.bufs.step.clone(), 0, vec![0u32, 0])];
        if let Some(tokens) = tokens {
            writes.push((self.bufs.tokens.clone(), 4, tokens.to_vec()));
        }
        for s in sessions.iter().filter(|s| chooses_alone(s)) {
            // Its choice reads tokens[pos] back through the penalty window
            // and writes tokens[pos + 1].
            let pos = s.len + offset;
            writes.push(s.step_write_at(pos, pos + 1));
        }
        StepSubmit {
            queue: self.model.gpu.queue.clone(),
            writes,
            commands,
            readback: self.readbacks[readback].clone(),
            bytes: 4 * n as u64,
        }
    }

    /// Waits until `step`'s tokens are mapped (at once when they are).
    pub(super) fn wait(&mut self, step: &mut InFlightStep) -> Result<()> {
        let mapping = step.mapping_here()?;
        mapping.wait(&self.model.gpu, &mut self.blocking_waits)?;
        mapping.check()
    }

    /// The `n` tokens of mapped readback buffer `readback` (then unmapped),
    /// checked against the vocabulary.
    pub(super) fn read_tokens(&self, readback: usize, n: usize) -> Result<Vec<u32>> {
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

/// Per row, its session's [`RowKey`] for the step at their lengths plus
/// `offset`.
fn row_keys(sessions: &[&mut Session], offset: usize) -> Vec<RowKey> {
    sessions.iter().map(|s| row_key(s, offset)).collect()
}

/// Whether a step of `sessions` at their lengths plus `offset` gets the
/// next step queued behind it (room for it, and no constrained row: a
/// constrained row's mask waits for its token).
pub(super) fn steps_behind(sessions: &[&mut Session], offset: usize) -> bool {
    sessions.iter().all(|s| s.len + offset + 2 <= s.bufs.capacity && !s.has_constraint())
}

/// A step's submit, owned ([`Batch::step_submit`]): the writes it reads
/// from the host, then its commands, then its tokens' readback mapping.
struct StepSubmit {
    queue: wgpu::Queue,
    /// (buffer, byte offset, words), written in order before the submit.
    writes: Vec<(wgpu::Buffer, u64, Vec<u32>)>,
    commands: StepCommands,
    readback: wgpu::Buffer,
    bytes: u64,
}

impl StepSubmit {
    fn run(self) -> Mapping {
        // Written before the submit, after the submits before it (queue order).
        for (buffer, offset, words) in &self.writes {
            self.queue.write_buffer(buffer, *offset, bytemuck::cast_slice(words));
        }
        let commands = match self.commands {
            StepCommands::Ready(commands) => commands,
            // On the batch's thread, recorded by now (its recording was
            // queued there first).
            StepCommands::Recorded(p) => p.take(),
        };
        let submission = self.queue.submit([commands]);
        Mapping::start(self.readback.slice(..self.bytes), submission)
    }
}

/// A step's commands: recorded, or being recorded on the batch's thread
/// (taken where the step is submitted).
pub(super) enum StepCommands {
    Ready(wgpu::CommandBuffer),
    Recorded(PrerecordedStep),
}
