//! The `int8_matmul` family: the tiled matrix product that runs a prompt
//! batch through the normed `int8_matvec` variants (qkv, gate/up). Same
//! params ([`super::MatvecParams`]), bindings and epilogues as the matvec,
//! whose bind group it shares; the tile sizes size its workgroup arrays, so
//! they come in a `const` preamble rather than as overrides. On Metal its
//! MSL twin ([`MATMUL_MSL`], on SIMD-group matrices) takes its place, on
//! the same bind group and grid, where the MSL twins are in use.

use super::abi::{msl_decls, wgsl_decls, GpuStruct};
use super::matvec::{MatvecParams, MatvecVariant, INT8_COMMON};
use super::msl::preamble_of;
use super::PREFILL_TOKENS_PER_WG;
use crate::converted::QUANT_GROUP;

/// Rows and prompt tokens of one `int8_matmul` tile (the tiled prefill
/// pipelines: MM_ROWS and MM_TOKENS in its preamble); each invocation
/// computes 4 rows x 4 tokens.
pub const MATMUL_ROWS_PER_WG: u32 = 64;
/// The most tokens of any `int8_matmul` tile (see
/// [`super::Kernel::matmul_tokens_per_wg`]): activation buffers hold a multiple.
pub const MATMUL_TOKENS_PER_WG: u32 = 64;
/// Tokens of the SwiGLU (gate/up) variant's tiles: its 6,144 rows fill an
/// H200 better in twice the workgroups of half the tokens (BENCHMARKS.md).
pub const MATMUL_SWIGLU_TOKENS_PER_WG: u32 = 32;

/// The MSL twin of `int8_matmul` (kernels/msl/int8_matmul.metal).
pub const MATMUL_MSL: &str = include_str!("../../kernels/msl/int8_matmul.metal");

/// Threadgroup size of the MSL twin: four 32-lane simdgroups, each
/// multiplying a quarter of the tile on SIMD-group matrices (the grid is
/// the WGSL kernel's).
pub const MATMUL_MSL_WG: u32 = 128;

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

/// Whether prompt batches of a tile or more run this matvec variant
/// through the tiled `int8_matmul` rather than the per-token matvec (4
/// tokens per workgroup). Tiled for the projections out of an RMSNorm (qkv,
/// gate/up: 4096 and 6144 rows in the 0.6B model, 128+ tiles of 32 rows);
/// per token for those into the residual stream (o_proj, down: `hidden`
/// rows, 1024 in the 0.6B model, too few tiles to fill the GPU): measured
/// in BENCHMARKS.md.
pub fn tiled(variant: MatvecVariant) -> bool {
    variant.norm
}

/// Tokens of one tile of `variant`'s `int8_matmul`.
pub fn tokens_per_wg(variant: MatvecVariant) -> u32 {
    if variant.swiglu {
        MATMUL_SWIGLU_TOKENS_PER_WG
    } else {
        MATMUL_TOKENS_PER_WG
    }
}

/// The override constants of an `int8_matmul` pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatmulConstants {
    pub variant: MatvecVariant,
}

impl MatmulConstants {
    /// Tokens of one tile (in the source's preamble, not an override).
    pub fn tokens(&self) -> u32 {
        tokens_per_wg(self.variant)
    }

    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("WG", matmul_wg(self.tokens()) as f64),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
        ]
    }

    /// The MSL twin's constants (prefixed `Q3W_` in its preamble): its
    /// threadgroup size, the tile, the quant group's words and the
    /// epilogue flags.
    pub fn msl_constants(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("WG", MATMUL_MSL_WG as f64),
            ("MM_ROWS", MATMUL_ROWS_PER_WG as f64),
            ("MM_TOKENS", self.tokens() as f64),
            ("GROUP_WORDS", (QUANT_GROUP / 4) as f64),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
        ]
    }

    /// The MSL twin's full source, as Metal gets it: the preamble of
    /// [`Self::msl_constants`], the generated declarations (the params),
    /// then kernels/msl/int8_matmul.metal.
    pub fn msl_source(&self) -> String {
        format!(
            "{}{}{MATMUL_MSL}",
            preamble_of(&self.msl_constants()),
            msl_decls(&MatvecParams::DEF, MATMUL_MSL)
        )
    }

    /// The WGSL: the tile sizes and quant group as `const`s, the generated
    /// declarations (the params), what the matvec shares, then the kernel.
    pub fn source(&self) -> String {
        let body = include_str!("../../kernels/wgsl/int8_matmul.wgsl");
        let decls = wgsl_decls(&MatvecParams::DEF, &format!("{INT8_COMMON}{body}"));
        format!(
            "const MM_ROWS: u32 = {MATMUL_ROWS_PER_WG}u;\nconst MM_TOKENS: u32 = {}u;\n\
             const GROUP_WORDS: u32 = {}u;\noverride WG: u32 = {}u;\n{decls}\n{INT8_COMMON}\n{}",
            self.tokens(),
            QUANT_GROUP / 4,
            matmul_wg(self.tokens()),
            body
        )
    }
}
