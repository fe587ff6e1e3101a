//! The bench example at the edge of a model's positions: a context whose
//! measurement would pass `max_position_embeddings` is measured at the
//! largest context that fits (each line says which), not refused; and
//! `--prompt-batch` reaches the sessions it measures.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

#[test]
fn contexts_at_the_models_limit_are_measured_inside_it() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    for name in ["model.safetensors", "config.json"] {
        std::fs::copy(fixture.join(name), dir.path().join(name)).unwrap();
    }
    // The fixture's own limit (4,096) made small: cheap on a CPU adapter.
    let config = dir.path().join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 48.into();
    std::fs::write(&config, cfg.to_string()).unwrap();
    let out = Command::new(crate::support::example_bin("bench"))
        .args(["--checkpoint", dir.path().to_str().unwrap(), "--backend", "portable"])
        .args(["--contexts", "16,48", "--tokens", "4", "--timed-steps", "2", "--lookaheads", "1"])
        .args(["--sessions", "2", "--prompt-batch", "8"])
        .env_remove("QWEN3_WGPU_WEIGHTS")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let contexts = |bench: &str| -> Vec<(u64, u64)> {
        let of = |l: &Value, k: &str| l[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
        lines
            .iter()
            .filter(|l| l["bench"] == bench)
            .map(|l| (of(l, "context_requested"), of(l, "context")))
            .collect()
    };
    // Decode adds 4 tokens and 2 x 2 timed steps, plus one; a batch its 4
    // tokens, 2 warm-up steps, plus one.
    assert_eq!(contexts("decode"), [(16, 16), (48, 48 - 9)]);
    // The prompts ran in batches of 8 (`--prompt-batch`), as each line says.
    assert!(lines.iter().filter(|l| l["bench"] == "decode").all(|l| l["prompt_batch"] == 8), "{lines:?}");
    assert_eq!(contexts("batched_decode"), [(16, 16), (48, 48 - 7)]);
    // Each batch waited for its pipelines and took at least 2 warm-up
    // steps, at most as many as fit past its context (taken back after:
    // 48 - 16 - 1 = 31 and 48 - 41 - 1 = 6).
    let batched: Vec<&Value> = lines.iter().filter(|l| l["bench"] == "batched_decode").collect();
    let warm: Vec<u64> = batched.iter().map(|l| l["warm_steps"].as_u64().unwrap()).collect();
    assert!((2..=31).contains(&warm[0]) && (2..=6).contains(&warm[1]), "{warm:?}");
    assert!(batched.iter().all(|l| l["pipelines_wait_ms"].as_f64().is_some_and(|ms| ms >= 0.0)));
    assert!(stderr.contains("measuring at context 39"), "{stderr}");
}
