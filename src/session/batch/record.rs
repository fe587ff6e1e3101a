//! A step's commands and what they depend on: the keys that tell a step's
//! rows apart, the job that records them (on the caller's thread or ahead,
//! on the batch's recorder), and the step recorded ahead.

use std::sync::{mpsc, Arc};

use super::Batch;
use crate::gpu::Timestamps;
use crate::gpu_weights::ModelGpu;
use crate::kernels::{Launch, LaunchKind, ATTENTION_CHUNK};
use crate::qwen3::BatchForward;
use crate::session::recorder::{take_recorded, ReadbackCopy, Recordable, Recorder};
use crate::session::Session;

/// What a session must hold for a step to be its next one: (its lease's
/// number, feeds and truncations, length, pending token). The lease, not
/// the slot: a slot freed and taken again holds another session.
pub(super) type RowKey = (u64, u64, usize, Option<u32>);

/// What a batch step's commands depend on per row besides the row count
/// and order: (its session's lease number, feeds, truncations and changes
/// of how it chooses its token, position). Not the pending token: a step's
/// input tokens are written at its submit.
type RecordingKey = (u64, u64, usize);

/// Everything the commands of one batch step depend on (shared handles),
/// so that they can be recorded on another thread: see [`Batch::step_job`].
#[derive(Clone)]
pub(super) struct StepJob {
    model: Arc<ModelGpu>,
    forward: Option<Arc<BatchForward>>,
    rows: u32,
    /// Whether any row's context fits one chunk of positions / needs more.
    short: bool,
    long: bool,
    /// Build row pipelines missing now (see [`BatchForward::record`]).
    wait: bool,
    /// The batch's logits (rows `vocab_size` apart).
    logits: wgpu::Buffer,
    /// The rows that choose their token with their session's launches.
    choices: Vec<RowChoice>,
    /// Each row's token to where it goes next, then the tokens to the
    /// readback buffer.
    copies: Vec<ReadbackCopy>,
}

/// A row choosing its token with its session's own launches.
#[derive(Clone)]
struct RowChoice {
    row: usize,
    /// Its session's logits, where its launches read them.
    logits: wgpu::Buffer,
    launches: Vec<Launch>,
}

impl StepJob {
    /// Records the step, with a GPU timestamp after each launch of the
    /// batch's pass into `timestamps` (query 0 before the first; each
    /// launch's kind pushed to its list) when given.
    pub(super) fn encode_timed(
        &self,
        mut timestamps: Option<(&Timestamps, &mut Vec<LaunchKind>)>,
    ) -> wgpu::CommandBuffer {
        let gpu = &self.model.gpu;
        let kernels = &self.model.kernels;
        let (rows, short, long, wait) = (self.rows, self.short, self.long, self.wait);
        let mut enc =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("batch step"),
                timestamp_writes: None,
            });
            if let Some(forward) = &self.forward {
                match timestamps.as_mut() {
                    Some((ts, kinds)) => {
                        pass.write_timestamp(&ts.set, 0);
                        let mut q = 1;
                        let mut after = |pass: &mut wgpu::ComputePass<'_>, kind| {
                            pass.write_timestamp(&ts.set, q);
                            kinds.push(kind);
                            q += 1;
                        };
                        forward.record_each(&mut pass, gpu, kernels, rows, short, long, wait, &mut after);
                    }
                    None => forward.record(&mut pass, gpu, kernels, rows, short, long, wait),
                }
            }
        }
        // A row that samples (or applies penalties) chooses its token with
        // its session's own launches over its session's buffers: its logits
        // row copied there, at its own position (the draw is keyed by it),
        // so it draws the very token it would draw alone.
        let row_bytes = 4 * self.model.config.vocab_size as u64;
        for choice in &self.choices {
            enc.copy_buffer_to_buffer(
                &self.logits,
                choice.row as u64 * row_bytes,
                &choice.logits,
                0,
                row_bytes,
            );
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("batch row's token choice"),
                timestamp_writes: None,
            });
            for l in &choice.launches {
                l.record(&mut pass, kernels);
            }
        }
        for c in &self.copies {
            enc.copy_buffer_to_buffer(&c.src, c.src_offset, &c.dst, c.dst_offset, c.size);
        }
        if let Some((ts, _)) = &timestamps {
            ts.resolve(&mut enc);
        }
        enc.finish()
    }
}

impl Recordable for StepJob {
    fn encode(&self) -> wgpu::CommandBuffer {
        self.encode_timed(None)
    }
}

/// A batch step whose commands are recorded (or being recorded) ahead.
pub(super) struct PrerecordedStep {
    /// Per row, what the commands were recorded for.
    pub(super) rows: Vec<RecordingKey>,
    /// The readback buffer its tokens are copied to.
    pub(super) readback: usize,
    /// The job, kept to record it on the caller's thread should the
    /// recorder be gone.
    job: StepJob,
    commands: mpsc::Receiver<wgpu::CommandBuffer>,
    /// The commands, once [`Self::is_ready`] has seen them arrive.
    arrived: Option<wgpu::CommandBuffer>,
}

impl PrerecordedStep {
    /// Whether the commands can be submitted without waiting for the
    /// recorder: recorded, or the recorder gone (they are then recorded
    /// on the caller's thread).
    fn is_ready(&mut self) -> bool {
        if self.arrived.is_none() {
            match self.commands.try_recv() {
                Ok(commands) => self.arrived = Some(commands),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => {}
            }
        }
        true
    }

    /// The commands, waiting for the recorder if need be.
    pub(super) fn take(self) -> wgpu::CommandBuffer {
        match self.arrived {
            Some(commands) => commands,
            None => {
                take_recorded(&self.commands, true, || self.job.encode()).unwrap_or_else(|| self.job.encode())
            }
        }
    }
}

impl Batch {
    /// Whether the first step of `sessions` (a list with no step in
    /// flight) is recorded and can be submitted without waiting: if no
    /// recording of it is under way, one starts on the batch's recorder.
    /// True where no recorder thread can run (the step is then recorded on
    /// the caller's thread).
    pub(super) fn first_step_ready(&mut self, sessions: &[&mut Session]) -> bool {
        let key = recording_key(sessions, 0);
        match &mut self.prerecorded {
            Some(p) if p.rows == key && p.readback == 0 => p.is_ready(),
            _ => {
                self.record_ahead(sessions, 0, 0);
                self.prerecorded.is_none()
            }
        }
    }

    /// Starts recording the step of `sessions` at their lengths plus
    /// `offset` (the one after the step just submitted: the next submit
    /// for the same sessions), its tokens to readback buffer `readback`,
    /// on the batch's recorder, unless it would not fit or its recording
    /// is already under way (or done).
    pub(super) fn record_ahead(&mut self, sessions: &[&mut Session], offset: usize, readback: usize) {
        if !sessions.iter().all(|s| s.len + offset < s.bufs.capacity) {
            return;
        }
        if self.recorder.is_none() {
            self.recorder = Recorder::start();
        }
        let rows = recording_key(sessions, offset);
        // Recorded already (or being recorded) for this very step.
        if self.prerecorded.as_ref().is_some_and(|p| p.rows == rows && p.readback == readback) {
            return;
        }
        let job = self.step_job(sessions, offset, readback, false);
        let Some(recorder) = &self.recorder else { return };
        let commands = recorder.record(job.clone());
        self.recordings.2 += 1;
        self.prerecorded = Some(PrerecordedStep { rows, readback, job, commands, arrived: None });
    }

    /// What the commands of the step of `sessions` at their lengths plus
    /// `offset` record (see [`Self::submit`]): the batch's launches for
    /// the row count and the rows' positions, each row's own token choice
    /// where it samples, and the copies of the tokens. The rows' positions
    /// and input tokens are buffer contents, written at the submit
    /// ([`Self::submit_commands`]).
    pub(super) fn step_job(
        &self,
        sessions: &[&mut Session],
        offset: usize,
        readback: usize,
        wait: bool,
    ) -> StepJob {
        let n = sessions.len();
        let chunk = ATTENTION_CHUNK as usize;
        let choices = sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| chooses_alone(s))
            .map(|(row, s)| RowChoice {
                row,
                logits: s.bufs.logits.clone(),
                launches: s.forward.choose.clone(),
            })
            .collect();
        // Each row's token where its session's next step reads it (a row
        // choosing alone: from where its choice wrote it, to the batch's
        // row, which the readback and the next batch step read).
        let mut copies = Vec::with_capacity(n + 1);
        for (z, s) in sessions.iter().enumerate() {
            let at = 4 * (s.len + offset + 1) as u64;
            let row = 4 * (1 + z as u64);
            let (batch, own) = (self.bufs.tokens.clone(), s.bufs.tokens.clone());
            copies.push(if chooses_alone(s) {
                ReadbackCopy { src: own, src_offset: at, dst: batch, dst_offset: row, size: 4 }
            } else {
                ReadbackCopy { src: batch, src_offset: row, dst: own, dst_offset: at, size: 4 }
            });
        }
        copies.push(ReadbackCopy {
            src: self.bufs.tokens.clone(),
            src_offset: 4,
            dst: self.readbacks[readback].clone(),
            dst_offset: 0,
            size: 4 * n as u64,
        });
        StepJob {
            model: self.model.clone(),
            forward: self.forward.clone(),
            rows: n as u32,
            short: sessions.iter().any(|s| s.len + offset < chunk),
            long: sessions.iter().any(|s| s.len + offset >= chunk),
            wait,
            logits: self.bufs.logits.clone(),
            choices,
            copies,
        }
    }
}

/// Whether `s` chooses its token with its own launches in a batch step
/// (it samples, applies penalties or a constraint's mask) rather than by
/// the batch's argmax.
pub(super) fn chooses_alone(s: &Session) -> bool {
    !s.sampling.is_greedy() || s.sampling.has_penalties() || s.has_constraint()
}

/// `s`'s key as a step `offset` positions on from now finds it (the pending
/// token of a later step is not known yet).
pub(super) fn row_key(s: &Session, offset: usize) -> RowKey {
    let lease = s.kv_slot.as_ref().map_or(u64::MAX, |l| l.number);
    (lease, s.edits, s.len + offset, if offset == 0 { s.pending } else { None })
}

/// Per row, the key of the commands of the step `offset` positions on
/// from now (see [`RecordingKey`]).
pub(super) fn recording_key(sessions: &[&mut Session], offset: usize) -> Vec<RecordingKey> {
    sessions.iter().map(|s| row_key(s, offset)).map(|(lease, edits, pos, _)| (lease, edits, pos)).collect()
}
