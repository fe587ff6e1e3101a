//! The public step calls (blocking, non-blocking, profiled), the checks
//! they make first and how a step advances its sessions, and the
//! per-session fallback on kernels without batched variants.

use std::sync::Arc;

use rayon::prelude::*;

use super::record::{row_key, RowKey};
use super::submit::{steps_behind, InFlightStep};
use super::Batch;

use crate::error::{Error, Result};
use crate::gpu::Timestamps;
use crate::kernels::{LaunchKind, ATTENTION_CHUNK};
use crate::session::Session;

impl Batch {
    /// Advances each of `sessions` by one token, in one GPU step, and
    /// returns their new tokens in order: for each session, exactly what
    /// [`Session::next_token`] would return, and the session is left as
    /// that call would leave it (the token pending, the previous one in its
    /// KV cache). Steps the sessions had queued ahead alone are discarded
    /// first. Each call passes any sessions of this batch, so sessions join
    /// and leave between calls.
    ///
    /// Before waiting for its tokens, a call queues the next step for the
    /// same sessions, so the GPU runs it while the caller handles these
    /// tokens: the next call with the same sessions, in the same order and
    /// untouched in between, gets its tokens without a step's wait. Any
    /// other call drops it (waiting for it first); what it wrote lies past
    /// each session's length, as for a session's own steps queued ahead.
    /// A call after a [`Batch::try_step`] that returned `None` for the same
    /// sessions waits for that step and returns its tokens.
    ///
    /// A member whose constraint forced tokens after its last one returns
    /// them (and then the choice after them) as it does alone: they run
    /// through the model as one prompt batch of its own, and the step's
    /// rows are the other members.
    ///
    /// Errors, before anything runs (no session changes):
    /// [`Error::InvalidArgument`] naming `sessions` for an empty list or a
    /// session that holds no slot of this batch (made by another batch, or
    /// by [`Model::session`](crate::Model::session)), naming `logprobs` for one
    /// reporting log-probabilities, naming `session` for one
    /// with a [`Session::begin_feed`] in progress; `no_pending_token` for a
    /// session never fed; `context_overflow` for a full one. Then a GPU
    /// failure.
    pub fn step(&mut self, sessions: &mut [&mut Session]) -> Result<Vec<u32>> {
        settle_masks(sessions, true)?;
        self.check_step(sessions)?;
        if self.forward.is_none() {
            // The MSL twins have no batched variants: each session's own
            // step (its arithmetic is that of the pipelines it runs alone).
            return sessions.iter_mut().map(|s| s.next_token()).collect();
        }
        if !sessions.iter().any(|s| serves_itself(s)) {
            return self.step_rows(sessions);
        }
        // Members returning forced tokens (or the choice after them) take
        // them as alone; the others step as the batch's rows.
        let mut out = vec![0; sessions.len()];
        let (mut own, mut rows) = split_members(sessions);
        if !rows.is_empty() {
            let mut refs: Vec<&mut Session> = rows.iter_mut().map(|(_, s)| &mut **s).collect();
            for (token, (i, _)) in self.step_rows(&mut refs)?.into_iter().zip(&rows) {
                out[*i] = token;
            }
        }
        for (i, s) in own.iter_mut() {
            out[*i] =
                s.serve_forced(false)?.ok_or_else(|| Error::internal("a member's token did not come"))?;
        }
        Ok(out)
    }

    /// [`Batch::step`] of members that all step as rows.
    fn step_rows(&mut self, sessions: &mut [&mut Session]) -> Result<Vec<u32>> {
        let rows: Vec<RowKey> = sessions.iter().map(|s| row_key(s, 0)).collect();
        // The step queued ahead by the last call serves when the sessions
        // are those it ran for, in the same order and state; otherwise it
        // is dropped (what it wrote lies past each session's length).
        let mut current = match self.ahead.take() {
            Some(ahead) if ahead.rows == rows => ahead,
            other => {
                self.ahead = other;
                self.drop_stale_steps()?;
                for s in sessions.iter_mut() {
                    s.discard_queued()?;
                }
                let pending: Vec<u32> = rows.iter().map(|r| r.3.unwrap_or(0)).collect();
                self.submit(sessions, 0, Some(&pending), 0, true)
            }
        };
        // Steps a session queued alone since are discarded (they ran after
        // the batch's and wrote the same values).
        for s in sessions.iter_mut() {
            if let Err(e) = s.discard_queued() {
                self.ahead = Some(current); // in flight: the next call drops it
                return Err(e);
            }
        }
        // The next step for the same sessions, queued before waiting (a
        // try_step may have queued it already): the GPU runs it while the
        // host handles this one's tokens. Its inputs are this step's
        // tokens, already on the GPU.
        // No step ahead for a constrained row: its mask waits for its token.
        let room = steps_behind(sessions, 0);
        let next = match self.behind.take() {
            Some(next) => Some(next),
            None => room.then(|| self.submit(sessions, 1, None, 1 - current.readback, true)),
        };
        let out = self.wait(&mut current).and_then(|()| self.read_tokens(current.readback, sessions.len()));
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                // Leave no readback buffer with a mapping pending.
                if let Some(mut next) = next {
                    if self.wait(&mut next).is_ok() {
                        self.readbacks[next.readback].unmap();
                    }
                }
                return Err(e);
            }
        };
        self.advance(sessions, &out, next, false)?;
        Ok(out)
    }

    /// [`Batch::step`] that never waits for the GPU (a host that renders
    /// calls it once a frame and keeps its frame rate): `Ok(None)` while
    /// the step's tokens are on their way, leaving every session as it was
    /// (its length, pending token and context); then `Ok(Some(tokens))`,
    /// the tokens [`Batch::step`] returns, each session advanced as `step`
    /// advances it.
    ///
    /// ```no_run
    /// # fn frame(batch: &mut qwen3_wgpu::Batch, a: &mut qwen3_wgpu::Session, b: &mut qwen3_wgpu::Session) -> qwen3_wgpu::Result<()> {
    /// if let Some(tokens) = batch.try_step(&mut [a, b])? {
    ///     println!("{tokens:?}"); // one token each, in order
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// A call submits at most one step. The first call for some sessions
    /// starts recording their step on a thread of the batch's own and
    /// returns `None`; the first call that finds it recorded submits it
    /// (and returns `None`); calls with the same
    /// sessions, in the same order and untouched in between, submit the
    /// next step behind it (as `step` does) and poll the device until the
    /// step's tokens are back (the call that returns them leaves the next
    /// step in flight, so the following call may find its tokens at once).
    /// A call with other sessions, another order, or a session changed in
    /// between (fed, truncated, stepped alone,
    /// dropped) drops the steps in flight once they have finished (they
    /// advanced no session, so no token is lost; what they wrote lies past
    /// each session's length) and returns `None` until then; then it
    /// records and submits the step of its own sessions as a first call
    /// does. Steps a session queued alone
    /// are discarded once they have finished, in the same way.
    /// [`Batch::step`] and `try_step` mix freely: either one takes over
    /// the step the other left in flight for the same sessions (`step`
    /// waits for it). Each session count has its own pipelines, built
    /// ahead by the batch ([`Batch::pipelines_ready`]); `try_step` never
    /// builds one on the caller's thread: a count's build not done yet (or
    /// past the warm-up's counts) goes on on a thread of its own, and until
    /// it is done that count's steps run their rows in a built pipeline of
    /// up to four times as many rows, or else each row through the
    /// one-token pipelines (the same tokens either way).
    ///
    /// Nor does it record or submit steps on the caller's thread: right
    /// after a step is submitted, the commands of the next one for the
    /// same sessions are recorded on the batch's thread, and the call that
    /// submits that one hands its rows' positions and its submit to the
    /// same thread, behind the recording. Until the thread has made that
    /// submit, a member's own calls ([`Session::feed`],
    /// [`Session::truncate`], ...) wait for it (at most a recording and a
    /// submit), so what they queue follows it. Commands recorded for sessions that changed since
    /// (another list or order, a session fed, truncated, given other
    /// sampling parameters or dropped) are dropped unsubmitted, and the
    /// step is recorded anew there as a first call's. Only where no thread
    /// can be started is a step recorded and submitted on the caller's thread.
    ///
    /// The call that returns tokens leaves the constrained members' next
    /// masks ([`Session::set_constraint`]) to rayon's threads; the next
    /// call returns `None` until every one is on the GPU (any call of a
    /// member's own waits for its mask first).
    ///
    /// Errors: those of [`Batch::step`], before anything is submitted
    /// (and a member's failed mask: its constraint allowing no token);
    /// then a GPU failure.
    pub fn try_step(&mut self, sessions: &mut [&mut Session]) -> Result<Option<Vec<u32>>> {
        // The masks after the tokens the last call returned, computed on
        // rayon's threads: until every one is on the GPU, nothing to do.
        if !settle_masks(sessions, false)? {
            return Ok(None);
        }
        self.check_step(sessions)?;
        if self.forward.is_none() {
            return try_step_each(sessions);
        }
        if !sessions.iter().any(|s| serves_itself(s)) {
            return self.try_step_rows(sessions);
        }
        // All or none: the members returning forced tokens (or the choice
        // after them) are checked ready first, then the rows step, then
        // the members take theirs (as alone, without waiting).
        let mut out = vec![0; sessions.len()];
        let (mut own, mut rows) = split_members(sessions);
        for (_, s) in own.iter_mut() {
            if !ready_by_itself(s)? {
                return Ok(None);
            }
        }
        if !rows.is_empty() {
            let mut refs: Vec<&mut Session> = rows.iter_mut().map(|(_, s)| &mut **s).collect();
            let Some(tokens) = self.try_step_rows(&mut refs)? else { return Ok(None) };
            for (token, (i, _)) in tokens.into_iter().zip(&rows) {
                out[*i] = token;
            }
        }
        for (i, s) in own.iter_mut() {
            out[*i] = s
                .serve_forced(true)?
                .ok_or_else(|| Error::internal("a member's ready token did not come"))?;
        }
        Ok(Some(out))
    }

    /// [`Batch::try_step`] of members that all step as rows.
    fn try_step_rows(&mut self, sessions: &mut [&mut Session]) -> Result<Option<Vec<u32>>> {
        self.poll()?;
        let rows: Vec<RowKey> = sessions.iter().map(|s| row_key(s, 0)).collect();
        let mut current = match self.ahead.take() {
            Some(ahead) if ahead.rows == rows => ahead,
            other => {
                self.ahead = other;
                if !self.try_drop_stale_steps()? || !own_steps_arrived(sessions)? {
                    return Ok(None);
                }
                // Nothing of theirs is in flight: discarding waits for nothing.
                for s in sessions.iter_mut() {
                    s.discard_queued()?;
                }
                // Nor is a step of this list recorded yet: its recording
                // starts on the batch's recorder and a later call submits
                // it (a frame's call never records a step itself).
                if !self.first_step_ready(sessions) {
                    return Ok(None);
                }
                // This call submits the step; later calls submit the next
                // one behind it and poll for its tokens (one submit a
                // call: a frame pays for one step's recording).
                let pending: Vec<u32> = rows.iter().map(|r| r.3.unwrap_or(0)).collect();
                self.ahead = Some(self.submit(sessions, 0, Some(&pending), 0, false));
                return Ok(None);
            }
        };
        // The next step behind this one, as `step` queues it (unless a
        // call queued it already).
        if self.behind.is_none() && steps_behind(sessions, 0) {
            self.behind = Some(self.submit(sessions, 1, None, 1 - current.readback, false));
        }
        // A failed mapping drops the step (its buffer is not mapped); the
        // one behind it is dropped as stale by the next call.
        if !current.arrived()? || !own_steps_arrived(sessions)? {
            self.ahead = Some(current);
            return Ok(None);
        }
        for s in sessions.iter_mut() {
            if let Err(e) = s.discard_queued() {
                self.ahead = Some(current); // mapped: the next call unmaps it
                return Err(e);
            }
        }
        let out = self.read_tokens(current.readback, sessions.len())?;
        let next = self.behind.take();
        self.advance(sessions, &out, next, true)?;
        if self.ahead.is_none() {
            // No step behind this one (a constrained row's mask waits for
            // its token): the next for the same sessions is recorded (its
            // recording started at this one's submit, unless a row changed
            // since), so the call that finds the masks on the GPU submits it.
            self.record_ahead(sessions, 0, 0);
        }
        Ok(Some(out))
    }

    /// Runs one step of `sessions` (as [`Batch::step`], nothing queued
    /// ahead) with a GPU timestamp after each launch of the batch's pass,
    /// and returns each launch's kind and GPU time in microseconds; `None`
    /// where the device cannot time inside a pass or the kernels have no
    /// batched variants. A diagnostic for the `profile` tool.
    #[doc(hidden)]
    pub fn profile_step(&mut self, sessions: &mut [&mut Session]) -> Result<Option<Vec<(LaunchKind, f64)>>> {
        settle_masks(sessions, true)?;
        self.check_step(sessions)?;
        let gpu = self.model.gpu.clone();
        let Some(forward) = &self.forward else { return Ok(None) };
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        let short = sessions.iter().any(|s| s.len < ATTENTION_CHUNK as usize);
        let long = sessions.iter().any(|s| s.len >= ATTENTION_CHUNK as usize);
        let count = forward.launch_count(short, long) as u32 + 1;
        self.drop_stale_steps()?;
        for s in sessions.iter_mut() {
            s.discard_queued()?;
        }
        let ts = Timestamps::new(&gpu, "batch launch timestamps", count);
        let mut kinds = Vec::new();
        let pending: Vec<u32> = sessions.iter().map(|s| s.pending.unwrap_or(0)).collect();
        self.prerecorded = None;
        self.recordings.0 += 1;
        let commands = self.step_job(sessions, 0, 0, true).encode_timed(Some((&ts, &mut kinds)));
        let mut step = self.submit_commands(sessions, 0, Some(&pending), 0, commands);
        self.wait(&mut step)?;
        let out = self.read_tokens(step.readback, sessions.len())?;
        self.advance(sessions, &out, None, false)?;
        let us = ts.intervals_us(&gpu)?;
        Ok(Some(kinds.into_iter().zip(us).collect()))
    }

    /// Checks the sessions of a step ([`Batch::step`]'s errors), changing
    /// nothing.
    fn check_step(&self, sessions: &[&mut Session]) -> Result<()> {
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
            if s.logprobs > 0 {
                return Err(Error::invalid_argument(
                    "logprobs",
                    format!("session {i} reports log-probabilities; batched steps do not compute them"),
                ));
            }
            s.check_can_step(1)?;
        }
        Ok(())
    }

    /// Gives each session its token (the pending one before it is now in
    /// its KV cache) and makes `next`, if any, the step ahead, its rows'
    /// pending tokens now known. `polled` (a call that must not wait)
    /// leaves the constrained rows' next masks to rayon's threads.
    fn advance(
        &mut self,
        sessions: &mut [&mut Session],
        tokens: &[u32],
        next: Option<InFlightStep>,
        polled: bool,
    ) -> Result<()> {
        for (s, &token) in sessions.iter_mut().zip(tokens) {
            s.len += 1;
            s.pending = Some(token);
            s.reset_gpu_position();
        }
        self.ahead = next.map(|mut next| {
            for (row, s) in next.rows.iter_mut().zip(sessions.iter()) {
                row.3 = s.pending;
            }
            next
        });
        // The constrained rows' next masks (no step is queued ahead of
        // one), computed in parallel: one inside a free string can take
        // milliseconds.
        let consumed: Vec<_> = if polled {
            let mut tasks = Vec::new();
            let consumed = sessions
                .iter_mut()
                .zip(tokens)
                .map(|(s, &token)| s.consume_constraint_on_worker(token, &mut tasks))
                .collect();
            crate::session::spawn_mask_tasks(tasks);
            consumed
        } else if sessions.iter().filter(|s| s.has_constraint()).count() > 1 {
            sessions
                .par_iter_mut()
                .zip(tokens.par_iter())
                .map(|(s, &token)| s.consume_constraint(token))
                .collect()
        } else {
            sessions.iter_mut().zip(tokens).map(|(s, &token)| s.consume_constraint(token)).collect()
        };
        for (s, consumed) in sessions.iter_mut().zip(consumed) {
            s.after_constraint_consumed(consumed)?;
        }
        Ok(())
    }
}

/// Takes back the masks the sessions' constraints computed on other
/// threads (waiting for them if `wait`): false while one is on its way.
/// A failed mask is the step's error.
fn settle_masks(sessions: &mut [&mut Session], wait: bool) -> Result<bool> {
    let mut settled = true;
    for s in sessions.iter_mut() {
        match s.settle_choice(wait) {
            Some(outcome) => outcome?,
            None => settled &= !s.has_work_on_worker(),
        }
    }
    Ok(settled)
}

/// Whether `s` takes its next token by itself, not as a row of the batch's
/// step: tokens its constraint forced (fed as one prompt batch, returned
/// without a step each), or the choice after them, which that batch
/// computed (as alone: the same tokens).
fn serves_itself(s: &Session) -> bool {
    !s.forced.is_empty() || s.forced_feed
}

/// The members that serve themselves ([`serves_itself`]) and those that
/// step as rows, each with its index in `sessions`.
type Members<'s> = Vec<(usize, &'s mut Session)>;

fn split_members<'s>(sessions: &'s mut [&mut Session]) -> (Members<'s>, Members<'s>) {
    sessions.iter_mut().map(|s| &mut **s).enumerate().partition(|(_, s)| serves_itself(s))
}

/// Whether a member that serves itself has its next token without waiting
/// (a forced one always; the choice after them once its readback is back).
fn ready_by_itself(s: &mut Session) -> Result<bool> {
    if !s.forced.is_empty() {
        return Ok(true);
    }
    if !s.settle_forced(false)? {
        return Ok(false);
    }
    // (Nothing queued is not a state of a member serving itself: its
    // choice is queued once settled.)
    Ok(s.queued_front_arrived()?.unwrap_or(true))
}

/// Whether every step the sessions queued alone has its token back (so
/// discarding them waits for nothing).
fn own_steps_arrived(sessions: &mut [&mut Session]) -> Result<bool> {
    for s in sessions.iter_mut() {
        for q in s.queued.iter_mut() {
            if !q.arrived()? {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// [`Batch::try_step`] on kernels without batched variants: each session's
/// own steps are queued, and the tokens taken once every session's has
/// arrived (all or none: a `None` leaves every session as it was).
fn try_step_each(sessions: &mut [&mut Session]) -> Result<Option<Vec<u32>>> {
    for s in sessions.iter_mut() {
        s.queue_ahead(1)?;
    }
    if let Some(s) = sessions.first() {
        s.model.gpu.poll_once()?;
    }
    for s in sessions.iter_mut() {
        let front = s.queued.front_mut().ok_or_else(crate::session::no_step_in_flight)?;
        if !front.arrived()? {
            return Ok(None);
        }
    }
    sessions.iter_mut().map(|s| s.take_queued(false)).collect::<Result<Vec<u32>>>().map(Some)
}
