//! Checkpoint reading and validation: each bad weights file, tensor and
//! dtype named with its code.

use crate::tiny_checkpoint::*;
use qwen3_wgpu::internals::cache::CachePolicy;
use qwen3_wgpu::{Error, Mismatch};
use safetensors::Dtype;

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
