//! Every pipeline of an engine in one cache keyed by what determines it:
//! the kernel (whose bind-group layout it takes), the program (which source
//! text) and the typed override constants. The decode and prefill pipelines
//! are built when the set is made (the self-check runs them, and a failing
//! MSL build falls back to WGSL then), over the default weight format
//! (int8) and the f16 KV cache; another weight format's products and
//! another KV format's attention when first needed (`formats`: built,
//! proven, the products falling back to WGSL on their own); the matvec
//! pipelines specialised to a launch's shape on first use (`specialised`).

mod formats;
mod prompt_attention;
#[cfg(test)]
mod replace;
mod specialised;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use std::thread::JoinHandle;

use super::choice::{
    msl_available, with_fallback, KernelChoice, KernelReport, KernelSource, RowsMatvecCase, SelfCheck,
    SelfChecker, WeightKernels,
};
use super::compile::{bind_group_layout, build, Code, ShaderChecks};
use super::matmul::COOP_KSPLITS;
use super::{
    attention_prefill_source, Constants, Kernel, MatmulConstants, MatmulTile, MatvecConstants, MatvecLayout,
    MATMUL_MSL_WG, PREFILL_ATTENTION_TOKENS,
};
use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kv_cache::KvFormat;

/// Which source text a pipeline compiles (for a kernel and its constants,
/// on one device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Program {
    /// The kernel's WGSL ([`Kernel::source`]).
    Wgsl,
    /// The kernel's MSL twin ([`crate::kernels::msl::msl_source`]).
    Msl,
    /// `attention_prefill`, the prompt-batch program of
    /// [`Kernel::AttentionPartial`].
    AttentionPrefill,
    /// Its tile program (attention_prefill_tiles.wgsl) on cooperative
    /// matrices, or (`emulated`) with scalar sums in their place.
    AttentionPrefillTiles { emulated: bool },
    /// The tile program's MSL twin
    /// ([`crate::kernels::attention_prefill_tiles_msl_source`]).
    AttentionPrefillTilesMsl,
    /// `int8_matmul`, the tiled prompt-batch program of a matvec variant
    /// (or `int8_matmul_coop`, as its constants say).
    Matmul,
    /// The MSL twin of `int8_matmul`
    /// ([`crate::kernels::MatmulConstants::msl_source`]).
    MatmulMsl,
    /// `f16_stage`, which stages `int8_matmul_coop`'s operands
    /// ([`crate::kernels::matmul::stage_source`]).
    F16Stage,
}

/// What determines a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PipelineKey {
    pub kernel: Kernel,
    pub program: Program,
    pub constants: Constants,
    /// The KV cache's format (`KV_INT8`): [`KvFormat::F16`] for the
    /// kernels that read no cache ([`Kernel::reads_kv_cache`]).
    pub kv: KvFormat,
}

/// A compiled kernel: pipeline plus its bind-group layout.
pub struct Pipeline {
    pub kernel: Kernel,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// The pipelines one launch may run: its kernel's decode pipeline and, for
/// the kernels with prompt-batch programs, those.
#[derive(Clone)]
pub(crate) struct LaunchPipelines {
    pub decode: wgpu::ComputePipeline,
    /// [`super::PREFILL_TOKENS_PER_WG`] tokens per workgroup (a matvec) or
    /// [`PREFILL_ATTENTION_TOKENS`] (`attention_prefill`), on the decode
    /// grid.
    pub per_token: Option<wgpu::ComputePipeline>,
    /// Tokens per workgroup of `per_token`: its grid's z groups.
    pub per_token_tokens: u32,
    /// `int8_matmul`, for the variants [`Kernel::prefill_tiled`] names, used
    /// for batches that fill a tile (smaller ones would compute a whole
    /// tile for a few).
    pub tiled: Option<TiledPipeline>,
    /// `int8_matmul_coop` (its `staged` pipelines set) where the set runs
    /// prompt batches on cooperative matrices: used instead of `tiled` by
    /// the launches given staging buffers ([`super::Launch::with_staging`]).
    pub coop: Option<TiledPipeline>,
}

/// A tiled prompt-batch pipeline and its tile: the grid's rows and tokens
/// per workgroup.
#[derive(Clone)]
pub(crate) struct TiledPipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub rows: u32,
    pub tokens: u32,
    /// The fewest tokens a batch runs tiled (fewer run the per-token
    /// pipeline): the base tiling's tile, whatever the tiling, so that the
    /// tiling never changes which path a batch takes (the two paths add in
    /// different orders).
    pub min_tokens: u32,
    /// For `int8_matmul_coop`: the staging of its operands, run before it.
    pub staged: Option<StagedPipelines>,
}

/// The pipelines of a cooperative-matrix product: `f16_stage` (the
/// launch's weights and its batch's inputs, normed as the variant is) and
/// `int8_matmul_coop` in each of its slicings of k.
#[derive(Clone)]
pub(crate) struct StagedPipelines {
    pub stage: wgpu::ComputePipeline,
    /// `int8_matmul_coop` with each of [`COOP_KSPLITS`] slices of k, in
    /// that order.
    pub products: [wgpu::ComputePipeline; 3],
    /// The slices every launch takes ([`Kernels::coop_ksplit`]); `None`:
    /// each launch's own ([`super::matmul::coop_ksplit`]).
    pub ksplit: Option<u32>,
}

impl StagedPipelines {
    /// The product with `ksplit` slices of k (one of [`COOP_KSPLITS`]).
    pub fn product(&self, ksplit: u32) -> &wgpu::ComputePipeline {
        let i = COOP_KSPLITS.iter().position(|&k| k == ksplit).unwrap_or(0);
        &self.products[i]
    }

    /// The product for a launch of `rows` rows x `tokens` tokens over
    /// `k_words` words.
    pub fn product_for(&self, rows: u32, k_words: u32, tokens: u32) -> &wgpu::ComputePipeline {
        self.product(self.ksplit.unwrap_or_else(|| super::matmul::coop_ksplit(rows, k_words, tokens)))
    }
}

/// The keys of a kernel's cooperative-matrix pipelines.
struct CoopKeys {
    /// `int8_matmul_coop` with each of [`COOP_KSPLITS`] slices of k.
    products: [PipelineKey; 3],
    /// `f16_stage`.
    stage: PipelineKey,
}

impl CoopKeys {
    fn all(self) -> impl Iterator<Item = PipelineKey> {
        self.products.into_iter().chain([self.stage])
    }
}

/// Every kernel compiled for one device.
pub struct Kernels {
    /// One bind-group layout per kernel (by [`Kernel::ALL`] index): every
    /// pipeline of the kernel takes it, so one bind group serves them all.
    layouts: Vec<wgpu::BindGroupLayout>,
    /// Every pipeline built, shared by every session.
    cache: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    /// Batched-row pipelines being built on a thread of their own, and
    /// those whose build failed (never tried again): see
    /// [`Kernels::matvec_rows_pipeline_or_start`]. Dropping the set joins
    /// the threads (none is left inside the driver as the process exits).
    building: Mutex<HashMap<PipelineKey, Build>>,
    /// At most this many of those builds run at once (a batch's warm-up
    /// counts as one): a driver compiles each on a core of its own, and a
    /// batch whose session count changes asks for several at once (a cold
    /// shader cache ran 40 side by side, each ~1 s, and the caller's
    /// thread waited milliseconds for a core).
    background_builds: usize,
    /// Proves a batched-row pipeline before its first use
    /// ([`SelfChecker::rows_matvec`]).
    rows_check: RowsCheck,
    /// Proves a weight format's pipelines before a model in it first
    /// loads ([`SelfChecker::format`]).
    format_check: FormatCheck,
    /// Proves the pipelines over a KV cache in a format other than f16
    /// before a session first keeps its cache in it ([`SelfChecker::kv`]).
    kv_check: KvCheck,
    /// The KV formats other than f16 proven so far, each with its check;
    /// held while one is built and proven, so that it is done once.
    kv_formats: Mutex<HashMap<KvFormat, SelfCheck>>,
    /// Proves the packed decode attention pipeline over a KV format before
    /// its first use ([`SelfChecker::packed_attention`]).
    packed_attention_check: KvCheck,
    /// The packed decode attention pipeline of each KV format asked for so
    /// far: `None` where there is none (an MSL twin serves the step) or
    /// its build or proof failed (the unpacked one serves; never tried
    /// again).
    packed_attention: Mutex<HashMap<KvFormat, Option<wgpu::ComputePipeline>>>,
    /// The weight formats other than the default proven so far, each with
    /// its report; held while one is built and proven, so that it is done
    /// once.
    formats: Mutex<HashMap<WeightFormat, WeightKernels>>,
    /// Where the matrix products over each weight format other than the
    /// default come from (the candidate while it is proven); absent: the
    /// set's `source`.
    format_sources: RwLock<HashMap<WeightFormat, KernelSource>>,
    /// Where the kernels over each KV-cache format other than f16 come from
    /// (the candidate while it is proven); absent: the set's `source`.
    kv_sources: RwLock<HashMap<KvFormat, KernelSource>>,
    /// An edit of the batched-row pipelines' source (tests: a wrong
    /// pipeline must not be used).
    #[cfg(test)]
    rows_source_edit: Option<fn(&str) -> String>,
    /// Whether the WGSL takes the subgroup reduction prelude.
    subgroups: bool,
    /// The matvec layout the pipelines were built for.
    pub matvec_layout: MatvecLayout,
    /// Whether the set has `int8_matmul_coop` beside each f32 tiled
    /// prompt-batch pipeline (after `f16_stage`'s staging of its
    /// operands), for the launches of at least
    /// [`Self::coop_min_rows`] rows.
    pub coop: bool,
    /// With `coop`: the product is its emulation without cooperative
    /// matrices ([`Gpu::coop_emulated`]).
    pub coop_emulated: bool,
    /// Whether prompt batches over an f16 KV cache run the tile program of
    /// `attention_prefill` (with the set's `coop`, or its MSL twin with the
    /// MSL set, where the device's workgroup memory holds it) for models
    /// whose head_dim it takes (`attention_prefill_for`).
    pub attention_tiles: bool,
    /// The fewest rows a launch runs on cooperative matrices
    /// ([`super::matmul::COOP_MIN_ROWS_ENV`], else
    /// [`super::matmul::COOP_MIN_ROWS`]).
    pub coop_min_rows: u32,
    /// The first position from which decode attention packs two query heads
    /// a workgroup ([`crate::kernels::attention::ATTENTION_PACK_FROM_ENV`],
    /// else [`crate::kernels::attention::ATTENTION_PACK_FROM`]).
    pub attention_pack_from: u32,
    /// The register tiling of the f32 `int8_matmul` pipelines
    /// ([`MatmulTile::from_env`], else [`MatmulTile::DEFAULT`]).
    pub matmul_tile: MatmulTile,
    /// The slices of k every cooperative-matrix product takes
    /// ([`super::matmul::COOP_KSPLIT_ENV`]); `None`: each launch's own
    /// ([`super::matmul::coop_ksplit`]).
    pub coop_ksplit: Option<u32>,
    /// Which WGSL kernels keep naga's runtime checks
    /// ([`ShaderChecks::from_env`], else [`ShaderChecks::DataIndexed`]).
    pub shader_checks: ShaderChecks,
    /// Where the kernels with an MSL twin came from.
    pub source: KernelSource,
    /// How the kernels were chosen and checked.
    pub report: KernelReport,
}

/// How many batched-row pipelines may build at once off the caller's
/// thread: a quarter of the cores (a game keeps the rest), 1 to 4.
fn background_build_limit() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4))
}

/// A batched-row pipeline built (and proven) off the caller's thread: the
/// pipeline, or why it is not used.
enum Build {
    Running(JoinHandle<std::result::Result<wgpu::ComputePipeline, String>>),
    /// Built by a batch's warm-up thread ([`Kernels::warm_rows_pipeline`]),
    /// which files the result itself.
    Warming,
    Failed,
}

/// [`SelfChecker::rows_matvec`].
type RowsCheck = fn(&Gpu, &RowsMatvecCase<'_>) -> Result<Option<String>>;

/// [`SelfChecker::kv`].
type KvCheck = fn(&Gpu, &Kernels, KvFormat) -> Result<SelfCheck>;

/// [`SelfChecker::format`].
type FormatCheck = fn(&Gpu, &Kernels, WeightFormat) -> Result<SelfCheck>;

impl Drop for Kernels {
    fn drop(&mut self) {
        let building = std::mem::take(self.building.get_mut().unwrap_or_else(|e| e.into_inner()));
        for build in building.into_values() {
            if let Build::Running(thread) = build {
                let _ = thread.join();
            }
        }
    }
}

impl Kernels {
    /// Compiles every kernel for `gpu`: the MSL twins where `choice` and
    /// the device allow (see [`msl_available`]), WGSL otherwise or when any
    /// twin fails to build or the self-check ([`crate::self_check`]) finds
    /// one computing a wrong value. The WGSL matvec takes `layout`, or the
    /// device's ([`MatvecLayout::for_device`]). `self_check` checks a built
    /// set ([`crate::self_check::run`]; the pipelines in use pass it, or
    /// this fails) and each batched-row pipeline before its first use.
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
        let mut coop_rejected = None;
        let ((mut kernels, self_check), source, rejected) = with_fallback(want_msl, |source| {
            let checked = |coop: bool, attention_tiles: bool| -> Result<(Kernels, SelfCheck)> {
                let kernels = Self::build(gpu, source, layout, coop, attention_tiles, self_check)?;
                let check = (self_check.set)(gpu, &kernels)?;
                let check = check.passed(&format!("the {} kernels (start-up)", source.as_str()))?;
                Ok((kernels, check))
            };
            // The prompt attention's tile program first (the MSL twin's,
            // or on cooperative matrices where the device has them: WGSL
            // only, the MSL twins bring their own), then without it;
            // then, for WGSL, the f32 program when the cooperative
            // matrices' build or check fails.
            let coop = source == KernelSource::Wgsl && gpu.coop;
            if coop || source == KernelSource::Msl {
                match checked(coop, true) {
                    Ok(built) => return Ok(built),
                    Err(e) => {
                        log::warn!("the prompt attention's tile program unavailable: {e}");
                        coop_rejected = coop.then(|| e.to_string());
                    }
                }
            }
            if coop {
                match checked(true, false) {
                    Ok(built) => return Ok(built),
                    Err(e) => {
                        log::warn!("cooperative-matrix prompt batches unavailable, using f32 ones: {e}")
                    }
                }
            }
            checked(false, false)
        })?;
        let fallback = rejected.map(|e| match e {
            Error::ShaderCompileFailed { kernel, reason } => (kernel, reason),
            other => ("self-check".to_string(), other.to_string()),
        });
        let cooperative_matrices = kernels.coop;
        kernels.report = KernelReport {
            source,
            self_check,
            fallback,
            cooperative_matrices,
            cooperative_fallback: coop_rejected,
            f16_residual: kernels.matvec_layout.x16(),
            weight_formats: WeightFormat::ALL.to_vec(),
        };
        Ok(kernels)
    }

    /// The set for `source`, with every decode pipeline and every prefill
    /// pipeline built (the matvec variants' over the default weight
    /// format): the MSL twins where `source` says so (the decode kernels
    /// that have one and the tiled `int8_matmul`), WGSL for the rest, the
    /// tiled ones on cooperative matrices when `coop` (and the prompt
    /// attention's tile program with them when `attention_tiles`).
    fn build(
        gpu: &Gpu,
        source: KernelSource,
        layout: Option<MatvecLayout>,
        coop: bool,
        attention_tiles: bool,
        checker: SelfChecker,
    ) -> Result<Self> {
        let matvec_layout = match source {
            KernelSource::Msl => crate::kernels::msl::MSL_MATVEC_LAYOUT,
            KernelSource::Wgsl => layout.unwrap_or_else(|| MatvecLayout::for_device(&gpu.info)),
        };
        let kernels = Kernels {
            layouts: Kernel::ALL.iter().map(|k| bind_group_layout(gpu, k.entry(), k.bindings())).collect(),
            cache: Default::default(),
            building: Default::default(),
            background_builds: background_build_limit(),
            rows_check: checker.rows_matvec,
            format_check: checker.format,
            kv_check: checker.kv,
            kv_formats: Default::default(),
            packed_attention_check: checker.packed_attention,
            packed_attention: Default::default(),
            formats: Default::default(),
            format_sources: Default::default(),
            kv_sources: Default::default(),
            #[cfg(test)]
            rows_source_edit: None,
            subgroups: gpu.subgroups,
            matvec_layout,
            coop,
            coop_emulated: coop && gpu.coop_emulated,
            attention_tiles: attention_tiles
                && (coop || source == KernelSource::Msl)
                && gpu.device.limits().max_compute_workgroup_storage_size
                    >= super::attention::prefill_tile_attention_workgroup_bytes(source == KernelSource::Msl),
            matmul_tile: MatmulTile::from_env()?.unwrap_or_default(),
            coop_ksplit: super::matmul::coop_ksplit_from_env()?,
            coop_min_rows: super::matmul::coop_min_rows_from_env()?.unwrap_or(super::matmul::COOP_MIN_ROWS),
            attention_pack_from: super::attention::attention_pack_from_env()?
                .unwrap_or(super::attention::ATTENTION_PACK_FROM),
            shader_checks: ShaderChecks::from_env()?.unwrap_or(ShaderChecks::DataIndexed),
            source,
            report: KernelReport::unchecked(source),
        };
        for k in Kernel::ALL {
            kernels.build_kernel(gpu, k, WeightFormat::default())?;
        }
        Ok(kernels)
    }

    /// Builds `k`'s decode and prompt-batch pipelines for weights in
    /// `format` (those already built are kept).
    fn build_kernel(&self, gpu: &Gpu, k: Kernel, format: WeightFormat) -> Result<()> {
        self.pipeline(gpu, self.decode_key(k, format))?;
        let (per_token, tiled) = self.prefill_keys(k, format);
        let staged = self.coop_keys(k, format).into_iter().flat_map(|c| c.all());
        let attention_tiles = self.attention_tiles_key().filter(|_| k == Kernel::AttentionPartial);
        for key in per_token.into_iter().chain(tiled).chain(staged).chain(attention_tiles) {
            self.pipeline(gpu, key)?;
        }
        Ok(())
    }

    /// The key of `k`'s decode pipeline (a matvec's over weights in
    /// `format`).
    fn decode_key(&self, kernel: Kernel, format: WeightFormat) -> PipelineKey {
        self.decode_key_kv(kernel, format, KvFormat::F16)
    }

    /// [`Self::decode_key`] over a KV cache in `kv` (the kernels that read
    /// the cache; their MSL twins take either format).
    fn decode_key_kv(&self, kernel: Kernel, format: WeightFormat, kv: KvFormat) -> PipelineKey {
        // (A kernel that reads no weights has one key for every format,
        // and one that reads no cache one for every KV format.)
        let kv = if kernel.reads_kv_cache() { kv } else { KvFormat::F16 };
        let source = if kernel.matvec_variant().is_some() {
            self.source_for(format)
        } else if kernel.reads_kv_cache() {
            self.kv_source(kv)
        } else {
            self.source
        };
        let msl = source == KernelSource::Msl && kernel.row().msl.is_some();
        let program = if msl { Program::Msl } else { Program::Wgsl };
        PipelineKey { kernel, program, constants: kernel.typed_constants_in(self.matvec_layout, format), kv }
    }

    /// The keys of `k`'s prompt-batch pipelines: per token (the matvec
    /// variants, over weights in `format`; `attention_prefill`) and tiled
    /// (`int8_matmul`, f32).
    fn prefill_keys(
        &self,
        kernel: Kernel,
        format: WeightFormat,
    ) -> (Option<PipelineKey>, Option<PipelineKey>) {
        let key = |program, constants| Some(PipelineKey { kernel, program, constants, kv: KvFormat::F16 });
        if kernel == Kernel::AttentionPartial {
            return (key(Program::AttentionPrefill, Constants::Workgroup(kernel.workgroup_size())), None);
        }
        let Some(variant) = kernel.matvec_variant() else { return (None, None) };
        let per_token = Constants::Matvec(MatvecConstants {
            format,
            ..MatvecConstants::prefill(variant, self.matvec_layout)
        });
        let msl = self.source_for(format) == KernelSource::Msl;
        let tiled = kernel.matmul_constants().filter(|_| kernel.prefill_tiled()).map(|c| MatmulConstants {
            coop: false,
            // The MSL twin is written for the base tile (its grid).
            tile: if msl { MatmulTile::BASE } else { self.matmul_tile },
            format,
            ..c
        });
        let matmul = if msl { Program::MatmulMsl } else { Program::Matmul };
        (key(Program::Wgsl, per_token), tiled.and_then(|c| key(matmul, Constants::Matmul(c))))
    }

    /// The keys of `k`'s cooperative-matrix pipelines, over weights in
    /// `format`, where the set has them.
    fn coop_keys(&self, kernel: Kernel, format: WeightFormat) -> Option<CoopKeys> {
        let (_, tiled) = self.prefill_keys(kernel, format);
        let tiled = tiled.filter(|t| self.coop && t.program == Program::Matmul)?;
        let Constants::Matmul(c) = tiled.constants else { return None };
        // The product reads the staged f16 operands: one program for
        // every format.
        let products = COOP_KSPLITS.map(|coop_ksplit| {
            let product = MatmulConstants {
                coop: true,
                emulated: self.coop_emulated,
                coop_ksplit,
                format: WeightFormat::Int8,
                ..c
            };
            PipelineKey { constants: Constants::Matmul(product), ..tiled }
        });
        let stage = PipelineKey {
            kernel,
            program: Program::F16Stage,
            constants: Constants::Stage { norm: c.variant.norm, format },
            kv: KvFormat::F16,
        };
        Some(CoopKeys { products, stage })
    }

    /// The pipeline `key` names: from the cache, or compiled on `k`'s
    /// layout and cached.
    fn pipeline(&self, gpu: &Gpu, key: PipelineKey) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = self.cached(key) {
            return Ok(p);
        }
        let p = self.build_pipeline(gpu, key)?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        Ok(cache.entry(key).or_insert(p).clone())
    }

    /// Builds the pipeline of `key` (not cached).
    fn build_pipeline(&self, gpu: &Gpu, key: PipelineKey) -> Result<wgpu::ComputePipeline> {
        let (source, entry) = self.source_of(key)?;
        build_from(gpu, self.shader_checks, key, &source, entry, &self.layouts[key.kernel as usize])
    }

    /// The program of `key` and its entry point.
    fn source_of(&self, key: PipelineKey) -> Result<(String, &'static str)> {
        let k = key.kernel;
        let missing = |what: &str| Error::ShaderCompileFailed {
            kernel: k.entry().to_string(),
            reason: format!("{k:?} has no {what}"),
        };
        let (source, entry) = match key.program {
            Program::Wgsl => (k.source(self.subgroups), k.entry()),
            Program::Msl => (
                crate::kernels::msl::msl_source_with(k, &key.constants.render(), key.kv)
                    .ok_or_else(|| missing("MSL twin"))?,
                crate::kernels::msl::msl_entry(k),
            ),
            Program::AttentionPrefill => (attention_prefill_source(self.subgroups).0, "attention_prefill"),
            Program::AttentionPrefillTiles { emulated } => {
                (super::attention::attention_prefill_tiles_source(emulated), "attention_prefill")
            }
            Program::AttentionPrefillTilesMsl => {
                (super::attention::attention_prefill_tiles_msl_source(), "attention_prefill_tiles")
            }
            Program::Matmul => match key.constants {
                Constants::Matmul(c) => (c.source(), "int8_matmul"),
                _ => return Err(missing("int8_matmul constants")),
            },
            Program::MatmulMsl => match key.constants {
                Constants::Matmul(c) => (c.msl_source(), "int8_matmul"),
                _ => return Err(missing("int8_matmul constants")),
            },
            Program::F16Stage => (super::matmul::stage_source(), "f16_stage"),
        };
        Ok((source, entry))
    }

    /// The pipeline of `key` if built.
    fn cached(&self, key: PipelineKey) -> Option<wgpu::ComputePipeline> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }

    /// A pipeline built with the set: present by construction.
    fn built(&self, key: PipelineKey) -> wgpu::ComputePipeline {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.get(&key).cloned().expect("built with the kernel set")
    }

    /// `k`'s decode pipeline (a matvec's over int8 weights) and
    /// bind-group layout.
    pub fn get(&self, k: Kernel) -> Pipeline {
        self.get_for(k, WeightFormat::Int8)
    }

    /// `k`'s decode pipeline over weights in `format` (built with the set)
    /// and bind-group layout.
    pub fn get_for(&self, k: Kernel, format: WeightFormat) -> Pipeline {
        Pipeline {
            kernel: k,
            pipeline: self.built(self.decode_key(k, format)),
            layout: self.layout(k).clone(),
        }
    }

    /// The bind-group layout of every pipeline of `k`.
    pub fn layout(&self, k: Kernel) -> &wgpu::BindGroupLayout {
        &self.layouts[k as usize]
    }

    /// The pipelines a launch of `k` over weights in `format` runs (built
    /// with the set).
    pub(crate) fn launch_pipelines(&self, k: Kernel, format: WeightFormat) -> LaunchPipelines {
        self.launch_pipelines_kv(k, format, KvFormat::F16)
    }

    /// [`Self::launch_pipelines`] over a KV cache in `kv` (its pipelines
    /// built: [`Self::prepare_kv`]).
    pub(crate) fn launch_pipelines_kv(
        &self,
        k: Kernel,
        format: WeightFormat,
        kv: KvFormat,
    ) -> LaunchPipelines {
        let kv = if k.reads_kv_cache() { kv } else { KvFormat::F16 };
        let (per_token, tiled) = self.prefill_keys(k, format);
        let per_token = per_token.map(|key| PipelineKey { kv, ..key });
        let tiled_pipeline = |key: PipelineKey| match key.constants {
            Constants::Matmul(c) => Some(TiledPipeline {
                pipeline: self.built(key),
                rows: c.rows(),
                tokens: c.tokens(),
                min_tokens: k.matmul_tokens_per_wg(),
                staged: None,
            }),
            _ => None,
        };
        LaunchPipelines {
            decode: self.built(self.decode_key_kv(k, format, kv)),
            per_token: per_token.map(|key| self.built(key)),
            per_token_tokens: match k {
                Kernel::AttentionPartial => PREFILL_ATTENTION_TOKENS,
                _ => super::PREFILL_TOKENS_PER_WG,
            },
            tiled: tiled.and_then(tiled_pipeline),
            coop: self.coop_keys(k, format).and_then(|keys| {
                let staged = StagedPipelines {
                    stage: self.built(keys.stage),
                    products: keys.products.map(|key| self.built(key)),
                    ksplit: self.coop_ksplit,
                };
                // The one-slice product gives the tile; a launch runs the
                // slicing its shape takes (`StagedPipelines::product_for`).
                Some(TiledPipeline { staged: Some(staged), ..tiled_pipeline(keys.products[0])? })
            }),
        }
    }
}

/// Builds `key`'s pipeline from its program `source` (entry point `entry`)
/// against its kernel's bind-group `layout`.
fn build_from(
    gpu: &Gpu,
    checks: ShaderChecks,
    key: PipelineKey,
    source: &str,
    entry: &str,
    layout: &wgpu::BindGroupLayout,
) -> Result<wgpu::ComputePipeline> {
    let k = key.kernel;
    let mut constants = key.constants.render();
    if key.kv == KvFormat::Int8 {
        constants.push(("KV_INT8", 1.0));
    }
    let code = match key.program {
        Program::Msl => Code::Msl { source, workgroup_size: k.workgroup_size() },
        Program::MatmulMsl => Code::Msl { source, workgroup_size: MATMUL_MSL_WG },
        Program::AttentionPrefillTilesMsl => Code::Msl { source, workgroup_size: k.workgroup_size() },
        _ => Code::Wgsl { source, constants: &constants, checked: checks.keeps(k) },
    };
    let (p, _) = build(gpu, entry, code, entry, k.bindings(), Some(layout))?;
    Ok(p)
}
