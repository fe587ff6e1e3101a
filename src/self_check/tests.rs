use super::*;
use crate::converted::WeightFormat;
use crate::gpu::AdapterPolicy;
use crate::kernels::{compile_for_layout, Constants, KernelChoice, PREFILL_ATTENTION_TOKENS};
use crate::kv_cache::KvFormat;

fn wgsl_kernels() -> (Gpu, Kernels) {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, CHECKER).expect("the WGSL kernels build");
    (gpu, kernels)
}

/// `kernel`'s WGSL with the source edited by `edit`, on its layout.
fn edited(
    gpu: &Gpu,
    kernels: &Kernels,
    kernel: Kernel,
    edit: impl Fn(String) -> String,
) -> wgpu::ComputePipeline {
    edited_in(gpu, kernels, kernel, WeightFormat::Int8, edit)
}

/// [`edited`] for weights in `format`.
fn edited_in(
    gpu: &Gpu,
    kernels: &Kernels,
    kernel: Kernel,
    format: WeightFormat,
    edit: impl Fn(String) -> String,
) -> wgpu::ComputePipeline {
    let constants = kernel.typed_constants_in(kernels.matvec_layout, format).render();
    edited_with(gpu, kernels, kernel, &constants, edit)
}

/// [`edited`] compiled with `constants`; the edit must change the source.
fn edited_with(
    gpu: &Gpu,
    kernels: &Kernels,
    kernel: Kernel,
    constants: &[(&str, f64)],
    edit: impl Fn(String) -> String,
) -> wgpu::ComputePipeline {
    let src = edit(kernel.source(gpu.subgroups));
    assert_ne!(src, kernel.source(gpu.subgroups), "the edit applies");
    let layout = Some(kernels.layout(kernel));
    compile_for_layout(gpu, "edited", &src, kernel.entry(), kernel.bindings(), constants, layout)
        .expect("the edited kernel compiles")
        .0
}

/// Every decode pipeline, the tiled prompt-batch pipeline of each
/// variant that has one, and `attention_prefill`.
fn pipelines_checked() -> usize {
    let tiled = Kernel::ALL.iter().filter(|k| k.prefill_tiled()).count();
    Kernel::ALL.len() + tiled + 1
}

/// The matvec variants' decode and tiled pipelines over another format.
fn format_pipelines_checked() -> usize {
    let tiled = Kernel::ALL.iter().filter(|k| k.prefill_tiled()).count();
    Kernel::ALL.iter().filter(|k| k.matvec_variant().is_some()).count() + tiled
}

#[test]
fn every_pipeline_of_a_correct_set_passes() {
    let (gpu, kernels) = wgsl_kernels();
    let check = run(&gpu, &kernels).unwrap();
    assert!(check.ok, "{}", check.describe_failures());
    assert_eq!(check.pipelines, pipelines_checked());
    assert_eq!(pipelines_checked(), Kernel::ALL.len() + 3 + 1, "every matvec variant runs tiled");
    // Engine construction ran it too.
    assert!(kernels.report.self_check.ok && kernels.report.self_check.pipelines == pipelines_checked());
    // And int4's, prepared.
    let int4 = kernels.prepare_format(&gpu, WeightFormat::Int4).unwrap();
    assert!(int4.self_check.ok, "{}", int4.self_check.describe_failures());
    assert_eq!((int4.self_check.pipelines, format_pipelines_checked()), (6, 6));
    assert_eq!(run_format(&gpu, &kernels, WeightFormat::Int4).unwrap().pipelines, 6);
}

/// A tiled prompt-batch pipeline that computes a wrong value (here: the
/// RMSNorm's scale left out of the outputs) is caught, and only it.
#[test]
fn a_wrong_tiled_prompt_batch_pipeline_is_caught() {
    let (gpu, mut kernels) = wgsl_kernels();
    let kernel = Kernel::Int8MatvecNormSwiglu;
    let (src, constants) = kernel.matmul_source().unwrap();
    let unnormed = src.replace("inv = inverseSqrt(s / f32(p.n_in) + p.eps);", "inv = vec4<f32>(1.0);");
    assert_ne!(src, unnormed, "the substitution applies");
    let layout = Some(kernels.layout(kernel));
    let wrong =
        compile_for_layout(&gpu, "edited", &unnormed, "int8_matmul", kernel.bindings(), &constants, layout)
            .expect("the edited kernel compiles")
            .0;
    kernels.replace_tiled_pipeline(kernel, wrong);
    let check = run(&gpu, &kernels).unwrap();
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(failed, ["Int8MatvecNormSwiglu"], "{}", check.describe_failures());
    assert!(check.failures[0].1.starts_with("tiled:"), "{}", check.describe_failures());
}

/// A tiled pipeline that reads the wrong tokens' inputs (here: every
/// tile reads the first tile's, so the second tile's real tokens get
/// other tokens' outputs) is caught: the check runs two tiles.
#[test]
fn a_tiled_pipeline_reading_the_wrong_tokens_is_caught() {
    let (gpu, mut kernels) = wgsl_kernels();
    let kernel = Kernel::Int8MatvecNorm;
    let (src, constants) = kernel.matmul_source().unwrap();
    let shifted = src.replace("let xb = (t0 + 4u * tq) * p.k_words", "let xb = (4u * tq) * p.k_words");
    assert_ne!(src, shifted, "the substitution applies");
    let layout = Some(kernels.layout(kernel));
    let wrong =
        compile_for_layout(&gpu, "edited", &shifted, "int8_matmul", kernel.bindings(), &constants, layout)
            .expect("the edited kernel compiles")
            .0;
    kernels.replace_tiled_pipeline(kernel, wrong);
    let check = run(&gpu, &kernels).unwrap();
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
}

/// An int4 pipeline that takes a word's nibbles in the wrong order, or
/// its quant group's scale from the wrong slot, is caught (decode and
/// tiled alike), and only it: the int8 pipelines of the same variant pass.
#[test]
fn an_int4_nibble_order_or_scale_slot_swapped_is_caught() {
    type Edit = fn(&str) -> String;
    // Values 0..3 and 4..7 of every step's first word trade places.
    let nibbles: Edit =
        |s| s.replace("dot(v0.lo, a.x0) + dot(v0.hi, a.x1)", "dot(v0.hi, a.x0) + dot(v0.lo, a.x1)");
    // Int8's steps per group: step j reads group j / 4, not j / 2.
    let scales: Edit = |s| s.replace("GROUP_WORDS / 8u, INT4)", "GROUP_WORDS / 4u, INT4)");
    let tiled_nibbles: Edit = |s| s.replace(">> (4u * (word % 2u))", ">> (4u * (1u - word % 2u))");
    let tiled_scales: Edit =
        |s| s.replace("let g = (c * CHUNK_WORDS) / GROUP_WORDS;", "let g = c / GROUP_WORDS;");
    let kernel = Kernel::Int8MatvecNorm;
    let (gpu, mut kernels) = wgsl_kernels();
    kernels.prepare_format(&gpu, WeightFormat::Int4).unwrap();
    let decode_pipeline = kernels.get_for(kernel, WeightFormat::Int4).pipeline;
    let tiled_pipeline = kernels.launch_pipelines(kernel, WeightFormat::Int4).tiled.unwrap().pipeline;
    for (decode, edit) in [(true, nibbles), (true, scales), (false, tiled_nibbles), (false, tiled_scales)] {
        if decode {
            let src = kernel.source(gpu.subgroups);
            assert_ne!(edit(&src), src, "the substitution applies");
            let wrong = edited_in(&gpu, &kernels, kernel, WeightFormat::Int4, |s| edit(&s));
            kernels.replace_pipeline_in(kernel, WeightFormat::Int4, wrong);
        } else {
            let c = crate::kernels::MatmulConstants {
                format: WeightFormat::Int4,
                ..kernel.matmul_constants().unwrap()
            };
            let src = c.source();
            assert_ne!(edit(&src), src, "the substitution applies");
            let layout = Some(kernels.layout(kernel));
            let wrong = compile_for_layout(
                &gpu,
                "edited",
                &edit(&src),
                "int8_matmul",
                kernel.bindings(),
                &c.render(),
                layout,
            )
            .expect("the edited kernel compiles")
            .0;
            kernels.replace_tiled_pipeline_in(kernel, WeightFormat::Int4, wrong);
        }
        let check = run_format(&gpu, &kernels, WeightFormat::Int4).unwrap();
        let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
        let how = if decode { "int4: " } else { "int4: tiled:" };
        assert!(check.failures[0].1.starts_with(how), "{}", check.describe_failures());
        // The int8 pipelines of the same variant pass.
        assert!(run(&gpu, &kernels).unwrap().ok);
        kernels.replace_pipeline_in(kernel, WeightFormat::Int4, decode_pipeline.clone());
        kernels.replace_tiled_pipeline_in(kernel, WeightFormat::Int4, tiled_pipeline.clone());
        assert!(run_format(&gpu, &kernels, WeightFormat::Int4).unwrap().ok, "the set restored");
    }
}

/// On the split-K layout the int4 normed decode pipelines take integer
/// dot products (`IDOT`): one pairing a word's nibbles with the wrong
/// inputs is caught, and only it.
#[test]
fn an_int_dot_pipeline_with_its_nibbles_swapped_is_caught() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let layout = Some(crate::kernels::MatvecLayout::SplitK);
    let mut kernels =
        Kernels::new(&gpu, KernelChoice::Wgsl, layout, CHECKER).expect("the WGSL kernels build");
    kernels.prepare_format(&gpu, WeightFormat::Int4).unwrap();
    let kernel = Kernel::Int8MatvecNorm;
    assert!(kernel
        .typed_constants_in(kernels.matvec_layout, WeightFormat::Int4)
        .render()
        .contains(&("IDOT", 1.0)));
    let good = kernels.get_for(kernel, WeightFormat::Int4).pipeline;
    let swap = |s: String| {
        s.replace(
            "dot4I8Packed(lo.x, q0.x) + dot4I8Packed(hi.x, q0.y)",
            "dot4I8Packed(hi.x, q0.x) + dot4I8Packed(lo.x, q0.y)",
        )
    };
    let wrong = edited_in(&gpu, &kernels, kernel, WeightFormat::Int4, swap);
    kernels.replace_pipeline_in(kernel, WeightFormat::Int4, wrong);
    let check = run_format(&gpu, &kernels, WeightFormat::Int4).unwrap();
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
    kernels.replace_pipeline_in(kernel, WeightFormat::Int4, good);
    assert!(run_format(&gpu, &kernels, WeightFormat::Int4).unwrap().ok, "the set restored");
}

#[test]
fn a_swapped_buffer_slot_is_caught() {
    let (gpu, mut kernels) = wgsl_kernels();
    // x and norm_w trade slots: both are f32 vectors of the input length.
    let swap = |s: String| {
        s.replace("@binding(1) var<storage, read> x:", "@binding(9) var<storage, read> x:")
            .replace("@binding(5) var<storage, read> norm_w:", "@binding(1) var<storage, read> norm_w:")
            .replace("@binding(9) var<storage, read> x:", "@binding(5) var<storage, read> x:")
    };
    let wrong = edited(&gpu, &kernels, Kernel::Int8MatvecNorm, swap);
    kernels.replace_pipeline(Kernel::Int8MatvecNorm, wrong);
    let check = run(&gpu, &kernels).unwrap();
    assert!(!check.ok);
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
}

/// On the split-K layout (the residual's f16 copy), a normed matvec
/// that reads the f32 x and norm weights instead of their f16 copies
/// is caught: the check gives the copies other values.
#[test]
fn a_normed_matvec_not_reading_the_f16_copies_is_caught() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let mut kernels =
        Kernels::new(&gpu, KernelChoice::Wgsl, Some(crate::kernels::MatvecLayout::SplitK), CHECKER)
            .expect("the WGSL kernels build");
    assert!(kernels.matvec_layout.x16() && run(&gpu, &kernels).unwrap().ok);
    let f32_reads = |s: String| s.replace("if X16 && NORM {", "if false {").replace("if X16 {", "if false {");
    assert_ne!(
        f32_reads(Kernel::Int8MatvecNorm.source(gpu.subgroups)),
        Kernel::Int8MatvecNorm.source(gpu.subgroups)
    );
    let wrong = edited(&gpu, &kernels, Kernel::Int8MatvecNorm, f32_reads);
    kernels.replace_pipeline(Kernel::Int8MatvecNorm, wrong);
    let check = run(&gpu, &kernels).unwrap();
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
}

/// On the split-K layout, a normed matvec pipeline specialised to a
/// shape, or one of batched rows, that reads the f32 x and norm weights
/// instead of their f16 copies fails its proof (which gives the copies
/// other values) and is not used.
#[test]
fn a_shaped_matvec_not_reading_the_f16_copies_is_not_used() {
    use crate::kernels::{MatvecLayout, MatvecShape};
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let mut kernels = Kernels::new(&gpu, KernelChoice::Wgsl, Some(MatvecLayout::SplitK), CHECKER)
        .expect("the WGSL kernels build");
    let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
    for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecNormSwiglu] {
        let split = MatvecLayout::SplitK.split(70, 48, true, WeightFormat::Int8);
        assert!(split.x16);
        assert!(
            kernels.matvec_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8).is_some(),
            "{kernel:?}"
        );
        assert!(
            kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, 3).is_some(),
            "{kernel:?}"
        );
    }
    // The f32 norm weights (the f16 x still read; this one passed the
    // proof while the copies held the f32 values), then the f32 x: each
    // on shapes and row counts not built yet.
    type Edit = fn(&str) -> String;
    let f32_norm_weights: Edit = |s| s.replace("if X16 {", "if false {");
    let f32_x: Edit = |s| s.replace("if X16 && NORM {", "if false {");
    for (edit, n_in, rows) in [(f32_norm_weights, 170, 5), (f32_x, 150, 6)] {
        kernels.edit_rows_source(edit);
        let shaped = MatvecShape { n_in, ..shape };
        for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecNormSwiglu] {
            let split = MatvecLayout::SplitK.split(70, 48, true, WeightFormat::Int8);
            assert!(
                kernels.matvec_pipeline(&gpu, kernel, split, shaped, WeightFormat::Int8).is_none(),
                "{kernel:?} {n_in}"
            );
            assert!(
                kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, rows).is_none(),
                "{kernel:?} {n_in}"
            );
        }
    }
}

#[test]
fn a_wrong_epilogue_and_a_wrong_attention_are_caught() {
    let (gpu, mut kernels) = wgsl_kernels();
    // The accumulate slot runs the plain normed matvec: y is overwritten.
    let plain = kernels.get(Kernel::Int8MatvecNorm).pipeline.clone();
    kernels.replace_pipeline(Kernel::Int8MatvecAccumulate, plain);
    // The chunked decode attention runs the direct variant's pipeline.
    let direct = kernels.get(Kernel::AttentionStepDirect).pipeline.clone();
    kernels.replace_pipeline(Kernel::AttentionStep, direct);
    let check = run(&gpu, &kernels).unwrap();
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    assert!(failed.contains(&"Int8MatvecAccumulate"), "{}", check.describe_failures());
    assert!(failed.contains(&"AttentionStep"), "{}", check.describe_failures());
}

/// The packed decode attention (two query heads a workgroup) is proven at
/// its first use and served, over either KV format; a wrong one (the second
/// head's output taking the first head's V sums) fails its check and is
/// not served: the unpacked pipeline serves instead.
#[test]
fn the_packed_attention_is_proven_and_a_wrong_one_is_not_served() {
    use crate::kernels::{AttentionConstants, Constants};
    let (gpu, kernels) = wgsl_kernels();
    for kv in [KvFormat::F16, KvFormat::Int8] {
        assert!(kernels.attention_packed_pipeline(&gpu, kv).is_some(), "{kv}");
        let check = run_packed_attention(&gpu, &kernels, kv).unwrap();
        assert!(check.ok, "{kv}: {}", check.describe_failures());
    }
    let (gpu, mut kernels) = wgsl_kernels();
    let k = Kernel::AttentionStep;
    let Constants::Attention(c) = k.typed_constants(kernels.matvec_layout) else {
        panic!("an attention kernel")
    };
    let constants = Constants::Attention(AttentionConstants { packed: true, ..c }).render();
    let wrong = edited_with(&gpu, &kernels, k, &constants, |s| {
        s.replace("write_head(lo1, hi1,", "write_head(lo, hi,")
    });
    kernels.replace_packed_attention_pipeline(KvFormat::F16, wrong);
    let check = run_packed_attention(&gpu, &kernels, KvFormat::F16).unwrap();
    assert!(!check.ok, "a wrong packed attention passed");
    assert!(kernels.attention_packed_pipeline(&gpu, KvFormat::F16).is_none());
}

/// Where the set runs prompt attention on 16 x 16 tiles (here their
/// emulation: lavapipe has f16 but no cooperative matrices), a model of the
/// check's head_dim runs that program over an f16 cache, and the check
/// covers it and `attention_prefill` (what other head_dims and the int8
/// cache run): a tile program that reads every query head's K and V from
/// KV head 0 is caught.
#[test]
fn the_tile_attention_program_is_checked_and_a_wrong_one_caught() {
    let gpu = Gpu::new_with(AdapterPolicy::Portable, false, true).expect("a Vulkan adapter (lavapipe in CI)");
    let mut kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, CHECKER).expect("the WGSL kernels build");
    assert!(
        kernels.coop_emulated && kernels.attention_tiles,
        "lavapipe has f16 and 32 KB of workgroup memory"
    );
    let check = kernels.report.self_check.clone();
    assert!(check.ok, "{}", check.describe_failures());
    let (tiles, per_wg) = kernels.attention_prefill_for(KvFormat::F16, 64);
    assert_eq!(per_wg, crate::kernels::PREFILL_TILE_ATTENTION_TOKENS);
    let f32_program = kernels.attention_prefill_f32(KvFormat::F16);
    assert_ne!(tiles, f32_program);
    for (kv, head_dim) in [(KvFormat::F16, 72), (KvFormat::F16, 40)] {
        let (p, per_wg) = kernels.attention_prefill_for(kv, head_dim);
        assert_eq!((p, per_wg), (f32_program.clone(), PREFILL_ATTENTION_TOKENS), "head_dim {head_dim}");
    }
    kernels.prepare_kv(&gpu, KvFormat::Int8, 64).unwrap();
    let (p, per_wg) = kernels.attention_prefill_for(KvFormat::Int8, 64);
    assert_eq!((p, per_wg), (kernels.attention_prefill_f32(KvFormat::Int8), PREFILL_ATTENTION_TOKENS));
    let src = crate::kernels::attention_prefill_tiles_source(true);
    let wrong = src.replace("let kvh = wg.x / (p.n_heads / p.n_kv_heads);", "let kvh = 0u;");
    assert_ne!(src, wrong, "the edit applies");
    let k = Kernel::AttentionPartial;
    let constants = Constants::Workgroup(k.workgroup_size()).render();
    let layout = Some(kernels.layout(k));
    let wrong =
        compile_for_layout(&gpu, "edited", &wrong, "attention_prefill", k.bindings(), &constants, layout)
            .expect("the edited kernel compiles")
            .0;
    kernels.replace_attention_tiles_pipeline(wrong.clone());
    let check = run(&gpu, &kernels).unwrap();
    assert!(!check.ok, "a tile program reading KV head 0 for every head passed");
    assert!(check.describe_failures().contains("AttentionPartial"), "{}", check.describe_failures());
    // The f32 program is checked too: the wrong one in its place fails.
    kernels.replace_attention_tiles_pipeline(tiles);
    assert!(run(&gpu, &kernels).unwrap().ok);
    kernels.replace_kv_pipeline(k, KvFormat::F16, true, wrong);
    assert!(!run(&gpu, &kernels).unwrap().ok, "a wrong f32 prompt attention passed");
}

/// The int8 KV cache's pipelines pass their check at first use, and each
/// kind of wrong one is caught: the f16 cache's pipelines in the int8
/// slots (the q/k norm's write, the prompt batch's attention), and a
/// decode attention whose scores take the V rows' steps.
#[test]
fn the_int8_kv_pipelines_are_proven_and_wrong_ones_are_caught() {
    let (gpu, mut kernels) = wgsl_kernels();
    assert!(kernels.kv_check(KvFormat::Int8).is_none());
    kernels.prepare_kv(&gpu, KvFormat::Int8, 64).unwrap();
    let check = kernels.kv_check(KvFormat::Int8).expect("checked at first use");
    assert!(check.ok && check.pipelines >= 5, "{}", check.describe_failures());
    let f16 = |k: Kernel| kernels.launch_pipelines(k, WeightFormat::Int8);
    let (norm, batch) = (f16(Kernel::QkNormRope).decode, f16(Kernel::AttentionPartial).per_token.unwrap());
    kernels.replace_kv_pipeline(Kernel::QkNormRope, KvFormat::Int8, false, norm);
    kernels.replace_kv_pipeline(Kernel::AttentionPartial, KvFormat::Int8, true, batch);
    let k = Kernel::AttentionStepDirect;
    let mut constants = k.typed_constants(kernels.matvec_layout).render();
    constants.push(("KV_INT8", 1.0));
    let swapped = edited_with(&gpu, &kernels, k, &constants, |s| {
        s.replace(
            "fn k_step(w: u32) -> f32 {\n    return bitcast<f32>(k_cache",
            "fn k_step(w: u32) -> f32 {\n    return bitcast<f32>(v_cache",
        )
    });
    kernels.replace_kv_pipeline(k, KvFormat::Int8, false, swapped);
    let check = run_kv(&gpu, &kernels, KvFormat::Int8).unwrap();
    let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
    for want in ["QkNormRope", "AttentionPartial", "AttentionStepDirect"] {
        assert!(failed.contains(&want), "{want}: {}", check.describe_failures());
    }
    assert!(!failed.contains(&"AttentionStep"), "{}", check.describe_failures());
}

/// A batched-row pipeline is used only once proven against the
/// one-token pipeline its rows run alone: correct ones are (every
/// variant, asked for with and without waiting, row counts a workgroup
/// runs whole or in grid z groups); one that differs in the last bit of
/// its outputs is not, in either route, and is never built again (the
/// caller runs the one-token pipeline per row). A specialised one-token
/// pipeline that computes a wrong value is not used either.
#[test]
fn a_batched_row_pipeline_is_used_only_once_proven() {
    use crate::kernels::{MatvecLayout, MatvecShape};
    let (gpu, mut kernels) = wgsl_kernels();
    let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
    // Asks without waiting until the pipeline comes or its build failed.
    let wait = |kernels: &Kernels, kernel: Kernel, split, rows: u32| {
        let t0 = Instant::now();
        loop {
            if let Some(p) =
                kernels.matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, WeightFormat::Int8, rows)
            {
                return Some(p);
            }
            if kernels.rows_failed(kernel, split, shape, rows) {
                return None;
            }
            assert!(t0.elapsed().as_secs() < 120, "the build never finished");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    let splits = [MatvecLayout::RowsPerTeam.splits()[0], MatvecLayout::SplitK.splits()[0]];
    for split in splits {
        for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecAccumulate, Kernel::Int8MatvecNormSwiglu] {
            let what = format!("{kernel:?} {split:?}");
            // What a session runs the launch with alone (the forward
            // builds it before any batch).
            assert!(
                kernels.matvec_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8).is_some(),
                "{what}"
            );
            assert!(
                kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, 3).is_some(),
                "{what}"
            );
            assert!(wait(&kernels, kernel, split, 6).is_some(), "{what}");
            assert!(!kernels.rows_failed(kernel, split, shape, 6), "{what}");
        }
    }
    // Where no pipeline is specialised to the shape, a session runs the
    // kernel's default pipeline alone; rows of the other layout's split
    // (another order of additions) differ from it, and are not used.
    let other = MatvecShape { n_in: 150, ..shape };
    let kernel = Kernel::Int8MatvecNorm;
    let foreign = splits.into_iter().find(|s| s.layout != kernels.matvec_layout).unwrap();
    assert!(
        kernels.matvec_rows_pipeline(&gpu, kernel, foreign, other, WeightFormat::Int8, 4).is_none(),
        "{foreign:?}"
    );
    // A wrong specialised one-token pipeline is not used either (the
    // general one serves), nor built again.
    kernels.edit_rows_source(|s| s.replace("y[o] = v;", "y[o] = v * 2.0 + 1.0;"));
    let shaped = MatvecShape { n_in: 170, ..shape };
    for split in splits {
        assert!(
            kernels
                .matvec_pipeline(&gpu, Kernel::Int8MatvecAccumulate, split, shaped, WeightFormat::Int8)
                .is_none(),
            "{split:?}"
        );
        assert!(
            kernels
                .matvec_pipeline(&gpu, Kernel::Int8MatvecAccumulate, split, shaped, WeightFormat::Int8)
                .is_none(),
            "{split:?}"
        );
    }
    kernels.edit_rows_source(|s| s.replace("y[o] = v;", "y[o] = v + v * 1e-6;"));
    let (kernel, split) = (Kernel::Int8MatvecAccumulate, splits[1]);
    assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, 7).is_none());
    assert!(kernels.rows_failed(kernel, split, shape, 7));
    assert!(
        kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, 7).is_none(),
        "not tried again"
    );
    assert!(wait(&kernels, kernel, split, 9).is_none());
    assert!(
        kernels.matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, WeightFormat::Int8, 9).is_none(),
        "not tried again"
    );
    assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8, 9).is_none());
}
