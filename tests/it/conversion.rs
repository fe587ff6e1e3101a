//! Int8 conversion through the load step: every dtype, sharded and tied
//! or untied checkpoints, and the MLX fixtures bit for bit.

use crate::tiny_checkpoint::*;
use qwen3_wgpu::internals::cache::CachePolicy;
use qwen3_wgpu::internals::checkpoint::{expected_tensors, Checkpoint};
use qwen3_wgpu::internals::config::load_config;
use qwen3_wgpu::internals::convert::{convert, dequantize};
use qwen3_wgpu::internals::converted::{Blob, QuantMatrix};
use qwen3_wgpu::{Error, WeightFormat};
use safetensors::Dtype;
use serde_json::json;
use std::path::{Path, PathBuf};

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
    assert_eq!(dirs.len(), 11);
    for dir in dirs {
        let cfg = load_config(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        // The int4_* fixtures' layers are int4-exact (the embedding int8-exact).
        let int4 = dir.file_name().unwrap().to_string_lossy().starts_with("int4_");
        let format = if int4 { WeightFormat::Int4 } else { WeightFormat::Int8 };
        let model = convert(&ckpt, &cfg, format).unwrap();
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
