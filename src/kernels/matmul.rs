//! The `int8_matmul` family: the tiled matrix product that runs a prompt
//! batch through the normed `int8_matvec` variants (qkv, gate/up). Same
//! params ([`super::MatvecParams`]), bindings and epilogues as the matvec,
//! whose bind group it shares; the tile sizes size its workgroup arrays, so
//! they come in a `const` preamble rather than as overrides. On Metal its
//! MSL twin ([`MATMUL_MSL`], on SIMD-group matrices) takes its place, on
//! the same bind group and grid, where the MSL twins are in use; on
//! adapters with 16x16 f16 cooperative matrices and 32-lane subgroups
//! (NVIDIA through Vulkan), `int8_matmul_coop` does (the same tile and
//! grid; [`MatmulConstants::coop`]). The f32 program's tile and its
//! division among invocations ([`MatmulTile`]) are chosen at start-up
//! (`QWEN3_WGPU_MATMUL_TILE`); the others keep [`MatmulTile::BASE`]'s grid.

mod coop;
#[cfg(test)]
mod tests;
mod tile;

use super::abi::{msl_decls, wgsl_decls, GpuStruct};
use super::matvec::{MatvecParams, MatvecVariant, INT8_COMMON, INT8_MATH};
use super::msl::preamble_of;
use crate::converted::{WeightFormat, QUANT_GROUP};
pub use coop::{
    coop_ksplit, coop_ksplit_from_env, coop_min_rows_from_env, stage_constants, stage_grid, stage_source,
    staged_bytes, staged_input_bytes, staged_weight_bytes, COOP_KSPLITS, COOP_KSPLIT_ENV, COOP_MIN_ROWS,
    COOP_MIN_ROWS_CHOICES, COOP_MIN_ROWS_ENV, F16_STAGE_WG, MATMUL_COOP_SUB, MATMUL_COOP_TILE,
    MATMUL_COOP_WG,
};
pub use tile::{MatmulTile, MATMUL_TILE_ENV};

/// Rows of one `int8_matmul` tile in the base tiling ([`MatmulTile::BASE`]:
/// MM_ROWS in the preamble, the grid's rows per workgroup), which the MSL
/// twin and `int8_matmul_coop` keep.
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

/// The cooperative-matrix program (`int8_matmul_coop`): the product over
/// operands staged as f16 by [`F16_STAGE_WGSL`].
pub const MATMUL_COOP_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop.wgsl");
/// `int8_matmul_coop`'s product without cooperative matrices, for tests on
/// adapters that have none ([`MatmulConstants::emulated`]).
pub const MATMUL_COOP_EMULATED_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop_emulated.wgsl");
/// What both cooperative-matrix products share: the tile in workgroup
/// memory and its epilogue.
pub(crate) const MATMUL_COOP_TILE_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop_tile.wgsl");
/// The staging program of `int8_matmul_coop`: a launch's weights and its
/// batch's inputs as f16 in 16 x 16 blocks, in one launch.
pub const F16_STAGE_WGSL: &str = include_str!("../../kernels/wgsl/f16_stage.wgsl");
/// What both WGSL prompt-batch programs share after `int8_common.wgsl`.
const MATMUL_COMMON: &str = include_str!("../../kernels/wgsl/int8_matmul_common.wgsl");

/// Tokens of one tile of `variant`'s `int8_matmul` in the base tiling.
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
    /// The cooperative-matrix program (`int8_matmul_coop`) rather than
    /// the f32 one.
    pub coop: bool,
    /// With `coop`: its emulation without cooperative matrices (the same
    /// staged operands and epilogue, a scalar product), for tests where
    /// the adapter has none.
    pub emulated: bool,
    /// The f32 program's tiling (`int8_matmul_coop` ignores it).
    pub tile: MatmulTile,
    /// `int8_matmul_coop`'s slices of k (one of [`COOP_KSPLITS`]; the f32
    /// program ignores it).
    pub coop_ksplit: u32,
    /// The weights' format (`INT4`; `int8_matmul_coop` reads them staged
    /// as f16 and ignores it).
    pub format: WeightFormat,
}

impl MatmulConstants {
    /// Tokens of one tile (in the source's preamble, not an override): the
    /// grid's tokens per workgroup.
    pub fn tokens(&self) -> u32 {
        if self.coop {
            MATMUL_COOP_TILE
        } else {
            self.tile.tokens_for(self.variant)
        }
    }

    /// Rows of one tile: the grid's rows per workgroup.
    pub fn rows(&self) -> u32 {
        if self.coop {
            MATMUL_COOP_TILE
        } else {
            self.tile.rows_for()
        }
    }

    /// Workgroup size of the WGSL program.
    pub fn workgroup_size(&self) -> u32 {
        if self.coop {
            MATMUL_COOP_WG * self.coop_ksplit
        } else {
            self.tile.workgroup_size(self.rows(), self.tokens())
        }
    }

    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("WG", self.workgroup_size() as f64),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
            ("INT4", flag(self.format == WeightFormat::Int4)),
        ]
    }

    /// The MSL twin's constants (prefixed `Q3W_` in its preamble): its
    /// threadgroup size, the tile, the quant group's words, the epilogue
    /// flags and the weights' format.
    pub fn msl_constants(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("WG", MATMUL_MSL_WG as f64),
            // The base tile whatever the tiling: the twin is written for it.
            ("MM_ROWS", MATMUL_ROWS_PER_WG as f64),
            ("MM_TOKENS", tokens_per_wg(self.variant) as f64),
            ("GROUP_WORDS", (QUANT_GROUP / 4) as f64),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
            ("INT4", flag(self.format == WeightFormat::Int4)),
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

    /// The WGSL: (for the cooperative-matrix program, its `enable`s), the
    /// tile sizes, register tiling and quant group as `const`s, the generated declarations
    /// (the params), what the matvec shares, the stores, then the kernel.
    pub fn source(&self) -> String {
        // The cooperative-matrix program binds the layout with other types
        // (its staged f16 operands): the arithmetic without the bindings.
        let (enables, common, tile, body) = match (self.coop, self.emulated) {
            // The slices' reduction branches on the subgroup: uniform in
            // each, all cooperative matrices need, which naga's analysis
            // cannot see (it reports it under this rule).
            (true, false) => (
                "enable f16;\nenable wgpu_cooperative_matrix;\ndiagnostic(off, derivative_uniformity);\n",
                INT8_MATH,
                MATMUL_COOP_TILE_WGSL,
                MATMUL_COOP_WGSL,
            ),
            (true, true) => ("enable f16;\n", INT8_MATH, MATMUL_COOP_TILE_WGSL, MATMUL_COOP_EMULATED_WGSL),
            (false, _) => ("", INT8_COMMON, "", include_str!("../../kernels/wgsl/int8_matmul.wgsl")),
        };
        let decls = wgsl_decls(&MatvecParams::DEF, &format!("{common}{MATMUL_COMMON}{tile}{body}"));
        let MatmulTile { inv_rows, inv_tokens, prefetch, swizzle, .. } = self.tile;
        let ksplit = self.coop_ksplit;
        format!(
            "{enables}const MM_ROWS: u32 = {}u;\nconst MM_TOKENS: u32 = {}u;\n\
             const COOP_KSPLIT: u32 = {ksplit}u;\n\
             const INV_ROWS: u32 = {inv_rows}u;\nconst INV_TOKENS: u32 = {inv_tokens}u;\n\
             const PREFETCH: bool = {prefetch};\nconst SWIZZLE: bool = {swizzle};\nconst GROUP_WORDS: u32 = {}u;\noverride WG: u32 = {}u;\n\
             {decls}\n{common}\n{MATMUL_COMMON}\n{tile}\n{}",
            self.rows(),
            self.tokens(),
            QUANT_GROUP / 4,
            self.workgroup_size(),
            body
        )
    }
}
