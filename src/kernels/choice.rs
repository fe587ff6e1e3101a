//! Which kernels an engine uses and how they were checked: the MSL twins
//! or WGSL ([`KernelSource`], [`KernelChoice`]), the fallback from one to
//! the other, and the start-up self-check's report.

use super::{Kernel, Kernels, MatvecConstants};
use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// Where the pipelines of the kernels that have a hand-written MSL twin
/// (see [`crate::kernels::msl`]) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

    /// The check itself when it passed; otherwise
    /// [`Error::GpuDeviceFailed`] saying that `what` (the kernels checked)
    /// failed it, and how.
    pub(crate) fn passed(self, what: &str) -> Result<Self> {
        if self.ok {
            return Ok(self);
        }
        Err(Error::GpuDeviceFailed {
            reason: format!("{what} failed the self-check: {}", self.describe_failures()),
        })
    }
}

/// Proves built pipelines on known answers ([`crate::self_check::CHECKER`]).
#[derive(Debug, Clone, Copy)]
pub struct SelfChecker {
    /// Runs a built kernel set ([`crate::self_check::run`]); the set in
    /// use passes it.
    pub set: fn(&Gpu, &Kernels) -> Result<SelfCheck>,
    /// Runs the pipelines over weights in a format other than the set's
    /// own before a model in it first loads
    /// ([`crate::self_check::run_format`]).
    pub format: fn(&Gpu, &Kernels, WeightFormat) -> Result<SelfCheck>,
    /// Runs the pipelines over a KV cache in a format other than f16
    /// before a session first keeps its cache in it
    /// ([`crate::self_check::run_kv`]).
    pub kv: fn(&Gpu, &Kernels, crate::kv_cache::KvFormat) -> Result<SelfCheck>,
    /// Runs the packed decode attention pipeline over a KV cache in a
    /// format before a session first uses it
    /// ([`crate::self_check::run_packed_attention`]).
    pub packed_attention: fn(&Gpu, &Kernels, crate::kv_cache::KvFormat) -> Result<SelfCheck>,
    /// Runs a batched-row matvec pipeline beside the one-token pipeline
    /// its rows run alone ([`crate::self_check::rows_matvec`]) before its
    /// first use: `Ok(None)` when proven, `Ok(Some(how))` when not.
    pub rows_matvec: fn(&Gpu, &RowsMatvecCase<'_>) -> Result<Option<String>>,
}

/// A batched-row matvec pipeline to prove before its first use.
pub struct RowsMatvecCase<'a> {
    /// The matvec variant.
    pub kernel: Kernel,
    /// The pipeline's constants (its split, shape, `DECODE_ROWS` and
    /// `ROWS_PER_Z`).
    pub constants: MatvecConstants,
    /// The kernel's bind-group layout.
    pub layout: &'a wgpu::BindGroupLayout,
    /// The batched-row pipeline.
    pub rows: &'a wgpu::ComputePipeline,
    /// The pipeline a session runs the same launch with alone.
    pub one_token: &'a wgpu::ComputePipeline,
}

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
    /// Whether prompt batches run on cooperative matrices
    /// (`int8_matmul_coop`: f16 operands, f32 sums; see
    /// [`crate::EngineBuilder::cooperative_matrices`]).
    pub cooperative_matrices: bool,
    /// Why the cooperative-matrix programs are not all in use although
    /// the device offers them (a build or the self-check failed with the
    /// prompt attention's tile program; the products may still run on
    /// them, as `cooperative_matrices` says): `None` otherwise.
    pub cooperative_fallback: Option<String>,
    /// Whether decode steps keep an f16 copy of the residual stream, which
    /// the normed matvecs (qkv, gate/up, the LM head) read instead of the
    /// f32 one: half their input bytes on GPUs whose matvecs are bound by
    /// them (the split-K layout: NVIDIA-class GPUs). The residual itself
    /// stays f32; logits then differ from f32 inputs' by about 1e-3 of
    /// their rms (greedy tokens agree with MLX's float32 up to near-ties).
    pub f16_residual: bool,
    /// The layer-weight formats the engine loads
    /// ([`crate::LoadOptions::weights`] picks a model's). The start-up
    /// self-check runs the default format's pipelines (int8); another
    /// format's are built and proven when the first model in it loads, or
    /// ahead of that by [`crate::Engine::prepare_weights`], which reports
    /// them.
    pub weight_formats: Vec<WeightFormat>,
}

/// How the pipelines over one layer-weight format were built and proven
/// ([`crate::Engine::prepare_weights`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WeightKernels {
    /// The format.
    pub format: WeightFormat,
    /// Where its matrix products come from: the MSL twins, or WGSL (also
    /// when the twins were wanted and failed; see `fallback`).
    pub source: KernelSource,
    /// The self-check of its pipelines (the decode matvecs and the tiled
    /// prompt-batch products).
    pub self_check: SelfCheck,
    /// Why its MSL twins are not in use although the engine's kernels are
    /// the MSL ones; `None` otherwise.
    pub fallback: Option<String>,
}

impl KernelReport {
    pub(super) fn unchecked(source: KernelSource) -> Self {
        let self_check = SelfCheck { ok: false, pipelines: 0, ms: 0.0, failures: vec![] };
        KernelReport {
            source,
            self_check,
            fallback: None,
            cooperative_matrices: false,
            cooperative_fallback: None,
            f16_residual: false,
            weight_formats: Vec::new(),
        }
    }
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
    fn a_failing_wgsl_build_is_an_error() {
        let r = with_fallback(true, |_| -> Result<()> { Err(compile_error()) });
        assert_eq!(r.unwrap_err().code(), "shader_compile_failed");
    }
}
