//! The decode example's command-line contract, run as a user runs it: with
//! `--json`, every failure (a malformed argument included) ends stdout with
//! one `{"error": {"code", "message"}}` line and a non-zero exit; `--help`
//! and `--version` print and exit 0; a flag wins over its `QWEN3_WGPU_*`
//! variable, which applies when the flag is not given; the tokenizer is
//! read only when text is needed; `--chat` and `--print-prompt` render the
//! checkpoint's chat template. The chat example answers each line of stdin
//! on one session and ends at end of input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The engine's environment variables: cleared for every run, so the
/// caller's environment cannot change what a case tests.
const SETTINGS: [&str; 5] = [
    "QWEN3_WGPU_BACKEND",
    "QWEN3_WGPU_KERNELS",
    "QWEN3_WGPU_MATVEC_LAYOUT",
    "QWEN3_WGPU_COOPERATIVE_MATRICES",
    "QWEN3_WGPU_WEIGHTS",
];

/// The decode example's binary, built for this test binary.
fn decode_bin() -> PathBuf {
    crate::support::example_bin("decode")
}

/// The chat example's binary, built for this test binary.
fn chat_bin() -> PathBuf {
    crate::support::example_bin("chat")
}

/// Runs the decode example with `args`, the engine's variables (and
/// RUST_LOG: warnings show by default) cleared and then set as `env` says.
fn decode(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(decode_bin());
    cmd.args(args);
    for var in SETTINGS.iter().chain(&["RUST_LOG"]) {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the decode example")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Stdout's last line as JSON.
fn last_json(out: &Output) -> Value {
    let text = stdout(out);
    let last = text.lines().last().unwrap_or_else(|| panic!("nothing on stdout; stderr: {}", stderr(out)));
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last stdout line {last:?} is not JSON: {e}"))
}

/// A failed run: exit status 2 and, last on stdout, the error object with
/// `code`; returns its message.
fn expect_error(out: &Output, code: &str) -> String {
    let json = last_json(out);
    assert_eq!(json["error"]["code"], code, "{json}; stderr: {}", stderr(out));
    assert_eq!(out.status.code(), Some(2), "{json}");
    let message = json["error"]["message"].as_str().expect("a message").to_string();
    // stderr carries the same error, on one line, with its code.
    assert!(stderr(out).contains(&format!("error [{code}]: {message}")), "stderr: {}", stderr(out));
    message
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64")
}

/// A copy of the small fixture beside a tokenizer.json that is not JSON.
fn fixture_with_broken_tokenizer() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), tmp.path().join(f)).unwrap();
    }
    std::fs::write(tmp.path().join("tokenizer.json"), "{ not a tokenizer").unwrap();
    tmp
}

#[test]
fn every_malformed_argument_is_a_json_invalid_argument() {
    // (arguments, the flag the message names)
    let cases: &[(&[&str], &str)] = &[
        (&["--prompt-ids", "abc"], "--prompt-ids"),
        (&["--prompt-ids", "-1"], "--prompt-ids"),
        (&["--prompt-ids", ""], "--prompt-ids"),
        (&["--prompt-ids", "1,,2"], "--prompt-ids"),
        (&["--prompt-ids", "1,2,"], "--prompt-ids"),
        (&["--prompt-ids", "4294967296"], "--prompt-ids"),
        (&["--prompt-ids", "1 2"], "--prompt-ids"),
        (&["--prompt-ids"], "--prompt-ids"),
        (&["--prompt-ids", "1", "--max-new-tokens", "-1"], "--max-new-tokens"),
        (&["--prompt-ids", "1", "--max-new-tokens", "18446744073709551616"], "--max-new-tokens"),
        (&["--prompt-ids", "1", "--max-new-tokens", "lots"], "--max-new-tokens"),
        (&["--prompt", "hello", "--prompt-ids", "1"], "--prompt"),
        (&["--prompt-ids", "1", "--no-such-flag"], "--no-such-flag"),
        (&["--prompt-ids", "1", "--backend", "vulkan"], "--backend"),
        (&["--prompt-ids", "1", "--kernels", "fast"], "--kernels"),
        (&["--prompt-ids", "1", "--matvec-layout", "columns"], "--matvec-layout"),
        (&["--prompt-ids", "1", "--weights", "int2"], "--weights"),
        (&["--prompt-ids", "1", "--kv-cache", "int4"], "--kv-cache"),
    ];
    for (args, flag) in cases {
        // --json first and last: it is honoured wherever it stands.
        for json_first in [true, false] {
            let mut argv: Vec<&str> = args.to_vec();
            if json_first {
                argv.insert(0, "--json");
            } else {
                argv.push("--json");
            }
            let out = decode(&argv, &[]);
            let message = expect_error(&out, "invalid_argument");
            assert!(message.contains(flag), "{argv:?}: {message}");
        }
    }
}

/// `--model` without the `hub` feature is an error naming the feature;
/// with it, an id missing from an empty offline cache is
/// `checkpoint_not_found` naming the id. Either way `--model` with
/// `--checkpoint` is refused.
#[test]
fn model_resolves_through_the_hub_feature_or_names_it() {
    let hub = tempfile::tempdir().unwrap();
    let hub_cache = hub.path().to_str().unwrap();
    let env = [("HF_HUB_CACHE", hub_cache), ("HF_HUB_OFFLINE", "1")];
    let out = decode(&["--model", "Qwen/Qwen3-0.6B-Base", "--prompt-ids", "1", "--json"], &env);
    if cfg!(feature = "hub") {
        let message = expect_error(&out, "checkpoint_not_found");
        assert!(message.contains("Qwen/Qwen3-0.6B-Base"), "{message}");
    } else {
        let message = expect_error(&out, "invalid_argument");
        assert!(message.contains("--model") && message.contains("`hub` feature"), "{message}");
    }
    let dir = fixture();
    let both =
        ["--model", "Qwen/Qwen3-0.6B-Base", "--checkpoint", dir.to_str().unwrap(), "--prompt-ids", "1"];
    let out = decode(&[&both[..], &["--json"]].concat(), &env);
    let message = expect_error(&out, "invalid_argument");
    assert!(message.contains("--model") || message.contains("--checkpoint"), "{message}");
}

#[test]
fn without_json_an_argument_error_is_one_line_on_stderr() {
    let out = decode(&["--prompt-ids", "1,,2"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stdout(&out), "");
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error [invalid_argument]: invalid argument --prompt-ids"), "{err}");
}

#[test]
fn help_and_version_print_and_exit_0() {
    for (flag, expect) in [("--help", "Usage:"), ("--version", env!("CARGO_PKG_VERSION"))] {
        for argv in [vec![flag], vec!["--json", flag]] {
            let out = decode(&argv, &[]);
            assert_eq!(out.status.code(), Some(0), "{argv:?}: {}", stderr(&out));
            assert!(stdout(&out).contains(expect), "{argv:?}: {}", stdout(&out));
        }
    }
    let help = stdout(&decode(&["--help"], &[]));
    for flag in ["--backend", "--kernels", "--matvec-layout", "QWEN3_WGPU_BACKEND"] {
        assert!(help.contains(flag), "--help does not mention {flag}");
    }
}

#[test]
fn an_unknown_variable_value_is_invalid_argument_naming_it() {
    for var in SETTINGS {
        // The ids parse ("1, 2": spaces around an id are allowed), so the
        // error is the variable's.
        let out = decode(&["--prompt-ids", "1, 2", "--json"], &[(var, "bogus")]);
        let message = expect_error(&out, "invalid_argument");
        assert!(message.contains(var) && message.contains("bogus"), "{message}");
        assert!(message.contains("allowed:"), "{message}");
    }
}

/// Without --backend, QWEN3_WGPU_BACKEND=portable is honoured: the run gets
/// past the adapter (lavapipe here, not Metal) to the missing checkpoint.
#[test]
fn the_backend_variable_applies_without_the_flag() {
    let out = decode(
        &["--checkpoint", "/nonexistent/qwen3", "--prompt-ids", "1, 2", "--json"],
        &[("QWEN3_WGPU_BACKEND", "portable")],
    );
    let message = expect_error(&out, "checkpoint_not_found");
    assert!(message.contains("/nonexistent/qwen3"), "{message}");
}

/// Flags win: with every variable bogus, the flags alone decide (the
/// variables are never read, else they would be invalid_argument).
#[test]
fn flags_win_over_the_variables() {
    let out = decode(
        &[
            "--checkpoint",
            "/nonexistent/qwen3",
            "--prompt-ids",
            "1",
            "--backend",
            "portable",
            "--kernels",
            "wgsl",
            "--matvec-layout",
            "rows",
            "--cooperative-matrices",
            "off",
            "--weights",
            "int8",
            "--json",
        ],
        &SETTINGS.map(|var| (var, "bogus")),
    );
    expect_error(&out, "checkpoint_not_found");
}

/// A count whose `prompt + count - 1` wraps is refused up front: nothing is
/// decoded (stdout holds the error line alone).
#[test]
fn a_huge_max_new_tokens_is_context_overflow_up_front() {
    let fixture = fixture();
    let args = [
        "--checkpoint",
        fixture.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "18446744073709551615",
        "--backend",
        "portable",
        "--no-cache",
        "--json",
    ];
    let out = decode(&args, &[]);
    expect_error(&out, "context_overflow");
    assert_eq!(stdout(&out).lines().count(), 1, "{}", stdout(&out));
}

/// Two runs of 2 new tokens after prompt ids 1,2,3 on `ckpt` (portable, no
/// cache) with `extra` flags: with `--json`, then without; each exits 0.
fn short_runs(ckpt: &Path, extra: &[&str]) -> (Output, Output) {
    let ckpt = ckpt.to_str().unwrap();
    let mut args = vec![
        "--checkpoint",
        ckpt,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--backend",
        "portable",
        "--no-cache",
    ];
    args.extend_from_slice(extra);
    let plain = args.clone();
    args.push("--json");
    let runs = (decode(&args, &[]), decode(&plain, &[]));
    for out in [&runs.0, &runs.1] {
        assert_eq!(out.status.code(), Some(0), "{}", stderr(out));
    }
    runs
}

#[test]
fn a_broken_tokenizer_does_not_block_a_prompt_ids_run() {
    let dir = fixture_with_broken_tokenizer();
    let (json_out, out) = short_runs(dir.path(), &[]);
    let result = last_json(&json_out);
    assert_eq!(result["token_ids"].as_array().map(|a| a.len()), Some(5), "{result}");
    // Without --json the text would be printed: the ids are, and stderr says
    // why the text is not, naming the file.
    assert!(stdout(&out).contains("generated ids:"), "{}", stdout(&out));
    assert!(stderr(&out).contains("tokenizer.json"), "{}", stderr(&out));
}

/// The summary line and `--json` say whether decode steps read the
/// residual's f16 copy: on the split-K layout they do, on rows per team not.
#[test]
fn the_f16_residual_copy_is_reported() {
    for (layout, on) in [("split", true), ("rows", false)] {
        let (json_out, out) = short_runs(&fixture(), &["--matvec-layout", layout]);
        assert_eq!(last_json(&json_out)["f16_residual"], Value::Bool(on), "{layout}");
        assert_eq!(stdout(&out).contains(", f16 residual copy,"), on, "{layout}: {}", stdout(&out));
    }
}

/// `--weights` picks the layers' format and `--json` reports it; without
/// the flag, QWEN3_WGPU_WEIGHTS does, else int8.
#[test]
fn the_weight_format_is_chosen_and_reported() {
    let (json_out, text_out) = short_runs(&fixture(), &["--weights", "int4"]);
    assert_eq!(last_json(&json_out)["weights"], "int4");
    assert!(stdout(&text_out).contains(", int4 weights, stop:"), "{}", stdout(&text_out));
    let ckpt = fixture();
    let args = ["--checkpoint", ckpt.to_str().unwrap(), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"];
    let args = [&args[..], &["--backend", "portable", "--no-cache", "--json"]].concat();
    for (env, want) in [(Some("INT4"), "int4"), (None, "int8")] {
        let out = decode(&args, &env.map(|v| ("QWEN3_WGPU_WEIGHTS", v)).into_iter().collect::<Vec<_>>());
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert_eq!(last_json(&out)["weights"], want, "{env:?}");
    }
}

/// `--kv-cache int8` runs the session over an int8 KV cache; `--json`
/// reports it (`f16` without the flag), and so does the summary line.
#[test]
fn the_kv_cache_format_is_chosen_and_reported() {
    for (flag, want) in [(&["--kv-cache", "int8"][..], "int8"), (&[][..], "f16")] {
        let (json_out, text_out) = short_runs(&fixture(), flag);
        assert_eq!(last_json(&json_out)["kv_cache"], want, "{flag:?}");
        let summary = stdout(&text_out);
        assert_eq!(summary.contains(" weights, int8 KV cache, stop:"), want == "int8", "{summary}");
    }
}

#[test]
fn a_broken_tokenizer_needed_for_a_prompt_is_an_error_naming_it() {
    let dir = fixture_with_broken_tokenizer();
    let out = decode(&["--checkpoint", dir.path().to_str().unwrap(), "--prompt", "hello", "--json"], &[]);
    let message = expect_error(&out, "checkpoint_invalid");
    assert!(message.contains("tokenizer.json"), "{message}");
}

/// A copy of the small fixture beside the Qwen3 tokenizer (its ids below
/// 1000 decode to text) and the prompt and greedy ids the reference gave.
fn fixture_with_tokenizer() -> (tempfile::TempDir, Vec<u32>, Vec<u32>) {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), tmp.path().join(f)).unwrap();
    }
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tokenizer/tokenizer.json");
    std::fs::copy(tokenizer, tmp.path().join("tokenizer.json")).unwrap();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| expected[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (tmp, ids("prompt_ids"), ids("generated_ids"))
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let (dir, prompt, want) = fixture_with_tokenizer();
    let tokenizer = qwen3_wgpu::Tokenizer::from_checkpoint(dir.path()).unwrap();
    let full = tokenizer.decode(&want).unwrap();
    // Three characters from the middle of the reference's text.
    let start = full.char_indices().nth(full.chars().count() / 2).unwrap().0;
    let stop: String = full[start..].chars().take(3).collect();
    let before = &full[..full.find(&stop).unwrap()];
    let prompt = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let ckpt = dir.path().to_str().unwrap();
    let args = [
        "--checkpoint",
        ckpt,
        "--prompt-ids",
        &prompt,
        "--max-new-tokens",
        "32",
        "--backend",
        "portable",
        "--no-cache",
    ];
    let with_stops = [&args[..], &["--stop", "never here", "--stop", &stop]].concat();
    let out = decode(&[&with_stops[..], &["--json"]].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let result = last_json(&out);
    assert_eq!(result["stop_reason"], "stop_string", "{result}");
    assert_eq!(result["stop_index"], 1, "{result}");
    assert_eq!(result["text"], before, "{result}");
    let n = result["generated_ids"].as_array().unwrap().len();
    assert!(n < want.len(), "{result}");
    assert_eq!(result["generated_ids"], serde_json::json!(want[..n]), "{result}");
    // The printed text ends before the stop string too.
    let out = decode(&with_stops, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).starts_with(&format!("{before}\nprompt ids:")), "{}", stdout(&out));
    assert!(stdout(&out).contains("stop: stop_string"), "{}", stdout(&out));
    // Without stop strings: no "text", the budget ends it.
    let result = last_json(&decode(&[&args[..], &["--json"]].concat(), &[]));
    assert_eq!(result["stop_reason"], "max_new_tokens", "{result}");
    assert!(result.get("text").is_none(), "{result}");
    // An empty stop string is refused, naming the flag.
    let message =
        expect_error(&decode(&[&args[..], &["--stop", "", "--json"]].concat(), &[]), "invalid_argument");
    assert!(message.contains("--stop"), "{message}");
}

fn qwen3_tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tokenizer")
}

/// `--print-prompt --chat` prints the rendered user turn, byte for byte
/// Qwen3's template, from tokenizer_config.json alone (the directory has no
/// weights or config.json: nothing else is read).
#[test]
fn print_prompt_with_chat_prints_the_rendered_turn_without_weights() {
    let dir = qwen3_tokenizer_dir();
    let ckpt = dir.to_str().unwrap();
    let want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let out = decode(&["--checkpoint", ckpt, "--print-prompt", "--chat", "--prompt", "hi"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), want);
    let out = decode(&["--checkpoint", ckpt, "--print-prompt", "--chat", "--prompt", "hi", "--json"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(last_json(&out), serde_json::json!({ "prompt": want }));
    // --no-think: Qwen3's empty thinking block opens the reply.
    let out =
        decode(&["--checkpoint", ckpt, "--print-prompt", "--chat", "--no-think", "--prompt", "hi"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{want}<think>\n\n</think>\n\n"));
    // Without --chat the prompt is the text itself.
    let out = decode(&["--checkpoint", ckpt, "--print-prompt", "--prompt", "hi <|im_end|>", "--json"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(last_json(&out), serde_json::json!({ "prompt": "hi <|im_end|>" }));
}

#[test]
fn chat_needs_text_and_a_template() {
    let message = expect_error(&decode(&["--chat", "--prompt-ids", "1", "--json"], &[]), "invalid_argument");
    assert!(message.contains("--chat"), "{message}");
    let message = expect_error(&decode(&["--no-think", "--prompt", "hi", "--json"], &[]), "invalid_argument");
    assert!(message.contains("--no-think") && message.contains("--chat"), "{message}");
    for flag in ["--chat", "--print-prompt"] {
        let message = expect_error(&decode(&[flag, "--json"], &[]), "invalid_argument");
        assert!(message.contains(flag) && message.contains("--prompt"), "{message}");
    }
    // A checkpoint without tokenizer_config.json has no template.
    let fixture = fixture();
    let args =
        ["--checkpoint", fixture.to_str().unwrap(), "--chat", "--prompt", "hi", "--print-prompt", "--json"];
    let message = expect_error(&decode(&args, &[]), "checkpoint_not_found");
    assert!(message.contains("tokenizer_config.json"), "{message}");
}

/// A small random model with Qwen3's vocabulary (so every Qwen3 token id
/// is valid), beside the Qwen3 tokenizer and chat template.
fn small_chat_checkpoint() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = qwen3_wgpu::ModelConfig::qwen3_0_6b_base();
    cfg.hidden_size = 128;
    cfg.intermediate_size = 256;
    cfg.num_hidden_layers = 1;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
    qwen3_wgpu::internals::testing::write_random_checkpoint(tmp.path(), &cfg, 3).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(qwen3_tokenizer_dir().join(f), tmp.path().join(f)).unwrap();
    }
    tmp
}

/// `--chat` decodes from the rendered turn's ids (the template's control
/// tokens as single ids, the user text as text), with `<|im_end|>` as an
/// extra end-of-text id.
#[test]
fn chat_decodes_the_rendered_turn() {
    let dir = small_chat_checkpoint();
    let ckpt = dir.path().to_str().unwrap();
    let common = ["--checkpoint", ckpt, "--backend", "portable", "--no-cache", "--max-new-tokens", "2"];
    let prompt = "hi <|im_end|>";
    let out = decode(&[&common[..], &["--chat", "--prompt", prompt, "--json"]].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let result = last_json(&out);
    let tokenizer = qwen3_wgpu::Tokenizer::from_checkpoint(dir.path()).unwrap();
    let template = qwen3_wgpu::ChatTemplate::from_checkpoint(dir.path()).unwrap();
    let want = template
        .encode(&tokenizer, &[qwen3_wgpu::Message::user(prompt)], &qwen3_wgpu::ChatOptions::default())
        .unwrap();
    let n = want.len();
    assert_eq!(result["n_prompt"], n, "{result}");
    assert_eq!(result["token_ids"].as_array().unwrap()[..n], serde_json::json!(want).as_array().unwrap()[..]);
    // The user's "<|im_end|>" is text: the prompt holds the control token
    // once (the template's own), not twice.
    let im_end = tokenizer.token_id("<|im_end|>").unwrap();
    assert_eq!(want.iter().filter(|&&id| id == im_end).count(), 1);
    // Without --json the rendered prompt is echoed before the reply.
    let out = decode(&[&common[..], &["--chat", "--prompt", "hi"]].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
}

/// Two lines piped into the chat example, on a small random model with
/// Qwen3's vocabulary and tokenizer: two replies, each with its count
/// line, and a clean exit at the end of input.
#[test]
fn chat_answers_each_line_and_ends_at_eof() {
    use std::io::Write;
    let tmp = small_chat_checkpoint();
    let mut cmd = Command::new(chat_bin());
    for var in SETTINGS.iter().chain(&["RUST_LOG"]) {
        cmd.env_remove(var);
    }
    let mut child = cmd
        .args(["--checkpoint", tmp.path().to_str().unwrap(), "--backend", "portable"])
        .args(["--system", "Be brief.", "--max-new-tokens", "3", "--no-think"])
        .env("XDG_CACHE_HOME", tmp.path().join("cache"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the chat example");
    child.stdin.take().unwrap().write_all(b"hello\nand again\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("error"), "{}", stderr(&out));
    // "[n tokens, t tok/s; prompt p tokens, f fed, ms]" after each reply.
    let text = stdout(&out);
    let counts: Vec<(usize, usize)> = text
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("tok/s; prompt ")?;
            let (prompt, rest) = rest.split_once(" tokens, ")?;
            let (fed, _) = rest.split_once(" fed")?;
            Some((prompt.parse().ok()?, fed.parse().ok()?))
        })
        .collect();
    assert_eq!(counts.len(), 2, "{text}");
    // The first turn feeds its whole prompt; the second only what the
    // session lacks: its KV cache keeps the first prompt, all but the empty
    // thinking block (`<think>`, `\n\n`, `</think>`, `\n\n`) that Qwen3's
    // template drops from earlier replies, where the session is rewound.
    assert_eq!(counts[0].0, counts[0].1, "{text}");
    let reused = counts[1].0 - counts[1].1;
    assert!(reused >= counts[0].0 - 4 && reused < counts[0].0, "{text}");
}

/// Sampling from the command line: `--temperature 0.8 --seed 7` twice gives
/// the same tokens, seeds 7 and 8 differ, `--temperature 0` is greedy, and
/// the JSON says which parameters were used; bad values name their flag.
#[test]
fn sampling_flags_are_reproducible_and_reported() {
    let fixture = fixture();
    let run = |extra: &[&str]| -> Value {
        let mut args = vec![
            "--checkpoint",
            fixture.to_str().unwrap(),
            "--prompt-ids",
            "851,720,591,221",
            "--max-new-tokens",
            "12",
            "--backend",
            "portable",
            "--no-cache",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = decode(&args, &[]);
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        last_json(&out)
    };
    let ids = |v: &Value| v["generated_ids"].clone();
    let seven = run(&["--temperature", "0.8", "--seed", "7"]);
    assert_eq!(ids(&seven), ids(&run(&["--temperature", "0.8", "--seed", "7"])));
    assert_ne!(ids(&seven), ids(&run(&["--temperature", "0.8", "--seed", "8"])));
    let greedy = run(&[]);
    assert_eq!(ids(&run(&["--temperature", "0", "--seed", "7"])), ids(&greedy));
    assert_eq!(seven["sampling"]["temperature"].as_f64(), Some(0.800000011920929), "{seven}");
    assert_eq!(seven["sampling"]["seed"], 7);
    assert_eq!(greedy["sampling"]["greedy"], true);
    let all = run(&[
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--min-p",
        "0.05",
        "--repeat-penalty",
        "1.1",
        "--presence-penalty",
        "0.2",
        "--frequency-penalty",
        "0.1",
        "--penalty-window",
        "32",
        "--seed",
        "1",
    ]);
    assert_eq!(all["sampling"]["top_k"], 20, "{all}");
    assert_eq!(all["sampling"]["penalty_window"], 32, "{all}");
    // The checkpoint has no generation_config.json: the defaults (greedy).
    assert_eq!(ids(&run(&["--generation-config"])), ids(&greedy));
    for (flag, value) in
        [("--temperature", "-1"), ("--top-p", "0"), ("--min-p", "2"), ("--repeat-penalty", "0")]
    {
        let args = ["--checkpoint", fixture.to_str().unwrap(), "--prompt-ids", "1", flag, value, "--json"];
        let message = expect_error(&decode(&args, &[]), "invalid_argument");
        assert!(message.contains(flag), "{flag}: {message}");
    }
}

/// A missing checkpoint is `checkpoint_not_found`, and stderr says where
/// to get one.
#[test]
fn a_missing_checkpoint_says_where_to_get_one() {
    let out = decode(
        &["--checkpoint", "/nonexistent/qwen3", "--prompt-ids", "1", "--backend", "portable", "--json"],
        &[],
    );
    expect_error(&out, "checkpoint_not_found");
    assert!(stderr(&out).contains("hf download Qwen/Qwen3-0.6B-Base"), "{}", stderr(&out));
}

/// A checkpoint without tokenizer.json asked for text: the hint is
/// `--prompt-ids`, not a download of another checkpoint.
#[test]
fn a_checkpoint_without_a_tokenizer_points_to_prompt_ids() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    let args = [
        "--checkpoint",
        dir.path().to_str().unwrap(),
        "--prompt",
        "hello",
        "--backend",
        "portable",
        "--json",
    ];
    let out = decode(&args, &[]);
    let message = expect_error(&out, "checkpoint_not_found");
    assert!(message.contains("tokenizer.json"), "{message}");
    let err = stderr(&out);
    assert!(err.contains("--prompt-ids") && !err.contains("hf download"), "{err}");
}

/// `--logprobs N`: the JSON lists, per generated token, the token, its
/// log-probability and the N most likely; without the flag, no such key;
/// more than 20 is `invalid_argument` naming it.
#[test]
fn logprobs_flag_adds_them_to_the_json() {
    let fixture = fixture();
    let base = [
        "--checkpoint",
        fixture.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
        "--backend",
        "portable",
        "--no-cache",
        "--json",
    ];
    let sampled = ["--logprobs", "3", "--temperature", "0.8", "--seed", "7"];
    let out = decode(&[&base[..], &sampled[..]].concat(), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = last_json(&out);
    let per_token = json["logprobs"].as_array().expect("logprobs");
    let ids = json["generated_ids"].as_array().unwrap();
    assert_eq!(per_token.len(), ids.len(), "{json}");
    for (lp, id) in per_token.iter().zip(ids) {
        assert_eq!(&lp["token"], id, "{json}");
        assert_eq!(lp["top"].as_array().unwrap().len(), 3, "{json}");
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0, "{json}");
    }
    assert!(last_json(&decode(&base, &[])).get("logprobs").is_none());
    let message =
        expect_error(&decode(&[&base[..], &["--logprobs", "21"]].concat(), &[]), "invalid_argument");
    assert!(message.contains("logprobs"), "{message}");
}

/// `--regex`, `--json-schema` and `--grammar` constrain the output: the
/// JSON's `"text"` matches and `"stop_reason"` is `constraint_complete`;
/// two at once, a schema that is not JSON and a grammar that does not
/// compile are `invalid_argument` naming them.
#[test]
fn constraint_flags_constrain_the_output() {
    let (dir, _, _) = fixture_with_tokenizer();
    let ckpt = dir.path().to_str().unwrap();
    let common =
        ["--checkpoint", ckpt, "--prompt-ids", "1,2,3", "--backend", "portable", "--no-cache", "--json"];
    let run = |extra: &[&str]| decode(&[&common[..], &["--max-new-tokens", "40"], extra].concat(), &[]);
    let out = run(&["--regex", "(yes|no), [0-9]{2}!"]);
    let json = last_json(&out);
    assert_eq!(json["stop_reason"], "constraint_complete", "{json}");
    assert_eq!(json["constraint_complete"], true, "{json}");
    let text = json["text"].as_str().unwrap();
    assert!(text.starts_with("yes, ") || text.starts_with("no, "), "{text:?}");
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, r#"{"type": "object", "properties": {"hp": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["hp"], "additionalProperties": false}"#).unwrap();
    let json = last_json(&run(&["--json-schema", schema.to_str().unwrap()]));
    let value: Value = serde_json::from_str(json["text"].as_str().unwrap()).unwrap();
    assert!(value["hp"].as_u64().is_some_and(|hp| hp <= 99), "{json}");
    let grammar = dir.path().join("moves.lark");
    std::fs::write(&grammar, "start: \"go \" DIR\nDIR: \"north\" | \"south\"\n").unwrap();
    let json = last_json(&run(&["--grammar", grammar.to_str().unwrap()]));
    assert!(["go north", "go south"].contains(&json["text"].as_str().unwrap()), "{json}");
    // A budget too small: incomplete.
    let json =
        last_json(&decode(&[&common[..], &["--max-new-tokens", "1", "--regex", "a{20}"]].concat(), &[]));
    assert_eq!(
        (json["stop_reason"].as_str(), json["constraint_complete"].as_bool()),
        (Some("max_new_tokens"), Some(false))
    );

    let message =
        expect_error(&run(&["--regex", "a", "--grammar", grammar.to_str().unwrap()]), "invalid_argument");
    assert!(message.contains("cannot be used with"), "{message}");
    std::fs::write(&schema, "{not json").unwrap();
    let message = expect_error(&run(&["--json-schema", schema.to_str().unwrap()]), "invalid_argument");
    assert!(message.contains("--json-schema") && message.contains("not JSON"), "{message}");
    std::fs::write(&grammar, "start: undefined_rule\n").unwrap();
    let message = expect_error(&run(&["--grammar", grammar.to_str().unwrap()]), "invalid_argument");
    assert!(message.contains("grammar"), "{message}");
    let message = expect_error(&run(&["--regex", "(unclosed"]), "invalid_argument");
    assert!(message.contains("regex"), "{message}");
    // Constraint files go through the checked reader: a FIFO is refused
    // unread (a blocking open waited for a writer forever), a missing file
    // is named.
    #[cfg(unix)]
    {
        let fifo = dir.path().join("schema.fifo");
        let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let message = expect_error(&run(&["--json-schema", fifo.to_str().unwrap()]), "invalid_argument");
        assert!(message.contains("--json-schema") && message.contains("not a regular file"), "{message}");
    }
    let message = expect_error(&run(&["--grammar", "/nonexistent/g.lark"]), "invalid_argument");
    assert!(message.contains("--grammar") && message.contains("no such file"), "{message}");
}

/// `--tools` with `--chat`: the tools are rendered into the prompt,
/// `--tool-choice NAME` makes the reply calls of that tool with valid
/// arguments, reported as `"tool_calls"`; misuse names the flag.
#[test]
fn tools_flag_renders_the_tools_and_reports_the_calls() {
    let tmp = small_chat_checkpoint();
    let ckpt = tmp.path().to_str().unwrap();
    let tools = tmp.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "give", "description": "Give gold.",
            "parameters": {"type": "object", "properties": {"gold": {"type": "integer", "minimum": 1, "maximum": 50}},
                           "required": ["gold"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "wave", "parameters": {"type": "object"}}}]"#,
    )
    .unwrap();
    let tools = tools.to_str().unwrap();
    let common =
        ["--checkpoint", ckpt, "--backend", "portable", "--no-cache", "--chat", "--prompt", "Pay me."];
    let prompt =
        last_json(&decode(&[&common[..], &["--tools", tools, "--print-prompt", "--json"]].concat(), &[]));
    let prompt = prompt["prompt"].as_str().unwrap();
    assert!(prompt.contains("<tools>") && prompt.contains("\"name\": \"give\""), "{prompt}");

    let run = |extra: &[&str]| decode(&[&common[..], &["--tools", tools, "--json"], extra].concat(), &[]);
    let json = last_json(&run(&["--tool-choice", "give", "--max-new-tokens", "40"]));
    let calls = json["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{json}");
    for call in calls {
        assert_eq!(call["name"], "give", "{json}");
        let gold = call["arguments"]["gold"].as_u64().unwrap();
        assert!((1..=50).contains(&gold), "{json}");
    }
    // auto: a free reply, its calls (none from random weights, most likely) listed.
    let json = last_json(&run(&["--max-new-tokens", "2"]));
    assert!(json["tool_calls"].is_array(), "{json}");

    let message = expect_error(&run(&["--tool-choice", "fly", "--max-new-tokens", "2"]), "invalid_argument");
    assert!(message.contains("fly"), "{message}");
    let no_chat =
        ["--checkpoint", ckpt, "--backend", "portable", "--prompt", "x", "--tools", tools, "--json"];
    let message = expect_error(&decode(&no_chat, &[]), "invalid_argument");
    assert!(message.contains("--tools") && message.contains("--chat"), "{message}");
    let bad = tmp.path().join("bad_tools.json");
    std::fs::write(&bad, r#"[{"type": "function", "function": {"name": "ok"}}, {"function": {}}]"#).unwrap();
    let out = decode(&[&common[..], &["--tools", bad.to_str().unwrap(), "--json"]].concat(), &[]);
    let message = expect_error(&out, "invalid_argument");
    assert!(message.contains("--tools") && message.contains("entry 1"), "{message}");
}

/// The `tools` example on a random checkpoint: with `--tool-choice
/// required`, each turn's calls are the game's functions with valid
/// arguments, their results go back, and it ends at the end of input.
#[test]
fn tools_example_calls_the_game_functions() {
    let tmp = small_chat_checkpoint();
    let out = Command::new(crate::support::example_bin("tools"))
        .args(["--checkpoint", tmp.path().to_str().unwrap(), "--backend", "portable", "--no-cache"])
        .args(["--tool-choice", "required", "--max-new-tokens", "48"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(b"Pay me.\n")?;
            child.wait_with_output()
        })
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    let calls: Vec<&str> = text.lines().filter(|l| l.starts_with("call ")).collect();
    assert!(!calls.is_empty(), "{text}");
    for call in calls {
        let ok = call.starts_with("call give_gold({\"amount\":") && call.contains("-> {\"player_gold\":")
            || call.starts_with("call walk_to({\"place\":") && call.contains("-> {\"npc_at\":");
        assert!(ok, "{call}");
    }
}
