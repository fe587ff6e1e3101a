//! The Qwen3 decoder forward pass for one token, as the list of kernel
//! launches the GPU runs in order (mirrors mlx-lm's `qwen3.py`):
//!
//! ```text
//! x = embed(token)
//! for each layer:
//!     q, k, v = split(qkv_proj(rms_norm(x, input_norm)))     # norm fused into the matvec
//!     q, k = rope(rms_norm(q, q_norm)), rope(rms_norm(k, k_norm)); cache k, v
//!     x += o_proj(attention(q, k_cache, v_cache))            # add fused into the matvec
//!     g, u = split(gate_up_proj(rms_norm(x, post_attention_norm)))
//!     x += down(silu(g) * u)
//! token = argmax(lm_head(rms_norm(x, norm)))   # on the GPU; feeds the next step
//! ```
//! Built once per session: only the `step` uniform (the position) changes
//! between tokens.

use bytemuck::{bytes_of, Pod, Zeroable};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::kernels::{Kernel, Kernels, Launch, ARGMAX_CHUNK, WG};
use crate::model::{GpuMatrix, GpuWeights};
use crate::session::SessionBuffers;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MatvecParams {
    rows: u32,
    k_words: u32,
    groups: u32,
    row_offset: u32,
    n_in: u32,
    eps: f32,
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

/// Records launches for one forward pass, owning their uniform buffers.
struct Builder<'a> {
    gpu: &'a Gpu,
    kernels: &'a Kernels,
    /// rms_norm_eps of the fused input norms.
    eps: f32,
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
        let u = self.gpu.uniform(kernel.entry(), params)?;
        let mut all = vec![whole(&u)];
        all.extend_from_slice(buffers);
        self.launches.push(Launch::new(
            self.gpu,
            self.kernels,
            kernel,
            &all,
            workgroups,
        ));
        Ok(())
    }

    /// y = W x, y += W x (`accumulate`), or y = W rms_norm(x) (`norm`: the
    /// norm weight); one launch per bound row chunk.
    fn matvec(
        &mut self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        accumulate: bool,
        norm: Option<&wgpu::Buffer>,
    ) -> Result<()> {
        let kernel = Kernel::matvec_for(w.rows, accumulate, norm.is_some(), self.gpu);
        for c in &w.chunks {
            let p = MatvecParams {
                rows: c.rows as u32,
                k_words: w.k_words as u32,
                groups: w.groups as u32,
                row_offset: c.row_start as u32,
                n_in: w.cols as u32,
                eps: self.eps,
            };
            // Without a norm the norm_w slot is never read: bind x there.
            let bufs = [
                whole(x),
                w.data_range(c),
                w.scales_range(c),
                whole(y),
                whole(norm.unwrap_or(x)),
            ];
            let groups = (c.rows as u32).div_ceil(kernel.matvec_rows());
            self.launch(kernel, bytes_of(&p), &bufs, groups)?;
        }
        Ok(())
    }
}

/// Builds the launches of one decode step over `weights` and `s`.
pub fn forward(
    gpu: &Gpu,
    kernels: &Kernels,
    cfg: &ModelConfig,
    weights: &GpuWeights,
    s: &SessionBuffers,
) -> Result<Vec<Launch>> {
    let mut b = Builder {
        gpu,
        kernels,
        eps: cfg.rms_norm_eps,
        launches: Vec::new(),
    };

    for c in &weights.embed.chunks {
        let p = EmbedParams {
            k_words: weights.embed.k_words as u32,
            groups: weights.embed.groups as u32,
            row_start: c.row_start as u32,
            row_end: (c.row_start + c.rows) as u32,
        };
        let bufs = [
            whole(&s.token),
            weights.embed.data_range(c),
            weights.embed.scales_range(c),
            whole(&s.x),
        ];
        b.launch(
            Kernel::EmbedLookup,
            bytes_of(&p),
            &bufs,
            (weights.embed.k_words as u32).div_ceil(WG),
        )?;
    }

    let n_qkv_heads = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) as u32;
    for (l, layer) in weights.layers.iter().enumerate() {
        b.matvec(&layer.qkv, &s.x, &s.qkv, false, Some(&layer.input_norm))?;
        let rope = HeadParams {
            n_heads: cfg.num_attention_heads as u32,
            n_kv_heads: cfg.num_key_value_heads as u32,
            head_dim: cfg.head_dim as u32,
            capacity: s.capacity as u32,
            eps_or_scale: cfg.rms_norm_eps,
        };
        let bufs = [
            whole(&s.step),
            whole(&s.qkv),
            whole(&layer.q_norm),
            whole(&layer.k_norm),
            whole(&s.rope),
            whole(&s.q),
            whole(&s.k_cache[l]),
            whole(&s.v_cache[l]),
        ];
        b.launch(Kernel::QkNormRope, bytes_of(&rope), &bufs, n_qkv_heads)?;
        let attn = HeadParams {
            eps_or_scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            ..rope
        };
        let bufs = [
            whole(&s.step),
            whole(&s.q),
            whole(&s.k_cache[l]),
            whole(&s.v_cache[l]),
            whole(&s.scores),
            whole(&s.attn),
        ];
        b.launch(
            Kernel::GqaAttention,
            bytes_of(&attn),
            &bufs,
            cfg.num_attention_heads as u32,
        )?;
        b.matvec(&layer.o_proj, &s.attn, &s.x, true, None)?;
        b.matvec(
            &layer.gate_up,
            &s.x,
            &s.gate_up,
            false,
            Some(&layer.post_norm),
        )?;
        let n = cfg.intermediate_size as u32;
        b.launch(
            Kernel::Swiglu,
            bytes_of(&n),
            &[whole(&s.gate_up), whole(&s.h)],
            n.div_ceil(WG),
        )?;
        b.matvec(&layer.down, &s.h, &s.x, true, None)?;
    }

    b.matvec(
        weights.lm_head(),
        &s.x,
        &s.logits,
        false,
        Some(&weights.final_norm),
    )?;
    let n = cfg.vocab_size as u32;
    let parts = n.div_ceil(ARGMAX_CHUNK);
    let bufs = [whole(&s.logits), whole(&s.part_val), whole(&s.part_idx)];
    b.launch(
        Kernel::ArgmaxPartial,
        bytemuck::cast_slice(&[n, ARGMAX_CHUNK]),
        &bufs,
        parts,
    )?;
    let bufs = [whole(&s.part_val), whole(&s.part_idx), whole(&s.token)];
    b.launch(Kernel::ArgmaxFinal, bytes_of(&parts), &bufs, 1)?;
    Ok(b.launches)
}
