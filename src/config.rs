//! `config.json` of a Hugging Face Qwen3 checkpoint, and the shape profiles
//! the engine accepts.

/// The model hyper-parameters the engine uses, read from `config.json`
/// (and `generation_config.json` for the end-of-text ids).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate/up projections.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads per layer.
    pub num_attention_heads: usize,
    /// Key/value heads per layer (query heads share them in groups).
    pub num_key_value_heads: usize,
    /// Dimensions per head (config.json's, else hidden_size / heads).
    pub head_dim: usize,
    /// Rows of the embedding table and the LM head.
    pub vocab_size: usize,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// True when the LM head reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Ids that end generation (config.json's and generation_config.json's
    /// `eos_token_id`, which may be a number or a list).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// The shape of Qwen3-0.6B-Base (the `--exact-shape` profile).
    pub fn qwen3_0_6b_base() -> Self {
        ModelConfig {
            hidden_size: 1024,
            intermediate_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            vocab_size: 151936,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
            eos_token_ids: vec![151643],
        }
    }

    /// Rows of the fused q/k/v projection: `(heads + 2 * kv_heads) * head_dim`.
    pub fn qkv_rows(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }
    /// Width of the attention output (`heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    /// Width of one position's K (or V) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Mismatch, Result};

/// Largest value accepted for any single dimension of config.json. Far above
/// every real Qwen3 (vocab 151936, intermediate 25600) yet small enough that
/// no product of a few dimensions can overflow `usize` on a 64-bit host.
pub const MAX_DIMENSION: usize = 1 << 24;

/// Largest accepted `max_position_embeddings`.
pub const MAX_POSITIONS: usize = 1 << 31;

/// Default `max_position_embeddings` when config.json omits it.
pub const DEFAULT_MAX_POSITIONS: usize = 40960;
/// Default `rope_theta` when config.json omits it.
pub const DEFAULT_ROPE_THETA: f32 = 1.0e6;
/// Default `rms_norm_eps` when config.json omits it.
pub const DEFAULT_RMS_NORM_EPS: f32 = 1.0e-6;

/// Which shapes [`check_profile`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShapeProfile {
    /// Any Qwen3 shape the engine can run (the checks [`load_config`] makes).
    AnyQwen3,
    /// Exactly the shape of Qwen3-0.6B.
    Qwen3_0_6B,
}

impl ShapeProfile {
    /// The profile name used in [`Error::UnsupportedArchitecture`].
    pub fn name(self) -> &'static str {
        match self {
            ShapeProfile::AnyQwen3 => "qwen3",
            ShapeProfile::Qwen3_0_6B => "qwen3-0.6b",
        }
    }
}

/// Reads `dir/config.json` and, when present, `dir/generation_config.json`
/// (whose `eos_token_id`s are appended to the config's, without duplicates).
///
/// Errors: [`Error::CheckpointNotFound`] when the directory or config.json is
/// missing; [`Error::CheckpointInvalid`] for malformed JSON, a missing or
/// mistyped required field, or a `model_type` other than `qwen3`;
/// [`Error::UnsupportedArchitecture`] (profile `qwen3`) listing every shape
/// problem the engine cannot run (zero sizes, heads not a multiple of
/// kv_heads, odd head_dim, ...).
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    if !dir.is_dir() {
        return Err(Error::CheckpointNotFound {
            path: dir.to_path_buf(),
            reason: "checkpoint directory does not exist".into(),
        });
    }
    let config_path = dir.join("config.json");
    let bytes = read_required(&config_path)?;
    let mut cfg = parse_config(&bytes).map_err(|reason| Error::invalid(&config_path, reason))?;

    let gen_path = dir.join("generation_config.json");
    if let Some(gen_bytes) = read_optional(&gen_path)? {
        let gen_ids = parse_generation_eos(&gen_bytes).map_err(|reason| Error::invalid(&gen_path, reason))?;
        for id in gen_ids {
            if !cfg.eos_token_ids.contains(&id) {
                cfg.eos_token_ids.push(id);
            }
        }
    }

    let problems = engine_mismatches(&cfg);
    if !problems.is_empty() {
        return Err(Error::UnsupportedArchitecture {
            profile: ShapeProfile::AnyQwen3.name().into(),
            mismatches: problems,
        });
    }
    Ok(cfg)
}

/// Checks `cfg` against `profile`, listing every mismatched field (with the
/// expected and the found value) in one [`Error::UnsupportedArchitecture`].
pub fn check_profile(cfg: &ModelConfig, profile: ShapeProfile) -> Result<()> {
    let mismatches = match profile {
        ShapeProfile::AnyQwen3 => engine_mismatches(cfg),
        ShapeProfile::Qwen3_0_6B => {
            let want = ModelConfig::qwen3_0_6b_base();
            let expected: [(&str, usize, usize); 7] = [
                ("hidden_size", want.hidden_size, cfg.hidden_size),
                ("num_hidden_layers", want.num_hidden_layers, cfg.num_hidden_layers),
                ("num_attention_heads", want.num_attention_heads, cfg.num_attention_heads),
                ("num_key_value_heads", want.num_key_value_heads, cfg.num_key_value_heads),
                ("head_dim", want.head_dim, cfg.head_dim),
                ("intermediate_size", want.intermediate_size, cfg.intermediate_size),
                ("vocab_size", want.vocab_size, cfg.vocab_size),
            ];
            let mut m: Vec<Mismatch> = expected
                .iter()
                .filter(|(_, want, got)| want != got)
                .map(|(field, want, got)| mismatch(field, want, got))
                .collect();
            if !cfg.tie_word_embeddings {
                m.push(mismatch("tie_word_embeddings", true, false));
            }
            m
        }
    };
    if mismatches.is_empty() {
        Ok(())
    } else {
        Err(Error::UnsupportedArchitecture { profile: profile.name().into(), mismatches })
    }
}

fn mismatch(field: &str, expected: impl std::fmt::Display, found: impl std::fmt::Display) -> Mismatch {
    Mismatch { field: field.into(), expected: expected.to_string(), found: found.to_string() }
}

/// Every reason the engine cannot run `cfg`, whatever the profile.
fn engine_mismatches(cfg: &ModelConfig) -> Vec<Mismatch> {
    let mut m = Vec::new();
    let dims = [
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("num_hidden_layers", cfg.num_hidden_layers),
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("head_dim", cfg.head_dim),
        ("vocab_size", cfg.vocab_size),
    ];
    for (field, value) in dims {
        if value == 0 {
            m.push(mismatch(field, "> 0", value));
        } else if value > MAX_DIMENSION {
            m.push(mismatch(field, format_args!("<= {MAX_DIMENSION}"), value));
        }
    }
    if cfg.max_position_embeddings == 0 {
        m.push(mismatch("max_position_embeddings", "> 0", 0));
    } else if cfg.max_position_embeddings > MAX_POSITIONS {
        m.push(mismatch(
            "max_position_embeddings",
            format_args!("<= {MAX_POSITIONS}"),
            cfg.max_position_embeddings,
        ));
    }
    if cfg.num_key_value_heads != 0 && !cfg.num_attention_heads.is_multiple_of(cfg.num_key_value_heads) {
        m.push(mismatch(
            "num_attention_heads",
            format_args!("a multiple of num_key_value_heads ({})", cfg.num_key_value_heads),
            cfg.num_attention_heads,
        ));
    }
    if !cfg.head_dim.is_multiple_of(crate::kernels::HEAD_DIM_MULTIPLE) {
        // RoPE rotates pairs of dimensions; attention reads K 8 halves at a time.
        let want = format_args!("a multiple of {}", crate::kernels::HEAD_DIM_MULTIPLE);
        m.push(mismatch("head_dim", want, cfg.head_dim));
    } else if cfg.head_dim > crate::kernels::MAX_HEAD_DIM {
        // The attention kernels keep one head in workgroup memory.
        m.push(mismatch("head_dim", format_args!("<= {}", crate::kernels::MAX_HEAD_DIM), cfg.head_dim));
    }
    if !(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0) {
        m.push(mismatch("rope_theta", "a finite number > 0", cfg.rope_theta));
    }
    if !(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0) {
        m.push(mismatch("rms_norm_eps", "a finite number > 0", cfg.rms_norm_eps));
    }
    m
}

fn read_required(path: &Path) -> Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::CheckpointNotFound { path: path.to_path_buf(), reason: "file does not exist".into() })
        }
        Err(e) => Err(Error::invalid(path, format!("cannot read: {e}"))),
    }
}

/// `Ok(None)` when the file does not exist.
pub(crate) fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::invalid(path, format!("cannot read: {e}"))),
    }
}

fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("malformed JSON: the top level is not an object".into()),
        Err(e) => Err(format!("malformed JSON: {e}")),
    }
}

/// Parses config.json's content. Errors are the reason text for
/// [`Error::CheckpointInvalid`].
fn parse_config(bytes: &[u8]) -> Result<ModelConfig, String> {
    let obj = parse_object(bytes)?;
    match obj.get("model_type") {
        Some(Value::String(t)) if t == "qwen3" => {}
        Some(Value::String(t)) => return Err(format!("model_type is \"{t}\", expected \"qwen3\"")),
        Some(other) => return Err(format!("model_type is {other}, expected \"qwen3\"")),
        None => return Err("missing required field model_type".into()),
    }
    let hidden_size = required_usize(&obj, "hidden_size")?;
    let num_attention_heads = required_usize(&obj, "num_attention_heads")?;
    // HF's Qwen3Config defaults kv heads to the attention heads (plain MHA).
    let num_key_value_heads = optional_usize(&obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
    let head_dim = match optional_usize(&obj, "head_dim")? {
        Some(hd) => hd,
        None if num_attention_heads == 0 => 0, // reported as a zero head count later
        None => hidden_size / num_attention_heads,
    };
    let mut eos_token_ids = Vec::new();
    for id in eos_ids(&obj, "eos_token_id")? {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    Ok(ModelConfig {
        hidden_size,
        intermediate_size: required_usize(&obj, "intermediate_size")?,
        num_hidden_layers: required_usize(&obj, "num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        vocab_size: required_usize(&obj, "vocab_size")?,
        max_position_embeddings: optional_usize(&obj, "max_position_embeddings")?
            .unwrap_or(DEFAULT_MAX_POSITIONS),
        rms_norm_eps: optional_f32(&obj, "rms_norm_eps")?.unwrap_or(DEFAULT_RMS_NORM_EPS),
        rope_theta: optional_f32(&obj, "rope_theta")?.unwrap_or(DEFAULT_ROPE_THETA),
        tie_word_embeddings: optional_bool(&obj, "tie_word_embeddings")?.unwrap_or(true),
        eos_token_ids,
    })
}

fn parse_generation_eos(bytes: &[u8]) -> Result<Vec<u32>, String> {
    eos_ids(&parse_object(bytes)?, "eos_token_id")
}

fn required_usize(obj: &Map<String, Value>, key: &str) -> Result<usize, String> {
    optional_usize(obj, key)?.ok_or_else(|| format!("missing required field {key}"))
}

/// `null` counts as absent, as in HF's configs.
fn optional_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| format!("{key} must be a non-negative integer, found {v}")),
    }
}

fn optional_f32(obj: &Map<String, Value>, key: &str) -> Result<Option<f32>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| format!("{key} must be a number, found {v}"))
        }
    }
}

fn optional_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(format!("{key} must be true or false, found {v}")),
    }
}

/// An `eos_token_id` field: absent/null, one id, or a list of ids.
fn eos_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>, String> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("{key} must be a token id or a list of token ids, found {v}"))
    };
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}
