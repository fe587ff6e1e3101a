//! The kernels on a Metal adapter (macOS): the cases of tests/it/common run
//! every WGSL kernel (both reduction preludes, both matvec layouts) and
//! every MSL twin, built as the engine builds them (`kernels::compile_msl`
//! on `msl::msl_source`, and the `int8_matmul` twin on
//! `MatmulConstants::msl_source`), against the CPU references; a probe
//! checks the device's SIMD-group matrices against the table the shim
//! emulates; and every MSL variant goes through Apple's offline compiler
//! with warnings as errors.
//!
//! Elsewhere there is no Metal adapter: the GPU tests exist on macOS only,
//! and the offline-compiler test runs wherever `xcrun` exists (on macOS it
//! must; on other systems it says it was skipped). The code compiles on
//! every system, so lint checks it everywhere.
#![cfg_attr(not(target_os = "macos"), allow(dead_code, unused_imports))]

use crate::common;

use common::cases::{
    argmax_case, argmax_never_writes_past_the_token_array, assert_matvec, attention_case,
    attention_step_case, check_matrix_probe, matmul_case_for, matmul_case_half_exact, matrix_probe_inputs,
    matvec_case, matvec_case_in, qk_norm_rope_case, ATTENTION_SHAPES, ATTENTION_STEP_CHUNKED_SHAPES,
    ATTENTION_STEP_DIRECT_SHAPES, MATRIX_PROBE, MATRIX_PROBE_BINDINGS, MATRIX_PROBE_THREADGROUP,
    QK_NORM_ROPE_SHAPES,
};
use qwen3_wgpu::internals::kernels::{self, Bind, Kernel, MatvecLayout, MatvecSplit};
use qwen3_wgpu::internals::msl;
use qwen3_wgpu::{AdapterPolicy, Gpu, KvFormat, WeightFormat};
use rand::{rngs::StdRng, SeedableRng};
use std::path::Path;
use std::process::Command;

/// The Metal device the engine's default policy picks.
fn metal_gpu() -> Gpu {
    let gpu = Gpu::new(AdapterPolicy::MetalOnly).expect("a Metal adapter");
    assert_eq!(gpu.info.backend, wgpu::Backend::Metal);
    gpu
}

/// Runs `pipeline` (whose bind-group layout is `layout`, `kernel`'s
/// bindings) once over `grid`: `buffers` fill the bindings in order;
/// returns the read_write buffers, in order.
fn dispatch(
    gpu: &Gpu,
    kernel: Kernel,
    pipeline: &(wgpu::ComputePipeline, wgpu::BindGroupLayout),
    grid: [u32; 3],
    buffers: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    dispatch_bindings(gpu, kernel.bindings(), pipeline, grid, buffers)
}

/// [`dispatch`] for a pipeline whose bindings are `binds`.
fn dispatch_bindings(
    gpu: &Gpu,
    binds: &[Bind],
    (pipeline, layout): &(wgpu::ComputePipeline, wgpu::BindGroupLayout),
    grid: [u32; 3],
    buffers: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    assert_eq!(buffers.len(), binds.len(), "one buffer per binding");
    let bufs: Vec<wgpu::Buffer> = binds
        .iter()
        .zip(buffers)
        .map(|(b, d)| match b {
            Bind::Uniform => gpu.uniform("u", d).unwrap(),
            _ => gpu.storage_init("s", d).unwrap(),
        })
        .collect();
    let entries: Vec<_> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
        .collect();
    let bg =
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries });
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
    }
    gpu.queue.submit([enc.finish()]);
    let out = binds
        .iter()
        .zip(&bufs)
        .zip(buffers)
        .filter(|((b, _), _)| **b == Bind::ReadWrite)
        .map(|((_, buf), d)| gpu.download(buf, d.len()).unwrap())
        .collect();
    gpu.check_fault().unwrap();
    out
}

/// A [`common::cases::Run`] over the WGSL kernels compiled with
/// `constants`.
fn wgsl_run<'a>(
    gpu: &'a Gpu,
    subgroups: bool,
    constants: impl Fn(Kernel) -> Vec<(&'static str, f64)> + 'a,
) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    move |k, grid, buffers| {
        let p =
            kernels::compile(gpu, k.entry(), &k.source(subgroups), k.entry(), k.bindings(), &constants(k))
                .unwrap_or_else(|e| panic!("{k:?} (WGSL) builds: {e}"));
        dispatch(gpu, k, &p, grid, buffers)
    }
}

/// A [`common::cases::Run`] over the MSL twins, each built exactly as the
/// engine builds it.
fn msl_run(gpu: &Gpu) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + '_ {
    msl_run_in(gpu, WeightFormat::Int8)
}

/// [`msl_run`] with the matvecs over weights in `format`.
fn msl_run_in(gpu: &Gpu, format: WeightFormat) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + '_ {
    move |k, grid, buffers| {
        let src = msl::msl_source_in(k, format).expect("an MSL twin");
        let p =
            kernels::compile_msl(gpu, k.entry(), &src, msl::msl_entry(k), k.bindings(), k.workgroup_size())
                .unwrap_or_else(|e| panic!("{k:?} (MSL) builds: {e}"));
        dispatch(gpu, k, &p, grid, buffers)
    }
}

/// The decode-shaped cases of every kernel family but the matvec, through
/// `run` (the ones tests/it/kernels.rs and tests/it/msl_kernels.rs run).
fn run_non_matvec_cases(run: common::cases::Run<'_>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for &(n, chunk) in
        &[(1usize, 1000u32), (7, 1000), (555, 256), (1000, 1000), (151936, kernels::ARGMAX_CHUNK)]
    {
        for ties in [false, true] {
            argmax_case(run, n, chunk, ties, &mut rng);
        }
    }
    argmax_never_writes_past_the_token_array(run);
    let qwen_rope = [(16, 8, 128, 4096, 3999, 1), (16, 8, 128, 4096, 100, 4)];
    for shape in qwen_rope.into_iter().chain(QK_NORM_ROPE_SHAPES) {
        qk_norm_rope_case(run, shape, &mut rng);
    }
    let qwen_attention = [(16, 8, 128, 4096, 300, 1), (16, 8, 128, 4096, 255, 3)];
    for shape in qwen_attention.into_iter().chain(ATTENTION_SHAPES) {
        attention_case(run, shape, &mut rng);
    }
    for shape in [(16, 8, 128, 4096, 255)].into_iter().chain(ATTENTION_STEP_DIRECT_SHAPES) {
        attention_step_case(run, Kernel::AttentionStepDirect, shape, &mut rng);
    }
    for shape in [(16, 8, 128, 4096, 4000)].into_iter().chain(ATTENTION_STEP_CHUNKED_SHAPES) {
        attention_step_case(run, Kernel::AttentionStep, shape, &mut rng);
    }
}

/// Matvec shapes: awkward ones (rows not a multiple of 4, 8 or 32; K not a
/// multiple of a simdgroup's stride; one token or a batch of 3 in grid z)
/// and Qwen3-0.6B's.
const MATVEC_SHAPES: [(usize, usize, usize); 8] = [
    (2, 64, 1),
    (6, 96, 3),
    (10, 1000, 1),
    (66, 128, 3),
    (130, 1024, 1),
    (18, 3072, 3),
    (4096, 1024, 1),
    (1024, 3072, 2),
];

#[cfg(target_os = "macos")]
#[test]
fn metal_wgsl_kernels_match_cpu() {
    let gpu = metal_gpu();
    let preludes = if gpu.subgroups { vec![true, false] } else { vec![false] };
    let mut seed = 1;
    for sub in preludes {
        let splits = [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK]
            .into_iter()
            .flat_map(|l| l.splits())
            .collect::<Vec<_>>();
        for split in splits {
            let MatvecSplit { layout, workgroup_size, rows_per_wg, .. } = split;
            let run = wgsl_run(&gpu, sub, move |k| k.split_constants(split));
            for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
                for (rows, cols, tokens) in MATVEC_SHAPES {
                    seed += 1;
                    let res = matvec_case(&run, kernel, rows_per_wg, 1, rows, cols, tokens, seed);
                    assert_matvec(
                        &format!(
                            "Metal WGSL {kernel:?} {layout:?} wg {workgroup_size} {rows}x{cols} sub={sub}"
                        ),
                        &res,
                    );
                }
            }
        }
        let run = wgsl_run(&gpu, sub, |k| k.constants(MatvecLayout::RowsPerTeam));
        run_non_matvec_cases(&run, 20 + sub as u64);
    }
}

#[cfg(target_os = "macos")]
#[test]
fn metal_msl_kernels_match_cpu() {
    let gpu = metal_gpu();
    let run = msl_run(&gpu);
    let rows_per_wg = msl::MSL_MATVEC_LAYOUT.rows_per_wg();
    let mut seed = 100;
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        for (rows, cols, tokens) in MATVEC_SHAPES.into_iter().chain([(151936, 1024, 1), (6144, 1024, 2)]) {
            seed += 1;
            let res = matvec_case(&run, kernel, rows_per_wg, 1, rows, cols, tokens, seed);
            assert_matvec(&format!("Metal MSL {kernel:?} {rows}x{cols}"), &res);
        }
    }
    // Over int4 weights (the layers'; the LM head stays int8).
    let run4 = msl_run_in(&gpu, WeightFormat::Int4);
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        for (rows, cols, tokens) in MATVEC_SHAPES.into_iter().chain([(6144, 1024, 2), (14, 64 * 17, 3)]) {
            seed += 1;
            let f = WeightFormat::Int4;
            let res = matvec_case_in(&run4, kernel, f, false, rows_per_wg, 1, rows, cols, tokens, seed);
            assert_matvec(&format!("Metal MSL int4 {kernel:?} {rows}x{cols}"), &res);
        }
    }
    run_non_matvec_cases(&run, 30);
    // The chunked step's twin packing two query heads a threadgroup (the
    // cases' uniform packs from position 0).
    let packed = |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
        let src = msl::msl_source_with(k, &packed_attention_constants(k)).expect("an MSL twin");
        let p =
            kernels::compile_msl(&gpu, k.entry(), &src, msl::msl_entry(k), k.bindings(), k.workgroup_size())
                .unwrap_or_else(|e| panic!("{k:?} (packed MSL) builds: {e}"));
        dispatch(&gpu, k, &p, grid, buffers)
    };
    let mut rng = StdRng::seed_from_u64(31);
    for shape in [(16, 8, 128, 4096, 4000)].into_iter().chain(ATTENTION_STEP_CHUNKED_SHAPES) {
        attention_step_case(&packed, Kernel::AttentionStep, shape, &mut rng);
    }
}

/// `k`'s constants with `PACKED` on (an attention kernel's).
fn packed_attention_constants(k: Kernel) -> Vec<(&'static str, f64)> {
    let kernels::Constants::Attention(c) = k.typed_constants(msl::MSL_MATVEC_LAYOUT) else {
        panic!("{k:?} is no attention kernel")
    };
    kernels::Constants::Attention(kernels::AttentionConstants { packed: true, ..c }).render()
}

/// The prompt-batch product's MSL twin on SIMD-group matrices, built as
/// the engine builds it (`MatmulConstants::msl_source`, threadgroups of
/// `MATMUL_MSL_WG`), in every epilogue, over weights exact in half: the awkward shapes
/// tests/it/msl_kernels.rs runs through the shim, and Qwen3-0.6B's qkv and
/// gate/up over a 512-token prompt.
#[cfg(target_os = "macos")]
#[test]
fn metal_msl_matmul_matches_cpu() {
    let gpu = metal_gpu();
    let gpu = &gpu;
    let run_in = |format: WeightFormat| {
        move |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
            let c = kernels::MatmulConstants { format, ..k.matmul_constants().expect("a matvec variant") };
            let src = c.msl_source();
            let p = kernels::compile_msl(
                gpu,
                "int8_matmul",
                &src,
                "int8_matmul",
                k.bindings(),
                kernels::MATMUL_MSL_WG,
            )
            .unwrap_or_else(|e| panic!("{k:?} int8_matmul (MSL) builds: {e}"));
            dispatch(gpu, k, &p, grid, buffers)
        }
    };
    let mut seed = 300;
    let kernels_in = WeightFormat::ALL.into_iter().flat_map(|f| Kernel::ALL.into_iter().map(move |k| (k, f)));
    for (kernel, format) in kernels_in.filter(|(k, _)| k.matvec_variant().is_some()) {
        let run = run_in(format);
        let v = kernel.matvec_variant().unwrap();
        let tile = kernel.matmul_tokens_per_wg() as usize;
        let pair = |rows: usize| if v.swiglu { rows + rows % 2 } else { rows };
        let qwen = if v.swiglu { (6144, 1024, 512) } else { (4096, 1024, 512) };
        for (rows, cols, tokens) in
            [(13, 200, 5), (13, 200, 37), (70, 200, tile + 5), (130, 1024, tile), qwen]
        {
            seed += 1;
            let rows = pair(rows);
            let rpw = kernels::MATMUL_ROWS_PER_WG;
            // The twin rounds its weights to half: int8 scales that keep
            // them exact (int4's are), so f32 tolerance still holds.
            let res = match format {
                WeightFormat::Int8 => matmul_case_half_exact(&run, kernel, tile, rows, cols, tokens, seed),
                _ => matmul_case_for(&run, kernel, format, rpw, tile, rows, cols, tokens, seed),
            };
            let what = format!("Metal MSL int8_matmul {kernel:?} {format:?} {rows}x{cols} x{tokens}");
            assert_matvec(&what, &res);
        }
    }
}

/// The device's SIMD-group matrices compute what the shim's emulation does,
/// with the element table the shim and the `int8_matmul` twin assume (the
/// probe tests/it/msl_kernels.rs runs through the shim).
#[cfg(target_os = "macos")]
#[test]
fn metal_simdgroup_matrices_match_the_shims_table() {
    let gpu = metal_gpu();
    let src = format!("{}{MATRIX_PROBE}", msl::MSL_HEADER);
    let p = kernels::compile_msl(
        &gpu,
        "matrix_probe",
        &src,
        "matrix_probe",
        &MATRIX_PROBE_BINDINGS,
        MATRIX_PROBE_THREADGROUP,
    )
    .unwrap_or_else(|e| panic!("the probe builds: {e}"));
    let (mats, buffers) = matrix_probe_inputs(17);
    let out = dispatch_bindings(&gpu, &MATRIX_PROBE_BINDINGS, &p, [1, 1, 1], &buffers);
    check_matrix_probe(&mats, &out).unwrap_or_else(|e| panic!("{e}"));
}

/// Whether `xcrun` (Apple's developer-tool launcher) can be run.
fn have_xcrun() -> bool {
    Command::new("xcrun").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Compiles `source` with `xcrun -sdk macosx metal -Werror -c`; the
/// compiler's output on failure.
fn metal_compile(source: &str, dir: &Path, name: &str) -> Result<(), String> {
    let src = dir.join(format!("{name}.metal"));
    std::fs::write(&src, source).unwrap();
    let out = Command::new("xcrun")
        .args(["-sdk", "macosx", "metal", "-Werror", "-c"])
        .arg(&src)
        .arg("-o")
        .arg(dir.join(format!("{name}.air")))
        .output()
        .map_err(|e| format!("xcrun did not start: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    }
}

/// Every MSL variant, exactly as the engine hands it to Metal (preamble and
/// body), passes Apple's compiler with warnings as errors. Runs wherever
/// `xcrun` exists and always on macOS (where a missing `metal` compiler
/// fails the test: install Xcode, and on Xcode 26 or later run
/// `xcodebuild -downloadComponent MetalToolchain`).
#[test]
fn every_msl_variant_compiles_with_xcrun_metal() {
    if !have_xcrun() {
        if cfg!(target_os = "macos") {
            panic!("xcrun is missing: install Xcode (xcode-select --install is not enough)");
        }
        eprintln!("note: no xcrun on this system; the MSL variants were not compiled with Apple's compiler");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut compiled = 0;
    // Each weight format's (the other kernels read no weights: one source).
    for (k, format) in WeightFormat::ALL.into_iter().flat_map(|f| Kernel::ALL.map(|k| (k, f))) {
        let Some(src) = msl::msl_source_in(k, format) else { continue };
        if format != WeightFormat::Int8 && k.matvec_variant().is_none() {
            continue;
        }
        if let Err(e) = metal_compile(&src, dir.path(), &format!("{k:?}_{format:?}")) {
            panic!("{k:?} {format:?}: `xcrun -sdk macosx metal -Werror -c` rejects the engine's MSL:\n{e}");
        }
        compiled += 1;
    }
    for (k, format) in WeightFormat::ALL.into_iter().flat_map(|f| Kernel::ALL.map(|k| (k, f))) {
        let Some(c) = k.matmul_constants() else { continue };
        let c = kernels::MatmulConstants { format, ..c };
        if let Err(e) = metal_compile(&c.msl_source(), dir.path(), &format!("{k:?}_{format:?}_matmul")) {
            panic!(
                "{k:?} {format:?} int8_matmul: `xcrun -sdk macosx metal -Werror -c` rejects its twin:\n{e}"
            );
        }
        compiled += 1;
    }
    // The kernels over an int8 KV cache.
    for k in Kernel::ALL.into_iter().filter(|k| k.reads_kv_cache()) {
        let constants = k.typed_constants_in(msl::MSL_MATVEC_LAYOUT, WeightFormat::Int8).render();
        let Some(src) = msl::msl_source_with(k, &constants, KvFormat::Int8) else { continue };
        if let Err(e) = metal_compile(&src, dir.path(), &format!("{k:?}_kv_int8")) {
            panic!(
                "{k:?} over an int8 KV cache: `xcrun -sdk macosx metal -Werror -c` rejects its twin:\n{e}"
            );
        }
        compiled += 1;
    }
    // The chunked decode attention packing two query heads a threadgroup,
    // over either cache.
    let k = Kernel::AttentionStep;
    for kv in [KvFormat::F16, KvFormat::Int8] {
        let packed = msl::msl_source_with(k, &packed_attention_constants(k), kv).expect("an MSL twin");
        if let Err(e) = metal_compile(&packed, dir.path(), &format!("AttentionStep_packed_{kv:?}")) {
            panic!(
                "the packed attention ({kv:?}): `xcrun -sdk macosx metal -Werror -c` rejects its twin:\n{e}"
            );
        }
        compiled += 1;
    }
    let probe = format!("{}{MATRIX_PROBE}", msl::MSL_HEADER);
    if let Err(e) = metal_compile(&probe, dir.path(), "matrix_probe") {
        panic!("the SIMD-group matrix probe: `xcrun -sdk macosx metal -Werror -c` rejects it:\n{e}");
    }
    assert!(compiled >= 15, "MSL variants compiled: {compiled}");
    // The check has teeth: a source Apple's compiler must reject.
    let broken =
        msl::msl_source(Kernel::ArgmaxFinal).unwrap().replace("threadgroup_barrier(", "no_such_barrier(");
    assert!(metal_compile(&broken, dir.path(), "broken").is_err(), "a broken MSL source compiled");
}
