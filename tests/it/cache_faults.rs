//! The conversion cache and loader under changed, damaged or oversized
//! checkpoints: an in-place edit never reuses a stale entry, non-finite
//! small tensors are refused before anything is cached, a checkpoint
//! truncated while it is read is a named error, a model too large for host
//! memory is `out_of_memory`, and temporary files of dead writers go.

use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::cache::{CachePolicy, CACHE_FORMAT_VERSION};
use qwen3_wgpu::internals::checkpoint::{expected_tensors, Checkpoint};
use qwen3_wgpu::internals::config::{load_config, ShapeProfile};
use qwen3_wgpu::internals::convert::{blob_bytes, convert};
use qwen3_wgpu::internals::converted::ConvertedModel;
use qwen3_wgpu::internals::load::{load_model, LoadReport};
use qwen3_wgpu::{Error, WeightFormat};

const FIXTURE: &str = "tests/fixtures/mlx/gqa2_hd64";

/// A copy of the fixture checkpoint in `root/ckpt`.
fn fixture_copy(root: &Path) -> PathBuf {
    let dst = root.join("ckpt");
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    dst
}

fn load(dir: &Path, cache: &CachePolicy) -> (ConvertedModel, LoadReport) {
    match load_model(dir, ShapeProfile::AnyQwen3, cache) {
        Ok(r) => r,
        Err(e) => panic!("load_model failed: {} ({e})", e.code()),
    }
}

fn load_err(dir: &Path, cache: &CachePolicy) -> Error {
    match load_model(dir, ShapeProfile::AnyQwen3, cache) {
        Ok(_) => panic!("load_model succeeded where it should fail"),
        Err(e) => e,
    }
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<String> =
        entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// Absolute byte range of `tensor` inside the safetensors file `path`, and
/// the byte length of one of its rows.
fn tensor_range(path: &Path, tensor: &str) -> (usize, usize, usize) {
    let bytes = std::fs::read(path).unwrap();
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let info = metadata.info(tensor).unwrap();
    let start = 8 + header_len + info.data_offsets.0;
    let end = 8 + header_len + info.data_offsets.1;
    let row_bytes = info.shape.last().unwrap() * info.dtype.bitsize() / 8;
    (start, end, row_bytes)
}

/// Rewrites `range` of `path` in place (same size, same inode), keeping the
/// file's modification time when `keep_mtime`.
fn edit_in_place(path: &Path, range: std::ops::Range<usize>, f: impl FnOnce(&mut [u8]), keep_mtime: bool) {
    use std::io::{Seek, SeekFrom, Write};
    let before = std::fs::metadata(path).unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes[range.clone()]);
    let mut file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.seek(SeekFrom::Start(range.start as u64)).unwrap();
    file.write_all(&bytes[range]).unwrap();
    if keep_mtime {
        file.set_modified(before.modified().unwrap()).unwrap();
    }
    drop(file);
    assert_eq!(std::fs::metadata(path).unwrap().len(), before.len());
}

fn weights(dir: &Path) -> PathBuf {
    dir.join("model.safetensors")
}

/// Cached load after an in-place edit converts again and gives exactly what
/// an uncached load of the edited checkpoint gives.
fn assert_edit_is_seen(dir: &Path, cache: &CachePolicy, before: &ConvertedModel) {
    let (cached, report) = load(dir, cache);
    assert!(report.converted, "the edited checkpoint reused the stale cache entry");
    let (fresh, _) = load(dir, &CachePolicy::Disabled);
    assert_eq!(blob_bytes(&cached), blob_bytes(&fresh));
    assert_ne!(blob_bytes(&cached), blob_bytes(before), "the edit changed nothing converted");
    // And the new entry is now a hit that still matches.
    let (again, report) = load(dir, cache);
    assert!(!report.converted);
    assert_eq!(blob_bytes(&again), blob_bytes(&fresh));
}

/// One embedding row negated in place (bytes away from the start and end of
/// the file): the cache key changes.
#[test]
fn negated_embedding_row_misses_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture_copy(tmp.path());
    let cache = CachePolicy::Dir(tmp.path().join("cache"));
    let (before, report) = load(&dir, &cache);
    assert!(report.converted);

    let (start, _, row_bytes) = tensor_range(&weights(&dir), "model.embed_tokens.weight");
    let row = 670;
    let range = start + row * row_bytes..start + (row + 1) * row_bytes;
    // bf16: the sign is bit 15 of each little-endian pair.
    edit_in_place(&weights(&dir), range, |b| b.chunks_exact_mut(2).for_each(|e| e[1] ^= 0x80), false);
    assert_edit_is_seen(&dir, &cache, &before);
}

/// Rows of one q_proj rewritten in place with the file's modification time
/// restored: the key still changes (it does not rely on timestamps).
#[test]
fn rewritten_q_proj_misses_the_cache_even_with_mtime_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture_copy(tmp.path());
    let cache = CachePolicy::Dir(tmp.path().join("cache"));
    let (before, _) = load(&dir, &cache);

    let (start, _, row_bytes) = tensor_range(&weights(&dir), "model.layers.0.self_attn.q_proj.weight");
    let range = start..start + 32 * row_bytes;
    // Reverse the order of the first 32 rows.
    let rewrite = |b: &mut [u8]| {
        let rows: Vec<Vec<u8>> = b.chunks_exact(row_bytes).rev().map(|r| r.to_vec()).collect();
        b.copy_from_slice(&rows.concat());
    };
    edit_in_place(&weights(&dir), range, rewrite, true);
    assert_edit_is_seen(&dir, &cache, &before);
}

/// A NaN or infinity in a norm vector is `checkpoint_invalid` naming the
/// tensor, and nothing is written to the cache directory.
#[test]
fn non_finite_norm_weights_are_refused_before_caching() {
    // bf16 bit patterns, little-endian.
    let cases = [
        ("model.layers.1.self_attn.q_norm.weight", [0xc0, 0x7f]), // NaN
        ("model.layers.0.input_layernorm.weight", [0x80, 0x7f]),  // +inf
        ("model.norm.weight", [0x80, 0xff]),                      // -inf
        ("model.layers.0.self_attn.k_norm.weight", [0xc0, 0xff]), // -NaN
    ];
    for (tensor, value) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dir = fixture_copy(tmp.path());
        let cache_dir = tmp.path().join("cache");
        let (start, end, _) = tensor_range(&weights(&dir), tensor);
        let element = 5.min((end - start) / 2 - 1);
        let at = start + 2 * element;
        edit_in_place(&weights(&dir), at..at + 2, |b| b.copy_from_slice(&value), false);

        let err = load_err(&dir, &CachePolicy::Dir(cache_dir.clone()));
        assert_eq!(err.code(), "checkpoint_invalid", "{tensor}: {err}");
        assert!(err.to_string().contains(tensor), "{tensor}: {err}");
        assert_eq!(dir_entries(&cache_dir), Vec::<String>::new(), "{tensor}: the cache directory changed");
        let err = load_err(&dir, &CachePolicy::Disabled);
        assert_eq!(err.code(), "checkpoint_invalid", "{tensor}: {err}");
    }
}

/// A weights file truncated after the checkpoint was opened (as by another
/// process while it converts) is `checkpoint_invalid` naming the file, from
/// the fingerprint and from the conversion, instead of a SIGBUS.
#[test]
fn checkpoint_truncated_while_open_is_a_named_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture_copy(tmp.path());
    let cfg = load_config(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    ckpt.validate(&cfg).unwrap();
    let len = std::fs::metadata(weights(&dir)).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(weights(&dir)).unwrap().set_len(len / 2).unwrap();

    for err in [
        ckpt.fingerprint(&cfg, CACHE_FORMAT_VERSION, WeightFormat::Int8)
            .expect_err("fingerprint of a truncated file"),
        convert(&ckpt, &cfg, WeightFormat::Int8).err().expect("conversion of a truncated file"),
    ] {
        assert_eq!(err.code(), "checkpoint_invalid", "{err}");
        let text = err.to_string();
        assert!(text.contains("model.safetensors") && text.contains("truncated"), "{text}");
    }
}

/// A process that has exited: its id is free (and, within this test, not
/// reused).
#[cfg(unix)]
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// A cache hit deletes the fresh temporary file of a writer that no longer
/// runs (killed mid-write) and keeps that of a running writer.
#[cfg(unix)]
#[test]
fn cache_hit_removes_temp_files_of_dead_writers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture_copy(tmp.path());
    let cache_dir = tmp.path().join("cache");
    let cache = CachePolicy::Dir(cache_dir.clone());
    let (_, first) = load(&dir, &cache);
    let entry = first.cache_path.unwrap().file_name().unwrap().to_string_lossy().into_owned();
    let key = entry.strip_suffix(".q3w").unwrap();

    let mut live = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    let dead_temp = format!(".{key}.{}.0.123.tmp", dead_pid());
    let live_temp = format!(".{key}.{}.0.456.tmp", live.id());
    for name in [&dead_temp, &live_temp] {
        std::fs::write(cache_dir.join(name), b"partial cache file").unwrap();
    }

    let (_, hit) = load(&dir, &cache);
    live.kill().unwrap();
    live.wait().unwrap();
    assert!(!hit.converted);
    let mut want = vec![live_temp, entry];
    want.sort();
    assert_eq!(dir_entries(&cache_dir), want);
}

/// Writes a checkpoint for `cfg` whose tensors are all zeros, as a sparse
/// file (no data blocks are written, whatever its size).
#[cfg(target_os = "linux")]
fn write_sparse_checkpoint(dir: &Path, cfg: &serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let model_cfg = load_config(dir).unwrap();
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in expected_tensors(&model_cfg) {
        if name == "lm_head.weight" && model_cfg.tie_word_embeddings {
            continue;
        }
        let len = shape.iter().product::<usize>() * 2;
        header.insert(
            name,
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    let path = dir.join("model.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len((bytes.len() + offset) as u64)
        .unwrap();
}

/// A checkpoint whose int8 form is larger than the host's available memory
/// is `out_of_memory` naming the bytes needed and available, not an abort.
#[cfg(target_os = "linux")]
#[test]
fn model_larger_than_memory_is_out_of_memory() {
    let available =
        qwen3_wgpu::internals::convert::available_memory().expect("MemAvailable in /proc/meminfo");
    // int8 embedding rows of `hidden` bytes: twice the available memory.
    let hidden = 1usize << 15;
    let vocab = usize::try_from(2 * available / hidden as u64).unwrap().clamp(1 << 10, 1 << 24);
    assert!((vocab * hidden) as u64 > available, "this host has too much memory for the test");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("huge");
    write_sparse_checkpoint(
        &dir,
        &serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
            "vocab_size": vocab, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "tie_word_embeddings": true, "eos_token_id": 2
        }),
    );
    let err = load_err(&dir, &CachePolicy::Disabled);
    assert_eq!(err.code(), "out_of_memory", "{err}");
    match err {
        Error::OutOfMemory { needed, available: reported, .. } => {
            assert!(needed > reported, "needed {needed}, available {reported}");
            assert!(needed >= (vocab * hidden) as u64);
        }
        other => panic!("{other}"),
    }
}
