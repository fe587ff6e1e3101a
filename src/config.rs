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

use crate::checked_read;
pub(crate) use crate::checked_read::file_kind;
use crate::error::{Error, Mismatch, Result};
use crate::limits::{HEAD_DIM_MULTIPLE, MAX_HEAD_DIM};

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
/// missing (or `dir` is not a directory); [`Error::CheckpointInvalid`] for
/// malformed JSON, a missing or mistyped required field, a `model_type`
/// other than `qwen3`, or a JSON file that is not a regular file (a FIFO
/// would block the read forever) or cannot be read;
/// [`Error::UnsupportedArchitecture`] (profile `qwen3`) listing every shape
/// problem the engine cannot run (zero sizes, heads not a multiple of
/// kv_heads, odd head_dim, ...) and every field that changes the
/// computation in a way the engine does not implement (`rope_scaling`,
/// `hidden_act`, sliding-window attention, `attention_bias`, ...).
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    require_checkpoint_dir(dir)?;
    read_config(dir)
}

/// [`load_config`] in a directory already checked to be one.
pub(crate) fn read_config(dir: &Path) -> Result<ModelConfig> {
    let config_path = dir.join("config.json");
    let bytes = read_required(&config_path)?;
    let (mut cfg, mut problems) =
        parse_config(&bytes).map_err(|reason| Error::invalid(&config_path, reason))?;

    let gen_path = dir.join("generation_config.json");
    if let Some(gen_bytes) = read_optional(&gen_path)? {
        let gen_ids = parse_generation_eos(&gen_bytes).map_err(|reason| Error::invalid(&gen_path, reason))?;
        for id in gen_ids {
            if !cfg.eos_token_ids.contains(&id) {
                cfg.eos_token_ids.push(id);
            }
        }
    }

    // A field config.json already got a more precise complaint about (a
    // value f32 cannot hold, say) is not listed twice.
    for m in engine_mismatches(&cfg) {
        if !problems.iter().any(|p| p.field == m.field) {
            problems.push(m);
        }
    }
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
    #[cfg(test)]
    crate::check_counts::count(&crate::check_counts::ENGINE_SHAPE);
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
    if !cfg.head_dim.is_multiple_of(HEAD_DIM_MULTIPLE) {
        // RoPE rotates pairs of dimensions; attention reads K 8 halves at a time.
        let want = format_args!("a multiple of {}", HEAD_DIM_MULTIPLE);
        m.push(mismatch("head_dim", want, cfg.head_dim));
    } else if cfg.head_dim > MAX_HEAD_DIM {
        // The attention kernels keep one head in workgroup memory.
        m.push(mismatch("head_dim", format_args!("<= {}", MAX_HEAD_DIM), cfg.head_dim));
    }
    if !(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0) {
        m.push(mismatch("rope_theta", "a finite number > 0", cfg.rope_theta));
    }
    if !(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0) {
        m.push(mismatch("rms_norm_eps", "a finite number > 0", cfg.rms_norm_eps));
    }
    m
}

pub use crate::checked_read::MAX_JSON_FILE_LEN;

/// A checkpoint directory: missing is [`Error::CheckpointNotFound`], a file
/// (or anything else that is not a directory) too, saying what it is.
pub(crate) fn require_checkpoint_dir(dir: &Path) -> Result<()> {
    #[cfg(test)]
    crate::check_counts::count(&crate::check_counts::DIRECTORY);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(Error::CheckpointNotFound {
            path: dir.to_path_buf(),
            reason: format!(
                "{} is {}, not a checkpoint directory (pass the directory that holds config.json)",
                dir.display(),
                file_kind(&m.file_type())
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::CheckpointNotFound {
            path: dir.to_path_buf(),
            reason: "checkpoint directory does not exist".into(),
        }),
        Err(e) => Err(Error::invalid(dir, format!("cannot access checkpoint directory: {e}"))),
    }
}

/// Metadata of the checkpoint file `path` (symbolic links followed, as in
/// the Hugging Face cache's snapshots): `Ok(None)` when it does not exist,
/// [`Error::CheckpointInvalid`] naming the file when it cannot be examined
/// or is not a regular file.
///
/// Checked before opening because opening a FIFO for reading blocks until a
/// writer appears (forever, for a stray pipe). A file swapped for a FIFO
/// between this check and the open can still block the open; the window is
/// the time between two system calls, and only someone rewriting the
/// checkpoint directory during the load can hit it.
pub(crate) fn regular_file_metadata(path: &Path) -> Result<Option<std::fs::Metadata>> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(Some(m)),
        Ok(m) => Err(Error::invalid(path, format!("is {}, not a regular file", file_kind(&m.file_type())))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::invalid(path, format!("cannot read: {e}"))),
    }
}

fn read_required(path: &Path) -> Result<Vec<u8>> {
    checked_read::read_required(path, "JSON", MAX_JSON_FILE_LEN)
}

/// Reads a JSON file of the checkpoint. `Ok(None)` when the file does not
/// exist; [`Error::CheckpointInvalid`] naming the file when it is not a
/// regular file, is larger than [`MAX_JSON_FILE_LEN`], or cannot be read.
pub(crate) fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    checked_read::read_file(path, "JSON", MAX_JSON_FILE_LEN)
}

fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("malformed JSON: the top level is not an object".into()),
        Err(e) => Err(format!("malformed JSON: {e}")),
    }
}

/// Parses config.json's content: the model's hyper-parameters, and every
/// field whose value changes the computation in a way the engine does not
/// implement (see [`unsupported_fields`]). Errors are the reason text for
/// [`Error::CheckpointInvalid`].
fn parse_config(bytes: &[u8]) -> Result<(ModelConfig, Vec<Mismatch>), String> {
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
    let num_hidden_layers = required_usize(&obj, "num_hidden_layers")?;
    let mut problems = unsupported_fields(&obj, num_hidden_layers)?;
    // Newer transformers keep the RoPE base in `rope_parameters`.
    let nested_theta = match obj.get("rope_parameters") {
        Some(Value::Object(p)) => optional_f64(p, "rope_theta")?,
        _ => None,
    };
    let top_theta = optional_f64(&obj, "rope_theta")?;
    if let (Some(top), Some(nested)) = (top_theta, nested_theta) {
        if top != nested {
            problems.push(mismatch(
                "rope_parameters.rope_theta",
                format_args!("the same as rope_theta ({})", number_text(top)),
                number_text(nested),
            ));
        }
    }
    let rope_theta = top_theta.or(nested_theta);
    let rms_norm_eps = optional_f64(&obj, "rms_norm_eps")?;
    for (field, value) in [("rope_theta", rope_theta), ("rms_norm_eps", rms_norm_eps)] {
        if let Some(m) = value.and_then(|v| f32_range_mismatch(field, v)) {
            problems.push(m);
        }
    }
    let cfg = ModelConfig {
        hidden_size,
        intermediate_size: required_usize(&obj, "intermediate_size")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        vocab_size: required_usize(&obj, "vocab_size")?,
        max_position_embeddings: optional_usize(&obj, "max_position_embeddings")?
            .unwrap_or(DEFAULT_MAX_POSITIONS),
        rms_norm_eps: rms_norm_eps.map_or(DEFAULT_RMS_NORM_EPS, |v| v as f32),
        rope_theta: rope_theta.map_or(DEFAULT_ROPE_THETA, |v| v as f32),
        tie_word_embeddings: optional_bool(&obj, "tie_word_embeddings")?.unwrap_or(true),
        eos_token_ids,
    };
    Ok((cfg, problems))
}

/// A number as config.json would write it: exponent notation for the very
/// small or large (`1e-50`, not a row of zeros), plain otherwise, with the
/// digits JSON parsing adds (`9.999999999999999e-51`) rounded away.
fn number_text(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e16).contains(&v.abs()) {
        let text = format!("{v:.9e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        format!("{mantissa}e{exponent}")
    } else {
        format!("{v}")
    }
}

/// A positive finite `value` that f32 (what the kernels compute in) turns
/// into 0 or infinity.
fn f32_range_mismatch(field: &str, value: f64) -> Option<Mismatch> {
    let single = value as f32;
    let lost = value.is_finite() && value != 0.0 && (single == 0.0 || single.is_infinite());
    lost.then(|| {
        mismatch(
            field,
            "a finite number > 0 that f32 can hold",
            format_args!("{} ({single} as f32)", number_text(value)),
        )
    })
}

/// Activation names that are SiLU in transformers (`ACT2FN`).
const SILU_NAMES: [&str; 2] = ["silu", "swish"];

/// Default of Qwen3Config's `max_window_layers`.
const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// Most layer indices spelled out for a `layer_types` mismatch.
const MAX_LISTED_LAYERS: usize = 8;

/// Every config.json field whose value makes the model compute something
/// the engine does not (it runs Qwen3 dense: SiLU MLP, full causal
/// attention on every layer, plain RoPE, no biases, unquantized weights).
/// Such a checkpoint would load and decode plausible but wrong tokens, so it
/// is refused. The values published Qwen3 checkpoints carry
/// (`hidden_act: "silu"`, `rope_scaling: null`, `attention_bias: false`,
/// `use_sliding_window: false`, any `sliding_window` and
/// `max_window_layers`) pass. A mistyped field is an `Err` (the reason for
/// [`Error::CheckpointInvalid`]).
fn unsupported_fields(obj: &Map<String, Value>, num_hidden_layers: usize) -> Result<Vec<Mismatch>, String> {
    let mut m = Vec::new();
    match obj.get("hidden_act") {
        None | Some(Value::Null) => {}
        Some(Value::String(a)) if SILU_NAMES.contains(&a.as_str()) => {}
        Some(other) => m.push(mismatch("hidden_act", "\"silu\"", other)),
    }
    for field in ["rope_scaling", "rope_parameters"] {
        if let Some(found) = obj.get(field).filter(|v| !is_default_rope(v)) {
            m.push(mismatch(field, "null or {\"rope_type\": \"default\"}", found));
        }
    }
    if let Some(f) = optional_f64(obj, "partial_rotary_factor")?.filter(|&f| f != 1.0) {
        m.push(mismatch("partial_rotary_factor", "1 (RoPE over the whole head)", number_text(f)));
    }
    if optional_bool(obj, "attention_bias")? == Some(true) {
        m.push(mismatch("attention_bias", "false (q/k/v/o projections without bias)", true));
    }
    // As in transformers: layers from `max_window_layers` on attend to the
    // last `sliding_window` positions only, when both are set.
    let window = optional_usize(obj, "sliding_window")?;
    let max_window_layers = optional_usize(obj, "max_window_layers")?.unwrap_or(DEFAULT_MAX_WINDOW_LAYERS);
    if optional_bool(obj, "use_sliding_window")? == Some(true) {
        if let Some(window) = window.filter(|_| max_window_layers < num_hidden_layers) {
            m.push(mismatch(
                "use_sliding_window",
                "false (full attention on every layer)",
                format_args!(
                    "true (layers {max_window_layers} to {} attend to the last {window} positions)",
                    num_hidden_layers - 1
                ),
            ));
        }
    }
    match obj.get("layer_types") {
        None | Some(Value::Null) => {}
        Some(Value::Array(types)) => {
            let mut other = Vec::new();
            for (i, t) in types.iter().enumerate() {
                match t {
                    Value::String(s) if s == "full_attention" => {}
                    Value::String(s) => other.push((i, s.as_str())),
                    v => return Err(format!("layer_types[{i}] must be a string, found {v}")),
                }
            }
            if let Some(&(_, first)) = other.first() {
                let mut layers: Vec<String> =
                    other.iter().take(MAX_LISTED_LAYERS).map(|(i, _)| i.to_string()).collect();
                if other.len() > MAX_LISTED_LAYERS {
                    layers.push(format!("and {} more", other.len() - MAX_LISTED_LAYERS));
                }
                m.push(mismatch(
                    "layer_types",
                    "\"full_attention\" for every layer",
                    format_args!("\"{first}\" at layers {}", layers.join(", ")),
                ));
            }
        }
        Some(v) => return Err(format!("layer_types must be a list of strings, found {v}")),
    }
    match obj.get("quantization_config") {
        None | Some(Value::Null) => {}
        Some(found) => m.push(mismatch("quantization_config", "absent (BF16, F16 or F32 weights)", found)),
    }
    Ok(m)
}

/// `null`, or a RoPE description that transformers computes as plain RoPE:
/// `rope_type` (or the older `type`) absent or `"default"`, and no partial
/// rotation. Other keys (the base `rope_theta`, a `factor` the default type
/// ignores) do not change the computation.
fn is_default_rope(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(p) => {
            let kind_ok = ["rope_type", "type"]
                .iter()
                .all(|k| p.get(*k).is_none_or(|t| t.is_null() || t.as_str() == Some("default")));
            let partial_ok =
                p.get("partial_rotary_factor").is_none_or(|f| f.is_null() || f.as_f64() == Some(1.0));
            kind_ok && partial_ok
        }
        _ => false,
    }
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

fn optional_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| format!("{key} must be a number, found {v}")),
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
