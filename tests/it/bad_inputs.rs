//! Bad input and faults, through the public API: every case gets its stable
//! error code (or a documented success), never a panic or a hang, and the
//! cache directory holds afterwards exactly what it should (nothing after a
//! refused checkpoint; one complete cache file and no temporary file after
//! a conversion).
//!
//! Cases that need no GPU call `cache::load_model` (what `Engine::load` runs
//! before the upload); the cases about prompts and counts share one engine
//! on the portable adapter.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use qwen3_wgpu::internals::cache::CACHE_EXTENSION;
use qwen3_wgpu::internals::load::{load_model, LoadReport};
use qwen3_wgpu::{decode_with, CachePolicy, Engine, Error, LoadOptions, ShapeProfile};
use serde_json::{json, Map, Value};

// ---------------------------------------------------------------- helpers

/// A run that takes longer than this is taken for a hang.
const HANG_LIMIT: Duration = Duration::from_secs(20);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

/// A scratch copy of the `gqa2_hd64` fixture (tied, 2 layers, hidden 128,
/// vocab 1000) at `ckpt`, and a cache directory `cache` that does not exist
/// yet.
struct Case {
    _tmp: tempfile::TempDir,
    ckpt: PathBuf,
    cache: PathBuf,
}

impl Case {
    fn new() -> Self {
        Self::of("gqa2_hd64")
    }

    fn of(fixture_name: &str) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = tmp.path().join("ckpt");
        std::fs::create_dir(&ckpt).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture(fixture_name).join(f), ckpt.join(f)).unwrap();
        }
        let cache = tmp.path().join("cache");
        Case { _tmp: tmp, ckpt, cache }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.ckpt.join(name)
    }

    fn policy(&self) -> CachePolicy {
        CachePolicy::Dir(self.cache.clone())
    }

    /// Edits config.json as JSON.
    fn edit_config(&self, f: impl FnOnce(&mut Map<String, Value>)) {
        let path = self.file("config.json");
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        f(v.as_object_mut().unwrap());
        std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    }

    /// Rewrites model.safetensors from its JSON header and data, edited.
    fn edit_weights(&self, f: impl FnOnce(&mut Map<String, Value>, &mut Vec<u8>)) {
        let path = self.file("model.safetensors");
        let (mut header, mut data) = split_safetensors(&std::fs::read(&path).unwrap());
        f(&mut header, &mut data);
        std::fs::write(path, join_safetensors(&header, &data)).unwrap();
    }

    /// Runs [`load`] on this case.
    fn load(&self) -> Result<LoadReport, Error> {
        load(&self.ckpt, self.policy())
    }

    /// Loads, expects `code`, and checks that the cache directory was left
    /// alone (a refused checkpoint writes nothing).
    fn refused(&self, code: &str) -> Error {
        let e = match self.load() {
            Ok(r) => panic!("expected {code}, the load succeeded ({r:?})"),
            Err(e) => e,
        };
        assert_eq!(e.code(), code, "{e}");
        assert!(Error::ALL_CODES.contains(&e.code()));
        assert_eq!(cache_entries(&self.cache), Vec::<String>::new(), "a refused load wrote to the cache");
        e
    }

    /// Loads, expects success, and checks the cache holds exactly one
    /// complete file (the one reported) and nothing else.
    fn loads(&self) -> LoadReport {
        let r = self.load().unwrap_or_else(|e| panic!("expected a load, got {} ({e})", e.code()));
        assert_single_cache_file(&self.cache, &r);
        r
    }
}

/// `cache::load_model` on a worker thread: a panic or a run longer than
/// [`HANG_LIMIT`] fails the test with a message instead of aborting or
/// hanging the binary.
fn load(ckpt: &Path, policy: CachePolicy) -> Result<LoadReport, Error> {
    let ckpt = ckpt.to_path_buf();
    within_limit(move || load_model(&ckpt, ShapeProfile::AnyQwen3, &policy).map(|(_, r)| r))
}

fn within_limit<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(HANG_LIMIT) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("no answer within {HANG_LIMIT:?}: the load hangs"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the load panicked (see above)"),
    }
}

fn split_safetensors(bytes: &[u8]) -> (Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header.as_object().unwrap().clone(), bytes[8 + n..].to_vec())
}

fn join_safetensors(header: &Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let text = serde_json::to_vec(header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    out
}

/// Names in `dir`, sorted; empty when `dir` does not exist.
fn cache_entries(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut v: Vec<String> = entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn assert_single_cache_file(dir: &Path, report: &LoadReport) {
    let path = report.cache_path.as_ref().expect("a cache file was used or written");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.ends_with(&format!(".{CACHE_EXTENSION}")), "{name}");
    assert_eq!(cache_entries(dir), vec![name], "exactly the one cache file, no temporary files");
}

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let status = Command::new("mkfifo").arg(path).status().expect("mkfifo runs");
    assert!(status.success(), "mkfifo {}", path.display());
}

fn replace_with_dir(path: &Path) {
    let _ = std::fs::remove_file(path);
    std::fs::create_dir(path).unwrap();
}

fn mismatch_fields(e: &Error) -> Vec<(String, String)> {
    match e {
        Error::UnsupportedArchitecture { mismatches, .. } => {
            mismatches.iter().map(|m| (m.field.clone(), m.found.clone())).collect()
        }
        other => panic!("not unsupported_checkpoint_architecture: {other}"),
    }
}

fn assert_names(e: &Error, path: &Path, words: &str) {
    let text = e.to_string();
    assert!(text.contains(&path.display().to_string()), "{text} does not name {}", path.display());
    assert!(text.contains(words), "{text} does not say {words:?}");
}

// ---------------------------------------------------------------- the checkpoint directory

#[test]
fn missing_checkpoint_directory() {
    let case = Case::new();
    let e = load(&case.ckpt.join("nope"), case.policy()).unwrap_err();
    assert_eq!(e.code(), "checkpoint_not_found");
    assert_names(&e, &case.ckpt.join("nope"), "does not exist");
    assert!(cache_entries(&case.cache).is_empty());
}

#[test]
fn checkpoint_path_is_a_file() {
    let case = Case::new();
    let file = case.file("model.safetensors");
    let e = load(&file, case.policy()).unwrap_err();
    assert_eq!(e.code(), "checkpoint_not_found");
    assert_names(&e, &file, "is a regular file, not a checkpoint directory");
    assert!(cache_entries(&case.cache).is_empty());
}

// ---------------------------------------------------------------- config.json

#[test]
fn config_missing() {
    let case = Case::new();
    std::fs::remove_file(case.file("config.json")).unwrap();
    assert_names(&case.refused("checkpoint_not_found"), &case.file("config.json"), "does not exist");
}

#[test]
fn config_empty() {
    let case = Case::new();
    std::fs::write(case.file("config.json"), "").unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "malformed JSON");
}

#[test]
fn config_malformed_json() {
    let case = Case::new();
    std::fs::write(case.file("config.json"), "{\"model_type\": \"qwen3\",").unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "malformed JSON");
}

#[test]
fn config_top_level_not_an_object() {
    let case = Case::new();
    std::fs::write(case.file("config.json"), "[\"qwen3\"]").unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "not an object");
}

#[test]
fn config_is_a_directory() {
    let case = Case::new();
    replace_with_dir(&case.file("config.json"));
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "is a directory");
}

#[test]
fn config_is_a_fifo() {
    let case = Case::new();
    mkfifo(&case.file("config.json"));
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "FIFO");
}

#[test]
fn config_larger_than_any_config() {
    let case = Case::new();
    // Sparse: costs no disk.
    let f = std::fs::File::create(case.file("config.json")).unwrap();
    f.set_len(qwen3_wgpu::internals::config::MAX_JSON_FILE_LEN + 1).unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "more than");
}

#[test]
fn config_wrong_model_type() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("model_type".into(), json!("qwen3_moe"));
    });
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "qwen3_moe");
}

#[test]
fn config_missing_required_field() {
    let case = Case::new();
    case.edit_config(|c| {
        c.remove("vocab_size");
    });
    assert_names(&case.refused("checkpoint_invalid"), &case.file("config.json"), "vocab_size");
}

#[test]
fn config_mistyped_fields() {
    for (field, value) in [
        ("hidden_size", json!("128")),
        ("hidden_size", json!(-128)),
        ("hidden_size", json!(128.5)),
        ("num_hidden_layers", json!(1e30)),
        ("tie_word_embeddings", json!("yes")),
        ("eos_token_id", json!(-1)),
        ("rms_norm_eps", json!("small")),
        ("attention_bias", json!(1)),
        ("layer_types", json!("full_attention")),
    ] {
        let case = Case::new();
        case.edit_config(|c| {
            c.insert(field.into(), value.clone());
        });
        let e = case.refused("checkpoint_invalid");
        assert_names(&e, &case.file("config.json"), field);
    }
}

#[test]
fn config_unrunnable_shapes() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("num_key_value_heads".into(), json!(0));
        c.insert("hidden_size".into(), json!(1u64 << 40));
        c.insert("head_dim".into(), json!(60));
    });
    let fields: Vec<String> = mismatch_fields(&case.refused("unsupported_checkpoint_architecture"))
        .into_iter()
        .map(|f| f.0)
        .collect();
    assert_eq!(fields, ["hidden_size", "num_key_value_heads", "head_dim"]);
}

/// A config claiming 2^24 layers: refused as missing tensors, counted
/// without listing 184 million names.
#[test]
fn config_huge_layer_count() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("num_hidden_layers".into(), json!(1u64 << 24));
    });
    let e = case.refused("checkpoint_invalid");
    let text = e.to_string();
    assert!(text.contains("184549354 missing tensor(s): model.layers.2.input_layernorm.weight"), "{text}");
    assert!(text.ends_with("and 184549322 more"), "{text}");
}

#[test]
fn config_rope_scaling_yarn() {
    let case = Case::new();
    let yarn = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    case.edit_config(|c| {
        c.insert("rope_scaling".into(), yarn.clone());
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(mismatch_fields(&e), vec![("rope_scaling".to_string(), yarn.to_string())]);
}

#[test]
fn config_rope_parameters_not_default() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("rope_parameters".into(), json!({"rope_type": "linear", "factor": 2.0}));
        c.insert("partial_rotary_factor".into(), json!(0.5));
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    let fields: Vec<String> = mismatch_fields(&e).into_iter().map(|f| f.0).collect();
    assert_eq!(fields, ["rope_parameters", "partial_rotary_factor"]);
}

#[test]
fn config_hidden_act_not_silu() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("hidden_act".into(), json!("gelu"));
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(mismatch_fields(&e), vec![("hidden_act".to_string(), "\"gelu\"".to_string())]);
}

#[test]
fn config_sliding_window_attention() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("use_sliding_window".into(), json!(true));
        c.insert("sliding_window".into(), json!(64));
        c.insert("max_window_layers".into(), json!(1));
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    let fields = mismatch_fields(&e);
    assert_eq!(fields.len(), 1, "{e}");
    assert_eq!(fields[0].0, "use_sliding_window");
    assert!(fields[0].1.contains("layers 1 to 1 attend to the last 64 positions"), "{e}");
}

#[test]
fn config_sliding_layer_types() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("layer_types".into(), json!(["full_attention", "sliding_attention"]));
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(
        mismatch_fields(&e),
        vec![("layer_types".to_string(), "\"sliding_attention\" at layers 1".to_string())]
    );
}

#[test]
fn config_attention_bias() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("attention_bias".into(), json!(true));
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(mismatch_fields(&e), vec![("attention_bias".to_string(), "true".to_string())]);
}

#[test]
fn config_quantized_weights() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert(
            "quantization_config".into(),
            json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
        );
    });
    let fields = mismatch_fields(&case.refused("unsupported_checkpoint_architecture"));
    assert_eq!(fields[0].0, "quantization_config");
}

#[test]
fn config_tiny_rms_norm_eps_is_printed_faithfully() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("rms_norm_eps".into(), json!(1e-50));
        c.insert("rope_theta".into(), json!(1e39));
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(
        mismatch_fields(&e),
        vec![
            ("rope_theta".to_string(), "1e39 (inf as f32)".to_string()),
            ("rms_norm_eps".to_string(), "1e-50 (0 as f32)".to_string()),
        ]
    );
}

/// The values published Qwen3 configs carry, in every spelling seen, load.
#[test]
fn config_published_values_load() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("sliding_window".into(), json!(4096));
        c.insert("use_sliding_window".into(), json!(false));
        c.insert("max_window_layers".into(), json!(0));
        c.insert("layer_types".into(), json!(["full_attention", "full_attention"]));
        c.insert("rope_scaling".into(), json!({"rope_type": "default"}));
        c.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 1000000}));
        c.insert("attention_dropout".into(), json!(0.0));
        c.insert("transformers_version".into(), json!("4.51.0"));
    });
    let r = case.loads();
    assert!(r.converted);
}

/// transformers 5 writes the RoPE base inside `rope_parameters` only.
#[test]
fn config_rope_theta_inside_rope_parameters() {
    let case = Case::new();
    case.edit_config(|c| {
        c.remove("rope_theta");
        c.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 5000.0}));
    });
    let cfg = qwen3_wgpu::internals::config::load_config(&case.ckpt).unwrap();
    assert_eq!(cfg.rope_theta, 5000.0);
    // Two different bases are refused rather than one picked.
    case.edit_config(|c| {
        c.insert("rope_theta".into(), json!(10000.0));
    });
    let fields = mismatch_fields(&case.refused("unsupported_checkpoint_architecture"));
    assert_eq!(fields[0].0, "rope_parameters.rope_theta");
}

#[test]
fn generation_config_malformed_or_fifo() {
    let case = Case::new();
    std::fs::write(case.file("generation_config.json"), "{\"eos_token_id\": [1,").unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &case.file("generation_config.json"), "malformed JSON");
    mkfifo(&case.file("generation_config.json"));
    assert_names(&case.refused("checkpoint_invalid"), &case.file("generation_config.json"), "FIFO");
}

#[cfg(unix)]
#[test]
fn json_files_linked_to_dev_zero_or_past_the_bound() {
    for name in ["config.json", "generation_config.json"] {
        let case = Case::new();
        std::fs::remove_file(case.file(name)).ok();
        std::os::unix::fs::symlink("/dev/zero", case.file(name)).unwrap();
        assert_names(&case.refused("checkpoint_invalid"), &case.file(name), "character device");
        std::fs::remove_file(case.file(name)).unwrap();
        let f = std::fs::File::create(case.file(name)).unwrap();
        f.set_len(qwen3_wgpu::internals::config::MAX_JSON_FILE_LEN + 1).unwrap();
        assert_names(&case.refused("checkpoint_invalid"), &case.file(name), "more than");
    }
}

// ---------------------------------------------------------------- model.safetensors

#[test]
fn weights_missing() {
    let case = Case::new();
    std::fs::remove_file(case.file("model.safetensors")).unwrap();
    assert_names(&case.refused("checkpoint_not_found"), &case.file("model.safetensors"), "no weights");
}

#[test]
fn weights_empty() {
    let case = Case::new();
    std::fs::write(case.file("model.safetensors"), b"").unwrap();
    assert_names(
        &case.refused("checkpoint_invalid"),
        &case.file("model.safetensors"),
        "malformed safetensors",
    );
}

#[test]
fn weights_is_a_directory() {
    let case = Case::new();
    replace_with_dir(&case.file("model.safetensors"));
    assert_names(&case.refused("checkpoint_invalid"), &case.file("model.safetensors"), "is a directory");
}

#[test]
fn weights_is_a_fifo() {
    let case = Case::new();
    mkfifo(&case.file("model.safetensors"));
    assert_names(&case.refused("checkpoint_invalid"), &case.file("model.safetensors"), "FIFO");
}

#[cfg(unix)]
#[test]
fn weights_is_a_character_device() {
    let case = Case::new();
    std::fs::remove_file(case.file("model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", case.file("model.safetensors")).unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &case.file("model.safetensors"), "character device");
}

/// Unreadable weights are the checkpoint's fault, named. A privileged
/// user (root in a container) reads the file regardless of its mode; there
/// the load succeeds, and that is what is asserted.
#[cfg(unix)]
#[test]
fn weights_unreadable() {
    use std::os::unix::fs::PermissionsExt;
    let case = Case::new();
    let path = case.file("model.safetensors");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::File::open(&path).is_ok() {
        case.loads();
    } else {
        assert_names(&case.refused("checkpoint_invalid"), &path, "ermission denied");
    }
}

#[test]
fn header_length_beyond_the_file() {
    let case = Case::new();
    let path = case.file("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &path, "malformed safetensors");
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &path, "malformed safetensors");
}

#[test]
fn header_not_json() {
    let case = Case::new();
    let path = case.file("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8] = b'<';
    std::fs::write(&path, &bytes).unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &path, "malformed safetensors");
}

#[test]
fn tensor_offsets_past_the_end() {
    let case = Case::new();
    case.edit_weights(|h, data| {
        let end = data.len() as u64;
        let t = h["model.norm.weight"].as_object_mut().unwrap();
        let start = t["data_offsets"][0].as_u64().unwrap();
        t.insert("data_offsets".into(), json!([start + end, start + end + 256]));
    });
    assert_names(
        &case.refused("checkpoint_invalid"),
        &case.file("model.safetensors"),
        "malformed safetensors",
    );
}

#[test]
fn tensor_offsets_overlap() {
    let case = Case::new();
    case.edit_weights(|h, _| {
        let other = h["model.layers.0.input_layernorm.weight"]["data_offsets"].clone();
        h["model.layers.1.input_layernorm.weight"]["data_offsets"] = other;
    });
    assert_names(
        &case.refused("checkpoint_invalid"),
        &case.file("model.safetensors"),
        "malformed safetensors",
    );
}

#[test]
fn tensor_shape_huge() {
    let case = Case::new();
    case.edit_weights(|h, _| {
        h["model.norm.weight"]["shape"] = json!([u64::MAX, u64::MAX]);
    });
    assert_names(
        &case.refused("checkpoint_invalid"),
        &case.file("model.safetensors"),
        "malformed safetensors",
    );
}

#[test]
fn weights_truncated() {
    let case = Case::new();
    case.edit_weights(|_, data| data.truncate(data.len() - 2));
    assert_names(
        &case.refused("checkpoint_invalid"),
        &case.file("model.safetensors"),
        "malformed safetensors",
    );
}

#[test]
fn tensor_wrong_dtype() {
    let case = Case::new();
    case.edit_weights(|h, _| {
        // Same byte length: 64 x I32 in place of 128 x BF16.
        h["model.norm.weight"]["dtype"] = json!("I32");
        h["model.norm.weight"]["shape"] = json!([64]);
    });
    let e = case.refused("unsupported_dtype");
    assert!(e.to_string().contains("model.norm.weight"), "{e}");
}

#[test]
fn tensor_wrong_shape() {
    let case = Case::new();
    case.edit_weights(|h, _| {
        // Same byte length, transposed.
        h["model.layers.0.mlp.up_proj.weight"]["shape"] = json!([128, 256]);
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(
        mismatch_fields(&e),
        vec![("model.layers.0.mlp.up_proj.weight".to_string(), "[128, 256]".to_string())]
    );
}

#[test]
fn tensor_missing() {
    let case = Case::new();
    case.edit_weights(|h, _| {
        // Its bytes stay in the file as an unreferenced gap... which the
        // format forbids, so rename it instead: then it is missing and an
        // unknown tensor at once, and missing is reported first.
        let t = h.remove("model.layers.1.self_attn.k_norm.weight").unwrap();
        h.insert("model.layers.1.self_attn.k_norm.weights".into(), t);
    });
    let e = case.refused("checkpoint_invalid");
    assert!(e.to_string().contains("1 missing tensor(s): model.layers.1.self_attn.k_norm.weight"), "{e}");
}

/// Stored q/k/v biases (what `attention_bias: true` means) would be ignored:
/// refused, each named, even when config.json does not announce them.
#[test]
fn bias_tensors_are_refused() {
    let case = Case::new();
    case.edit_weights(|h, data| {
        for name in ["q_proj", "k_proj", "v_proj"] {
            let start = data.len();
            data.extend_from_slice(&[0u8; 2 * 128]);
            h.insert(
                format!("model.layers.0.self_attn.{name}.bias"),
                json!({"dtype": "BF16", "shape": [128], "data_offsets": [start, start + 256]}),
            );
        }
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    let fields: Vec<String> = mismatch_fields(&e).into_iter().map(|f| f.0).collect();
    assert_eq!(
        fields,
        [
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.v_proj.bias"
        ]
    );
}

/// A classification checkpoint (`score.weight` instead of a language-model
/// head), or layers beyond `num_hidden_layers`: refused, not ignored.
#[test]
fn foreign_tensors_are_refused() {
    let case = Case::new();
    case.edit_weights(|h, data| {
        let start = data.len();
        data.extend_from_slice(&[0u8; 2 * 2 * 128]);
        h.insert(
            "score.weight".into(),
            json!({"dtype": "BF16", "shape": [2, 128], "data_offsets": [start, start + 512]}),
        );
        let norm = h["model.norm.weight"].clone();
        h.insert("model.layers.2.input_layernorm.weight".into(), norm);
    });
    // The second entry shares bytes with model.norm.weight: the format
    // refuses that first.
    case.refused("checkpoint_invalid");
    case.edit_weights(|h, _| {
        h.remove("model.layers.2.input_layernorm.weight");
    });
    let e = case.refused("unsupported_checkpoint_architecture");
    assert_eq!(mismatch_fields(&e), vec![("score.weight".to_string(), "BF16 [2, 128]".to_string())]);
}

/// A tied checkpoint that also stores `lm_head.weight` (a layout some
/// exporters write) loads: transformers ties the head to the embedding and
/// discards the stored copy, and so does the engine.
#[test]
fn tied_checkpoint_with_stored_head_loads() {
    let case = Case::of("tied_with_stored_head");
    assert!(case.loads().converted);
}

// ---------------------------------------------------------------- shards

/// Splits the case's weights into two shards with an index.
fn shard(case: &Case) -> [PathBuf; 2] {
    let path = case.file("model.safetensors");
    let (header, data) = split_safetensors(&std::fs::read(&path).unwrap());
    std::fs::remove_file(&path).unwrap();
    let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    let mut parts = [Map::new(), Map::new()];
    let mut weight_map = Map::new();
    let tensors: Vec<(&String, &Value)> = header.iter().filter(|(k, _)| *k != "__metadata__").collect();
    for (i, (name, _)) in tensors.iter().enumerate() {
        weight_map.insert((*name).clone(), json!(names[i % 2]));
    }
    for (p, part) in parts.iter_mut().enumerate() {
        let mut bytes = Vec::new();
        for (name, info) in tensors.iter().skip(p).step_by(2) {
            let [a, b] = [0, 1].map(|k| info["data_offsets"][k].as_u64().unwrap() as usize);
            let start = bytes.len();
            bytes.extend_from_slice(&data[a..b]);
            let mut info = (*info).clone();
            info["data_offsets"] = json!([start, bytes.len()]);
            part.insert((*name).clone(), info);
        }
        std::fs::write(case.file(names[p]), join_safetensors(part, &bytes)).unwrap();
    }
    let index = json!({"metadata": {"total_size": data.len()}, "weight_map": weight_map});
    std::fs::write(case.file("model.safetensors.index.json"), index.to_string()).unwrap();
    names.map(|n| case.file(n))
}

#[test]
fn sharded_checkpoint_loads() {
    let case = Case::new();
    shard(&case);
    assert!(case.loads().converted);
}

#[test]
fn shard_missing() {
    let case = Case::new();
    let [_, second] = shard(&case);
    std::fs::remove_file(&second).unwrap();
    assert_names(&case.refused("checkpoint_not_found"), &second, "does not exist");
}

#[test]
fn shard_is_a_directory_or_fifo() {
    let case = Case::new();
    let [first, _] = shard(&case);
    replace_with_dir(&first);
    assert_names(&case.refused("checkpoint_invalid"), &first, "is a directory");
    std::fs::remove_dir(&first).unwrap();
    mkfifo(&first);
    assert_names(&case.refused("checkpoint_invalid"), &first, "FIFO");
}

#[test]
fn shard_index_malformed_or_fifo() {
    let case = Case::new();
    shard(&case);
    let index = case.file("model.safetensors.index.json");
    for text in ["", "{\"weight_map\": 3}", "{\"weight_map\": {}}", "{\"weight_map\": {\"a\": 1}}"] {
        std::fs::write(&index, text).unwrap();
        case.refused("checkpoint_invalid");
    }
    std::fs::write(&index, r#"{"weight_map": {"model.norm.weight": "../model.safetensors"}}"#).unwrap();
    assert_names(&case.refused("checkpoint_invalid"), &index, "not a plain file name");
    mkfifo(&index);
    assert_names(&case.refused("checkpoint_invalid"), &index, "FIFO");
}

#[test]
fn tensor_in_two_shards() {
    let case = Case::new();
    let [first, second] = shard(&case);
    // Copy one tensor of the second shard into the first as well.
    let (mut h1, mut d1) = split_safetensors(&std::fs::read(&first).unwrap());
    let (h2, d2) = split_safetensors(&std::fs::read(&second).unwrap());
    let (name, info) = h2.iter().find(|(k, _)| *k != "__metadata__").unwrap();
    let [a, b] = [0, 1].map(|k| info["data_offsets"][k].as_u64().unwrap() as usize);
    let start = d1.len();
    d1.extend_from_slice(&d2[a..b]);
    let mut info = info.clone();
    info["data_offsets"] = json!([start, d1.len()]);
    h1.insert(name.clone(), info);
    std::fs::write(&first, join_safetensors(&h1, &d1)).unwrap();
    let e = case.refused("checkpoint_invalid");
    assert!(e.to_string().contains(&format!("tensor {name} is stored in both")), "{e}");
}

// ---------------------------------------------------------------- the cache directory

#[test]
fn missing_nested_cache_directory_is_created() {
    let mut case = Case::new();
    case.cache = case.cache.join("a/b/c");
    assert!(case.loads().converted);
    assert!(!case.loads().converted, "the second load hits the cache");
}

#[test]
fn cache_directory_path_is_a_file() {
    let case = Case::new();
    std::fs::write(&case.cache, b"a file").unwrap();
    let e = case.load().unwrap_err();
    assert_eq!(e.code(), "cache_io");
    assert_eq!(std::fs::read(&case.cache).unwrap(), b"a file", "the file is left alone");
}

/// A directory where nobody, root included, can create files.
#[cfg(target_os = "linux")]
#[test]
fn read_only_cache_directory() {
    let case = Case::new();
    let e = load(&case.ckpt, CachePolicy::Dir("/proc/self".into())).unwrap_err();
    assert_eq!(e.code(), "cache_io");
    assert!(e.to_string().contains("/proc/self"), "{e}");
    let ours: Vec<String> = cache_entries(Path::new("/proc/self"))
        .into_iter()
        .filter(|n| n.ends_with(".tmp") || n.ends_with(CACHE_EXTENSION))
        .collect();
    assert!(ours.is_empty(), "{ours:?}");
}

/// Mode 0555: cache_io for an ordinary user; a privileged one (root) writes
/// regardless, and there the cache file is written completely.
#[cfg(unix)]
#[test]
fn cache_directory_without_write_permission() {
    use std::os::unix::fs::PermissionsExt;
    let case = Case::new();
    std::fs::create_dir(&case.cache).unwrap();
    std::fs::set_permissions(&case.cache, std::fs::Permissions::from_mode(0o555)).unwrap();
    let privileged = std::fs::write(case.cache.join("probe"), b"").is_ok();
    let _ = std::fs::remove_file(case.cache.join("probe"));
    if privileged {
        case.loads();
    } else {
        assert_eq!(case.load().unwrap_err().code(), "cache_io");
        assert!(cache_entries(&case.cache).is_empty());
    }
}

/// Loads once, damages the cache file, and checks the next load converts
/// again, replaces the file, and the one after hits it.
fn assert_rebuilt_after(damage: impl FnOnce(&Path)) {
    let case = Case::new();
    let first = case.loads();
    let path = first.cache_path.clone().unwrap();
    damage(&path);
    let second = case.loads();
    assert!(second.converted, "a damaged cache file was used");
    assert!(!case.loads().converted, "the rebuilt cache file is used");
}

#[test]
fn cache_file_truncated() {
    assert_rebuilt_after(|p| {
        let len = std::fs::metadata(p).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(p).unwrap().set_len(len / 2).unwrap();
    });
}

#[test]
fn cache_file_empty() {
    assert_rebuilt_after(|p| std::fs::write(p, b"").unwrap());
}

#[test]
fn cache_file_foreign() {
    assert_rebuilt_after(|p| std::fs::write(p, b"\x89PNG\r\n\x1a\n not a cache file at all").unwrap());
}

#[test]
fn cache_file_bit_flips() {
    for at in [0usize, 9, 20, 45, 200, 5000] {
        assert_rebuilt_after(|p| {
            let mut b = std::fs::read(p).unwrap();
            let i = at.min(b.len() - 1);
            b[i] ^= 0x10;
            std::fs::write(p, b).unwrap();
        });
    }
}

#[test]
fn cache_file_replaced_by_a_fifo() {
    assert_rebuilt_after(mkfifo);
}

#[test]
fn cache_file_extended() {
    assert_rebuilt_after(|p| {
        let mut b = std::fs::read(p).unwrap();
        b.extend_from_slice(b"tail");
        std::fs::write(p, b).unwrap();
    });
}

#[test]
fn two_threads_convert_into_one_cache_directory() {
    let case = Case::new();
    let reports: Vec<LoadReport> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|_| s.spawn(|| case.load())).collect();
        handles.into_iter().map(|h| h.join().expect("no panic").expect("both loads succeed")).collect()
    });
    assert_eq!(reports[0].cache_path, reports[1].cache_path);
    assert_single_cache_file(&case.cache, &reports[0]);
    assert!(!case.loads().converted);
}

const CHILD_ENV: &str = "QWEN3_WGPU_BAD_INPUTS_CHILD";

/// Two processes load one checkpoint into one cache directory at once:
/// both succeed, and the directory ends with one complete file.
#[test]
fn two_processes_convert_into_one_cache_directory() {
    if let Some(args) = std::env::var_os(CHILD_ENV) {
        let args = args.into_string().unwrap();
        let (ckpt, cache) = args.split_once('\n').unwrap();
        match load(Path::new(ckpt), CachePolicy::Dir(cache.into())) {
            Ok(r) => println!("CHILD converted={}", r.converted),
            Err(e) => println!("CHILD error={}", e.code()),
        }
        return;
    }
    let case = Case::new();
    let spawn = || {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "bad_inputs::two_processes_convert_into_one_cache_directory",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, format!("{}\n{}", case.ckpt.display(), case.cache.display()))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children = [spawn(), spawn()];
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        assert!(stdout.contains("CHILD converted="), "{stdout}");
    }
    let r = case.loads();
    assert!(!r.converted, "the file the two wrote is complete and used");
}

// ---------------------------------------------------------------- prompts and counts (GPU)

fn engine() -> &'static Engine {
    crate::support::engine()
}

fn options(case: &Case) -> LoadOptions {
    LoadOptions { cache: case.policy(), ..Default::default() }
}

#[test]
fn token_ids_out_of_range() {
    let case = Case::new();
    for (prompt, bad, at) in [(vec![1, 1000], 1000u32, 1usize), (vec![u32::MAX], u32::MAX, 0)] {
        let e = decode_with(engine(), &case.ckpt, &prompt, 4, &options(&case)).unwrap_err();
        assert_eq!(e.code(), "invalid_token_id");
        let Error::InvalidTokenId { id, position, vocab_size } = e else { panic!("{e}") };
        assert_eq!((id, position, vocab_size), (bad, at, 1000));
    }
    // The load before the check cached the conversion, completely.
    let model = engine().load(&case.ckpt, &options(&case)).unwrap();
    assert!(!model.load_report().converted);
    assert_single_cache_file(&case.cache, model.load_report());
}

#[test]
fn empty_prompt_loads_nothing() {
    let case = Case::new();
    let e = decode_with(engine(), &case.ckpt, &[], 4, &options(&case)).unwrap_err();
    assert_eq!(e.code(), "empty_prompt");
    assert!(cache_entries(&case.cache).is_empty(), "checked before loading");
}

#[test]
fn huge_token_counts_overflow_up_front() {
    let case = Case::new();
    let model = engine().load(&case.ckpt, &options(&case)).unwrap();
    for max_new_tokens in [usize::MAX, usize::MAX - 1, 4096] {
        let mut seen = 0;
        let e = model.generate(&[1, 2], max_new_tokens, |_| seen += 1).unwrap_err();
        assert_eq!(e.code(), "context_overflow", "{max_new_tokens}");
        assert_eq!(seen, 0, "refused before decoding");
    }
    let e = decode_with(engine(), &case.ckpt, &[1, 2], usize::MAX, &options(&case)).unwrap_err();
    let Error::ContextOverflow { needed, capacity } = e else { panic!("{e}") };
    assert_eq!((needed, capacity), (usize::MAX, 4096));
    assert_eq!(model.session_with_capacity(0).err().map(|e| e.code()), Some("context_overflow"));
    assert_eq!(model.session_with_capacity(usize::MAX).err().map(|e| e.code()), Some("context_overflow"));
}

#[test]
fn zero_new_tokens_decodes_nothing() {
    let case = Case::new();
    let out = decode_with(engine(), &case.ckpt, &[1, 2, 3], 0, &options(&case)).unwrap();
    assert_eq!(out.token_ids, vec![1, 2, 3]);
    assert!(out.generated_ids().is_empty());
}

#[test]
fn engine_load_refuses_ignored_tensors() {
    let case = Case::new();
    case.edit_config(|c| {
        c.insert("attention_bias".into(), json!(true));
    });
    let e = engine().load(&case.ckpt, &options(&case)).err().expect("refused");
    assert_eq!(e.code(), "unsupported_checkpoint_architecture");
    assert!(cache_entries(&case.cache).is_empty());
}
