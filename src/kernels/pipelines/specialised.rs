//! The pipelines specialised to a launch's shape, built on first use: a
//! matvec for one matrix shape, the batched-row matvecs for a row count
//! (built and proven on a thread of their own before their first use),
//! and the batched-row attention.

use std::collections::HashMap;

use super::{build_from, Build, Kernels, PipelineKey, Program};
use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::choice::{KernelSource, RowsMatvecCase};
use crate::kernels::{AttentionConstants, Constants, Kernel, MatvecConstants, MatvecShape, MatvecSplit};
use crate::kv_cache::KvFormat;

impl Kernels {
    /// The decode pipeline of matvec variant `kernel` over weights in
    /// `format` under `split`, specialised to `shape` (compiled on first
    /// use, once per engine, on the kernel's bind-group layout). `None`
    /// where the matvec is an MSL twin (on Metal), which reads its
    /// shape from the launch's parameters, or if the
    /// build or its proof against the CPU reference
    /// ([`SelfChecker::rows_matvec`](crate::kernels::SelfChecker::rows_matvec), at its compiled shape) fails: the
    /// kernel's default pipeline then serves, which reads
    /// the shape and has every split's rows per workgroup, so the launch's
    /// grid holds (only its speed differs).
    pub fn matvec_pipeline(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
    ) -> Option<wgpu::ComputePipeline> {
        let variant = kernel.matvec_variant()?;
        if self.source_for(format) == KernelSource::Msl {
            return None;
        }
        let constants =
            MatvecConstants { shape: Some(shape), format, ..MatvecConstants::decode(variant, split) };
        let key = PipelineKey {
            kernel,
            program: Program::Wgsl,
            constants: Constants::Matvec(constants),
            kv: KvFormat::F16,
        };
        self.proven(gpu, key)
    }

    /// The pipeline of matvec variant `kernel` that runs `rows` decode rows
    /// of a batch of sessions in each workgroup (`DECODE_ROWS`), under
    /// `split` and specialised to `shape` as [`Self::matvec_pipeline`]'s:
    /// each row computes exactly what that pipeline computes for one
    /// token. Compiled on first use, once per engine, and proven before it
    /// is used ([`SelfChecker::rows_matvec`](crate::kernels::SelfChecker::rows_matvec): every row bit for bit against
    /// the one-token pipeline). `None` where the matvecs are MSL twins
    /// (which have no such variant) or if the build or the proof fails
    /// (the caller then runs the decode pipeline over a grid of rows: the
    /// same results, the matrix read once per row).
    pub fn matvec_rows_pipeline(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
        rows: u32,
    ) -> Option<wgpu::ComputePipeline> {
        let key = self.matvec_rows_key(kernel, split, shape, format, rows)?;
        self.proven(gpu, key)
    }

    /// The specialised matvec pipeline `key` (one token's or a batch's
    /// rows'): cached, or built and proven here and cached; `None` if its
    /// build or proof failed, now or before.
    pub(super) fn proven(&self, gpu: &Gpu, key: PipelineKey) -> Option<wgpu::ComputePipeline> {
        if let Some(p) = self.cached(key) {
            return Some(p);
        }
        if self.failed(key) {
            return None;
        }
        // A batch's warm-up thread building it: wait for that build
        // rather than make a second.
        while matches!(
            self.building.lock().unwrap_or_else(|e| e.into_inner()).get(&key),
            Some(Build::Warming)
        ) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if let Some(p) = self.cached(key) {
            return Some(p);
        }
        if self.failed(key) {
            return None;
        }
        let built = self.proven_build(gpu, key)();
        self.file_proven(key, built)
    }

    /// Whether `key`'s build or proof failed (never tried again).
    pub(super) fn failed(&self, key: PipelineKey) -> bool {
        matches!(self.building.lock().unwrap_or_else(|e| e.into_inner()).get(&key), Some(Build::Failed))
    }

    /// Files a specialised matvec pipeline's build (one token's or a batch's
    /// rows'): cached when built and proven, else never tried again
    /// (logged; the caller runs the general pipeline, or the one-token one
    /// over a grid of rows).
    fn file_proven(
        &self,
        key: PipelineKey,
        built: std::result::Result<wgpu::ComputePipeline, String>,
    ) -> Option<wgpu::ComputePipeline> {
        match built {
            Ok(p) => {
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                Some(cache.entry(key).or_insert(p).clone())
            }
            Err(why) => {
                let (k, c) = (key.kernel, key.constants);
                log::warn!("a specialised {k:?} ({c:?}) is not used ({why}); the general or one-token pipeline serves");
                let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
                building.insert(key, Build::Failed);
                None
            }
        }
    }

    /// The build of specialised matvec pipeline `key` and its proof: a
    /// batch's rows' against the CPU reference and, bit for bit, the
    /// one-token pipeline a session runs the launch with alone (the
    /// specialised one where built, else the kernel's default, as
    /// [`crate::kernels::Launch::record_rows`] falls back to); one token's against
    /// the CPU reference. A closure that owns what it needs (it may run on
    /// a thread of its own).
    fn proven_build(
        &self,
        gpu: &Gpu,
        key: PipelineKey,
    ) -> impl FnOnce() -> std::result::Result<wgpu::ComputePipeline, String> + Send + 'static {
        #[allow(unused_mut)] // edited by tests
        let mut source = self.source_of(key).map_err(|e| e.to_string());
        #[cfg(test)]
        if let (Some(edit), Ok((text, _))) = (self.rows_source_edit, source.as_mut()) {
            *text = edit(text);
        }
        let alone = match key.constants {
            Constants::Matvec(c) if c.decode_rows == 0 => Ok((c, None)),
            Constants::Matvec(c) => {
                let one = MatvecConstants { decode_rows: 0, rows_per_z: 0, ..c };
                let one_key = PipelineKey { constants: Constants::Matvec(one), ..key };
                Ok((
                    c,
                    Some(self.cached(one_key).unwrap_or_else(|| self.get_for(key.kernel, c.format).pipeline)),
                ))
            }
            _ => Err(format!("{key:?} is no matvec key")),
        };
        let (gpu, layout, checks, check) =
            (gpu.clone(), self.layouts[key.kernel as usize].clone(), self.shader_checks, self.rows_check);
        move || {
            let (source, entry) = source?;
            let (constants, one_token) = alone?;
            let rows = build_from(&gpu, checks, key, &source, entry, &layout).map_err(|e| e.to_string())?;
            let case = RowsMatvecCase {
                kernel: key.kernel,
                constants,
                layout: &layout,
                rows: &rows,
                one_token: one_token.as_ref().unwrap_or(&rows),
            };
            match check(&gpu, &case) {
                Ok(None) => Ok(rows),
                Ok(Some(how)) => Err(format!("first-use check: {how}")),
                Err(e) => Err(format!("first-use check: {e}")),
            }
        }
    }

    /// [`Self::matvec_rows_pipeline`] that never builds on the caller's
    /// thread (a frame must not wait for a compiler or the proof's GPU
    /// run): the pipeline if built and proven; otherwise `None`, and its
    /// build and proof start on a thread of their own (once: a failure is
    /// not tried again; not while as many builds as the set allows at once
    /// are running: a later call starts it), so a later call finds it.
    /// Meanwhile the caller runs a larger count's pipeline
    /// ([`Self::built_rows_pipeline`]) or the decode pipeline over a grid
    /// of rows (the same results).
    pub fn matvec_rows_pipeline_or_start(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
        rows: u32,
    ) -> Option<wgpu::ComputePipeline> {
        let key = self.matvec_rows_key(kernel, split, shape, format, rows)?;
        if let Some(p) = self.built_or_finished(key) {
            return Some(p);
        }
        let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
        // Failed, being built, or as many builds running as allowed.
        if building.contains_key(&key) || builds_in_flight(&building) >= self.background_builds {
            return None;
        }
        // The thread owns what the build needs (not the set, which joins
        // it when dropped).
        let build = self.proven_build(gpu, key);
        let thread = std::thread::Builder::new().name("qwen3-wgpu pipeline build".into()).spawn(build);
        // No thread now: a later call tries again.
        if let Ok(thread) = thread {
            building.insert(key, Build::Running(thread));
        }
        None
    }

    /// The `rows`-row pipeline [`Self::matvec_rows_pipeline`] gives if it
    /// is built and proven (filed here if its build thread has finished);
    /// `None` otherwise, starting nothing: a step of fewer rows looks for
    /// a larger count's pipeline to run its rows in (see
    /// [`crate::qwen3::BatchForward::record`]).
    pub fn built_rows_pipeline(
        &self,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
        rows: u32,
    ) -> Option<wgpu::ComputePipeline> {
        self.built_or_finished(self.matvec_rows_key(kernel, split, shape, format, rows)?)
    }

    /// Pipeline `key` if built and proven, or if its build thread has
    /// finished (filed here: cached, or marked failed); `None` otherwise.
    fn built_or_finished(&self, key: PipelineKey) -> Option<wgpu::ComputePipeline> {
        if let Some(p) = self.cached(key) {
            return Some(p);
        }
        let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
        match building.remove(&key) {
            Some(Build::Running(thread)) if thread.is_finished() => {
                drop(building);
                let built = thread.join().unwrap_or_else(|_| Err("the build thread panicked".to_string()));
                self.file_proven(key, built)
            }
            Some(other) => {
                building.insert(key, other);
                None
            }
            None => None,
        }
    }

    /// Builds and proves the `rows`-row pipeline
    /// [`Self::matvec_rows_pipeline`] gives, here, unless it is built,
    /// being built or failed already; a call of
    /// [`Self::matvec_rows_pipeline_or_start`] meanwhile finds it in the
    /// making and starts no second build. For a batch's warm-up thread,
    /// which builds the pipelines its steps will need before they run.
    pub fn warm_rows_pipeline(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
        rows: u32,
    ) {
        let Some(key) = self.matvec_rows_key(kernel, split, shape, format, rows) else { return };
        if self.cached(key).is_some() {
            return;
        }
        {
            let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
            if building.contains_key(&key) {
                return;
            }
            building.insert(key, Build::Warming);
        }
        // Whatever happens to this build (a panic in the driver included),
        // the marker goes: a blocking step waits on it.
        struct Unmark<'a>(&'a Kernels, PipelineKey);
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                let built = self.0.cached(self.1).is_some();
                let mut building = self.0.building.lock().unwrap_or_else(|e| e.into_inner());
                if matches!(building.get(&self.1), Some(Build::Warming)) {
                    // Not filed as built: never tried again.
                    if built {
                        building.remove(&self.1);
                    } else {
                        building.insert(self.1, Build::Failed);
                    }
                }
            }
        }
        let _unmark = Unmark(self, key);
        let built = self.proven_build(gpu, key)();
        self.file_proven(key, built);
    }

    /// Whether the `rows`-row pipeline [`Self::matvec_rows_pipeline`]
    /// gives is built and proven (or there is none to build: MSL twins).
    pub fn rows_pipeline_ready(
        &self,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
        rows: u32,
    ) -> bool {
        self.matvec_rows_key(kernel, split, shape, format, rows).is_none_or(|key| self.cached(key).is_some())
    }

    /// The key of matvec variant `kernel`'s `rows`-row pipeline over
    /// weights in `format`; `None` where the matvecs are MSL twins (no such
    /// variant).
    fn matvec_rows_key(
        &self,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        format: WeightFormat,
        rows: u32,
    ) -> Option<PipelineKey> {
        let variant = kernel.matvec_variant()?;
        if self.source_for(format) == KernelSource::Msl {
            return None;
        }
        let constants = MatvecConstants {
            shape: Some(shape),
            format,
            decode_rows: rows,
            rows_per_z: crate::kernels::batch_rows_per_z(split, rows),
            ..MatvecConstants::decode(variant, split)
        };
        Some(PipelineKey {
            kernel,
            program: Program::Wgsl,
            constants: Constants::Matvec(constants),
            kv: KvFormat::F16,
        })
    }

    /// The WGSL pipeline of decode attention variant `kernel`
    /// ([`Kernel::AttentionStep`] or [`Kernel::AttentionStepDirect`]) over
    /// a batch of sessions' steps (`ROWS`; the output's rows
    /// `out_stride` elements apart), `packed` or not (see
    /// [`Self::attention_packed_pipeline`]). Compiled on first use.
    pub fn attention_rows_pipeline(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        out_stride: u32,
        kv: KvFormat,
        packed: bool,
    ) -> Result<wgpu::ComputePipeline> {
        self.pipeline(gpu, self.attention_key(kernel, Some(out_stride), kv, packed)?)
    }

    /// The key of an `attention_partial` pipeline of `kernel`: WGSL for a
    /// batch's rows (`rows_out_stride`), else the program of the kernel's
    /// decode pipeline (its MSL twin where the set has it).
    fn attention_key(
        &self,
        kernel: Kernel,
        rows_out_stride: Option<u32>,
        kv: KvFormat,
        packed: bool,
    ) -> Result<PipelineKey> {
        let Constants::Attention(c) = kernel.typed_constants(self.matvec_layout) else {
            return Err(Error::internal(format!("{kernel:?} is no attention kernel")));
        };
        let constants = Constants::Attention(AttentionConstants { rows_out_stride, packed, ..c });
        let program = match rows_out_stride {
            Some(_) => Program::Wgsl,
            None => self.decode_key_kv(kernel, WeightFormat::default(), kv).program,
        };
        Ok(PipelineKey { kernel, program, constants, kv })
    }

    /// The decode step's chunked attention ([`Kernel::AttentionStep`]) over
    /// a cache in `kv` with two query heads a workgroup from
    /// [`Self::attention_pack_from`] on, in the program of the step's own
    /// (its MSL twin where the set has it): built and proven
    /// ([`SelfChecker::packed_attention`](crate::kernels::SelfChecker::packed_attention))
    /// on the first call for a format. `None` where the build or the proof
    /// failed: the unpacked pipeline then serves (the same results: packing
    /// changes no bits).
    pub fn attention_packed_pipeline(&self, gpu: &Gpu, kv: KvFormat) -> Option<wgpu::ComputePipeline> {
        let mut packed = self.packed_attention.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = packed.get(&kv) {
            return p.clone();
        }
        let proven = || -> Result<wgpu::ComputePipeline> {
            let pipeline = self.attention_packed_step_pipeline(gpu, kv)?;
            (self.packed_attention_check)(gpu, self, kv)?.passed("the packed decode attention")?;
            Ok(pipeline)
        };
        let made = match proven() {
            Ok(pipeline) => Some(pipeline),
            Err(e) => {
                log::warn!("decode attention runs one head a workgroup over a {kv} KV cache: {e}");
                None
            }
        };
        packed.insert(kv, made.clone());
        made
    }

    /// Whether the packed attention over a cache in `kv` was asked for and
    /// is in use ([`Self::attention_packed_pipeline`] returned it).
    pub(crate) fn packed_attention_in_use(&self, kv: KvFormat) -> bool {
        let packed = self.packed_attention.lock().unwrap_or_else(|e| e.into_inner());
        packed.get(&kv).is_some_and(|p| p.is_some())
    }

    /// Puts `pipeline` in place of the packed one-token attention pipeline
    /// over a cache in `kv` before its first use (the self-check's tests).
    #[cfg(test)]
    pub(crate) fn replace_packed_attention_pipeline(
        &mut self,
        kv: KvFormat,
        pipeline: wgpu::ComputePipeline,
    ) {
        let key = self.attention_key(Kernel::AttentionStep, None, kv, true).expect("an attention kernel");
        self.cache.get_mut().unwrap_or_else(|e| e.into_inner()).insert(key, pipeline);
    }

    /// The packed one-token [`Kernel::AttentionStep`] pipeline over a cache
    /// in `kv`, built (not proven: the self-check's entry).
    pub(crate) fn attention_packed_step_pipeline(
        &self,
        gpu: &Gpu,
        kv: KvFormat,
    ) -> Result<wgpu::ComputePipeline> {
        self.pipeline(gpu, self.attention_key(Kernel::AttentionStep, None, kv, true)?)
    }

    /// Edits the batched-row pipelines' source before they build (the
    /// first-use check's tests: a wrong pipeline must not be used).
    #[cfg(test)]
    pub(crate) fn edit_rows_source(&mut self, edit: fn(&str) -> String) {
        self.rows_source_edit = Some(edit);
    }

    /// Whether the batched-row pipeline's build or check failed (never
    /// tried again).
    #[cfg(test)]
    pub(crate) fn rows_failed(
        &self,
        kernel: Kernel,
        split: MatvecSplit,
        shape: MatvecShape,
        rows: u32,
    ) -> bool {
        self.matvec_rows_key(kernel, split, shape, WeightFormat::Int8, rows)
            .is_some_and(|key| self.failed(key))
    }
}

/// Builds running off the caller's threads: started by
/// [`Kernels::matvec_rows_pipeline_or_start`] and not finished, or a
/// batch's warm-up's.
pub(super) fn builds_in_flight(building: &HashMap<PipelineKey, Build>) -> usize {
    building
        .values()
        .filter(|b| match b {
            Build::Running(thread) => !thread.is_finished(),
            Build::Warming => true,
            Build::Failed => false,
        })
        .count()
}
