//! What the test modules share besides the kernel cases and the tiny
//! checkpoints: running one test alone in a child process of this test
//! binary (for the tests that change the process's environment: every
//! module shares one process, so a variable set on one test's thread would
//! reach the engines other tests build at the same time), and the examples'
//! binaries, built for this test binary's profile.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

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

/// Example `name`'s binary, built from this tree for this test binary's
/// profile and features. `cargo test --test it` builds no examples, and one
/// left over from an earlier build may be stale, so this asks cargo itself,
/// once per process, in the target directory and profile this binary was
/// built in (`target/<profile dir>/deps/it-<hash>`). It asks for what the
/// test command builds, `cargo test --workspace --no-run` (every example
/// with the tests): a build of the example alone resolves the dependencies'
/// features differently (without the other packages' dev-dependencies) and
/// would build them all a second time.
pub fn example_bin(name: &str) -> PathBuf {
    static BUILT: Mutex<bool> = Mutex::new(false);
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let bin = profile_dir.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !*built {
        let target_dir = profile_dir.parent().expect("target dir");
        // `cargo test`'s own profile builds into target/debug.
        let profile: &[&str] = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => &[],
            Some(name) => &["--profile", name],
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let out = Command::new(cargo)
            .args(["test", "--no-run", "--quiet", "--workspace"])
            .args(profile)
            .arg("--manifest-path")
            .arg(&manifest)
            .args(if cfg!(feature = "hub") { &["--features", "qwen3-wgpu/hub"][..] } else { &[] })
            .arg("--target-dir")
            .arg(target_dir)
            .output()
            .expect("run cargo");
        assert!(
            out.status.success(),
            "building the examples failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        *built = true;
    }
    assert!(bin.is_file(), "{} missing after the build", bin.display());
    bin
}
