//! Decoding while rendering: one wgpu device shared by a renderer and the
//! engine, as in a game. Each frame renders a full-screen fragment shader
//! (an iterated Julia set, enough work to take a few milliseconds of GPU)
//! to an offscreen texture, then polls every conversation without blocking
//! (`begin_feed`/`poll_feed` for the prompt; then a single conversation
//! takes its tokens with `try_next_token`, while several are sessions of
//! one `Batch` stepped together by one `Batch::try_step` a frame: one GPU
//! step, one token each), then sleeps to the next 60 Hz frame boundary.
//!
//! It runs one phase of `--frames` frames with rendering alone, then one
//! per `--sessions` count with that many conversations decoding, and prints
//! per phase (p50, p99 and max, in ms): the frame's CPU time (the render's
//! encoding and submit plus the engine calls), the render's and the
//! engine's parts of it, the rendered frame's GPU-complete latency (from
//! its submit until its own commands are done, which a 4-byte copy at their
//! end into a buffer then mapped tells: decode steps queued ahead of it
//! included, as one queue runs them first, and none submitted after it;
//! seen by polling the device every 0.2 ms while the frame idles), frames
//! that overran their boundary, the times an engine call waited for the
//! GPU (none: every call it makes is non-blocking), and the tokens per second the
//! conversations reached; in the JSON also the 8 rendered frames that
//! completed latest, each with the engine's calls in the 3 frames before
//! it, and the frame from which a batch's row pipelines were all built
//! (until then a step may run a larger session count's pipelines, or each
//! row through the one-token pipelines: the launches of each are counted);
//! per frame also the batch steps submitted and the idle part's longest
//! `device.poll` (a poll held up inside wgpu would delay the completions
//! it reports, and so the latency measured).
//! A single conversation takes every token that has
//! arrived each frame (`--max-tokens-per-frame` caps it); batched ones take
//! at most one each per frame. A conversation whose context
//! (`--context`) fills starts over: `Session::truncate(0)`, which then has
//! no queued step to wait for, and its prompt again.
//!
//! ```text
//! cargo run --release --example frame_loop -- --checkpoint DIR [--frames 600] [--sessions 1,8]
//!     [--backend metal|portable] [--width 1920] [--height 1080] [--render-ms 2 | --iterations N]
//!     [--prompt-len 64] [--context 512] [--kv-cache f16|int8] [--lookahead N] [--max-tokens-per-frame N]
//!     [--prompt-batch N]
//!     [--no-cache] [--json]
//!     [--constraint SCHEMA.json --tokenizer DIR]
//! ```
//!
//! With `--json`, one object per line: the setup, then one per phase.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use qwen3_wgpu::{
    wgpu, AdapterPolicy, Batch, BatchOptions, CachePolicy, Constraint, Engine, Error, FeedStatus, Gpu,
    KvFormat, LoadOptions, Model, Result, Session, SessionOptions, Tokenizer, DEFAULT_LOOKAHEAD,
};
use serde_json::{json, Value};

/// The frame period: 60 Hz.
const FRAME: Duration = Duration::from_nanos(16_666_667);

/// How often the idle part of a frame polls the device, so that the
/// rendered frame's completion is seen within this much of it.
const IDLE_POLL: Duration = Duration::from_micros(200);

#[derive(Parser)]
#[command(about = "Decode while rendering on one shared wgpu device, with frame-time statistics")]
struct Args {
    /// Checkpoint directory (config.json + safetensors).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Frames per phase (at 60 Hz: 600 is 10 s).
    #[arg(long, default_value_t = 600)]
    frames: usize,
    /// Conversations decoding in each phase after rendering alone,
    /// comma-separated.
    #[arg(long, default_value = "1,8", value_delimiter = ',')]
    sessions: Vec<usize>,
    /// metal or portable (default: QWEN3_WGPU_BACKEND, else portable).
    #[arg(long)]
    backend: Option<String>,
    /// Render target width in pixels.
    #[arg(long, default_value_t = 1920)]
    width: u32,
    /// Render target height in pixels.
    #[arg(long, default_value_t = 1080)]
    height: u32,
    /// Iterations of the fragment shader's loop are doubled from 8 until a
    /// frame takes this much GPU time (rendering alone, waited for).
    #[arg(long, default_value_t = 2.0)]
    render_ms: f64,
    /// Iterations of the fragment shader's loop (no calibration).
    #[arg(long)]
    iterations: Option<u32>,
    /// Prompt length of each conversation (synthetic ids; no tokenizer).
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// KV-cache positions of each conversation; a full one starts over
    /// (rewinds and feeds its prompt again).
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// The conversations' KV-cache format: `f16` or `int8`.
    #[arg(long, default_value = "f16", value_parser = parse_kv_cache)]
    kv_cache: KvFormat,
    /// Decode steps a conversation stepped alone keeps queued ahead
    /// (default: the engine's).
    #[arg(long)]
    lookahead: Option<usize>,
    /// Prompt positions one batch of a feed runs (`Session::set_prompt_batch`;
    /// default: the engine's): the most prompt work a frame queues.
    #[arg(long)]
    prompt_batch: Option<usize>,
    /// Tokens taken from each session per frame (0: every token that has
    /// arrived).
    #[arg(long, default_value_t = 0)]
    max_tokens_per_frame: usize,
    /// Constrains every reply to this JSON schema (needs --tokenizer); a
    /// conversation whose reply is complete starts over with its prompt.
    #[arg(long)]
    constraint: Option<PathBuf>,
    /// Tokenizer directory (tokenizer.json) for --constraint.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Neither read nor write the converted-weights cache.
    #[arg(long)]
    no_cache: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

/// A full-screen fragment shader drawn to an offscreen texture.
struct Renderer {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipeline: wgpu::RenderPipeline,
    bind_group: wgpu::BindGroup,
    params: wgpu::Buffer,
    view: wgpu::TextureView,
    width: u32,
    height: u32,
    iterations: u32,
    /// 4 bytes each frame copies into its own readback marker: the
    /// marker's mapping completes when that frame's commands are done, and
    /// not, as `on_submitted_work_done` would, when everything submitted
    /// before the callback's registration is (another thread, as the
    /// engine's recorders do, may submit between the frame and the
    /// registration).
    marker_src: wgpu::Buffer,
}

const SHADER: &str = r#"
struct Params { time: f32, iterations: u32, width: f32, height: f32 }
@group(0) @binding(0) var<uniform> params: Params;

@vertex
fn vs(@builtin(vertex_index) i: u32) -> @builtin(position) vec4f {
    let p = vec2f(f32((i << 1u) & 2u), f32(i & 2u));
    return vec4f(p * 2.0 - 1.0, 0.0, 1.0);
}

// A Julia set iterated a fixed number of times (no early exit, so every
// pixel costs the same), shaded by how close the orbit stays to 0.
@fragment
fn fs(@builtin(position) pos: vec4f) -> @location(0) vec4f {
    let uv = pos.xy / vec2f(params.width, params.height);
    var z = (uv - 0.5) * vec2f(3.0 * params.width / params.height, 3.0);
    let c = 0.7885 * vec2f(cos(params.time), sin(params.time));
    var glow = 0.0;
    for (var i = 0u; i < params.iterations; i++) {
        z = clamp(vec2f(z.x * z.x - z.y * z.y, 2.0 * z.x * z.y) + c, vec2f(-4.0), vec2f(4.0));
        glow += exp(-dot(z, z));
    }
    let v = glow / f32(max(params.iterations, 1u));
    return vec4f(v, v * v, sqrt(v), 1.0);
}
"#;

impl Renderer {
    fn new(device: &wgpu::Device, queue: &wgpu::Queue, width: u32, height: u32) -> Self {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("frame"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let format = wgpu::TextureFormat::Rgba8Unorm;
        let pipeline = device.create_render_pipeline(&wgpu::RenderPipelineDescriptor {
            label: Some("frame"),
            layout: None,
            vertex: wgpu::VertexState {
                module: &module,
                entry_point: Some("vs"),
                compilation_options: Default::default(),
                buffers: &[],
            },
            primitive: wgpu::PrimitiveState::default(),
            depth_stencil: None,
            multisample: wgpu::MultisampleState::default(),
            fragment: Some(wgpu::FragmentState {
                module: &module,
                entry_point: Some("fs"),
                compilation_options: Default::default(),
                targets: &[Some(wgpu::ColorTargetState {
                    format,
                    blend: None,
                    write_mask: wgpu::ColorWrites::ALL,
                })],
            }),
            multiview_mask: None,
            cache: None,
        });
        let params = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("frame params"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("frame"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[wgpu::BindGroupEntry { binding: 0, resource: params.as_entire_binding() }],
        });
        let target = device.create_texture(&wgpu::TextureDescriptor {
            label: Some("frame target"),
            size: wgpu::Extent3d { width, height, depth_or_array_layers: 1 },
            mip_level_count: 1,
            sample_count: 1,
            dimension: wgpu::TextureDimension::D2,
            format,
            usage: wgpu::TextureUsages::RENDER_ATTACHMENT,
            view_formats: &[],
        });
        let view = target.create_view(&Default::default());
        Renderer {
            device: device.clone(),
            queue: queue.clone(),
            pipeline,
            bind_group,
            params,
            view,
            width,
            height,
            iterations: 8,
            marker_src: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("frame marker source"),
                size: 4,
                usage: wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
        }
    }

    /// A readback marker for [`Renderer::frame`].
    fn marker(&self) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("frame marker"),
            size: 4,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Records and submits frame `n` (ending with a copy into `marker`, if
    /// given); returns its submission.
    fn frame(&self, n: usize, marker: Option<&wgpu::Buffer>) -> wgpu::SubmissionIndex {
        let time = n as f32 / 60.0;
        let mut params = [0u8; 16];
        params[0..4].copy_from_slice(&time.to_le_bytes());
        params[4..8].copy_from_slice(&self.iterations.to_le_bytes());
        params[8..12].copy_from_slice(&(self.width as f32).to_le_bytes());
        params[12..16].copy_from_slice(&(self.height as f32).to_le_bytes());
        self.queue.write_buffer(&self.params, 0, &params);
        let mut enc = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_render_pass(&wgpu::RenderPassDescriptor {
                label: Some("frame"),
                color_attachments: &[Some(wgpu::RenderPassColorAttachment {
                    view: &self.view,
                    depth_slice: None,
                    resolve_target: None,
                    ops: wgpu::Operations {
                        load: wgpu::LoadOp::Clear(wgpu::Color::BLACK),
                        store: wgpu::StoreOp::Store,
                    },
                })],
                depth_stencil_attachment: None,
                timestamp_writes: None,
                occlusion_query_set: None,
                multiview_mask: None,
            });
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &self.bind_group, &[]);
            pass.draw(0..3, 0..1);
        }
        if let Some(marker) = marker {
            enc.copy_buffer_to_buffer(&self.marker_src, 0, marker, 0, 4);
        }
        self.queue.submit([enc.finish()])
    }

    /// GPU time of one frame, waited for (the median of three).
    fn timed_frame(&self) -> Result<f64> {
        let mut times = Vec::new();
        for n in 0..3 {
            let start = Instant::now();
            let index = self.frame(n, None);
            self.device
                .poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("waiting for a frame: {e}") })?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[1])
    }

    /// Doubles the shader's iterations until a frame takes `target_ms`
    /// (at most 2^16 iterations); returns that frame's time.
    fn calibrate(&mut self, target_ms: f64) -> Result<f64> {
        loop {
            let ms = self.timed_frame()?;
            if ms >= target_ms || self.iterations >= 1 << 16 {
                return Ok(ms);
            }
            self.iterations *= 2;
        }
    }
}

/// One conversation: its prompt fed without blocking, then tokens.
struct Conversation {
    session: Session,
    feeding: bool,
    /// Frames from the feed's start to its first token.
    feed_frames: Option<usize>,
    frames_fed: usize,
    tokens: usize,
    /// Times the context filled, or a constrained reply was complete, and
    /// the conversation started over.
    restarts: usize,
    /// Constrained replies completed.
    replies: usize,
    /// The longest engine call of each kind, ms: where a slow frame's
    /// time goes.
    slowest_calls: CallTimes,
    /// The first tokens of its first reply (the prompt's prediction first),
    /// to check against a blocking session.
    first_ids: Vec<u32>,
}

/// The longest engine call of each kind, ms; and the time of each kind
/// in the frame at hand (what a slow frame spent its time on).
#[derive(Default)]
struct CallTimes(
    std::collections::BTreeMap<&'static str, f64>,
    std::collections::BTreeMap<&'static str, f64>,
);

impl CallTimes {
    fn note(&mut self, call: &'static str, start: Instant) {
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let slowest = self.0.entry(call).or_insert(0.0);
        *slowest = slowest.max(ms);
        *self.1.entry(call).or_insert(0.0) += ms;
    }

    /// Adds the frame's calls to `frame` and starts the next frame.
    fn end_frame(&mut self, frame: &mut std::collections::BTreeMap<&'static str, f64>) {
        for (call, ms) in std::mem::take(&mut self.1) {
            *frame.entry(call).or_insert(0.0) += ms;
        }
    }

    fn merge(&mut self, other: &CallTimes) {
        for (&call, &ms) in &other.0 {
            let slowest = self.0.entry(call).or_insert(0.0);
            *slowest = slowest.max(ms);
        }
    }
}

/// Tokens of the first reply kept in [`Conversation::first_ids`].
const FIRST_IDS: usize = 16;

impl Conversation {
    /// Begins feeding `prompt` to `session`.
    fn start(mut session: Session, prompt: &[u32]) -> Result<Self> {
        session.begin_feed(prompt)?;
        Ok(Conversation {
            session,
            feeding: true,
            feed_frames: None,
            frames_fed: 0,
            tokens: 0,
            restarts: 0,
            replies: 0,
            slowest_calls: CallTimes::default(),
            first_ids: Vec::new(),
        })
    }

    /// One frame's engine work for a conversation stepped alone: never
    /// waits for the GPU.
    fn poll(&mut self, prompt: &[u32], max_tokens: usize) -> Result<()> {
        if !self.ready_to_decode(prompt)? {
            return Ok(());
        }
        let mut taken = 0;
        while max_tokens == 0 || taken < max_tokens {
            if self.session.len() >= self.session.capacity() || self.session.constraint_complete() {
                break;
            }
            let t = Instant::now();
            let got = self.session.try_next_token()?;
            self.slowest_calls.note("try_next_token", t);
            match got {
                Some(token) => {
                    taken += 1;
                    self.took(token);
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Advances the prompt's feed, or starts the conversation over once its
    /// context is full; whether it can decode a token this frame (neither
    /// waits for the GPU).
    fn ready_to_decode(&mut self, prompt: &[u32]) -> Result<bool> {
        if self.feeding {
            self.frames_fed += 1;
            let t = Instant::now();
            let status = self.session.poll_feed()?;
            self.slowest_calls.note("poll_feed", t);
            if let FeedStatus::Ready(token) = status {
                self.feeding = false;
                self.tokens += 1;
                if self.feed_frames.is_none() {
                    self.feed_frames = Some(self.frames_fed);
                    self.first_ids.push(token);
                }
            }
            return Ok(false);
        }
        // A full context, or a complete constrained reply, starts the
        // conversation over. Steps are never queued past the capacity, nor
        // past a constrained token (each waits for its mask), so every
        // queued step has been taken, and the rewind waits for nothing.
        let complete = self.session.constraint_complete();
        self.replies += usize::from(complete);
        if complete || self.session.len() >= self.session.capacity() {
            let t = Instant::now();
            self.session.truncate(0)?;
            self.slowest_calls.note("truncate", t);
            let t = Instant::now();
            self.session.begin_feed(prompt)?;
            self.slowest_calls.note("begin_feed", t);
            self.feeding = true;
            self.frames_fed = 0;
            self.restarts += 1;
            return Ok(false);
        }
        Ok(true)
    }

    /// Counts a decoded token (kept while the first reply is short).
    fn took(&mut self, token: u32) {
        // Only the first reply: a restart feeds the prompt again.
        if self.first_ids.len() < FIRST_IDS && self.first_ids.len() == self.tokens {
            self.first_ids.push(token);
        }
        self.tokens += 1;
    }
}

/// One frame's engine work for conversations stepped as one batch: feeds
/// and restarts as alone, then one [`Batch::try_step`] for every
/// conversation ready to decode (one GPU step for all of them; never waits
/// for the GPU).
fn poll_batch(batch: &mut Batch, conversations: &mut [Conversation], prompt: &[u32]) -> Result<()> {
    let mut decoding = Vec::with_capacity(conversations.len());
    for c in conversations.iter_mut() {
        if c.ready_to_decode(prompt)? {
            decoding.push(c);
        }
    }
    if decoding.is_empty() {
        return Ok(());
    }
    let mut sessions: Vec<&mut Session> = decoding.iter_mut().map(|c| &mut c.session).collect();
    let t = Instant::now();
    let stepped = batch.try_step(&mut sessions)?;
    decoding[0].slowest_calls.note("try_step", t);
    if let Some(tokens) = stepped {
        for (c, token) in decoding.iter_mut().zip(tokens) {
            c.took(token);
        }
    }
    Ok(())
}

/// p50, p99 and max of `values`, in milliseconds.
fn stats(values: &[f64]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    json!({"p50": round(at(0.5)), "p99": round(at(0.99)), "max": round(v[v.len() - 1])})
}

/// A rendered frame waiting for its marker's mapping (its commands done).
struct InFlightFrame {
    submitted: Instant,
    /// When the mapping completed, and whether it succeeded (a failed one
    /// is not unmapped, nor its marker reused).
    done: Arc<Mutex<Option<(Instant, bool)>>>,
    marker: wgpu::Buffer,
}

/// Runs one phase of `frames` frames with `sessions` conversations.
fn phase(
    renderer: &Renderer,
    model: &Model,
    args: &Args,
    prompt: &[u32],
    constraint: Option<&Constraint>,
    sessions: usize,
) -> Result<Value> {
    let capacity = args.context;
    // Several conversations step as one batch (one GPU step for all of
    // them per frame); a single one steps alone, queueing steps ahead.
    let mut batch =
        match sessions {
            0 | 1 => None,
            n => Some(model.batch(
                &BatchOptions::default().slots(n).capacity_per_slot(capacity).kv_cache(args.kv_cache),
            )?),
        };
    let mut conversations = (0..sessions)
        .map(|_| {
            let mut session = match &batch {
                Some(batch) => batch.session()?,
                None => {
                    let options = SessionOptions::default().capacity(capacity).kv_cache(args.kv_cache);
                    let mut session = model.session_with(&options)?;
                    if let Some(n) = args.lookahead {
                        session.set_lookahead(n);
                    }
                    session
                }
            };
            if let Some(n) = args.prompt_batch {
                session.set_prompt_batch(n)?;
            }
            session.set_constraint(constraint)?;
            Conversation::start(session, prompt)
        })
        .collect::<Result<Vec<_>>>()?;
    let (mut frame_cpu, mut render_cpu, mut engine_cpu) = (Vec::new(), Vec::new(), Vec::new());
    let mut latency = Vec::new();
    let mut in_flight: VecDeque<InFlightFrame> = VecDeque::new();
    let mut late = 0;
    // Each frame's engine time by call kind, ms.
    let mut frame_calls = Vec::new();
    // The first frame at which the batch's row pipelines were all built
    // (before it, a batch step may run in a larger count's pipelines or
    // each row through the one-token pipelines: more GPU time a step).
    let mut pipelines_ready_frame = None;
    // Each frame's matvec launches run through a larger session count's
    // pipelines and once per row through the one-token pipelines (a
    // step's own count's pipelines not built yet).
    let mut stand_ins: Vec<(u64, u64)> = Vec::new();
    let mut stand_ins_so_far = (0, 0);
    // Each frame's longest `device.poll` in its idle part, ms (a poll held
    // up inside wgpu delays the completions it reports), and its batch
    // steps submitted.
    let mut longest_poll: Vec<f64> = Vec::new();
    let mut steps_submitted: Vec<u64> = Vec::new();
    let mut steps_so_far = 0;
    let start = Instant::now();
    let mut boundary = start;
    // Markers whose mapping was harvested, for later frames.
    let mut markers: Vec<wgpu::Buffer> = Vec::new();
    let harvest =
        |in_flight: &mut VecDeque<InFlightFrame>, latency: &mut Vec<f64>, markers: &mut Vec<wgpu::Buffer>| {
            while let Some((done, mapped)) = in_flight.front().and_then(|f| *f.done.lock().unwrap()) {
                let f = in_flight.pop_front().unwrap();
                latency.push((done - f.submitted).as_secs_f64() * 1e3);
                if mapped {
                    f.marker.unmap();
                    markers.push(f.marker);
                }
            }
        };
    for n in 0..args.frames {
        let frame_start = Instant::now();
        let marker = markers.pop().unwrap_or_else(|| renderer.marker());
        renderer.frame(n, Some(&marker));
        let submitted = Instant::now();
        let done = Arc::new(Mutex::new(None));
        let slot = done.clone();
        marker.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            *slot.lock().unwrap() = Some((Instant::now(), r.is_ok()))
        });
        in_flight.push_back(InFlightFrame { submitted, done, marker });
        let engine_start = Instant::now();
        render_cpu.push((engine_start - frame_start).as_secs_f64() * 1e3);
        match &mut batch {
            Some(batch) => {
                if pipelines_ready_frame.is_none() && batch.pipelines_ready() {
                    pipelines_ready_frame = Some(n);
                }
                poll_batch(batch, &mut conversations, prompt)?;
                let now = batch.debug_stand_in_launches();
                stand_ins.push((now.0 - stand_ins_so_far.0, now.1 - stand_ins_so_far.1));
                stand_ins_so_far = now;
                let (here, ahead, _) = batch.debug_step_recordings();
                steps_submitted.push(here + ahead - steps_so_far);
                steps_so_far = here + ahead;
            }
            None => {
                for c in &mut conversations {
                    c.poll(prompt, args.max_tokens_per_frame)?;
                }
                stand_ins.push((0, 0));
                steps_submitted.push(0);
            }
        }
        let end = Instant::now();
        engine_cpu.push((end - engine_start).as_secs_f64() * 1e3);
        let mut calls = std::collections::BTreeMap::new();
        for c in &mut conversations {
            c.slowest_calls.end_frame(&mut calls);
        }
        frame_calls.push(calls);
        frame_cpu.push((end - frame_start).as_secs_f64() * 1e3);
        // Idle until the next boundary, polling the device so completions
        // are seen promptly (not counted as the frame's CPU time).
        boundary += FRAME;
        if Instant::now() > boundary {
            late += 1;
            boundary = Instant::now();
        }
        let mut frame_longest_poll: f64 = 0.0;
        loop {
            let t = Instant::now();
            renderer
                .device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
            frame_longest_poll = frame_longest_poll.max(t.elapsed().as_secs_f64() * 1e3);
            harvest(&mut in_flight, &mut latency, &mut markers);
            let now = Instant::now();
            if now >= boundary {
                break;
            }
            std::thread::sleep((boundary - now).min(IDLE_POLL));
        }
        longest_poll.push(frame_longest_poll);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let tokens: usize = conversations.iter().map(|c| c.tokens).sum();
    let restarts: usize = conversations.iter().map(|c| c.restarts).sum();
    let replies: usize = conversations.iter().map(|c| c.replies).sum();
    let mut slowest_calls = CallTimes::default();
    for c in &conversations {
        slowest_calls.merge(&c.slowest_calls);
    }
    // Waits on the GPU inside the engine's calls: none, if it never blocked.
    let waits: u64 = conversations.iter().map(|c| c.session.debug_feed_counts().1).sum::<u64>()
        + batch.as_ref().map_or(0, Batch::debug_blocking_waits);
    let feed_frames: Vec<f64> =
        conversations.iter().filter_map(|c| c.feed_frames.map(|f| f as f64)).collect();
    let first_ids = conversations.first().map(|c| c.first_ids.clone()).unwrap_or_default();
    drop(conversations);
    drop(batch);
    renderer
        .device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| Error::GpuDeviceFailed { reason: format!("waiting for the phase's work: {e}") })?;
    harvest(&mut in_flight, &mut latency, &mut markers);
    // The slowest frames' engine time, with their index: where the p99
    // comes from (a conversation's first frames, a restart, ...).
    let mut slowest: Vec<(usize, f64)> = engine_cpu.iter().copied().enumerate().collect();
    slowest.sort_by(|a, b| b.1.total_cmp(&a.1));
    slowest.truncate(5);
    // The rendered frames that completed latest, with the engine's calls in
    // the frames before each (the work its render queued behind).
    let mut late_gpu: Vec<(usize, f64)> = latency.iter().copied().enumerate().collect();
    late_gpu.sort_by(|a, b| b.1.total_cmp(&a.1));
    late_gpu.truncate(8);
    let calls_before = |i: usize| {
        (i.saturating_sub(3)..i)
            .map(|j| {
                let (padded, per_row) = stand_ins[j];
                json!({"frame": j, "calls_ms": frame_calls[j], "padded_launches": padded, "per_row_launches": per_row,
                       "steps_submitted": steps_submitted[j], "longest_poll_ms": (longest_poll[j] * 1000.0).round() / 1000.0})
            })
            .collect::<Vec<_>>()
    };
    Ok(json!({
        "slowest_gpu_frames": late_gpu
            .iter()
            .map(|&(i, ms)| json!({"frame": i, "gpu_latency_ms": (ms * 1000.0).round() / 1000.0,
                                   "longest_poll_ms": (longest_poll[i] * 1000.0).round() / 1000.0,
                                   "engine_before": calls_before(i)}))
            .collect::<Vec<_>>(),
        "pipelines_ready_frame": pipelines_ready_frame,
        "stand_in_launches": {"padded": stand_ins_so_far.0, "per_row": stand_ins_so_far.1},
        "longest_poll_ms": stats(&longest_poll),
        "phase": if sessions == 0 { "render" } else { "decode" },
        "slowest_engine_frames": slowest
            .iter()
            .map(|&(i, ms)| json!({"frame": i, "ms": ms, "calls_ms": frame_calls[i]}))
            .collect::<Vec<_>>(),
        "slowest_engine_calls_ms": slowest_calls.0,
        "sessions": sessions,
        "batched": sessions > 1,
        "frames": args.frames,
        "late_frames": late,
        "frame_cpu_ms": stats(&frame_cpu),
        "render_cpu_ms": stats(&render_cpu),
        "engine_cpu_ms": stats(&engine_cpu),
        "gpu_latency_ms": stats(&latency),
        "tokens": tokens,
        "restarts": restarts,
        "constrained_replies": replies,
        "engine_waits": waits,
        "tokens_per_sec": (tokens as f64 / elapsed * 10.0).round() / 10.0,
        "first_token_frames": stats(&feed_frames),
        "first_session_ids": first_ids,
    }))
}

fn parse_kv_cache(value: &str) -> std::result::Result<KvFormat, Error> {
    KvFormat::from_name("--kv-cache", value)
}

fn run(args: &Args) -> Result<()> {
    let policy = match &args.backend {
        Some(name) => AdapterPolicy::from_name("--backend", name)?,
        None => AdapterPolicy::from_env()?.unwrap_or(AdapterPolicy::Portable),
    };
    if args.frames == 0 {
        return Err(Error::InvalidArgument { name: "--frames".into(), reason: "must be at least 1".into() });
    }
    if args.prompt_len == 0 {
        return Err(Error::InvalidArgument {
            name: "--prompt-len".into(),
            reason: "must be at least 1".into(),
        });
    }
    if args.context < args.prompt_len + 4 {
        return Err(Error::InvalidArgument {
            name: "--context".into(),
            reason: format!(
                "{} positions leave no room to decode after a {}-token prompt",
                args.context, args.prompt_len
            ),
        });
    }
    if args.width == 0 || args.height == 0 {
        return Err(Error::InvalidArgument {
            name: "--width/--height".into(),
            reason: "must be at least 1 pixel".into(),
        });
    }
    // The host's device: created by the renderer, with the features and
    // limits the engine asks for, then handed to the engine.
    let adapter = Gpu::adapters().into_iter().next().ok_or_else(|| Error::NoGpuAdapter {
        reason: "wgpu found no adapter (on Linux, install a Vulkan driver such as mesa-vulkan-drivers)"
            .into(),
    })?;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("renderer"),
        required_features: Engine::required_features(&adapter),
        required_limits: Engine::required_limits(&adapter),
        ..Default::default()
    }))
    .map_err(|e| Error::GpuDeviceFailed { reason: format!("request_device: {e}") })?;
    let engine = Engine::builder().policy(policy).device(device.clone(), queue.clone()).build()?;
    let cache = if args.no_cache { CachePolicy::Disabled } else { CachePolicy::Default };
    let model = engine.load(&args.checkpoint, &LoadOptions { cache, ..Default::default() })?;
    let constraint = match (&args.constraint, &args.tokenizer) {
        (Some(schema), Some(dir)) => {
            let tokenizer = Tokenizer::from_checkpoint(dir)?;
            let text = std::fs::read(schema)
                .map_err(|e| Error::InvalidArgument { name: "--constraint".into(), reason: e.to_string() })?;
            let schema: Value = serde_json::from_slice(&text)
                .map_err(|e| Error::InvalidArgument { name: "--constraint".into(), reason: e.to_string() })?;
            Some(Constraint::json_schema(&tokenizer, &schema)?)
        }
        (Some(_), None) => {
            return Err(Error::InvalidArgument {
                name: "--tokenizer".into(),
                reason: "--constraint needs it".into(),
            })
        }
        (None, _) => None,
    };
    let vocab = model.config().vocab_size as u64;
    // Synthetic prompt ids spread over the vocabulary.
    let prompt: Vec<u32> = (0..args.prompt_len as u64).map(|i| ((7 + 7919 * i) % vocab) as u32).collect();

    let mut renderer = Renderer::new(&device, &queue, args.width, args.height);
    let render_ms = match args.iterations {
        Some(n) => {
            renderer.iterations = n;
            renderer.timed_frame()?
        }
        None => renderer.calibrate(args.render_ms)?,
    };
    let info = engine.adapter_info();
    let setup = json!({
        "adapter": {"name": info.name, "backend": info.backend.to_str()},
        "kernels": engine.kernel_source().as_str(),
        "render": {"width": args.width, "height": args.height, "iterations": renderer.iterations,
                   "frame_gpu_ms": (render_ms * 1000.0).round() / 1000.0},
        "prompt_ids": prompt,
        "context": args.context,
        "kv_cache": args.kv_cache.name(),
        "lookahead": args.lookahead.unwrap_or(DEFAULT_LOOKAHEAD),
        "prompt_batch": args.prompt_batch.unwrap_or(qwen3_wgpu::PREFILL_BATCH),
        "constraint": args.constraint,
        "frame_hz": 60,
    });
    if args.json {
        println!("{setup}");
    } else {
        println!(
            "{} ({}): {}x{} frame, {} iterations, {:.2} ms of GPU alone; prompt {} tokens",
            info.name,
            info.backend.to_str(),
            args.width,
            args.height,
            renderer.iterations,
            render_ms,
            args.prompt_len
        );
        println!(
            "{:>8} {:>6} {:>17} {:>17} {:>17} {:>5} {:>9}",
            "sessions", "frames", "frame cpu p50/p99", "engine p50/p99", "gpu lat p50/p99", "late", "tok/s"
        );
    }
    for sessions in std::iter::once(0).chain(args.sessions.iter().copied()) {
        let result = phase(&renderer, &model, args, &prompt, constraint.as_ref(), sessions)?;
        if args.json {
            println!("{result}");
        } else {
            let pair = |key: &str| match &result[key] {
                Value::Null => "-".to_string(),
                v => {
                    format!("{:.3}/{:.3}", v["p50"].as_f64().unwrap_or(0.0), v["p99"].as_f64().unwrap_or(0.0))
                }
            };
            println!(
                "{:>8} {:>6} {:>17} {:>17} {:>17} {:>5} {:>9.1}",
                sessions,
                args.frames,
                pair("frame_cpu_ms"),
                pair("engine_cpu_ms"),
                pair("gpu_latency_ms"),
                result["late_frames"],
                result["tokens_per_sec"].as_f64().unwrap_or(0.0)
            );
            if sessions > 0 {
                let slowest: Vec<String> = result["slowest_engine_frames"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|f| format!("#{} {:.3}", f["frame"], f["ms"].as_f64().unwrap_or(0.0)))
                    .collect();
                println!("{:>8} slowest engine frames (ms): {}", "", slowest.join(", "));
            }
        }
    }
    Ok(())
}

/// Prints `e` as every example does (stderr, and stdout's last line with
/// `--json`) and returns the failure status.
fn fail(e: &Error, json: bool) -> ExitCode {
    eprintln!("error [{}]: {e}", e.code());
    if json {
        println!("{}", json!({"error": {"code": e.code(), "message": e.to_string()}}));
    }
    ExitCode::from(2)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => e.exit(), // --help
        Err(e) => {
            // A malformed command line is `invalid_argument` with clap's reason.
            let reason = e.render().to_string();
            let reason = reason.lines().next().unwrap_or("").trim_start_matches("error: ").to_string();
            let e = Error::InvalidArgument { name: "arguments".into(), reason };
            return fail(&e, std::env::args().any(|a| a == "--json"));
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e, args.json),
    }
}
