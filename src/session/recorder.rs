//! Decode steps recorded ahead of their submit, on a thread of their
//! own: recording a step's ~150 launches and encoding them
//! (`CommandEncoder::finish`: wgpu's tracking and the driver's commands)
//! costs the host ~0.4 ms per step on x86 hosts, most of a decode call's
//! time. A session that keeps steps queued ahead knows the next submit's
//! positions one submit early, and so does a batch stepping the same
//! sessions frame after frame, so a [`Recorder`] encodes them meanwhile
//! and the caller's thread only submits the finished commands: a frame
//! that takes tokens pays for submits and readbacks, not for recording.
//! Every submit stays on the caller's thread, in the caller's order, so
//! writes the caller queues (`Queue::write_buffer`) keep their order
//! relative to the steps; commands recorded for positions that are no
//! longer next are dropped unsubmitted.

use std::ops::Range;
use std::sync::{mpsc, Arc};

use crate::gpu_weights::ModelGpu;
use crate::kernels::{Launch, ATTENTION_CHUNK};

/// A session's decode-step launches, owned (handles shared with its
/// forward pass) so that another thread can record them.
pub(super) struct StepLaunches {
    /// The step while the context fits one attention chunk.
    short: Vec<Launch>,
    /// The step after (chunked attention and its reduction).
    long: Vec<Launch>,
    /// From the position it names on, where the forward pass has one: the
    /// step whose attention runs two query heads a workgroup.
    packed: Option<(usize, Vec<Launch>)>,
    /// The last launches of each: those choosing the token.
    choose: usize,
}

impl StepLaunches {
    /// The launches of `forward`'s steps (shared handles: cheap).
    pub(super) fn of(forward: &crate::qwen3::Forward) -> Self {
        let chunk = ATTENTION_CHUNK as usize;
        StepLaunches {
            short: forward.step_at(0).cloned().collect(),
            long: forward.step_at(chunk).cloned().collect(),
            packed: forward.pack_from().map(|from| {
                let from = from.max(chunk);
                (from, forward.step_at(from).cloned().collect())
            }),
            choose: forward.choose.len(),
        }
    }

    /// The step at position `pos`, in order (as `Forward::step_at`).
    pub(super) fn at(&self, pos: usize) -> &[Launch] {
        match &self.packed {
            _ if pos < ATTENTION_CHUNK as usize => &self.short,
            Some((from, packed)) if pos >= *from => packed,
            _ => &self.long,
        }
    }

    /// The launches of the step at `pos` that `part` records.
    pub(super) fn part_at(&self, pos: usize, part: StepPart) -> &[Launch] {
        let all = self.at(pos);
        let split = all.len() - self.choose;
        match part {
            StepPart::Whole => all,
            StepPart::Forward => &all[..split],
            StepPart::Choice => &all[split..],
        }
    }
}

/// Which launches of a decode step a submit records: a constrained
/// session submits a step's forward pass (up to the logits) apart from its
/// token choice, which waits for the mask of the token before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StepPart {
    Whole,
    /// Up to the logits.
    Forward,
    /// The launches choosing the token from the logits.
    Choice,
}

/// One buffer-to-buffer copy recorded after the steps (a token, or its
/// log-probability record, into a readback slot; a batch row's token
/// between the batch's and its session's token sequences).
#[derive(Clone)]
pub(super) struct ReadbackCopy {
    pub src: wgpu::Buffer,
    pub src_offset: u64,
    pub dst: wgpu::Buffer,
    pub dst_offset: u64,
    pub size: u64,
}

/// Commands a [`Recorder`] can record: a job holds everything they depend
/// on (shared handles), so recording needs nothing of the caller's.
pub(super) trait Recordable: Send + 'static {
    /// Records and finishes the commands.
    fn encode(&self) -> wgpu::CommandBuffer;
}

/// What one submit of a session's decode steps records.
#[derive(Clone)]
pub(super) struct StepsJob {
    pub model: Arc<ModelGpu>,
    pub launches: Arc<StepLaunches>,
    pub positions: Range<usize>,
    /// The part of the first position's step recorded (later positions
    /// record whole steps): `Choice` when its forward pass was submitted
    /// ahead, `Forward` for a forward pass submitted ahead of its choice.
    pub first: StepPart,
    pub copies: Vec<ReadbackCopy>,
}

impl StepsJob {
    /// Records the steps at `positions` in one compute pass (a pass per
    /// step cost ~40 µs of GPU time per step on an H200), then the copies
    /// (each step's token is read back once the whole submit is done
    /// anyway, so they all follow the pass), and finishes the commands.
    pub(super) fn encode(&self) -> wgpu::CommandBuffer {
        let device = &self.model.gpu.device;
        let mut enc =
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: None,
            });
            for pos in self.positions.clone() {
                let part = if pos == self.positions.start { self.first } else { StepPart::Whole };
                for l in self.launches.part_at(pos, part) {
                    l.record(&mut pass, &self.model.kernels);
                }
            }
        }
        for c in &self.copies {
            enc.copy_buffer_to_buffer(&c.src, c.src_offset, &c.dst, c.dst_offset, c.size);
        }
        enc.finish()
    }
}

impl Recordable for StepsJob {
    fn encode(&self) -> wgpu::CommandBuffer {
        StepsJob::encode(self)
    }
}

/// What a prompt's last submit records: its last batch, then the token
/// after the prompt chosen ([`PrefillTail`]); or, for a prompt of one
/// position, that position's decode step.
#[derive(Clone)]
pub(super) enum LastJob {
    Batch(PrefillJob, PrefillTail),
    Step(StepsJob),
}

impl LastJob {
    /// Records the commands and finishes them.
    pub(super) fn encode(&self) -> wgpu::CommandBuffer {
        match self {
            LastJob::Batch(batch, tail) => {
                let mut enc = batch.encoder();
                tail.record(&mut enc, &batch.model);
                enc.finish()
            }
            LastJob::Step(s) => s.encode(),
        }
    }

    /// The decode-step launches whose token choice it records.
    pub(super) fn steps(&self) -> &Arc<StepLaunches> {
        match self {
            LastJob::Batch(_, tail) => &tail.steps,
            LastJob::Step(s) => &s.launches,
        }
    }
}

impl Recordable for LastJob {
    fn encode(&self) -> wgpu::CommandBuffer {
        LastJob::encode(self)
    }
}

/// What one prompt batch of a feed records: the prompt-batch launches
/// over `tokens` positions (their first position is in the session's step
/// buffer, written before the submit).
#[derive(Clone)]
pub(super) struct PrefillJob {
    pub model: Arc<ModelGpu>,
    pub launches: Arc<Vec<Launch>>,
    pub tokens: u32,
}

/// What the last batch of a prompt records after the batch: its last row
/// of x copied out, the choice's position set, the LM head over that row
/// and the token choice (those of the decode step at `pos`), and the
/// token's readback copies.
#[derive(Clone)]
pub(super) struct PrefillTail {
    pub head: Arc<Vec<Launch>>,
    pub steps: Arc<StepLaunches>,
    /// The prompt's last position.
    pub pos: usize,
    /// The batch's last row of x into `x_last`, then `step_last` into
    /// `step`.
    pub moves: [ReadbackCopy; 2],
    pub copies: Vec<ReadbackCopy>,
}

impl PrefillTail {
    fn record(&self, enc: &mut wgpu::CommandEncoder, model: &ModelGpu) {
        for c in &self.moves {
            enc.copy_buffer_to_buffer(&c.src, c.src_offset, &c.dst, c.dst_offset, c.size);
        }
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("prompt's next token"),
                timestamp_writes: None,
            });
            let choice = self.steps.part_at(self.pos, StepPart::Choice);
            for l in self.head.iter().chain(choice) {
                l.record(&mut pass, &model.kernels);
            }
        }
        for c in &self.copies {
            enc.copy_buffer_to_buffer(&c.src, c.src_offset, &c.dst, c.dst_offset, c.size);
        }
    }
}

impl Recordable for PrefillJob {
    fn encode(&self) -> wgpu::CommandBuffer {
        PrefillJob::encode(self)
    }
}

impl PrefillJob {
    /// Records the batch in one compute pass and finishes the commands.
    pub(super) fn encode(&self) -> wgpu::CommandBuffer {
        self.encoder().finish()
    }

    /// An encoder holding the batch's compute pass.
    fn encoder(&self) -> wgpu::CommandEncoder {
        let device = &self.model.gpu.device;
        let mut enc =
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("prefill") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("prefill"),
                timestamp_writes: None,
            });
            for l in self.launches.iter() {
                l.record_batch(&mut pass, &self.model.kernels, self.tokens);
            }
        }
        enc
    }
}

/// A job sent to a [`Recorder`] (or to none: then recorded on the caller's
/// thread when taken), kept to record it there should the recorder be
/// gone.
pub(super) struct Ahead<J> {
    pub job: J,
    commands: mpsc::Receiver<wgpu::CommandBuffer>,
}

impl<J: Recordable + Clone> Ahead<J> {
    /// Sends `job` to `recorder`.
    pub(super) fn record(recorder: Option<&Recorder>, job: J) -> Self {
        let commands = match recorder {
            Some(rec) => rec.record(job.clone()),
            // A receiver whose sender is gone: `take` records inline.
            None => mpsc::channel().1,
        };
        Ahead { job, commands }
    }

    /// The commands, waiting for their recording (on the recorder's own
    /// thread: those queued before a task are recorded by then).
    pub(super) fn take_waiting(&self) -> wgpu::CommandBuffer {
        take_recorded(&self.commands, true, || self.job.encode()).unwrap_or_else(|| self.job.encode())
    }

    /// The commands once recorded (`None` while they are being recorded),
    /// and whether they were recorded on the caller's thread (the
    /// recorder being gone).
    pub(super) fn take(&self) -> Option<(wgpu::CommandBuffer, bool)> {
        let mut inline = false;
        let commands = take_recorded(&self.commands, false, || {
            inline = true;
            self.job.encode()
        })?;
        Some((commands, inline))
    }
}

/// The commands a job queued on a [`Recorder`] yields once recorded
/// (waiting for them if `wait`; else `None` while they are being
/// recorded); `fallback` records them on the caller's thread when the
/// recorder is gone.
pub(super) fn take_recorded(
    commands: &mpsc::Receiver<wgpu::CommandBuffer>,
    wait: bool,
    fallback: impl FnOnce() -> wgpu::CommandBuffer,
) -> Option<wgpu::CommandBuffer> {
    let got = if wait {
        commands.recv().map_err(|_| mpsc::TryRecvError::Disconnected)
    } else {
        commands.try_recv()
    };
    match got {
        Ok(commands) => Some(commands),
        Err(mpsc::TryRecvError::Empty) => None,
        // The recorder is gone: record here.
        Err(mpsc::TryRecvError::Disconnected) => Some(fallback()),
    }
}

/// Work on its way to the recording thread: a job's recording (sending
/// its commands back), or a task of the owner's.
type QueuedJob = Box<dyn FnOnce() + Send>;

/// A session's or a batch's recording thread: encodes the jobs it is
/// sent, in order, and ends when its owner drops the [`Recorder`] (which
/// waits for it: no thread of the owner's is left inside the driver once
/// it is gone, e.g. while the process exits).
pub(super) struct Recorder {
    jobs: Option<mpsc::Sender<QueuedJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Recorder {
    /// Starts the thread; `None` when the system refuses one (the owner
    /// then records on the caller's thread).
    pub(super) fn start() -> Option<Self> {
        let (jobs, incoming) = mpsc::channel::<QueuedJob>();
        let thread = std::thread::Builder::new()
            .name("qwen3-wgpu recorder".into())
            .spawn(move || {
                for job in incoming {
                    job();
                }
            })
            .ok()?;
        Some(Recorder { jobs: Some(jobs), thread: Some(thread) })
    }

    /// Queues `job`; its commands arrive on the returned receiver
    /// (recorded on the caller's thread should the recorder's be gone).
    pub(super) fn record(&self, job: impl Recordable) -> mpsc::Receiver<wgpu::CommandBuffer> {
        let (done, commands) = mpsc::channel();
        self.run(move || {
            // The owner may have moved on and dropped the receiver.
            let _ = done.send(job.encode());
        });
        commands
    }

    /// Waits until every job and task queued so far has run.
    pub(super) fn finish_queued(&self) {
        let (tx, rx) = mpsc::channel();
        self.run(move || {
            let _ = tx.send(());
        });
        let _ = rx.recv();
    }

    /// Runs `task` on the thread after the jobs queued before it (on the
    /// caller's thread should the recorder's be gone).
    pub(super) fn run(&self, task: impl FnOnce() + Send + 'static) {
        let task: QueuedJob = Box::new(task);
        let unsent = match &self.jobs {
            Some(jobs) => jobs.send(task).err().map(|e| e.0),
            None => Some(task),
        };
        if let Some(task) = unsent {
            task();
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the job at hand (at
        // most one submit's recording).
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The next submit's steps, being recorded (or recorded) ahead.
pub(super) struct Prerecorded {
    /// The positions it steps.
    pub positions: Range<usize>,
    /// The launches it records (a rebuilt forward pass does not match).
    pub launches: Arc<StepLaunches>,
    /// The readback slots its copies write, one per step in order (held
    /// until it is submitted or dropped).
    pub slots: Vec<usize>,
    /// The job, kept to record it on the caller's thread should the
    /// recorder be gone.
    pub job: StepsJob,
    pub commands: mpsc::Receiver<wgpu::CommandBuffer>,
}

impl Prerecorded {
    /// The commands once recorded (waiting for them if `wait`; else
    /// `None` while they are being recorded).
    pub(super) fn take(&self, wait: bool) -> Option<wgpu::CommandBuffer> {
        take_recorded(&self.commands, wait, || self.job.encode())
    }

    /// The commands, waiting for their recording (recorded here should
    /// the recorder be gone).
    pub(super) fn take_waiting(&self) -> wgpu::CommandBuffer {
        self.take(true).unwrap_or_else(|| self.job.encode())
    }
}
