//! A decoding session: the KV cache (allocated once for its capacity), the
//! activation buffers, and the recorded forward pass. One command encoder,
//! one compute pass and one submit per token; the next token comes from the
//! GPU argmax, and only its 4 bytes are read back.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::{Kernels, Launch, ARGMAX_CHUNK, ATTENTION_CHUNK};
use crate::model::GpuWeights;
use crate::weights::QUANT_GROUP;

/// Buffers of one session.
pub struct SessionBuffers {
    pub capacity: usize,
    /// Current token id (u32): written for prompt tokens, by argmax otherwise.
    pub token: wgpu::Buffer,
    /// `{pos, seq_len}` uniform, the only per-token state.
    pub step: wgpu::Buffer,
    pub x: wgpu::Buffer,
    pub qkv: wgpu::Buffer,
    pub q: wgpu::Buffer,
    pub attn: wgpu::Buffer,
    pub gate_up: wgpu::Buffer,
    pub h: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    /// Per-chunk argmax results (value, index).
    pub part_val: wgpu::Buffer,
    pub part_idx: wgpu::Buffer,
    /// Chunks of positions attention splits the context into.
    pub attention_chunks: usize,
    /// Per (head, chunk): softmax max and sum, and the weighted V sum.
    pub attn_ml: wgpu::Buffer,
    pub attn_acc: wgpu::Buffer,
    /// RoPE (cos, sin) table, `[capacity][head_dim / 2]`.
    pub rope: wgpu::Buffer,
    /// Per layer, f16 pairs packed in u32: `[kv_head][capacity][head_dim/2]`.
    pub k_cache: Vec<wgpu::Buffer>,
    pub v_cache: Vec<wgpu::Buffer>,
    token_readback: wgpu::Buffer,
}

fn padded(n: usize) -> usize {
    n.div_ceil(QUANT_GROUP) * QUANT_GROUP
}

impl SessionBuffers {
    fn new(gpu: &Gpu, cfg: &ModelConfig, capacity: usize) -> Result<Self> {
        let f = |label: &str, n: usize| gpu.storage(label, 4 * n);
        let kv_words = cfg.num_key_value_heads * capacity * cfg.head_dim / 2;
        let chunks = capacity.div_ceil(ATTENTION_CHUNK as usize);
        Ok(SessionBuffers {
            capacity,
            token: f("token", 1),
            step: gpu.uniform("step", &[0u8; 8])?,
            // Inputs of matvecs are padded to the quant group; the tail stays zero.
            x: f("x", padded(cfg.hidden_size)),
            qkv: f("qkv", cfg.qkv_rows()),
            q: f("q", cfg.q_dim()),
            attn: f("attn", padded(cfg.q_dim())),
            gate_up: f("gate_up", 2 * cfg.intermediate_size),
            h: f("h", padded(cfg.intermediate_size)),
            logits: f("logits", cfg.vocab_size),
            part_val: f("part_val", cfg.vocab_size.div_ceil(ARGMAX_CHUNK as usize)),
            part_idx: f("part_idx", cfg.vocab_size.div_ceil(ARGMAX_CHUNK as usize)),
            attention_chunks: chunks,
            attn_ml: f("attn_ml", 2 * cfg.num_attention_heads * chunks),
            attn_acc: f("attn_acc", cfg.num_attention_heads * chunks * cfg.head_dim),
            rope: gpu.storage_init(
                "rope",
                bytemuck::cast_slice(&crate::qwen3::rope_table(cfg.head_dim, capacity, cfg.rope_theta)),
            )?,
            k_cache: (0..cfg.num_hidden_layers).map(|_| f("k_cache", kv_words)).collect(),
            v_cache: (0..cfg.num_hidden_layers).map(|_| f("v_cache", kv_words)).collect(),
            token_readback: gpu.readback("token_readback", 4),
        })
    }
}

/// What a session shares with its model.
pub(crate) struct ModelGpu {
    pub gpu: Gpu,
    pub kernels: std::sync::Arc<Kernels>,
    pub config: ModelConfig,
    pub weights: GpuWeights,
}

/// Refuses an empty prompt or a token id outside the vocabulary (naming
/// the first bad id and its position).
pub(crate) fn check_prompt(ids: &[u32], vocab_size: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    match ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab_size) {
        Some((position, &id)) => Err(Error::InvalidTokenId { id, position, vocab_size }),
        None => Ok(()),
    }
}

/// Where one decode step's time went (see [`Session::timed_step`]).
#[derive(Debug, Clone, Copy)]
pub struct StepTiming {
    /// CPU time to record the step's commands, microseconds.
    pub encode_us: f64,
    /// GPU time of the forward pass, microseconds (None without timestamp queries).
    pub gpu_us: Option<f64>,
    /// Wall time of the whole step, readback included, microseconds.
    pub wall_us: f64,
}

/// A decoding session over a loaded model: feed tokens, get greedy tokens.
///
/// The KV cache is allocated once, for `capacity` positions, and never grows.
pub struct Session {
    model: Arc<ModelGpu>,
    bufs: SessionBuffers,
    forward: Vec<Launch>,
    /// Positions filled in the KV cache.
    len: usize,
    /// Greedy prediction after the last token run, if any.
    pending: Option<u32>,
}

impl Session {
    pub(crate) fn new(model: Arc<ModelGpu>, capacity: usize) -> Result<Self> {
        let cfg = &model.config;
        let (bufs, forward) = model.gpu.scoped(
            || {
                let bufs = SessionBuffers::new(&model.gpu, cfg, capacity)?;
                let forward = crate::qwen3::forward(&model.gpu, &model.kernels, cfg, &model.weights, &bufs)?;
                Ok((bufs, forward))
            },
            |reason| Error::GpuDeviceFailed { reason: format!("creating session: {reason}") },
        )?;
        Ok(Session { model, bufs, forward, len: 0, pending: None })
    }

    /// KV-cache capacity in positions.
    pub fn capacity(&self) -> usize {
        self.bufs.capacity
    }

    /// Positions already in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before any token was fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// GPU memory this session allocated (KV cache, activations, scratch), bytes.
    pub fn buffer_bytes(&self) -> u64 {
        let b = &self.bufs;
        let fixed = [
            &b.token,
            &b.step,
            &b.x,
            &b.qkv,
            &b.q,
            &b.attn,
            &b.gate_up,
            &b.h,
            &b.logits,
            &b.part_val,
            &b.part_idx,
            &b.attn_ml,
            &b.attn_acc,
            &b.rope,
        ];
        let caches = b.k_cache.iter().chain(&b.v_cache);
        fixed.into_iter().chain(caches).map(|buf| buf.size()).sum()
    }

    /// Kernel launches (dispatches) per token.
    pub fn dispatches_per_token(&self) -> usize {
        self.forward.len()
    }

    /// The greedy prediction after the last token fed, if any.
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Runs `ids` through the model (appending them to the context) and
    /// returns the greedy next token. Checks every id and the capacity
    /// before touching the GPU.
    pub fn feed(&mut self, ids: &[u32]) -> Result<u32> {
        check_prompt(ids, self.model.config.vocab_size)?;
        self.check_room(ids.len())?;
        let mut next = 0;
        for &id in ids {
            next = self.run(Some(id))?;
        }
        Ok(next)
    }

    /// Feeds the pending greedy token back in and returns the next one
    /// (the streaming step). Fails with `empty_prompt` before any `feed`.
    pub fn next_token(&mut self) -> Result<u32> {
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        // The token buffer already holds the pending id (argmax wrote it).
        self.run(None)
    }

    fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.bufs.capacity {
            return Err(Error::ContextOverflow { needed: self.len + n, capacity: self.bufs.capacity });
        }
        Ok(())
    }

    /// One token's commands: one encoder, one compute pass (optionally
    /// timestamped at its start and end), and the 4-byte token copy.
    fn encode(&self, timestamps: Option<&wgpu::QuerySet>) -> wgpu::CommandBuffer {
        let gpu = &self.model.gpu;
        let mut enc =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("token") });
        {
            let timestamp_writes = timestamps.map(|query_set| wgpu::ComputePassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(0),
                end_of_pass_write_index: Some(1),
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes,
            });
            for l in &self.forward {
                l.record(&mut pass, &self.model.kernels);
            }
        }
        enc.copy_buffer_to_buffer(&self.bufs.token, 0, &self.bufs.token_readback, 0, 4);
        enc.finish()
    }

    /// Writes the per-token inputs: the token id (prompt tokens only; the
    /// argmax of the previous step is already in place) and the position.
    fn write_step(&self, id: Option<u32>) {
        let gpu = &self.model.gpu;
        if let Some(id) = id {
            gpu.queue.write_buffer(&self.bufs.token, 0, bytemuck::bytes_of(&id));
        }
        let step = [self.len as u32, self.len as u32 + 1];
        gpu.queue.write_buffer(&self.bufs.step, 0, bytemuck::cast_slice(&step));
    }

    /// Reads the token the last step wrote and advances the position.
    fn finish_step(&mut self) -> Result<u32> {
        let bytes = self.model.gpu.read(&self.bufs.token_readback)?;
        let next = bytes
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or_else(|| Error::GpuDeviceFailed { reason: "short token readback".into() })?;
        self.len += 1;
        if next as usize >= self.model.config.vocab_size {
            return Err(Error::GpuDeviceFailed {
                reason: format!("argmax returned {next} (non-finite logits?)"),
            });
        }
        self.pending = Some(next);
        Ok(next)
    }

    /// One token: one encoder, one pass, one submit, a 4-byte readback.
    fn run(&mut self, id: Option<u32>) -> Result<u32> {
        self.write_step(id);
        let commands = self.encode(None);
        self.model.gpu.queue.submit([commands]);
        self.finish_step()
    }

    /// Like [`next_token`](Self::next_token), and reports where the time
    /// went: CPU encoding, GPU time of the pass (from timestamp queries,
    /// when the device has them), and the whole step's wall time.
    pub fn timed_step(&mut self) -> Result<StepTiming> {
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        let gpu = &self.model.gpu;
        let timestamps = gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY).then(|| {
            let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("step timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            });
            let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            (set, resolve, gpu.readback("timestamps", 16))
        });
        let t0 = std::time::Instant::now();
        self.write_step(None);
        let commands = self.encode(timestamps.as_ref().map(|t| &t.0));
        let encode_us = t0.elapsed().as_secs_f64() * 1e6;
        let mut extra = Vec::new();
        if let Some((set, resolve, readback)) = &timestamps {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            enc.resolve_query_set(set, 0..2, resolve, 0);
            enc.copy_buffer_to_buffer(resolve, 0, readback, 0, 16);
            extra.push(enc.finish());
        }
        gpu.queue.submit(std::iter::once(commands).chain(extra));
        self.finish_step()?;
        let wall_us = t0.elapsed().as_secs_f64() * 1e6;
        let gpu_us = match &timestamps {
            Some((_, _, readback)) => {
                let b: Vec<u64> = bytemuck::pod_collect_to_vec(&self.model.gpu.read(readback)?);
                let period = self.model.gpu.queue.get_timestamp_period() as f64;
                b.get(1).zip(b.first()).map(|(end, start)| end.saturating_sub(*start) as f64 * period / 1e3)
            }
            None => None,
        };
        Ok(StepTiming { encode_us, gpu_us, wall_us })
    }

    /// Runs one decode step with a GPU timestamp after every launch (needs
    /// `TIMESTAMP_QUERY_INSIDE_PASSES`) and returns each launch's GPU time
    /// (kernel, microseconds). `None` when the device cannot time inside a
    /// pass. Advances the session like [`next_token`](Self::next_token).
    #[doc(hidden)]
    pub fn profile_gpu(&mut self) -> Result<Option<Vec<(crate::kernels::Kernel, f64)>>> {
        let gpu = &self.model.gpu;
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        if self.pending.is_none() {
            return Err(Error::EmptyPrompt);
        }
        self.check_room(1)?;
        let n = self.forward.len() as u32 + 1;
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("launch timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: n,
        });
        let bytes = 8 * n as u64;
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("launch timestamps"),
            size: bytes.div_ceil(256) * 256,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = gpu.readback("launch timestamps", bytes as usize);
        self.write_step(None);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&set, 0);
            for (i, l) in self.forward.iter().enumerate() {
                l.record(&mut pass, &self.model.kernels);
                pass.write_timestamp(&set, i as u32 + 1);
            }
        }
        enc.copy_buffer_to_buffer(&self.bufs.token, 0, &self.bufs.token_readback, 0, 4);
        enc.resolve_query_set(&set, 0..n, &resolve, 0);
        enc.copy_buffer_to_buffer(&resolve, 0, &readback, 0, bytes);
        gpu.queue.submit([enc.finish()]);
        self.finish_step()?;
        let t: Vec<u64> = bytemuck::pod_collect_to_vec(&self.model.gpu.read(&readback)?);
        let period = self.model.gpu.queue.get_timestamp_period() as f64;
        Ok(Some(
            self.forward
                .iter()
                .zip(t.windows(2))
                .map(|(l, w)| (l.kernel, w[1].saturating_sub(w[0]) as f64 * period / 1e3))
                .collect(),
        ))
    }

    /// Runs one decode step with a wait after every launch and returns the
    /// wall time of each (kernel, microseconds): a coarse per-kernel profile
    /// for adapters without timestamp queries inside passes. Advances the
    /// session by one position like [`next_token`](Self::next_token).
    #[doc(hidden)]
    pub fn profile_step(&mut self) -> Result<Vec<(crate::kernels::Kernel, f64)>> {
        self.check_room(1)?;
        let gpu = &self.model.gpu;
        let step = [self.len as u32, self.len as u32 + 1];
        gpu.queue.write_buffer(&self.bufs.step, 0, bytemuck::cast_slice(&step));
        let mut out = Vec::with_capacity(self.forward.len());
        for l in &self.forward {
            let t = std::time::Instant::now();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                l.record(&mut pass, &self.model.kernels);
            }
            gpu.queue.submit([enc.finish()]);
            gpu.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
            out.push((l.kernel, t.elapsed().as_secs_f64() * 1e6));
        }
        self.len += 1;
        gpu.check_fault()?;
        Ok(out)
    }

    /// Copies a session buffer back (tests and diagnostics).
    #[doc(hidden)]
    pub fn debug_logits(&self) -> Result<Vec<f32>> {
        let n = self.model.config.vocab_size;
        let bytes = self.model.gpu.download(&self.bufs.logits, 4 * n)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}
