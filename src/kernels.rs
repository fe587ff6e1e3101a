//! The kernel table: each WGSL kernel's source, entry point, binding order
//! and workgroup size, defined once here and used by the pipeline builder,
//! the model and the tests (a test checks the WGSL declares exactly these
//! bindings).

use crate::converted::QUANT_GROUP;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// How a kernel binds one buffer (binding index = position in the list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bind {
    Uniform,
    Read,
    ReadWrite,
}

/// The pattern matching every `int8_matvec` variant (one list, used by
/// each per-kernel table below).
macro_rules! matvec_kernels {
    () => {
        Kernel::Int8MatvecAccumulate | Kernel::Int8MatvecNorm | Kernel::Int8MatvecNormSwiglu
    };
}

/// The pattern matching every `attention_partial` variant.
macro_rules! attention_kernels {
    () => {
        Kernel::AttentionPartial | Kernel::AttentionStep | Kernel::AttentionStepDirect
    };
}

/// How `int8_matvec` splits its work, chosen once per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatvecLayout {
    /// Each subgroup takes blocks of [`MATVEC_ROWS_PER_TEAM`] rows, no
    /// barriers ([`MATVEC_ROWS`] rows per workgroup): Apple GPUs (the
    /// layout of the MSL twin), CPU adapters, and devices without subgroups.
    RowsPerTeam,
    /// The whole workgroup takes [`SPLIT_K_ROWS`] rows and splits K, then
    /// one workgroup reduction: more workgroups in flight for the small
    /// layer matrices on GPUs with many cores.
    SplitK,
}

/// Environment variable that overrides the matvec layout (`rows` or
/// `split`), for benchmarks.
pub const MATVEC_LAYOUT_ENV: &str = "QWEN3_WGPU_MATVEC_LAYOUT";

impl MatvecLayout {
    /// The names [`Self::from_name`] accepts: `rows` and `split`.
    pub const NAMES: [(&'static str, MatvecLayout); 2] =
        [("rows", MatvecLayout::RowsPerTeam), ("split", MatvecLayout::SplitK)];

    /// The layout named `rows` or `split`; anything else is
    /// `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        crate::settings::parse_choice(what, value, &Self::NAMES)
    }

    /// The layout [`MATVEC_LAYOUT_ENV`] names: `None` when it is unset,
    /// `invalid_argument` when it names no layout.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(MATVEC_LAYOUT_ENV, &Self::NAMES)
    }

    /// The layout for a device: split K on discrete and integrated GPUs
    /// other than Apple's, rows per team elsewhere.
    pub fn for_device(info: &wgpu::AdapterInfo) -> Self {
        let many_cores =
            matches!(info.device_type, wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu);
        if many_cores && info.backend != wgpu::Backend::Metal {
            MatvecLayout::SplitK
        } else {
            MatvecLayout::RowsPerTeam
        }
    }

    /// How the decode matvec of a matrix with `rows` rows of `k_words` u32
    /// words runs. Split-K devices run matrices of more than
    /// [`SPLIT_K_MAX_ROWS`] rows (the LM head) rows per team, one subgroup
    /// of [`LONG_MATRIX_WG`] lanes per 4 rows: they have workgroups enough
    /// to fill the GPU without splitting K, and skip its reduction (the
    /// 0.6B LM head on an H200: 63 against 77 µs, BENCHMARKS.md).
    pub fn split(self, rows: usize, k_words: usize) -> MatvecSplit {
        match self {
            MatvecLayout::SplitK if rows > SPLIT_K_MAX_ROWS => MatvecSplit {
                layout: MatvecLayout::RowsPerTeam,
                workgroup_size: LONG_MATRIX_WG,
                rows_per_wg: MATVEC_ROWS_PER_TEAM,
            },
            _ => MatvecSplit {
                layout: self,
                workgroup_size: self.workgroup_size(k_words),
                rows_per_wg: self.rows_per_wg(),
            },
        }
    }

    /// Every split [`Self::split`] can give; the first is that of the
    /// matvec kernels' default pipelines ([`Kernel::constants`]).
    pub fn splits(self) -> Vec<MatvecSplit> {
        let at =
            |workgroup_size| MatvecSplit { layout: self, workgroup_size, rows_per_wg: self.rows_per_wg() };
        match self {
            MatvecLayout::RowsPerTeam => vec![at(MATVEC_WG)],
            MatvecLayout::SplitK => SPLIT_K_WGS
                .into_iter()
                .map(at)
                .chain(std::iter::once(self.split(SPLIT_K_MAX_ROWS + 1, 0)))
                .collect(),
        }
    }

    /// Output rows per workgroup.
    pub fn rows_per_wg(self) -> u32 {
        match self {
            MatvecLayout::RowsPerTeam => MATVEC_ROWS,
            MatvecLayout::SplitK => SPLIT_K_ROWS,
        }
    }

    /// Workgroup size of the decode matvec over rows of `k_words` u32
    /// words: [`MATVEC_WG`] for rows per team; for split K the smallest of
    /// [`SPLIT_K_WGS`] that gives each lane at most one step (16 values) per
    /// row, or the largest. A lane's steps are a chain of dependent memory
    /// round trips: one step each keeps the launch at one round trip.
    pub fn workgroup_size(self, k_words: usize) -> u32 {
        match self {
            MatvecLayout::RowsPerTeam => MATVEC_WG,
            MatvecLayout::SplitK => {
                let steps = (4 * k_words).div_ceil(MATVEC_VALUES_PER_LANE as usize);
                let last = SPLIT_K_WGS[SPLIT_K_WGS.len() - 1];
                SPLIT_K_WGS.into_iter().find(|&w| w as usize >= steps).unwrap_or(last)
            }
        }
    }
}

/// How one matrix's decode matvec splits its work: the layout, the
/// workgroup size and the output rows per workgroup (its pipeline's `SPLIT_K`,
/// `WG` and `ROWS_PER_WG`), from [`MatvecLayout::split`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecSplit {
    pub layout: MatvecLayout,
    pub workgroup_size: u32,
    pub rows_per_wg: u32,
}

/// The shape of one decode matvec launch (a row chunk of a matrix): the
/// `int8_matvec` pipeline specialised with it ([`Kernels::matvec_pipeline`])
/// has it compiled in (its `SHAPE_*` override constants) instead of reading
/// it from the launch's uniform, so its first loads wait on nothing and its
/// index arithmetic folds (a 0.6B step's matvecs on an H200: 671 against
/// 715 µs, BENCHMARKS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatvecShape {
    /// Rows in this launch.
    pub rows: u32,
    /// Padded row length in u32 words.
    pub k_words: u32,
    /// Scales per row.
    pub groups: u32,
    /// Elements of the input (the RMSNorm's count).
    pub n_in: u32,
}

impl MatvecShape {
    /// The `SHAPE_*` override constants (the `int8_common.wgsl` names).
    pub fn constants(self) -> [(&'static str, f64); 4] {
        [
            ("SHAPE_ROWS", self.rows as f64),
            ("SHAPE_K_WORDS", self.k_words as f64),
            ("SHAPE_GROUPS", self.groups as f64),
            ("SHAPE_N_IN", self.n_in as f64),
        ]
    }
}

/// Epilogue of an `int8_matvec` variant (its override constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecVariant {
    /// `y += W x` (fused residual add).
    pub accumulate: bool,
    /// RMSNorm of x fused in (`y = W (x * rsqrt(mean(x^2) + eps) * norm_w)`).
    pub norm: bool,
    /// `y = silu(gate) * up` over a matrix whose rows interleave gate and up.
    pub swiglu: bool,
}

/// One compute kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `y += W x` (fused residual add: o_proj, down).
    Int8MatvecAccumulate,
    /// `y = W rms_norm(x)` (fused input RMSNorm: qkv, the LM head).
    Int8MatvecNorm,
    /// `h = silu(gate) * up` with `[gate; up] = W rms_norm(x)` (the MLP's
    /// gate/up projection, rows interleaved).
    Int8MatvecNormSwiglu,
    QkNormRope,
    /// Attention of a batch of prompt tokens over one chunk of positions
    /// per workgroup (q and the batch's K/V from `QkNormRope`).
    AttentionPartial,
    /// Attention of one decode step over one chunk of positions per
    /// workgroup, with `QkNormRope`'s work for its head folded in.
    AttentionStep,
    /// [`Kernel::AttentionStep`] for a context that fits one chunk: writes
    /// the attention output itself (no `AttentionReduce` launch).
    AttentionStepDirect,
    /// Combines the chunks' softmax statistics into the attention output.
    AttentionReduce,
    EmbedLookup,
    /// Per-chunk argmax of the logits (first of two launches).
    ArgmaxPartial,
    /// Reduces the chunks' results to the token and advances the position.
    ArgmaxFinal,
}

const _: () = {
    let mut i = 0;
    while i < Kernel::ALL.len() {
        assert!(Kernel::ALL[i] as usize == i);
        i += 1;
    }
};

/// Workgroup size of the kernels other than `int8_matvec` (a power of two,
/// as the workgroup-memory reductions need).
pub const WG: u32 = 256;
/// Workgroup size of `int8_matvec`: two 32-wide subgroups on Apple GPUs and
/// NVIDIA, eight 8-wide ones on lavapipe.
pub const MATVEC_WG: u32 = 64;
/// Output rows per `int8_matvec` workgroup (a multiple of
/// [`MATVEC_ROWS_PER_TEAM`]).
pub const MATVEC_ROWS: u32 = 8;
/// Rows one subgroup reduces at once (the kernel's vec4 of partial sums).
pub const MATVEC_ROWS_PER_TEAM: u32 = 4;
/// int8 values one lane reads per row and step (one `vec4<u32>`).
pub const MATVEC_VALUES_PER_LANE: u32 = 16;
/// Prompt tokens one per-token prefill matvec workgroup multiplies at once
/// (the WGSL `TOKENS` override of those prefill pipelines), and the tokens
/// one `attention_prefill` workgroup serves.
pub const PREFILL_TOKENS_PER_WG: u32 = 4;
/// Rows and prompt tokens of one `int8_matmul` tile (the tiled prefill
/// pipelines: MM_ROWS and MM_TOKENS in its preamble); each invocation
/// computes 4 rows x 4 tokens.
pub const MATMUL_ROWS_PER_WG: u32 = 64;
/// The most tokens of any `int8_matmul` tile (see
/// [`Kernel::matmul_tokens_per_wg`]): activation buffers hold a multiple.
pub const MATMUL_TOKENS_PER_WG: u32 = 64;
/// Tokens of the SwiGLU (gate/up) variant's tiles: its 6,144 rows fill an
/// H200 better in twice the workgroups of half the tokens (BENCHMARKS.md).
pub const MATMUL_SWIGLU_TOKENS_PER_WG: u32 = 32;
/// What the attention kernels share (params, bindings, f16 unpacking),
/// prepended to `attention_partial` and `attention_prefill`.
const ATTENTION_COMMON: &str = include_str!("../kernels/wgsl/attention_common.wgsl");
// attention_prefill carries its tokens in vec4s.
const _: () = assert!(PREFILL_TOKENS_PER_WG == 4);

/// The WGSL and override constants of `attention_prefill`, the
/// prompt-batch pipeline of [`Kernel::AttentionPartial`]:
/// [`PREFILL_TOKENS_PER_WG`] tokens per workgroup, on its bind-group layout.
pub fn attention_prefill_source(subgroups: bool) -> (String, Vec<(&'static str, f64)>) {
    let k = Kernel::AttentionPartial;
    let body = include_str!("../kernels/wgsl/attention_prefill.wgsl");
    let src = format!("const TOKENS: u32 = {PREFILL_TOKENS_PER_WG}u;\n{}", k.source_with(subgroups, body));
    (src, vec![("WG", k.workgroup_size() as f64)])
}

/// What the two int8 matrix kernels share (params, bindings, flags, the
/// int8-to-float conversion), prepended to each.
const INT8_COMMON: &str = include_str!("../kernels/wgsl/int8_common.wgsl");

/// Workgroup size of `int8_matmul` for tiles of `tokens` tokens.
pub const fn matmul_wg(tokens: u32) -> u32 {
    (MATMUL_ROWS_PER_WG / 4) * (tokens / 4)
}
const _: () = assert!(
    matmul_wg(MATMUL_TOKENS_PER_WG) <= 256
        && MATMUL_TOKENS_PER_WG.is_multiple_of(MATMUL_SWIGLU_TOKENS_PER_WG)
        && MATMUL_SWIGLU_TOKENS_PER_WG.is_multiple_of(16)
        && MATMUL_SWIGLU_TOKENS_PER_WG.is_multiple_of(PREFILL_TOKENS_PER_WG)
);
// int8_matmul's K chunks of 32 values divide the quant group.
const _: () = assert!(QUANT_GROUP.is_multiple_of(32));
/// Rows per workgroup of the split-K layout.
pub const SPLIT_K_ROWS: u32 = 4;
/// Split-K devices run matrices with more rows than this rows per team
/// (see [`MatvecLayout::split`]).
pub const SPLIT_K_MAX_ROWS: usize = 16384;
/// Workgroup size of those rows-per-team matvecs: one subgroup on NVIDIA
/// GPUs (measured by `matvec_sweep`: 32 lanes and 4 rows beat 64 and 8).
pub const LONG_MATRIX_WG: u32 = 32;
/// Workgroup sizes the split-K matvec pipelines are built with (see
/// [`MatvecLayout::workgroup_size`]; the first is [`MATVEC_WG`]).
pub const SPLIT_K_WGS: [u32; 3] = [MATVEC_WG, 128, 256];

const _: () = assert!(
    MATVEC_ROWS.is_multiple_of(MATVEC_ROWS_PER_TEAM)
        && WG.is_power_of_two()
        && MATVEC_WG.is_power_of_two()
        && (QUANT_GROUP as u32).is_multiple_of(MATVEC_VALUES_PER_LANE)
);

/// Cached positions per `attention_partial` workgroup (one per invocation).
pub const ATTENTION_CHUNK: u32 = WG;

/// Logits per `argmax_partial` workgroup.
pub const ARGMAX_CHUNK: u32 = 1024;
/// head_dim must be a multiple of this: attention_partial reads a K row as
/// `vec4<u32>`s (8 f16 values each).
pub const HEAD_DIM_MULTIPLE: usize = 8;
/// Largest head_dim the attention kernels hold in workgroup memory.
pub const MAX_HEAD_DIM: usize = 256;
// attention_partial's last step gives each output dim an invocation.
const _: () = assert!(MAX_HEAD_DIM <= WG as usize);

impl Kernel {
    /// Every kernel, in declaration order (`Kernel::ALL[k as usize] == k`).
    pub const ALL: [Kernel; 11] = [
        Kernel::Int8MatvecAccumulate,
        Kernel::Int8MatvecNorm,
        Kernel::Int8MatvecNormSwiglu,
        Kernel::QkNormRope,
        Kernel::AttentionPartial,
        Kernel::AttentionStep,
        Kernel::AttentionStepDirect,
        Kernel::AttentionReduce,
        Kernel::EmbedLookup,
        Kernel::ArgmaxPartial,
        Kernel::ArgmaxFinal,
    ];

    /// WGSL entry point (also the file name under kernels/wgsl/).
    pub fn entry(self) -> &'static str {
        match self {
            matvec_kernels!() => "int8_matvec",
            Kernel::QkNormRope => "qk_norm_rope",
            attention_kernels!() => "attention_partial",
            Kernel::AttentionReduce => "attention_reduce",
            Kernel::EmbedLookup => "embed_lookup",
            Kernel::ArgmaxPartial => "argmax_partial",
            Kernel::ArgmaxFinal => "argmax_final",
        }
    }

    /// The kernel's own WGSL (without the reduction prelude).
    pub fn wgsl(self) -> &'static str {
        match self {
            matvec_kernels!() => {
                include_str!("../kernels/wgsl/int8_matvec.wgsl")
            }
            Kernel::QkNormRope => include_str!("../kernels/wgsl/qk_norm_rope.wgsl"),
            attention_kernels!() => include_str!("../kernels/wgsl/attention_partial.wgsl"),
            Kernel::AttentionReduce => include_str!("../kernels/wgsl/attention_reduce.wgsl"),
            Kernel::EmbedLookup => include_str!("../kernels/wgsl/embed_lookup.wgsl"),
            Kernel::ArgmaxPartial => include_str!("../kernels/wgsl/argmax_partial.wgsl"),
            Kernel::ArgmaxFinal => include_str!("../kernels/wgsl/argmax_final.wgsl"),
        }
    }

    /// Binding order of group 0.
    pub fn bindings(self) -> &'static [Bind] {
        use Bind::*;
        match self {
            // params, x, w, scales, y, norm_w
            matvec_kernels!() => &[Uniform, Read, Read, Read, ReadWrite, Read],
            // params, step, qkv, qk_norm, rope, q_out, k_cache, v_cache
            Kernel::QkNormRope => &[Uniform, Read, Read, Read, Read, ReadWrite, ReadWrite, ReadWrite],
            // params, step, q (or qkv), k_cache, v_cache, part_ml, part_acc (or
            // the output), qk_norm, rope: 8 storage buffers at most, the
            // default limit (a host application's device)
            attention_kernels!() => {
                &[Uniform, Read, Read, ReadWrite, ReadWrite, ReadWrite, ReadWrite, Read, Read]
            }
            // params, part_ml, part_acc, out
            Kernel::AttentionReduce => &[Uniform, Read, Read, ReadWrite],
            // params, step, tokens, w, scales, x
            Kernel::EmbedLookup => &[Uniform, Read, Read, Read, Read, ReadWrite],
            // params, logits, part_val, part_idx
            Kernel::ArgmaxPartial => &[Uniform, Read, ReadWrite, ReadWrite],
            // params, part_val, part_idx, tokens, step
            Kernel::ArgmaxFinal => &[Uniform, Read, Read, ReadWrite, ReadWrite],
        }
    }

    /// For the `int8_matvec` variants: which epilogue.
    pub fn matvec_variant(self) -> Option<MatvecVariant> {
        let v = |accumulate, norm, swiglu| Some(MatvecVariant { accumulate, norm, swiglu });
        match self {
            Kernel::Int8MatvecAccumulate => v(true, false, false),
            Kernel::Int8MatvecNorm => v(false, true, false),
            Kernel::Int8MatvecNormSwiglu => v(false, true, true),
            _ => None,
        }
    }

    /// For the `attention_partial` variants: (FUSED, DIRECT), see the
    /// kernel's header.
    pub fn attention_variant(self) -> Option<(bool, bool)> {
        match self {
            Kernel::AttentionPartial => Some((false, false)),
            Kernel::AttentionStep => Some((true, false)),
            Kernel::AttentionStepDirect => Some((true, true)),
            _ => None,
        }
    }

    /// Workgroup size (the WGSL `WG` override).
    pub fn workgroup_size(self) -> u32 {
        match self.matvec_variant() {
            Some(_) => MATVEC_WG,
            None => WG,
        }
    }

    /// [`Self::constants`] of a matvec variant under `split`.
    pub fn split_constants(self, split: MatvecSplit) -> Vec<(&'static str, f64)> {
        let mut c = self.constants(split.layout);
        for (name, v) in c.iter_mut() {
            match *name {
                "WG" => *v = split.workgroup_size as f64,
                "ROWS_PER_WG" => *v = split.rows_per_wg as f64,
                _ => {}
            }
        }
        c
    }

    /// Override constants this kernel is specialised with (`layout`: the
    /// device's matvec layout).
    pub fn constants(self, layout: MatvecLayout) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut c = vec![("WG", self.workgroup_size() as f64)];
        if let Some(m) = self.matvec_variant() {
            c.push(("GROUP_WORDS", (QUANT_GROUP / 4) as f64));
            c.push(("ROWS_PER_WG", layout.rows_per_wg() as f64));
            c.push(("SPLIT_K", flag(layout == MatvecLayout::SplitK)));
            c.push(("ACCUMULATE", flag(m.accumulate)));
            c.push(("NORM", flag(m.norm)));
            c.push(("SWIGLU", flag(m.swiglu)));
            c.push(("TOKENS", 1.0));
        } else if let Some((fused, direct)) = self.attention_variant() {
            c.push(("FUSED", flag(fused)));
            c.push(("DIRECT", flag(direct)));
        } else if self == Kernel::EmbedLookup {
            c.push(("GROUP_WORDS", (QUANT_GROUP / 4) as f64));
        }
        c
    }

    /// The constants of this kernel's prefill pipeline: a matvec variant
    /// multiplies [`PREFILL_TOKENS_PER_WG`] tokens per workgroup; other
    /// kernels are the same as for decode.
    pub fn prefill_constants(self, layout: MatvecLayout) -> Vec<(&'static str, f64)> {
        let mut c = self.constants(layout);
        for (name, v) in c.iter_mut() {
            match *name {
                "TOKENS" => *v = PREFILL_TOKENS_PER_WG as f64,
                // Rows per team, on the decode grid: at least as many rows
                // per workgroup (extra workgroups exit at once).
                "SPLIT_K" => *v = 0.0,
                "ROWS_PER_WG" => *v = MATVEC_ROWS.max(layout.rows_per_wg()) as f64,
                _ => {}
            }
        }
        c
    }

    /// Whether prompt batches of a tile or more run this matvec variant
    /// through the tiled `int8_matmul` rather than the per-token matvec (4
    /// tokens per workgroup). Tiled for the projections out of an RMSNorm (qkv,
    /// gate/up: 4096 and 6144 rows in the 0.6B model, 128+ tiles of 32
    /// rows); per token for those into the residual stream (o_proj, down:
    /// `hidden` rows, 1024 in the 0.6B model, too few tiles to fill the GPU):
    /// measured in BENCHMARKS.md.
    pub fn prefill_tiled(self) -> bool {
        matches!(self, Kernel::Int8MatvecNorm | Kernel::Int8MatvecNormSwiglu)
    }

    /// Tokens of one tile of this variant's `int8_matmul`.
    pub fn matmul_tokens_per_wg(self) -> u32 {
        match self {
            Kernel::Int8MatvecNormSwiglu => MATMUL_SWIGLU_TOKENS_PER_WG,
            _ => MATMUL_TOKENS_PER_WG,
        }
    }

    /// The tiled prefill pipeline's WGSL (`int8_matmul`) and override
    /// constants, for the variants [`Kernel::prefill_tiled`] names. The tile
    /// sizes and the quant group come in a `const` preamble: they size the
    /// kernel's workgroup arrays.
    pub fn matmul_source(self) -> Option<(String, Vec<(&'static str, f64)>)> {
        let m = self.matvec_variant()?;
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let tokens = self.matmul_tokens_per_wg();
        let wg = matmul_wg(tokens);
        let src = format!(
            "const MM_ROWS: u32 = {MATMUL_ROWS_PER_WG}u;\nconst MM_TOKENS: u32 = {tokens}u;\n\
             const GROUP_WORDS: u32 = {}u;\noverride WG: u32 = {wg}u;\n{INT8_COMMON}\n{}",
            QUANT_GROUP / 4,
            include_str!("../kernels/wgsl/int8_matmul.wgsl")
        );
        let constants = vec![
            ("WG", wg as f64),
            ("ACCUMULATE", flag(m.accumulate)),
            ("NORM", flag(m.norm)),
            ("SWIGLU", flag(m.swiglu)),
        ];
        Some((src, constants))
    }

    /// Full WGSL source: the reduction prelude for this device, the GPU
    /// decode state's `Step` struct (shared by the kernels that read it),
    /// for the matvec variants what they share with `int8_matmul`, then the
    /// kernel.
    pub fn source(self, subgroups: bool) -> String {
        self.source_with(subgroups, self.wgsl())
    }

    /// [`Kernel::source`] with `body` in place of the kernel's own WGSL.
    fn source_with(self, subgroups: bool, body: &str) -> String {
        let prelude = if subgroups {
            include_str!("../kernels/wgsl/prelude_subgroup.wgsl")
        } else {
            include_str!("../kernels/wgsl/prelude_workgroup.wgsl")
        };
        let step = include_str!("../kernels/wgsl/step.wgsl");
        let common = if self.matvec_variant().is_some() {
            INT8_COMMON
        } else if self.attention_variant().is_some() {
            ATTENTION_COMMON
        } else {
            ""
        };
        format!("{prelude}\n{step}\n{common}\n{body}")
    }
}

/// Where the pipelines of the kernels that have a hand-written MSL twin
/// (see [`crate::msl`]) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelSource {
    /// The MSL twins, passed straight to Metal (Apple GPUs).
    Msl,
    /// WGSL compiled by naga (every backend).
    Wgsl,
}

impl KernelSource {
    /// `"msl"` or `"wgsl"`, as the examples report it.
    pub fn as_str(self) -> &'static str {
        match self {
            KernelSource::Msl => "msl",
            KernelSource::Wgsl => "wgsl",
        }
    }
}

/// The caller's kernel preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelChoice {
    /// The MSL twins on a Metal adapter that accepts passthrough shaders,
    /// WGSL elsewhere.
    #[default]
    Auto,
    /// WGSL everywhere (on Metal too: for comparison).
    Wgsl,
}

/// Environment variable read when the caller sets no [`KernelChoice`]:
/// `wgsl` forces the WGSL kernels, `auto` is the default.
pub const KERNELS_ENV: &str = "QWEN3_WGPU_KERNELS";

impl KernelChoice {
    /// The names [`Self::from_name`] accepts: `auto` (also `msl`) and `wgsl`.
    pub const NAMES: [(&'static str, KernelChoice); 3] =
        [("auto", KernelChoice::Auto), ("msl", KernelChoice::Auto), ("wgsl", KernelChoice::Wgsl)];

    /// The choice named `auto`, `msl` or `wgsl`; anything else is
    /// `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        crate::settings::parse_choice(what, value, &Self::NAMES)
    }

    /// The choice `QWEN3_WGPU_KERNELS` names: `None` when it is unset,
    /// `invalid_argument` when it names no choice.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(KERNELS_ENV, &Self::NAMES)
    }
}

/// True when the MSL twins can be used on `gpu`: a Metal adapter with
/// passthrough shaders, and simdgroup reductions not switched off.
pub fn msl_available(gpu: &Gpu) -> bool {
    gpu.info.backend == wgpu::Backend::Metal
        && gpu.device.features().contains(wgpu::Features::PASSTHROUGH_SHADERS)
        && gpu.subgroups
}

/// Builds with the MSL twins when `want_msl`, falling back to WGSL when
/// that fails (the failure is logged and returned): the fast path never
/// stops the engine. Returns what was built, from which source, and why
/// MSL was rejected if it was.
pub fn with_fallback<T>(
    want_msl: bool,
    mut build: impl FnMut(KernelSource) -> Result<T>,
) -> Result<(T, KernelSource, Option<Error>)> {
    let mut rejected = None;
    if want_msl {
        match build(KernelSource::Msl) {
            Ok(t) => return Ok((t, KernelSource::Msl, None)),
            Err(e) => {
                log::warn!("MSL kernels unavailable, using the WGSL ones: {e}");
                rejected = Some(e);
            }
        }
    }
    Ok((build(KernelSource::Wgsl)?, KernelSource::Wgsl, rejected))
}

/// A compiled kernel: pipeline plus its bind-group layout.
pub struct Pipeline {
    pub kernel: Kernel,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// The bind-group layout a kernel's binding list describes.
pub fn bind_group_layout(gpu: &Gpu, label: &str, bindings: &[Bind]) -> wgpu::BindGroupLayout {
    let entries: Vec<_> = bindings
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupLayoutEntry {
            binding: i as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: match b {
                Bind::Uniform => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                Bind::Read | Bind::ReadWrite => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: *b == Bind::Read },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
            },
            count: None,
        })
        .collect();
    gpu.device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(label), entries: &entries })
}

/// Compiles WGSL `source` and builds a pipeline for `entry` with an explicit
/// layout; compile and validation errors become `shader_compile_failed`.
pub fn compile(
    gpu: &Gpu,
    label: &str,
    source: &str,
    entry: &str,
    bindings: &[Bind],
    constants: &[(&str, f64)],
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    compile_for_layout(gpu, label, source, entry, bindings, constants, None)
}

/// [`compile`], reusing `layout` (so bind groups made for another pipeline
/// of the same kernel work with this one) when given.
pub fn compile_for_layout(
    gpu: &Gpu,
    label: &str,
    source: &str,
    entry: &str,
    bindings: &[Bind],
    constants: &[(&str, f64)],
    layout: Option<&wgpu::BindGroupLayout>,
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    // naga first: its error names the line, and a parse failure never reaches the device.
    let module = naga::front::wgsl::parse_str(source).map_err(|e| Error::ShaderCompileFailed {
        kernel: label.to_string(),
        reason: e.emit_to_string(source),
    })?;
    if !module.entry_points.iter().any(|e| e.name == entry) {
        return Err(Error::ShaderCompileFailed {
            kernel: label.to_string(),
            reason: format!("no entry point named {entry}"),
        });
    }
    gpu.scoped(
        || {
            let layout = layout.cloned().unwrap_or_else(|| bind_group_layout(gpu, label, bindings));
            let pl = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(label),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
            let sm = gpu.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            let pipeline = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(label),
                layout: Some(&pl),
                module: &sm,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
            Ok((pipeline, layout))
        },
        |reason| Error::ShaderCompileFailed { kernel: label.to_string(), reason },
    )
}

/// Builds a pipeline from hand-written MSL (a passthrough module, Metal
/// only) with the explicit layout `bindings` describe: binding i of group 0
/// is `[[buffer(i)]]`. Compile and validation errors (caught by an error
/// scope) and panics in the backend become `shader_compile_failed`.
pub fn compile_msl(
    gpu: &Gpu,
    label: &str,
    source: &str,
    entry: &str,
    bindings: &[Bind],
    workgroup_size: u32,
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    // Off Metal, wgpu itself rejects the module (a validation error): the
    // fallback's tests run that real route on Vulkan.
    let fail = |reason: String| Error::ShaderCompileFailed { kernel: format!("{label} (MSL)"), reason };
    let build = || {
        gpu.scoped(
            || {
                let layout = bind_group_layout(gpu, label, bindings);
                let pl = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(label),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
                let entry_points = [wgpu::PassthroughShaderEntryPoint {
                    name: entry.into(),
                    workgroup_size: (workgroup_size, 1, 1),
                }];
                // SAFETY: the source is one of the MSL twins: its buffer slots
                // are checked against `bindings` (tests/msl_kernels.rs), it is
                // executed against the CPU references through the C++ shim,
                // and it guards every access against the sizes in its params.
                let module = unsafe {
                    gpu.device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
                        label: Some(label),
                        entry_points: entry_points.as_slice().into(),
                        msl: Some(source.into()),
                        ..Default::default()
                    })
                };
                let pipeline = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(label),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                });
                Ok((pipeline, layout))
            },
            fail,
        )
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(build))
        .unwrap_or_else(|_| Err(fail("the Metal backend panicked while building the pipeline".into())))
}

/// A kernel's pipelines for prompt batches (the matvec variants', and
/// `attention_prefill` for [`Kernel::AttentionPartial`]).
struct PrefillPipelines {
    /// [`PREFILL_TOKENS_PER_WG`] tokens per workgroup, on the decode grid.
    per_token: wgpu::ComputePipeline,
    /// `int8_matmul`, for the variants [`Kernel::prefill_tiled`] names, used
    /// for batches that fill a tile (smaller ones would compute a whole
    /// tile of [`Kernel::matmul_tokens_per_wg`] tokens for a few).
    tiled: Option<wgpu::ComputePipeline>,
}

type SpecialisedMatvec = ((Kernel, MatvecSplit, MatvecShape), wgpu::ComputePipeline);

/// Every kernel compiled for one device.
pub struct Kernels {
    pipelines: Vec<Pipeline>,
    /// Per kernel, the prefill pipelines where they differ from the decode
    /// one (the matvecs, and `attention_partial`'s `attention_prefill`; WGSL
    /// on every backend, on the decode pipeline's bind-group layout).
    prefill: Vec<Option<PrefillPipelines>>,
    /// Decode matvec pipelines specialised to a launch shape, built on
    /// first use ([`Self::matvec_pipeline`]) and shared by every session.
    specialised: std::sync::Mutex<Vec<SpecialisedMatvec>>,
    /// The matvec layout the pipelines were built for.
    pub matvec_layout: MatvecLayout,
    /// Where the kernels with an MSL twin came from.
    pub source: KernelSource,
    /// How the kernels were chosen and checked.
    pub report: KernelReport,
}

/// The outcome of the self-check of one pipeline set.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SelfCheck {
    /// True when every pipeline matched its reference.
    pub ok: bool,
    /// Pipelines run.
    pub pipelines: usize,
    /// Wall time of the check (upload, one submit, readback, compare), ms.
    pub ms: f64,
    /// Each kernel that did not match, and how (the first wrong value).
    pub failures: Vec<(String, String)>,
}

impl SelfCheck {
    /// `kernel: how; kernel: how` for the failures.
    pub fn describe_failures(&self) -> String {
        self.failures.iter().map(|(k, how)| format!("{k}: {how}")).collect::<Vec<_>>().join("; ")
    }
}

/// Runs a built kernel set on known answers ([`crate::self_check::run`]).
pub type SelfChecker = fn(&Gpu, &Kernels) -> Result<SelfCheck>;

/// How the engine's kernels were chosen and checked at start-up
/// ([`crate::Engine::kernel_report`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KernelReport {
    /// Where the kernels with an MSL twin come from.
    pub source: KernelSource,
    /// The start-up self-check of the pipelines in use.
    pub self_check: SelfCheck,
    /// Why the MSL twins are not in use although they were wanted: the
    /// kernel that failed (or `self-check`) and the reason, wgpu's message
    /// included. A shader compiler's own text is logged by wgpu at error
    /// level (target `wgpu_core`). `None` when MSL is in use or was not
    /// wanted (not a Metal adapter, or WGSL chosen).
    pub fallback: Option<(String, String)>,
}

impl KernelReport {
    fn unchecked(source: KernelSource) -> Self {
        let self_check = SelfCheck { ok: false, pipelines: 0, ms: 0.0, failures: vec![] };
        KernelReport { source, self_check, fallback: None }
    }
}

impl Kernels {
    /// Compiles every kernel for `gpu`: the MSL twins where `choice` and
    /// the device allow (see [`msl_available`]), WGSL otherwise or when any
    /// twin fails to build or the self-check ([`crate::self_check`]) finds
    /// one computing a wrong value. The WGSL matvec takes `layout`, or the
    /// device's ([`MatvecLayout::for_device`]). `self_check` checks a built
    /// set ([`crate::self_check::run`]); the pipelines in use pass it, or
    /// this fails.
    pub fn new(
        gpu: &Gpu,
        choice: KernelChoice,
        layout: Option<MatvecLayout>,
        self_check: SelfChecker,
    ) -> Result<Self> {
        let want_msl = choice == KernelChoice::Auto && msl_available(gpu);
        Self::new_with(gpu, want_msl, layout, self_check)
    }

    /// [`Self::new`] with the MSL attempt decided by the caller (tests try
    /// it on a non-Metal adapter, where wgpu itself rejects the twins).
    pub(crate) fn new_with(
        gpu: &Gpu,
        want_msl: bool,
        layout: Option<MatvecLayout>,
        self_check: SelfChecker,
    ) -> Result<Self> {
        let ((mut kernels, self_check), source, rejected) = with_fallback(want_msl, |source| {
            let (pipelines, matvec_layout) = Self::build(gpu, source, layout)?;
            let kernels = Self::assemble(gpu, pipelines, matvec_layout, source)?;
            let check = self_check(gpu, &kernels)?;
            if !check.ok {
                return Err(Error::GpuDeviceFailed {
                    reason: format!(
                        "the {} kernels failed the start-up self-check: {}",
                        source.as_str(),
                        check.describe_failures()
                    ),
                });
            }
            Ok((kernels, check))
        })?;
        let fallback = rejected.map(|e| match e {
            Error::ShaderCompileFailed { kernel, reason } => (kernel, reason),
            other => ("self-check".to_string(), other.to_string()),
        });
        kernels.report = KernelReport { source, self_check, fallback };
        Ok(kernels)
    }

    /// The kernel set around the decode pipelines `pipelines`: the prefill
    /// pipelines (WGSL on every backend) on their bind-group layouts.
    fn assemble(
        gpu: &Gpu,
        pipelines: Vec<Pipeline>,
        matvec_layout: MatvecLayout,
        source: KernelSource,
    ) -> Result<Self> {
        let prefill = pipelines
            .iter()
            .map(|p| {
                let k = p.kernel;
                let layout = Some(&p.layout);
                if k == Kernel::AttentionPartial {
                    let ((src, constants), entry) =
                        (attention_prefill_source(gpu.subgroups), "attention_prefill");
                    let (per_token, _) =
                        compile_for_layout(gpu, entry, &src, entry, k.bindings(), &constants, layout)?;
                    return Ok(Some(PrefillPipelines { per_token, tiled: None }));
                }
                if k.matvec_variant().is_none() {
                    return Ok(None);
                }
                let constants = k.prefill_constants(matvec_layout);
                let src = k.source(gpu.subgroups);
                let (per_token, _) =
                    compile_for_layout(gpu, k.entry(), &src, k.entry(), k.bindings(), &constants, layout)?;
                let tiled = match k.matmul_source() {
                    Some((src, constants)) if k.prefill_tiled() => {
                        let entry = "int8_matmul";
                        Some(compile_for_layout(gpu, entry, &src, entry, k.bindings(), &constants, layout)?.0)
                    }
                    _ => None,
                };
                Ok(Some(PrefillPipelines { per_token, tiled }))
            })
            .collect::<Result<_>>()?;
        Ok(Kernels {
            pipelines,
            prefill,
            specialised: Default::default(),
            matvec_layout,
            source,
            report: KernelReport::unchecked(source),
        })
    }

    /// The decode pipeline of matvec variant `kernel` under `split`,
    /// specialised to `shape` (compiled on first use, once per engine, on
    /// the kernel's bind-group layout). `None` where the matvec is an MSL
    /// twin, which reads its shape from the launch's parameters, or if the
    /// build fails: the kernel's default pipeline then serves, which reads
    /// the shape and has every split's rows per workgroup, so the launch's
    /// grid holds (only its speed differs).
    pub fn matvec_pipeline(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
    ) -> Option<wgpu::ComputePipeline> {
        if self.source == KernelSource::Msl || kernel.matvec_variant().is_none() {
            return None;
        }
        let key = (kernel, split, shape);
        let mut cache = self.specialised.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = cache.iter().find(|(k, _)| *k == key) {
            return Some(p.clone());
        }
        let mut constants = kernel.split_constants(split);
        constants.extend(shape.constants());
        let layout = Some(&self.get(kernel).layout);
        let src = kernel.source(gpu.subgroups);
        match compile_for_layout(
            gpu,
            kernel.entry(),
            &src,
            kernel.entry(),
            kernel.bindings(),
            &constants,
            layout,
        ) {
            Ok((p, _)) => {
                cache.push((key, p.clone()));
                Some(p)
            }
            Err(e) => {
                log::warn!("specialising {kernel:?} to {shape:?} failed ({e}); the general pipeline serves");
                None
            }
        }
    }

    fn build(
        gpu: &Gpu,
        source: KernelSource,
        layout: Option<MatvecLayout>,
    ) -> Result<(Vec<Pipeline>, MatvecLayout)> {
        let matvec_layout = match source {
            KernelSource::Msl => crate::msl::MSL_MATVEC_LAYOUT,
            KernelSource::Wgsl => layout.unwrap_or_else(|| MatvecLayout::for_device(&gpu.info)),
        };
        let mut pipelines = Vec::new();
        for k in Kernel::ALL {
            let (pipeline, layout) = match (source, crate::msl::msl_source(k)) {
                (KernelSource::Msl, Some(msl)) => compile_msl(
                    gpu,
                    k.entry(),
                    &msl,
                    crate::msl::msl_entry(k),
                    k.bindings(),
                    k.workgroup_size(),
                )?,
                _ => {
                    let constants = k.constants(matvec_layout);
                    compile(gpu, k.entry(), &k.source(gpu.subgroups), k.entry(), k.bindings(), &constants)?
                }
            };
            pipelines.push(Pipeline { kernel: k, pipeline, layout });
        }
        Ok((pipelines, matvec_layout))
    }

    /// Puts `pipeline` in place of `k`'s decode pipeline (the self-check's
    /// tests: a wrong kernel must be caught).
    #[cfg(test)]
    pub(crate) fn replace_pipeline(&mut self, k: Kernel, pipeline: wgpu::ComputePipeline) {
        self.pipelines[k as usize].pipeline = pipeline;
    }

    pub fn get(&self, k: Kernel) -> &Pipeline {
        // Built in `Kernel::ALL` order, which is declaration order.
        &self.pipelines[k as usize]
    }
}

/// What a launch runs, as diagnostics name it: the kernel and, for a
/// matvec, its split (e.g. `Int8MatvecNorm [rows per team x32]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchKind {
    pub kernel: Kernel,
    pub split: Option<MatvecSplit>,
}

impl std::fmt::Display for LaunchKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.kernel)?;
        match self.split {
            Some(MatvecSplit { layout: MatvecLayout::SplitK, workgroup_size, .. }) => {
                write!(f, " [split K x{workgroup_size}]")
            }
            Some(MatvecSplit { layout: MatvecLayout::RowsPerTeam, workgroup_size, .. }) => {
                write!(f, " [rows per team x{workgroup_size}]")
            }
            None => Ok(()),
        }
    }
}

/// One recorded kernel launch: pipeline, its bound buffers, and a grid.
#[derive(Clone)]
pub struct Launch {
    pub kernel: Kernel,
    pub bind_group: wgpu::BindGroup,
    pub workgroups: [u32; 3],
    /// A matvec's split (see [`MatvecLayout::split`]); `None` for the
    /// other kernels.
    pub matvec_split: Option<MatvecSplit>,
    /// A matvec's decode pipeline, under its split and specialised to its
    /// shape ([`Kernels::matvec_pipeline`]); `None`: the kernel's default
    /// pipeline.
    pub decode_pipeline: Option<wgpu::ComputePipeline>,
    /// The tiled prefill pipeline's grid for one tile of tokens
    /// ([`Kernel::matmul_tokens_per_wg`]; one workgroup per
    /// [`MATMUL_ROWS_PER_WG`] rows); see [`Kernel::prefill_tiled`].
    pub prefill_workgroups: [u32; 3],
}

impl Launch {
    /// Binds `buffers` (whole buffers or ranges) in the kernel's binding
    /// order; `workgroups` is the grid (see [`grid`] for a 1-D count).
    pub fn new(
        gpu: &Gpu,
        kernels: &Kernels,
        kernel: Kernel,
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: [u32; 3],
    ) -> Self {
        let p = kernels.get(kernel);
        let entries: Vec<_> = buffers
            .iter()
            .enumerate()
            .map(|(i, r)| wgpu::BindGroupEntry { binding: i as u32, resource: r.clone() })
            .collect();
        let bind_group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kernel.entry()),
            layout: &p.layout,
            entries: &entries,
        });
        Launch {
            kernel,
            bind_group,
            workgroups,
            matvec_split: None,
            decode_pipeline: None,
            prefill_workgroups: workgroups,
        }
    }

    /// What this launch runs (for diagnostics).
    pub fn kind(&self) -> LaunchKind {
        LaunchKind { kernel: self.kernel, split: self.matvec_split }
    }

    /// Records the launch for one token (the decode step).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, kernels: &Kernels) {
        self.record_batch(pass, kernels, 1);
    }

    /// Records the launch for `tokens` consecutive tokens (batched
    /// prefill): the grid's z dimension, which every batched kernel reads
    /// as the token's index in the batch (a matvec's prefill pipelines and
    /// `attention_prefill` as the index of its group of
    /// [`PREFILL_TOKENS_PER_WG`] tokens, `int8_matmul` as that of its tile
    /// of [`Kernel::matmul_tokens_per_wg`] for a batch that fills one).
    pub fn record_batch(&self, pass: &mut wgpu::ComputePass<'_>, kernels: &Kernels, tokens: u32) {
        let (pipeline, grid, z) = match (tokens > 1, &kernels.prefill[self.kernel as usize]) {
            (true, Some(pp)) => match &pp.tiled {
                Some(tiled) if tokens >= self.kernel.matmul_tokens_per_wg() => {
                    (tiled, self.prefill_workgroups, tokens.div_ceil(self.kernel.matmul_tokens_per_wg()))
                }
                _ => (&pp.per_token, self.workgroups, tokens.div_ceil(PREFILL_TOKENS_PER_WG)),
            },
            _ => (
                self.decode_pipeline.as_ref().unwrap_or(&kernels.get(self.kernel).pipeline),
                self.workgroups,
                tokens,
            ),
        };
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2] * z);
    }
}

/// Splits a 1-D workgroup count over x and y (at most 65535 per dimension).
/// Kernels that can exceed the limit flatten `wg.x + wg.y * nwg.x` and
/// skip the overshoot.
pub fn grid(n: u32) -> [u32; 3] {
    const MAX: u32 = 65535;
    if n <= MAX {
        [n.max(1), 1, 1]
    } else {
        [MAX, n.div_ceil(MAX), 1]
    }
}

/// Rows per chunk when a matrix is bound in ranges (a multiple of 64 rows
/// keeps every range offset aligned to 256 bytes).
pub fn chunk_rows(row_bytes: usize, max_binding: u64) -> usize {
    let rows = (max_binding as usize / row_bytes.max(1)) / 64 * 64;
    rows.max(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile_error() -> Error {
        Error::ShaderCompileFailed { kernel: "int8_matvec (MSL)".into(), reason: "deliberate".into() }
    }

    #[test]
    fn a_failing_msl_build_falls_back_to_wgsl() {
        let mut tried = Vec::new();
        let (built, source, rejected) = with_fallback(true, |s| {
            tried.push(s);
            match s {
                KernelSource::Msl => Err(compile_error()),
                KernelSource::Wgsl => Ok("wgsl pipelines"),
            }
        })
        .unwrap();
        assert_eq!((built, source), ("wgsl pipelines", KernelSource::Wgsl));
        assert!(rejected.unwrap().to_string().contains("deliberate"));
        assert_eq!(tried, [KernelSource::Msl, KernelSource::Wgsl]);
    }

    #[test]
    fn msl_is_used_when_it_builds_and_never_tried_when_not_wanted() {
        let (_, source, rejected) = with_fallback(true, Ok).unwrap();
        assert_eq!(source, KernelSource::Msl);
        assert!(rejected.is_none());
        let mut tried = Vec::new();
        let (_, source, _) = with_fallback(false, |s| {
            tried.push(s);
            Ok(())
        })
        .unwrap();
        assert_eq!((source, tried), (KernelSource::Wgsl, vec![KernelSource::Wgsl]));
    }

    #[test]
    fn split_k_gives_each_lane_one_step_per_row_where_it_can() {
        let wg = |cols: usize| MatvecLayout::SplitK.workgroup_size(cols / 4);
        // Qwen3-0.6B: hidden 1024, q_dim 2048, intermediate 3072.
        assert_eq!((wg(1024), wg(2048), wg(3072)), (64, 128, 256));
        // Short rows keep the smallest size; long ones take the largest.
        assert_eq!((wg(64), wg(1088), wg(8192)), (64, 128, 256));
        assert_eq!(MatvecLayout::RowsPerTeam.workgroup_size(768), MATVEC_WG);
    }

    #[test]
    fn every_split_has_a_pipeline_and_the_first_is_the_default() {
        for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
            let splits = layout.splits();
            for k in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
                assert_eq!(k.split_constants(splits[0]), k.constants(layout), "{k:?} {layout:?}");
            }
            // Qwen3-0.6B's matrices (rows, k_words) and longer rows.
            for (rows, k_words) in
                [(4096, 256), (1024, 512), (6144, 256), (1024, 768), (151936, 256), (64, 4096)]
            {
                assert!(splits.contains(&layout.split(rows, k_words)), "{layout:?} {rows}x{k_words}");
            }
            // The default pipeline, which serves when a split's fails to
            // build, runs any split's grid.
            assert!(splits.iter().all(|s| s.rows_per_wg == splits[0].rows_per_wg), "{layout:?}");
        }
        let lm_head = MatvecLayout::SplitK.split(151936, 256);
        assert_eq!((lm_head.layout, lm_head.workgroup_size), (MatvecLayout::RowsPerTeam, LONG_MATRIX_WG));
        assert_eq!(MatvecLayout::SplitK.split(SPLIT_K_MAX_ROWS, 256).layout, MatvecLayout::SplitK);
    }

    #[test]
    fn a_failing_wgsl_build_is_an_error() {
        let r = with_fallback(true, |_| -> Result<()> { Err(compile_error()) });
        assert_eq!(r.unwrap_err().code(), "shader_compile_failed");
    }
}
