//! Checkpoint reading, validation, int8 conversion and the on-disk cache,
//! through the public API, on small checkpoints built on the fly.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::cache::{CachePolicy, ABANDONED_TEMP_AGE, CACHE_FORMAT_VERSION};
use qwen3_wgpu::internals::checkpoint::{expected_tensors, Checkpoint};
use qwen3_wgpu::internals::config::{check_profile, load_config, ModelConfig, ShapeProfile};
use qwen3_wgpu::internals::convert::{convert, dequantize};
use qwen3_wgpu::internals::converted::{Blob, ConvertedModel, QuantMatrix, BLOB_ALIGN, QUANT_GROUP};
use qwen3_wgpu::internals::load::{load_model, LoadReport};
use qwen3_wgpu::{Error, Mismatch};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

// ---------------------------------------------------------------- helpers

/// A small Qwen3 config: hidden 96 (two groups, the second padded), 3 heads
/// over 1 kv head of 32 dims, intermediate 80, 2 layers, vocab 50.
fn tiny_config() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 96,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 50,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": true,
        "eos_token_id": 7
    })
}

fn cfg_of(v: &Value) -> ModelConfig {
    let n = |k: &str| v[k].as_u64().unwrap() as usize;
    ModelConfig {
        hidden_size: n("hidden_size"),
        intermediate_size: n("intermediate_size"),
        num_hidden_layers: n("num_hidden_layers"),
        num_attention_heads: n("num_attention_heads"),
        num_key_value_heads: n("num_key_value_heads"),
        head_dim: n("head_dim"),
        vocab_size: n("vocab_size"),
        max_position_embeddings: 512,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap(),
        eos_token_ids: vec![],
    }
}

/// One tensor to write: name, shape, f32 values (stored in some dtype).
#[derive(Clone)]
struct Tensor {
    name: String,
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// Values exactly representable in bf16, f16 and f32 (k / 64 with
/// |k| <= 127), so any input dtype yields the same conversion. Norms are
/// 1 + k/128. About one element in 16 is zero and row 0 of each matrix has
/// an all-zero first group, to exercise zero scales.
fn make_tensors(cfg: &Value, seed: u64) -> Vec<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let c = cfg_of(cfg);
    let mut out = Vec::new();
    let mut names = expected_tensors(&c);
    if c.tie_word_embeddings {
        names.retain(|(n, _)| n != "lm_head.weight");
    }
    for (name, shape) in names {
        let count: usize = shape.iter().product();
        let values: Vec<f32> = if shape.len() == 1 {
            (0..count).map(|_| 1.0 + rng.random_range(-32i32..=32) as f32 / 128.0).collect()
        } else {
            let cols = shape[1];
            (0..count)
                .map(|i| {
                    if i < cols.min(QUANT_GROUP) || rng.random_range(0..16) == 0 {
                        0.0
                    } else {
                        rng.random_range(-127i32..=127) as f32 / 64.0
                    }
                })
                .collect()
        };
        out.push(Tensor { name, shape, values });
    }
    out
}

fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::I32 => values.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect(),
        Dtype::I8 => values.iter().map(|v| *v as i8 as u8).collect(),
        other => panic!("test helper does not encode {other:?}"),
    }
}

/// Writes `tensors` (each with its own dtype) as one safetensors file.
fn write_safetensors(path: &Path, tensors: &[(Tensor, Dtype)]) {
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(t, d)| (t.name.clone(), *d, t.shape.clone(), encode(&t.values, *d))).collect();
    let views: Vec<(String, TensorView<'_>)> =
        encoded.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn write_config(dir: &Path, cfg: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(cfg).unwrap()).unwrap();
}

/// A complete single-file checkpoint in `dir`, every tensor as `dtype`.
fn write_checkpoint(dir: &Path, cfg: &Value, tensors: &[Tensor], dtype: Dtype) {
    write_config(dir, cfg);
    let with_dtype: Vec<(Tensor, Dtype)> = tensors.iter().map(|t| (t.clone(), dtype)).collect();
    write_safetensors(&dir.join("model.safetensors"), &with_dtype);
}

fn tiny_checkpoint(dir: &Path) -> Vec<Tensor> {
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 1);
    write_checkpoint(dir, &cfg, &tensors, Dtype::BF16);
    tensors
}

fn blob_bytes(m: &ConvertedModel) -> &[u8] {
    qwen3_wgpu::internals::convert::blob_bytes(m).expect("storage shorter than the layout")
}

fn load(dir: &Path, cache: &CachePolicy) -> (ConvertedModel, LoadReport) {
    match load_model(dir, ShapeProfile::AnyQwen3, cache) {
        Ok(r) => r,
        Err(e) => panic!("load_model failed: {} ({e})", e.code()),
    }
}

fn load_err(dir: &Path, cache: &CachePolicy) -> Error {
    match load_model(dir, ShapeProfile::AnyQwen3, cache) {
        Ok(_) => panic!("load_model succeeded where it should fail"),
        Err(e) => e,
    }
}

/// Files in `dir` (names), sorted.
fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The reference quantization of one row: (q, scales), straight from the
/// spec with `f32::round` (half away from zero).
fn reference_row(row: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let groups = row.len().div_ceil(QUANT_GROUP);
    let mut q = vec![0i8; groups * QUANT_GROUP];
    let mut s = vec![0f32; groups];
    for (g, chunk) in row.chunks(QUANT_GROUP).enumerate() {
        let absmax = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = absmax / 127.0;
        s[g] = scale;
        if scale != 0.0 {
            for (i, x) in chunk.iter().enumerate() {
                q[g * QUANT_GROUP + i] = (x / scale).round().clamp(-127.0, 127.0) as i8;
            }
        }
    }
    (q, s)
}

/// Asserts that rows `first_row`, `first_row + stride`, ... of `m` hold
/// exactly the reference quantization of `t`'s rows, padding included.
fn assert_matrix_rows(
    model: &ConvertedModel,
    m: &QuantMatrix,
    (first_row, stride): (usize, usize),
    t: &Tensor,
) {
    let cols = t.shape[1];
    assert_eq!(m.cols, cols, "{}", t.name);
    let data = model.bytes(m.data);
    let scales = model.f32s(m.scales);
    for r in 0..t.shape[0] {
        let (q, s) = reference_row(&t.values[r * cols..(r + 1) * cols]);
        let row = first_row + r * stride;
        let got_q: Vec<i8> =
            data[row * m.padded_cols()..(row + 1) * m.padded_cols()].iter().map(|&b| b as i8).collect();
        assert_eq!(got_q, q, "{} row {r}", t.name);
        assert_eq!(&scales[row * m.groups()..(row + 1) * m.groups()], &s[..], "{} row {r} scales", t.name);
        // The test values are k/64 with a group absmax of the same form, so
        // the round trip is exact wherever the group's absmax is 127/64; in
        // general it is within half a step.
        for c in 0..cols {
            let w = t.values[r * cols + c];
            let d = dequantize(model, m, row, c).unwrap();
            assert!((w - d).abs() <= s[c / QUANT_GROUP] * 0.5 + 1e-7, "{} [{r},{c}]: {w} vs {d}", t.name);
        }
    }
}

fn by_name(tensors: &[Tensor]) -> HashMap<&str, &Tensor> {
    tensors.iter().map(|t| (t.name.as_str(), t)).collect()
}

/// Checks every array of `model` against the source tensors.
fn assert_model_matches(model: &ConvertedModel, tensors: &[Tensor]) {
    let t = by_name(tensors);
    let idx = &model.index;
    assert_matrix_rows(model, &idx.embed, (0, 1), t["model.embed_tokens.weight"]);
    for (i, l) in idx.layers.iter().enumerate() {
        let p = |s: &str| t[format!("model.layers.{i}.{s}").as_str()];
        let q = p("self_attn.q_proj.weight");
        let k = p("self_attn.k_proj.weight");
        assert_matrix_rows(model, &l.qkv, (0, 1), q);
        assert_matrix_rows(model, &l.qkv, (q.shape[0], 1), k);
        assert_matrix_rows(model, &l.qkv, (q.shape[0] + k.shape[0], 1), p("self_attn.v_proj.weight"));
        assert_matrix_rows(model, &l.o_proj, (0, 1), p("self_attn.o_proj.weight"));
        let gate = p("mlp.gate_proj.weight");
        // Interleaved: gate row i at 2i, up row i at 2i + 1.
        assert_matrix_rows(model, &l.gate_up, (0, 2), gate);
        assert_matrix_rows(model, &l.gate_up, (1, 2), p("mlp.up_proj.weight"));
        assert_matrix_rows(model, &l.down, (0, 1), p("mlp.down_proj.weight"));
        assert_eq!(model.f32s(l.input_norm), &p("input_layernorm.weight").values[..]);
        assert_eq!(model.f32s(l.q_norm), &p("self_attn.q_norm.weight").values[..]);
        assert_eq!(model.f32s(l.k_norm), &p("self_attn.k_norm.weight").values[..]);
        assert_eq!(model.f32s(l.post_norm), &p("post_attention_layernorm.weight").values[..]);
    }
    assert_eq!(model.f32s(idx.final_norm), &t["model.norm.weight"].values[..]);
    if let Some(head) = &idx.lm_head {
        assert_matrix_rows(model, head, (0, 1), t["lm_head.weight"]);
    }
}

/// Every range of the index starts at a multiple of BLOB_ALIGN.
fn assert_aligned(model: &ConvertedModel) {
    let idx = &model.index;
    let mut offsets = vec![idx.embed.data.offset, idx.embed.scales.offset, idx.final_norm.offset];
    for l in &idx.layers {
        offsets.extend([l.input_norm.offset, l.q_norm.offset, l.k_norm.offset, l.post_norm.offset]);
        for m in [&l.qkv, &l.o_proj, &l.gate_up, &l.down] {
            offsets.extend([m.data.offset, m.scales.offset]);
        }
    }
    assert!(offsets.iter().all(|o| o % BLOB_ALIGN == 0), "{offsets:?}");
    assert_eq!((model.blob.as_ptr() as usize + model.blob_start) % BLOB_ALIGN, 0);
}

fn cache_file(report: &LoadReport) -> PathBuf {
    report.cache_path.clone().expect("a cache path")
}

/// The file name of a load's cache file.
fn cache_name(report: &LoadReport) -> String {
    cache_file(report).file_name().unwrap().to_string_lossy().into_owned()
}

/// Asserts that `dir` holds exactly the files `names`, in any order.
fn assert_holds(dir: &Path, mut names: Vec<String>) {
    names.sort();
    assert_eq!(dir_entries(dir), names);
}

/// Changes a checkpoint's cache key: its generation_config.json (part of
/// the key) names end-of-text ids 7 and 9.
fn change_key(ckpt: &Path) {
    std::fs::write(ckpt.join("generation_config.json"), r#"{"eos_token_id": [7, 9]}"#).unwrap();
}

fn code(e: &Error) -> &'static str {
    e.code()
}

// ---------------------------------------------------------------- happy paths

#[test]
fn converts_and_writes_cache_then_hits_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    let tensors = tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());

    let (first, r1) = load(&ckpt, &policy);
    assert!(r1.converted);
    assert!(r1.load_ms >= r1.convert_ms);
    assert!(matches!(first.blob, Blob::Owned(_)));
    let path = cache_file(&r1);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(name.len(), 64 + 4, "{name}");
    assert!(name.ends_with(".q3w"));
    assert_eq!(dir_entries(&cache_dir), vec![name.clone()], "no temp files left");
    assert_eq!(first.config.vocab_size, 50);
    assert_eq!(first.config.eos_token_ids, vec![7]);
    assert_eq!(first.index.layers.len(), 2);
    assert_eq!(first.index.layers[0].qkv.rows, (3 + 2) * 32);
    assert_eq!(first.index.layers[0].gate_up.rows, 160);
    assert_eq!(first.index.embed.padded_cols(), 128);
    assert!(first.index.lm_head.is_none());
    assert_model_matches(&first, &tensors);
    assert_aligned(&first);

    let (second, r2) = load(&ckpt, &policy);
    assert!(!r2.converted);
    assert_eq!(r2.convert_ms, 0.0);
    assert_eq!(r2.cache_path.as_deref(), Some(path.as_path()));
    assert!(matches!(second.blob, Blob::Mapped(_)));
    assert_eq!(second.blob_start % 4096, 0);
    assert_eq!(second.index, first.index);
    assert_eq!(second.config, first.config);
    assert_eq!(blob_bytes(&second), blob_bytes(&first));
    assert_model_matches(&second, &tensors);
    assert_aligned(&second);
    // The file is preamble + header + padding + blob + 16-byte footer.
    let file_len = std::fs::metadata(&path).unwrap().len() as usize;
    assert_eq!(file_len, second.blob_start + blob_bytes(&second).len() + 16);
    assert_eq!(dir_entries(&cache_dir), vec![name]);
}

#[test]
fn disabled_cache_always_converts() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let (a, r1) = load(tmp.path(), &CachePolicy::Disabled);
    let (b, r2) = load(tmp.path(), &CachePolicy::Disabled);
    assert!(r1.converted && r2.converted);
    assert_eq!(r1.cache_path, None);
    assert_eq!(blob_bytes(&a), blob_bytes(&b));
}

#[test]
fn f16_and_f32_inputs_convert_like_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 2);
    let mut blobs = Vec::new();
    for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
        let dir = tmp.path().join(format!("{dtype:?}"));
        write_checkpoint(&dir, &cfg, &tensors, dtype);
        let (m, r) = load(&dir, &CachePolicy::Disabled);
        assert!(r.converted);
        assert_model_matches(&m, &tensors);
        blobs.push(blob_bytes(&m).to_vec());
    }
    assert_eq!(blobs[0], blobs[1], "f16 differs from bf16");
    assert_eq!(blobs[0], blobs[2], "f32 differs from bf16");
}

#[test]
fn mixed_dtypes_in_one_file() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 3);
    let dtypes = [Dtype::BF16, Dtype::F16, Dtype::F32];
    let mixed: Vec<(Tensor, Dtype)> =
        tensors.iter().enumerate().map(|(i, t)| (t.clone(), dtypes[i % 3])).collect();
    write_config(tmp.path(), &cfg);
    write_safetensors(&tmp.path().join("model.safetensors"), &mixed);
    let (m, _) = load(tmp.path(), &CachePolicy::Disabled);
    assert_model_matches(&m, &tensors);
}

#[test]
fn sharded_checkpoint_with_index() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 4);
    let single = tmp.path().join("single");
    write_checkpoint(&single, &cfg, &tensors, Dtype::BF16);

    let sharded = tmp.path().join("sharded");
    write_config(&sharded, &cfg);
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    let mut weight_map = serde_json::Map::new();
    for (part, name) in [a, b].iter().zip(names) {
        let with: Vec<(Tensor, Dtype)> = part.iter().map(|t| (t.clone(), Dtype::BF16)).collect();
        write_safetensors(&sharded.join(name), &with);
        for t in *part {
            weight_map.insert(t.name.clone(), json!(name));
        }
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let ck = Checkpoint::open(&sharded).unwrap();
    assert_eq!(ck.file_names(), names.to_vec());
    let (m_sharded, _) = load(&sharded, &CachePolicy::Disabled);
    let (m_single, _) = load(&single, &CachePolicy::Disabled);
    assert_eq!(blob_bytes(&m_sharded), blob_bytes(&m_single));
    assert_model_matches(&m_sharded, &tensors);

    // A shard the index names but that is gone: checkpoint_not_found.
    std::fs::remove_file(sharded.join(names[1])).unwrap();
    match load_err(&sharded, &CachePolicy::Disabled) {
        Error::CheckpointNotFound { path, .. } => assert_eq!(path, sharded.join(names[1])),
        e => panic!("expected checkpoint_not_found, got {} ({e})", code(&e)),
    }

    // An index that places a tensor in the wrong shard: checkpoint_invalid.
    let both: Vec<(Tensor, Dtype)> = b.iter().map(|t| (t.clone(), Dtype::BF16)).collect();
    write_safetensors(&sharded.join(names[1]), &both);
    let mut bad_map = weight_map.clone();
    bad_map.insert(b[0].name.clone(), json!(names[0]));
    std::fs::write(sharded.join("model.safetensors.index.json"), json!({"weight_map": bad_map}).to_string())
        .unwrap();
    let e = load_err(&sharded, &CachePolicy::Disabled);
    assert_eq!(code(&e), "checkpoint_invalid");
    assert!(e.to_string().contains(&b[0].name), "{e}");

    // An index entry pointing outside the directory.
    let mut escape = weight_map;
    escape.insert(b[0].name.clone(), json!("../model.safetensors"));
    std::fs::write(sharded.join("model.safetensors.index.json"), json!({"weight_map": escape}).to_string())
        .unwrap();
    let e = load_err(&sharded, &CachePolicy::Disabled);
    assert_eq!(code(&e), "checkpoint_invalid");
    assert!(e.to_string().contains("not a plain file name"), "{e}");
}

#[test]
fn untied_lm_head_is_required_and_converted() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config();
    cfg["tie_word_embeddings"] = json!(false);
    let tensors = make_tensors(&cfg, 5);
    assert!(tensors.iter().any(|t| t.name == "lm_head.weight"));

    let with_head = tmp.path().join("with");
    write_checkpoint(&with_head, &cfg, &tensors, Dtype::BF16);
    let (m, _) = load(&with_head, &CachePolicy::Disabled);
    let head = m.index.lm_head.expect("an untied head");
    assert_eq!((head.rows, head.cols), (50, 96));
    assert_ne!(head.data, m.index.embed.data);
    assert_eq!(m.lm_head(), &head);
    assert_model_matches(&m, &tensors);

    let without = tmp.path().join("without");
    let no_head: Vec<Tensor> = tensors.into_iter().filter(|t| t.name != "lm_head.weight").collect();
    write_checkpoint(&without, &cfg, &no_head, Dtype::BF16);
    match load_err(&without, &CachePolicy::Disabled) {
        Error::CheckpointInvalid { reason, .. } => {
            assert!(reason.contains("1 missing tensor(s): lm_head.weight"), "{reason}")
        }
        e => panic!("expected checkpoint_invalid, got {} ({e})", code(&e)),
    }
}

#[test]
fn tied_with_stored_lm_head_ignores_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 6);
    write_config(tmp.path(), &cfg);
    let mut with: Vec<(Tensor, Dtype)> = tensors.iter().map(|t| (t.clone(), Dtype::BF16)).collect();
    // Wrong shape and an unreadable dtype: neither matters, it is ignored.
    with.push((
        Tensor { name: "lm_head.weight".into(), shape: vec![3, 4], values: vec![1.0; 12] },
        Dtype::I32,
    ));
    write_safetensors(&tmp.path().join("model.safetensors"), &with);
    let (m, _) = load(tmp.path(), &CachePolicy::Disabled);
    assert!(m.index.lm_head.is_none());
    assert_eq!(m.lm_head(), &m.index.embed);
    assert_model_matches(&m, &tensors);
}

// ---------------------------------------------------------------- the cache

/// Loads once to create the cache, damages the file with `damage`, and
/// checks that the next load rebuilds it (converted, same bytes) and that
/// the one after hits the rebuilt file.
fn assert_rebuilt_after(damage: impl FnOnce(&Path)) {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (first, r1) = load(&ckpt, &policy);
    let path = cache_file(&r1);
    let good = std::fs::read(&path).unwrap();
    damage(&path);
    assert_ne!(std::fs::read(&path).unwrap(), good, "the damage changed nothing");

    let (rebuilt, r2) = load(&ckpt, &policy);
    assert!(r2.converted, "a damaged cache file was used");
    assert_eq!(r2.cache_path.as_deref(), Some(path.as_path()));
    assert_eq!(blob_bytes(&rebuilt), blob_bytes(&first));
    assert_eq!(std::fs::read(&path).unwrap(), good, "the cache file was not rewritten");
    let (_, r3) = load(&ckpt, &policy);
    assert!(!r3.converted);
    assert_eq!(dir_entries(&cache_dir).len(), 1);
}

fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn truncated_cache_is_rebuilt() {
    assert_rebuilt_after(|p| rewrite(p, |b| b.truncate(b.len() - 1)));
    assert_rebuilt_after(|p| rewrite(p, |b| b.truncate(b.len() / 2)));
    assert_rebuilt_after(|p| rewrite(p, |b| b.truncate(10)));
    assert_rebuilt_after(|p| rewrite(p, |b| b.clear()));
}

#[test]
fn flipped_byte_in_cache_is_rebuilt() {
    // In the blob (caught by the checksum).
    assert_rebuilt_after(|p| rewrite(p, |b| b[8192 + 3] ^= 0x10));
    // In the JSON header (checksum too).
    assert_rebuilt_after(|p| rewrite(p, |b| b[120] ^= 0x01));
    // In the key, and in the magic.
    assert_rebuilt_after(|p| rewrite(p, |b| b[50] ^= 0x01));
    assert_rebuilt_after(|p| rewrite(p, |b| b[0] ^= 0x01));
    // In the footer's end magic.
    assert_rebuilt_after(|p| {
        rewrite(p, |b| {
            let n = b.len();
            b[n - 2] ^= 0x01
        })
    });
}

#[test]
fn stale_version_is_rebuilt() {
    assert_rebuilt_after(|p| {
        rewrite(p, |b| b[8..12].copy_from_slice(&(CACHE_FORMAT_VERSION + 1).to_le_bytes()))
    });
    assert_rebuilt_after(|p| rewrite(p, |b| b[8..12].copy_from_slice(&0u32.to_le_bytes())));
}

/// Two checkpoints `a` and `b` under `root` with the same config, shapes
/// and dtypes but different values (as two fine-tunes of one base model),
/// and a cache directory for both: (cache dir, its policy, a, b).
fn two_checkpoints(root: &Path) -> (PathBuf, CachePolicy, PathBuf, PathBuf) {
    let cache_dir = root.join("cache");
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (a, b) = (root.join("a"), root.join("b"));
    tiny_checkpoint(&a);
    let cfg = tiny_config();
    write_checkpoint(&b, &cfg, &make_tensors(&cfg, 99), Dtype::BF16);
    (cache_dir, policy, a, b)
}

#[test]
fn cache_of_another_checkpoint_is_not_used() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, policy, a, b) = two_checkpoints(tmp.path());
    assert_eq!(
        std::fs::metadata(a.join("model.safetensors")).unwrap().len(),
        std::fs::metadata(b.join("model.safetensors")).unwrap().len()
    );
    // Same config, shapes and dtypes, different values (as two fine-tunes
    // of one base model): the key differs.
    let (ma, ra) = load(&a, &policy);
    let (mb, rb) = load(&b, &policy);
    assert!(ra.converted && rb.converted);
    assert_ne!(ra.cache_path, rb.cache_path);
    assert_ne!(blob_bytes(&ma), blob_bytes(&mb));
    // Overwrite b's cache file with a's (valid file, wrong key): rebuilt.
    std::fs::copy(cache_file(&ra), cache_file(&rb)).unwrap();
    let (mb2, rb2) = load(&b, &policy);
    assert!(rb2.converted);
    assert_eq!(blob_bytes(&mb2), blob_bytes(&mb));
    // generation_config.json is part of the key.
    change_key(&a);
    let (ma2, ra2) = load(&a, &policy);
    assert!(ra2.converted);
    assert_ne!(ra2.cache_path, ra.cache_path);
    assert_eq!(ma2.config.eos_token_ids, vec![7, 9]);
}

/// A changed checkpoint's new cache file replaces its old one; another
/// checkpoint's cache in the same directory stays.
#[test]
fn changed_checkpoint_replaces_its_stale_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache_dir, policy, a, b) = two_checkpoints(tmp.path());
    let (_, ra) = load(&a, &policy);
    let (_, rb) = load(&b, &policy);
    assert_holds(&cache_dir, vec![cache_name(&ra), cache_name(&rb)]);
    // a changes: its next load converts under a new key and deletes the old
    // file, not b's.
    change_key(&a);
    let (_, ra2) = load(&a, &policy);
    assert!(ra2.converted);
    assert_holds(&cache_dir, vec![cache_name(&ra2), cache_name(&rb)]);
    // The same checkpoint through another spelling of its path is the same
    // source: loading it again finds its cache.
    let (_, ra3) = load(&tmp.path().join("b/../a"), &policy);
    assert!(!ra3.converted);
}

/// The cache file of a checkpoint directory that no longer exists (deleted,
/// or moved: it converts again at its new path) is deleted when another
/// checkpoint's file is written; files of checkpoints that exist stay.
#[test]
fn cache_of_a_deleted_checkpoint_is_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache_dir, policy, a, b) = two_checkpoints(tmp.path());
    let (_, ra) = load(&a, &policy);
    let (_, rb) = load(&b, &policy);
    assert_ne!(cache_name(&ra), cache_name(&rb));
    // a moves: its file stays until the next cache write.
    let moved = tmp.path().join("a-moved");
    std::fs::rename(&a, &moved).unwrap();
    assert_holds(&cache_dir, vec![cache_name(&ra), cache_name(&rb)]);
    // b changes and converts again: a's orphan goes with b's old file.
    change_key(&b);
    let (_, rb2) = load(&b, &policy);
    assert!(rb2.converted);
    assert_holds(&cache_dir, vec![cache_name(&rb2)]);
    // At its new path a converts again and b's file stays.
    let (_, ra2) = load(&moved, &policy);
    assert!(ra2.converted);
    assert_holds(&cache_dir, vec![cache_name(&ra2), cache_name(&rb2)]);
}

/// Temporary files a killed writer left behind (untouched for
/// ABANDONED_TEMP_AGE) are deleted when a cache file is written; a fresh
/// one of a running writer and files that are not ours stay.
#[test]
fn abandoned_temp_files_are_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    std::fs::create_dir_all(&cache_dir).unwrap();
    let key = "0123456789abcdef".repeat(4);
    let old = std::time::SystemTime::now() - 2 * ABANDONED_TEMP_AGE;
    let files = [
        (format!(".{key}.4242.0.17.tmp"), true, false), // abandoned
        // Being written: fresh, and its writer (this process) runs.
        (format!(".{key}.{}.1.18.tmp", std::process::id()), false, true),
        ("notes.tmp".to_string(), true, true),
        (format!(".{key}.x.0.17.tmp"), true, true),
        ("user-file.q3w".to_string(), true, true), // not a cache file of ours
    ];
    for (name, is_old, _) in &files {
        let path = cache_dir.join(name);
        std::fs::write(&path, b"partial").unwrap();
        if *is_old {
            std::fs::File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        }
    }
    let (_, r) = load(&ckpt, &CachePolicy::Dir(cache_dir.clone()));
    assert!(r.converted);
    let mut want: Vec<String> = files.iter().filter(|f| f.2).map(|f| f.0.clone()).collect();
    want.push(cache_name(&r));
    assert_holds(&cache_dir, want);
}

#[test]
fn unwritable_explicit_cache_dir_is_cache_io() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    tiny_checkpoint(&ckpt);
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let e = load_err(&ckpt, &CachePolicy::Dir(file.join("cache")));
    assert_eq!(code(&e), "cache_io");
    match e {
        Error::CacheIo { path, .. } => assert_eq!(path, file.join("cache")),
        e => panic!("{e}"),
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory");
}

#[test]
fn failed_cache_write_leaves_no_temp_files() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (_, r) = load(&ckpt, &policy);
    let path = cache_file(&r);
    // Put a non-empty directory where the cache file goes: it is neither a
    // valid cache nor removable, and renaming onto it fails.
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir_all(path.join("occupied")).unwrap();
    let e = load_err(&ckpt, &policy);
    assert_eq!(code(&e), "cache_io");
    assert!(e.to_string().contains("rename"), "{e}");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(dir_entries(&cache_dir), vec![name], "a temp file was left behind");
}

/// `CachePolicy::Default` writes under the platform cache directory, and a
/// failure to write there is only logged. Both halves live in one test
/// because they steer `dirs::cache_dir()` through XDG_CACHE_HOME, which is
/// process-wide; no other test uses the default policy.
#[cfg(target_os = "linux")]
#[test]
fn default_cache_policy_writes_and_tolerates_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    tiny_checkpoint(&ckpt);
    let xdg = tmp.path().join("xdg");
    std::env::set_var("XDG_CACHE_HOME", &xdg);
    let (_, r1) = load(&ckpt, &CachePolicy::Default);
    let (_, r2) = load(&ckpt, &CachePolicy::Default);
    assert!(r1.converted && !r2.converted);
    assert_eq!(cache_file(&r1).parent(), Some(xdg.join("qwen3-wgpu").as_path()));

    // A cache "directory" under a regular file: still loads, uncached.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    std::env::set_var("XDG_CACHE_HOME", file.join("sub"));
    let (m, r3) = load(&ckpt, &CachePolicy::Default);
    std::env::remove_var("XDG_CACHE_HOME");
    assert!(r3.converted);
    assert_eq!(r3.cache_path, None);
    assert_eq!(m.index.layers.len(), 2);
}

// ---------------------------------------------------------------- failures

#[test]
fn unsupported_dtypes_are_named() {
    for dtype in [Dtype::I32, Dtype::I8] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = tiny_config();
        let tensors = make_tensors(&cfg, 7);
        write_config(tmp.path(), &cfg);
        let bad = "model.layers.1.mlp.up_proj.weight";
        let with: Vec<(Tensor, Dtype)> =
            tensors.iter().map(|t| (t.clone(), if t.name == bad { dtype } else { Dtype::BF16 })).collect();
        write_safetensors(&tmp.path().join("model.safetensors"), &with);
        let cache = tmp.path().join("cache");
        match load_err(tmp.path(), &CachePolicy::Dir(cache.clone())) {
            Error::UnsupportedDtype { tensor, dtype: found } => {
                assert_eq!(tensor, bad);
                assert_eq!(found, format!("{dtype:?}"));
            }
            e => panic!("expected unsupported_dtype, got {} ({e})", code(&e)),
        }
        assert!(!cache.exists(), "the cache was touched before validation");
    }
}

#[test]
fn non_finite_weights_are_checkpoint_invalid() {
    for bad in [f32::NAN, f32::INFINITY] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = tiny_config();
        let mut tensors = make_tensors(&cfg, 10);
        let name = "model.layers.0.mlp.down_proj.weight";
        let t = tensors.iter_mut().find(|t| t.name == name).unwrap();
        t.values[3 * 80 + 70] = bad; // row 3, second group
        write_checkpoint(tmp.path(), &cfg, &tensors, Dtype::F32);
        match load_err(tmp.path(), &CachePolicy::Disabled) {
            Error::CheckpointInvalid { path, reason } => {
                assert_eq!(path, tmp.path());
                assert_eq!(reason, format!("{name} row 3 holds NaN or infinite values; cannot quantize"));
            }
            e => panic!("{} ({e})", code(&e)),
        }
    }
}

#[test]
fn missing_directory_and_files() {
    let tmp = tempfile::tempdir().unwrap();
    let gone = tmp.path().join("nope");
    match load_err(&gone, &CachePolicy::Disabled) {
        Error::CheckpointNotFound { path, .. } => assert_eq!(path, gone),
        e => panic!("{} ({e})", code(&e)),
    }
    // A directory without config.json.
    match load_err(tmp.path(), &CachePolicy::Disabled) {
        Error::CheckpointNotFound { path, .. } => assert_eq!(path, tmp.path().join("config.json")),
        e => panic!("{} ({e})", code(&e)),
    }
    // config.json but no weights.
    write_config(tmp.path(), &tiny_config());
    match load_err(tmp.path(), &CachePolicy::Disabled) {
        Error::CheckpointNotFound { reason, .. } => {
            assert!(reason.contains("no weights"), "{reason}")
        }
        e => panic!("{} ({e})", code(&e)),
    }
}

#[test]
fn malformed_config_is_checkpoint_invalid() {
    let cases: [(&str, &str); 6] = [
        ("{ not json", "malformed JSON"),
        ("[1, 2]", "not an object"),
        (r#"{"model_type": "llama", "hidden_size": 8}"#, "model_type is \"llama\""),
        (r#"{"hidden_size": 8}"#, "missing required field model_type"),
        (
            r#"{"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10}"#,
            "missing required field intermediate_size",
        ),
        (
            r#"{"model_type": "qwen3", "hidden_size": -64, "num_attention_heads": 2}"#,
            "hidden_size must be a non-negative integer",
        ),
    ];
    for (text, want) in cases {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("config.json"), text).unwrap();
        match load_err(tmp.path(), &CachePolicy::Disabled) {
            Error::CheckpointInvalid { path, reason } => {
                assert_eq!(path, tmp.path().join("config.json"));
                assert!(reason.contains(want), "{text}: {reason}");
            }
            e => panic!("{text}: expected checkpoint_invalid, got {} ({e})", code(&e)),
        }
    }
    // A malformed generation_config.json is named too.
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    std::fs::write(tmp.path().join("generation_config.json"), "{").unwrap();
    match load_err(tmp.path(), &CachePolicy::Disabled) {
        Error::CheckpointInvalid { path, .. } => {
            assert_eq!(path, tmp.path().join("generation_config.json"))
        }
        e => panic!("{} ({e})", code(&e)),
    }
}

#[test]
fn garbage_safetensors_is_checkpoint_invalid() {
    let garbage: [&[u8]; 4] =
        [b"", b"garbage!", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}       ", &[0xff; 64]];
    for bytes in garbage {
        let tmp = tempfile::tempdir().unwrap();
        write_config(tmp.path(), &tiny_config());
        std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
        match load_err(tmp.path(), &CachePolicy::Disabled) {
            Error::CheckpointInvalid { path, reason } => {
                assert_eq!(path, tmp.path().join("model.safetensors"));
                assert!(reason.starts_with("malformed safetensors"), "{reason}");
            }
            e => panic!("{bytes:?}: expected checkpoint_invalid, got {} ({e})", code(&e)),
        }
    }
    // A valid file truncated by one byte.
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    rewrite(&tmp.path().join("model.safetensors"), |b| b.truncate(b.len() - 1));
    assert_eq!(code(&load_err(tmp.path(), &CachePolicy::Disabled)), "checkpoint_invalid");
}

#[test]
fn missing_tensors_are_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let tensors: Vec<Tensor> = make_tensors(&cfg, 8)
        .into_iter()
        .filter(|t| !t.name.contains("layers.1.") && t.name != "model.norm.weight")
        .collect();
    write_checkpoint(tmp.path(), &cfg, &tensors, Dtype::BF16);
    match load_err(tmp.path(), &CachePolicy::Disabled) {
        Error::CheckpointInvalid { reason, .. } => {
            assert!(
                reason.starts_with("12 missing tensor(s): model.layers.1.input_layernorm.weight"),
                "{reason}"
            );
            assert!(reason.ends_with("model.norm.weight"), "{reason}");
        }
        e => panic!("{} ({e})", code(&e)),
    }
}

#[test]
fn wrong_shapes_name_every_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let mut tensors = make_tensors(&cfg, 9);
    for t in &mut tensors {
        match t.name.as_str() {
            "model.layers.0.self_attn.k_proj.weight" => {
                t.shape = vec![64, 96];
                t.values = vec![0.5; 64 * 96];
            }
            "model.layers.1.self_attn.q_norm.weight" => {
                t.shape = vec![16];
                t.values = vec![1.0; 16];
            }
            "model.embed_tokens.weight" => t.shape = vec![96, 50],
            _ => {}
        }
    }
    write_checkpoint(tmp.path(), &cfg, &tensors, Dtype::BF16);
    match load_err(tmp.path(), &CachePolicy::Disabled) {
        Error::UnsupportedArchitecture { profile, mismatches } => {
            assert_eq!(profile, "config.json");
            let want = vec![
                Mismatch {
                    field: "model.embed_tokens.weight".into(),
                    expected: "[50, 96]".into(),
                    found: "[96, 50]".into(),
                },
                Mismatch {
                    field: "model.layers.0.self_attn.k_proj.weight".into(),
                    expected: "[32, 96]".into(),
                    found: "[64, 96]".into(),
                },
                Mismatch {
                    field: "model.layers.1.self_attn.q_norm.weight".into(),
                    expected: "[32]".into(),
                    found: "[16]".into(),
                },
            ];
            assert_eq!(mismatches, want);
        }
        e => panic!("{} ({e})", code(&e)),
    }
}

#[test]
fn exact_profile_lists_every_mismatched_field() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let cache = tmp.path().join("cache");
    match load_model(tmp.path(), ShapeProfile::Qwen3_0_6B, &CachePolicy::Dir(cache.clone())) {
        Err(Error::UnsupportedArchitecture { profile, mismatches }) => {
            assert_eq!(profile, "qwen3-0.6b");
            let fields: Vec<(&str, &str, &str)> = mismatches
                .iter()
                .map(|m| (m.field.as_str(), m.expected.as_str(), m.found.as_str()))
                .collect();
            assert_eq!(
                fields,
                vec![
                    ("hidden_size", "1024", "96"),
                    ("num_hidden_layers", "28", "2"),
                    ("num_attention_heads", "16", "3"),
                    ("num_key_value_heads", "8", "1"),
                    ("head_dim", "128", "32"),
                    ("intermediate_size", "3072", "80"),
                    ("vocab_size", "151936", "50"),
                ]
            );
        }
        Err(e) => panic!("{} ({e})", code(&e)),
        Ok(_) => panic!("a tiny config passed the 0.6B profile"),
    }
    assert!(!cache.exists());
}

#[test]
fn engine_rejects_unrunnable_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config();
    cfg["num_key_value_heads"] = json!(2); // 3 heads over 2 kv heads
    cfg["head_dim"] = json!(31);
    cfg["intermediate_size"] = json!(0);
    write_config(tmp.path(), &cfg);
    match load_config(tmp.path()) {
        Err(Error::UnsupportedArchitecture { profile, mismatches }) => {
            assert_eq!(profile, "qwen3");
            let fields: Vec<&str> = mismatches.iter().map(|m| m.field.as_str()).collect();
            assert_eq!(fields, vec!["intermediate_size", "num_attention_heads", "head_dim"]);
            assert_eq!(mismatches[1].found, "3");
            assert_eq!(mismatches[2].expected, "a multiple of 8");
        }
        Err(e) => panic!("{} ({e})", code(&e)),
        Ok(_) => panic!("accepted an unrunnable config"),
    }
}

#[test]
fn config_defaults_and_eos_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "eos_token_id": [5, 3, 5]
    });
    write_config(tmp.path(), &cfg);
    std::fs::write(tmp.path().join("generation_config.json"), r#"{"eos_token_id": [3, 9], "top_k": 20}"#)
        .unwrap();
    let c = load_config(tmp.path()).unwrap();
    assert_eq!(c.head_dim, 32);
    assert_eq!(c.max_position_embeddings, 40960);
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.eos_token_ids, vec![5, 3, 9]);
    check_profile(&c, ShapeProfile::AnyQwen3).unwrap();

    std::fs::write(tmp.path().join("generation_config.json"), r#"{"eos_token_id": 11}"#).unwrap();
    assert_eq!(load_config(tmp.path()).unwrap().eos_token_ids, vec![5, 3, 11]);
}

#[test]
fn qwen3_0_6b_profile_counts_each_difference() {
    let mut c = ModelConfig {
        hidden_size: 1024,
        intermediate_size: 3072,
        num_hidden_layers: 28,
        num_attention_heads: 16,
        num_key_value_heads: 8,
        head_dim: 128,
        vocab_size: 151936,
        max_position_embeddings: 40960,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: true,
        eos_token_ids: vec![151645],
    };
    check_profile(&c, ShapeProfile::Qwen3_0_6B).unwrap();
    c.num_hidden_layers = 24;
    c.vocab_size = 151669;
    c.tie_word_embeddings = false;
    match check_profile(&c, ShapeProfile::Qwen3_0_6B) {
        Err(Error::UnsupportedArchitecture { profile, mismatches }) => {
            assert_eq!(profile, "qwen3-0.6b");
            assert_eq!(mismatches.len(), 3);
            assert_eq!(mismatches[0].to_string(), "num_hidden_layers: expected 28, found 24");
            assert_eq!(mismatches[1].to_string(), "vocab_size: expected 151936, found 151669");
            assert_eq!(mismatches[2].to_string(), "tie_word_embeddings: expected true, found false");
        }
        other => panic!("{:?}", other.err().map(|e| e.to_string())),
    }
}

// ---------------------------------------------------------------- MLX fixtures

fn fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}

fn bf16_bits(f: f32) -> u16 {
    (f.to_bits() >> 16) as u16
}

/// Every fixture converts losslessly: each dequantized weight equals the
/// stored bf16 value bit for bit, and each norm is carried over exactly.
#[test]
fn mlx_fixtures_convert_losslessly() {
    let dirs = fixture_dirs();
    assert_eq!(dirs.len(), 8);
    for dir in dirs {
        let cfg = load_config(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let model = convert(&ckpt, &cfg).unwrap();
        let idx = &model.index;
        // (matrix, (first row, row stride), tensor)
        let mut mats: Vec<(&QuantMatrix, (usize, usize), String)> =
            vec![(&idx.embed, (0, 1), "model.embed_tokens.weight".to_string())];
        let mut norms = vec![(idx.final_norm, "model.norm.weight".to_string())];
        for (i, l) in idx.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            mats.extend([
                (&l.qkv, (0, 1), format!("{p}.self_attn.q_proj.weight")),
                (&l.qkv, (cfg.q_dim(), 1), format!("{p}.self_attn.k_proj.weight")),
                (&l.qkv, (cfg.q_dim() + cfg.kv_dim(), 1), format!("{p}.self_attn.v_proj.weight")),
                (&l.o_proj, (0, 1), format!("{p}.self_attn.o_proj.weight")),
                (&l.gate_up, (0, 2), format!("{p}.mlp.gate_proj.weight")),
                (&l.gate_up, (1, 2), format!("{p}.mlp.up_proj.weight")),
                (&l.down, (0, 1), format!("{p}.mlp.down_proj.weight")),
            ]);
            norms.extend([
                (l.input_norm, format!("{p}.input_layernorm.weight")),
                (l.q_norm, format!("{p}.self_attn.q_norm.weight")),
                (l.k_norm, format!("{p}.self_attn.k_norm.weight")),
                (l.post_norm, format!("{p}.post_attention_layernorm.weight")),
            ]);
        }
        if let Some(h) = &idx.lm_head {
            mats.push((h, (0, 1), "lm_head.weight".to_string()));
        }
        let mut checked = 0usize;
        for (m, (first_row, stride), name) in mats {
            let t = ckpt.require(&name).unwrap();
            assert_eq!(t.dtype, Dtype::BF16, "{name}");
            let mut row = vec![0f32; t.row_len()];
            for r in 0..t.rows() {
                t.row_f32(r, &mut row).unwrap();
                for (c, &w) in row.iter().enumerate() {
                    let d = dequantize(&model, m, first_row + r * stride, c).unwrap();
                    // int8 has no negative zero: a stored -0.0 comes back
                    // as +0.0, equal as a number. Everything else must be
                    // the same bits.
                    let same = if w == 0.0 { d == 0.0 } else { bf16_bits(d) == bf16_bits(w) };
                    assert!(same, "{}: {name}[{r},{c}]: {w} vs {d}", dir.display());
                    assert_eq!(d.to_bits() & 0xffff, 0, "{}: {name}[{r},{c}] not bf16", dir.display());
                    checked += 1;
                }
            }
        }
        for (range, name) in norms {
            let want = ckpt.require(&name).unwrap().to_f32_vec().unwrap();
            assert_eq!(model.f32s(range), &want[..], "{}: {name}", dir.display());
        }
        let params: usize = expected_tensors(&cfg)
            .iter()
            .filter(|(_, s)| s.len() == 2)
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(checked, params, "{}", dir.display());
        if dir.ends_with("tied_with_stored_head") {
            assert!(ckpt.tensor("lm_head.weight").is_some());
            assert!(idx.lm_head.is_none());
        }
        if dir.ends_with("untied_head") {
            assert!(idx.lm_head.is_some());
        }
    }
}
