//! The start-up self-check: every pipeline the engine built for the decode
//! step, the tiled prompt-batch products (`int8_matmul`, an MSL twin on
//! Metal), both kinds of matrix product over the default weight format
//! (int8; another format's, int4's, before a model in it first loads:
//! [`run_format`]), and the prompt-batch attention
//! (`attention_prefill`, WGSL everywhere), runs once on small known-answer
//! inputs and is compared with the CPU references ([`crate::reference`]) before the engine is returned. It
//! proves the hand-written MSL twins on the device they run on (a shifted
//! buffer slot, a compiler difference, a fast-math surprise or another
//! SIMD-group matrix layout shows up as a mismatch, and the engine falls
//! back to WGSL); the same code checks the WGSL pipelines, which is how it
//! runs on every backend.
//!
//! A wrong binding cannot pass: every binding holds distinct non-trivial
//! data (each format's matrix its own pseudo-random values and scales over
//! four quant groups, so an int4 nibble order or scale slot swapped
//! fails), outputs start as NaN, the accumulating matvec starts from a
//! non-zero `y`, row counts are not multiples of 4, attention runs over two
//! chunks plus the reduce and within one chunk, the new KV row is compared
//! value by value with every other row compared bit for bit, and the
//! argmax's maximum is tied across chunks; the tiled products run over two
//! token tiles whose spare tokens are NaN, which must reach no real
//! token's output; the prompt-batch attention serves a short last group of
//! tokens whose contexts cross a chunk edge. One submit and one wait.
//!
//! The pipelines over an int8 KV cache are built and proven the same way
//! ([`run_kv`]: the q/k norm's write, the prompt and prompt-batch
//! attention, the decode step's within one chunk and over several) when a
//! session first keeps its cache in int8.
//!
//! The batched-row matvecs (several sessions' steps per launch) are built
//! per row count and matrix shape when a batch first needs them, on a
//! thread of their own; [`rows_matvec`] proves each there before its first
//! use, bit for bit against the one-token pipeline its rows run alone.

mod attention;
mod products;
mod rig;
mod rows;
#[cfg(test)]
mod tests;
mod tokens;

use std::time::Instant;

use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::matmul::COOP_KSPLITS;
use crate::kernels::{Kernel, Kernels, SelfCheck, SelfChecker};
use crate::kv_cache::KvFormat;

use attention::{attention_prompt, attention_prompt_batch, attention_step, qk_norm_rope};
use products::{matmul, matvec};
use rig::Rig;
pub use rows::rows_matvec;
use tokens::{argmax, embed, logits_mask, sample, sample_top_k};

/// The engine's checks: [`run`] at start-up, [`rows_matvec`] before a
/// batched-row pipeline's first use.
pub const CHECKER: SelfChecker = SelfChecker {
    set: run,
    format: run_format,
    kv: run_kv,
    packed_attention: run_packed_attention,
    rows_matvec,
};

/// Relative tolerance of the matvecs: well above f32 rounding (the kernel
/// tests use 1e-5), low enough that a wrong weight, scale or input fails.
const MATVEC_TOLERANCE: f64 = 1e-3;
/// Attention outputs and rotated heads: Metal's fast exp and rsqrt.
const ATTENTION_TOLERANCE: f64 = 2e-3;
/// A value rounded to f16 in the KV cache.
const F16_TOLERANCE: f64 = 4e-3;

/// Runs every decode pipeline of `kernels` (the matvecs' over the default
/// weight format), every tiled prompt-batch pipeline (that format's) and
/// the prompt-batch attention once and compares with the CPU references. A
/// device error during the check is an `Err`; a wrong result is a [`SelfCheck`] with
/// `ok: false`.
pub fn run(gpu: &Gpu, kernels: &Kernels) -> Result<SelfCheck> {
    let t0 = Instant::now();
    let mut rig = Rig::new(gpu, kernels);
    let checks = gpu.scoped(
        || {
            let mut checks = vec![
                qk_norm_rope(&mut rig, KvFormat::F16)?,
                attention_prompt(&mut rig, KvFormat::F16)?,
                attention_prompt_batch(&mut rig, KvFormat::F16)?,
                attention_step(&mut rig, Kernel::AttentionStepDirect, 16, 9, KvFormat::F16)?,
                attention_step(&mut rig, Kernel::AttentionStep, 300, 270, KvFormat::F16)?,
                argmax(&mut rig)?,
                embed(&mut rig)?,
                sample(&mut rig)?,
                sample_top_k(&mut rig)?,
                logits_mask(&mut rig)?,
            ];
            checks.extend(attention::attention_prompt_batch_f32(&mut rig)?);
            checks.extend(products(&mut rig, WeightFormat::default())?);
            Ok(checks)
        },
        |reason| Error::GpuDeviceFailed { reason: format!("self-check: {reason}") },
    )?;
    compare(rig, checks, t0)
}

/// Runs the matrix products over weights in `format` (the decode matvecs
/// and the tiled prompt-batch products, each format's pipelines its own:
/// int4's a nibble order or scale slot of their own) once and compares
/// with the CPU references, as [`run`] does the default format's.
pub fn run_format(gpu: &Gpu, kernels: &Kernels, format: WeightFormat) -> Result<SelfCheck> {
    let t0 = Instant::now();
    let mut rig = Rig::new(gpu, kernels);
    let checks = gpu.scoped(
        || products(&mut rig, format),
        |reason| Error::GpuDeviceFailed { reason: format!("self-check ({format} weights): {reason}") },
    )?;
    compare(rig, checks, t0)
}

/// Runs the pipelines that read and write a KV cache in `kv` (the q/k norm
/// with RoPE, the prompt and prompt-batch attention, the decode step's
/// fused attention within one chunk and over several) once and compares
/// with the CPU references, as [`run`] does the f16 cache's: before a
/// session first keeps its cache in `kv`.
pub fn run_kv(gpu: &Gpu, kernels: &Kernels, kv: KvFormat) -> Result<SelfCheck> {
    let t0 = Instant::now();
    let mut rig = Rig::new(gpu, kernels);
    let checks = gpu.scoped(
        || {
            Ok(vec![
                qk_norm_rope(&mut rig, kv)?,
                attention_prompt(&mut rig, kv)?,
                attention_prompt_batch(&mut rig, kv)?,
                attention_step(&mut rig, Kernel::AttentionStepDirect, 16, 9, kv)?,
                attention_step(&mut rig, Kernel::AttentionStep, 300, 270, kv)?,
            ])
        },
        |reason| Error::GpuDeviceFailed { reason: format!("self-check ({kv} KV cache): {reason}") },
    )?;
    compare(rig, checks, t0)
}

/// Runs the decode step's packed attention pipeline
/// ([`Kernels::attention_packed_pipeline`]: two query heads a workgroup)
/// over a KV cache in `kv` once, over several chunks, and compares with
/// the CPU reference, as [`run`] does the unpacked one: before a session
/// first uses it.
pub fn run_packed_attention(gpu: &Gpu, kernels: &Kernels, kv: KvFormat) -> Result<SelfCheck> {
    let t0 = Instant::now();
    let mut rig = Rig::new(gpu, kernels);
    let checks = gpu.scoped(
        || Ok(vec![attention::attention_step_packed(&mut rig, 300, 270, kv)?]),
        |reason| Error::GpuDeviceFailed {
            reason: format!("self-check (packed attention, {kv} KV cache): {reason}"),
        },
    )?;
    compare(rig, checks, t0)
}

/// The checks of the matrix products over weights in `format`.
fn products(rig: &mut Rig<'_>, format: WeightFormat) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        checks.push(matvec(rig, kernel, format)?);
    }
    for kernel in Kernel::ALL.into_iter().filter(|k| k.prefill_tiled()) {
        let pipelines = rig.kernels.launch_pipelines(kernel, format);
        let tiled = pipelines.tiled.expect("a tiled prefill pipeline");
        checks.push(matmul(rig, kernel, format, tiled, 1)?);
        if let Some(coop) = pipelines.coop {
            // Every slicing of k a launch may take.
            for ksplit in COOP_KSPLITS {
                checks.push(matmul(rig, kernel, format, coop.clone(), ksplit)?);
            }
        }
    }
    Ok(checks)
}

/// Submits what `rig` recorded, reads it back and runs `checks` on it.
fn compare(mut rig: Rig<'_>, checks: Vec<Check>, t0: Instant) -> Result<SelfCheck> {
    let outputs = rig.finish()?;
    let mut failures = Vec::new();
    for check in checks {
        failures.extend(check(&outputs));
    }
    let pipelines = rig.ran.len();
    Ok(SelfCheck { ok: failures.is_empty(), pipelines, ms: t0.elapsed().as_secs_f64() * 1e3, failures })
}

/// Compares the read-back outputs: each failure as (kernel, how).
type Check = Box<dyn FnOnce(&[Vec<u8>]) -> Vec<(String, String)>>;
