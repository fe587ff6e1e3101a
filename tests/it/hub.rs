//! `hub::resolve` against a Hugging Face cache laid out on disk as
//! `huggingface_hub` lays it out (refs, snapshots of links into blobs),
//! holding a fixture checkpoint: offline by option and by `HF_HUB_OFFLINE`,
//! with the network unreachable, by branch, tag and commit, and the errors
//! (not cached, a broken cache, a malformed id).

use std::path::{Path, PathBuf};

use qwen3_wgpu::hub::{repo_folder, resolve, HubOptions};
use qwen3_wgpu::internals::load::load_model;
use qwen3_wgpu::{CachePolicy, ChatTemplate, ShapeProfile, Tokenizer};

const MODEL: &str = "Qwen/Qwen3-0.6B-Base";
const COMMIT: &str = "9ab1d5a3c0de2f0e4b6c7d8e9f00112233445566";

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Lays `MODEL` out in the hub cache `hub`: each file a blob, linked from
/// `snapshots/COMMIT/` (copied where links are not available), and
/// `refs/main` and `refs/v1.0` naming the commit. Returns the snapshot.
fn lay_out_cache(hub: &Path) -> PathBuf {
    let repo = repo_folder(hub, MODEL);
    let snapshot = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    let fixture = manifest().join("tests/fixtures/mlx/gqa2_hd64");
    let tokenizer = manifest().join("tests/fixtures/qwen3-tokenizer");
    let files = [
        (fixture.join("config.json"), "config.json"),
        (fixture.join("model.safetensors"), "model.safetensors"),
        (tokenizer.join("tokenizer.json"), "tokenizer.json"),
        (tokenizer.join("tokenizer_config.json"), "tokenizer_config.json"),
    ];
    for (i, (source, name)) in files.iter().enumerate() {
        let blob = repo.join("blobs").join(format!("{i:064x}"));
        std::fs::copy(source, &blob).unwrap();
        link(&blob, &snapshot.join(name));
    }
    std::fs::write(snapshot.join("generation_config.json"), r#"{"eos_token_id": 2}"#).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    std::fs::write(repo.join("refs/v1.0"), format!("{COMMIT}\n")).unwrap();
    snapshot
}

#[cfg(unix)]
fn link(blob: &Path, at: &Path) {
    std::os::unix::fs::symlink(blob, at).unwrap();
}

#[cfg(not(unix))]
fn link(blob: &Path, at: &Path) {
    std::fs::copy(blob, at).unwrap();
}

fn offline(hub: &Path) -> HubOptions {
    HubOptions::default().offline(true).cache_dir(hub)
}

/// The directory resolved is a checkpoint the loader, the tokenizer and the
/// chat template all read.
#[test]
fn offline_resolves_a_cached_model_to_a_usable_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    let snapshot = lay_out_cache(&hub);
    let dir = resolve(MODEL, &offline(&hub)).unwrap();
    assert_eq!(dir, snapshot);
    let (model, report) = load_model(&dir, ShapeProfile::AnyQwen3, &CachePolicy::Disabled).unwrap();
    assert!(report.converted);
    assert_eq!(model.config.hidden_size, 128);
    let tokenizer = Tokenizer::from_checkpoint(&dir).unwrap();
    assert!(!tokenizer.encode("The capital of France is").unwrap().is_empty());
    ChatTemplate::from_checkpoint(&dir).unwrap();

    // A tag and a commit hash name the same snapshot.
    assert_eq!(resolve(MODEL, &offline(&hub).revision("v1.0")).unwrap(), snapshot);
    assert_eq!(resolve(MODEL, &offline(&hub).revision(COMMIT)).unwrap(), snapshot);
}

#[test]
fn a_model_not_in_the_cache_is_checkpoint_not_found_naming_it_and_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    lay_out_cache(&hub);
    for (id, revision) in [("Qwen/Qwen3-4B", "main"), (MODEL, "other-branch")] {
        let err = resolve(id, &offline(&hub).revision(revision)).unwrap_err();
        assert_eq!(err.code(), "checkpoint_not_found", "{err}");
        let text = err.to_string();
        assert!(text.contains(id) && text.contains(&hub.display().to_string()), "{text}");
    }
}

#[test]
fn a_broken_cache_entry_is_checkpoint_not_found() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    let snapshot = lay_out_cache(&hub);
    let repo = repo_folder(&hub, MODEL);
    // A branch naming a snapshot that is not there.
    std::fs::write(repo.join("refs/main"), "0".repeat(40)).unwrap();
    let err = resolve(MODEL, &offline(&hub)).unwrap_err();
    assert_eq!(err.code(), "checkpoint_not_found");
    assert!(err.to_string().contains("config.json"), "{err}");
    // A ref that is no hash names no directory.
    std::fs::write(repo.join("refs/main"), "../../elsewhere").unwrap();
    assert_eq!(resolve(MODEL, &offline(&hub)).unwrap_err().code(), "checkpoint_not_found");
    // A snapshot without weights (a partial download).
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    std::fs::remove_file(snapshot.join("model.safetensors")).unwrap();
    let err = resolve(MODEL, &offline(&hub)).unwrap_err();
    assert_eq!(err.code(), "checkpoint_not_found");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn a_malformed_id_or_revision_is_invalid_argument() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    for id in ["", "Qwen", "Qwen/", "/Qwen3", "Qwen/Qwen3/extra", "../Qwen3", "Qwen/..", "Qwen/a b"] {
        let err = resolve(id, &offline(&hub)).unwrap_err();
        assert_eq!(err.code(), "invalid_argument", "{id:?}: {err}");
    }
    for revision in ["", "../main", "a//b"] {
        let err = resolve(MODEL, &offline(&hub).revision(revision)).unwrap_err();
        assert_eq!(err.code(), "invalid_argument", "{revision:?}: {err}");
    }
}

/// Everything that reads the environment, in one test (the environment is
/// the process's): `HF_HOME` and `HF_HUB_CACHE` choose the cache,
/// `HF_HUB_OFFLINE` keeps off the network, and with the network
/// unreachable (`HF_ENDPOINT` at a closed local port) a cached model still
/// resolves and an uncached one names the failed download.
#[test]
fn the_environment_chooses_the_cache_and_offline_mode() {
    if !crate::support::alone_in_child(module_path!(), "the_environment_chooses_the_cache_and_offline_mode") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    let snapshot = lay_out_cache(&home.join("hub"));
    let other = tmp.path().join("other-hub");
    let other_snapshot = lay_out_cache(&other);
    // Safety of set_var: no other test of this file reads these variables.
    std::env::remove_var("HF_HUB_CACHE");
    std::env::set_var("HF_HOME", &home);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    assert_eq!(resolve(MODEL, &HubOptions::default()).unwrap(), snapshot);
    let err = resolve("Qwen/Qwen3-4B", &HubOptions::default()).unwrap_err();
    assert_eq!(err.code(), "checkpoint_not_found");
    assert!(err.to_string().contains("HF_HUB_OFFLINE"), "{err}");

    std::env::set_var("HF_HUB_CACHE", &other);
    assert_eq!(resolve(MODEL, &HubOptions::default()).unwrap(), other_snapshot);
    std::env::remove_var("HF_HUB_CACHE");

    // Online, with nothing listening where the hub should be.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    std::env::set_var("HF_ENDPOINT", &endpoint);
    std::env::set_var("HF_HUB_OFFLINE", "0");
    assert_eq!(resolve(MODEL, &HubOptions::default()).unwrap(), snapshot);
    let err = resolve("Qwen/Qwen3-4B", &HubOptions::default()).unwrap_err();
    assert_eq!(err.code(), "checkpoint_not_found");
    assert!(err.to_string().contains("downloading failed"), "{err}");
    std::env::remove_var("HF_ENDPOINT");
    std::env::remove_var("HF_HUB_OFFLINE");
    std::env::remove_var("HF_HOME");
}
