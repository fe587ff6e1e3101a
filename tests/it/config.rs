//! config.json and the shape profiles: defaults, end-of-text ids, and
//! every mismatched or unrunnable field listed.

use crate::tiny_checkpoint::*;
use qwen3_wgpu::internals::cache::CachePolicy;
use qwen3_wgpu::internals::config::{check_profile, load_config, ModelConfig, ShapeProfile};
use qwen3_wgpu::internals::load::load_model;
use qwen3_wgpu::Error;
use serde_json::json;

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

/// The head_dim limits config validation enforces are those the kernels
/// are compiled for.
#[test]
fn head_dim_limits_are_the_kernels() {
    use qwen3_wgpu::internals::{kernels, limits};
    assert_eq!(limits::HEAD_DIM_MULTIPLE, kernels::HEAD_DIM_MULTIPLE);
    assert_eq!(limits::MAX_HEAD_DIM, kernels::MAX_HEAD_DIM);
}
