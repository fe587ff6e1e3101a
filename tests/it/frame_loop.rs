//! The frame-loop example (decoding while rendering on one shared device)
//! as a smoke run on the portable adapter: a few frames per phase, its JSON
//! lines, the engine never waiting for the GPU (conversations fill their
//! small context and start over meanwhile), and the tokens its first
//! conversation decoded between frames (alone, or in a batch with the
//! others), which must be those of a blocking session fed the same prompt.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions};
use serde_json::Value;

const FRAMES: u64 = 10;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64")
}

fn frame_loop(args: &[&str]) -> Output {
    let scratch = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(crate::support::example_bin("frame_loop"));
    cmd.arg("--checkpoint").arg(fixture()).args(args).env("XDG_RUNTIME_DIR", scratch.path());
    for var in ["QWEN3_WGPU_BACKEND", "QWEN3_WGPU_KERNELS", "QWEN3_WGPU_MATVEC_LAYOUT", "RUST_LOG"] {
        cmd.env_remove(var);
    }
    cmd.output().expect("run the frame_loop example")
}

/// p50 <= p99 <= max, all finite and >= 0.
#[track_caller]
fn check_stats(v: &Value, what: &str) {
    let get = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{what}.{k} missing in {v}"));
    let (p50, p99, max) = (get("p50"), get("p99"), get("max"));
    assert!(0.0 <= p50 && p50 <= p99 && p99 <= max && max.is_finite(), "{what}: {v}");
}

#[test]
fn frames_render_and_conversations_decode_the_blocking_tokens() {
    let frames = FRAMES.to_string();
    let out = frame_loop(&[
        "--backend",
        "portable",
        "--frames",
        &frames,
        "--sessions",
        "1,3",
        "--width",
        "32",
        "--height",
        "32",
        "--iterations",
        "4",
        "--prompt-len",
        "8",
        // Room for a few tokens only: conversations fill and start over.
        "--context",
        "16",
        "--no-cache",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 4, "setup and three phases: {stdout}");
    let setup = &lines[0];
    assert_eq!(setup["render"]["iterations"], 4);
    assert_eq!(setup["frame_hz"], 60);
    assert_eq!(setup["kv_cache"], "f16");
    let prompt: Vec<u32> =
        setup["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(prompt.len(), 8);
    assert_eq!(setup["context"], 16);

    // The tokens a blocking session gives for the same prompt.
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let model =
        engine.load(fixture(), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let mut session = model.session().unwrap();
    let mut expected = vec![session.feed(&prompt).unwrap()];
    while expected.len() < 16 {
        expected.push(session.next_token().unwrap());
    }

    for (phase, sessions) in lines[1..].iter().zip([0, 1, 3]) {
        assert_eq!(phase["sessions"], sessions, "{phase}");
        assert_eq!(phase["phase"], if sessions == 0 { "render" } else { "decode" });
        // Several conversations step as one batch.
        assert_eq!(phase["batched"], sessions > 1, "{phase}");
        assert_eq!(phase["frames"], FRAMES);
        for key in ["frame_cpu_ms", "engine_cpu_ms", "gpu_latency_ms"] {
            check_stats(&phase[key], key);
        }
        // No engine call waited for the GPU, restarts of a full context
        // included.
        assert_eq!(phase["engine_waits"], 0, "{phase}");
        // The latest rendered frames, each with the engine's calls of the
        // (at most 3) frames before it, and their latencies among the
        // phase's.
        let late = phase["slowest_gpu_frames"].as_array().unwrap();
        assert_eq!(late.len(), 8, "{phase}");
        for f in late {
            let i = f["frame"].as_u64().unwrap();
            assert!(i < FRAMES, "{f}");
            assert!(
                f["gpu_latency_ms"].as_f64().unwrap() <= phase["gpu_latency_ms"]["max"].as_f64().unwrap()
            );
            assert_eq!(f["engine_before"].as_array().unwrap().len() as u64, i.min(3), "{f}");
        }
        // A batch's row pipelines may still be building when the phase
        // ends; a conversation alone has none.
        let ready = &phase["pipelines_ready_frame"];
        match sessions {
            0 | 1 => assert!(ready.is_null(), "{phase}"),
            _ => assert!(ready.is_null() || ready.as_u64().unwrap() < FRAMES, "{phase}"),
        }
        // The engine's time is part of the frame's.
        assert!(phase["engine_cpu_ms"]["max"].as_f64() <= phase["frame_cpu_ms"]["max"].as_f64(), "{phase}");
        let ids: Vec<u32> = phase["first_session_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let tokens = phase["tokens"].as_u64().unwrap();
        if sessions == 0 {
            assert_eq!(tokens, 0);
            assert!(ids.is_empty());
        } else {
            // The prompt's prediction arrives within a few frames; the
            // tokens decoded between frames are the blocking session's.
            assert!(!ids.is_empty() && tokens >= ids.len() as u64, "{phase}");
            assert_eq!(ids, expected[..ids.len()], "{phase}");
            check_stats(&phase["first_token_frames"], "first_token_frames");
            assert!(phase["tokens_per_sec"].as_f64().unwrap() > 0.0);
        }
    }
}

#[test]
fn bad_arguments_are_invalid_arguments() {
    for (args, name) in [
        (&["--frames", "0", "--json"][..], "--frames"),
        (&["--backend", "vulkan", "--json"][..], "--backend"),
        (&["--prompt-len", "0", "--json"][..], "--prompt-len"),
        (&["--prompt-len", "8", "--context", "11", "--json"][..], "--context"),
        (&["--frames", "many", "--json"][..], "--frames"),
        (&["--kv-cache", "int4", "--json"][..], "--kv-cache"),
    ] {
        let out = frame_loop(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(last["error"]["code"], "invalid_argument", "{last}");
        assert!(last["error"]["message"].as_str().unwrap().contains(name), "{last}");
    }
}
