//! Making the launches over a session's buffers: each kernel family's
//! launch with its bind group and its parameters in a shared uniform page.

use std::cell::RefCell;

use bytemuck::bytes_of;

use crate::buffers::{padded, SessionBuffers};
use crate::config::ModelConfig;
use crate::converted::WeightFormat;
use crate::gpu::{Gpu, UniformPages};
use crate::gpu_weights::GpuMatrix;
use crate::kernels::matmul::staged_bytes;
#[cfg(doc)]
use crate::kernels::MatvecSplit;
use crate::kernels::{
    attention, decode_bindings, grid, EmbedParams, HeadParams, Kernel, Kernels, Launch, MatvecParams,
    MatvecShape, MatvecVariant, WG,
};

/// What a matvec computes from `x` (each is one `int8_matvec` variant, over
/// the matrix's [`WeightFormat`](crate::WeightFormat)):
/// `y += W x` (the residual add), `y = W rms_norm(x)`, or
/// `y = silu(gate) * up` with `[gate; up] = W rms_norm(x)` (W's rows
/// interleave gate and up). The buffers are the RMSNorm weights.
pub(super) enum Matvec<'a> {
    Accumulate,
    Normed(&'a wgpu::Buffer),
    NormedSwiglu(&'a wgpu::Buffer),
}

/// Makes launches over the session's buffers (their parameters packed in
/// shared uniform buffers).
pub(super) struct Builder<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) kernels: &'a Kernels,
    pub(super) cfg: &'a ModelConfig,
    pub(super) s: &'a SessionBuffers,
    pub(super) uniforms: RefCell<UniformPages>,
    /// Where cooperative-matrix prompt batches stage their operands as f16
    /// (the model's: [`GpuWeights::staging`](crate::gpu_weights::GpuWeights::staging)).
    pub(super) staging: Option<wgpu::Buffer>,
}

/// A launch's parameters: a range of a shared uniform page.
struct UniformSlot {
    page: wgpu::Buffer,
    offset: u64,
    size: u64,
}

impl UniformSlot {
    fn binding(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.page,
            offset: self.offset,
            size: wgpu::BufferSize::new(self.size),
        })
    }
}

pub(super) fn whole(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    b.as_entire_binding()
}

/// The session's region of a K or V cache buffer.
fn kv_range<'a>(s: &SessionBuffers, b: &'a wgpu::Buffer) -> wgpu::BindingResource<'a> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer: b,
        offset: s.kv_offset,
        size: wgpu::BufferSize::new(s.kv_bytes),
    })
}

impl Builder<'_> {
    /// A launch of `kernel` (over the session's KV cache format, where it
    /// reads the cache).
    pub(super) fn launch(
        &self,
        kernel: Kernel,
        params: &[u8],
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: [u32; 3],
    ) -> Launch {
        let page = self.uniform(params);
        let mut all = vec![page.binding()];
        all.extend_from_slice(buffers);
        let formats = (WeightFormat::Int8, self.s.kv_layout.format);
        Launch::new_in(self.gpu, self.kernels, kernel, formats, &all, workgroups)
    }

    /// `params` in the shared uniform pages.
    fn uniform(&self, params: &[u8]) -> UniformSlot {
        let (page, offset, size) = self.uniforms.borrow_mut().push(self.gpu, params);
        UniformSlot { page, offset, size }
    }

    /// x = embed[token], one launch per bound chunk of the table (only the
    /// chunk holding the token writes).
    pub(super) fn embed(&self, table: &GpuMatrix, step: &wgpu::Buffer) -> Vec<Launch> {
        let s = self.s;
        table
            .chunks
            .iter()
            .map(|c| {
                let p = EmbedParams {
                    k_words: table.k_words as u32,
                    groups: table.groups as u32,
                    row_start: c.row_start as u32,
                    row_end: (c.row_start + c.rows) as u32,
                };
                let bufs = [
                    whole(step),
                    whole(&s.tokens),
                    table.data_range(c),
                    table.scales_range(c),
                    whole(&s.x),
                    whole(&s.x16),
                ];
                self.launch(
                    Kernel::EmbedLookup,
                    bytes_of(&p),
                    &bufs,
                    grid((table.k_words as u32).div_ceil(WG)),
                )
            })
            .collect()
    }

    /// One matvec (see [`Matvec`]), one launch per bound row chunk of W.
    pub(super) fn matvec(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        what: Matvec<'_>,
    ) -> Vec<Launch> {
        self.matvec_padded(w, x, y, what, true)
    }

    /// [`Self::matvec`] whose decode launch reads x as f32 even where
    /// decode steps read the residual's f16 copy ([`MatvecSplit::x16`]):
    /// the LM head over a prompt batch's last row.
    pub(super) fn matvec_f32_input(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        what: Matvec<'_>,
    ) -> Vec<Launch> {
        self.matvec_padded(w, x, y, what, false)
    }

    /// [`Self::matvec`]; `x16` as [`Self::matvec_with`]'s.
    fn matvec_padded(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        what: Matvec<'_>,
        x16: bool,
    ) -> Vec<Launch> {
        // Every activation buffer holds one row per token, padded to the
        // quant group (what a consuming matvec's k_words expects).
        let outputs = if matches!(what, Matvec::NormedSwiglu(_)) { w.rows / 2 } else { w.rows };
        self.matvec_with(w, x, y, what, padded(outputs), x16).into_iter().map(|(l, _)| l).collect()
    }

    /// [`Self::matvec`] with token z's output at `y[z * y_stride ..]`, each
    /// launch with its shape.
    pub(super) fn matvec_strided(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        what: Matvec<'_>,
        y_stride: usize,
    ) -> Vec<(Launch, MatvecShape)> {
        self.matvec_with(w, x, y, what, y_stride, true)
    }

    /// [`Self::matvec_strided`]; `x16`: whether its decode launch may read
    /// the f16 copy where the layout keeps one.
    fn matvec_with(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        what: Matvec<'_>,
        y_stride: usize,
        x16: bool,
    ) -> Vec<(Launch, MatvecShape)> {
        let (kernel, variant, norm) = match what {
            Matvec::Accumulate => (Kernel::Int8MatvecAccumulate, MatvecVariant::ACCUMULATE, None),
            Matvec::Normed(n) => (Kernel::Int8MatvecNorm, MatvecVariant::NORM, Some(n)),
            Matvec::NormedSwiglu(n) => (Kernel::Int8MatvecNormSwiglu, MatvecVariant::NORM_SWIGLU, Some(n)),
        };
        // The kernel table's variant (every test run checks the two agree).
        debug_assert_eq!(kernel.matvec_variant(), Some(variant));
        w.chunks
            .iter()
            .map(|c| {
                let p = MatvecParams {
                    rows: c.rows as u32,
                    k_words: w.k_words as u32,
                    groups: w.groups as u32,
                    row_offset: c.row_start as u32,
                    n_in: w.cols as u32,
                    eps: self.cfg.rms_norm_eps,
                    y_stride: y_stride as u32,
                };
                let uniform = self.uniform(bytes_of(&p));
                // Without a norm the norm_w slot is never read: bind x there.
                let bufs = [
                    uniform.binding(),
                    whole(x),
                    w.data_range(c),
                    w.scales_range(c),
                    whole(y),
                    whole(norm.unwrap_or(x)),
                    whole(&self.s.x16),
                ];
                let mut split = self.kernels.matvec_layout.split_for(variant, w.rows, w.k_words, w.format);
                split.x16 &= x16;
                let shape = MatvecShape { rows: p.rows, k_words: p.k_words, groups: p.groups, n_in: p.n_in };
                // A paired split's pipeline, or its unpaired split's (whose
                // grid the default pipeline shares) where it is not available.
                let mut decode_pipeline =
                    self.kernels.matvec_pipeline(self.gpu, kernel, split, shape, w.format);
                if decode_pipeline.is_none() && split.paired {
                    split = split.unpaired();
                    decode_pipeline = self.kernels.matvec_pipeline(self.gpu, kernel, split, shape, w.format);
                }
                let groups = (c.rows as u32).div_ceil(split.rows_per_wg);
                let mut l = Launch::new_for(self.gpu, self.kernels, kernel, w.format, &bufs, grid(groups));
                // The staging buffer holds every layer matrix's operands;
                // the LM head's (whose batches are one token) may not fit.
                let tokens = self.s.batch as u32;
                let fits = |st: &wgpu::Buffer| st.size() >= staged_bytes(c.rows, w.k_words, tokens as usize);
                if let (true, Some(st)) = (
                    l.can_stage() && p.rows >= self.kernels.coop_min_rows,
                    self.staging.as_ref().filter(|st| fits(st)),
                ) {
                    l = l.with_staging(self.gpu, self.kernels, &bufs, st, p.rows, p.k_words, tokens);
                }
                l.matvec_split = Some(split);
                l.decode_pipeline = decode_pipeline;
                if let Some(decode) = decode_bindings(variant, split.x16, bufs.clone()) {
                    l = l.with_decode_bindings(self.gpu, self.kernels, &decode);
                }
                if let Some(rows_per_wg) = l.tiled_rows_per_wg() {
                    l.prefill_workgroups = grid((c.rows as u32).div_ceil(rows_per_wg));
                }
                (l, shape)
            })
            .collect()
    }

    fn head_params(&self) -> HeadParams {
        HeadParams {
            n_heads: self.cfg.num_attention_heads as u32,
            n_kv_heads: self.cfg.num_key_value_heads as u32,
            head_dim: self.cfg.head_dim as u32,
            capacity: self.s.capacity as u32,
            eps: self.cfg.rms_norm_eps,
            qkv_stride: padded(self.cfg.qkv_rows()) as u32,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
            pack: attention::heads_per_workgroup(self.cfg.num_attention_heads, self.cfg.num_key_value_heads),
            pack_from: self.kernels.attention_pack_from,
        }
    }

    /// q = rope(rms_norm(q) * q_norm); k_cache[pos] = rope(rms_norm(k) *
    /// k_norm); v_cache[pos] = v. One workgroup per q, k and v head.
    pub(super) fn qk_norm_rope(&self, qk_norm: &wgpu::Buffer, layer: usize) -> Launch {
        let s = self.s;
        let heads = (self.cfg.num_attention_heads + 2 * self.cfg.num_key_value_heads) as u32;
        let bufs = [
            whole(&s.step),
            whole(&s.qkv),
            whole(qk_norm),
            whole(&s.rope),
            whole(&s.q),
            kv_range(s, &s.k_cache[layer]),
            kv_range(s, &s.v_cache[layer]),
        ];
        self.launch(Kernel::QkNormRope, bytes_of(&self.head_params()), &bufs, grid(heads))
    }

    /// attn = softmax(q k^T / sqrt(head_dim)) v over the cached positions,
    /// one workgroup per (head, chunk of positions): `kernel` is an
    /// `attention_partial` variant (prompt batches read q normed and
    /// rotated; decode steps read the qkv output and do that themselves).
    /// The direct variant runs one chunk and writes `attn`; the others
    /// cover the capacity and leave the chunks to [`Self::attention_reduce`].
    pub(super) fn attention(&self, kernel: Kernel, qk_norm: &wgpu::Buffer, layer: usize) -> Launch {
        self.attention_with_step(kernel, qk_norm, layer, &self.s.step)
    }

    /// [`Self::attention`] reading its position(s) from `step` (a batch's
    /// rows: see `attention_common.wgsl`).
    pub(super) fn attention_with_step(
        &self,
        kernel: Kernel,
        qk_norm: &wgpu::Buffer,
        layer: usize,
        step: &wgpu::Buffer,
    ) -> Launch {
        let s = self.s;
        let (fused, direct) = kernel.attention_variant().expect("an attention_partial variant");
        let bufs = [
            whole(step),
            whole(if fused { &s.qkv } else { &s.q }),
            kv_range(s, &s.k_cache[layer]),
            kv_range(s, &s.v_cache[layer]),
            whole(&s.attn_ml),
            whole(if direct { &s.attn } else { &s.attn_acc }),
            whole(qk_norm),
            whole(&s.rope),
        ];
        let chunks = if direct { 1 } else { s.attention_chunks as u32 };
        let heads = self.cfg.num_attention_heads as u32;
        let launch = self.launch(kernel, bytes_of(&self.head_params()), &bufs, [heads, chunks, 1]);
        if kernel != Kernel::AttentionPartial {
            return launch;
        }
        let (prompt, tokens) = self.kernels.attention_prefill_for(s.kv_layout.format, self.cfg.head_dim);
        launch.with_prompt_pipeline(prompt, tokens)
    }

    /// Combines the chunks of an attention launch into `attn`, one
    /// workgroup per head.
    pub(super) fn attention_reduce(&self) -> Launch {
        let s = self.s;
        let p = [self.cfg.head_dim as u32, s.attention_chunks as u32, padded(self.cfg.q_dim()) as u32];
        let bufs = [whole(&s.attn_ml), whole(&s.attn_acc), whole(&s.attn)];
        let heads = self.cfg.num_attention_heads as u32;
        self.launch(Kernel::AttentionReduce, bytemuck::cast_slice(&p), &bufs, grid(heads))
    }
}
