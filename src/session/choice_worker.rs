//! A constrained step's token choice handed to the session's thread: the
//! mask after a token inside a free JSON string takes llguidance up to
//! milliseconds, so a polled decode ([`Session::try_next_token`]) returns
//! the token at once and the recorder's thread computes the next mask,
//! writes it, submits the choice (whose forward pass is on the GPU
//! already) and the forward pass after it, and sends back the choice's
//! readback. The caller's next call collects it (or returns `None` while
//! it is on its way). Nothing else of the session's is queued on the GPU
//! meanwhile: every other call settles it first, waiting if need be.
//! A batch's member hands over its mask alone (rayon's threads compute
//! the members' in parallel); the batch's next step settles them.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use crate::constraint::{ConstraintState, Consumed};
use crate::error::{Error, Result};

use super::readback::{InFlight, Mapping};
use super::recorder::{Prerecorded, StepPart};
use super::Session;

/// A constraint's next mask on another thread: with the token choice of
/// the step at `pos` (a session's own), or alone (a batch member's).
pub(super) struct ChoiceOnWorker {
    done: mpsc::Receiver<ChoiceDone>,
    choice: Option<WorkerChoice>,
}

/// The step whose token choice the worker submits.
struct WorkerChoice {
    /// Its position (its forward pass was submitted ahead).
    pos: usize,
    /// The readback slot its token is copied into.
    slot: usize,
    /// Whether the worker submits the forward pass at `pos + 1` too.
    forward_next: bool,
}

/// What the worker sends back: the constraint, and the choice's readback
/// (`None`: not submitted, the reply being complete or the constraint
/// having forced tokens; an error: not submitted either).
struct ChoiceDone {
    constraint: ConstraintState,
    outcome: Result<Option<Mapping>>,
}

impl Session {
    /// Advances the constraint past `token`, just returned by a polled
    /// call, handing the next mask and the step's token choice to the
    /// session's thread where it can; true if it did (else the caller
    /// advances the constraint itself).
    pub(super) fn choose_on_worker(&mut self, token: u32) -> Result<bool> {
        let pos = self.len;
        // Its forward pass, unless submitted already: where the session's
        // thread is still recording it (behind a prompt batch's submits,
        // say), that thread submits it first, in order; the caller never
        // waits for it.
        let mut forward_first = None;
        if self.splits_steps() && self.queued.is_empty() && self.forward_ahead() != Some(pos) {
            let launches = self.step_launches();
            match self.prerecorded_forward.take() {
                Some(p) if p.positions.start == pos && Arc::ptr_eq(&p.launches, &launches) => {
                    match p.take(false) {
                        Some(commands) => {
                            self.model.gpu.queue.submit([commands]);
                            self.forward_ahead.store(pos + 1, Ordering::Relaxed);
                            self.forward_ahead_submits += 1;
                        }
                        None if self.recorder.is_some() => forward_first = Some(p),
                        None => {
                            self.prerecorded_forward = Some(p);
                            self.submit_forward_ahead(true);
                        }
                    }
                }
                other => {
                    self.prerecorded_forward = other;
                    self.submit_forward_ahead(true);
                }
            }
        }
        let forward_ready = self.forward_ahead() == Some(pos) || forward_first.is_some();
        let eligible = self.splits_steps()
            && self.kv_slot.is_none()
            && self.choice_on_worker.is_none()
            && self.queued.is_empty()
            && self.gpu_pos == pos
            && forward_ready
            && pos < self.bufs.capacity
            && self.started_recorder().is_some();
        if !eligible {
            self.submit_forward_first(forward_first);
            return Ok(false);
        }
        let Some(constraint) = self.constraint.as_mut() else { return Ok(false) };
        match constraint.consume_token(token)? {
            Consumed::MaskDue => {}
            // Nothing to compute: finish on the caller's thread.
            done => {
                self.submit_forward_first(forward_first);
                self.after_constraint_consumed(Ok(Some((false, done == Consumed::Woke))))?;
                return Ok(true);
            }
        }
        let launches = self.step_launches();
        // The choice at `pos`: recorded ahead, or recorded now on the
        // session's thread ahead of the task.
        let choice = match self.prerecorded.take() {
            Some(p)
                if p.positions == (pos..pos + 1)
                    && p.job.first == StepPart::Choice
                    && Arc::ptr_eq(&p.launches, &launches) =>
            {
                Some(p)
            }
            other => {
                self.prerecorded = other;
                self.drop_prerecorded_steps();
                let slot = self.free_slots.pop();
                slot.map(|slot| self.record_on_thread(pos..pos + 1, vec![slot], StepPart::Choice))
            }
        };
        let (Some(choice), true) = (choice, self.constraint.is_some()) else {
            // No readback slot free (unreachable by their count): the
            // mask on the caller's thread, the step queued as usual.
            self.submit_forward_first(forward_first);
            let consumed = self.constraint.as_mut().map(|c| c.compute_mask().map(|()| (false, false)));
            self.after_constraint_consumed(consumed.transpose())?;
            return Ok(true);
        };
        let Some(constraint) = self.constraint.take() else { return Err(Error::internal("no constraint")) };
        let forward_next = pos + 1 < self.bufs.capacity;
        let forward = forward_next.then(|| match self.prerecorded_forward.take() {
            Some(p) if p.positions.start == pos + 1 && Arc::ptr_eq(&p.launches, &launches) => p,
            _ => self.record_on_thread(pos + 1..pos + 2, Vec::new(), StepPart::Forward),
        });
        let slot = choice.slots[0];
        let forward_first_too = forward_first.is_some();
        let (tx, done) = mpsc::channel();
        let task = ChoiceTask {
            constraint,
            queue: self.model.gpu.queue.clone(),
            token_mask: self.bufs.token_mask.clone(),
            vocab_size: self.model.config.vocab_size,
            slot_buffer: self.slots[slot].clone(),
            forward_first,
            choice,
            forward,
        };
        let Some(rec) = &self.recorder else { return Err(Error::internal("the session's thread is gone")) };
        rec.run(move || {
            let _ = tx.send(task.run());
        });
        self.choice_on_worker =
            Some(ChoiceOnWorker { done, choice: Some(WorkerChoice { pos, slot, forward_next }) });
        self.gpu_pos = pos + 1;
        let ahead = if forward_next { pos + 2 } else { 0 };
        self.forward_ahead.store(ahead, Ordering::Relaxed);
        self.decode_submits += 1;
        self.forward_ahead_submits += u64::from(forward_next) + u64::from(forward_first_too);
        self.choices_on_worker += 1;
        Ok(true)
    }

    /// Submits a forward pass taken for the session's thread that stays
    /// with the caller after all (waiting for its recording).
    fn submit_forward_first(&mut self, forward_first: Option<Prerecorded>) {
        if let Some(p) = forward_first {
            self.prerecorded_forward = Some(p);
            self.submit_forward_ahead(true);
        }
    }

    /// Takes back the choice handed to the session's thread, if any:
    /// `None` while it is still on its way and `wait` is false. The
    /// choice's readback joins the queued steps; where the worker
    /// submitted nothing (the reply complete, or the mask failed), the
    /// step is as before the hand-over (its forward pass queued, its
    /// choice not) and the error is returned.
    pub(super) fn settle_choice(&mut self, wait: bool) -> Option<Result<()>> {
        let worker = self.choice_on_worker.as_ref()?;
        let done = if wait {
            worker.done.recv().ok()
        } else {
            match worker.done.try_recv() {
                Ok(done) => Some(done),
                Err(mpsc::TryRecvError::Empty) => return None,
                Err(mpsc::TryRecvError::Disconnected) => None,
            }
        };
        let worker = self.choice_on_worker.take()?;
        let Some(done) = done else {
            return Some(Err(Error::internal("the session's thread ended without the constraint's mask")));
        };
        self.constraint = Some(done.constraint);
        self.take_forced_from_constraint();
        let Some(choice) = worker.choice else {
            // A mask alone, written by the worker.
            return Some(done.outcome.map(|_| ()));
        };
        match done.outcome {
            Ok(Some(mapping)) => {
                self.queued.push_back(InFlight::new(choice.slot, mapping));
                Some(Ok(()))
            }
            outcome => {
                self.free_slots.push(choice.slot);
                // Recorded for positions after the step.
                self.drop_prerecorded();
                self.gpu_pos = choice.pos;
                self.forward_ahead.store(choice.pos + 1, Ordering::Relaxed);
                self.decode_submits -= 1;
                self.forward_ahead_submits -= u64::from(choice.forward_next);
                Some(outcome.map(|_| ()))
            }
        }
    }

    /// Advances a batch member's constraint past `token`, leaving the next
    /// mask (when it is a parser's computation) to rayon's threads: its
    /// task is added to `tasks`, which the caller hands to rayon at once
    /// ([`spawn_mask_tasks`]: one wake-up for a batch's members, not one
    /// each); the batch's next step settles it. Returns the constraint's
    /// consumption when nothing was left to compute (`None` without a
    /// constraint).
    pub(super) fn consume_constraint_on_worker(
        &mut self,
        token: u32,
        tasks: &mut Vec<MaskTask>,
    ) -> Result<Option<(bool, bool)>> {
        let Some(c) = &mut self.constraint else { return Ok(None) };
        let was_dormant = c.is_dormant();
        let consumed = c.consume_token(token)?;
        if consumed != Consumed::MaskDue {
            return Ok(Some((was_dormant, consumed == Consumed::Woke)));
        }
        let Some(mut constraint) = self.constraint.take() else { return Ok(None) };
        let (tx, done) = mpsc::channel();
        let queue = self.model.gpu.queue.clone();
        let token_mask = self.bufs.token_mask.clone();
        let vocab_size = self.model.config.vocab_size;
        tasks.push(Box::new(move || {
            // The mask's upload too (~20 KB a member): queued before the
            // batch's next step, which waits for this task.
            let outcome = upload_next_mask(&mut constraint, &queue, &token_mask, vocab_size).map(|_| None);
            let _ = tx.send(ChoiceDone { constraint, outcome });
        }));
        self.choice_on_worker = Some(ChoiceOnWorker { done, choice: None });
        self.choices_on_worker += 1;
        Ok(None)
    }

    /// True while a mask or a choice is on another thread.
    pub(super) fn has_work_on_worker(&self) -> bool {
        self.choice_on_worker.is_some()
    }

    /// Settles a choice on the session's thread, waiting for it, before
    /// anything else is queued; its failure is left to the next step to
    /// report (the session is as before the hand-over).
    pub(super) fn settle_choice_quietly(&mut self) {
        let _ = self.settle_choice(true);
    }

    /// Token choices handed to the session's thread so far (polled
    /// constrained steps whose mask was computed there).
    #[doc(hidden)]
    pub fn debug_choices_on_worker(&self) -> u64 {
        self.choices_on_worker
    }
}

/// The work of a choice on the session's thread.
struct ChoiceTask {
    constraint: ConstraintState,
    queue: wgpu::Queue,
    token_mask: wgpu::Buffer,
    vocab_size: usize,
    slot_buffer: wgpu::Buffer,
    /// The forward pass at the choice's position, if the caller left it
    /// (still being recorded on this thread, recorded by now).
    forward_first: Option<Prerecorded>,
    choice: Prerecorded,
    forward: Option<Prerecorded>,
}

impl ChoiceTask {
    fn run(self) -> ChoiceDone {
        let ChoiceTask {
            mut constraint,
            queue,
            token_mask,
            vocab_size,
            slot_buffer,
            forward_first,
            choice,
            forward,
        } = self;
        if let Some(first) = forward_first {
            queue.submit([first.take_waiting()]);
        }
        let outcome =
            upload_next_mask(&mut constraint, &queue, &token_mask, vocab_size).and_then(|complete| {
                // Complete, or tokens forced: their prompt batch, fed by
                // the session, carries the next choice.
                if complete || constraint.has_forced() {
                    return Ok(None);
                }
                let commands = choice.take(true).ok_or_else(|| Error::internal("choice not recorded"))?;
                let submission = queue.submit([commands]);
                let mapping = Mapping::start(slot_buffer.slice(..), submission);
                if let Some(forward) = forward {
                    let commands =
                        forward.take(true).ok_or_else(|| Error::internal("forward pass not recorded"))?;
                    queue.submit([commands]);
                }
                Ok(Some(mapping))
            });
        ChoiceDone { constraint, outcome }
    }
}

/// Computes `constraint`'s next mask and uploads it; true when the reply
/// is complete (no choice to make), an error when the mask allows no
/// token among the model's logits. A panic inside the parser fails this
/// step, not the thread.
fn upload_next_mask(
    constraint: &mut ConstraintState,
    queue: &wgpu::Queue,
    token_mask: &wgpu::Buffer,
    vocab_size: usize,
) -> Result<bool> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        constraint.compute_mask()?;
        let words = constraint.mask_words(vocab_size);
        queue.write_buffer(token_mask, 0, bytemuck::cast_slice(&words));
        // (After forced tokens, the check is the step's that asks for the
        // token after them.)
        if !constraint.has_forced() && !constraint.allows_any_below(vocab_size) {
            return Err(super::submit::no_token_below(constraint.kind(), vocab_size));
        }
        Ok(constraint.is_complete())
    }))
    .unwrap_or_else(|_| Err(Error::internal("the constraint's parser panicked computing a mask")))
}

/// A batch member's next mask, computed and uploaded on rayon's threads
/// ([`Session::consume_constraint_on_worker`]).
pub(super) type MaskTask = Box<dyn FnOnce() + Send>;

/// Hands `tasks` to rayon in one job (each waking a thread would cost
/// the caller a system call a member), which runs them in parallel.
pub(super) fn spawn_mask_tasks(tasks: Vec<MaskTask>) {
    match tasks.len() {
        0 => {}
        1 => rayon::spawn(move || tasks.into_iter().for_each(|task| task())),
        _ => rayon::spawn(move || {
            use rayon::prelude::*;
            tasks.into_par_iter().for_each(|task| task());
        }),
    }
}
