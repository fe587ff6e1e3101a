//! The exact Qwen3-0.6B-Base shape: a random BF16 checkpoint of that shape
//! (~1.2 GB, in a temp dir) is converted, decoded, loaded again from the
//! cache, and rebuilt after the cache file is corrupted.

use std::borrow::Cow;
use std::path::Path;
use std::time::Instant;

use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions, ShapeProfile};
use safetensors::{Dtype, View};

const HIDDEN: usize = 1024;
const LAYERS: usize = 28;
const HEADS: usize = 16;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const INTER: usize = 3072;
const VOCAB: usize = 151936;

/// A BF16 tensor whose bytes are generated when the writer asks for them,
/// so the whole checkpoint is never in memory at once.
struct RandomBf16 {
    shape: Vec<usize>,
    seed: u64,
    std: f32,
    /// Norm weights: 1 + small noise instead of zero-mean noise.
    around_one: bool,
}

impl View for RandomBf16 {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let n: usize = self.shape.iter().product();
        let mut out = Vec::with_capacity(2 * n);
        let mut s = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for _ in 0..n {
            // xorshift64*: plenty for test weights
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let v = (r * 2.0 - 1.0) * self.std * 1.732 + if self.around_one { 1.0 } else { 0.0 };
            out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        2 * self.shape.iter().product::<usize>()
    }
}

fn write_checkpoint(dir: &Path) {
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut seed = 0u64;
    let mut t = |shape: &[usize], std: f32, around_one: bool| {
        seed += 1;
        RandomBf16 { shape: shape.to_vec(), seed, std, around_one }
    };
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), t(&[VOCAB, HIDDEN], 0.05, false))];
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        let w = 1.0 / (HIDDEN as f32).sqrt();
        tensors.push((format!("{p}.input_layernorm.weight"), t(&[HIDDEN], 0.1, true)));
        tensors.push((format!("{p}.self_attn.q_proj.weight"), t(&[HEADS * HEAD_DIM, HIDDEN], w, false)));
        tensors.push((format!("{p}.self_attn.k_proj.weight"), t(&[KV_HEADS * HEAD_DIM, HIDDEN], w, false)));
        tensors.push((format!("{p}.self_attn.v_proj.weight"), t(&[KV_HEADS * HEAD_DIM, HIDDEN], w, false)));
        tensors.push((format!("{p}.self_attn.o_proj.weight"), t(&[HIDDEN, HEADS * HEAD_DIM], w, false)));
        tensors.push((format!("{p}.self_attn.q_norm.weight"), t(&[HEAD_DIM], 0.1, true)));
        tensors.push((format!("{p}.self_attn.k_norm.weight"), t(&[HEAD_DIM], 0.1, true)));
        tensors.push((format!("{p}.post_attention_layernorm.weight"), t(&[HIDDEN], 0.1, true)));
        tensors.push((format!("{p}.mlp.gate_proj.weight"), t(&[INTER, HIDDEN], w, false)));
        tensors.push((format!("{p}.mlp.up_proj.weight"), t(&[INTER, HIDDEN], w, false)));
        tensors.push((format!("{p}.mlp.down_proj.weight"), t(&[HIDDEN, INTER], 1.0 / (INTER as f32).sqrt(), false)));
    }
    tensors.push(("model.norm.weight".to_string(), t(&[HIDDEN], 0.1, true)));
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
}

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
    write_checkpoint(&ckpt);
    eprintln!("wrote the exact-shape checkpoint in {:.1} s", t.elapsed().as_secs_f64());

    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let options = LoadOptions { profile: ShapeProfile::Qwen3_0_6B, cache: CachePolicy::Dir(cache_dir.clone()) };
    let prompt = [785u32, 6722, 315, 9625, 374];
    let new_tokens = 4;

    // First load converts and writes the cache.
    let model = engine.load(&ckpt, &options).unwrap();
    assert!(model.load_report().converted, "first load must convert");
    let session = model.session_with_capacity(64).unwrap();
    let dispatches = session.dispatches_per_token();
    drop(session);
    let first = model.generate(&prompt, new_tokens, |_| {}).unwrap();
    assert_eq!(first.generated_ids().len(), new_tokens);
    assert!(first.generated_ids().iter().all(|&t| (t as usize) < VOCAB));
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
    eprintln!("exact shape, cached run: load {:.0} ms, decode {:.2} tok/s", model.load_ms(), second.decode_tokens_per_sec);
    drop(model);

    // A corrupted cache file is detected and rebuilt, never used.
    let path = &files[0];
    let mut bytes = std::fs::read(path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(path, &bytes).unwrap();
    drop(bytes);
    let model = engine.load(&ckpt, &options).unwrap();
    assert!(model.load_report().converted, "a corrupted cache must be rebuilt");
    let third = model.generate(&prompt, new_tokens, |_| {}).unwrap();
    assert_eq!(third.token_ids, first.token_ids);
    drop(model);
    assert_eq!(cache_files(&cache_dir).len(), 1, "the rebuilt cache replaced the corrupt one");
    let model = engine.load(&ckpt, &options).unwrap();
    assert!(!model.load_report().converted, "the rebuilt cache is used");
}
