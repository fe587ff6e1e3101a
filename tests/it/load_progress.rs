//! Load progress and cancellation: every phase is reported from 0 to its
//! total without going back, one call at a time; cancelling in any phase
//! gives `cancelled`, leaves the cache directory without partial or
//! temporary files, and the next load works.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use qwen3_wgpu::internals::load::{load_model_with, LoadReport, Progress};
use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::{
    AdapterPolicy, CachePolicy, Engine, Error, LoadOptions, LoadPhase, LoadProgress, LoadProgressFn,
    ModelConfig, ShapeProfile, WeightFormat,
};

/// A random model of about 5 MB: enough bytes for several reports in
/// every phase (hashing reads 256 KiB at a time, conversion 256 KiB
/// windows, the cache is written and checked in parts).
fn checkpoint(dir: &Path) -> PathBuf {
    let cfg = ModelConfig {
        hidden_size: 256,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        vocab_size: 8192,
        ..ModelConfig::qwen3_0_6b_base()
    };
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    write_random_checkpoint(&ckpt, &cfg, 5).unwrap();
    ckpt
}

/// Bytes of the tensors in `ckpt`'s model.safetensors (the file less its
/// length prefix and header): what hashing and conversion report.
fn tensor_bytes(ckpt: &Path) -> u64 {
    let bytes = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes.len() as u64 - 8 - header_len
}

/// Records every report; checks no two calls overlap and none follows a
/// cancel.
#[derive(Default)]
struct Recorder {
    reports: Mutex<Vec<LoadProgress>>,
    in_call: AtomicBool,
    cancelled: AtomicBool,
}

impl Recorder {
    fn record(&self, p: LoadProgress) {
        assert!(!self.in_call.swap(true, Ordering::SeqCst), "the callback was entered twice at once");
        assert!(!self.cancelled.load(Ordering::SeqCst), "{p:?} reported after the load was cancelled");
        self.reports.lock().unwrap().push(p);
        self.in_call.store(false, Ordering::SeqCst);
    }

    fn reports(&self) -> Vec<LoadProgress> {
        self.reports.lock().unwrap().clone()
    }
}

/// A callback recording into `recorder` and cancelling at the first
/// report `cancel_at` accepts.
fn callback(
    recorder: &Arc<Recorder>,
    cancel_at: impl Fn(&LoadProgress) -> bool + Send + Sync + 'static,
) -> Arc<LoadProgressFn> {
    let recorder = recorder.clone();
    Arc::new(move |p: LoadProgress| {
        recorder.record(p);
        if cancel_at(&p) {
            recorder.cancelled.store(true, Ordering::SeqCst);
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
}

fn load_with(
    ckpt: &Path,
    cache: &CachePolicy,
    callback: Option<&LoadProgressFn>,
) -> Result<LoadReport, Error> {
    let progress = Progress::new(callback);
    load_model_with(ckpt, ShapeProfile::AnyQwen3, cache, WeightFormat::Int8, &progress)
        .map(|(_, report)| report)
}

/// The phases in the order reported, checking each is one run of reports
/// from 0 up to its total, never going back.
fn check_phases(reports: &[LoadProgress]) -> Vec<(LoadPhase, u64)> {
    let mut phases: Vec<(LoadPhase, u64)> = Vec::new();
    let mut last: Option<LoadProgress> = None;
    for p in reports {
        assert!(p.bytes_done <= p.bytes_total, "{p:?}");
        match last {
            Some(l) if l.phase == p.phase => {
                assert_eq!(p.bytes_total, l.bytes_total, "the total changed within a phase: {p:?}");
                assert!(p.bytes_done > l.bytes_done, "not increasing: {l:?} then {p:?}");
            }
            _ => {
                if let Some(l) = last {
                    assert_eq!(l.bytes_done, l.bytes_total, "{:?} ended before its total", l.phase);
                }
                assert!(phases.iter().all(|(ph, _)| *ph != p.phase), "{:?} reported twice", p.phase);
                assert_eq!(p.bytes_done, 0, "{:?} did not start at 0", p.phase);
                phases.push((p.phase, p.bytes_total));
            }
        }
        last = Some(*p);
    }
    if let Some(l) = last {
        assert_eq!(l.bytes_done, l.bytes_total, "{:?} ended before its total", l.phase);
    }
    phases
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names
}

#[test]
fn every_phase_is_reported_from_zero_to_its_total() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path());
    let tensors = tensor_bytes(&ckpt);
    let cache = CachePolicy::Dir(tmp.path().join("cache"));

    let recorder = Arc::new(Recorder::default());
    let cb = callback(&recorder, |_| false);
    let report = load_with(&ckpt, &cache, Some(&*cb)).unwrap();
    assert!(report.converted);
    let reports = recorder.reports();
    let phases = check_phases(&reports);
    let file_len = std::fs::metadata(report.cache_path.as_ref().unwrap()).unwrap().len();
    assert_eq!(
        phases,
        vec![
            (LoadPhase::Hashing, tensors),
            (LoadPhase::Converting, tensors),
            (LoadPhase::WritingCache, file_len)
        ]
    );
    // Several reports within each phase, not only the first and the last.
    for phase in [LoadPhase::Hashing, LoadPhase::Converting, LoadPhase::WritingCache] {
        let n = reports.iter().filter(|p| p.phase == phase).count();
        assert!(n >= 3, "{phase:?}: {n} reports");
    }

    let recorder = Arc::new(Recorder::default());
    let cb = callback(&recorder, |_| false);
    let report = load_with(&ckpt, &cache, Some(&*cb)).unwrap();
    assert!(!report.converted);
    let phases = check_phases(&recorder.reports());
    assert_eq!(phases.iter().map(|p| p.0).collect::<Vec<_>>(), [LoadPhase::Hashing, LoadPhase::ReadingCache]);
    assert_eq!(phases[0].1, tensors);
    // The checksum covers the JSON header and the blob.
    assert!(phases[1].1 > 0 && phases[1].1 < file_len, "{phases:?}");

    let recorder = Arc::new(Recorder::default());
    let cb = callback(&recorder, |_| false);
    load_with(&ckpt, &CachePolicy::Disabled, Some(&*cb)).unwrap();
    assert_eq!(check_phases(&recorder.reports()), vec![(LoadPhase::Converting, tensors)]);
}

/// Cancels a load at the first report `at` accepts, checks the error, the
/// reports up to it and what `cache_dir` holds, then loads again.
fn cancel(ckpt: &Path, cache_dir: &Path, at: impl Fn(&LoadProgress) -> bool + Send + Sync + 'static) {
    let cache = CachePolicy::Dir(cache_dir.to_path_buf());
    let before = entries(cache_dir);
    let recorder = Arc::new(Recorder::default());
    let cb = callback(&recorder, at);
    let err = load_with(ckpt, &cache, Some(&*cb)).unwrap_err();
    assert_eq!(err.code(), "cancelled", "{err}");
    assert!(matches!(err, Error::Cancelled));
    assert!(recorder.cancelled.load(Ordering::SeqCst));
    let last = *recorder.reports().last().unwrap();
    assert_eq!(entries(cache_dir), before, "cancelled in {last:?}: the cache directory changed");
}

#[test]
fn cancelling_in_any_phase_leaves_no_file_and_the_next_load_works() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path());
    let cache_dir = tmp.path().join("cache");
    let cache = CachePolicy::Dir(cache_dir.clone());
    for phase in [LoadPhase::Hashing, LoadPhase::Converting, LoadPhase::WritingCache] {
        // At the phase's start, in its middle, and at its last report.
        cancel(&ckpt, &cache_dir, move |p| p.phase == phase && p.bytes_done == 0);
        cancel(&ckpt, &cache_dir, move |p| p.phase == phase && p.bytes_done > 0);
        cancel(&ckpt, &cache_dir, move |p| p.phase == phase && p.bytes_done == p.bytes_total);
        assert_eq!(entries(&cache_dir), Vec::<String>::new(), "{phase:?}");
    }
    let report = load_with(&ckpt, &cache, None).unwrap();
    assert!(report.converted);
    let name = report.cache_path.unwrap().file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(entries(&cache_dir), vec![name.clone()]);
    let file = cache_dir.join(&name);
    let bytes = std::fs::read(&file).unwrap();

    // A cache hit cancelled while the file is checked keeps the file as it was.
    cancel(&ckpt, &cache_dir, |p| p.phase == LoadPhase::ReadingCache && p.bytes_done == 0);
    cancel(&ckpt, &cache_dir, |p| p.phase == LoadPhase::ReadingCache && p.bytes_done > 0);
    assert_eq!(std::fs::read(&file).unwrap(), bytes);
    let report = load_with(&ckpt, &cache, None).unwrap();
    assert!(!report.converted, "the cache file survived the cancelled reads");
    assert_eq!(entries(&cache_dir), vec![name]);
}

/// A load without a cache cancelled while converting; the default cache
/// policy (whose write failures are only logged) still reports a cancel
/// while writing as `cancelled`.
#[test]
fn cancelling_without_a_cache_and_under_the_default_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path());
    let recorder = Arc::new(Recorder::default());
    let cb = callback(&recorder, |p| p.phase == LoadPhase::Converting && p.bytes_done > 0);
    let err = load_with(&ckpt, &CachePolicy::Disabled, Some(&*cb)).unwrap_err();
    assert_eq!(err.code(), "cancelled");
    assert!(load_with(&ckpt, &CachePolicy::Disabled, None).unwrap().converted);
}

#[test]
fn cancelled_is_a_stable_code() {
    assert_eq!(Error::Cancelled.code(), "cancelled");
    assert!(Error::ALL_CODES.contains(&"cancelled"));
}

/// Through the engine: the upload is the last phase, and cancelling it
/// frees what was uploaded and returns `cancelled`.
#[test]
fn engine_load_reports_the_upload_and_can_cancel_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let cache_dir = tmp.path().join("cache");

    let recorder = Arc::new(Recorder::default());
    let r = recorder.clone();
    let options = LoadOptions { cache: CachePolicy::Dir(cache_dir.clone()), ..Default::default() }
        .on_progress(move |p| {
            r.record(p);
            ControlFlow::Continue(())
        });
    let model = engine.load(&ckpt, &options).unwrap();
    let phases = check_phases(&recorder.reports());
    let order: Vec<LoadPhase> = phases.iter().map(|p| p.0).collect();
    assert_eq!(
        order,
        [LoadPhase::Hashing, LoadPhase::Converting, LoadPhase::WritingCache, LoadPhase::Uploading]
    );
    // The upload's bytes: every converted range, without the GPU's padding.
    let uploaded = phases[3].1;
    assert!(uploaded > 0 && uploaded <= model.weight_bytes(), "{uploaded} of {}", model.weight_bytes());
    drop(model);
    // Clones share the callback.
    let cloned = options.clone();
    assert!(format!("{cloned:?}").contains("callback"));

    for at_start in [true, false] {
        let recorder = Arc::new(Recorder::default());
        let r = recorder.clone();
        let options = LoadOptions { cache: CachePolicy::Dir(cache_dir.clone()), ..Default::default() }
            .on_progress(move |p| {
                r.record(p);
                let hit = p.phase == LoadPhase::Uploading && (p.bytes_done == 0) == at_start;
                if hit {
                    r.cancelled.store(true, Ordering::SeqCst);
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            });
        let err = engine.load(&ckpt, &options).err().expect("a cancelled upload");
        assert_eq!(err.code(), "cancelled", "{err}");
        assert_eq!(recorder.reports().last().unwrap().phase, LoadPhase::Uploading);
    }
    assert_eq!(entries(&cache_dir).len(), 1);
    let model = engine.load(&ckpt, &LoadOptions { cache: CachePolicy::Dir(cache_dir), ..Default::default() });
    assert!(!model.unwrap().load_report().converted);
}
