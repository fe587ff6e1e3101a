//! The pipelines over a weight format other than the set's own (int4's
//! products) and over a KV-cache format other than f16 (int8's attention):
//! built and proven when a model or session first needs them, once, and
//! where each format's kernels come from (MSL twins, or WGSL where they
//! failed for that format).

use super::{Kernels, PipelineKey};
use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::choice::{with_fallback, KernelSource, SelfCheck, WeightKernels};
use crate::kernels::Kernel;
use crate::kv_cache::KvFormat;

impl Kernels {
    /// Builds and proves the matrix products over weights in `format`
    /// (those of the default format are built and proven with the set): on
    /// the first call for a format the pipelines are built from the set's
    /// source and run by the self-check ([`SelfChecker::format`]); MSL
    /// twins that fail to build or to match fall back to WGSL for this
    /// format alone. Later calls return the first one's report. Errors:
    /// [`Error::GpuDeviceFailed`] when the WGSL pipelines fail the check
    /// too (or the device fails during it); a failed proof is tried again
    /// by the next call.
    pub(crate) fn prepare_format(&self, gpu: &Gpu, format: WeightFormat) -> Result<WeightKernels> {
        if format == WeightFormat::default() {
            return Ok(WeightKernels {
                format,
                source: self.source,
                self_check: self.report.self_check.clone(),
                fallback: self.report.fallback.as_ref().map(|(kernel, reason)| format!("{kernel}: {reason}")),
            });
        }
        let mut formats = self.formats.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = formats.get(&format) {
            return Ok(done.clone());
        }
        let outcome = with_fallback(self.source == KernelSource::Msl, |source| {
            self.format_sources.write().unwrap_or_else(|e| e.into_inner()).insert(format, source);
            for k in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
                self.build_kernel(gpu, k, format)?;
            }
            let check = (self.format_check)(gpu, self, format)?;
            check.passed(&format!("the {} kernels over {format} weights", source.as_str()))
        });
        match outcome {
            Ok((self_check, source, rejected)) => {
                self.format_sources.write().unwrap_or_else(|e| e.into_inner()).insert(format, source);
                let report =
                    WeightKernels { format, source, self_check, fallback: rejected.map(|e| e.to_string()) };
                formats.insert(format, report.clone());
                Ok(report)
            }
            Err(e) => {
                self.format_sources.write().unwrap_or_else(|e| e.into_inner()).remove(&format);
                Err(e)
            }
        }
    }

    /// Builds the pipelines of the kernels that read the KV cache
    /// ([`Kernel::reads_kv_cache`]) over a cache in `kv` (the f16 cache's
    /// are built and proven with the set) and proves them
    /// ([`SelfChecker::kv`]) on the first call for a format: MSL twins that
    /// fail to build or to match fall back to WGSL for this format alone.
    /// Errors: `invalid_argument` naming `kv_cache` when the model's
    /// `head_dim` does not fit the format; [`Error::GpuDeviceFailed`] when
    /// the WGSL pipelines fail to build or the check too (tried again by
    /// the next call).
    pub(crate) fn prepare_kv(&self, gpu: &Gpu, kv: KvFormat, head_dim: usize) -> Result<()> {
        if !kv.fits_head_dim(head_dim) {
            return Err(Error::invalid_argument(
                "kv_cache",
                format!(
                    "a {kv} KV cache needs head_dim a multiple of {}; this model's is {head_dim}",
                    crate::limits::KV_INT8_HEAD_DIM_MULTIPLE
                ),
            ));
        }
        if kv == KvFormat::F16 {
            return Ok(()); // proven with the set
        }
        self.prove_kv(gpu, kv).map(|_| ())
    }

    /// [`Self::prepare_kv`] without a model: the format's self-check
    /// (the start-up one's for f16).
    pub(crate) fn prove_kv(&self, gpu: &Gpu, kv: KvFormat) -> Result<SelfCheck> {
        if kv == KvFormat::F16 {
            return Ok(self.report.self_check.clone());
        }
        let mut proven = self.kv_formats.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(check) = proven.get(&kv) {
            return Ok(check.clone());
        }
        let outcome = with_fallback(self.source == KernelSource::Msl, |source| {
            self.kv_sources.write().unwrap_or_else(|e| e.into_inner()).insert(kv, source);
            for k in Kernel::ALL.into_iter().filter(|k| k.reads_kv_cache()) {
                self.pipeline(gpu, self.decode_key_kv(k, WeightFormat::default(), kv))?;
                let (per_token, _) = self.prefill_keys(k, WeightFormat::default());
                if let Some(key) = per_token {
                    self.pipeline(gpu, PipelineKey { kv, ..key })?;
                }
            }
            (self.kv_check)(gpu, self, kv)?
                .passed(&format!("the {} kernels over a {kv} KV cache", source.as_str()))
        });
        match outcome {
            Ok((check, _, _)) => {
                proven.insert(kv, check.clone());
                Ok(check)
            }
            Err(e) => {
                self.kv_sources.write().unwrap_or_else(|e| e.into_inner()).remove(&kv);
                Err(e)
            }
        }
    }

    /// Where the matrix products over weights in `format` come from (for
    /// a format other than the default: the source proven by
    /// [`Self::prepare_format`], or the one it tries first).
    pub(super) fn source_for(&self, format: WeightFormat) -> KernelSource {
        if format == WeightFormat::default() {
            return self.source;
        }
        let sources = self.format_sources.read().unwrap_or_else(|e| e.into_inner());
        sources.get(&format).copied().unwrap_or(self.source)
    }

    /// Where the kernels over a KV cache in `kv` come from (for a format
    /// other than f16: the source proven by [`Self::prove_kv`], or the one
    /// it tries first).
    pub fn kv_source(&self, kv: KvFormat) -> KernelSource {
        if kv == KvFormat::F16 {
            return self.source;
        }
        let sources = self.kv_sources.read().unwrap_or_else(|e| e.into_inner());
        sources.get(&kv).copied().unwrap_or(self.source)
    }

    /// The self-check of the pipelines over a KV cache in `kv`, once a
    /// session has used it (`None` before, and for f16, whose pipelines
    /// the start-up check covers).
    pub fn kv_check(&self, kv: KvFormat) -> Option<SelfCheck> {
        self.kv_formats.lock().unwrap_or_else(|e| e.into_inner()).get(&kv).cloned()
    }
}
