//! The `int8_matmul` family: the tiled matrix product that runs a prompt
//! batch through the normed `int8_matvec` variants (qkv, gate/up). Same
//! params ([`super::MatvecParams`]), bindings and epilogues as the matvec,
//! whose bind group it shares; the tile sizes size its workgroup arrays, so
//! they come in a `const` preamble rather than as overrides. On Metal its
//! MSL twin ([`MATMUL_MSL`], on SIMD-group matrices) takes its place, on
//! the same bind group and grid, where the MSL twins are in use; on
//! adapters with 16x16 f16 cooperative matrices and 32-lane subgroups
//! (NVIDIA through Vulkan), `int8_matmul_coop` does (the same tile and
//! grid; [`MatmulConstants::coop`]).

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

/// The cooperative-matrix program (`int8_matmul_coop`).
pub const MATMUL_COOP_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop.wgsl");
/// What both WGSL prompt-batch programs share after `int8_common.wgsl`.
const MATMUL_COMMON: &str = include_str!("../../kernels/wgsl/int8_matmul_common.wgsl");
/// Rows and tokens of one subgroup's block in `int8_matmul_coop`, and the
/// subgroup size it is written for.
pub const MATMUL_COOP_SUB: u32 = crate::gpu::COOP_SUBGROUP_SIZE;

/// Workgroup size of `int8_matmul_coop` for tiles of `tokens` tokens: one
/// 32-lane subgroup per 32 x 32 block of the tile.
pub const fn matmul_coop_wg(tokens: u32) -> u32 {
    (MATMUL_ROWS_PER_WG / MATMUL_COOP_SUB) * (tokens / MATMUL_COOP_SUB) * MATMUL_COOP_SUB
}
const _: () = assert!(
    MATMUL_ROWS_PER_WG.is_multiple_of(MATMUL_COOP_SUB)
        && MATMUL_SWIGLU_TOKENS_PER_WG.is_multiple_of(MATMUL_COOP_SUB)
        && MATMUL_TOKENS_PER_WG.is_multiple_of(MATMUL_COOP_SUB)
);

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

/// Whether `variant`'s prompt batches run `int8_matmul_coop` on a device
/// that has cooperative matrices: the SwiGLU (gate/up) variant only, where
/// a stand-alone kernel of the same tile (64 rows x 32 tokens) took 145 µs
/// against 284 for the f32 program at the 0.6B model's 6,144 x 1,024 and
/// 256 tokens (H200); at qkv's 4,096 rows a 64 x 64 tile measured 165
/// against 158. In the engine `int8_matmul_coop` still takes 329 µs there
/// (BENCHMARKS.md), hence off by default.
pub fn coop_pays(variant: MatvecVariant) -> bool {
    variant.swiglu
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
    /// The cooperative-matrix program (`int8_matmul_coop`) rather than
    /// the f32 one.
    pub coop: bool,
}

impl MatmulConstants {
    /// Tokens of one tile (in the source's preamble, not an override).
    pub fn tokens(&self) -> u32 {
        tokens_per_wg(self.variant)
    }

    /// Workgroup size of the WGSL program.
    pub fn workgroup_size(&self) -> u32 {
        if self.coop {
            matmul_coop_wg(self.tokens())
        } else {
            matmul_wg(self.tokens())
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

    /// The WGSL: (for the cooperative-matrix program, its `enable`s), the
    /// tile sizes and quant group as `const`s, the generated declarations
    /// (the params), what the matvec shares, the stores, then the kernel.
    pub fn source(&self) -> String {
        let (enables, body) = if self.coop {
            ("enable f16;\nenable wgpu_cooperative_matrix;\n", MATMUL_COOP_WGSL)
        } else {
            ("", include_str!("../../kernels/wgsl/int8_matmul.wgsl"))
        };
        let decls = wgsl_decls(&MatvecParams::DEF, &format!("{INT8_COMMON}{MATMUL_COMMON}{body}"));
        format!(
            "{enables}const MM_ROWS: u32 = {MATMUL_ROWS_PER_WG}u;\nconst MM_TOKENS: u32 = {}u;\n\
             const GROUP_WORDS: u32 = {}u;\noverride WG: u32 = {}u;\n{decls}\n{INT8_COMMON}\n{MATMUL_COMMON}\n{}",
            self.tokens(),
            QUANT_GROUP / 4,
            self.workgroup_size(),
            body
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernel;

    /// The cooperative-matrix program of each tiled variant goes through
    /// the naga path a Vulkan device takes (parse, validate, overrides,
    /// SPIR-V) on every machine, also where no adapter offers cooperative
    /// matrices (CI's lavapipe). naga 30's SPIR-V writer panics on a
    /// `coopStore` whose arguments are not already emitted: this catches a
    /// kernel edit that brings that back.
    #[test]
    fn the_cooperative_matrix_program_compiles_to_spirv() {
        let tiled: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.prefill_tiled()).collect();
        assert_eq!(tiled.len(), 2, "qkv and gate/up run tiled");
        for kernel in tiled {
            let c = MatmulConstants { coop: true, ..kernel.matmul_constants().unwrap() };
            let source = c.source();
            let module = naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&source)));
            let flags = naga::valid::ValidationFlags::all();
            let info = naga::valid::Validator::new(flags, naga::valid::Capabilities::all())
                .validate(&module)
                .unwrap_or_else(|e| panic!("{kernel:?}: {}", e.emit_to_string(&source)));
            let constants: naga::back::PipelineConstants =
                c.render().into_iter().map(|(name, v)| (name.to_string(), v)).collect();
            let (module, info) =
                naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
                    .unwrap_or_else(|e| panic!("{kernel:?}: {e}"));
            let pipeline = naga::back::spv::PipelineOptions {
                shader_stage: naga::ShaderStage::Compute,
                entry_point: "int8_matmul".into(),
            };
            let options = naga::back::spv::Options::default();
            let words = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
                .unwrap_or_else(|e| panic!("{kernel:?}: {e}"));
            assert!(words.len() > 100, "{kernel:?}: {} SPIR-V words", words.len());
            assert_eq!(c.workgroup_size(), matmul_coop_wg(c.tokens()));
        }
    }
}
