//! Sessions over an int8 KV cache (`KvFormat::Int8`): greedy tokens
//! against MLX's float32 on the fixtures wherever the int8 rounding cannot
//! flip them, the logits near the f16 cache's, batches bit-identical to
//! each session alone, forks and session files that keep the format, half
//! the cache memory, and a named error for a head_dim it cannot hold.

use std::path::{Path, PathBuf};

use qwen3_wgpu::{BatchOptions, CachePolicy, Engine, KvFormat, LoadOptions, Model, Session, SessionOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

fn engine() -> &'static Engine {
    crate::support::engine()
}

fn load(name: &str) -> Model {
    engine().load(fixture(name), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap()
}

fn session(model: &Model, capacity: usize, kv: KvFormat) -> Session {
    model.session_with(&SessionOptions::default().capacity(capacity).kv_cache(kv)).unwrap()
}

#[derive(serde::Deserialize)]
struct Expected {
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    margins: Vec<f64>,
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The greedy tokens after feeding `prompt`: the first, then `n - 1` more.
fn greedy(s: &mut Session, prompt: &[u32], n: usize) -> Vec<u32> {
    let first = s.feed(prompt).unwrap();
    std::iter::once(first).chain((1..n).map(|_| s.next_token().unwrap())).collect()
}

fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

/// Logit margins (top-1 minus top-2, MLX float32) below this may flip under
/// the int8 cache's rounding (its logit error is about 1.5% of the logits'
/// rms, 0.03 on these fixtures: `first_logits_stay_near_the_f16_caches`).
const FLIPPABLE_MARGIN: f64 = 0.1;

/// On every MLX fixture whose head_dim an int8 cache holds, the greedy
/// tokens are MLX's at every step up to the first one whose margin is
/// below [`FLIPPABLE_MARGIN`], and 150 of the 168 steps agree before the
/// first difference of their fixture.
#[test]
fn greedy_tokens_follow_mlx_until_a_margin_the_rounding_can_flip() {
    let mut agreed = 0;
    for name in ["gqa2_hd64", "gqa4_hd128", "mqa_hd64", "odd_dims", "prompt_300tok", "untied_head"] {
        let model = load(name);
        let exp = expected(name);
        let n = exp.generated_ids.len();
        let mut s = session(&model, exp.prompt_ids.len() + n, KvFormat::Int8);
        assert_eq!(s.kv_format(), KvFormat::Int8);
        let got = greedy(&mut s, &exp.prompt_ids, n);
        let same = got.iter().zip(&exp.generated_ids).take_while(|(a, b)| a == b).count();
        let safe = exp.margins.iter().position(|m| *m < FLIPPABLE_MARGIN).unwrap_or(n);
        assert!(same >= safe, "{name}: token {same} differs (margins {:?})", &exp.margins[..=same]);
        agreed += same;
    }
    // (Lavapipe: all 168 agree, margins down to 0.012 included.)
    assert!(agreed >= 150, "only {agreed} of 168 steps agree");
}

/// The prompt's logits over an int8 cache stay near the f16 cache's: the
/// difference's rms within 3% of the logits' rms, the largest within 10%
/// (lavapipe: 1.5% and 6%; a value's rounding is at most 1/254 of its
/// row's largest, its rms about 1/440, against f16's 1/3500 of the value),
/// and they do differ (the int8 path ran).
#[test]
fn first_logits_stay_near_the_f16_caches() {
    for name in ["gqa4_hd128", "prompt_300tok"] {
        let model = load(name);
        let exp = expected(name);
        let logits = |kv| {
            let mut s = session(&model, exp.prompt_ids.len() + 1, kv);
            s.feed(&exp.prompt_ids).unwrap();
            s.debug_logits().unwrap()
        };
        let (f16, int8) = (logits(KvFormat::F16), logits(KvFormat::Int8));
        let scale = rms(&f16);
        let worst = f16.iter().zip(&int8).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        let diff: Vec<f32> = f16.iter().zip(&int8).map(|(a, b)| a - b).collect();
        let typical = rms(&diff);
        assert!(typical <= 0.03 * scale, "{name}: rms logit difference {typical}, logits' rms {scale}");
        assert!(worst <= 0.1 * scale, "{name}: largest logit difference {worst}, logits' rms {scale}");
        assert!(worst > 0.0, "{name}: the int8 cache changed nothing");
    }
}

/// A session's buffers shrink by what the KV cache saves: per layer, K and
/// V, each head's rows take head_dim bytes a position instead of
/// 2 head_dim, plus a 4-byte scale (its head's capacity rounded to 4, the
/// scales starting at a multiple of 16 bytes).
#[test]
fn an_int8_cache_takes_about_half_the_memory() {
    let model = load("gqa4_hd128");
    let cfg = model.config();
    let capacity = 301;
    let (layers, heads, hd) = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim);
    let f16 = heads * capacity * hd * 2;
    let int8 = (heads * capacity * hd).next_multiple_of(16) + heads * 4 * capacity.next_multiple_of(4);
    let saved = 2 * layers * (f16 - int8);
    let (a, b) = (session(&model, capacity, KvFormat::F16), session(&model, capacity, KvFormat::Int8));
    assert_eq!(a.buffer_bytes() - b.buffer_bytes(), saved as u64);
    assert!(int8 * 100 <= f16 * 52, "int8 {int8} bytes against f16 {f16}");
}

/// A fork and a saved-then-restored session keep the int8 cache and go on
/// with the same tokens as the session itself; the file holds what the
/// format says (int8 rows and a scale per head and position).
#[test]
fn forks_and_session_files_keep_the_int8_cache() {
    let model = load("gqa2_hd64");
    let cfg = model.config().clone();
    let exp = expected("gqa2_hd64");
    let mut s = session(&model, 64, KvFormat::Int8);
    s.feed(&exp.prompt_ids).unwrap();
    s.next_token().unwrap();
    let mut fork = s.fork_with_capacity(40).unwrap();
    assert_eq!(fork.kv_format(), KvFormat::Int8);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("int8.q3s");
    s.save(&path).unwrap();
    let position = cfg.num_key_value_heads * (cfg.head_dim + 4) * 2 * cfg.num_hidden_layers;
    let want_size = 96 + s.len() * (4 + position);
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, want_size);
    let mut restored = model.restore_session(&path).unwrap();
    assert_eq!(restored.kv_format(), KvFormat::Int8);
    assert_eq!(restored.tokens().unwrap(), s.tokens().unwrap());
    let want: Vec<u32> = (0..6).map(|_| s.next_token().unwrap()).collect();
    for (what, other) in [("fork", &mut fork), ("restored", &mut restored)] {
        let got: Vec<u32> = (0..6).map(|_| other.next_token().unwrap()).collect();
        assert_eq!(got, want, "{what}");
    }
}

/// A batch over int8 caches: each session's tokens equal its tokens alone
/// (an int8 session), one of them crossing the 256-position chunk.
#[test]
fn an_int8_batch_equals_each_session_alone() {
    let model = load("gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let ids = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32).map(|i| (i * 7919 + seed * 104_729) % vocab).collect()
    };
    let (pa, pb) = (ids(1, 250), ids(2, 9));
    let n = 12;
    let alone = |p: &[u32]| greedy(&mut session(&model, 300, KvFormat::Int8), p, n);
    let want = [alone(&pa), alone(&pb)];
    let options = BatchOptions::default().slots(2).capacity_per_slot(300).kv_cache(KvFormat::Int8);
    let mut batch = model.batch(&options).unwrap();
    let (mut a, mut b) = (batch.session().unwrap(), batch.session().unwrap());
    assert_eq!((a.kv_format(), b.kv_format()), (KvFormat::Int8, KvFormat::Int8));
    let mut got = [vec![a.feed(&pa).unwrap()], vec![b.feed(&pb).unwrap()]];
    for _ in 1..n {
        let t = batch.step(&mut [&mut a, &mut b]).unwrap();
        got[0].push(t[0]);
        got[1].push(t[1]);
    }
    assert!(a.len() > 256);
    assert_eq!(got, want);
}

/// `Engine::prepare_kv_cache` builds and proves the int8 cache's
/// pipelines ahead of a session (the q/k norm's write, the prompt and
/// prompt-batch attention, the decode step direct and chunked, the
/// reduce) and returns their check, the same one each later call; f16's
/// is the start-up check. `doctor` reports it.
#[test]
fn the_int8_pipelines_are_proven_ahead_and_doctor_reports_them() {
    let engine = engine();
    let check = engine.prepare_kv_cache(KvFormat::Int8).unwrap();
    assert!(check.ok && check.pipelines >= 6, "{}", check.describe_failures());
    assert_eq!(engine.prepare_kv_cache(KvFormat::Int8).unwrap().ms, check.ms, "proven once");
    assert_eq!(
        engine.kv_cache_source(KvFormat::Int8),
        engine.kernel_source(),
        "no twin here to fall back from"
    );
    assert_eq!(
        engine.prepare_kv_cache(KvFormat::F16).unwrap().pipelines,
        engine.kernel_report().self_check.pipelines
    );
    let out = std::process::Command::new(crate::support::example_bin("doctor"))
        .args(["--backend", "portable"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("int8 KV cache: wgsl kernels, self-check ok"), "{text}");
    assert!(text.contains("READY:") && !text.contains("NOT READY"), "{text}");
}

/// A model whose head_dim is not a multiple of 16 cannot keep an int8
/// cache: `invalid_argument` naming `kv_cache`, for a session and a batch;
/// its f16 sessions work.
#[test]
fn a_head_dim_the_int8_cache_cannot_hold_is_a_named_error() {
    use crate::tiny_checkpoint::{make_tensors, tiny_config, write_checkpoint};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config();
    cfg["head_dim"] = serde_json::json!(40);
    write_checkpoint(dir.path(), &cfg, &make_tensors(&cfg, 5), safetensors::Dtype::F32);
    let model = engine()
        .load(dir.path(), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() })
        .unwrap();
    let e =
        model.session_with(&SessionOptions::default().capacity(16).kv_cache(KvFormat::Int8)).err().unwrap();
    assert!(matches!(&e, qwen3_wgpu::Error::InvalidArgument { name, .. } if name == "kv_cache"), "{e}");
    let e = model
        .batch(&BatchOptions::default().slots(1).capacity_per_slot(16).kv_cache(KvFormat::Int8))
        .unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    let mut s = model.session_with(&SessionOptions::default().capacity(16)).unwrap();
    s.feed(&[1, 2, 3]).unwrap();
}

/// An int8 cache's session file read as another format, or damaged, is a
/// named error: its flag cleared (the length then says f16 rows), the flag
/// set on an f16 session's file, a flipped bit in a scale, a byte short;
/// each resealed where the checksum would otherwise catch it first.
#[test]
fn int8_session_files_read_as_another_format_or_damaged_are_refused() {
    let model = load("gqa2_hd64");
    let exp = expected("gqa2_hd64");
    let dir = tempfile::tempdir().unwrap();
    let save = |kv: KvFormat| {
        let mut s = session(&model, 32, kv);
        s.feed(&exp.prompt_ids).unwrap();
        let path = dir.path().join(format!("{kv}.q3s"));
        s.save(&path).unwrap();
        std::fs::read(&path).unwrap()
    };
    let (int8, f16) = (save(KvFormat::Int8), save(KvFormat::F16));
    let reseal = |bytes: &mut Vec<u8>| {
        let end = bytes.len() - 16;
        let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..end]);
        bytes[end..end + 8].copy_from_slice(&sum.to_le_bytes());
    };
    let restore = |bytes: &[u8]| {
        let path = dir.path().join("edited.q3s");
        std::fs::write(&path, bytes).unwrap();
        model.restore_session(&path).err().map(|e| e.code())
    };
    assert_eq!(restore(&int8), None);
    let mut cleared = int8.clone();
    cleared[12] &= !2;
    reseal(&mut cleared);
    assert_eq!(restore(&cleared), Some("session_file_invalid"));
    let mut set = f16.clone();
    set[12] |= 2;
    reseal(&mut set);
    assert_eq!(restore(&set), Some("session_file_invalid"));
    // The last scale of the last layer's V: the checksum catches it.
    let mut flipped = int8.clone();
    let at = flipped.len() - 16 - 2;
    flipped[at] ^= 0x10;
    assert_eq!(restore(&flipped), Some("session_file_invalid"));
    let mut short = int8[..int8.len() - 1].to_vec();
    reseal(&mut short);
    assert_eq!(restore(&short), Some("session_file_invalid"));
}
