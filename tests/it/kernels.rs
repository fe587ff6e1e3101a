//! Every WGSL kernel against a CPU reference, on random non-zero inputs, at
//! several shapes (including ones that are not multiples of the workgroup
//! or subgroup size), in both reduction variants (subgroup and workgroup
//! memory), in every matvec layout. Outputs are poisoned with NaN before
//! each run so an unwritten element fails. The cases and references are
//! the ones the MSL twins run (tests/it/common).

use crate::common;

use common::cases::{
    argmax_case, argmax_never_writes_past_the_token_array, assert_matvec, attention_case,
    attention_case_int8, attention_case_rows, attention_params, attention_reduce_case, attention_step_case,
    attention_step_case_int8, matmul_case_for, matmul_case_in, matvec_case, matvec_case_in, matvec_case_x16,
    qk_norm_rope_case, qk_norm_rope_case_int8, step, to_u32, u32s, Sums, ATTENTION_INT8_SHAPES,
    ATTENTION_REDUCE_SHAPES, ATTENTION_SHAPES, ATTENTION_STEP_CHUNKED_SHAPES, ATTENTION_STEP_DIRECT_SHAPES,
    ATTENTION_STEP_INT8_SHAPES, QK_NORM_ROPE_INT8_SHAPES, QK_NORM_ROPE_SHAPES,
};
use common::reference::*;
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, OnceLock};

use half::f16;
use qwen3_wgpu::internals::converted::QUANT_GROUP;
use qwen3_wgpu::internals::kernels::{
    self, Bind, Constants, EmbedParams, Kernel, MatmulConstants, MatmulTile, MatvecConstants, MatvecLayout,
    MatvecShape, MatvecSplit, WG,
};
use qwen3_wgpu::{AdapterPolicy, Gpu, WeightFormat};
use rand::{rngs::StdRng, SeedableRng};

/// One device for every kernel test of the process: their pipelines are
/// cached (see [`compiled`]), and a pipeline belongs to its device.
fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    // With cooperative matrices where the adapter has them, else f16 where
    // it has that (lavapipe does): the programs written for them run there,
    // or their emulations.
    GPU.get_or_init(|| {
        Gpu::new_with(AdapterPolicy::Portable, true, true).expect("a Vulkan adapter (lavapipe in CI)")
    })
}

/// `entry` of `source` compiled with `constants` for `kernel`'s bindings on
/// [`gpu`]'s device, once per process: the cases run one program at many
/// shapes, and compiling it (naga, then the driver) costs far more on
/// lavapipe than running it.
fn compiled(
    gpu: &Gpu,
    kernel: Kernel,
    source: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> (wgpu::ComputePipeline, wgpu::BindGroupLayout) {
    type Cache = Mutex<HashMap<String, (wgpu::ComputePipeline, wgpu::BindGroupLayout)>>;
    static CACHE: LazyLock<Cache> = LazyLock::new(Default::default);
    assert!(std::ptr::eq(gpu, self::gpu()), "kernel tests share one device");
    let key = format!("{entry}\n{constants:?}\n{:?}\n{source}", kernel.bindings());
    if let Some(hit) = CACHE.lock().unwrap().get(&key) {
        return hit.clone();
    }
    // Compiled without the lock: other tests compile meanwhile.
    let made =
        kernels::compile(gpu, entry, source, entry, kernel.bindings(), constants).expect("kernel compiles");
    CACHE.lock().unwrap().entry(key).or_insert(made).clone()
}

fn variants(gpu: &Gpu) -> Vec<bool> {
    if gpu.device.features().contains(wgpu::Features::SUBGROUP) {
        vec![true, false]
    } else {
        vec![false]
    }
}

/// Runs `kernel` once: `uniforms` and `storage` fill the kernel's bindings
/// in order; returns the contents of every read_write buffer, in order.
fn dispatch(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    workgroups: u32,
) -> Vec<Vec<u8>> {
    let layout = MatvecLayout::RowsPerTeam;
    dispatch_grid(gpu, kernel, subgroups, layout, uniforms, storage, kernels::grid(workgroups))
}

/// [`dispatch`] with an explicit matvec layout and (x, y, z) grid.
fn dispatch_grid(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
    layout: MatvecLayout,
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    grid: [u32; 3],
) -> Vec<Vec<u8>> {
    dispatch_with(gpu, kernel, subgroups, &kernel.constants(layout), uniforms, storage, grid)
}

/// [`dispatch_grid`] with explicit override constants.
fn dispatch_with(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
    constants: &[(&str, f64)],
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    grid: [u32; 3],
) -> Vec<Vec<u8>> {
    dispatch_source(
        gpu,
        kernel,
        (kernel.source(subgroups), kernel.entry()),
        constants,
        uniforms,
        storage,
        grid,
    )
}

/// [`dispatch_with`] for an explicit (source, entry point).
fn dispatch_source(
    gpu: &Gpu,
    kernel: Kernel,
    (source, entry): (String, &str),
    constants: &[(&str, f64)],
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    grid: [u32; 3],
) -> Vec<Vec<u8>> {
    let (pipeline, layout) = compiled(gpu, kernel, &source, entry, constants);
    let (mut u, mut s) = (uniforms.iter(), storage.iter());
    let bufs: Vec<(Bind, wgpu::Buffer, usize)> = kernel
        .bindings()
        .iter()
        .map(|b| match b {
            Bind::Uniform => {
                let d = u.next().expect("enough uniforms");
                (*b, gpu.uniform("u", d).unwrap(), d.len())
            }
            _ => {
                let d = s.next().expect("enough storage buffers");
                (*b, gpu.storage_init("s", d).unwrap(), d.len())
            }
        })
        .collect();
    assert!(u.next().is_none() && s.next().is_none(), "binding count mismatch");
    let entries: Vec<_> = bufs
        .iter()
        .enumerate()
        .map(|(i, (_, b, _))| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
        .collect();
    let bg = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &layout,
        entries: &entries,
    });
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
    }
    gpu.queue.submit([enc.finish()]);
    let out = bufs
        .iter()
        .filter(|(b, _, _)| *b == Bind::ReadWrite)
        .map(|(_, buf, len)| gpu.download(buf, *len).unwrap())
        .collect();
    gpu.check_fault().unwrap();
    out
}

/// A [`common::cases::Run`] over the WGSL kernels, compiled with
/// `constants` (the uniforms are the leading buffers of the binding order).
fn wgsl_run<'a>(
    gpu: &'a Gpu,
    subgroups: bool,
    constants: impl Fn(Kernel) -> Vec<(&'static str, f64)> + 'a,
) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    move |k, grid, buffers| {
        let (uniforms, storage) = split_buffers(k, buffers);
        let source = (k.source(subgroups), k.entry());
        dispatch_source(gpu, k, source, &constants(k), &uniforms, &storage, grid)
    }
}

/// [`wgsl_run`] over the matvec variants' tiled prefill kernel
/// (int8_matmul) in register tiling `tile`.
fn matmul_run(gpu: &Gpu, tile: MatmulTile) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + '_ {
    move |k, grid, buffers| {
        let (uniforms, storage) = split_buffers(k, buffers);
        let c = MatmulConstants { tile, ..k.matmul_constants().expect("a matvec variant") };
        dispatch_source(gpu, k, (c.source(), "int8_matmul"), &c.render(), &uniforms, &storage, grid)
    }
}

/// A kernel's buffers (in binding order) split into uniforms and storage.
fn split_buffers(k: Kernel, buffers: &[Vec<u8>]) -> (Vec<&[u8]>, Vec<Vec<u8>>) {
    let binds = k.bindings();
    let uniforms =
        buffers.iter().zip(binds).filter(|(_, b)| **b == Bind::Uniform).map(|(d, _)| &d[..]).collect();
    let storage =
        buffers.iter().zip(binds).filter(|(_, b)| **b != Bind::Uniform).map(|(d, _)| d.clone()).collect();
    (uniforms, storage)
}

#[test]
fn int8_matvec_matches_cpu() {
    let gpu = gpu();
    let per_wg = kernels::PREFILL_TOKENS_PER_WG as usize;
    let mut seed = 1;
    for sub in variants(gpu) {
        // Rows not a multiple of the 4 rows per team or the 8 per workgroup,
        // K not a multiple of a team's stride (lavapipe: 8 lanes x 16 values);
        // one token (decode), a batch of 3 (prefill, grid z), or whole
        // groups of tokens for the prefill pipelines.
        // The last flag: the decode pipelines also specialised to the
        // launch's shape (the same code with the shape compiled in; three
        // shapes cover rows not a multiple of 4, a padded group, K beyond
        // a split-K workgroup's lanes and several tokens).
        let shapes = [
            (2, 64, 1, false, false),
            (6, 96, 3, false, true),
            (10, 1000, 1, false, false),
            (66, 128, 3, false, false),
            (130, 1024, 1, false, true),
            (18, 3072, 3, false, true),
            (4, 2048, 1, false, false),
            (6, 96, per_wg, true, false),
            (66, 1000, 2 * per_wg, true, false),
        ];
        for &(rows, cols, tokens, prefill, specialise) in &shapes {
            let kernels = Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some());
            // Every split the engine can pick (rows per team; split K at each
            // of its workgroup sizes, and its long matrices' rows per team);
            // prefill pipelines per device layout.
            let splits = [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK]
                .into_iter()
                .flat_map(|layout| if prefill { vec![layout.splits()[0]] } else { layout.splits() })
                // (Pairing is int4's: an int8 pipeline runs the same code unpaired.)
                .filter(|s| !s.paired)
                .collect::<Vec<_>>();
            // Decode pipelines also specialised to the launch's shape (its
            // SHAPE_* constants; what the engine runs), as
            // `Kernels::matvec_pipeline` builds them.
            let groups = usize::div_ceil(cols, QUANT_GROUP);
            let shape = MatvecShape {
                rows: rows as u32,
                k_words: (groups * QUANT_GROUP / 4) as u32,
                groups: groups as u32,
                n_in: cols as u32,
            };
            let shapes = if specialise { vec![None, Some(shape)] } else { vec![None] };
            let mut cases = Vec::new();
            for k in kernels {
                for &s in &splits {
                    cases.extend(shapes.iter().map(|&sh| (k, s, sh)));
                }
            }
            for (kernel, split, shape) in cases {
                let MatvecSplit { layout, workgroup_size: wg, rows_per_wg, x16, paired } = split;
                let constants = move |k: Kernel| {
                    if prefill {
                        k.prefill_constants(layout)
                    } else {
                        let mut c = k.split_constants(split);
                        c.extend(shape.iter().flat_map(|s| s.constants()));
                        c
                    }
                };
                let run = wgsl_run(gpu, sub, constants);
                seed += 1;
                let tokens_per_wg = if prefill { per_wg } else { 1 };
                // The engine sizes the grid for the decode layout, also for prefill.
                let res = if x16 && !prefill {
                    matvec_case_x16(&run, kernel, rows_per_wg, 1, rows, cols, tokens, seed)
                } else {
                    matvec_case(&run, kernel, rows_per_wg, tokens_per_wg, rows, cols, tokens, seed)
                };
                let specialised = shape.is_some();
                assert_matvec(
                    &format!("{kernel:?} {layout:?} wg {wg} rows/wg {rows_per_wg} x16={x16} paired={paired} {rows}x{cols} prefill={prefill} specialised={specialised} sub={sub}"),
                    &res,
                );
            }
        }
    }
}

/// The matvec over int4 weights (`INT4`) against the CPU reference, in
/// every variant and every split the engine can pick (rows per team; split
/// K at each workgroup size, and its long matrices' rows per team), the
/// decode pipelines general and (one shape) specialised to the launch's
/// shape, and the per-token prefill pipelines: rows not a multiple of a
/// team or workgroup, K of one step, of a padded group, and of more steps
/// than a split-K workgroup has lanes; random values in -8..=7 with both
/// extremes, poisoned outputs. Fewer shapes than the int8 test: the
/// layouts and epilogues are the same code, only the steps differ.
#[test]
fn int4_matvec_matches_cpu() {
    let gpu = gpu();
    let per_wg = kernels::PREFILL_TOKENS_PER_WG as usize;
    let sub = variants(gpu)[0];
    let mut seed = 900;
    let shapes = [
        (6, 96, 3, false),
        (10, 1000, 1, false),
        (14, 64 * 70, 1, false),
        (6, 96, per_wg, true),
        (18, 160, 2 * per_wg, true),
    ];
    for &(rows, cols, tokens, prefill) in &shapes {
        let groups = usize::div_ceil(cols, QUANT_GROUP);
        let shape = MatvecShape {
            rows: rows as u32,
            k_words: (groups * QUANT_GROUP / 4) as u32,
            groups: groups as u32,
            n_in: cols as u32,
        };
        for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
            let variant = kernel.matvec_variant().unwrap();
            for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
                let splits = if prefill { vec![layout.default_split()] } else { layout.splits() };
                for split in splits {
                    let constants = if prefill {
                        MatvecConstants::prefill(variant, layout)
                    } else {
                        let shape = (cols == 1000).then_some(shape);
                        MatvecConstants { shape, ..MatvecConstants::decode(variant, split) }
                    };
                    let constants = MatvecConstants { format: WeightFormat::Int4, ..constants };
                    let run = wgsl_run(gpu, sub, move |_| constants.render());
                    seed += 1;
                    let tokens_per_wg = if prefill { per_wg } else { 1 };
                    let (x16, rpw) = (split.x16 && !prefill, split.rows_per_wg);
                    let res = matvec_case_in(
                        &run,
                        kernel,
                        WeightFormat::Int4,
                        x16,
                        rpw,
                        tokens_per_wg,
                        rows,
                        cols,
                        tokens,
                        seed,
                    );
                    assert_matvec(
                        &format!("int4 {kernel:?} {split:?} {rows}x{cols} x{tokens} prefill={prefill}"),
                        &res,
                    );
                }
            }
        }
    }
}

/// The batched decode rows (`DECODE_ROWS`) over int4 weights match the CPU
/// reference and, bit for bit, the one-token pipeline (each session's
/// tokens are those it gets alone), in every split and epilogue.
#[test]
fn int4_matvec_decode_rows_match_one_token_bit_for_bit() {
    let gpu = gpu();
    let sub = variants(gpu)[0];
    let mut seed = 950;
    let (rows, cols, n) = (66usize, 1000usize, 5usize);
    let groups = usize::div_ceil(cols, QUANT_GROUP);
    let shape = MatvecShape {
        rows: rows as u32,
        k_words: (groups * QUANT_GROUP / 4) as u32,
        groups: groups as u32,
        n_in: cols as u32,
    };
    let splits = [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK].into_iter().flat_map(|l| l.splits());
    for split in splits {
        for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
            seed += 1;
            let one = MatvecConstants {
                shape: Some(shape),
                format: WeightFormat::Int4,
                ..MatvecConstants::decode(kernel.matvec_variant().unwrap(), split)
            };
            let per_z = kernels::batch_rows_per_z(split, n as u32);
            let all = MatvecConstants { decode_rows: n as u32, rows_per_z: per_z, ..one };
            let case = |c: MatvecConstants, tokens_per_wg: usize| {
                let run = wgsl_run(gpu, sub, move |_| c.render());
                let rpw = split.rows_per_wg;
                matvec_case_in(
                    &run,
                    kernel,
                    WeightFormat::Int4,
                    split.x16,
                    rpw,
                    tokens_per_wg,
                    rows,
                    cols,
                    n,
                    seed,
                )
            };
            let alone = case(one, 1);
            let batched = case(all, per_z as usize);
            let what = format!("int4 {kernel:?} {split:?} {rows}x{cols} rows {n} per z {per_z}");
            assert_matvec(&what, &batched);
            for (z, (a, b)) in alone.iter().zip(&batched).enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a.0), bits(&b.0), "{what}: row {z} differs from its one-token run");
            }
        }
    }
}

/// The tiled prefill kernel (int8_matmul) over int4 weights, in the base
/// and the default tiling, every epilogue, against the CPU reference (rows
/// and tokens not multiples of the tile, the spare tokens' inputs NaN).
#[test]
fn int4_matmul_matches_cpu() {
    let gpu = gpu();
    let mut seed = 980;
    for &(rows, cols, tiles, short) in &[(6usize, 96usize, 1usize, 0usize), (66, 1000, 2, 5)] {
        for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
            let tokens = tiles * kernels::MATMUL_TOKENS_PER_WG as usize - short;
            for tile in [MatmulTile::BASE, MatmulTile::DEFAULT] {
                seed += 1;
                let c = MatmulConstants {
                    tile,
                    format: WeightFormat::Int4,
                    ..kernel.matmul_constants().expect("a matvec variant")
                };
                let run = move |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
                    let (uniforms, storage) = split_buffers(k, buffers);
                    dispatch_source(
                        gpu,
                        k,
                        (c.source(), "int8_matmul"),
                        &c.render(),
                        &uniforms,
                        &storage,
                        grid,
                    )
                };
                let (rpw, tpw) = (c.rows(), c.tokens() as usize);
                let res =
                    matmul_case_for(&run, kernel, WeightFormat::Int4, rpw, tpw, rows, cols, tokens, seed);
                assert_matvec(
                    &format!("int4 int8_matmul {} {kernel:?} {rows}x{cols} x{tokens}", tile.name()),
                    &res,
                );
            }
        }
    }
}

/// The tiled prefill kernel (int8_matmul) in every tiling (its tile of rows
/// x tokens and register tile) and every epilogue, on the tiling's grid:
/// row counts not multiples of the tile (and odd ones),
/// token counts not multiples of it (the buffers hold whole tiles, the
/// spare tokens' inputs NaN), one to three token tiles, K of 1 to 32 quant
/// groups, outputs poisoned before the run. Each tiling matches the CPU
/// reference and, bit for bit, the 4 x 4 tile (every tiling computes each
/// output as the same sum in the same order).
#[test]
fn int8_matmul_matches_cpu_and_the_4x4_tile_bit_for_bit() {
    let gpu = gpu();
    let mut seed = 100;
    let shapes = [(6, 96, 1, 0), (66, 1000, 2, 5), (130, 64, 1, 29), (40, 2048, 1, 0), (20, 160, 3, 31)];
    for &(rows, cols, tiles, short) in &shapes {
        for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
            // Whole tiles of the largest tile's tokens (the activation
            // buffers' multiple), less `short`.
            let tokens = tiles * kernels::MATMUL_TOKENS_PER_WG as usize - short;
            seed += 1;
            let case = |tile: MatmulTile| {
                let run = matmul_run(gpu, tile);
                let c = MatmulConstants { tile, ..kernel.matmul_constants().expect("a matvec variant") };
                let res =
                    matmul_case_in(&run, kernel, c.rows(), c.tokens() as usize, rows, cols, tokens, seed);
                let what = format!("int8_matmul {} {kernel:?} {rows}x{cols} x{tokens}", tile.name());
                assert_matvec(&what, &res);
                (what, res)
            };
            let (_, base) = case(MatmulTile::BASE);
            // The residual add's epilogue is per output, whatever tile owns
            // it: every tiling under the normed variants (the norm's sums
            // and SwiGLU's halved tokens are the tiling's own), the
            // default one under all three.
            let tilings = MatmulTile::all().into_iter().filter(|(_, t)| {
                *t != MatmulTile::BASE
                    && (kernel != Kernel::Int8MatvecAccumulate || *t == MatmulTile::DEFAULT)
            });
            for (_, tile) in tilings {
                let (what, res) = case(tile);
                for (z, ((got, _, _), (want, _, _))) in res.iter().zip(&base).enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(want), "{what} token {z}: not the 4x4 tile's bits");
                }
            }
        }
    }
}

#[test]
fn embed_lookup_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(4);
    for &(rows, cols) in &[(10usize, 64usize), (77, 96), (1000, 1024)] {
        let m = random_quant(&mut rng, rows, cols);
        for &(token, row_start, row_end) in
            &[(0u32, 0u32, rows as u32), (rows as u32 - 1, 0, rows as u32), (5, 4, 9), (9, 4, 9), (3, 4, 9)]
        {
            // The kernel binds a chunk: the table from row_start on.
            let chunk = Quant {
                rows: (row_end - row_start) as usize,
                cols,
                padded: m.padded,
                format: m.format,
                q: m.q[row_start as usize * m.padded..row_end as usize * m.padded].to_vec(),
                scales: m.scales[row_start as usize * m.groups()..row_end as usize * m.groups()].to_vec(),
            };
            let params =
                EmbedParams { k_words: m.k_words() as u32, groups: m.groups() as u32, row_start, row_end };
            // The token is read at the GPU's position (2) of the sequence.
            let tokens = [7u32, 8, token, 9];
            let out = dispatch(
                gpu,
                Kernel::EmbedLookup,
                false,
                &[bytemuck::bytes_of(&params)],
                &[
                    step(2, 3),
                    bytemuck::cast_slice(&tokens).to_vec(),
                    chunk.data(),
                    chunk.scale_blob(),
                    poisoned(m.padded),
                    poisoned(m.padded / 2),
                ],
                (m.padded as u32 / 4).div_ceil(WG),
            );
            let got = to_f32(&out[0]);
            let words16 = to_u32(&out[1]);
            if token >= row_start && token < row_end {
                let want: Vec<f64> =
                    (0..m.padded).map(|c| if c < cols { m.w(token as usize, c) } else { 0.0 }).collect();
                let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1e-3).collect();
                assert_close(&format!("embed {rows}x{cols} token {token}"), &got, &want, &scale, 1e-6);
                let want16: Vec<f64> = got.iter().map(|v| f16::from_f32(*v).to_f64()).collect();
                let got16 = unpack_f16(&out[1]);
                assert_close(
                    &format!("embed {rows}x{cols} token {token} (f16)"),
                    &got16,
                    &want16,
                    &scale,
                    1e-6,
                );
            } else {
                assert!(got.iter().all(|v| v.to_bits() == POISON), "a chunk without the token wrote");
                assert!(words16.iter().all(|w| *w == POISON), "a chunk without the token wrote its f16 copy");
            }
        }
    }
}

#[test]
fn embed_lookup_batches_tokens_from_the_position() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(14);
    let (rows, cols) = (40usize, 96usize);
    let m = random_quant(&mut rng, rows, cols);
    let tokens = [7u32, 8, 31, 0, 39, 5];
    let params = EmbedParams {
        k_words: m.k_words() as u32,
        groups: m.groups() as u32,
        row_start: 0,
        row_end: rows as u32,
    };
    let out = dispatch_grid(
        gpu,
        Kernel::EmbedLookup,
        false,
        MatvecLayout::RowsPerTeam,
        &[bytemuck::bytes_of(&params)],
        &[
            step(2, 6),
            bytemuck::cast_slice(&tokens).to_vec(),
            m.data(),
            m.scale_blob(),
            poisoned(3 * m.padded),
            poisoned(3 * m.padded / 2),
        ],
        [(m.padded as u32 / 4).div_ceil(WG), 1, 3],
    );
    let got = to_f32(&out[0]);
    let got16 = unpack_f16(&out[1]);
    for z in 0..3 {
        let t = tokens[2 + z] as usize;
        let want: Vec<f64> = (0..m.padded).map(|c| if c < cols { m.w(t, c) } else { 0.0 }).collect();
        let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1e-3).collect();
        let row = z * m.padded..(z + 1) * m.padded;
        assert_close(&format!("batched embed token {z}"), &got[row.clone()], &want, &scale, 1e-6);
        // The residual's f16 copy: the same row, rounded to f16.
        let want16: Vec<f64> = got[row.clone()].iter().map(|v| f16::from_f32(*v).to_f64()).collect();
        assert_close(&format!("batched embed token {z} (f16)"), &got16[row], &want16, &scale, 1e-6);
    }
}

#[test]
fn argmax_matches_cpu_with_lowest_index_on_ties_and_advances_the_step() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| k.constants(MatvecLayout::RowsPerTeam));
        // Chunks not a multiple of the workgroup size, the vocabulary.
        for &(n, chunk) in
            &[(1usize, 1000u32), (7, 1000), (255, 1000), (1000, 1000), (151936, 1000), (151936, 1024)]
        {
            for ties in [false, true] {
                argmax_case(&run, n, chunk, ties, &mut rng);
            }
        }
        argmax_never_writes_past_the_token_array(&run);
    }
}

#[test]
fn qk_norm_rope_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(6);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| k.constants(MatvecLayout::RowsPerTeam));
        for shape in QK_NORM_ROPE_SHAPES {
            qk_norm_rope_case(&run, shape, &mut rng);
        }
    }
}

#[test]
fn attention_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| k.constants(MatvecLayout::RowsPerTeam));
        for shape in ATTENTION_SHAPES {
            attention_case(&run, shape, &mut rng);
        }
    }
}

/// qk_norm_rope writing an int8 KV cache (`KV_INT8`): rows within half a
/// quantisation step of the reference, the rows' scales, a row of zeros.
#[test]
fn qk_norm_rope_int8_kv_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| {
            let mut c = k.constants(MatvecLayout::RowsPerTeam);
            if k == Kernel::QkNormRope {
                c.push(("KV_INT8", 1.0));
            }
            c
        });
        for shape in QK_NORM_ROPE_INT8_SHAPES {
            qk_norm_rope_case_int8(&run, shape, &mut rng);
        }
    }
}

/// attention_partial over an int8 KV cache (`KV_INT8`): the prompt variant
/// with the reduce, and the fused decode step (direct and chunked), which
/// also writes the new position's int8 rows and scales.
#[test]
fn attention_int8_kv_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(29);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| {
            let mut c = with_packed(k, k.constants(MatvecLayout::RowsPerTeam));
            if matches!(k, Kernel::AttentionPartial | Kernel::AttentionStep | Kernel::AttentionStepDirect) {
                c.push(("KV_INT8", 1.0));
            }
            c
        });
        for shape in ATTENTION_INT8_SHAPES {
            attention_case_int8(&run, shape, 1, &mut rng);
        }
        // And 83 chunks, the context not a multiple of the chunk.
        let long = (Kernel::AttentionStep, (1, 1, 16, 21_000, 20_999));
        for (kernel, shape) in ATTENTION_STEP_INT8_SHAPES.into_iter().chain([long]) {
            attention_step_case_int8(&run, kernel, shape, &mut rng);
        }
    }
}

/// attention_reduce alone: rising chunk maxima, NaN in the chunks past the
/// context, more chunks than one pass of its loads covers.
#[test]
fn attention_reduce_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(17);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| k.constants(MatvecLayout::RowsPerTeam));
        for shape in ATTENTION_REDUCE_SHAPES {
            attention_reduce_case(&run, shape, &mut rng);
        }
    }
}

/// The prompt-batch pipeline of attention_partial (attention_prefill) on
/// the prompt-batch cases and on batches that are no multiple of its
/// tokens per workgroup (contexts across a chunk edge, head_dims of one,
/// two and part of a second 128-dim half, GQA ratios of 1 to 4, a chunk
/// whose last positions are live and spans cut short): each token against
/// the CPU reference, its partial results poisoned before the run.
#[test]
fn attention_prefill_matches_cpu() {
    // (heads, kv heads, head_dim, capacity, context of the first token, tokens)
    let prefill_shapes = [
        (4, 1, 64, 600, 240, 21),   // contexts 240..260: across a chunk edge
        (2, 1, 256, 300, 250, 40),  // two halves of V a span, two groups of tokens
        (6, 3, 40, 40, 1, 19),      // from the first position, an odd number of K quads per row
        (2, 2, 128, 520, 500, 13),  // contexts 500..512: the last two positions of the second chunk
        (4, 1, 200, 530, 190, 70),  // 9 quads in the second half, three groups, 3 chunks
        (16, 8, 128, 600, 257, 33), // the 0.6B model's heads
    ];
    let shapes: Vec<_> = ATTENTION_SHAPES.iter().copied().chain(prefill_shapes).collect();
    let rows_multiple = kernels::PREFILL_ATTENTION_TOKENS as usize; // as the engine's batch buffers
    let gpu = gpu();
    for sub in variants(gpu) {
        let plain = wgsl_run(gpu, sub, |k| k.constants(MatvecLayout::RowsPerTeam));
        let run = |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
            if k != Kernel::AttentionPartial {
                return plain(k, grid, buffers);
            }
            let (uniforms, storage) = split_buffers(k, buffers);
            let (source, constants) = kernels::attention_prefill_source(sub);
            let grid = [grid[0], grid[1], grid[2].div_ceil(kernels::PREFILL_ATTENTION_TOKENS)];
            dispatch_source(gpu, k, (source, "attention_prefill"), &constants, &uniforms, &storage, grid)
        };
        let mut rng = StdRng::seed_from_u64(12);
        for &shape in &shapes {
            attention_case_rows(&run, shape, rows_multiple, Sums::F32, &mut rng);
        }
        // Over an int8 KV cache (`KV_INT8`; head_dim a multiple of 16).
        let int8 = |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
            if k != Kernel::AttentionPartial {
                return plain(k, grid, buffers);
            }
            let (uniforms, storage) = split_buffers(k, buffers);
            let (source, mut constants) = kernels::attention_prefill_source(sub);
            constants.push(("KV_INT8", 1.0));
            let grid = [grid[0], grid[1], grid[2].div_ceil(kernels::PREFILL_ATTENTION_TOKENS)];
            dispatch_source(gpu, k, (source, "attention_prefill"), &constants, &uniforms, &storage, grid)
        };
        for shape in [
            (4, 1, 64, 600, 240, 21),
            (2, 1, 256, 300, 250, 40),
            (4, 1, 208, 530, 190, 70),
            (16, 8, 128, 600, 257, 33),
        ] {
            attention_case_int8(&int8, shape, rows_multiple, &mut rng);
        }
    }
}

/// attention_prefill's tile program (the engine's prompt attention on
/// cooperative-matrix devices over an f16 cache), where the device has no
/// cooperative matrices in its emulation (the same tiles, staging, softmax
/// and stores with scalar sums). Each token
/// against the CPU reference (q exact in f16), its partial results
/// poisoned: contexts across chunk edges and 16-position tiles, a chunk
/// that ends at a capacity inside a tile (the last KV head's rows past it
/// lie past the buffer), head_dims of 3 to 16 tiles, GQA ratios of 1 to
/// 4, 83 chunks.
#[test]
fn attention_prefill_tiles_match_cpu() {
    let gpu = gpu();
    assert!(gpu.coop, "cooperative matrices, or f16 to emulate them (lavapipe has f16)");
    // (heads, kv heads, head_dim, capacity, context of the first token, tokens)
    let shapes = [
        (4, 1, 64, 600, 240, 21),       // contexts 240..260: across a chunk edge
        (2, 1, 256, 300, 250, 40),      // the largest head_dim, three groups of tokens
        (6, 3, 48, 40, 1, 19),          // from the first position, one to two tiles
        (2, 1, 64, 300, 280, 20),       // up to the capacity, 12 positions into a tile
        (2, 2, 128, 520, 500, 13),      // the last two positions of the second chunk
        (4, 1, 208, 530, 190, 70),      // 13 dim tiles, five groups, 3 chunks
        (16, 8, 128, 600, 257, 33),     // the 0.6B model's heads
        (2, 1, 64, 21_000, 20_990, 10), // 83 chunks
    ];
    let per_wg = kernels::PREFILL_TILE_ATTENTION_TOKENS;
    let plain = wgsl_run(gpu, false, |k| k.constants(MatvecLayout::RowsPerTeam));
    let run = |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
        if k != Kernel::AttentionPartial {
            return plain(k, grid, buffers);
        }
        let (uniforms, storage) = split_buffers(k, buffers);
        let source = kernels::attention_prefill_tiles_source(gpu.coop_emulated);
        let constants = Constants::Workgroup(WG).render();
        let grid = [grid[0], grid[1], grid[2].div_ceil(per_wg)];
        dispatch_source(gpu, k, (source, "attention_prefill"), &constants, &uniforms, &storage, grid)
    };
    let mut rng = StdRng::seed_from_u64(31);
    for shape in shapes {
        attention_case_rows(&run, shape, per_wg as usize, Sums::F16_TILES, &mut rng);
    }
}

/// `constants` of `k`, with the chunked decode step's pipeline the packed
/// one (the cases' uniform packs from position 0 where the GQA group
/// allows): its unpacked pipeline gives the same bits
/// (`attention_packed_heads_equal_unpacked_bit_for_bit`).
fn with_packed(k: Kernel, mut constants: Vec<(&'static str, f64)>) -> Vec<(&'static str, f64)> {
    if k == Kernel::AttentionStep {
        constants.push(("PACKED", 1.0));
    }
    constants
}

#[test]
fn attention_step_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    for sub in variants(gpu) {
        let run = wgsl_run(gpu, sub, |k| with_packed(k, k.constants(MatvecLayout::RowsPerTeam)));
        for shape in ATTENTION_STEP_DIRECT_SHAPES {
            attention_step_case(&run, Kernel::AttentionStepDirect, shape, &mut rng);
        }
        for shape in ATTENTION_STEP_CHUNKED_SHAPES {
            attention_step_case(&run, Kernel::AttentionStep, shape, &mut rng);
        }
    }
}

/// The WGSL of every kernel declares exactly the bindings the Rust table
/// lists (same indices, same address space and access).
#[test]
fn wgsl_bindings_match_the_kernel_table() {
    for k in Kernel::ALL {
        let matmul = k.matmul_source().map(|(src, _)| src);
        for src in [k.source(true), k.source(false)].into_iter().chain(matmul) {
            let module = naga::front::wgsl::parse_str(&src).expect("parses");
            let mut found: Vec<(u32, Bind)> = module
                .global_variables
                .iter()
                .filter_map(|(_, g)| {
                    let b = g.binding.as_ref()?;
                    assert_eq!(b.group, 0, "{}: only group 0 is used", k.entry());
                    let kind = match g.space {
                        naga::AddressSpace::Uniform => Bind::Uniform,
                        naga::AddressSpace::Storage { access }
                            if access.contains(naga::StorageAccess::STORE) =>
                        {
                            Bind::ReadWrite
                        }
                        naga::AddressSpace::Storage { .. } => Bind::Read,
                        other => panic!("{}: unexpected space {other:?}", k.entry()),
                    };
                    Some((b.binding, kind))
                })
                .collect();
            found.sort_by_key(|(i, _)| *i);
            let want: Vec<(u32, Bind)> =
                k.bindings().iter().enumerate().map(|(i, b)| (i as u32, *b)).collect();
            assert_eq!(found, want, "{}", k.entry());
        }
    }
}

/// The quant group size lives in weights.rs; the kernels get it as an override.
#[test]
fn group_size_reaches_the_kernels() {
    let users = Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some() || *k == Kernel::EmbedLookup);
    for k in users {
        let c = k.constants(MatvecLayout::RowsPerTeam);
        let gw = c.iter().find(|(n, _)| *n == "GROUP_WORDS").expect("GROUP_WORDS set").1;
        assert_eq!(gw as usize * 4, qwen3_wgpu::internals::converted::QUANT_GROUP);
        assert!(k.wgsl().contains("override GROUP_WORDS"));
    }
}

/// The decode matvec over a batch of sessions' rows (`DECODE_ROWS`: each
/// workgroup runs `ROWS_PER_Z` rows in turn, grid z over the groups) matches the CPU reference
/// and, bit for bit, the one-token decode pipeline run with row z in grid
/// z (what each session runs alone), in every split and epilogue, at rows
/// and K that are not multiples of a team or workgroup.
#[test]
fn int8_matvec_decode_rows_match_one_token_bit_for_bit() {
    let gpu = gpu();
    let mut seed = 500;
    for sub in variants(gpu) {
        // Without subgroups, the long K only where the split-K rows path
        // is not the one-token code (the short shapes cover its passes).
        let shapes: &[(usize, usize, usize)] =
            if sub { &[(6, 96, 3), (66, 1000, 5), (18, 3072, 2)] } else { &[(6, 96, 3), (66, 1000, 5)] };
        for &(rows, cols, n) in shapes {
            let groups = usize::div_ceil(cols, QUANT_GROUP);
            let shape = MatvecShape {
                rows: rows as u32,
                k_words: (groups * QUANT_GROUP / 4) as u32,
                groups: groups as u32,
                n_in: cols as u32,
            };
            // Split K at 64 and 256 lanes: with these shapes each takes
            // both the rows path (every lane one step at most) and the
            // one-token path per row; 128 lanes take no other.
            let splits = [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK]
                .into_iter()
                .flat_map(|l| l.splits())
                .filter(|s| !(s.paired || s.layout == MatvecLayout::SplitK && s.workgroup_size == 128));
            for split in splits {
                for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
                    seed += 1;
                    let one = move |k: Kernel| {
                        let mut c = k.split_constants(split);
                        c.extend(shape.constants());
                        c
                    };
                    let rpw = split.rows_per_wg;
                    let case = if split.x16 { matvec_case_x16 } else { matvec_case };
                    let alone = case(&wgsl_run(gpu, sub, one), kernel, rpw, 1, rows, cols, n, seed);
                    // Every row in each workgroup, and (first shape: 3
                    // rows) two per grid z, the last group short.
                    for per_z in if rows == 6 { vec![n, 2] } else { vec![n] } {
                        let all_rows = move |k: Kernel| {
                            let mut c = one(k);
                            c.extend([("DECODE_ROWS", n as f64), ("ROWS_PER_Z", per_z as f64)]);
                            c
                        };
                        let batched =
                            case(&wgsl_run(gpu, sub, all_rows), kernel, rpw, per_z, rows, cols, n, seed);
                        let what =
                            format!("{kernel:?} {split:?} {rows}x{cols} rows {n} per z {per_z} sub={sub}");
                        assert_matvec(&what, &batched);
                        for (z, (a, b)) in alone.iter().zip(&batched).enumerate() {
                            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&a.0),
                                bits(&b.0),
                                "{what}: row {z} differs from its one-token run"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Decode attention over a batch of sessions' rows (`ROWS`: row z's
/// position and KV region from the step binding's words, its qkv row at
/// z * qkv_stride, the direct output at z * OUT_STRIDE) computes for each
/// row it serves exactly, bit for bit, what the one-token kernel computes
/// for that row alone over its own cache (the new K/V row, and the output
/// or the chunks' partials), and leaves the other rows to the other launch
/// (their outputs and caches untouched). Rows at positions within one
/// chunk, at the chunk boundary and past it, in slots out of row order;
/// the rows from position 256 on pack two heads a workgroup, the others
/// not.
#[test]
fn attention_rows_match_each_row_alone_bit_for_bit() {
    use kernels::{AttentionConstants, AttentionVariant};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(77);
    let (nh, nkv, hd, cap) = (4usize, 2usize, 64usize, 300usize);
    let positions = [13usize, 256, 255, 299];
    let slots = [2usize, 0, 3, 1];
    let n = positions.len();
    let qkv_stride = (nh + 2 * nkv) * hd + 8;
    let out_stride = nh * hd + 5;
    let region = nkv * cap * hd / 2; // u32 words of one slot's K (or V)
    let params = bytemuck::bytes_of(&attention_params((nh, nkv, hd, cap), qkv_stride, 256)).to_vec();
    let qkv = nonzero(&mut rng, n * qkv_stride);
    let qn_kn = nonzero(&mut rng, 2 * hd);
    let rope = qwen3_wgpu::internals::qwen3::rope_table(hd, cap, 1_000_000.0);
    let f16s = |v: Vec<f32>| -> Vec<u8> {
        let h: Vec<half::f16> = v.into_iter().map(half::f16::from_f32).collect();
        bytemuck::cast_slice(&h).to_vec()
    };
    let (k_pool, v_pool) = (f16s(nonzero(&mut rng, 2 * 4 * region)), f16s(nonzero(&mut rng, 2 * 4 * region)));
    let slot_of = |pool: &[u8], s: usize| pool[4 * s * region..4 * (s + 1) * region].to_vec();
    let rows: Vec<u32> =
        positions.iter().zip(&slots).flat_map(|(&p, &s)| [p as u32, (s * region / 4) as u32]).collect();
    for sub in variants(gpu) {
        for variant in [AttentionVariant::STEP_DIRECT, AttentionVariant::STEP] {
            let kernel = if variant.direct { Kernel::AttentionStepDirect } else { Kernel::AttentionStep };
            let chunks = if variant.direct { 1 } else { cap.div_ceil(kernels::ATTENTION_CHUNK as usize) };
            let out_len =
                |rows: usize| if variant.direct { rows * out_stride } else { rows * nh * chunks * hd };
            let render = |rows_out_stride| {
                // The chunked launch packs (from pack_from), as long contexts' do.
                let packed = !variant.direct;
                Constants::Attention(AttentionConstants { variant, rows_out_stride, packed }).render()
            };
            let grid = |z| [nh as u32, chunks as u32, z];
            let batched = dispatch_with(
                gpu,
                kernel,
                sub,
                &render(Some(out_stride as u32)),
                &[&params],
                &[
                    u32s(&rows),
                    f32s(&qkv),
                    k_pool.clone(),
                    v_pool.clone(),
                    poisoned(2 * n * nh * chunks),
                    poisoned(out_len(n)),
                    f32s(&qn_kn),
                    f32s(&rope),
                ],
                grid(n as u32),
            );
            for (z, (&pos, &slot)) in positions.iter().zip(&slots).enumerate() {
                let what = format!("{kernel:?} row {z} at {pos} in slot {slot} sub={sub}");
                let alone = dispatch_with(
                    gpu,
                    kernel,
                    sub,
                    &render(None),
                    &[&params],
                    &[
                        step(pos, 0),
                        f32s(&qkv[z * qkv_stride..(z + 1) * qkv_stride]),
                        slot_of(&k_pool, slot),
                        slot_of(&v_pool, slot),
                        poisoned(2 * nh * chunks),
                        poisoned(out_len(1)),
                        f32s(&qn_kn),
                        f32s(&rope),
                    ],
                    grid(1),
                );
                let served = (pos < kernels::ATTENTION_CHUNK as usize) == variant.direct;
                let cache = |i: usize| slot_of(&batched[i], slot);
                let untouched = [slot_of(&k_pool, slot), slot_of(&v_pool, slot)];
                let ml = |o: &[u8], z: usize| o[8 * z * nh * chunks..8 * (z + 1) * nh * chunks].to_vec();
                let (len1, len0) = (4 * out_len(1), 4 * out_len(z));
                let out_row = batched[3][len0..len0 + len1].to_vec();
                if served {
                    assert!(cache(0) == alone[0] && cache(1) == alone[1], "{what}: K/V differ");
                    assert!(out_row == alone[3], "{what}: output differs");
                    if !variant.direct {
                        assert!(ml(&batched[2], z) == alone[2], "{what}: (m, l) differ");
                    }
                } else {
                    assert!(cache(0) == untouched[0] && cache(1) == untouched[1], "{what}: K/V written");
                    assert!(out_row.chunks(4).all(|w| w == POISON.to_le_bytes()), "{what}: output written");
                }
            }
        }
    }
}

/// attention_partial's packed pipeline (`PACKED`: two query heads a
/// workgroup from `HeadParams::pack_from` on, here every position) gives
/// every head, bit for bit, what the unpacked pipeline gives it: the caches (the new position's K/V row), the chunks'
/// (m, l) and sums or the direct output. Over f16 and int8 caches, the
/// fused step (direct and chunked, GQA groups of 2 and 4) and the prompt
/// variant (three tokens).
#[test]
fn attention_packed_heads_equal_unpacked_bit_for_bit() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(83);
    let cases = [
        (Kernel::AttentionStepDirect, (4usize, 2usize, 64usize, 200usize, 150usize)),
        (Kernel::AttentionStep, (4, 2, 128, 600, 513)),
        (Kernel::AttentionStep, (8, 2, 64, 300, 256)),
        (Kernel::AttentionPartial, (4, 1, 64, 520, 300)),
    ];
    for sub in variants(gpu) {
        for int8 in [false, true] {
            for (kernel, (nh, nkv, hd, cap, pos)) in cases {
                let (fused, direct) = kernel.attention_variant().expect("an attention_partial variant");
                let tokens = if fused { 1 } else { 3 };
                let qkv_stride = (nh + 2 * nkv) * hd + 8;
                let params = |pack_from| attention_params((nh, nkv, hd, cap), qkv_stride, pack_from);
                let cache = |rng: &mut StdRng| -> Vec<u8> {
                    let values = nonzero(rng, nkv * cap * hd);
                    if int8 {
                        common::cases::kv_int8_quantize(&values, nkv, cap, hd).0
                    } else {
                        let h: Vec<f16> = values.iter().map(|v| f16::from_f32(*v)).collect();
                        bytemuck::cast_slice(&h).to_vec()
                    }
                };
                let (k, v) = (cache(&mut rng), cache(&mut rng));
                let q =
                    if fused { nonzero(&mut rng, qkv_stride) } else { nonzero(&mut rng, tokens * nh * hd) };
                let norms = nonzero(&mut rng, 2 * hd);
                let rope = qwen3_wgpu::internals::qwen3::rope_table(hd, cap, 1_000_000.0);
                let chunks = if direct { 1 } else { cap.div_ceil(kernels::ATTENTION_CHUNK as usize) };
                let out_len = if direct { nh * hd + 3 } else { tokens * nh * chunks * hd };
                let mut constants = kernel.constants(MatvecLayout::RowsPerTeam);
                if int8 {
                    constants.push(("KV_INT8", 1.0));
                }
                let mut packed_constants = constants.clone();
                packed_constants.push(("PACKED", 1.0));
                let run = |pack_from| {
                    dispatch_with(
                        gpu,
                        kernel,
                        sub,
                        if pack_from == 0 { &packed_constants } else { &constants },
                        &[bytemuck::bytes_of(&params(pack_from))],
                        &[
                            step(pos, 0),
                            f32s(&q),
                            k.clone(),
                            v.clone(),
                            poisoned(2 * tokens * nh * chunks),
                            poisoned(out_len),
                            f32s(&norms),
                            f32s(&rope),
                        ],
                        [nh as u32, chunks as u32, tokens as u32],
                    )
                };
                let (packed, unpacked) = (run(0), run(u32::MAX));
                let what = format!("{kernel:?} {:?} int8={int8} sub={sub}", (nh, nkv, hd, cap, pos));
                let names = ["k_cache", "v_cache", "(m, l)", "output"];
                for (i, name) in names.iter().enumerate() {
                    assert!(packed[i] == unpacked[i], "{what}: {name} differs");
                }
                // Every head's results written (the chunks past the context
                // write only their (m, l)).
                let written = if direct { &packed[3][..4 * nh * hd] } else { &packed[2][..] };
                assert!(
                    !written.chunks(4).any(|w| w == POISON.to_le_bytes()),
                    "{what}: a head left unwritten"
                );
            }
        }
    }
}

/// `f16_stage` (which runs on every adapter, unlike the product it
/// feeds) against the CPU, over int8 and int4 weights
/// alike: in one launch, 70 rows (two tiles, the second
/// mostly spare) of 200 columns (a padded tail) staged as f16 blocks, the
/// spare rows zero, then 70 tokens (two tiles of 64) of inputs, normed or
/// not, after them. Each value within one f16 rounding step of the
/// reference, every element of the poisoned output written.
#[test]
fn staging_matches_the_cpu_reference() {
    use half::f16;
    use qwen3_wgpu::internals::kernels::matmul::{
        stage_constants, stage_grid, stage_source, staged_bytes, staged_weight_bytes,
    };
    use qwen3_wgpu::internals::kernels::MatvecParams;
    use qwen3_wgpu::internals::reference::{poisoned, pseudo_nonzero, Quant, POISON};
    let gpu = gpu();
    let (rows, cols, tokens) = (70usize, 200usize, 70usize);
    for format in [WeightFormat::Int8, WeightFormat::Int4] {
        let m = Quant::pseudo_in(format, 17, rows, cols);
        let k = m.padded;
        let blocks = k / 16;
        let blocked = |r: usize, c: usize| ((r / 16) * blocks + c / 16) * 256 + (r % 16) * 16 + c % 16;
        let mut x = pseudo_nonzero(18, tokens.next_multiple_of(64) * k);
        for row in x.chunks_mut(k) {
            row[cols..].iter_mut().for_each(|v| *v = 0.0);
        }
        let norm_w = pseudo_nonzero(19, k);
        let eps = 1e-6f32;
        let layout = kernels::bind_group_layout(gpu, "f16_stage", kernels::matvec::BINDINGS);
        let close = |what: &str, got: u16, want: f64| {
            let g = f16::from_bits(got).to_f64();
            let step = f16::from_f64(want).to_f64().abs().max(1e-7) * 2f64.powi(-10);
            assert!(g.is_finite() && (g - want).abs() <= step, "{what}: got {g}, want {want}");
        };
        for norm in [false, true] {
            let p = MatvecParams {
                rows: rows as u32,
                k_words: m.k_words() as u32,
                groups: m.groups() as u32,
                row_offset: 0,
                n_in: cols as u32,
                eps,
                y_stride: 0,
            };
            let out_bytes = staged_bytes(rows, m.k_words(), tokens) as usize;
            let x0 = staged_weight_bytes(rows, m.k_words()) as usize / 2; // f16 values
            let bufs = [
                gpu.uniform("p", bytemuck::bytes_of(&p)).unwrap(),
                gpu.storage_init("x", bytemuck::cast_slice(&x)).unwrap(),
                gpu.storage_init("w", &m.data()).unwrap(),
                gpu.storage_init("scales", &m.scale_blob()).unwrap(),
                gpu.storage_init("staged", &poisoned(out_bytes / 4)).unwrap(),
                gpu.storage_init("norm_w", bytemuck::cast_slice(&norm_w)).unwrap(),
                gpu.storage("x16 (residual; unused)", 16),
            ];
            let constants = stage_constants(norm, format);
            let (pipeline, _) = kernels::compile_for_layout(
                gpu,
                "f16_stage",
                &stage_source(),
                "f16_stage",
                kernels::matvec::BINDINGS,
                &constants,
                Some(&layout),
            )
            .unwrap();
            let entries: Vec<_> = bufs
                .iter()
                .enumerate()
                .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
                .collect();
            let group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &layout,
                entries: &entries,
            });
            let grid = stage_grid(rows as u32, m.k_words() as u32, tokens as u32);
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
            }
            let readback = gpu.readback("staged", out_bytes);
            enc.copy_buffer_to_buffer(&bufs[4], 0, &readback, 0, readback.size());
            gpu.queue.submit([enc.finish()]);
            let bytes = gpu.read(&readback).unwrap();
            let (out, words): (Vec<u16>, Vec<u32>) =
                (bytemuck::pod_collect_to_vec(&bytes), bytemuck::pod_collect_to_vec(&bytes));
            assert!(!words.contains(&POISON), "({format}, norm {norm}): an element not written");
            for r in 0..rows.next_multiple_of(64) {
                for c in 0..k {
                    let want = if r < rows { f16::from_f64(m.w(r, c)).to_f64() } else { 0.0 };
                    close(&format!("{format} w16[{r}][{c}]"), out[blocked(r, c)], want);
                }
            }
            for t in 0..tokens.next_multiple_of(64) {
                let xt = &x[t * k..(t + 1) * k];
                let inv = if norm {
                    let ms = xt[..cols].iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / cols as f64;
                    1.0 / (ms + eps as f64).sqrt()
                } else {
                    1.0
                };
                for c in 0..k {
                    let v = xt[c] as f64 * if norm { inv * norm_w[c] as f64 } else { 1.0 };
                    close(&format!("x16[{t}][{c}] (norm {norm})"), out[x0 + blocked(t, c)], v);
                }
            }
        }
    }
}

/// Every WGSL program a Metal device may build (each kernel's, in both
/// reduction variants; the prompt-batch attention; the f32 tiled product)
/// goes through the naga path wgpu's Metal backend takes: parse, validate,
/// overrides, MSL; and so does the module the engine hands wgpu, the
/// program specialised to its constants (`kernels::specialise`, which must
/// take every one). On a Mac these run where a kernel has no MSL twin or
/// its twin falls back, so a construct naga cannot write as MSL would fail
/// there only at start-up; here it fails on every machine.
#[test]
fn every_wgsl_program_translates_to_msl() {
    let write_msl = |what: &str, module: &naga::Module, info: &naga::valid::ModuleInfo, entry: &str| {
        let options = naga::back::msl::Options {
            lang_version: (3, 0),
            fake_missing_bindings: true,
            ..Default::default()
        };
        let pipeline = naga::back::msl::PipelineOptions {
            entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
            ..Default::default()
        };
        let (text, _) = naga::back::msl::write_string(module, info, &options, &pipeline)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(text.contains(&format!("kernel void {entry}")), "{what}: no kernel {entry} in the MSL");
    };
    let validator =
        || naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all());
    let msl = |what: &str, source: &str, constants: &[(&str, f64)], entry: &str| {
        let specialised = kernels::specialise(source, entry, constants)
            .unwrap_or_else(|| panic!("{what}: naga could not specialise it"));
        let info = validator().validate(&specialised).unwrap_or_else(|e| panic!("{what} (specialised): {e}"));
        write_msl(&format!("{what} (specialised)"), &specialised, &info, entry);
        let module = naga::front::wgsl::parse_str(source)
            .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(source)));
        let info =
            validator().validate(&module).unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(source)));
        let constants: naga::back::PipelineConstants =
            constants.iter().map(|&(name, v)| (name.to_string(), v)).collect();
        let (module, info) =
            naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        write_msl(what, &module, &info, entry);
    };
    let mut programs = 0;
    for sub in [true, false] {
        for k in Kernel::ALL {
            for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
                msl(
                    &format!("{k:?} (subgroups {sub}, {layout:?})"),
                    &k.source(sub),
                    &k.constants(layout),
                    k.entry(),
                );
                programs += 1;
            }
            if let Some((source, constants)) = k.matmul_source() {
                msl(&format!("{k:?} int8_matmul"), &source, &constants, "int8_matmul");
                programs += 1;
            }
        }
        let (source, constants) = kernels::attention_prefill_source(sub);
        msl("attention_prefill", &source, &constants, "attention_prefill");
        programs += 1;
    }
    assert!(programs > 2 * 2 * Kernel::ALL.len(), "{programs} programs");
}

/// `logits_mask`: allowed logits unchanged, forbidden ones -inf, logits
/// past the vocabulary untouched, for vocabularies that end inside a mask
/// word and random masks (and the all-allowed and one-allowed masks).
#[test]
fn logits_mask_forbids_exactly_the_cleared_bits() {
    use rand::Rng;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(29);
    let run = wgsl_run(gpu, false, |k| k.constants(MatvecLayout::RowsPerTeam));
    for n in [1usize, 31, 33, 1000, 4097, 151936] {
        let words = kernels::mask::words(n as u32);
        let masks: [Vec<u32>; 3] = [
            (0..words).map(|_| rng.random()).collect(),
            vec![u32::MAX; words],
            (0..words).map(|w| if w == (n - 1) / 32 { 1 << ((n - 1) % 32) } else { 0 }).collect(),
        ];
        for mask in masks {
            // 40 logits past the vocabulary, which the launch must not touch.
            let logits = nonzero(&mut rng, n + 40);
            let params = bytemuck::bytes_of(&kernels::mask::params(n as u32)).to_vec();
            let out =
                run(Kernel::LogitsMask, kernels::mask::grid(n as u32), &[params, u32s(&mask), f32s(&logits)]);
            let got = to_f32(&out[0]);
            for (t, (&g, &l)) in got.iter().zip(&logits).enumerate() {
                let allowed = t >= n || mask[t / 32] >> (t % 32) & 1 == 1;
                let want = if allowed { l } else { f32::NEG_INFINITY };
                assert_eq!(g.to_bits(), want.to_bits(), "n={n} token {t}: {g}, want {want}");
            }
        }
    }
}
