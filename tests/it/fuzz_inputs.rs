//! Seeded random mutations of config.json, the safetensors header and a
//! cache file, through parsing, validation, conversion and the cache (no
//! GPU): every case ends in a converted model or a named error, never a
//! panic; and a damaged cache file never yields weights other than the
//! checkpoint's.
//!
//! `QWEN3_WGPU_FUZZ_CASES` sets the number of cases (default
//! [`DEFAULT_CASES`]) and `QWEN3_WGPU_FUZZ_SEED` the first seed (case `i`
//! uses seed + i), for long local runs:
//! `QWEN3_WGPU_FUZZ_CASES=1000000 cargo test --release --test it fuzz_inputs:: -- --nocapture`.
//! A failure prints its seed; `QWEN3_WGPU_FUZZ_SEED=<seed> QWEN3_WGPU_FUZZ_CASES=1` replays it.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

use qwen3_wgpu::internals::convert::blob_bytes;
use qwen3_wgpu::internals::load::load_model;
use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::{CachePolicy, Error, ModelConfig, ShapeProfile};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

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

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}

#[test]
fn random_mutations_never_panic() {
    let cases = env_u64("QWEN3_WGPU_FUZZ_CASES", DEFAULT_CASES);
    let first_seed = env_u64("QWEN3_WGPU_FUZZ_SEED", DEFAULT_SEED);
    let root = tempfile::tempdir().unwrap();
    let base = base(root.path());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8) as u64;
    let started = Instant::now();
    let mut outcomes = BTreeMap::<String, u64>::new();
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (base, root) = (&base, root.path());
                s.spawn(move || {
                    let work = root.join(format!("worker{w}"));
                    std::fs::create_dir_all(work.join("ckpt")).unwrap();
                    let mut failures = Vec::new();
                    let mut outcomes = BTreeMap::<String, u64>::new();
                    for i in (w..cases).step_by(workers as usize) {
                        let seed = first_seed.wrapping_add(i);
                        match catch_unwind(AssertUnwindSafe(|| run_case(base, &work, seed))) {
                            Ok((outcome, failure)) => {
                                *outcomes.entry(outcome).or_default() += 1;
                                failures.extend(failure);
                            }
                            Err(_) => failures.push(format!("seed {seed}: panicked (message above)")),
                        }
                    }
                    (failures, outcomes)
                })
            })
            .collect();
        let mut failures = Vec::new();
        for h in handles {
            let (f, o) = h.join().unwrap();
            failures.extend(f);
            for (k, n) in o {
                *outcomes.entry(k).or_default() += n;
            }
        }
        failures
    });
    println!(
        "{cases} mutations from seed {first_seed} on {workers} threads in {:.1} s; first loads by input and outcome: {outcomes:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{} of {cases} cases failed:\n{}", failures.len(), failures.join("\n"));
}
