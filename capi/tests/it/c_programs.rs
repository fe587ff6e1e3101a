//! The C and C++ examples and a dlopen host, compiled with the system's
//! `cc`/`c++` under AddressSanitizer and UndefinedBehaviorSanitizer (leak
//! detection on), linked against this package's shared library (and once
//! against the static library), run on the portable adapter (lavapipe off
//! Apple), and compared token for token with the Rust API on the same
//! fixture checkpoint.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use qwen3_wgpu::{
    AdapterPolicy, CachePolicy, Engine, LoadOptions, LoadPhase, Model, SamplingParams, Tokenizer,
};

const PROMPT: [u32; 7] = [851, 720, 591, 221, 110, 800, 753];
const MAX_NEW: usize = 12;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn fixture() -> PathBuf {
    manifest_dir().join("../tests/fixtures/mlx/gqa2_hd64")
}

fn tokenizer_dir() -> PathBuf {
    manifest_dir().join("../tests/fixtures/qwen3-tokenizer")
}

/// Where cargo put this package's libraries for the tests: beside the test
/// binary, in `<target>/<profile>/deps`.
fn library_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().to_path_buf()
}

fn shared_library() -> PathBuf {
    let name = if cfg!(target_os = "macos") { "libqwen3wgpu.dylib" } else { "libqwen3wgpu.so" };
    let path = library_dir().join(name);
    assert!(path.exists(), "{} is missing (cargo builds it with the tests)", path.display());
    path
}

const SANITIZE: [&str; 3] = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"];

/// Compiles `sources` into `exe` with the sanitizers, warnings as errors
/// (on Linux with `tests/c/keep_vulkan_drivers_loaded.c`, which keeps
/// LeakSanitizer from reporting lavapipe's own allocation once the Vulkan
/// loader unloads it).
fn compile(compiler: &str, standard: &str, sources: &[PathBuf], exe: &Path, link: &[String]) {
    let keep = cfg!(target_os = "linux").then(|| manifest_dir().join("tests/c/keep_vulkan_drivers_loaded.c"));
    let out = Command::new(compiler)
        .arg(standard)
        .args(["-Wall", "-Wextra", "-Werror", "-O1"])
        .args(SANITIZE)
        .arg("-I")
        .arg(manifest_dir().join("include"))
        .args(sources)
        .args(keep)
        .arg("-o")
        .arg(exe)
        .args(link)
        .output()
        .unwrap_or_else(|e| panic!("{compiler}: {e}"));
    assert!(
        out.status.success(),
        "{compiler} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn link_shared() -> Vec<String> {
    let dir = library_dir();
    vec![format!("-L{}", dir.display()), "-lqwen3wgpu".into(), format!("-Wl,-rpath,{}", dir.display())]
}

/// Where Mesa keeps the shaders its Vulkan drivers compiled, for this
/// process: the programs below get a private XDG_CACHE_HOME (for the
/// engine's weights cache), and without this they would compile every
/// kernel again under the sanitizers.
fn mesa_shader_cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("MESA_SHADER_CACHE_DIR") {
        return dir.into();
    }
    match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) => PathBuf::from(dir).join("mesa_shader_cache"),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/mesa_shader_cache"),
    }
}

/// Runs a compiled program on the portable adapter with leak detection on;
/// returns its stdout. The weights cache goes to a private directory; the
/// Vulkan driver's shader cache is this process's.
fn run(exe: &Path, args: &[String]) -> String {
    let scratch = tempfile::tempdir().unwrap();
    let out = Command::new(exe)
        .args(args)
        .env("XDG_RUNTIME_DIR", scratch.path())
        .env("XDG_CACHE_HOME", scratch.path().join("cache"))
        .env("MESA_SHADER_CACHE_DIR", mesa_shader_cache())
        .env("QWEN3_WGPU_BACKEND", "portable")
        // LeakSanitizer exists on Linux only (Apple's ASan refuses the option).
        .env("ASAN_OPTIONS", if cfg!(target_os = "linux") { "detect_leaks=1" } else { "detect_leaks=0" })
        .env("LSAN_OPTIONS", format!("suppressions={}", manifest_dir().join("tests/lsan.supp").display()))
        .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn model() -> Model {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    engine.load(fixture(), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap()
}

/// What the examples print, from the Rust API: `generate` (which stops at
/// an end-of-text id, as the examples do) and the tokenizer's decode.
fn expected_example_output() -> String {
    let out = model().generate(&PROMPT, MAX_NEW, |_| {}).unwrap();
    let text = Tokenizer::from_checkpoint(&tokenizer_dir()).unwrap().decode(out.generated_ids()).unwrap();
    let ids = |ids: &[u32]| ids.iter().map(|id| format!(" {id}")).collect::<String>();
    format!("prompt:{}\ntext: {text}\ntokens:{}\n", ids(&PROMPT), ids(out.generated_ids()))
}

fn example_args() -> Vec<String> {
    let mut args =
        vec![fixture().display().to_string(), tokenizer_dir().display().to_string(), MAX_NEW.to_string()];
    args.extend(PROMPT.iter().map(u32::to_string));
    args
}

#[test]
fn c_example_against_the_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("greedy");
    let _ = shared_library();
    compile("cc", "-std=c11", &[manifest_dir().join("examples/c/greedy.c")], &exe, &link_shared());
    assert_eq!(run(&exe, &example_args()), expected_example_output());
}

#[test]
fn cpp_example_against_the_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("greedy_cpp");
    let _ = shared_library();
    compile("c++", "-std=c++17", &[manifest_dir().join("examples/cpp/greedy.cpp")], &exe, &link_shared());
    assert_eq!(run(&exe, &example_args()), expected_example_output());
}

/// The system libraries the static library needs (what `rustc --print
/// native-static-libs` lists for it).
fn native_static_libs() -> Vec<String> {
    let libs: &[&str] = if cfg!(target_os = "macos") {
        &[
            "-framework",
            "Metal",
            "-framework",
            "QuartzCore",
            "-framework",
            "CoreGraphics",
            "-framework",
            "Foundation",
            "-lobjc",
            "-liconv",
            "-lc",
            "-lm",
        ]
    } else {
        &["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"]
    };
    libs.iter().map(|s| s.to_string()).collect()
}

#[test]
fn c_example_against_the_static_library() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("greedy_static");
    let archive = library_dir().join("libqwen3wgpu.a");
    assert!(archive.exists(), "{} is missing (cargo builds it with the tests)", archive.display());
    let mut link = vec![archive.display().to_string()];
    link.extend(native_static_libs());
    compile("cc", "-std=c11", &[manifest_dir().join("examples/c/greedy.c")], &exe, &link);
    assert_eq!(run(&exe, &example_args()), expected_example_output());
}

/// A plugin host: dlopen, dlsym, error paths from C,
/// then greedy decoding, token for token the Rust session's.
#[test]
fn dlopen_plugin_host() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("plugin_host");
    let link = if cfg!(target_os = "linux") { vec!["-ldl".to_string()] } else { vec![] };
    compile("cc", "-std=gnu11", &[manifest_dir().join("tests/c/plugin_host.c")], &exe, &link);
    let mut args =
        vec![shared_library().display().to_string(), fixture().display().to_string(), MAX_NEW.to_string()];
    args.extend(PROMPT.iter().map(u32::to_string));

    let model = model();
    let mut session = model.session().unwrap();
    let mut expected = vec![session.feed(&PROMPT).unwrap()];
    while expected.len() < MAX_NEW {
        expected.push(session.next_token().unwrap());
    }
    let expected: String = expected.iter().map(|id| format!(" {id}")).collect();
    assert_eq!(run(&exe, &args), format!("tokens:{expected}\n"));
}

/// Phases a load reports (each once, in order) when its callback cancels
/// at `cancel_at`; the load's result; the entries left in the cache
/// directory.
fn rust_load_phases(
    cache: &Path,
    cancel_at: Option<LoadPhase>,
) -> (Vec<&'static str>, qwen3_wgpu::Result<Model>, usize) {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let phases = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let seen = phases.clone();
    let options = LoadOptions { cache: CachePolicy::Dir(cache.to_path_buf()), ..Default::default() }
        .on_progress(move |p| {
            let mut seen = seen.lock().unwrap();
            if seen.last() != Some(&p.phase.as_str()) {
                seen.push(p.phase.as_str());
            }
            match Some(p.phase) == cancel_at {
                true => ControlFlow::Break(()),
                false => ControlFlow::Continue(()),
            }
        });
    let result = engine.load(fixture(), &options);
    let entries = std::fs::read_dir(cache).map_or(0, |d| d.count());
    let phases = phases.lock().unwrap().clone();
    (phases, result, entries)
}

/// What `examples/c/sessions.c` prints, from the Rust API.
fn expected_sessions_output() -> String {
    let ids = |ids: &[u32]| ids.iter().map(|id| format!(" {id}")).collect::<String>();
    let scratch = tempfile::tempdir().unwrap();
    let cache = scratch.path().join("cache");
    let (phases, cancelled, entries) = rust_load_phases(&cache, Some(LoadPhase::Converting));
    let cancelled = cancelled.err().expect("the load is cancelled");
    let mut out =
        format!("cancelled: {}; phases: {}; cache entries: {entries}\n", cancelled.code(), phases.join(" "));
    let (phases, model, entries) = rust_load_phases(&cache, None);
    let model = model.unwrap();
    out += &format!("loaded; phases: {}; cache entries: {entries}\n", phases.join(" "));

    let decode = |params: Option<&SamplingParams>| {
        let mut session = model.session_with_capacity(PROMPT.len() + MAX_NEW).unwrap();
        if let Some(params) = params {
            session.set_sampling(params).unwrap();
        }
        let mut tokens = vec![session.feed(&PROMPT).unwrap()];
        while tokens.len() < MAX_NEW {
            tokens.push(session.next_token().unwrap());
        }
        tokens
    };
    let greedy = decode(None);
    out += &format!("feed: {} ({} of {} positions)\n", greedy[0], PROMPT.len(), PROMPT.len());
    for label in ["greedy", "fork", "restored"] {
        out += &format!("{label}:{}\n", ids(&greedy));
    }
    let params = SamplingParams::default().temperature(0.8).top_k(40).top_p(0.95).seed(7);
    let sampled = decode(Some(&params));
    assert_ne!(sampled, greedy, "sampling at temperature 0.8 picks other tokens than greedy here");
    for _ in 0..2 {
        out += &format!("sampled (seed 7):{}\n", ids(&sampled));
    }
    out
}

/// The C example of the session features (a load cancelled from its
/// progress callback leaving no cache file, the non-blocking feed, a fork,
/// save and restore, seeded sampling twice) prints what the Rust API gives.
#[test]
fn c_sessions_example_against_the_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("sessions");
    let _ = shared_library();
    compile("cc", "-std=c11", &[manifest_dir().join("examples/c/sessions.c")], &exe, &link_shared());
    let scratch = tempfile::tempdir().unwrap();
    let mut args =
        vec![fixture().display().to_string(), scratch.path().display().to_string(), MAX_NEW.to_string()];
    args.extend(PROMPT.iter().map(u32::to_string));
    let printed = run(&exe, &args);
    let expected = expected_sessions_output();
    assert!(
        expected.starts_with("cancelled: cancelled; phases: hashing converting; cache entries: 0\n"),
        "{expected}"
    );
    assert_eq!(printed, expected);
    assert!(scratch.path().join("session.q3s").is_file());
}

/// The C API guide's example (`examples/c/chat.c`) builds warning-free under
/// the sanitizers, and on a checkpoint that is not there it reports the
/// status and message and frees everything it made (LeakSanitizer on).
/// (A successful turn needs a checkpoint with the tokenizer's whole
/// vocabulary, too slow on lavapipe for the test command.)
#[test]
fn readme_chat_example_reports_a_missing_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("chat");
    let _ = shared_library();
    compile("cc", "-std=c11", &[manifest_dir().join("examples/c/chat.c")], &exe, &link_shared());
    let missing = dir.path().join("no-such-checkpoint");
    let out = Command::new(&exe)
        .arg(&missing)
        .arg("Can you fix my sword?")
        .env("XDG_RUNTIME_DIR", dir.path())
        .env("XDG_CACHE_HOME", dir.path().join("cache"))
        .env("MESA_SHADER_CACHE_DIR", mesa_shader_cache())
        .env("QWEN3_WGPU_BACKEND", "portable")
        .env("ASAN_OPTIONS", if cfg!(target_os = "linux") { "detect_leaks=1" } else { "detect_leaks=0" })
        .env("LSAN_OPTIONS", format!("suppressions={}", manifest_dir().join("tests/lsan.supp").display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("error [checkpoint_not_found]") && stderr.contains("no-such-checkpoint"),
        "{stderr}"
    );
    assert!(!stderr.contains("Sanitizer"), "{stderr}");
}

/// What `examples/c/batch.c` prints, from the Rust API: each prompt's
/// greedy tokens in a session of its own (the batch's must be the same),
/// and the log-probabilities of the first prompt's second token.
fn expected_batch_output(prompts: &[Vec<u32>], max_new: usize) -> String {
    let ids = |ids: &[u32]| ids.iter().map(|id| format!(" {id}")).collect::<String>();
    let model = model();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|prompt| {
            let mut session = model.session().unwrap();
            let mut tokens = vec![session.feed(prompt).unwrap()];
            while tokens.len() < max_new {
                tokens.push(session.next_token().unwrap());
            }
            tokens
        })
        .collect();
    let mut out = format!("free slots: 0 of {}\n", prompts.len());
    for label in ["alone", "batch"] {
        for (i, tokens) in alone.iter().enumerate() {
            out += &format!("{label} {i}:{}\n", ids(tokens));
        }
    }
    out += "batch: same tokens as alone\n";
    let mut session = model.session().unwrap();
    session.set_logprobs(5).unwrap();
    session.feed(&prompts[0]).unwrap();
    let token = session.next_token().unwrap();
    let lp = session.last_logprobs().unwrap();
    assert_eq!(lp.token, token);
    let top: Vec<u32> = lp.top.iter().map(|&(id, _)| id).collect();
    out += &format!("logprobs: {} of {token} (top:{})\n", top.len(), ids(&top));
    out += "logprobs: finite, sorted, <= 0, the chosen token first\n";
    out += &format!("logprobs into 2 entries: 2 written of {}\n", top.len());
    out += "batch step of a session reporting logprobs: invalid_argument\n";
    out
}

/// The C example of batches and log-probabilities: three conversations
/// stepped as a batch (blocking, then a non-blocking loop) give each one's
/// tokens alone, and the log-probabilities of a greedy step are finite,
/// sorted, <= 0, led by the chosen token and written only up to the
/// caller's capacity; all as the Rust API gives them.
#[test]
fn c_batch_example_against_the_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("batch");
    let _ = shared_library();
    compile("cc", "-std=c11", &[manifest_dir().join("examples/c/batch.c")], &exe, &link_shared());
    let prompts = vec![PROMPT.to_vec(), vec![17, 404], PROMPT[2..].iter().rev().copied().collect()];
    let mut args = vec![fixture().display().to_string(), MAX_NEW.to_string()];
    args.extend(prompts.iter().map(|p| p.iter().map(u32::to_string).collect::<Vec<_>>().join(",")));
    let printed = run(&exe, &args);
    assert_eq!(printed, expected_batch_output(&prompts, MAX_NEW));
}

/// A C host restoring session files it did not write (a header claiming
/// 8 TiB a layer in 100 bytes, 4,000 positions in 100 bytes, a FIFO, a
/// link to /dev/zero, a truncated save, a missing file) under the
/// sanitizers: each is a status naming the file with the output session
/// NULL, the intact save restores, and nothing aborts, hangs or leaks.
#[cfg(unix)]
#[test]
fn c_host_restoring_crafted_session_files_gets_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("restore_crafted");
    let _ = shared_library();
    compile("cc", "-std=c11", &[manifest_dir().join("tests/c/restore_crafted.c")], &exe, &link_shared());
    let scratch = tempfile::tempdir().unwrap();
    let printed = run(&exe, &[fixture().display().to_string(), scratch.path().display().to_string()]);
    assert_eq!(
        printed,
        "huge_layer.q3s: session_file_invalid\n\
         short.q3s: session_file_invalid\n\
         fifo.q3s: session_file_invalid\n\
         zero.q3s: session_file_invalid\n\
         truncated.q3s: session_file_invalid\n\
         saved.q3s: ok\n\
         missing.q3s: session_io\n"
    );
}

/// A C host constraining a session (regex, JSON schema, Lark grammar)
/// under the sanitizers: refused constraints are statuses, and each reply
/// is the one the Rust API gives under the same constraint.
#[cfg(unix)]
#[test]
fn c_host_constraining_a_session() {
    use qwen3_wgpu::Constraint;
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("constrained");
    let _ = shared_library();
    compile("cc", "-std=c11", &[manifest_dir().join("tests/c/constrained.c")], &exe, &link_shared());
    let printed = run(&exe, &[fixture().display().to_string(), tokenizer_dir().display().to_string()]);
    // The same replies through the Rust API.
    let model = model();
    let tokenizer = Tokenizer::from_checkpoint(&tokenizer_dir()).unwrap();
    let mut session = model.session().unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {"hp": {"type": "integer", "minimum": 0,
        "maximum": 99}}, "required": ["hp"], "additionalProperties": false});
    let constraints = [
        ("regex", Constraint::regex(&tokenizer, "(yes|no), [0-9]{2}!").unwrap()),
        ("json_schema", Constraint::json_schema(&tokenizer, &schema).unwrap()),
        ("grammar", Constraint::lark(&tokenizer, "start: \"go \" DIR\nDIR: \"north\" | \"south\"").unwrap()),
    ];
    let tools = serde_json::json!([{"type": "function", "function": {"name": "give", "parameters": {"type": "object",
        "properties": {"gold": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["gold"],
        "additionalProperties": false}}}]);
    let tools =
        Constraint::tool_calls(&tokenizer, tools.as_array().unwrap(), &qwen3_wgpu::ToolChoice::Required, 1)
            .unwrap();
    let mut want = String::from(
        "bad regex: invalid_argument\nbad schema: invalid_argument\nnull grammar: invalid_argument\n",
    );
    for (kind, constraint) in &constraints {
        session.set_constraint(Some(constraint)).unwrap();
        session.truncate(0).unwrap();
        let mut ids = vec![session.feed(&[1, 2, 3]).unwrap()];
        while !session.constraint_complete() {
            ids.push(session.next_token().unwrap());
        }
        want.push_str(&format!("{kind}: {}\n", tokenizer.decode(&ids).unwrap()));
    }
    want.push_str("bad tools: invalid_argument\nbad max_calls: invalid_argument\n");
    session.set_constraint(Some(&tools)).unwrap();
    session.truncate(0).unwrap();
    let mut ids = vec![session.feed(&[1, 2, 3]).unwrap()];
    while !session.constraint_complete() {
        ids.push(session.next_token().unwrap());
    }
    let text = tokenizer.decode(&ids).unwrap();
    let parsed = qwen3_wgpu::parse_tool_calls(&text);
    assert!(parsed.calls.len() == 1 && parsed.calls[0].name == "give" && !parsed.incomplete, "{text:?}");
    let calls: Vec<serde_json::Value> =
        parsed.calls.iter().map(|c| serde_json::json!({"name": c.name, "arguments": c.arguments})).collect();
    let json =
        serde_json::json!({"content": parsed.content, "calls": calls, "incomplete": parsed.incomplete});
    want.push_str(&format!("tools: {text}\ncalls: {json}\n"));
    want.push_str("cleared: free\n");
    assert_eq!(printed, want);
}
