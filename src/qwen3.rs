//! The Qwen3 decoder forward pass for one token, as the list of kernel
//! launches the GPU runs in order (mirrors mlx-lm's `qwen3.py`):
//!
//! ```text
//! x = embed(token)
//! for each layer:
//!     q, k, v = split(qkv_proj(rms_norm(x, input_norm)))     # norm fused into the matvec
//!     q, k = rope(rms_norm(q, q_norm)), rope(rms_norm(k, k_norm)); cache k, v
//!     x += o_proj(attention(q, k_cache, v_cache))            # add fused into the matvec
//!     h = silu(gate) * up, [gate; up] = gate_up_proj(rms_norm(x, post_attention_norm))   # one launch
//!     x += down(h)
//! token = argmax(lm_head(rms_norm(x, norm)))   # on the GPU; feeds the next step
//! ```
//! Built once per session. The position lives on the GPU (`step`, advanced
//! by the argmax), so the same launches run every token and steps can be
//! queued without the host reading anything in between.

use bytemuck::{bytes_of, Pod, Zeroable};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::kernels::{grid, Kernel, Kernels, Launch, ARGMAX_CHUNK, WG};
use crate::model::{GpuMatrix, GpuWeights};
use crate::session::{padded, SessionBuffers};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MatvecParams {
    rows: u32,
    k_words: u32,
    groups: u32,
    row_offset: u32,
    n_in: u32,
    eps: f32,
    /// Elements between consecutive tokens' outputs (batched prefill).
    y_stride: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct HeadParams {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    /// rms_norm_eps for qk_norm_rope, the softmax scale for attention.
    eps_or_scale: f32,
    /// qk_norm_rope: elements between consecutive tokens' qkv rows.
    qkv_stride: u32,
}

/// RoPE's (cos, sin) for every position below `capacity` and frequency
/// `d < head_dim / 2` (angle `pos * theta^(-2d/head_dim)`), computed in f64.
pub fn rope_table(head_dim: usize, capacity: usize, theta: f32) -> Vec<f32> {
    let half = head_dim / 2;
    let mut t = Vec::with_capacity(capacity * head_dim);
    for pos in 0..capacity {
        for d in 0..half {
            let a = pos as f64 * (theta as f64).powf(-((2 * d) as f64) / head_dim as f64);
            t.push(a.cos() as f32);
            t.push(a.sin() as f32);
        }
    }
    t
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct EmbedParams {
    k_words: u32,
    groups: u32,
    row_start: u32,
    row_end: u32,
}

/// The launches of one decode step, in order. `launches[..layers_end]`
/// (embedding and decoder layers) also run batched over several prompt
/// tokens (`Launch::record_batch`: token z of the batch in grid z, at
/// position `step.pos + z`); the rest (final norm, LM head, argmax) run for
/// one token.
pub struct Forward {
    pub launches: Vec<Launch>,
    pub layers_end: usize,
}

/// Builds the launches of one decode step over `weights` and the session
/// buffers `s`.
pub fn forward(
    gpu: &Gpu,
    kernels: &Kernels,
    cfg: &ModelConfig,
    weights: &GpuWeights,
    s: &SessionBuffers,
) -> Result<Forward> {
    use Matvec::{Accumulate, Normed, NormedSwiglu};
    let mut b = Builder { gpu, kernels, cfg, s, launches: Vec::new() };
    b.embed(&weights.embed)?;
    for (l, layer) in weights.layers.iter().enumerate() {
        b.matvec(&layer.qkv, &s.x, &s.qkv, Normed(&layer.input_norm))?;
        b.qk_norm_rope(&layer.q_norm, &layer.k_norm, l)?;
        b.attention(l)?;
        b.matvec(&layer.o_proj, &s.attn, &s.x, Accumulate)?;
        b.matvec(&layer.gate_up, &s.x, &s.h, NormedSwiglu(&layer.post_norm))?;
        b.matvec(&layer.down, &s.h, &s.x, Accumulate)?;
    }
    let layers_end = b.launches.len();
    b.matvec(weights.lm_head(), &s.x, &s.logits, Normed(&weights.final_norm))?;
    b.argmax()?;
    Ok(Forward { launches: b.launches, layers_end })
}

/// What a matvec computes from `x` (each is one `int8_matvec` variant):
/// `y += W x` (the residual add), `y = W rms_norm(x)`, or
/// `y = silu(gate) * up` with `[gate; up] = W rms_norm(x)` (W's rows
/// interleave gate and up). The buffers are the RMSNorm weights.
enum Matvec<'a> {
    Accumulate,
    Normed(&'a wgpu::Buffer),
    NormedSwiglu(&'a wgpu::Buffer),
}

/// Records launches for one forward pass, owning their uniform buffers.
struct Builder<'a> {
    gpu: &'a Gpu,
    kernels: &'a Kernels,
    cfg: &'a ModelConfig,
    s: &'a SessionBuffers,
    launches: Vec<Launch>,
}

fn whole(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    b.as_entire_binding()
}

impl Builder<'_> {
    fn launch(
        &mut self,
        kernel: Kernel,
        params: &[u8],
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: u32,
    ) -> Result<()> {
        self.launch_grid(kernel, params, buffers, grid(workgroups))
    }

    fn launch_grid(
        &mut self,
        kernel: Kernel,
        params: &[u8],
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: [u32; 3],
    ) -> Result<()> {
        let u = self.gpu.uniform(kernel.entry(), params)?;
        let mut all = vec![whole(&u)];
        all.extend_from_slice(buffers);
        self.launches.push(Launch::new(self.gpu, self.kernels, kernel, &all, workgroups));
        Ok(())
    }

    /// x = embed[token], one launch per bound chunk of the table (only the
    /// chunk holding the token writes).
    fn embed(&mut self, table: &GpuMatrix) -> Result<()> {
        for c in &table.chunks {
            let p = EmbedParams {
                k_words: table.k_words as u32,
                groups: table.groups as u32,
                row_start: c.row_start as u32,
                row_end: (c.row_start + c.rows) as u32,
            };
            let s = self.s;
            let bufs =
                [whole(&s.step), whole(&s.tokens), table.data_range(c), table.scales_range(c), whole(&s.x)];
            self.launch(Kernel::EmbedLookup, bytes_of(&p), &bufs, (table.k_words as u32).div_ceil(WG))?;
        }
        Ok(())
    }

    /// One matvec (see [`Matvec`]), one launch per bound row chunk of W.
    fn matvec(&mut self, w: &GpuMatrix, x: &wgpu::Buffer, y: &wgpu::Buffer, what: Matvec<'_>) -> Result<()> {
        let (kernel, norm) = match what {
            Matvec::Accumulate => (Kernel::Int8MatvecAccumulate, None),
            Matvec::Normed(n) => (Kernel::Int8MatvecNorm, Some(n)),
            Matvec::NormedSwiglu(n) => (Kernel::Int8MatvecNormSwiglu, Some(n)),
        };
        // Every activation buffer holds one row per token, padded to the
        // quant group (what a consuming matvec's k_words expects).
        let outputs = if kernel == Kernel::Int8MatvecNormSwiglu { w.rows / 2 } else { w.rows };
        let y_stride = padded(outputs);
        for c in &w.chunks {
            let p = MatvecParams {
                rows: c.rows as u32,
                k_words: w.k_words as u32,
                groups: w.groups as u32,
                row_offset: c.row_start as u32,
                n_in: w.cols as u32,
                eps: self.cfg.rms_norm_eps,
                y_stride: y_stride as u32,
            };
            // Without a norm the norm_w slot is never read: bind x there.
            let bufs = [whole(x), w.data_range(c), w.scales_range(c), whole(y), whole(norm.unwrap_or(x))];
            let groups = (c.rows as u32).div_ceil(self.kernels.matvec_layout.rows_per_wg());
            self.launch(kernel, bytes_of(&p), &bufs, groups)?;
        }
        Ok(())
    }

    fn head_params(&self, eps_or_scale: f32) -> HeadParams {
        HeadParams {
            n_heads: self.cfg.num_attention_heads as u32,
            n_kv_heads: self.cfg.num_key_value_heads as u32,
            head_dim: self.cfg.head_dim as u32,
            capacity: self.s.capacity as u32,
            eps_or_scale,
            qkv_stride: padded(self.cfg.qkv_rows()) as u32,
        }
    }

    /// q = rope(rms_norm(q) * q_norm); k_cache[pos] = rope(rms_norm(k) *
    /// k_norm); v_cache[pos] = v. One workgroup per q, k and v head.
    fn qk_norm_rope(&mut self, q_norm: &wgpu::Buffer, k_norm: &wgpu::Buffer, layer: usize) -> Result<()> {
        let s = self.s;
        let p = self.head_params(self.cfg.rms_norm_eps);
        let heads = (self.cfg.num_attention_heads + 2 * self.cfg.num_key_value_heads) as u32;
        let bufs = [
            whole(&s.step),
            whole(&s.qkv),
            whole(q_norm),
            whole(k_norm),
            whole(&s.rope),
            whole(&s.q),
            whole(&s.k_cache[layer]),
            whole(&s.v_cache[layer]),
        ];
        self.launch(Kernel::QkNormRope, bytes_of(&p), &bufs, heads)
    }

    /// attn = softmax(q k^T / sqrt(head_dim)) v over the cached positions:
    /// one workgroup per (head, chunk of positions), then one per head to
    /// combine the chunks.
    fn attention(&mut self, layer: usize) -> Result<()> {
        let s = self.s;
        let heads = self.cfg.num_attention_heads as u32;
        let p = self.head_params(1.0 / (self.cfg.head_dim as f32).sqrt());
        let bufs = [
            whole(&s.step),
            whole(&s.q),
            whole(&s.k_cache[layer]),
            whole(&s.v_cache[layer]),
            whole(&s.attn_ml),
            whole(&s.attn_acc),
        ];
        self.launch_grid(
            Kernel::AttentionPartial,
            bytes_of(&p),
            &bufs,
            [heads, s.attention_chunks as u32, 1],
        )?;
        let p = [self.cfg.head_dim as u32, s.attention_chunks as u32, padded(self.cfg.q_dim()) as u32];
        let bufs = [whole(&s.attn_ml), whole(&s.attn_acc), whole(&s.attn)];
        self.launch(Kernel::AttentionReduce, bytemuck::cast_slice(&p), &bufs, heads)
    }

    /// tokens[pos + 1] = argmax(logits), ties to the lowest id: per-chunk,
    /// then final (which also advances the position).
    fn argmax(&mut self) -> Result<()> {
        let s = self.s;
        let n = self.cfg.vocab_size as u32;
        let parts = n.div_ceil(ARGMAX_CHUNK);
        let bufs = [whole(&s.logits), whole(&s.part_val), whole(&s.part_idx)];
        self.launch(Kernel::ArgmaxPartial, bytemuck::cast_slice(&[n, ARGMAX_CHUNK]), &bufs, parts)?;
        let bufs = [whole(&s.part_val), whole(&s.part_idx), whole(&s.tokens), whole(&s.step)];
        let n_tokens = (s.capacity + 1) as u32;
        self.launch(Kernel::ArgmaxFinal, bytemuck::cast_slice(&[parts, n_tokens]), &bufs, 1)
    }
}
