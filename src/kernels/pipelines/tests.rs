use super::*;

use crate::error::Result;
use crate::gpu::AdapterPolicy;
use crate::gpu::Gpu;
use crate::kernels::choice::{KernelChoice, KernelSource, RowsMatvecCase, SelfCheck, SelfChecker};
use crate::kernels::{Constants, Kernel, MatmulTile, MatvecShape, PREFILL_ATTENTION_TOKENS};

/// A checker that runs `set` at start-up and passes every other weight
/// format's pipelines and every batched-row pipeline (the real checks are
/// tested in `crate::self_check`).
fn checker(set: fn(&Gpu, &Kernels) -> Result<SelfCheck>) -> SelfChecker {
    SelfChecker {
        set,
        format: |_, _, _| Ok(passed()),
        kv: |_, _, _| Ok(passed()),
        packed_attention: |_, _, _| Ok(passed()),
        rows_matvec: |_, _| Ok(None),
    }
}

fn passed() -> SelfCheck {
    SelfCheck { ok: true, pipelines: 0, ms: 0.0, failures: vec![] }
}

/// A set that every check passes, claiming the MSL source (its twins'
/// keys) on lavapipe, where wgpu rejects passthrough MSL.
fn msl_set(gpu: &Gpu) -> Kernels {
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    let mut kernels = Kernels::new(gpu, KernelChoice::Wgsl, None, checker(pass)).unwrap();
    kernels.source = KernelSource::Msl;
    kernels
}

/// A batched-row pipeline asked for without waiting is built on a
/// thread of its own: the call returns at once with none, a later call
/// finds the very pipeline the blocking call returns (one cache entry),
/// and a key being built is not built twice.
#[test]
fn rows_pipelines_asked_without_waiting_build_on_another_thread() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker(pass)).unwrap();
    let split = kernels.matvec_layout.splits()[0];
    let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
    let kernel = Kernel::Int8MatvecNorm;
    let before = kernels.cache.lock().unwrap().len();
    assert!(kernels
        .matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, WeightFormat::Int8, 5)
        .is_none());
    let t0 = std::time::Instant::now();
    let built = loop {
        if let Some(p) =
            kernels.matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, WeightFormat::Int8, 5)
        {
            break p;
        }
        assert!(t0.elapsed().as_secs() < 120, "the build never finished");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(kernels.cache.lock().unwrap().len(), before + 1, "one build, one entry");
    assert_eq!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, 5), Some(built));
    assert!(kernels.building.lock().unwrap().is_empty(), "the finished build is taken");
}

/// Builds asked for without waiting run a few at a time, however many
/// session counts a batch asks for at once: the rest start as earlier
/// ones finish, and every one is built in the end.
#[test]
fn rows_pipelines_asked_without_waiting_build_a_few_at_a_time() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    // A proof slow enough that the builds overlap.
    let slow_proof = |_: &Gpu, _: &RowsMatvecCase<'_>| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        Ok(None)
    };
    let checker = SelfChecker { rows_matvec: slow_proof, ..checker(pass) };
    let mut kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker).unwrap();
    kernels.background_builds = 2;
    let split = kernels.matvec_layout.splits()[0];
    let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
    let kernel = Kernel::Int8MatvecNorm;
    let counts = [2, 3, 4, 5, 6];
    let mut built = std::collections::BTreeSet::new();
    let mut most = 0;
    let t0 = std::time::Instant::now();
    while built.len() < counts.len() {
        for rows in counts {
            if kernels
                .matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, WeightFormat::Int8, rows)
                .is_some()
            {
                built.insert(rows);
            }
        }
        let in_flight = specialised::builds_in_flight(&kernels.building.lock().unwrap());
        assert!(in_flight <= 2, "{in_flight} builds at once (at most 2 allowed)");
        most = most.max(in_flight);
        assert!(t0.elapsed().as_secs() < 120, "the builds never finished");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(most, 2, "the builds ran side by side");
}

/// A pipeline warmed ahead (a batch's warm-up) is built once and is the
/// one later calls get; one whose build fails is marked failed (a
/// blocking call then returns at once instead of waiting on it) and not
/// tried again.
#[test]
fn rows_pipelines_warmed_ahead_are_built_once_and_failures_marked() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    let mut kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker(pass)).unwrap();
    let split = kernels.matvec_layout.splits()[0];
    let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
    let kernel = Kernel::Int8MatvecNorm;
    let format = WeightFormat::Int8;
    assert!(!kernels.rows_pipeline_ready(kernel, split, shape, format, 3));
    let before = kernels.cache.lock().unwrap().len();
    kernels.warm_rows_pipeline(&gpu, kernel, split, shape, format, 3);
    assert!(kernels.rows_pipeline_ready(kernel, split, shape, format, 3));
    kernels.warm_rows_pipeline(&gpu, kernel, split, shape, format, 3);
    assert_eq!(kernels.cache.lock().unwrap().len(), before + 1, "one build, one entry");
    let warmed = kernels.matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, format, 3);
    assert!(warmed.is_some());
    assert_eq!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, format, 3), warmed);
    assert!(kernels.building.lock().unwrap().is_empty(), "no marker is left");
    // A build that fails (its source broken) is marked failed.
    kernels.edit_rows_source(|s| s.replace("fn int8_matvec(", "fn int8_matvec(broken"));
    kernels.warm_rows_pipeline(&gpu, kernel, split, shape, format, 4);
    assert!(!kernels.rows_pipeline_ready(kernel, split, shape, format, 4));
    assert!(kernels.rows_failed(kernel, split, shape, 4));
    let t0 = std::time::Instant::now();
    assert_eq!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, format, 4), None);
    assert!(t0.elapsed().as_secs() < 5, "a blocking call waited on a failed warm-up");
}

/// The set is built once, eagerly, over the default weight format: each
/// decode and prefill pipeline is one cache entry, and what launches and
/// the self-check get is that entry (no second build). Another format's
/// pipelines are built when it is first prepared, once.
#[test]
fn the_set_builds_each_decode_and_prefill_pipeline_once() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    // The count is the builder's own: no check runs pipelines here.
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker(pass)).unwrap();
    let entries = || kernels.cache.lock().unwrap().len();
    // Every kernel's decode; per token: 3 matvec variants and
    // attention_prefill; tiled: the 3 variants' int8_matmul.
    let int8 = Kernel::ALL.len() + 4 + 3;
    assert_eq!(entries(), int8, "no int4 pipeline before int4 is prepared");
    let normed = kernels.launch_pipelines(Kernel::Int8MatvecNorm, WeightFormat::Int8);
    assert!(normed.per_token.is_some() && normed.tiled.is_some());
    assert_eq!(normed.decode, kernels.get(Kernel::Int8MatvecNorm).pipeline);
    let add = kernels.launch_pipelines(Kernel::Int8MatvecAccumulate, WeightFormat::Int8);
    assert!(add.per_token.is_some() && add.tiled.is_some());
    let attention = kernels.launch_pipelines(Kernel::AttentionPartial, WeightFormat::Int8);
    assert!(attention.per_token.is_some() && attention.tiled.is_none());
    // Its grid's z groups are those of the tokens the set was built for.
    assert_eq!(attention.per_token_tokens, PREFILL_ATTENTION_TOKENS);
    assert_eq!(normed.per_token_tokens, crate::kernels::PREFILL_TOKENS_PER_WG);
    let argmax = kernels.launch_pipelines(Kernel::ArgmaxFinal, WeightFormat::Int8);
    assert!(argmax.per_token.is_none() && argmax.tiled.is_none());
    // The 3 variants' decode, per-token and tiled pipelines over int4,
    // built by the first preparation only.
    for _ in 0..2 {
        let report = kernels.prepare_format(&gpu, WeightFormat::Int4).unwrap();
        assert_eq!((report.format, report.source), (WeightFormat::Int4, KernelSource::Wgsl));
        assert!(report.self_check.ok && report.fallback.is_none());
        assert_eq!(entries(), int8 + 3 * 3);
    }
    let int4 = kernels.launch_pipelines(Kernel::Int8MatvecNorm, WeightFormat::Int4);
    assert!(int4.per_token.is_some() && int4.tiled.is_some());
    assert_ne!(int4.decode, normed.decode);
    assert_eq!(int4.decode, kernels.get_for(Kernel::Int8MatvecNorm, WeightFormat::Int4).pipeline);
    assert_eq!(entries(), int8 + 3 * 3);
    // The default format is the set's own: nothing to build.
    assert!(kernels.prepare_format(&gpu, WeightFormat::Int8).unwrap().self_check.ok);
    assert_eq!(entries(), int8 + 3 * 3);
}

/// A weight format whose MSL twins fail (here: wgpu rejects passthrough
/// MSL on a Vulkan adapter) runs on WGSL alone, the reason recorded, while
/// the set's other pipelines keep their source; a format whose WGSL fails
/// the check too is an error, tried again by the next preparation.
#[test]
fn a_formats_failing_twins_fall_back_to_wgsl_for_that_format_alone() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let kernels = msl_set(&gpu);
    let report = kernels.prepare_format(&gpu, WeightFormat::Int4).unwrap();
    assert_eq!(report.source, KernelSource::Wgsl);
    assert!(report.fallback.is_some(), "the MSL rejection is recorded");
    for k in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        assert_eq!(kernels.decode_key(k, WeightFormat::Int4).program, Program::Wgsl, "{k:?}");
        assert_eq!(kernels.decode_key(k, WeightFormat::Int8).program, Program::Msl, "{k:?}");
        assert_eq!(kernels.prefill_keys(k, WeightFormat::Int4).1.map(|t| t.program), Some(Program::Matmul));
        kernels.launch_pipelines(k, WeightFormat::Int4);
    }

    let fail = |_: &Gpu, _: &Kernels, _: WeightFormat| {
        Ok(SelfCheck { ok: false, pipelines: 1, ms: 0.0, failures: vec![("k".into(), "wrong".into())] })
    };
    let kernels = Kernels::new(
        &gpu,
        KernelChoice::Wgsl,
        None,
        SelfChecker {
            set: |_, _| Ok(passed()),
            format: fail,
            kv: |_, _, _| Ok(passed()),
            packed_attention: |_, _, _| Ok(passed()),
            rows_matvec: |_, _| Ok(None),
        },
    )
    .unwrap();
    for _ in 0..2 {
        let e = kernels.prepare_format(&gpu, WeightFormat::Int4).unwrap_err();
        assert_eq!(e.code(), "gpu_device_failed");
        assert!(e.to_string().contains("int4 weights failed the self-check: k: wrong"), "{e}");
    }
}

/// The MSL set runs the twins of the kernels reading the KV cache over an
/// int8 cache too (their source defining `Q3W_KV_INT8` 1, the f16 cache's
/// 0); where they fail (here: wgpu rejects passthrough MSL on a Vulkan
/// adapter) the int8 cache's kernels run on WGSL alone, proven, while the
/// f16 cache's keep the twins.
#[test]
fn an_int8_caches_failing_twins_fall_back_to_wgsl_for_that_cache_alone() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let kernels = msl_set(&gpu);
    let kv_kernels: Vec<Kernel> =
        Kernel::ALL.into_iter().filter(|k| k.reads_kv_cache() && k.row().msl.is_some()).collect();
    assert!(kv_kernels.contains(&Kernel::QkNormRope) && kv_kernels.contains(&Kernel::AttentionStep));
    for &k in &kv_kernels {
        for (kv, flag) in [(KvFormat::F16, 0), (KvFormat::Int8, 1)] {
            let key = kernels.decode_key_kv(k, WeightFormat::Int8, kv);
            assert_eq!(key.program, Program::Msl, "{k:?} {kv:?}");
            let (source, _) = kernels.source_of(key).unwrap();
            assert!(source.contains(&format!("#define Q3W_KV_INT8 {flag}\n")), "{k:?} {kv:?}");
        }
    }
    assert_eq!(kernels.kv_source(KvFormat::Int8), KernelSource::Msl, "tried first");
    let check = kernels.prove_kv(&gpu, KvFormat::Int8).unwrap();
    assert!(check.ok);
    assert_eq!(
        (kernels.kv_source(KvFormat::Int8), kernels.kv_source(KvFormat::F16)),
        (KernelSource::Wgsl, KernelSource::Msl)
    );
    for &k in &kv_kernels {
        assert_eq!(
            kernels.decode_key_kv(k, WeightFormat::Int8, KvFormat::Int8).program,
            Program::Wgsl,
            "{k:?}"
        );
        assert_eq!(
            kernels.decode_key_kv(k, WeightFormat::Int8, KvFormat::F16).program,
            Program::Msl,
            "{k:?}"
        );
    }
    assert!(kernels.attention_packed_pipeline(&gpu, KvFormat::Int8).is_some(), "the packed WGSL pipeline");
}

/// The MSL set asks for the MSL `int8_matmul` twin with the base tile
/// whatever tiling WGSL takes (the twin's source is written for that
/// grid: a narrow grid would leave three quarters of its outputs
/// unwritten), and the launch's grid comes from the same constants as
/// the twin's; the WGSL set takes the chosen tiling.
#[test]
fn the_msl_set_takes_the_twins_base_tile_whatever_the_tiling() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    let mut kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker(pass)).unwrap();
    assert_ne!(MatmulTile::DEFAULT, MatmulTile::BASE, "the check needs a tiling other than the base");
    let tiled: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| kernels.prefill_keys(*k, WeightFormat::Int8).1.is_some())
        .collect();
    assert_eq!(tiled.len(), 3, "the three matvec variants run tiled");
    for tile in [MatmulTile::DEFAULT, MatmulTile::BASE] {
        kernels.matmul_tile = tile;
        for source in [KernelSource::Msl, KernelSource::Wgsl] {
            kernels.source = source;
            for (&k, format) in tiled.iter().flat_map(|k| WeightFormat::ALL.map(|f| (k, f))) {
                let key = kernels.prefill_keys(k, format).1.unwrap();
                let Constants::Matmul(c) = key.constants else { panic!("{k:?}: matmul constants") };
                assert_eq!(c.format, format);
                match source {
                    KernelSource::Msl => {
                        assert_eq!(key.program, Program::MatmulMsl);
                        assert_eq!(c.tile, MatmulTile::BASE, "{k:?} under {}", tile.name());
                        // The grid the launch takes is the twin's own.
                        let msl = c.msl_constants();
                        let of = |name| msl.iter().find(|(n, _)| *n == name).unwrap().1 as u32;
                        assert_eq!((c.rows(), c.tokens()), (of("MM_ROWS"), of("MM_TOKENS")), "{k:?}");
                        assert_eq!(of("INT4"), (format == WeightFormat::Int4) as u32, "{k:?}");
                    }
                    KernelSource::Wgsl => {
                        assert_eq!(key.program, Program::Matmul);
                        assert_eq!(c.tile, tile, "{k:?}");
                    }
                }
            }
        }
    }
}

/// The MSL set runs the twins over every weight format: each matvec
/// variant's decode pipeline is the MSL twin, its source the preamble of
/// the key's own constants (`Q3W_INT4` as the format says), and no
/// pipeline is specialised to a shape or to batched rows (the twin reads
/// its shape from the launch, and runs rows as grid z).
#[test]
fn the_msl_set_runs_the_twins_over_every_format() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let mut kernels = msl_set(&gpu);
    kernels.matvec_layout = crate::kernels::msl::MSL_MATVEC_LAYOUT;
    let split = kernels.matvec_layout.splits()[0];
    let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
    for k in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        for format in WeightFormat::ALL {
            let key = kernels.decode_key(k, format);
            assert_eq!(key.program, Program::Msl, "{k:?} {format:?}");
            let (source, entry) = kernels.source_of(key).unwrap();
            assert_eq!(entry, "int8_matvec");
            let int4 = (format == WeightFormat::Int4) as u32;
            assert!(source.contains(&format!("#define Q3W_INT4 {int4}\n")), "{k:?} {format:?}");
            assert_eq!(Some(source), crate::kernels::msl::msl_source_in(k, format));
            assert!(kernels.matvec_pipeline(&gpu, k, split, shape, format).is_none(), "{k:?} {format:?}");
            assert!(
                kernels.matvec_rows_pipeline(&gpu, k, split, shape, format, 4).is_none(),
                "{k:?} {format:?}"
            );
        }
    }
}

/// A set whose prompt attention's tile program fails its check keeps the
/// cooperative-matrix products (here their emulation) without it: prompt
/// attention runs `attention_prefill`, and the report says why.
#[test]
fn a_failing_tile_attention_program_leaves_the_cooperative_products() {
    let gpu = Gpu::new_with(AdapterPolicy::Portable, false, true).expect("a Vulkan adapter (lavapipe in CI)");
    let tiles_fail = |_: &Gpu, k: &Kernels| {
        let failures =
            if k.attention_tiles { vec![("AttentionPartial".into(), "wrong".into())] } else { vec![] };
        Ok(SelfCheck { ok: failures.is_empty(), pipelines: 1, ms: 0.0, failures })
    };
    let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker(tiles_fail)).unwrap();
    assert!(kernels.coop && !kernels.attention_tiles);
    assert!(kernels.report.cooperative_matrices);
    let why = kernels.report.cooperative_fallback.as_deref().unwrap_or_default();
    assert!(why.contains("wrong"), "{why}");
    let (_, per_wg) = kernels.attention_prefill_for(KvFormat::F16, 64);
    assert_eq!(per_wg, PREFILL_ATTENTION_TOKENS);
}

/// Which tile program a model's prompt attention takes: the MSL set's twin
/// (8x8 SIMD-group matrices) for any head_dim the engine takes, the WGSL
/// one (16x16 cooperative matrices) for head_dims that are multiples of
/// 16; an int8 cache, or a set without tiles, takes `attention_prefill`.
#[test]
fn the_tile_program_a_model_takes() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let mut msl = msl_set(&gpu);
    assert!(msl.attention_tiles_key_for(KvFormat::F16, 64).is_none(), "no tiles on lavapipe's set");
    msl.attention_tiles = true;
    let program = |k: &Kernels, kv, head_dim| k.attention_tiles_key_for(kv, head_dim).map(|key| key.program);
    for head_dim in [40, 64, 128] {
        assert_eq!(program(&msl, KvFormat::F16, head_dim), Some(Program::AttentionPrefillTilesMsl));
    }
    assert_eq!(program(&msl, KvFormat::Int8, 64), None);
    let pass = |_: &Gpu, _: &Kernels| Ok(passed());
    let mut wgsl = Kernels::new(&gpu, KernelChoice::Wgsl, None, checker(pass)).unwrap();
    wgsl.attention_tiles = true;
    let tiles = Some(Program::AttentionPrefillTiles { emulated: false });
    assert_eq!((program(&wgsl, KvFormat::F16, 64), program(&wgsl, KvFormat::F16, 128)), (tiles, tiles));
    assert_eq!(program(&wgsl, KvFormat::F16, 40), None);
    assert_eq!(program(&wgsl, KvFormat::Int8, 128), None);
}
