//! Seeded random mutations of config.json, the safetensors header and a
//! cache file, through parsing, validation, conversion and the cache (no
//! GPU): every case ends in a converted model or a named error, never a
//! panic; and a damaged cache file never yields weights other than the
//! checkpoint's. Seeded mutations of a saved session file through
//! `Model::restore_session` (on the portable adapter): a session only
//! from the unmodified file or a resealed change the format allows, with
//! exactly what that change says; otherwise a named error, never a panic
//! or an abort, in bounded time.
//!
//! `QWEN3_WGPU_FUZZ_CASES` sets the number of cases (default
//! [`DEFAULT_CASES`]) and `QWEN3_WGPU_FUZZ_SEED` the first seed (case `i`
//! uses seed + i), for long local runs:
//! `QWEN3_WGPU_FUZZ_CASES=1000000 cargo test --release --test it fuzz_inputs:: -- --nocapture`.
//! A failure prints its seed; `QWEN3_WGPU_FUZZ_SEED=<seed> QWEN3_WGPU_FUZZ_CASES=1` replays it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use qwen3_wgpu::internals::convert::blob_bytes;
use qwen3_wgpu::internals::load::load_model;
use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::{CachePolicy, Error, ModelConfig, ShapeProfile};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::common::seeded::{cpu_workers, run_seeded};

/// Cases per CI run.
const DEFAULT_CASES: u64 = 10_000;
const DEFAULT_SEED: u64 = 0x5157_3357_4755;

/// The smallest shape the engine runs with every code path (GQA, two
/// layers, an untied head): conversion takes well under a millisecond.
fn tiny_shape() -> ModelConfig {
    ModelConfig {
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 32,
        vocab_size: 48,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: false,
        eos_token_ids: vec![2],
    }
}

/// The unmutated inputs.
struct Base {
    config: Vec<u8>,
    weights: Vec<u8>,
    /// A checkpoint directory holding `config` and `weights`, never mutated.
    ckpt: PathBuf,
    /// The name of its cache file, and that file's bytes.
    cache_name: PathBuf,
    cache: Vec<u8>,
    /// The converted blob every successful load of the unmutated checkpoint
    /// must return.
    blob: Vec<u8>,
}

fn base(root: &Path) -> Base {
    let ckpt = root.join("base");
    std::fs::create_dir(&ckpt).unwrap();
    write_random_checkpoint(&ckpt, &tiny_shape(), 3).unwrap();
    // The fields published configs carry, so splices reach their checks.
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
    for (k, v) in [
        ("rope_scaling", Value::Null),
        ("attention_bias", json!(false)),
        ("use_sliding_window", json!(false)),
        ("sliding_window", Value::Null),
        ("max_window_layers", json!(2)),
        ("layer_types", json!(["full_attention", "full_attention"])),
        ("hidden_act", json!("silu")),
    ] {
        cfg[k] = v;
    }
    let config = serde_json::to_vec_pretty(&cfg).unwrap();
    std::fs::write(ckpt.join("config.json"), &config).unwrap();
    let weights = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let cache_dir = root.join("base-cache");
    let (model, report) = load_model(&ckpt, ShapeProfile::AnyQwen3, &CachePolicy::Dir(cache_dir)).unwrap();
    let cache_path = report.cache_path.unwrap();
    Base {
        config,
        weights,
        cache: std::fs::read(&cache_path).unwrap(),
        cache_name: PathBuf::from(cache_path.file_name().unwrap()),
        blob: blob_bytes(&model).unwrap().to_vec(),
        ckpt,
    }
}

/// Values that break assumptions: zero, negatives, the edges of every
/// integer width, floats that vanish or overflow in f32, wrong types.
fn extreme(rng: &mut StdRng) -> Value {
    match rng.random_range(0..20) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(u64::MAX),
        3 => json!(i64::MIN),
        4 => json!(u32::MAX),
        5 => json!(1u64 << 24),
        6 => json!((1u64 << 24) + 1),
        7 => json!(1u64 << 31),
        8 => json!(1e308),
        9 => json!(5e-324),
        10 => json!(1e-50),
        11 => json!(-0.0),
        12 => json!(0.5),
        13 => Value::Null,
        14 => json!(true),
        15 => json!("silu"),
        16 => json!([]),
        17 => json!({}),
        18 => json!(rng.random_range(0..300)),
        _ => json!([rng.random_range(0..100), u64::MAX]),
    }
}

/// A random value somewhere inside `v` (an object member or array item),
/// replaced, removed or duplicated.
fn splice_json(v: &mut Value, rng: &mut StdRng) -> String {
    let depth = rng.random_range(0..3);
    splice_at(v, rng, depth, String::new())
}

fn splice_at(cur: &mut Value, rng: &mut StdRng, depth: u32, path: String) -> String {
    if depth > 0 {
        match cur {
            Value::Object(m) if !m.is_empty() => {
                let k = m.keys().nth(rng.random_range(0..m.len())).unwrap().clone();
                let child = m.get_mut(&k).unwrap();
                if child.is_object() || child.is_array() {
                    return splice_at(child, rng, depth - 1, format!("{path}.{k}"));
                }
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.random_range(0..a.len());
                if a[i].is_object() || a[i].is_array() {
                    return splice_at(&mut a[i], rng, depth - 1, format!("{path}[{i}]"));
                }
            }
            _ => {}
        }
    }
    match cur {
        Value::Object(m) if !m.is_empty() => {
            let k = m.keys().nth(rng.random_range(0..m.len())).unwrap().clone();
            if rng.random_range(0..4) == 0 {
                m.remove(&k);
                format!("remove {path}.{k}")
            } else {
                let x = extreme(rng);
                let text = format!("set {path}.{k} = {x}");
                m.insert(k, x);
                text
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.random_range(0..a.len());
            match rng.random_range(0..3) {
                0 => {
                    a.remove(i);
                    format!("remove {path}[{i}]")
                }
                1 => {
                    let dup = a[i].clone();
                    a.push(dup);
                    format!("duplicate {path}[{i}]")
                }
                _ => {
                    a[i] = extreme(rng);
                    format!("set {path}[{i}] = {}", a[i])
                }
            }
        }
        other => {
            *other = extreme(rng);
            format!("set {path} = {other}")
        }
    }
}

/// Byte-level damage within `range` of `bytes`.
fn mutate_bytes(bytes: &mut Vec<u8>, range: std::ops::Range<usize>, rng: &mut StdRng) -> String {
    let range = range.start.min(bytes.len())..range.end.min(bytes.len());
    if range.is_empty() {
        bytes.push(rng.random());
        return "append one byte".into();
    }
    let at = rng.random_range(range.clone());
    match rng.random_range(0..6) {
        0 => {
            let bit = rng.random_range(0..8);
            bytes[at] ^= 1 << bit;
            format!("flip bit {bit} of byte {at}")
        }
        1 => {
            let b: u8 = rng.random();
            bytes.insert(at, b);
            format!("insert {b:#04x} at {at}")
        }
        2 => {
            bytes.remove(at);
            format!("delete byte {at}")
        }
        3 => {
            bytes.truncate(at);
            format!("truncate to {at}")
        }
        4 => {
            let b = *[0u8, 0xff, b'"', b'{', b'}', b'9', b'-', b'.'].get(rng.random_range(0..8)).unwrap();
            bytes[at] = b;
            format!("set byte {at} = {b:#04x}")
        }
        _ => {
            // A run of ASCII digits made as long as possible.
            let end = (at..range.end).take_while(|&i| bytes[i].is_ascii_digit()).last().map_or(at, |i| i + 1);
            let digits = if rng.random() { "18446744073709551616" } else { "99999999999999999999999999" };
            bytes.splice(at..end, digits.bytes());
            format!("numeric extreme at {at}")
        }
    }
}

fn mutate_config(base: &Base, rng: &mut StdRng) -> (Vec<u8>, String) {
    let mut bytes = base.config.clone();
    if rng.random() {
        let mut v: Value = serde_json::from_slice(&bytes).unwrap();
        let what =
            (0..rng.random_range(1..4)).map(|_| splice_json(&mut v, rng)).collect::<Vec<_>>().join("; ");
        (serde_json::to_vec(&v).unwrap(), what)
    } else {
        let len = bytes.len();
        let what = mutate_bytes(&mut bytes, 0..len, rng);
        (bytes, what)
    }
}

fn mutate_weights(base: &Base, rng: &mut StdRng) -> (Vec<u8>, String) {
    let bytes = &base.weights;
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let data = &bytes[8 + n..];
    match rng.random_range(0..5) {
        4 => {
            // A header that stays self-consistent, so validation is reached:
            // a tensor renamed, retyped to another 2-byte dtype, or reshaped
            // to the same element count.
            let mut header: serde_json::Map<String, Value> =
                serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
            let name = names[rng.random_range(0..names.len())].clone();
            let what = match rng.random_range(0..3) {
                0 => {
                    let new = [
                        "lm_head.bias",
                        "model.layers.0.self_attn.q_proj.bias",
                        "model.layers.2.mlp.up_proj.weight",
                        "score.weight",
                    ][rng.random_range(0..4)];
                    let info = header.remove(&name).unwrap();
                    header.insert(new.to_string(), info);
                    format!("rename {name} to {new}")
                }
                1 => {
                    let dtype = ["F16", "I16", "U16", "F8_E4M3"][rng.random_range(0..4)];
                    header[&name]["dtype"] = json!(dtype);
                    format!("{name} as {dtype}")
                }
                _ => {
                    let shape: Vec<u64> = header[&name]["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap())
                        .collect();
                    let count: u64 = shape.iter().product();
                    let new = if shape.len() == 2 { vec![shape[1], shape[0]] } else { vec![1, count] };
                    header[&name]["shape"] = json!(new);
                    format!("{name} reshaped to {new:?}")
                }
            };
            let text = serde_json::to_vec(&header).unwrap();
            let mut out = (text.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&text);
            out.extend_from_slice(data);
            (out, what)
        }
        0 | 1 => {
            // A JSON-level edit of the header, length prefix recomputed.
            let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let what = (0..rng.random_range(1..3)).map(|_| splice_json(&mut header, rng)).collect::<Vec<_>>();
            let text = serde_json::to_vec(&header).unwrap();
            let mut out = (text.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&text);
            out.extend_from_slice(data);
            (out, what.join("; "))
        }
        2 => {
            let mut out = bytes.clone();
            let what = mutate_bytes(&mut out, 0..8 + n, rng);
            (out, format!("header: {what}"))
        }
        _ => {
            let mut out = bytes.clone();
            let len = out.len();
            let what = mutate_bytes(&mut out, 8 + n..len, rng);
            (out, format!("data: {what}"))
        }
    }
}

fn mutate_cache(base: &Base, rng: &mut StdRng) -> (Vec<u8>, String) {
    let mut bytes = base.cache.clone();
    let len = bytes.len();
    // Most damage in the preamble and JSON header, where parsing happens.
    let range = if rng.random_range(0..4) == 0 { 0..len } else { 0..len.min(4096) };
    let what =
        (0..rng.random_range(1..3)).map(|_| mutate_bytes(&mut bytes, range.clone(), rng)).collect::<Vec<_>>();
    (bytes, what.join("; "))
}

#[derive(Clone, Copy, Debug)]
enum Target {
    Config,
    Weights,
    Cache,
}

/// Runs case `seed` in `work` (a scratch directory of this worker).
/// Returns what the first load gave (`"Config ok"`, `"Weights
/// checkpoint_invalid"`, ...) for the summary, and a failure description.
fn run_case(base: &Base, work: &Path, seed: u64) -> (String, Option<String>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let target = [Target::Config, Target::Weights, Target::Cache][rng.random_range(0..3)];
    let ckpt = work.join("ckpt");
    let cache = work.join("cache");
    let _ = std::fs::remove_dir_all(&cache);
    let (ckpt_dir, policy, what) = match target {
        Target::Config | Target::Weights => {
            let (config, weights, what) = match target {
                Target::Config => {
                    let (c, w) = mutate_config(base, &mut rng);
                    (c, base.weights.clone(), w)
                }
                _ => {
                    let (b, w) = mutate_weights(base, &mut rng);
                    (base.config.clone(), b, w)
                }
            };
            std::fs::write(ckpt.join("config.json"), config).unwrap();
            std::fs::write(ckpt.join("model.safetensors"), weights).unwrap();
            // A quarter through the cache (write, then read back), the rest
            // without: both convert.
            let policy = if rng.random_range(0..4) == 0 {
                CachePolicy::Dir(cache.clone())
            } else {
                CachePolicy::Disabled
            };
            (ckpt.clone(), policy, what)
        }
        Target::Cache => {
            let (bytes, what) = mutate_cache(base, &mut rng);
            std::fs::create_dir_all(&cache).unwrap();
            std::fs::write(cache.join(&base.cache_name), bytes).unwrap();
            (base.ckpt.clone(), CachePolicy::Dir(cache.clone()), what)
        }
    };
    let first = load_model(&ckpt_dir, ShapeProfile::AnyQwen3, &policy);
    let outcome = format!("{target:?} {}", first.as_ref().map_or_else(|e| e.code(), |_| "ok"));
    // Through the cache: load again, from the file the first load wrote.
    let second = match (&first, &policy) {
        (Ok(_), CachePolicy::Dir(_)) => Some(load_model(&ckpt_dir, ShapeProfile::AnyQwen3, &policy)),
        _ => None,
    };
    let fail = |why: String| (outcome.clone(), Some(format!("seed {seed} ({target:?}: {what}): {why}")));
    for result in std::iter::once(first).chain(second) {
        match result {
            Ok((model, _)) => {
                let blob = blob_bytes(&model);
                // An intact checkpoint with a damaged cache must still give
                // exactly its own weights.
                if matches!(target, Target::Cache) && blob != Some(&base.blob[..]) {
                    return fail("a damaged cache file changed the weights".into());
                }
            }
            Err(e) if Error::ALL_CODES.contains(&e.code()) => {
                if matches!(target, Target::Cache) {
                    return fail(format!("an intact checkpoint failed to load: {} ({e})", e.code()));
                }
            }
            Err(e) => return fail(format!("undocumented code {}", e.code())),
        }
    }
    (outcome, None)
}

#[test]
fn random_mutations_never_panic() {
    let root = tempfile::tempdir().unwrap();
    let base = base(root.path());
    let (base, root) = (&base, root.path());
    run_seeded(
        "mutations (first loads by input and outcome)",
        DEFAULT_CASES,
        DEFAULT_SEED,
        cpu_workers(),
        |w| {
            let work = root.join(format!("worker{w}"));
            std::fs::create_dir_all(work.join("ckpt")).unwrap();
            move |seed| run_case(base, &work, seed)
        },
    );
}

/// Session cases per CI run (each restores a file on the GPU).
const DEFAULT_SESSION_CASES: u64 = 2_000;

/// The session file's layout (see `src/session/state.rs`): the header's
/// fields, by offset and width, and where the token ids start.
const SESSION_FIELDS: [(&str, usize, usize); 11] = [
    ("magic", 0, 8),
    ("version", 8, 4),
    ("flags", 12, 4),
    ("fingerprint", 16, 32),
    ("layers", 48, 4),
    ("heads", 52, 4),
    ("head_dim", 56, 4),
    ("pending", 60, 4),
    ("capacity", 64, 8),
    ("len", 72, 8),
    ("token", 80, 4),
];

/// The checksum after a change: xxh3-64 of everything before the footer.
fn reseal_session(bytes: &mut [u8]) {
    let end = bytes.len() - 16;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..end]);
    bytes[end..end + 8].copy_from_slice(&sum.to_le_bytes());
}

/// What a restore must give for a mutated file.
#[derive(Debug, PartialEq)]
enum Want {
    /// A session of these positions' tokens, pending token and capacity.
    Session { tokens: Vec<u32>, pending: Option<u32>, capacity: usize },
    /// An error of this code.
    Code(&'static str),
}

/// The saved files the session cases start from, and what they hold.
struct SessionBase {
    model: qwen3_wgpu::Model,
    good: Vec<u8>,
    /// A file another model (of another shape) saved.
    foreign: Vec<u8>,
    tokens: Vec<u32>,
    pending: Option<u32>,
    capacity: usize,
    vocab: u64,
    max_positions: u64,
}

fn session_base(root: &Path) -> SessionBase {
    use qwen3_wgpu::{AdapterPolicy, Engine, LoadOptions};
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx");
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
    let model = engine.load(fixtures.join("gqa2_hd64"), &options).unwrap();
    let foreign_model = engine.load(fixtures.join("mqa_hd64"), &options).unwrap();
    let tokens = vec![85, 720, 591, 221, 110]; // in both vocabularies (777 and 1,000)
    let save = |model: &qwen3_wgpu::Model, name: &str| {
        let mut s = model.session_with_capacity(24).unwrap();
        let pending = s.feed(&tokens).unwrap();
        let path = root.join(name);
        s.save(&path).unwrap();
        (std::fs::read(path).unwrap(), pending)
    };
    let (good, pending) = save(&model, "good.q3s");
    let (foreign, _) = save(&foreign_model, "foreign.q3s");
    // Both models' files are the same length only by accident of shape.
    assert_ne!(good.len(), foreign.len());
    SessionBase {
        model,
        good,
        foreign,
        tokens,
        pending: Some(pending),
        capacity: 24,
        vocab: 1000,
        max_positions: 4096,
    }
}

/// A value to write into a field of `width` bytes: the edges of the
/// width, sizes that multiply past 2^64, the field's neighbours, and the
/// model's own bounds.
fn extreme_field(rng: &mut StdRng, width: usize, original: u64, base: &SessionBase) -> u64 {
    let max = if width == 8 { u64::MAX } else { u64::from(u32::MAX) };
    let v = match rng.random_range(0..14) {
        0 => 0,
        1 => 1,
        2 => max,
        3 => max - 1,
        4 => 1 << 20,
        5 => 1 << 21,
        6 => 1 << 31,
        7 => 1 << 40,
        8 => original.wrapping_add(1),
        9 => original.wrapping_sub(1),
        10 => base.vocab,
        11 => base.max_positions + rng.random_range(0..2),
        12 => rng.random_range(0..32),
        _ => rng.random_range(0..2000),
    };
    v & max
}

/// A mutation of case `seed` and what restoring it must give.
fn mutate_session(base: &SessionBase, rng: &mut StdRng) -> (Vec<u8>, Want, String) {
    let good = &base.good;
    let intact = |capacity: usize, tokens: &[u32], pending: Option<u32>| Want::Session {
        tokens: tokens.to_vec(),
        pending,
        capacity,
    };
    let invalid = Want::Code("session_file_invalid");
    match rng.random_range(0..8) {
        0 => {
            let mut bytes = good.clone();
            let flips: Vec<String> = (0..rng.random_range(1..4))
                .map(|_| {
                    let (at, bit) = (rng.random_range(0..bytes.len()), rng.random_range(0..8));
                    bytes[at] ^= 1 << bit;
                    format!("{at}.{bit}")
                })
                .collect();
            // Flips that cancel leave the file as it was.
            let want =
                if &bytes == good { intact(base.capacity, &base.tokens, base.pending) } else { invalid };
            (bytes, want, format!("flip bits {}", flips.join(" ")))
        }
        1 => {
            // Most truncations inside the header and the footer.
            let at = match rng.random_range(0..3) {
                0 => rng.random_range(0..96),
                1 => good.len() - rng.random_range(1..32),
                _ => rng.random_range(0..good.len()),
            };
            (good[..at].to_vec(), invalid, format!("truncate to {at}"))
        }
        2 => {
            let mut bytes = good.clone();
            let n = rng.random_range(1..200);
            let at = if rng.random() { bytes.len() } else { rng.random_range(0..bytes.len()) };
            let extra: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            bytes.splice(at..at, extra);
            (bytes, invalid, format!("insert {n} bytes at {at}"))
        }
        3 => {
            let mut bytes = good.clone();
            let len = bytes.len();
            let what = mutate_bytes(&mut bytes, 0..len, rng);
            let want =
                if &bytes == good { intact(base.capacity, &base.tokens, base.pending) } else { invalid };
            (bytes, want, what)
        }
        4 | 5 => {
            // A header field (or a token id) set to an extreme value and
            // the checksum recomputed: only changes the format allows give
            // a session, holding exactly what the change says.
            let (name, mut at, width) = SESSION_FIELDS[rng.random_range(0..SESSION_FIELDS.len())];
            if name == "token" {
                at += 4 * rng.random_range(0..base.tokens.len());
            }
            let mut bytes = good.clone();
            let original = match width {
                4 => u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())),
                8 => u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()),
                _ => 0,
            };
            let value = extreme_field(rng, width, original, base);
            match width {
                4 => bytes[at..at + 4].copy_from_slice(&(value as u32).to_le_bytes()),
                8 => bytes[at..at + 8].copy_from_slice(&value.to_le_bytes()),
                _ if name == "fingerprint" => {
                    let hex = b"0123456789abcdef";
                    for b in &mut bytes[at..at + width] {
                        *b = hex[rng.random_range(0..16)];
                    }
                }
                _ => rng.fill(&mut bytes[at..at + width]),
            }
            reseal_session(&mut bytes);
            let unchanged = &bytes == good;
            let want = match name {
                _ if unchanged => intact(base.capacity, &base.tokens, base.pending),
                "fingerprint" => Want::Code("session_model_mismatch"),
                // Version 1 is still read: an f16 cache's file is the same.
                "version" if value == 1 => intact(base.capacity, &base.tokens, base.pending),
                "flags" if value == 0 => intact(base.capacity, &base.tokens, None),
                "pending" if value < base.vocab => intact(base.capacity, &base.tokens, Some(value as u32)),
                "capacity" if value > base.max_positions => Want::Code("context_overflow"),
                "capacity" if value >= base.tokens.len() as u64 => {
                    intact(value as usize, &base.tokens, base.pending)
                }
                "token" if value < base.vocab => {
                    let mut tokens = base.tokens.clone();
                    tokens[(at - 80) / 4] = value as u32;
                    intact(base.capacity, &tokens, base.pending)
                }
                _ => invalid,
            };
            (bytes, want, format!("resealed {name} at {at} = {value:#x}"))
        }
        6 => {
            // The header's shape and lengths set together, the file given
            // the length they imply where that is small (else a short
            // body), resealed: every size a reader could take from it, up
            // to 0 layers of 2^20 heads of 2^21 dimensions in 100 bytes.
            let pick = |rng: &mut StdRng, values: &[u64]| values[rng.random_range(0..values.len())];
            let max32 = u64::from(u32::MAX);
            let layers = pick(rng, &[0, 1, 2, 3, 1 << 20, max32]);
            let heads = pick(rng, &[0, 1, 2, 1 << 20, max32]);
            let head_dim = pick(rng, &[0, 1, 2, 64, 1 << 21, max32 - 1]);
            let len = pick(rng, &[0, 1, 3, 5000, 1 << 40, u64::MAX]);
            let capacity = pick(rng, &[len, len.saturating_add(7), 0, base.max_positions + 1, u64::MAX]);
            let implied = heads
                .checked_mul(head_dim / 2)
                .and_then(|w| w.checked_mul(8)?.checked_mul(len))
                .and_then(|layer| layer.checked_mul(layers))
                .and_then(|kv| kv.checked_add(len.checked_mul(4)?))
                .and_then(|body| body.checked_add(96));
            let mut bytes = good[..80].to_vec();
            for (at, v) in [(48, layers), (52, heads), (56, head_dim)] {
                bytes[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
            }
            bytes[64..72].copy_from_slice(&capacity.to_le_bytes());
            bytes[72..80].copy_from_slice(&len.to_le_bytes());
            let body = match implied {
                Some(n) if n <= 4 << 20 => n as usize - 96,
                _ => rng.random_range(0..1000),
            };
            bytes.resize(80 + body + 16, 0);
            let end = bytes.len() - 8;
            bytes[end..].copy_from_slice(b"Q3WSEND\0");
            reseal_session(&mut bytes);
            let want = if implied != Some(bytes.len() as u64)
                || head_dim % 2 == 1
                || capacity == 0
                || len > capacity
                || (layers, heads, head_dim) != (2, 2, 64)
            {
                invalid
            } else if capacity > base.max_positions {
                Want::Code("context_overflow")
            } else {
                intact(capacity as usize, &vec![0; len as usize], base.pending)
            };
            let what = format!("{layers} layers, {heads} heads, head_dim {head_dim}, len {len}, capacity {capacity} in {} bytes", bytes.len());
            (bytes, want, what)
        }
        _ => {
            // Another model's file: intact, or damaged.
            let mut bytes = base.foreign.clone();
            if rng.random() {
                let len = bytes.len();
                let what = mutate_bytes(&mut bytes, 0..len, rng);
                let want = if bytes == base.foreign { Want::Code("session_model_mismatch") } else { invalid };
                (bytes, want, format!("another model's file: {what}"))
            } else {
                (bytes, Want::Code("session_model_mismatch"), "another model's file".into())
            }
        }
    }
}

/// Restores case `seed`'s file from `path`; a failure description.
fn run_session_case(base: &SessionBase, path: &Path, seed: u64) -> (String, Option<String>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (bytes, want, what) = mutate_session(base, &mut rng);
    std::fs::write(path, &bytes).unwrap();
    let started = Instant::now();
    let got = match base.model.restore_session(path) {
        Ok(s) => Want::Session { tokens: s.tokens().unwrap(), pending: s.pending(), capacity: s.capacity() },
        Err(e) if Error::ALL_CODES.contains(&e.code()) => Want::Code(e.code()),
        Err(e) => {
            return (String::new(), Some(format!("seed {seed} ({what}): undocumented code {}", e.code())))
        }
    };
    let outcome = match &got {
        Want::Session { .. } => "ok".to_string(),
        Want::Code(code) => code.to_string(),
    };
    let elapsed = started.elapsed();
    let failure = if got != want {
        Some(format!("seed {seed} ({what}): expected {want:?}, got {got:?}"))
    } else if elapsed.as_secs() >= 5 {
        Some(format!("seed {seed} ({what}): took {elapsed:?}"))
    } else {
        None
    };
    (outcome, failure)
}

#[test]
fn session_file_mutations_are_restored_exactly_or_refused() {
    let root = tempfile::tempdir().unwrap();
    let base = session_base(root.path());
    let path = root.path().join("case.q3s");
    // One thread: each case restores a session on the GPU.
    run_seeded("session file mutations", DEFAULT_SESSION_CASES, DEFAULT_SEED, 1, |_| {
        |seed| run_session_case(&base, &path, seed)
    });
}
