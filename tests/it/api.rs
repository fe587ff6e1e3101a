//! The public API as an embedding app uses it: sharing the host's device,
//! the environment-variable opt-in, and streaming sessions.

use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::kernels::{ATTENTION_CHUNK, MATMUL_TOKENS_PER_WG};
use qwen3_wgpu::PREFILL_BATCH;
use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions, WeightFormat, BACKEND_ENV};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64")
}

fn expected() -> (Vec<u32>, Vec<u32>) {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (ids("prompt_ids"), ids("generated_ids"))
}

fn no_cache() -> LoadOptions {
    LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }
}

/// A host app's device, made the way a renderer would: default limits and
/// no optional features.
fn host_device() -> (wgpu::Device, wgpu::Queue) {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::PRIMARY;
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).expect("an adapter");
    pollster::block_on(adapter.request_device(&Default::default())).expect("a device")
}

#[test]
fn runs_on_the_host_apps_device_without_creating_another() {
    let (device, queue) = host_device();
    let engine = Engine::builder()
        .policy(AdapterPolicy::Portable)
        .device(device.clone(), queue.clone())
        .build()
        .unwrap();
    assert!(engine.gpu().device == device, "the engine must use the host's device");
    // The host asked for no subgroups: the workgroup-memory kernels run.
    assert!(!engine.uses_subgroups());
    let (prompt, want) = expected();
    let model = engine.load(fixture(), &no_cache()).unwrap();
    let out = model.generate(&prompt, 8, |_| {}).unwrap();
    assert_eq!(out.generated_ids(), &want[..8]);
}

#[test]
fn the_default_policy_refuses_a_non_metal_host_device() {
    let (device, queue) = host_device();
    let backend = device.adapter_info().backend;
    let r = Engine::builder().device(device, queue).build();
    if backend == wgpu::Backend::Metal {
        assert!(r.is_ok());
    } else {
        assert_eq!(r.err().map(|e| e.code()), Some("non_metal_adapter"));
    }
}

/// `QWEN3_WGPU_BACKEND=portable` opts in without code changes (checked in a
/// child process so the variable never leaks into other tests).
#[test]
fn environment_variable_opts_in_to_portable() {
    if std::env::var_os("QWEN3_WGPU_TEST_CHILD").is_some() {
        let r = Engine::new();
        println!("RESULT={}", r.err().map(|e| e.code()).unwrap_or("ok"));
        return;
    }
    let run = |value: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "api::environment_variable_opts_in_to_portable",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("QWEN3_WGPU_TEST_CHILD", "1")
            .env(BACKEND_ENV, value)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    assert!(run("portable").contains("RESULT=ok"), "portable opt-in failed");
    let metal = run("metal");
    let best = qwen3_wgpu::Gpu::adapters().into_iter().next().unwrap().get_info().backend;
    if best != wgpu::Backend::Metal {
        assert!(metal.contains("RESULT=non_metal_adapter"), "{metal}");
    }
}

#[test]
fn streaming_session_matches_one_call_decode() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let (prompt, want) = expected();
    let model = engine.load(fixture(), &no_cache()).unwrap();
    let mut streamed = Vec::new();
    let out = model.generate(&prompt, 12, |t| streamed.push(t)).unwrap();
    assert_eq!(streamed, out.generated_ids());
    assert_eq!(out.stop_reason.as_str(), "max_new_tokens");
    assert_eq!(out.token_ids.len(), prompt.len() + 12);

    let mut s = model.session().unwrap();
    assert_eq!(s.capacity(), 4096);
    let mut got = vec![s.feed(&prompt).unwrap()];
    while got.len() < 12 {
        got.push(s.next_token().unwrap());
    }
    assert_eq!(got, out.generated_ids());
    assert_eq!(&got[..], &want[..12]);
    assert_eq!(s.len(), prompt.len() + 11);
}

/// Steps queued ahead of the caller are discarded when it runs a step
/// alone or feeds more tokens: whatever the lookahead, the tokens are those
/// of a wait on every token (lookahead 1), and of a fresh session fed the
/// same context in one call (batched prefill).
#[test]
fn queued_steps_never_change_the_tokens() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let (prompt, _) = expected();
    let model = engine.load(fixture(), &no_cache()).unwrap();
    let extra = [5u32, 17, 3];
    let mut runs = Vec::new();
    for lookahead in [1, 4, 8] {
        let mut s = model.session_with_capacity(128).unwrap();
        s.set_lookahead(lookahead);
        let mut seq = vec![s.feed(&prompt).unwrap()];
        seq.extend((0..3).map(|_| s.next_token().unwrap()));
        // A timed step runs alone: the queued steps are dropped and the
        // GPU's position is put back; then more than a lookahead's worth.
        s.timed_step().unwrap();
        seq.push(s.pending().unwrap());
        seq.extend((0..10).map(|_| s.next_token().unwrap()));
        assert_eq!(s.len(), prompt.len() + seq.len() - 1);
        // The last token is still pending: `feed` commits it before `extra`.
        let after: Vec<u32> =
            std::iter::once(s.feed(&extra).unwrap()).chain((0..4).map(|_| s.next_token().unwrap())).collect();
        runs.push((seq, after));
    }
    assert!(runs.windows(2).all(|w| w[0] == w[1]), "lookaheads disagree: {runs:?}");
    let (seq, after) = &runs[0];
    let context: Vec<u32> = prompt.iter().chain(seq).chain(&extra).copied().collect();
    let mut fresh = model.session_with_capacity(128).unwrap();
    let again: Vec<u32> = std::iter::once(fresh.feed(&context).unwrap())
        .chain((0..4).map(|_| fresh.next_token().unwrap()))
        .collect();
    assert_eq!(&again, after, "one-call prefill of the same context");
}

/// The non-blocking token API gives the tokens `next_token` gives, and
/// needs a prompt first like it.
#[test]
fn try_next_token_gives_the_same_tokens_without_waiting() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let (prompt, want) = expected();
    let model = engine.load(fixture(), &no_cache()).unwrap();
    let mut s = model.session_with_capacity(64).unwrap();
    assert_eq!(s.try_next_token().err().map(|e| e.code()), Some("no_pending_token"));
    let mut got = vec![s.feed(&prompt).unwrap()];
    while got.len() < 8 {
        match s.try_next_token().unwrap() {
            Some(t) => got.push(t),
            // A host would render a frame here.
            None => std::thread::sleep(std::time::Duration::from_micros(200)),
        }
    }
    assert_eq!(&got[..], &want[..8]);
    assert_eq!(s.len(), prompt.len() + 7);
    // Mixed with the blocking call, the sequence goes on unchanged.
    got.push(s.next_token().unwrap());
    assert_eq!(&got[..], &want[..9]);
}

#[test]
fn stops_at_end_of_text() {
    // Make the fixture's 3rd greedy token the end-of-text id.
    let (prompt, want) = expected();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(fixture().join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    cfg["eos_token_id"] = serde_json::json!(want[2]);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let out = qwen3_wgpu::decode_with(&engine, tmp.path(), &prompt, 16, &no_cache()).unwrap();
    let first = want.iter().position(|&t| t == want[2]).unwrap();
    assert_eq!(out.generated_ids(), &want[..=first]);
    assert_eq!(out.stop_reason.as_str(), "end_of_text");
}

/// Memory is bounded and accounted: the weights once per model, and per
/// session exactly what its capacity needs (KV cache in f16, RoPE table,
/// token sequence, attention partials per chunk of positions), allocated
/// up front.
#[test]
fn memory_is_accounted_per_model_and_per_session_capacity() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let model = engine.load(fixture(), &no_cache()).unwrap();
    let cfg = model.config().clone();
    // int8 weights plus scales: about one byte per parameter, never f32-sized.
    let params = cfg.vocab_size * cfg.hidden_size
        + cfg.num_hidden_layers
            * (cfg.qkv_rows() * cfg.hidden_size
                + cfg.hidden_size * cfg.q_dim()
                + 3 * cfg.intermediate_size * cfg.hidden_size);
    let w = model.weight_bytes() as usize;
    assert!(w >= params && w < params + params / 8 + (1 << 16), "{w} bytes for {params} parameters");
    // Both capacities hold one chunk of attention positions and one full
    // prompt batch of activation rows.
    let (small_cap, large_cap) = (PREFILL_BATCH - 24, PREFILL_BATCH);
    assert!(
        large_cap <= ATTENTION_CHUNK as usize
            && small_cap.next_multiple_of(MATMUL_TOKENS_PER_WG as usize) >= PREFILL_BATCH
    );
    let small = model.session_with_capacity(small_cap).unwrap().buffer_bytes();
    let large = model.session_with_capacity(large_cap).unwrap().buffer_bytes();
    let per_position = cfg.num_hidden_layers * 2 * cfg.kv_dim() * 2 // K and V, f16
        + cfg.head_dim * 4 // RoPE (cos, sin) pairs
        + 4; // the token sequence (u32)
    assert_eq!(large - small, (24 * per_position) as u64);
}

/// Launch parameters are packed into a few shared uniform buffers, each
/// block at the device's offset alignment and none overlapping another.
#[test]
fn launch_parameters_share_a_few_uniform_buffers() {
    use qwen3_wgpu::internals::gpu::{UniformPages, UNIFORM_PAGE_BYTES};
    let gpu = qwen3_wgpu::Gpu::new(AdapterPolicy::Portable).unwrap();
    let align = gpu.device.limits().min_uniform_buffer_offset_alignment as u64;
    let mut pages = UniformPages::new(&gpu);
    let n = 300u64;
    let blocks: Vec<_> = (0..n as u32).map(|i| pages.push(&gpu, bytemuck::cast_slice(&[i; 7]))).collect();
    let mut buffers: Vec<&wgpu::Buffer> = Vec::new();
    for (i, (page, offset, size)) in blocks.iter().enumerate() {
        assert!(offset % align == 0 && *size == 32 && offset + size <= page.size(), "block {i}");
        if !buffers.contains(&page) {
            buffers.push(page);
        }
        for (page2, offset2, size2) in &blocks[..i] {
            let apart = offset + size <= *offset2 || offset2 + size2 <= *offset;
            assert!(page != page2 || apart, "blocks {i} and one before overlap");
        }
    }
    let per_page = UNIFORM_PAGE_BYTES / align.max(32);
    assert_eq!(buffers.len() as u64, n.div_ceil(per_page));
    assert_eq!(pages.bytes(), buffers.len() as u64 * UNIFORM_PAGE_BYTES);
}

/// The decode matvec pipelines specialised to a launch shape are built once
/// per shape and split, then shared: a second request gets the same
/// pipeline, another shape a pipeline of its own.
#[test]
fn specialised_matvec_pipelines_are_built_once_per_shape() {
    use qwen3_wgpu::internals::kernels::{Kernel, KernelChoice, Kernels, MatvecShape};
    let gpu = qwen3_wgpu::Gpu::new(AdapterPolicy::Portable).unwrap();
    let kernels =
        Kernels::new(&gpu, KernelChoice::Wgsl, None, qwen3_wgpu::internals::self_check::CHECKER).unwrap();
    let qkv = MatvecShape { rows: 4096, k_words: 256, groups: 16, n_in: 1024 };
    let o = MatvecShape { rows: 1024, k_words: 512, groups: 32, n_in: 2048 };
    let split =
        kernels.matvec_layout.split(qkv.rows as usize, qkv.k_words as usize, true, WeightFormat::Int8);
    let get = |kernel, shape| {
        kernels
            .matvec_pipeline(&gpu, kernel, split, shape, WeightFormat::Int8)
            .expect("a specialised pipeline")
    };
    let first = get(Kernel::Int8MatvecNorm, qkv);
    assert_eq!(first, get(Kernel::Int8MatvecNorm, qkv));
    assert_ne!(first, get(Kernel::Int8MatvecNorm, o));
    assert_ne!(first, get(Kernel::Int8MatvecNormSwiglu, qkv));
    // Kernels other than the matvecs have no specialised pipelines.
    assert!(kernels.matvec_pipeline(&gpu, Kernel::EmbedLookup, split, qkv, WeightFormat::Int8).is_none());
}

/// A host's device made with what the engine asks for
/// (`Engine::required_features` / `required_limits`).
fn host_device_for_the_engine() -> (wgpu::Device, wgpu::Queue) {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::PRIMARY;
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).expect("an adapter");
    let wanted = wgpu::DeviceDescriptor {
        required_features: Engine::required_features(&adapter),
        required_limits: Engine::required_limits(&adapter),
        ..Default::default()
    };
    pollster::block_on(adapter.request_device(&wanted)).expect("a device")
}

/// A validation error of the host's own, outside any error scope: a bind
/// group with no entries for a layout that has one.
fn host_validation_error(device: &wgpu::Device) {
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("host layout"),
        entries: &[wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        }],
    });
    let _ = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("host bind group"),
        layout: &layout,
        entries: &[],
    });
}

#[test]
fn host_error_handler_survives_adoption() {
    let (device, queue) = host_device_for_the_engine();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = seen.clone();
    device.on_uncaptured_error(std::sync::Arc::new(move |e: wgpu::Error| {
        sink.lock().unwrap().push(e.to_string());
    }));
    let engine =
        Engine::builder().policy(AdapterPolicy::Portable).device(device.clone(), queue).build().unwrap();
    host_validation_error(&device);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1, "the host's handler must receive the host's own error: {seen:?}");
    assert!(seen[0].contains("host bind group"), "{seen:?}");
    drop(engine);
}

#[test]
fn engine_works_after_host_error() {
    let (device, queue) = host_device_for_the_engine();
    // The host's handler swallows its errors (without one, wgpu panics).
    device.on_uncaptured_error(std::sync::Arc::new(|_e: wgpu::Error| {}));
    let engine =
        Engine::builder().policy(AdapterPolicy::Portable).device(device.clone(), queue).build().unwrap();
    assert!(engine.uses_subgroups() == device.features().contains(wgpu::Features::SUBGROUP));
    host_validation_error(&device);
    let (prompt, want) = expected();
    let model = engine.load(fixture(), &no_cache()).unwrap();
    host_validation_error(&device);
    let out = model.generate(&prompt, 8, |_| {}).unwrap();
    assert_eq!(out.generated_ids(), &want[..8]);
}

/// An MSL build rejected by wgpu itself (here: passthrough MSL on a Vulkan
/// adapter, a validation error raised inside wgpu) leaves the engine on
/// WGSL, self-checked, with the reason recorded.
#[test]
fn a_rejected_msl_build_falls_back_to_wgsl_through_wgpus_error_route() {
    let engine =
        Engine::builder().policy(AdapterPolicy::Portable).attempt_msl_on_any_adapter().build().unwrap();
    let report = engine.kernel_report();
    assert_eq!(report.source, qwen3_wgpu::KernelSource::Wgsl);
    let (kernel, reason) = report.fallback.clone().expect("the MSL rejection is recorded");
    assert!(kernel.ends_with("(MSL)"), "{kernel}: {reason}");
    assert!(reason.to_lowercase().contains("passthrough") || reason.contains("MSL"), "{reason}");
    assert!(report.self_check.ok && report.self_check.pipelines > 0, "{:?}", report.self_check);
    // And it decodes.
    let (prompt, want) = expected();
    let out = engine.load(fixture(), &no_cache()).unwrap().generate(&prompt, 4, |_| {}).unwrap();
    assert_eq!(out.generated_ids(), &want[..4]);
}

#[test]
fn every_engine_build_runs_the_self_check() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let report = engine.kernel_report();
    assert!(report.self_check.ok, "{:?}", report.self_check);
    // Every decode pipeline, the tiled prompt-batch ones (every matvec
    // variant) and the prompt-batch attention, over int8: an engine that
    // never loads int4 weights builds none of int4's.
    let all = qwen3_wgpu::internals::kernels::Kernel::ALL;
    let tiled = all.iter().filter(|k| k.prefill_tiled()).count();
    let matvecs = all.iter().filter(|k| k.matvec_variant().is_some()).count();
    assert_eq!(report.self_check.pipelines, all.len() + tiled + 1);
    assert!(report.self_check.ms > 0.0);
    assert_eq!(report.weight_formats, [qwen3_wgpu::WeightFormat::Int8, qwen3_wgpu::WeightFormat::Int4]);
    assert!(report.fallback.is_none(), "MSL was not wanted on {:?}", engine.adapter_info().backend);
    // The matvec variants' decode and tiled pipelines over int4, proven
    // when asked for (and by the first int4 load).
    let int4 = engine.prepare_weights(qwen3_wgpu::WeightFormat::Int4).unwrap();
    assert!(int4.self_check.ok, "{:?}", int4.self_check);
    assert_eq!(int4.self_check.pipelines, matvecs + tiled);
    assert_eq!((int4.source, int4.fallback), (qwen3_wgpu::KernelSource::Wgsl, None));
}
