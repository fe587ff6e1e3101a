//! Every error code is reachable, through the public API, with the stable
//! code and a message that names the problem. Never a panic.

use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::kernels::{self, Bind};
use qwen3_wgpu::{
    decode, decode_with, AdapterPolicy, CachePolicy, Engine, Error, Gpu, LoadOptions, ShapeProfile,
};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64")
}

fn engine() -> &'static Engine {
    crate::support::engine()
}

fn no_cache() -> LoadOptions {
    LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }
}

/// A copy of the small fixture that a test may break.
fn fixture_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), tmp.path().join(f)).unwrap();
    }
    tmp
}

#[test]
fn codes_are_stable_and_distinct() {
    let mut codes = Error::ALL_CODES.to_vec();
    codes.sort();
    codes.dedup();
    assert_eq!(codes.len(), Error::ALL_CODES.len());
    assert_eq!(Error::EmptyPrompt.code(), "empty_prompt");
}

/// The guide's error table (`qwen3_wgpu::guide::errors`) has a row for
/// every code, so a user can look up what to do about any error.
#[test]
fn guide_documents_every_code() {
    let table = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/guide/errors.md")).unwrap();
    for code in Error::ALL_CODES {
        assert!(
            table.contains(&format!("| `{code}` |")),
            "src/guide/errors.md's table has no row for {code}"
        );
    }
}

#[test]
fn checkpoint_not_found() {
    let e = decode_with(engine(), "/nonexistent/qwen3", &[1, 2], 4, &no_cache()).unwrap_err();
    assert_eq!(e.code(), "checkpoint_not_found");
    assert!(e.to_string().contains("/nonexistent/qwen3"), "{e}");
}

#[test]
fn checkpoint_invalid() {
    let dir = fixture_copy();
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let e = decode_with(engine(), dir.path(), &[1, 2], 4, &no_cache()).unwrap_err();
    assert_eq!(e.code(), "checkpoint_invalid");
    assert!(e.to_string().contains("config.json"), "{e}");
}

#[test]
fn unsupported_checkpoint_architecture_lists_every_field() {
    let options =
        LoadOptions { profile: ShapeProfile::Qwen3_0_6B, cache: CachePolicy::Disabled, ..Default::default() };
    let e = decode_with(engine(), fixture(), &[1, 2], 4, &options).unwrap_err();
    assert_eq!(e.code(), "unsupported_checkpoint_architecture");
    let Error::UnsupportedArchitecture { mismatches, .. } = &e else { panic!("{e:?}") };
    // gqa2_hd64: hidden 128, 2 layers, 4 heads, 2 kv heads, head_dim 64, inter 256, vocab 1000
    let fields: Vec<&str> = mismatches.iter().map(|m| m.field.as_str()).collect();
    for f in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
    ] {
        assert!(fields.contains(&f), "{f} missing from {fields:?}");
    }
    let hidden = mismatches.iter().find(|m| m.field == "hidden_size").unwrap();
    assert_eq!((hidden.expected.as_str(), hidden.found.as_str()), ("1024", "128"));
}

#[test]
fn unsupported_dtype() {
    let dir = fixture_copy();
    // Rewrite the checkpoint with one tensor stored as I8.
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    let norm = vec![1u8; 128];
    for (name, view) in st.tensors() {
        if name == "model.norm.weight" {
            tensors.push((
                name,
                safetensors::tensor::TensorView::new(safetensors::Dtype::I8, vec![128], &norm).unwrap(),
            ));
        } else {
            tensors.push((name, view));
        }
    }
    safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors")).unwrap();
    let e = decode_with(engine(), dir.path(), &[1, 2], 4, &no_cache()).unwrap_err();
    assert_eq!(e.code(), "unsupported_dtype");
    assert!(e.to_string().contains("model.norm.weight"), "{e}");
}

#[test]
fn non_metal_adapter() {
    let best = Gpu::adapters().into_iter().next().expect("an adapter").get_info();
    let e = Engine::builder().policy(AdapterPolicy::MetalOnly).build().err();
    if best.backend == wgpu::Backend::Metal {
        assert!(e.is_none(), "Metal adapter refused: {e:?}");
    } else {
        let e = e.expect("a non-Metal adapter must be refused by default");
        assert_eq!(e.code(), "non_metal_adapter");
        let Error::NonMetalAdapter { backend, adapter } = &e else { panic!("{e:?}") };
        assert_eq!(adapter, &best.name);
        assert_eq!(backend, &format!("{:?}", best.backend));
    }
}

/// Runs in a child process whose Vulkan loader is pointed at no driver.
#[test]
fn no_gpu_adapter() {
    if std::env::var_os("QWEN3_WGPU_TEST_CHILD").is_some() {
        let e = Engine::builder().policy(AdapterPolicy::Portable).build().err().expect("no adapter");
        println!("CODE={}", e.code());
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["errors::no_gpu_adapter", "--exact", "--nocapture", "--test-threads=1"])
        .env("QWEN3_WGPU_TEST_CHILD", "1")
        .env("VK_DRIVER_FILES", "/nonexistent/icd.json")
        .env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("CODE=no_gpu_adapter"),
        "child said: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn gpu_device_failed() {
    let gpu = Gpu::new(AdapterPolicy::Portable).unwrap();
    // A device that is gone (destroyed, as after a GPU reset) cannot host the engine.
    gpu.device.destroy();
    let e = Engine::builder()
        .policy(AdapterPolicy::Portable)
        .device(gpu.device.clone(), gpu.queue.clone())
        .build()
        .err()
        .expect("a destroyed device must fail");
    assert_eq!(e.code(), "gpu_device_failed", "{e}");
}

#[test]
fn shader_compile_failed() {
    let gpu = Gpu::new(AdapterPolicy::Portable).unwrap();
    let broken = "@compute @workgroup_size(64) fn k() { let x: u32 = 1.5; }";
    let e = kernels::compile(&gpu, "broken", broken, "k", &[Bind::ReadWrite], &[]).unwrap_err();
    assert_eq!(e.code(), "shader_compile_failed");
    assert!(e.to_string().contains("broken"), "{e}");
    // Valid WGSL that the device rejects at pipeline creation (layout mismatch).
    let src = "@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n@compute @workgroup_size(64) fn k() { y[0] = 1.0; }";
    let e = kernels::compile(&gpu, "mismatch", src, "k", &[Bind::Uniform], &[]).unwrap_err();
    assert_eq!(e.code(), "shader_compile_failed");
}

#[test]
fn invalid_token_id() {
    let e = decode_with(engine(), fixture(), &[1, 1000], 4, &no_cache()).unwrap_err();
    assert_eq!(e.code(), "invalid_token_id");
    let Error::InvalidTokenId { id, position, vocab_size } = e else { panic!() };
    assert_eq!((id, position, vocab_size), (1000, 1, 1000));
    // Also through a session.
    let model = engine().load(fixture(), &no_cache()).unwrap();
    let mut s = model.session_with_capacity(8).unwrap();
    assert_eq!(s.feed(&[5, 1_000_000]).unwrap_err().code(), "invalid_token_id");
    assert!(s.is_empty(), "a rejected feed runs nothing");
}

#[test]
fn empty_prompt() {
    let e = decode(engine(), fixture(), &[], 4).unwrap_err();
    assert_eq!(e.code(), "empty_prompt");
    let model = engine().load(fixture(), &no_cache()).unwrap();
    let mut s = model.session_with_capacity(8).unwrap();
    assert_eq!(s.feed(&[]).unwrap_err().code(), "empty_prompt");
    assert_eq!(s.next_token().unwrap_err().code(), "no_pending_token");
}

#[test]
fn context_overflow() {
    let model = engine().load(fixture(), &no_cache()).unwrap();
    // max_position_embeddings 4096: 4000 prompt tokens + 100 new do not fit.
    let prompt = vec![7u32; 4000];
    let e = model.generate(&prompt, 100, |_| {}).unwrap_err();
    assert_eq!(e.code(), "context_overflow");
    let Error::ContextOverflow { needed, capacity } = e else { panic!() };
    assert_eq!((needed, capacity), (4099, 4096));
    // A session fills up and then refuses.
    let mut s = model.session_with_capacity(3).unwrap();
    s.feed(&[1, 2]).unwrap();
    s.next_token().unwrap();
    assert_eq!(s.next_token().unwrap_err().code(), "context_overflow");
    assert_eq!(s.len(), 3);
    // More than max_position_embeddings is refused up front.
    assert_eq!(model.session_with_capacity(1 << 30).err().map(|e| e.code()), Some("context_overflow"));
}

#[test]
fn cache_io() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let options = LoadOptions { cache: CachePolicy::Dir(file.join("cache")), ..Default::default() };
    let e = decode_with(engine(), fixture(), &[1, 2], 4, &options).unwrap_err();
    assert_eq!(e.code(), "cache_io");
    assert!(e.to_string().contains("a-file"), "{e}");
}
