//! Small Qwen3 checkpoints built on the fly, and what the checkpoint,
//! config, conversion and cache tests check them with (each test file uses
//! some of these).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::cache::CachePolicy;
use qwen3_wgpu::internals::checkpoint::expected_tensors;
use qwen3_wgpu::internals::config::{ModelConfig, ShapeProfile};
use qwen3_wgpu::internals::convert::dequantize;
use qwen3_wgpu::internals::converted::{ConvertedModel, QuantMatrix, BLOB_ALIGN, QUANT_GROUP};
use qwen3_wgpu::internals::load::{load_model, LoadReport};
use qwen3_wgpu::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

/// A small Qwen3 config: hidden 96 (two groups, the second padded), 3 heads
/// over 1 kv head of 32 dims, intermediate 80, 2 layers, vocab 50.
pub fn tiny_config() -> Value {
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

pub fn cfg_of(v: &Value) -> ModelConfig {
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
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// Values exactly representable in bf16, f16 and f32 (k / 64 with
/// |k| <= 127), so any input dtype yields the same conversion. Norms are
/// 1 + k/128. About one element in 16 is zero and row 0 of each matrix has
/// an all-zero first group, to exercise zero scales.
pub fn make_tensors(cfg: &Value, seed: u64) -> Vec<Tensor> {
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

pub fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
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
pub fn write_safetensors(path: &Path, tensors: &[(Tensor, Dtype)]) {
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(t, d)| (t.name.clone(), *d, t.shape.clone(), encode(&t.values, *d))).collect();
    let views: Vec<(String, TensorView<'_>)> =
        encoded.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

pub fn write_config(dir: &Path, cfg: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(cfg).unwrap()).unwrap();
}

/// A complete single-file checkpoint in `dir`, every tensor as `dtype`.
pub fn write_checkpoint(dir: &Path, cfg: &Value, tensors: &[Tensor], dtype: Dtype) {
    write_config(dir, cfg);
    let with_dtype: Vec<(Tensor, Dtype)> = tensors.iter().map(|t| (t.clone(), dtype)).collect();
    write_safetensors(&dir.join("model.safetensors"), &with_dtype);
}

pub fn tiny_checkpoint(dir: &Path) -> Vec<Tensor> {
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 1);
    write_checkpoint(dir, &cfg, &tensors, Dtype::BF16);
    tensors
}

pub fn blob_bytes(m: &ConvertedModel) -> &[u8] {
    qwen3_wgpu::internals::convert::blob_bytes(m).expect("storage shorter than the layout")
}

pub fn load(dir: &Path, cache: &CachePolicy) -> (ConvertedModel, LoadReport) {
    match load_model(dir, ShapeProfile::AnyQwen3, cache) {
        Ok(r) => r,
        Err(e) => panic!("load_model failed: {} ({e})", e.code()),
    }
}

pub fn load_err(dir: &Path, cache: &CachePolicy) -> Error {
    match load_model(dir, ShapeProfile::AnyQwen3, cache) {
        Ok(_) => panic!("load_model succeeded where it should fail"),
        Err(e) => e,
    }
}

/// Files in `dir` (names), sorted.
pub fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The reference quantization of one row: (q, scales), straight from the
/// spec with `f32::round` (half away from zero).
pub fn reference_row(row: &[f32]) -> (Vec<i8>, Vec<f32>) {
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
pub fn assert_matrix_rows(
    model: &ConvertedModel,
    m: &QuantMatrix,
    (first_row, stride): (usize, usize),
    t: &Tensor,
) {
    let cols = t.shape[1];
    assert_eq!(m.cols, cols, "{}", t.name);
    let data = model.bytes(m.data);
    let scales = model.scales(m);
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

pub fn by_name(tensors: &[Tensor]) -> HashMap<&str, &Tensor> {
    tensors.iter().map(|t| (t.name.as_str(), t)).collect()
}

/// Checks every array of `model` against the source tensors.
pub fn assert_model_matches(model: &ConvertedModel, tensors: &[Tensor]) {
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
pub fn assert_aligned(model: &ConvertedModel) {
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

pub fn cache_file(report: &LoadReport) -> PathBuf {
    report.cache_path.clone().expect("a cache path")
}

/// The file name of a load's cache file.
pub fn cache_name(report: &LoadReport) -> String {
    cache_file(report).file_name().unwrap().to_string_lossy().into_owned()
}

/// Asserts that `dir` holds exactly the files `names`, in any order.
pub fn assert_holds(dir: &Path, mut names: Vec<String>) {
    names.sort();
    assert_eq!(dir_entries(dir), names);
}

/// Changes a checkpoint's cache key: its generation_config.json (part of
/// the key) names end-of-text ids 7 and 9.
pub fn change_key(ckpt: &Path) {
    std::fs::write(ckpt.join("generation_config.json"), r#"{"eos_token_id": [7, 9]}"#).unwrap();
}

pub fn code(e: &Error) -> &'static str {
    e.code()
}

pub fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}
