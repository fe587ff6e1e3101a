//! Launch recording: one kernel launch's bound buffers, grid and
//! pipelines, recorded into a compute pass for one token or a prompt batch.

use super::pipelines::LaunchPipelines;
use super::{Kernel, Kernels, MatvecLayout, MatvecSplit};
use crate::converted::WeightFormat;
use crate::gpu::Gpu;
use crate::kv_cache::KvFormat;

/// What a launch runs, as diagnostics name it: the kernel and, for a
/// matvec, its split (e.g. `Int8MatvecNorm [rows per team x32]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchKind {
    pub kernel: Kernel,
    pub split: Option<MatvecSplit>,
}

impl std::fmt::Display for LaunchKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.kernel)?;
        match self.split {
            Some(MatvecSplit { layout: MatvecLayout::SplitK, workgroup_size, .. }) => {
                write!(f, " [split K x{workgroup_size}]")
            }
            Some(MatvecSplit { layout: MatvecLayout::RowsPerTeam, workgroup_size, .. }) => {
                write!(f, " [rows per team x{workgroup_size}]")
            }
            None => Ok(()),
        }
    }
}

/// One recorded kernel launch: pipeline, its bound buffers, and a grid.
#[derive(Clone)]
pub struct Launch {
    pub kernel: Kernel,
    /// The format of the weights a matvec reads (int8 for the other
    /// kernels): its pipelines' (see [`Self::new_for`]).
    pub format: WeightFormat,
    pub bind_group: wgpu::BindGroup,
    pub workgroups: [u32; 3],
    /// A matvec's split (see [`MatvecLayout::split`]); `None` for the
    /// other kernels.
    pub matvec_split: Option<MatvecSplit>,
    /// A matvec's decode pipeline, under its split and specialised to its
    /// shape ([`Kernels::matvec_pipeline`]); `None`: the kernel's default
    /// pipeline.
    pub decode_pipeline: Option<wgpu::ComputePipeline>,
    /// The bind group of the decode pipelines where their bindings differ
    /// from the prompt batches' ([`super::decode_bindings`]); `None`:
    /// `bind_group`.
    decode_bind_group: Option<wgpu::BindGroup>,
    /// The tiled prefill pipeline's grid for one tile of tokens (one
    /// workgroup per [`Self::tiled_rows_per_wg`] rows); see
    /// [`Kernel::prefill_tiled`].
    pub prefill_workgroups: [u32; 3],
    /// The kernel's pipelines, resolved when the launch is made (recording
    /// looks nothing up).
    pipelines: LaunchPipelines,
    /// The bind groups of `int8_matmul_coop`'s staging and product
    /// ([`Self::with_staging`]): the launch's batches run it instead of the
    /// f32 tiled pipeline.
    staged: Option<Box<StagedLaunch>>,
}

/// The bind groups of a cooperative-matrix product's three launches:
/// weights staged, inputs staged, product ([`staged_bindings`]).
#[derive(Clone)]
struct StagedLaunch {
    /// The staging's and the product's.
    groups: [wgpu::BindGroup; 2],
    /// The launch's shape: rows, and words per row.
    rows: u32,
    k_words: u32,
}

/// The staging range of a launch over `rows` rows of `k_words` words for
/// batches of up to `tokens` tokens, and its two parts, as (offset, bytes):
/// `[staged, w16, x16]` (see [`staged_bindings`]).
pub(crate) fn staged_parts(rows: u32, k_words: u32, tokens: u32) -> [(u64, u64); 3] {
    use super::matmul::{staged_input_bytes, staged_weight_bytes};
    let w = staged_weight_bytes(rows as usize, k_words as usize);
    let x = staged_input_bytes(tokens as usize, k_words as usize);
    [(0, w + x), (0, w), (w, x)]
}

/// [`staged_parts`] as ranges of `staging`.
pub(crate) fn staged_ranges(
    staging: &wgpu::Buffer,
    rows: u32,
    k_words: u32,
    tokens: u32,
) -> [wgpu::BindingResource<'_>; 3] {
    staged_parts(rows, k_words, tokens).map(|(offset, size)| {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: staging,
            offset,
            size: wgpu::BufferSize::new(size),
        })
    })
}

/// The bindings of the two launches of a cooperative-matrix product
/// (staging, product), in binding order, from a matvec launch's (params,
/// x, w, scales, y, norm_w, x16) and the staging range (`staged`: the weights'
/// part `w16`, then the inputs' `x16`): the staging writes `staged` at
/// binding 4, the product reads `x16` at 1 and `w16` at 2 and writes `y`;
/// the residual's f16 copy (slot 6, unused by prompt batches) stays.
/// Slots a program does not read hold buffers that no write of that
/// launch aliases.
pub(crate) fn staged_bindings<T: Clone>(matvec: [T; 7], [staged, w16, x16]: [T; 3]) -> [[T; 7]; 2] {
    let [params, x, w, scales, y, norm, resid16] = matvec;
    [
        [params.clone(), x, w, scales.clone(), staged, norm, resid16.clone()],
        [params, x16.clone(), w16, scales, y, x16, resid16],
    ]
}

/// Records a cooperative-matrix product of `rows` rows of `k_words` words
/// x `tokens` tokens: its weights and inputs staged as f16 (`staged`'s
/// staging pipeline), then `product` over `grid` (rows) and the tiles of
/// tokens.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_staged(
    pass: &mut wgpu::ComputePass<'_>,
    staged: &super::pipelines::StagedPipelines,
    product: &wgpu::ComputePipeline,
    groups: &[wgpu::BindGroup; 2],
    [rows, k_words]: [u32; 2],
    grid: [u32; 3],
    tokens: u32,
) {
    use super::matmul::{stage_grid, MATMUL_COOP_TILE};
    let steps = [
        (&staged.stage, stage_grid(rows, k_words, tokens)),
        (product, [grid[0], grid[1], grid[2] * tokens.div_ceil(MATMUL_COOP_TILE)]),
    ];
    for ((pipeline, g), group) in steps.into_iter().zip(groups) {
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, group, &[]);
        pass.dispatch_workgroups(g[0], g[1], g[2]);
    }
}

impl Launch {
    /// Binds `buffers` (whole buffers or ranges) in the kernel's binding
    /// order; `workgroups` is the grid (see [`grid`] for a 1-D count).
    pub fn new(
        gpu: &Gpu,
        kernels: &Kernels,
        kernel: Kernel,
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: [u32; 3],
    ) -> Self {
        Self::new_for(gpu, kernels, kernel, WeightFormat::Int8, buffers, workgroups)
    }

    /// [`Self::new`] of a matvec over weights in `format` (the set holds
    /// every format's pipelines).
    pub fn new_for(
        gpu: &Gpu,
        kernels: &Kernels,
        kernel: Kernel,
        format: WeightFormat,
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: [u32; 3],
    ) -> Self {
        Self::new_in(gpu, kernels, kernel, (format, KvFormat::F16), buffers, workgroups)
    }

    /// [`Self::new`] of a launch over weights in `formats.0` and a KV
    /// cache in `formats.1` (its pipelines built:
    /// [`Kernels::prepare_kv`]).
    pub fn new_in(
        gpu: &Gpu,
        kernels: &Kernels,
        kernel: Kernel,
        (format, kv): (WeightFormat, KvFormat),
        buffers: &[wgpu::BindingResource<'_>],
        workgroups: [u32; 3],
    ) -> Self {
        let bind_group = gpu.bind_group(kernel.entry(), kernels.layout(kernel), buffers.iter().cloned());
        Launch {
            kernel,
            format,
            bind_group,
            workgroups,
            matvec_split: None,
            decode_pipeline: None,
            decode_bind_group: None,
            prefill_workgroups: workgroups,
            pipelines: kernels.launch_pipelines_kv(kernel, format, kv),
            staged: None,
        }
    }

    /// Whether the launch's batches can run `int8_matmul_coop` (given
    /// staging buffers, [`Self::with_staging`]).
    pub fn can_stage(&self) -> bool {
        self.pipelines.coop.is_some()
    }

    /// Gives a matvec launch over `rows` rows of `k_words` words, bound to
    /// `buffers` (as [`Self::new`]), the staging buffer its
    /// cooperative-matrix batches of up to `tokens` tokens take (at least
    /// [`super::matmul::staged_bytes`]).
    #[allow(clippy::too_many_arguments)]
    pub fn with_staging(
        mut self,
        gpu: &Gpu,
        kernels: &Kernels,
        buffers: &[wgpu::BindingResource<'_>; 7],
        staging: &wgpu::Buffer,
        rows: u32,
        k_words: u32,
        tokens: u32,
    ) -> Self {
        let layout = kernels.layout(self.kernel);
        let ranges = staged_ranges(staging, rows, k_words, tokens);
        let groups =
            staged_bindings(buffers.clone(), ranges).map(|b| gpu.bind_group("int8_matmul_coop", layout, b));
        self.staged = Some(Box::new(StagedLaunch { groups, rows, k_words }));
        self
    }

    /// Binds `buffers` (as [`Self::new`]) for the launch's decode pipelines
    /// (one token, or a batch's rows), its prompt batches keeping the
    /// buffers it was made with.
    pub fn with_decode_bindings(
        mut self,
        gpu: &Gpu,
        kernels: &Kernels,
        buffers: &[wgpu::BindingResource<'_>],
    ) -> Self {
        let layout = kernels.layout(self.kernel);
        self.decode_bind_group = Some(gpu.bind_group(self.kernel.entry(), layout, buffers.iter().cloned()));
        self
    }

    /// The decode pipeline and its bind group.
    fn decode(&self) -> (&wgpu::ComputePipeline, &wgpu::BindGroup) {
        (
            self.decode_pipeline.as_ref().unwrap_or(&self.pipelines.decode),
            self.decode_bind_group.as_ref().unwrap_or(&self.bind_group),
        )
    }

    /// Rows of one workgroup of the tiled prefill pipeline the launch's
    /// batches run (`None`: it has none): `prefill_workgroups` covers the
    /// launch's rows in these.
    pub fn tiled_rows_per_wg(&self) -> Option<u32> {
        self.tiled().map(|t| t.rows)
    }

    /// The tiled prompt-batch pipeline the launch's batches run:
    /// `int8_matmul_coop` when given staging buffers, else `int8_matmul`.
    fn tiled(&self) -> Option<&super::pipelines::TiledPipeline> {
        match &self.staged {
            Some(_) => self.pipelines.coop.as_ref(),
            None => self.pipelines.tiled.as_ref(),
        }
    }

    /// The launch with `pipeline` as its prompt-batch program, serving
    /// `tokens` tokens a workgroup (attention_partial's, as the model and
    /// its KV cache take: [`Kernels::attention_prefill_for`]).
    pub(crate) fn with_prompt_pipeline(mut self, pipeline: wgpu::ComputePipeline, tokens: u32) -> Self {
        self.pipelines.per_token = Some(pipeline);
        self.pipelines.per_token_tokens = tokens;
        self
    }

    /// What this launch runs (for diagnostics).
    pub fn kind(&self) -> LaunchKind {
        LaunchKind { kernel: self.kernel, split: self.matvec_split }
    }

    /// Records the launch for one token (the decode step). The kernel set
    /// is the one the launch was made with (its pipelines are held).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, kernels: &Kernels) {
        self.record_batch(pass, kernels, 1);
    }

    /// Records the launch for `tokens` consecutive tokens (batched
    /// prefill): the grid's z dimension, which every batched kernel reads
    /// as the token's index in the batch (a matvec's prefill pipelines and
    /// `attention_prefill` as the index of its group of tokens,
    /// [`super::PREFILL_TOKENS_PER_WG`] and [`super::PREFILL_ATTENTION_TOKENS`],
    /// `int8_matmul` as that of its tile of tokens for a batch that fills
    /// one).
    pub fn record_batch(&self, pass: &mut wgpu::ComputePass<'_>, _kernels: &Kernels, tokens: u32) {
        let p = &self.pipelines;
        let batch = &self.bind_group;
        let (pipeline, group, grid, z) = match (tokens > 1, &p.per_token) {
            (true, Some(per_token)) => match self.tiled() {
                Some(tiled) if tokens >= tiled.min_tokens => match (&tiled.staged, &self.staged) {
                    (Some(staged), Some(s)) => {
                        let product = staged.product_for(s.rows, s.k_words, tokens);
                        let (grid, shape) = (self.prefill_workgroups, [s.rows, s.k_words]);
                        record_staged(pass, staged, product, &s.groups, shape, grid, tokens);
                        return;
                    }
                    _ => (&tiled.pipeline, batch, self.prefill_workgroups, tokens.div_ceil(tiled.tokens)),
                },
                _ => (per_token, batch, self.workgroups, tokens.div_ceil(p.per_token_tokens)),
            },
            _ => {
                let (pipeline, group) = self.decode();
                (pipeline, group, self.workgroups, tokens)
            }
        };
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, group, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2] * z);
    }

    /// Records the launch over `rows` decode rows of a batch of sessions'
    /// steps, each row computed as the decode pipeline computes one token:
    /// `all_rows` (a matvec pipeline whose workgroups run several rows each,
    /// [`Kernels::matvec_rows_pipeline`]) on the one-token grid times its
    /// z groups ([`super::batch_rows_per_z`]), or else the decode pipeline
    /// with row z in grid z.
    pub fn record_rows(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        all_rows: Option<&wgpu::ComputePipeline>,
        rows: u32,
    ) {
        let (decode, group) = self.decode();
        let (pipeline, z) = match (all_rows, self.matvec_split) {
            (Some(p), Some(split)) => (p, rows.div_ceil(super::batch_rows_per_z(split, rows))),
            _ => (decode, rows),
        };
        let grid = self.workgroups;
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, group, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2] * z);
    }
}

/// Splits a 1-D workgroup count over x and y (at most 65535 per dimension).
/// Kernels that can exceed the limit flatten `wg.x + wg.y * nwg.x` and
/// skip the overshoot.
pub fn grid(n: u32) -> [u32; 3] {
    const MAX: u32 = 65535;
    if n <= MAX {
        [n.max(1), 1, 1]
    } else {
        [MAX, n.div_ceil(MAX), 1]
    }
}

/// Rows per chunk when a matrix is bound in ranges: a multiple of 128
/// rows keeps every range offset aligned to 256 bytes (a row's int4
/// scales are 2 bytes a group of 64 values).
pub fn chunk_rows(row_bytes: usize, max_binding: u64) -> usize {
    let rows = (max_binding as usize / row_bytes.max(1)) / 128 * 128;
    rows.max(128)
}

#[cfg(test)]
mod tests {
    use super::{staged_bindings, staged_parts};
    use crate::kernels::matmul::{staged_input_bytes, staged_weight_bytes, F16_STAGE_WGSL, MATMUL_COOP_WGSL};

    /// `(binding, access, name, type)` of every `@group(0)` declaration in
    /// `wgsl`.
    fn bindings(wgsl: &str) -> Vec<(u32, String, String, String)> {
        wgsl.lines()
            .filter_map(|l| l.trim().strip_prefix("@group(0) @binding("))
            .map(|rest| {
                let (n, rest) = rest.split_once(')').unwrap();
                let access = rest.split_once('<').unwrap().1.split_once('>').unwrap().0.to_string();
                let (name, ty) = rest.split_once('>').unwrap().1.split_once(':').unwrap();
                (
                    n.parse().unwrap(),
                    access,
                    name.trim().to_string(),
                    ty.trim().trim_end_matches(';').to_string(),
                )
            })
            .collect()
    }

    /// The two launches of a cooperative-matrix product bind what their
    /// programs declare: the staging writes binding 4, the staging range,
    /// whose parts the product reads as `w16` and `x16`, both as f16; the
    /// product writes the launch's `y`, and no launch binds the buffer it
    /// writes at another slot.
    #[test]
    fn the_staged_launches_bind_what_their_programs_declare() {
        let stage = bindings(F16_STAGE_WGSL);
        let product = bindings(MATMUL_COOP_WGSL);
        let written = |decls: &[(u32, String, String, String)]| -> Vec<u32> {
            decls.iter().filter(|d| d.1.contains("read_write")).map(|d| d.0).collect()
        };
        assert_eq!(written(&stage), [4], "{stage:?}");
        assert_eq!(written(&product), [4], "{product:?}");
        let slot = |name: &str| product.iter().find(|d| d.2 == name).map(|d| (d.0, d.3.clone())).unwrap();
        assert_eq!(slot("x16"), (1, "array<f16>".into()));
        assert_eq!(slot("w16"), (2, "array<f16>".into()));
        assert_eq!(slot("y").0, 4);
        let matvec = ["params", "x", "w", "scales", "y", "norm_w", "x16 (residual)"];
        let [staging, prod] = staged_bindings(matvec, ["staged", "w16", "x16"]);
        assert_eq!(staging[4], "staged");
        assert_eq!((prod[1], prod[2], prod[4]), ("x16", "w16", "y"));
        // What the staging reads is the matvec launch's own buffers.
        assert_eq!(staging[..4], matvec[..4]);
        assert_eq!(staging[5], "norm_w");
        assert_eq!((staging[6], prod[6]), (matvec[6], matvec[6]));
        for launch in [staging, prod] {
            let out = launch[4];
            assert_eq!(launch.iter().filter(|b| **b == out).count(), 1, "{launch:?}");
        }
    }

    /// The staging range holds the weights' part, then the inputs', each
    /// where the staging program writes it (the inputs at the weights'
    /// bytes, tests/it/kernels.rs), at offsets a storage binding may take.
    #[test]
    fn the_staging_parts_tile_the_range() {
        for (rows, k_words, tokens) in [(70, 64, 70), (1024, 256, 256), (151_936, 256, 1), (13, 64, 128)] {
            let [(o, n), (wo, wn), (xo, xn)] = staged_parts(rows, k_words, tokens);
            assert_eq!((o, wo, wn), (0, 0, staged_weight_bytes(rows as usize, k_words as usize)));
            assert_eq!((xo, xo + xn), (wn, n));
            assert_eq!(xn, staged_input_bytes(tokens as usize, k_words as usize));
            assert!(xo.is_multiple_of(256) && wn > 0 && xn > 0);
        }
    }
}
