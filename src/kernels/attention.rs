//! The attention family: `attention_partial` (GQA attention split over
//! chunks of positions; variants for a prompt batch, a decode step with
//! `qk_norm_rope`'s work folded in, and a decode step whose context fits one
//! chunk and so writes the output itself), its prompt-batch pipeline
//! `attention_prefill`, and `attention_reduce`, which combines the chunks.

use super::abi::{gpu_struct, ATTENTION_KEY_LANES, MAX_HEAD_DIM};
use super::matmul::MATMUL_TOKENS_PER_WG;
use super::{Bind, Kernel, WG};
use crate::error::Result;

gpu_struct! {
    /// The uniform of `qk_norm_rope` and the `attention_partial` variants.
    "Params" pub struct HeadParams {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub head_dim: u32,
        pub capacity: u32,
        /// rms_norm_eps of the q/k norms.
        pub eps: f32,
        /// qk_norm_rope: elements between consecutive tokens' qkv rows.
        pub qkv_stride: u32,
        /// The softmax scale, 1/sqrt(head_dim).
        pub scale: f32,
    }
}

gpu_struct! {
    /// The uniform of `attention_reduce`.
    "Params" pub struct ReduceParams {
        pub head_dim: u32,
        /// Chunks of positions per head and token.
        pub n_chunks: u32,
        /// Elements between consecutive tokens' outputs.
        pub out_stride: u32,
    }
}

/// Binding order of the `attention_partial` variants (and
/// `attention_prefill`): params, step, q (or qkv), k_cache, v_cache,
/// part_ml, part_acc (or the output), qk_norm, rope: 8 storage buffers at
/// most, the default limit (a host application's device).
pub const PARTIAL_BINDINGS: &[Bind] = &[
    Bind::Uniform,
    Bind::Read,
    Bind::Read,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::Read,
    Bind::Read,
];

/// Binding order of `attention_reduce`: params, part_ml, part_acc, out.
pub const REDUCE_BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::Read, Bind::ReadWrite];

/// The grid of an `attention_partial` launch: one workgroup per query head
/// and chunk of [`ATTENTION_CHUNK`] positions (`z`: tokens of a batch).
pub fn partial_grid(n_heads: u32, chunks: u32) -> [u32; 3] {
    [n_heads, chunks, 1]
}

/// Workgroup size of `attention_reduce`: one invocation per output dim
/// (head_dim <= 256: two passes at most) and per chunk in its reductions.
pub const REDUCE_WG: u32 = 128;
const _: () = assert!(REDUCE_WG.is_power_of_two());

/// The grid of an `attention_reduce` launch: one workgroup per query head
/// (`z`: tokens of a batch).
pub fn reduce_grid(n_heads: u32) -> [u32; 3] {
    super::grid(n_heads)
}

/// What the attention kernels share (bindings, f16 unpacking), prepended to
/// `attention_partial` and `attention_prefill`.
pub(super) const ATTENTION_COMMON: &str = include_str!("../../kernels/wgsl/attention_common.wgsl");

/// Cached positions per `attention_partial` workgroup (one per invocation).
pub const ATTENTION_CHUNK: u32 = WG;
/// head_dim must be a multiple of this: attention_partial reads a K row as
/// `vec4<u32>`s (8 f16 values each).
pub const HEAD_DIM_MULTIPLE: usize = 8;
// attention_partial's last step gives each output dim an invocation.
const _: () = assert!(MAX_HEAD_DIM <= WG as usize);
// attention_partial's scores: WG / ATTENTION_KEY_LANES K rows per pass, and
// each position's partial dots fit its 8 floats of workgroup memory.
const _: () = assert!(WG.is_multiple_of(ATTENTION_KEY_LANES) && ATTENTION_KEY_LANES <= 8);

/// The environment variable that picks [`PrefillAttentionTokens`]: `4`, `8`
/// or `16`.
pub const PREFILL_ATTENTION_TOKENS_ENV: &str = "QWEN3_WGPU_PREFILL_ATTENTION_TOKENS";

/// Prompt tokens one `attention_prefill` workgroup serves (its `TOKENS`):
/// each K and V row it reads serves that many queries. Every value
/// computes each token's results with the same operations in the same
/// order (bit for bit the same on lavapipe, tests/kernels.rs); they differ
/// in memory traffic and registers only. Workgroup memory is the same for
/// all (8 KB at [`WG`] = 256, plus the reduction prelude's 5 KB): q and
/// exp(s - m) pass through it a piece at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillAttentionTokens(u32);

impl PrefillAttentionTokens {
    /// Four tokens per workgroup (one vec4 of them): each K/V row is read
    /// 64 times per 256-token batch.
    pub const FOUR: Self = PrefillAttentionTokens(4);
    /// Eight: half the K/V reads of four, 64 accumulator floats per
    /// invocation (four: 32), q of a head_dim up to 256 in one piece.
    pub const EIGHT: Self = PrefillAttentionTokens(8);
    /// Sixteen: a quarter of the K/V reads of four, but 128 accumulator
    /// floats per invocation (fewer workgroups resident) and q in pieces
    /// of 128 dims.
    pub const SIXTEEN: Self = PrefillAttentionTokens(16);
    /// The default: half the K/V traffic of four at half sixteen's
    /// accumulator registers.
    pub const DEFAULT: Self = Self::EIGHT;

    /// Every value, by its name in [`PREFILL_ATTENTION_TOKENS_ENV`].
    pub const ALL: [(&'static str, Self); 3] = [("4", Self::FOUR), ("8", Self::EIGHT), ("16", Self::SIXTEEN)];

    /// The value [`PREFILL_ATTENTION_TOKENS_ENV`] names: `None` when it is
    /// unset or empty, an `invalid_argument` error when it names none.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(PREFILL_ATTENTION_TOKENS_ENV, &Self::ALL)
    }

    /// Tokens per workgroup.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for PrefillAttentionTokens {
    fn default() -> Self {
        Self::DEFAULT
    }
}

// attention_prefill carries its tokens in vec4s, and its q pieces (WG /
// TOKENS K loads each) are whole multiples of its four loads at a time. A
// last partial group computes tokens past the batch from the rows past it:
// the session's batch buffers hold whole tiles of the tiled matmul's tokens.
const _: () = {
    let mut i = 0;
    while i < PrefillAttentionTokens::ALL.len() {
        let tokens = PrefillAttentionTokens::ALL[i].1 .0;
        assert!(tokens.is_multiple_of(4) && WG.is_multiple_of(tokens) && (WG / tokens).is_multiple_of(4));
        assert!(MATMUL_TOKENS_PER_WG.is_multiple_of(tokens));
        i += 1;
    }
};

/// Which `attention_partial` variant (its override constants; see the
/// kernel's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionVariant {
    /// q read raw from the qkv output, normed and rotated here, and the new
    /// position's K/V written (a decode step).
    pub fused: bool,
    /// One chunk, the output written directly (no reduce).
    pub direct: bool,
}

impl AttentionVariant {
    pub const PROMPT: Self = AttentionVariant { fused: false, direct: false };
    pub const STEP: Self = AttentionVariant { fused: true, direct: false };
    pub const STEP_DIRECT: Self = AttentionVariant { fused: true, direct: true };
}

/// The override constants of an `attention_partial` pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionConstants {
    pub variant: AttentionVariant,
    /// `ROWS`: a batch of sessions' decode steps, row z in grid z, with the
    /// output's row stride (`OUT_STRIDE`, elements); `None`: one token or
    /// a prompt batch.
    pub rows_out_stride: Option<u32>,
}

impl AttentionConstants {
    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut c = vec![
            ("WG", WG as f64),
            ("FUSED", flag(self.variant.fused)),
            ("DIRECT", flag(self.variant.direct)),
        ];
        if let Some(stride) = self.rows_out_stride {
            c.extend([("ROWS", 1.0), ("OUT_STRIDE", stride as f64)]);
        }
        c
    }
}

/// The WGSL and override constants of `attention_prefill`, the
/// prompt-batch pipeline of [`Kernel::AttentionPartial`]: `tokens` tokens
/// per workgroup, on its bind-group layout.
pub fn attention_prefill_source(
    subgroups: bool,
    tokens: PrefillAttentionTokens,
) -> (String, Vec<(&'static str, f64)>) {
    let k = Kernel::AttentionPartial;
    let body = write_out_loops(include_str!("../../kernels/wgsl/attention_prefill.wgsl"), tokens.get());
    let src = format!("const TOKENS: u32 = {}u;\n{}", tokens.get(), k.source_with(subgroups, &body));
    (src, vec![("WG", k.workgroup_size() as f64)])
}

/// `body` with each line `// for # in GROUPS: code` (or `TOKENS`) written
/// out as `code` once per group of 4 tokens (or token), `#` standing for
/// its index: attention_prefill's loops whose bodies hold barriers, which
/// a compiler might keep as loops and so index its per-token arrays at run
/// time (in memory rather than registers).
fn write_out_loops(body: &str, tokens: u32) -> String {
    let mut out = String::with_capacity(body.len() + 2048);
    for line in body.lines() {
        let code = line.trim_start();
        let indent = &line[..line.len() - code.len()];
        let loop_of = [("GROUPS", tokens / 4), ("TOKENS", tokens)]
            .into_iter()
            .find_map(|(name, count)| Some((code.strip_prefix(&format!("// for # in {name}: "))?, count)));
        match loop_of {
            Some((code, count)) => {
                for i in 0..count {
                    out.push_str(&format!("{indent}{}\n", code.replace('#', &i.to_string())));
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}
