//! The on-disk cache of converted weights: hits, rebuilds of damaged or
//! stale files, other checkpoints' files, housekeeping and write failures.

use crate::tiny_checkpoint::*;
use qwen3_wgpu::internals::cache::{CachePolicy, ABANDONED_TEMP_AGE, CACHE_FORMAT_VERSION};
use qwen3_wgpu::internals::converted::ConvertedModel;
use qwen3_wgpu::internals::load::{load_model_with, LoadReport, Progress};
use qwen3_wgpu::{Error, ShapeProfile, WeightFormat};
use safetensors::Dtype;
use std::path::{Path, PathBuf};

/// Loads once to create the cache, damages the file with `damage`, and
/// checks that the next load rebuilds it (converted, same bytes) and that
/// the one after hits the rebuilt file.
fn assert_rebuilt_after(damage: impl FnOnce(&Path)) {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (first, r1) = load(&ckpt, &policy);
    let path = cache_file(&r1);
    let good = std::fs::read(&path).unwrap();
    damage(&path);
    assert_ne!(std::fs::read(&path).unwrap(), good, "the damage changed nothing");

    let (rebuilt, r2) = load(&ckpt, &policy);
    assert!(r2.converted, "a damaged cache file was used");
    assert_eq!(r2.cache_path.as_deref(), Some(path.as_path()));
    assert_eq!(blob_bytes(&rebuilt), blob_bytes(&first));
    assert_eq!(std::fs::read(&path).unwrap(), good, "the cache file was not rewritten");
    let (_, r3) = load(&ckpt, &policy);
    assert!(!r3.converted);
    assert_eq!(dir_entries(&cache_dir).len(), 1);
}

#[test]
fn truncated_cache_is_rebuilt() {
    assert_rebuilt_after(|p| rewrite(p, |b| b.truncate(b.len() - 1)));
    assert_rebuilt_after(|p| rewrite(p, |b| b.truncate(b.len() / 2)));
    assert_rebuilt_after(|p| rewrite(p, |b| b.truncate(10)));
    assert_rebuilt_after(|p| rewrite(p, |b| b.clear()));
}

#[test]
fn flipped_byte_in_cache_is_rebuilt() {
    // In the blob (caught by the checksum).
    assert_rebuilt_after(|p| rewrite(p, |b| b[8192 + 3] ^= 0x10));
    // In the JSON header (checksum too).
    assert_rebuilt_after(|p| rewrite(p, |b| b[120] ^= 0x01));
    // In the key, and in the magic.
    assert_rebuilt_after(|p| rewrite(p, |b| b[50] ^= 0x01));
    assert_rebuilt_after(|p| rewrite(p, |b| b[0] ^= 0x01));
    // In the footer's end magic.
    assert_rebuilt_after(|p| {
        rewrite(p, |b| {
            let n = b.len();
            b[n - 2] ^= 0x01
        })
    });
}

#[test]
fn stale_version_is_rebuilt() {
    assert_rebuilt_after(|p| {
        rewrite(p, |b| b[8..12].copy_from_slice(&(CACHE_FORMAT_VERSION + 1).to_le_bytes()))
    });
    assert_rebuilt_after(|p| rewrite(p, |b| b[8..12].copy_from_slice(&0u32.to_le_bytes())));
}

/// Two checkpoints `a` and `b` under `root` with the same config, shapes
/// and dtypes but different values (as two fine-tunes of one base model),
/// and a cache directory for both: (cache dir, its policy, a, b).
fn two_checkpoints(root: &Path) -> (PathBuf, CachePolicy, PathBuf, PathBuf) {
    let cache_dir = root.join("cache");
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (a, b) = (root.join("a"), root.join("b"));
    tiny_checkpoint(&a);
    let cfg = tiny_config();
    write_checkpoint(&b, &cfg, &make_tensors(&cfg, 99), Dtype::BF16);
    (cache_dir, policy, a, b)
}

#[test]
fn cache_of_another_checkpoint_is_not_used() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, policy, a, b) = two_checkpoints(tmp.path());
    assert_eq!(
        std::fs::metadata(a.join("model.safetensors")).unwrap().len(),
        std::fs::metadata(b.join("model.safetensors")).unwrap().len()
    );
    // Same config, shapes and dtypes, different values (as two fine-tunes
    // of one base model): the key differs.
    let (ma, ra) = load(&a, &policy);
    let (mb, rb) = load(&b, &policy);
    assert!(ra.converted && rb.converted);
    assert_ne!(ra.cache_path, rb.cache_path);
    assert_ne!(blob_bytes(&ma), blob_bytes(&mb));
    // Overwrite b's cache file with a's (valid file, wrong key): rebuilt.
    std::fs::copy(cache_file(&ra), cache_file(&rb)).unwrap();
    let (mb2, rb2) = load(&b, &policy);
    assert!(rb2.converted);
    assert_eq!(blob_bytes(&mb2), blob_bytes(&mb));
    // generation_config.json is part of the key.
    change_key(&a);
    let (ma2, ra2) = load(&a, &policy);
    assert!(ra2.converted);
    assert_ne!(ra2.cache_path, ra.cache_path);
    assert_eq!(ma2.config.eos_token_ids, vec![7, 9]);
}

/// A changed checkpoint's new cache file replaces its old one; another
/// checkpoint's cache in the same directory stays.
#[test]
fn changed_checkpoint_replaces_its_stale_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache_dir, policy, a, b) = two_checkpoints(tmp.path());
    let (_, ra) = load(&a, &policy);
    let (_, rb) = load(&b, &policy);
    assert_holds(&cache_dir, vec![cache_name(&ra), cache_name(&rb)]);
    // a changes: its next load converts under a new key and deletes the old
    // file, not b's.
    change_key(&a);
    let (_, ra2) = load(&a, &policy);
    assert!(ra2.converted);
    assert_holds(&cache_dir, vec![cache_name(&ra2), cache_name(&rb)]);
    // The same checkpoint through another spelling of its path is the same
    // source: loading it again finds its cache.
    let (_, ra3) = load(&tmp.path().join("b/../a"), &policy);
    assert!(!ra3.converted);
}

/// The cache file of a checkpoint directory that no longer exists (deleted,
/// or moved: it converts again at its new path) is deleted when another
/// checkpoint's file is written; files of checkpoints that exist stay.
#[test]
fn cache_of_a_deleted_checkpoint_is_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache_dir, policy, a, b) = two_checkpoints(tmp.path());
    let (_, ra) = load(&a, &policy);
    let (_, rb) = load(&b, &policy);
    assert_ne!(cache_name(&ra), cache_name(&rb));
    // a moves: its file stays until the next cache write.
    let moved = tmp.path().join("a-moved");
    std::fs::rename(&a, &moved).unwrap();
    assert_holds(&cache_dir, vec![cache_name(&ra), cache_name(&rb)]);
    // b changes and converts again: a's orphan goes with b's old file.
    change_key(&b);
    let (_, rb2) = load(&b, &policy);
    assert!(rb2.converted);
    assert_holds(&cache_dir, vec![cache_name(&rb2)]);
    // At its new path a converts again and b's file stays.
    let (_, ra2) = load(&moved, &policy);
    assert!(ra2.converted);
    assert_holds(&cache_dir, vec![cache_name(&ra2), cache_name(&rb2)]);
}

/// Temporary files a killed writer left behind (untouched for
/// ABANDONED_TEMP_AGE) are deleted when a cache file is written; a fresh
/// one of a running writer and files that are not ours stay.
#[test]
fn abandoned_temp_files_are_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    std::fs::create_dir_all(&cache_dir).unwrap();
    let key = "0123456789abcdef".repeat(4);
    let old = std::time::SystemTime::now() - 2 * ABANDONED_TEMP_AGE;
    let files = [
        (format!(".{key}.4242.0.17.tmp"), true, false), // abandoned
        // Being written: fresh, and its writer (this process) runs.
        (format!(".{key}.{}.1.18.tmp", std::process::id()), false, true),
        ("notes.tmp".to_string(), true, true),
        (format!(".{key}.x.0.17.tmp"), true, true),
        ("user-file.q3w".to_string(), true, true), // not a cache file of ours
    ];
    for (name, is_old, _) in &files {
        let path = cache_dir.join(name);
        std::fs::write(&path, b"partial").unwrap();
        if *is_old {
            std::fs::File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        }
    }
    let (_, r) = load(&ckpt, &CachePolicy::Dir(cache_dir.clone()));
    assert!(r.converted);
    let mut want: Vec<String> = files.iter().filter(|f| f.2).map(|f| f.0.clone()).collect();
    want.push(cache_name(&r));
    assert_holds(&cache_dir, want);
}

#[test]
fn unwritable_explicit_cache_dir_is_cache_io() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    tiny_checkpoint(&ckpt);
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let e = load_err(&ckpt, &CachePolicy::Dir(file.join("cache")));
    assert_eq!(code(&e), "cache_io");
    match e {
        Error::CacheIo { path, .. } => assert_eq!(path, file.join("cache")),
        e => panic!("{e}"),
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory");
}

#[test]
fn failed_cache_write_leaves_no_temp_files() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (_, r) = load(&ckpt, &policy);
    let path = cache_file(&r);
    // Put a non-empty directory where the cache file goes: it is neither a
    // valid cache nor removable, and renaming onto it fails.
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir_all(path.join("occupied")).unwrap();
    let e = load_err(&ckpt, &policy);
    assert_eq!(code(&e), "cache_io");
    assert!(e.to_string().contains("rename"), "{e}");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(dir_entries(&cache_dir), vec![name], "a temp file was left behind");
}

/// `CachePolicy::Default` writes under the platform cache directory, and a
/// failure to write there is only logged. Both halves live in one test
/// because they steer `dirs::cache_dir()` through XDG_CACHE_HOME, which is
/// process-wide; no other test uses the default policy.
#[cfg(target_os = "linux")]
#[test]
fn default_cache_policy_writes_and_tolerates_failure() {
    if !crate::support::alone_in_child(module_path!(), "default_cache_policy_writes_and_tolerates_failure") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    tiny_checkpoint(&ckpt);
    let xdg = tmp.path().join("xdg");
    std::env::set_var("XDG_CACHE_HOME", &xdg);
    let (_, r1) = load(&ckpt, &CachePolicy::Default);
    let (_, r2) = load(&ckpt, &CachePolicy::Default);
    assert!(r1.converted && !r2.converted);
    assert_eq!(cache_file(&r1).parent(), Some(xdg.join("qwen3-wgpu").as_path()));

    // A cache "directory" under a regular file: still loads, uncached.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    std::env::set_var("XDG_CACHE_HOME", file.join("sub"));
    let (m, r3) = load(&ckpt, &CachePolicy::Default);
    std::env::remove_var("XDG_CACHE_HOME");
    assert!(r3.converted);
    assert_eq!(r3.cache_path, None);
    assert_eq!(m.index.layers.len(), 2);
}

/// [`load`] with the layers in `weights`.
fn load_as(dir: &Path, cache: &CachePolicy, weights: WeightFormat) -> (ConvertedModel, LoadReport) {
    load_model_with(dir, ShapeProfile::AnyQwen3, cache, weights, &Progress::none()).unwrap()
}

/// The int8 and int4 conversions of one checkpoint are two entries side by
/// side: each load writes or hits its own, and writing one leaves the
/// other (the housekeeping deletes a checkpoint's entries of its own
/// format only).
#[test]
fn int8_and_int4_entries_of_one_checkpoint_coexist() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (int8, r8) = load_as(&ckpt, &policy, WeightFormat::Int8);
    let (int4, r4) = load_as(&ckpt, &policy, WeightFormat::Int4);
    assert!(r8.converted && r4.converted);
    assert_ne!(cache_file(&r8), cache_file(&r4));
    assert_holds(&cache_dir, vec![cache_name(&r8), cache_name(&r4)]);
    assert_eq!((int8.index.weights, int4.index.weights), (WeightFormat::Int8, WeightFormat::Int4));
    assert_eq!(int4.index.layers[0].qkv.format, WeightFormat::Int4);
    assert_eq!(int4.index.embed.format, WeightFormat::Int8, "the embedding stays int8");
    assert!(blob_bytes(&int4).len() < blob_bytes(&int8).len());
    for (weights, first) in [(WeightFormat::Int8, &int8), (WeightFormat::Int4, &int4)] {
        let (again, report) = load_as(&ckpt, &policy, weights);
        assert!(!report.converted, "{weights}: not a cache hit");
        assert_eq!(blob_bytes(&again), blob_bytes(first), "{weights}");
    }
    assert_holds(&cache_dir, vec![cache_name(&r8), cache_name(&r4)]);
}

/// An entry of the other format in a load's place (its key rewritten: the
/// preamble is outside the checksum) is rebuilt, never read as this
/// format; the other format's own entry stays.
#[test]
fn an_entry_of_the_other_format_is_not_used() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let cache_dir = tmp.path().join("cache");
    tiny_checkpoint(&ckpt);
    let policy = CachePolicy::Dir(cache_dir.clone());
    let (_, r8) = load_as(&ckpt, &policy, WeightFormat::Int8);
    let (int4, r4) = load_as(&ckpt, &policy, WeightFormat::Int4);
    let (int8_file, int4_file) = (cache_file(&r8), cache_file(&r4));
    let int4_key = std::fs::read(&int4_file).unwrap()[40..104].to_vec();
    std::fs::copy(&int8_file, &int4_file).unwrap();
    rewrite(&int4_file, |b| b[40..104].copy_from_slice(&int4_key));
    let (rebuilt, report) = load_as(&ckpt, &policy, WeightFormat::Int4);
    assert!(report.converted, "an int8 entry was read as int4");
    assert_eq!(blob_bytes(&rebuilt), blob_bytes(&int4));
    assert_holds(&cache_dir, vec![cache_name(&r8), cache_name(&r4)]);
}
