//! Hand-written Metal Shading Language twins of the hot decode kernels
//! (kernels/msl/), for loading on Metal as passthrough shaders instead of
//! WGSL translated by naga: simdgroup reductions and no bounds-check code.
//!
//! Each twin implements the same algorithm and work split as its WGSL
//! kernel, so the WGSL run elsewhere (Vulkan, lavapipe in the tests)
//! exercises the same algorithm, and takes exactly its bind-group layout:
//! binding `i` of group 0 is `[[buffer(i)]]`, which is where wgpu's Metal
//! backend places group 0's buffers when a pipeline has no immediates.
//!
//! A passthrough module cannot be specialised with override constants, so
//! [`msl_source`] prefixes the `.metal` file with a preamble: the
//! `<metal_stdlib>` include and `using namespace metal;` first (Apple's
//! headers are parsed before any macro exists), then a `#define` per entry
//! of the same [`Kernel::constants`] list the WGSL gets, named with
//! [`MACRO_PREFIX`] (`Q3W_WG`, `Q3W_NORM`, ...) so no macro can collide
//! with a name in those headers: one compiled module per [`Kernel`] value,
//! as with WGSL pipelines (the `int8_matvec` variants are `#if`s on their
//! flags, the weights' format among them: `Q3W_INT4`). The `.metal` files
//! include nothing themselves. The threadgroup size to dispatch with is
//! [`Kernel::workgroup_size`] (also `Q3W_WG` in the preamble). The structs
//! and constants the host shares with the kernels (`Params`, `Step`,
//! `MAX_HEAD_DIM`, `NONE`) follow the preamble, generated from their Rust
//! definitions. The `int8_matvec` twin implements the rows-per-team layout
//! only ([`MSL_MATVEC_LAYOUT`]): a pipeline set using it must size the
//! matvec grids for that layout. The kernels that read or write the KV
//! cache take its format as one more flag (`Q3W_KV_INT8`, the WGSL's
//! `KV_INT8` override) and share kernels/msl/kv_cache.metal (an int8
//! cache's rounding and layout), placed before their files.
//!
//! The prompt-batch product `int8_matmul` has a twin too
//! (kernels/msl/int8_matmul.metal, on SIMD-group matrices): its source comes
//! from [`crate::kernels::MatmulConstants::msl_source`], the same preamble
//! over its own constants, and it runs in threadgroups of
//! [`crate::kernels::MATMUL_MSL_WG`] threads on the WGSL kernel's grid.

use super::abi::msl_decls;
use super::{Kernel, MatvecLayout};
use crate::converted::WeightFormat;
use crate::kv_cache::KvFormat;

/// The matvec layout of the MSL twin (the one Apple GPUs get from
/// [`MatvecLayout::for_device`]); its preamble is generated for it.
pub const MSL_MATVEC_LAYOUT: MatvecLayout = MatvecLayout::RowsPerTeam;

/// Prefix of every macro the preamble defines (`WG` becomes `Q3W_WG`).
pub const MACRO_PREFIX: &str = "Q3W_";

/// What every MSL source starts with, before any generated macro.
pub const MSL_HEADER: &str = "#include <metal_stdlib>\nusing namespace metal;\n";

/// The kernel's `.metal` file, for kernels that have an MSL twin (its row
/// of [`crate::kernels::TABLE`]).
pub fn msl_file(kernel: Kernel) -> Option<&'static str> {
    kernel.row().msl
}

/// Full MSL source of `kernel`'s variant: [`preamble`], the declarations
/// generated from the host-kernel ABI ([`crate::kernels::abi::msl_decls`]:
/// the kernel's `Params`, and `Step` and the shared constants where the file
/// uses them), then its `.metal` file. `None` for kernels without a twin
/// (they stay WGSL everywhere). A matvec's reads int8 weights.
pub fn msl_source(kernel: Kernel) -> Option<String> {
    msl_source_in(kernel, WeightFormat::Int8)
}

/// [`msl_source`] of the variant over weights in `format` (a matvec's; the
/// other kernels read no weights).
pub fn msl_source_in(kernel: Kernel, format: WeightFormat) -> Option<String> {
    msl_source_with(kernel, &kernel.typed_constants_in(MSL_MATVEC_LAYOUT, format).render(), KvFormat::F16)
}

/// What the twins that read or write the KV cache share (an int8 cache's
/// rounding and layout), between the declarations and the file.
pub const KV_CACHE_MSL: &str = include_str!("../../kernels/msl/kv_cache.metal");

/// [`msl_source`] with the preamble of `constants` (a pipeline's own) and,
/// for a kernel that reads or writes the KV cache, its format `kv` and
/// [`KV_CACHE_MSL`].
pub fn msl_source_with(kernel: Kernel, constants: &[(&str, f64)], kv: KvFormat) -> Option<String> {
    let mut constants = constants.to_vec();
    let shared = if kernel.reads_kv_cache() {
        constants.push(("KV_INT8", if kv == KvFormat::Int8 { 1.0 } else { 0.0 }));
        KV_CACHE_MSL
    } else {
        ""
    };
    let defines = preamble_of(&constants);
    msl_file(kernel).map(|body| {
        let decls = msl_decls(kernel.row().params, &format!("{shared}{body}"));
        format!("{defines}{decls}{shared}{body}")
    })
}

/// The MSL function to use as the pipeline's entry point (the WGSL entry's
/// name; none is called `main`, which MSL reserves).
pub fn msl_entry(kernel: Kernel) -> &'static str {
    kernel.entry()
}

/// [`MSL_HEADER`], then `#define Q3W_NAME value` for each of
/// [`Kernel::constants`]: flags as 0/1, integers without a decimal point
/// (they size threadgroup arrays and appear in `#if`s).
pub fn preamble(kernel: Kernel) -> String {
    preamble_of(&kernel.constants(MSL_MATVEC_LAYOUT))
}

/// [`MSL_HEADER`], then `#define Q3W_NAME value` for each of `constants`
/// (see [`preamble`]).
pub fn preamble_of(constants: &[(&str, f64)]) -> String {
    let defines = constants.iter().map(|&(name, v)| {
        if v.fract() == 0.0 && v.abs() < 1e15 {
            format!("#define {MACRO_PREFIX}{name} {}\n", v as i64)
        } else {
            format!("#define {MACRO_PREFIX}{name} {v:?}f\n")
        }
    });
    std::iter::once(MSL_HEADER.to_string()).chain(defines).collect()
}
