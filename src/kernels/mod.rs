//! The kernels: one table row per kernel (entry point, WGSL and MSL files,
//! binding order, workgroup size, params struct, family), the families that
//! own each kernel's params, variants and override constants
//! ([`matvec`], [`matmul`], [`attention`], [`norm_rope`], [`argmax`],
//! [`embed`], [`sample`]), the host-kernel ABI the WGSL and MSL declarations are
//! generated from ([`abi`]), one compile path, one pipeline cache
//! ([`Kernels`]) and launch recording ([`Launch`]).

pub mod abi;
pub mod argmax;
pub mod attention;
mod choice;
mod compile;
mod constant_branches;
pub mod embed;
mod launch;
pub mod mask;
pub mod matmul;
pub mod matvec;
pub mod msl;
pub mod norm_rope;
mod pipelines;
pub mod sample;

pub use abi::{quant_padded, GpuStruct, Step, MAX_HEAD_DIM, MAX_PENALTY_WINDOW, NONE, SAMPLE_TOP_K_MAX};
pub use argmax::{ArgmaxFinalParams, ArgmaxPartialParams, ARGMAX_CHUNK};
pub use attention::{
    attention_prefill_source, attention_prefill_tiles_msl_source, attention_prefill_tiles_source,
    AttentionConstants, AttentionVariant, HeadParams, ReduceParams, ATTENTION_CHUNK, HEAD_DIM_MULTIPLE,
    PREFILL_ATTENTION_TOKENS, PREFILL_TILE_ATTENTION_TOKENS,
};
pub use choice::{
    msl_available, with_fallback, KernelChoice, KernelReport, KernelSource, RowsMatvecCase, SelfCheck,
    SelfChecker, WeightKernels, KERNELS_ENV,
};
pub use compile::{
    bind_group_layout, compile, compile_for_layout, compile_msl, ShaderChecks, SHADER_CHECKS_ENV,
};
pub use constant_branches::specialise;
pub use embed::{EmbedConstants, EmbedParams};
pub use launch::{chunk_rows, grid, Launch, LaunchKind};
pub(crate) use launch::{record_staged, staged_bindings, staged_ranges};
pub use mask::MaskParams;
pub use matmul::{
    MatmulConstants, MatmulTile, F16_STAGE_WG, MATMUL_COOP_SUB, MATMUL_COOP_TILE, MATMUL_COOP_WG,
    MATMUL_MSL_WG, MATMUL_ROWS_PER_WG, MATMUL_SWIGLU_TOKENS_PER_WG, MATMUL_TILE_ENV, MATMUL_TOKENS_PER_WG,
};
pub use matvec::{
    batch_rows_per_z, decode_bindings, MatvecConstants, MatvecLayout, MatvecParams, MatvecShape, MatvecSplit,
    MatvecVariant, BATCH_SPLIT_K_ROWS_PER_Z, LONG_MATRIX_WG, MATVEC_LAYOUT_ENV, MATVEC_ROWS,
    MATVEC_ROWS_PER_TEAM, MATVEC_VALUES_PER_LANE, MATVEC_WG, SPLIT_K_MAX_ROWS, SPLIT_K_ROWS, SPLIT_K_WGS,
};
pub(crate) use pipelines::TiledPipeline;
pub use pipelines::{Kernels, Pipeline};
pub use sample::{SampleParams, TopkParams, SAMPLE_CHUNK};

use crate::converted::WeightFormat;
use abi::StructDef;

/// How a kernel binds one buffer (binding index = position in the list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bind {
    Uniform,
    Read,
    ReadWrite,
}

/// Workgroup size of the kernels other than `int8_matvec` (a power of two,
/// as the workgroup-memory reductions need).
pub const WG: u32 = 256;
const _: () = assert!(WG.is_power_of_two());

/// Prompt tokens one per-token prefill matvec workgroup multiplies at once
/// (the WGSL `TOKENS` override of those prefill pipelines); the tokens one
/// `attention_prefill` workgroup serves are [`PREFILL_ATTENTION_TOKENS`].
pub const PREFILL_TOKENS_PER_WG: u32 = 4;

/// The workgroup reductions every WGSL kernel starts with: on subgroup
/// operations, or through workgroup memory where the adapter has no
/// subgroups. Each declares the `WG` override and the `Lane` builtins.
pub fn reduction_prelude(subgroups: bool) -> &'static str {
    if subgroups {
        include_str!("../../kernels/wgsl/prelude_subgroup.wgsl")
    } else {
        include_str!("../../kernels/wgsl/prelude_workgroup.wgsl")
    }
}

/// What the merging sampler kernels share: the sampler's common WGSL and
/// the merge ([`sample::SAMPLE_MERGE`]).
const SAMPLE_MERGE_COMMON: &str = concat!(
    include_str!("../../kernels/wgsl/sample_common.wgsl"),
    "\n",
    include_str!("../../kernels/wgsl/sample_merge.wgsl")
);

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
    /// q/k RMSNorm, RoPE and the KV-cache write of a prompt batch.
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
    /// The token's embedding row, dequantised.
    EmbedLookup,
    /// Per-chunk argmax of the logits (first of two launches).
    ArgmaxPartial,
    /// Reduces the chunks' results to the token and advances the position.
    ArgmaxFinal,
    /// Sampling penalties, in place on the logits.
    SamplePenalty,
    /// Per-chunk maxima of the logits (the sampler's M).
    SampleMax,
    /// One radix-select pass of the sampler's thresholds, or its draw.
    SampleSelect,
    /// Each chunk's exact top-k candidates (the sampler's top-k path, and
    /// the log-probabilities).
    SampleTopk,
    /// The top-k path's merge, filters and draw; writes the token and
    /// advances the position.
    SampleTopkFinal,
    /// The log-probabilities of the step's distribution and token.
    LogprobFinal,
    /// A constraint's token mask on the logits (-inf where forbidden).
    LogitsMask,
}

/// The family of a kernel, with its variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Matvec(MatvecVariant),
    NormRope,
    Attention(AttentionVariant),
    AttentionReduce,
    Embed,
    Argmax,
    Sample,
    /// The sampler kernels that merge `sample_topk`'s candidates.
    SampleMerge,
    /// A constraint's token mask.
    Mask,
}

/// A kernel's row of the table.
#[derive(Debug, Clone, Copy)]
pub struct KernelRow {
    pub kernel: Kernel,
    pub family: Family,
    /// WGSL entry point and MSL function, also the file names under
    /// kernels/wgsl/ and kernels/msl/.
    pub entry: &'static str,
    /// The kernel's own WGSL (without the prelude, the generated
    /// declarations and what its family shares).
    pub wgsl: &'static str,
    /// The MSL twin's `.metal` file, for the kernels that have one.
    pub msl: Option<&'static str>,
    /// Binding order of group 0.
    pub bindings: &'static [Bind],
    /// Workgroup size (the WGSL `WG` override, `Q3W_WG` in MSL).
    pub workgroup_size: u32,
    /// The uniform's struct (generated into both sources as `Params`).
    pub params: &'static StructDef,
}

/// One row of [`TABLE`]: kernel, family, entry (names both files), whether
/// it has an MSL twin, bindings, workgroup size, params struct.
macro_rules! row {
    ($kernel:ident, $family:expr, $entry:literal, msl: $msl:tt, $bindings:expr, $wg:expr, $params:ty) => {
        KernelRow {
            kernel: Kernel::$kernel,
            family: $family,
            entry: $entry,
            wgsl: include_str!(concat!("../../kernels/wgsl/", $entry, ".wgsl")),
            msl: row!(@msl $msl, $entry),
            bindings: $bindings,
            workgroup_size: $wg,
            params: &<$params as GpuStruct>::DEF,
        }
    };
    (@msl yes, $entry:literal) => { Some(include_str!(concat!("../../kernels/msl/", $entry, ".metal"))) };
    (@msl no, $entry:literal) => { None };
}

/// The kernel table, in [`Kernel`] declaration order.
#[rustfmt::skip]
pub const TABLE: [KernelRow; 18] = {
    use Family as F;
    use {AttentionVariant as A, MatvecVariant as M};
    use {argmax as am, attention as at, embed as em, mask as mk, matvec as mv, norm_rope as nr, sample as sa};
    [
        row!(Int8MatvecAccumulate, F::Matvec(M::ACCUMULATE), "int8_matvec", msl: yes, mv::BINDINGS, MATVEC_WG, MatvecParams),
        row!(Int8MatvecNorm, F::Matvec(M::NORM), "int8_matvec", msl: yes, mv::BINDINGS, MATVEC_WG, MatvecParams),
        row!(Int8MatvecNormSwiglu, F::Matvec(M::NORM_SWIGLU), "int8_matvec", msl: yes, mv::BINDINGS, MATVEC_WG, MatvecParams),
        row!(QkNormRope, F::NormRope, "qk_norm_rope", msl: yes, nr::BINDINGS, nr::NORM_ROPE_WG, HeadParams),
        row!(AttentionPartial, F::Attention(A::PROMPT), "attention_partial", msl: yes, at::PARTIAL_BINDINGS, WG, HeadParams),
        row!(AttentionStep, F::Attention(A::STEP), "attention_partial", msl: yes, at::PARTIAL_BINDINGS, WG, HeadParams),
        row!(AttentionStepDirect, F::Attention(A::STEP_DIRECT), "attention_partial", msl: yes, at::PARTIAL_BINDINGS, WG, HeadParams),
        row!(AttentionReduce, F::AttentionReduce, "attention_reduce", msl: yes, at::REDUCE_BINDINGS, at::REDUCE_WG, ReduceParams),
        row!(EmbedLookup, F::Embed, "embed_lookup", msl: no, em::BINDINGS, WG, EmbedParams),
        row!(ArgmaxPartial, F::Argmax, "argmax_partial", msl: yes, am::PARTIAL_BINDINGS, WG, ArgmaxPartialParams),
        row!(ArgmaxFinal, F::Argmax, "argmax_final", msl: yes, am::FINAL_BINDINGS, WG, ArgmaxFinalParams),
        row!(SamplePenalty, F::Sample, "sample_penalty", msl: no, sa::PENALTY_BINDINGS, WG, SampleParams),
        row!(SampleMax, F::Sample, "sample_max", msl: no, sa::MAX_BINDINGS, WG, SampleParams),
        row!(SampleSelect, F::Sample, "sample_select", msl: no, sa::SELECT_BINDINGS, WG, SampleParams),
        row!(SampleTopk, F::Sample, "sample_topk", msl: no, sa::TOPK_BINDINGS, WG, TopkParams),
        row!(SampleTopkFinal, F::SampleMerge, "sample_topk_final", msl: no, sa::TOPK_FINAL_BINDINGS, WG, TopkParams),
        row!(LogprobFinal, F::SampleMerge, "logprob_final", msl: no, sa::LOGPROB_FINAL_BINDINGS, WG, TopkParams),
        row!(LogitsMask, F::Mask, "logits_mask", msl: no, mk::BINDINGS, WG, MaskParams),
    ]
};

const _: () = {
    let mut i = 0;
    while i < TABLE.len() {
        assert!(TABLE[i].kernel as usize == i && Kernel::ALL[i] as usize == i);
        i += 1;
    }
};

/// A pipeline's override constants, typed by family (rendered to WGSL's
/// (name, value) list, or MSL's `#define`s, by [`Constants::render`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Constants {
    Matvec(MatvecConstants),
    Matmul(MatmulConstants),
    Attention(AttentionConstants),
    Embed(EmbedConstants),
    /// The workgroup size alone (`WG`).
    Workgroup(u32),
    /// `f16_stage`: staging a launch's weights (in `format`) and its
    /// batch's inputs (normed when `norm`) for `int8_matmul_coop`.
    Stage {
        norm: bool,
        format: WeightFormat,
    },
}

impl Constants {
    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        match self {
            Constants::Matvec(c) => c.render(),
            Constants::Matmul(c) => c.render(),
            Constants::Attention(c) => c.render(),
            Constants::Embed(c) => c.render(),
            Constants::Workgroup(wg) => vec![("WG", *wg as f64)],
            Constants::Stage { norm, format } => matmul::stage_constants(*norm, *format),
        }
    }
}

impl Kernel {
    /// Every kernel, in declaration order (`Kernel::ALL[k as usize] == k`).
    pub const ALL: [Kernel; 18] = {
        let mut all = [Kernel::Int8MatvecAccumulate; 18];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].kernel;
            i += 1;
        }
        all
    };

    /// The kernel's row of [`TABLE`].
    pub fn row(self) -> &'static KernelRow {
        &TABLE[self as usize]
    }

    /// WGSL entry point (also the file name under kernels/wgsl/).
    pub fn entry(self) -> &'static str {
        self.row().entry
    }

    /// The kernel's own WGSL (without the reduction prelude).
    pub fn wgsl(self) -> &'static str {
        self.row().wgsl
    }

    /// Binding order of group 0.
    pub fn bindings(self) -> &'static [Bind] {
        self.row().bindings
    }

    /// Workgroup size (the WGSL `WG` override).
    pub fn workgroup_size(self) -> u32 {
        self.row().workgroup_size
    }

    /// For the `int8_matvec` variants: which epilogue.
    pub fn matvec_variant(self) -> Option<MatvecVariant> {
        match self.row().family {
            Family::Matvec(v) => Some(v),
            _ => None,
        }
    }

    /// For the `attention_partial` variants: (FUSED, DIRECT), see the
    /// kernel's header.
    pub fn attention_variant(self) -> Option<(bool, bool)> {
        match self.row().family {
            Family::Attention(v) => Some((v.fused, v.direct)),
            _ => None,
        }
    }

    /// Whether the kernel reads or writes the KV cache (its pipelines
    /// take the cache's format: `KV_INT8`).
    pub fn reads_kv_cache(self) -> bool {
        self == Kernel::QkNormRope || matches!(self.row().family, Family::Attention(_))
    }

    /// The override constants of this kernel's decode pipeline (`layout`:
    /// the device's matvec layout).
    pub fn typed_constants(self, layout: MatvecLayout) -> Constants {
        match self.row().family {
            Family::Matvec(v) => Constants::Matvec(MatvecConstants::decode(v, layout.default_split())),
            Family::Attention(variant) => {
                Constants::Attention(AttentionConstants { variant, rows_out_stride: None, packed: false })
            }
            Family::Embed => Constants::Embed(EmbedConstants),
            _ => Constants::Workgroup(self.workgroup_size()),
        }
    }

    /// [`Self::typed_constants`], a matvec's over weights in `format`.
    pub fn typed_constants_in(self, layout: MatvecLayout, format: WeightFormat) -> Constants {
        match self.typed_constants(layout) {
            Constants::Matvec(c) => Constants::Matvec(MatvecConstants { format, ..c }),
            other => other,
        }
    }

    /// [`Self::typed_constants`] as (WGSL name, value) pairs.
    pub fn constants(self, layout: MatvecLayout) -> Vec<(&'static str, f64)> {
        self.typed_constants(layout).render()
    }

    /// [`Self::constants`] of a matvec variant under `split`.
    pub fn split_constants(self, split: MatvecSplit) -> Vec<(&'static str, f64)> {
        match self.matvec_variant() {
            Some(v) => MatvecConstants::decode(v, split).render(),
            None => self.constants(split.layout),
        }
    }

    /// The constants of this kernel's prefill pipeline: a matvec variant
    /// multiplies [`PREFILL_TOKENS_PER_WG`] tokens per workgroup
    /// ([`MatvecConstants::prefill`]); other kernels are the same as for
    /// decode.
    pub fn prefill_constants(self, layout: MatvecLayout) -> Vec<(&'static str, f64)> {
        match self.matvec_variant() {
            Some(v) => MatvecConstants::prefill(v, layout).render(),
            None => self.constants(layout),
        }
    }

    /// Whether prompt batches of a tile or more run this kernel through the
    /// tiled `int8_matmul`: every matvec variant. o_proj and down (`hidden`
    /// rows, 1,024 in the 0.6B model: 16 tiles of 64 rows per 64 tokens)
    /// fill an H200 poorly, yet run faster tiled than per token (104.8 ->
    /// 92.2 and 142.3 -> 131.4 µs per 256-token batch; BENCHMARKS.md
    /// 2026-12-01).
    pub fn prefill_tiled(self) -> bool {
        self.matvec_variant().is_some()
    }

    /// Tokens of one tile of this variant's `int8_matmul` in the base
    /// tiling ([`MatmulTile::BASE`]: the grid of the MSL twin and of
    /// `int8_matmul_coop`); a launch takes the tile of the pipeline it
    /// runs ([`MatmulConstants::tokens`]).
    pub fn matmul_tokens_per_wg(self) -> u32 {
        self.matvec_variant().map_or(MATMUL_TOKENS_PER_WG, matmul::tokens_per_wg)
    }

    /// The override constants of this matvec variant's `int8_matmul` (the
    /// f32 program in the default tiling; the pipeline set switches `coop`
    /// on where it uses cooperative matrices, and takes its own tiling).
    pub fn matmul_constants(self) -> Option<MatmulConstants> {
        self.matvec_variant().map(|variant| MatmulConstants {
            variant,
            coop: false,
            emulated: false,
            tile: MatmulTile::DEFAULT,
            coop_ksplit: 1,
            format: WeightFormat::Int8,
        })
    }

    /// The tiled prefill pipeline's WGSL (`int8_matmul`) and override
    /// constants, for the variants [`Kernel::prefill_tiled`] names.
    pub fn matmul_source(self) -> Option<(String, Vec<(&'static str, f64)>)> {
        self.matmul_constants().map(|c| (c.source(), c.render()))
    }

    /// What the kernel's family shares in WGSL, prepended to its own.
    fn family_wgsl(self) -> &'static str {
        match self.row().family {
            Family::Matvec(_) => matvec::INT8_COMMON,
            // The int8 arithmetic's `pack_f16` (the residual's f16 copy).
            Family::Embed => matvec::INT8_MATH,
            Family::Attention(_) => attention::ATTENTION_COMMON,
            Family::NormRope => norm_rope::KV_CACHE_WGSL,
            Family::Sample => sample::SAMPLE_COMMON,
            Family::SampleMerge => SAMPLE_MERGE_COMMON,
            _ => "",
        }
    }

    /// Full WGSL source: the reduction prelude for this device, the
    /// declarations generated from the host-kernel ABI ([`abi::wgsl_decls`]:
    /// the params, and [`Step`] and the shared constants where used), what
    /// the family shares, then the kernel.
    pub fn source(self, subgroups: bool) -> String {
        self.source_with(subgroups, self.wgsl())
    }

    /// [`Kernel::source`] with `body` in place of the kernel's own WGSL.
    pub(crate) fn source_with(self, subgroups: bool, body: &str) -> String {
        let common = self.family_wgsl();
        let decls = abi::wgsl_decls(self.row().params, &format!("{common}\n{body}"));
        format!("{}\n{decls}\n{common}\n{body}", reduction_prelude(subgroups))
    }
}
