//! End to end against MLX: the fixtures under tests/fixtures/mlx are small
//! random Qwen3 checkpoints with exactly int8-representable weights, and
//! the greedy tokens mlx-lm's Qwen3 produced for them in float32
//! (scripts/make_mlx_fixtures.py). The engine must produce the same tokens
//! at every step before the first near-tie.

use std::path::{Path, PathBuf};

use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions};

#[derive(serde::Deserialize)]
struct Expected {
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    eos_token_id: u32,
    first_near_tie: Option<usize>,
    top5_first_step: Vec<(u32, f64)>,
}

fn fixture(case: &str) -> (PathBuf, Expected) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(case);
    let text = std::fs::read_to_string(dir.join("expected.json")).expect("expected.json");
    (dir, serde_json::from_str(&text).expect("valid expected.json"))
}

fn check_case(engine: &Engine, case: &str) {
    let (dir, exp) = fixture(case);
    let model = engine
        .load(&dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() })
        .unwrap_or_else(|e| panic!("{case}: load: {e}"));

    // First step: the logits themselves, against MLX's top 5.
    let mut session = model.session_with_capacity(exp.prompt_ids.len() + exp.generated_ids.len()).unwrap();
    let first = session.feed(&exp.prompt_ids).unwrap();
    let logits = session.debug_logits().unwrap();
    let rms = (logits.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / logits.len() as f64).sqrt();
    for (id, want) in &exp.top5_first_step {
        let got = logits[*id as usize] as f64;
        assert!((got - want).abs() <= 1e-3 * rms, "{case}: logit {id}: engine {got}, MLX {want} (rms {rms})");
    }
    assert_eq!(first, exp.generated_ids[0], "{case}: first token");

    // The whole greedy chain, up to the first near-tie (or end of text).
    let n = exp.first_near_tie.unwrap_or(exp.generated_ids.len());
    let out = model.generate(&exp.prompt_ids, exp.generated_ids.len(), |_| {}).unwrap();
    let got = out.generated_ids();
    let mut compared = 0;
    for (i, want) in exp.generated_ids.iter().take(n).enumerate() {
        assert_eq!(
            got.get(i),
            Some(want),
            "{case}: token {i}: engine {:?}, MLX {:?}",
            got,
            exp.generated_ids
        );
        compared += 1;
        if *want == exp.eos_token_id {
            break;
        }
    }
    assert!(compared >= 1, "{case}: nothing compared");
}

fn engine() -> Engine {
    Engine::builder().policy(AdapterPolicy::Portable).build().expect("engine")
}

#[test]
fn gqa_2_to_1_head_dim_64() {
    check_case(&engine(), "gqa2_hd64");
}

#[test]
fn gqa_4_to_1_head_dim_128() {
    check_case(&engine(), "gqa4_hd128");
}

#[test]
fn mqa() {
    check_case(&engine(), "mqa_hd64");
}

#[test]
fn untied_lm_head() {
    check_case(&engine(), "untied_head");
}

#[test]
fn tied_with_a_stored_lm_head() {
    check_case(&engine(), "tied_with_stored_head");
}

#[test]
fn one_token_prompt() {
    check_case(&engine(), "prompt_1tok");
}

#[test]
fn three_hundred_token_prompt() {
    check_case(&engine(), "prompt_300tok");
}

#[test]
fn dimensions_not_multiples_of_64_and_vocab_555() {
    check_case(&engine(), "odd_dims");
}

/// The workgroup-memory reductions (adapters without subgroups) agree too.
#[test]
fn without_subgroups() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).without_subgroups().build().unwrap();
    assert!(!engine.uses_subgroups());
    for case in ["gqa4_hd128", "odd_dims"] {
        check_case(&engine, case);
    }
}

/// The timed step (a diagnostic for benchmarks) computes the same tokens.
#[test]
fn timed_step_agrees() {
    let (dir, exp) = fixture("gqa2_hd64");
    let model =
        engine().load(&dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let mut s = model.session_with_capacity(64).unwrap();
    assert_eq!(s.feed(&exp.prompt_ids).unwrap(), exp.generated_ids[0]);
    for want in &exp.generated_ids[1..4] {
        let t = s.timed_step().unwrap();
        assert_eq!(s.pending(), Some(*want));
        assert!(t.wall_us > 0.0 && t.encode_us > 0.0 && t.wall_us >= t.encode_us);
        if let Some(g) = t.gpu_us {
            assert!(g > 0.0 && g < 1e9, "{g}");
        }
    }
    assert_eq!(s.len(), exp.prompt_ids.len() + 3);
}
