//! The exact Qwen3-0.6B-Base shape: a random BF16 checkpoint of that shape
//! (~1.2 GB, in a temp dir) is converted, decoded, and loaded again from the
//! cache into the same tokens. (A corrupted cache file is rebuilt whatever
//! the shape: `bad_inputs::cache_file_*` and `cache_faults::` check it on
//! small checkpoints.)

use std::path::Path;
use std::time::Instant;

use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions, ModelConfig, ShapeProfile};

fn cache_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

#[test]
fn exact_qwen3_0_6b_shape_converts_decodes_and_caches() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("qwen3-0.6b-random");
    let cache_dir = tmp.path().join("cache");
    std::fs::create_dir_all(&ckpt).unwrap();
    let t = Instant::now();
    let cfg = ModelConfig::qwen3_0_6b_base();
    write_random_checkpoint(&ckpt, &cfg, 1).unwrap();
    eprintln!("wrote the exact-shape checkpoint in {:.1} s", t.elapsed().as_secs_f64());

    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let check = &engine.kernel_report().self_check;
    assert!(check.ok, "self-check: {}", check.describe_failures());
    println!("self-check: {} pipelines in {:.1} ms", check.pipelines, check.ms);
    let options = LoadOptions {
        profile: ShapeProfile::Qwen3_0_6B,
        cache: CachePolicy::Dir(cache_dir.clone()),
        ..Default::default()
    };
    let prompt = [785u32, 6722, 315, 9625, 374];
    let new_tokens = 3;

    // First load converts and writes the cache.
    let model = engine.load(&ckpt, &options).unwrap();
    assert!(model.load_report().converted, "first load must convert");
    let session = model.session_with_capacity(64).unwrap();
    let dispatches = session.dispatches_per_token();
    drop(session);
    let first = model.generate(&prompt, new_tokens, |_| {}).unwrap();
    assert_eq!(first.generated_ids().len(), new_tokens);
    assert!(first.generated_ids().iter().all(|&t| (t as usize) < cfg.vocab_size));
    eprintln!(
        "exact shape, first run: load {:.0} ms (convert {:.0} ms), prefill {:.0} ms for {} tokens, decode {:.2} tok/s, {} dispatches/token, tokens {:?} [{}]",
        model.load_ms(),
        model.load_report().convert_ms,
        first.prefill_ms,
        prompt.len(),
        first.decode_tokens_per_sec,
        dispatches,
        first.generated_ids(),
        engine.adapter_info().name,
    );
    drop(model);
    let files = cache_files(&cache_dir);
    assert_eq!(files.len(), 1, "exactly one cache file, no temp files: {files:?}");

    // Second load uses the cache and decodes the same tokens.
    let model = engine.load(&ckpt, &options).unwrap();
    assert!(!model.load_report().converted, "second load must use the cache");
    let second = model.generate(&prompt, new_tokens, |_| {}).unwrap();
    assert_eq!(second.token_ids, first.token_ids);
    eprintln!(
        "exact shape, cached run: load {:.0} ms, decode {:.2} tok/s",
        model.load_ms(),
        second.decode_tokens_per_sec
    );
}
