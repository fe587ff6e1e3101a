//! What the test modules share besides the kernel cases and the tiny
//! checkpoints: running one test alone in a child process of this test
//! binary (for the tests that change the process's environment: every
//! module shares one process, so a variable set on one test's thread would
//! reach the engines other tests build at the same time), and the examples'
//! binaries, built for this test binary's profile; and the engine the
//! tests that need none of their own share.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use qwen3_wgpu::{AdapterPolicy, Engine};

/// The process's default portable engine, built on first use: the tests
/// that need no engine of their own (no builder option, no variable of
/// their own, no device they break) share it, since each build compiles
/// and self-checks the kernel set (over a second on lavapipe).
pub fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| Engine::builder().policy(AdapterPolicy::Portable).build().expect("engine"))
}

/// The variable that marks the child process, holding the test it runs.
const ALONE_ENV: &str = "QWEN3_WGPU_TEST_ALONE";

/// Whether the calling test should run its body in this process. In the
/// parent it runs test `name` of module `module` (pass `module_path!()`)
/// alone in a child process, asserts that exactly that test ran there and
/// passed, and returns false; in that child it returns true.
pub fn alone_in_child(module: &str, name: &str) -> bool {
    // Test paths omit the crate's own name (`it::cache` is `cache`).
    let module = module.split_once("::").map_or("", |(_, rest)| rest);
    let test = if module.is_empty() { name.to_string() } else { format!("{module}::{name}") };
    if std::env::var(ALONE_ENV).as_deref() == Ok(test.as_str()) {
        return true;
    }
    let out = Command::new(std::env::current_exe().expect("test binary path"))
        .args([test.as_str(), "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(ALONE_ENV, &test)
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} in its own process:\n{stdout}\n{stderr}"
    );
    false
}

/// Example `name`'s binary, as `cargo test` built it beside this test
/// binary (`target/<profile dir>/examples/`, the same profile and
/// features). The tests never run cargo themselves: a build from inside a
/// test can relink this very binary (a changed environment is enough to
/// make a dependency's build script run again), after which the running
/// tests cannot start it as a child. A run filtered to this binary
/// (`cargo test --test it cli::`) builds no examples: after a change in
/// `src/`, `cargo build --examples` (with the same features) first.
pub fn example_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let bin = profile_dir.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} is missing: `cargo test` without target filters builds the examples (or `cargo build --examples`)",
        bin.display()
    );
    bin
}
