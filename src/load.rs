//! Loading a model, in order: the checkpoint directory, config.json and
//! the shape profile, the tensors, then the converted weights from the
//! cache ([`crate::cache`]) or a fresh conversion ([`crate::convert`])
//! that is written to it. Every check runs once. Each phase reports its
//! progress ([`LoadProgress`]) to the caller's callback, which may cancel.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::cache::{cache_dir, read_cache, remove_abandoned_temp_files, remove_stale_files, write_cache};
use crate::cache::{CachePolicy, CACHE_EXTENSION, CACHE_FORMAT_VERSION};
use crate::checkpoint::{Checkpoint, Fingerprint};
use crate::config::{check_profile, read_config, require_checkpoint_dir, ShapeProfile};
use crate::convert::convert_validated;
use crate::converted::{ConvertedModel, WeightFormat};
use crate::error::{Error, Result};
pub use crate::progress::{LoadPhase, LoadProgress, LoadProgressFn, Progress};

/// What [`load_model`] did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LoadReport {
    /// True when the checkpoint was converted (no valid cache file).
    pub converted: bool,
    /// The cache file used or written; `None` when caching was disabled or
    /// the default cache could not be written.
    pub cache_path: Option<PathBuf>,
    /// Milliseconds spent converting (0 on a cache hit).
    pub convert_ms: f64,
    /// Milliseconds spent in [`load_model`] in total.
    pub load_ms: f64,
}

/// Loads the model in `dir`, its layers in int8: checks the directory, reads config.json (the
/// checks of [`load_config`](crate::config::load_config)) and [`check_profile`], opens and validates
/// the checkpoint (each once), then maps a valid cache file
/// (`<cache_dir>/<key>.q3w`, giving [`Blob::Mapped`](crate::converted::Blob::Mapped)) or converts the
/// checkpoint and, unless `cache` is [`CachePolicy::Disabled`], writes the
/// cache file.
///
/// With a cache directory, the checkpoint is fingerprinted first (every
/// tensor byte hashed, see [`Checkpoint::fingerprint`]) and abandoned
/// temporary files are removed from the directory, hit or miss.
///
/// Host memory stays bounded by the page cache plus one blob about the size
/// of the int8 model (checked against the memory available before it is
/// allocated).
///
/// Errors: those of [`load_config`](crate::config::load_config), [`check_profile`], [`Checkpoint::open`],
/// [`Checkpoint::validate`], [`Checkpoint::fingerprint`] and
/// [`convert`](crate::convert::convert); [`Error::CheckpointInvalid`] when
/// a weights file changed while it was read; [`Error::CacheIo`] when an
/// explicitly chosen cache directory cannot be created or written.
pub fn load_model(
    dir: &Path,
    profile: ShapeProfile,
    cache: &CachePolicy,
) -> Result<(ConvertedModel, LoadReport)> {
    load_model_with(dir, profile, cache, WeightFormat::Int8, &Progress::none())
}

/// [`load_model`] with the layers in `weights`, reporting each phase's
/// progress through `progress` (every phase but [`LoadPhase::Uploading`],
/// which is the caller's). The cache holds one entry per checkpoint and
/// format.
///
/// Errors: those of [`load_model`]; [`Error::Cancelled`] when the progress
/// callback asks to cancel. A cancelled load leaves no cache file and no
/// temporary file behind (a cache file it was reading stays as it was).
pub fn load_model_with(
    dir: &Path,
    profile: ShapeProfile,
    cache: &CachePolicy,
    weights: WeightFormat,
    progress: &Progress<'_>,
) -> Result<(ConvertedModel, LoadReport)> {
    let started = Instant::now();
    // Each check once: the directory, config.json (with the engine's own
    // shape limits), the profile's extra demands, the tensors.
    require_checkpoint_dir(dir)?;
    let cfg = read_config(dir)?;
    if profile != ShapeProfile::AnyQwen3 {
        check_profile(&cfg, profile)?;
    }
    let ckpt = Checkpoint::open_dir(dir)?;
    ckpt.validate(&cfg)?;

    let explicit = matches!(cache, CachePolicy::Dir(_));
    let chosen_dir = cache_dir(cache);
    if let Some(d) = &chosen_dir {
        remove_abandoned_temp_files(d);
    }
    // Only a cached load needs the key; without a cache, skip the hash.
    let fingerprint = match chosen_dir {
        Some(_) => Some(ckpt.fingerprint_with(&cfg, CACHE_FORMAT_VERSION, weights, progress)?),
        None => None,
    };
    let key = fingerprint.as_ref().map_or("", |f| f.key.as_str());
    let mut cache_path = chosen_dir.map(|d| d.join(format!("{key}.{CACHE_EXTENSION}")));

    if let Some(path) = &cache_path {
        match read_cache(path, key, &cfg, weights, progress)? {
            Ok(Some(model)) => {
                if let Some(fp) = &fingerprint {
                    unchanged_since(&ckpt, fp)?;
                }
                let report = LoadReport {
                    converted: false,
                    cache_path: Some(path.clone()),
                    convert_ms: 0.0,
                    load_ms: ms_since(started),
                };
                log::info!("weight cache hit: {} ({:.0} ms)", path.display(), report.load_ms);
                return Ok((model, report));
            }
            Ok(None) => {}
            Err(reason) => {
                log::warn!("ignoring invalid weight cache {}: {reason}; rebuilding it", path.display());
                if let Err(e) = std::fs::remove_file(path) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        log::warn!("cannot delete invalid weight cache {}: {e}", path.display());
                    }
                }
            }
        }
        // Fail before a long conversion when an explicit directory is unusable.
        if let Some(parent) = path.parent() {
            if let Err(e) = std::fs::create_dir_all(parent) {
                let err = Error::cache_io(parent, format!("cannot create cache directory: {e}"));
                if explicit {
                    return Err(err);
                }
                log::warn!("{err}; the converted weights will not be cached");
                cache_path = None;
            }
        }
    }

    let convert_started = Instant::now();
    let model = convert_validated(&ckpt, &cfg, weights, fingerprint.as_ref(), progress)?;
    let convert_ms = ms_since(convert_started);
    if let Some(fp) = &fingerprint {
        unchanged_since(&ckpt, fp)?;
    }
    drop(ckpt);

    if let Some(path) = &cache_path {
        let source = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let source = source.to_string_lossy();
        if let Err(err) = write_cache(path, key, &source, &model, progress) {
            if explicit || matches!(err, Error::Cancelled) {
                return Err(err);
            }
            log::warn!("{err}; the converted weights will not be cached");
            cache_path = None;
        } else if let Some(dir) = path.parent() {
            remove_stale_files(dir, key, &source, weights);
        }
    }
    let report = LoadReport { converted: true, cache_path, convert_ms, load_ms: ms_since(started) };
    match &report.cache_path {
        Some(path) => {
            log::info!("converted {} in {convert_ms:.0} ms, cached as {}", dir.display(), path.display())
        }
        None => log::info!("converted {} in {convert_ms:.0} ms (not cached)", dir.display()),
    }
    Ok((model, report))
}

/// [`Error::CheckpointInvalid`] naming the weights files whose size or
/// modification time changed since `fp` was taken.
fn unchanged_since(ckpt: &Checkpoint, fp: &Fingerprint) -> Result<()> {
    let changed = ckpt.changed_files(&fp.stamps);
    match changed.first() {
        None => Ok(()),
        Some(first) => Err(Error::invalid(
            first,
            format!(
                "{} weights file(s) changed size or modification time while being read; \
                 nothing was cached, load again once the checkpoint is complete",
                changed.len()
            ),
        )),
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check_counts::{take, DIRECTORY, ENGINE_SHAPE, VALIDATION};

    /// A load checks the directory, the config's shape and the tensors
    /// once each, on a cache miss (conversion) and on a hit alike.
    #[test]
    fn each_check_runs_once_per_load() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let cache = tempfile::tempdir().unwrap();
        let policy = CachePolicy::Dir(cache.path().to_path_buf());
        for converted in [true, false] {
            take(&DIRECTORY);
            take(&ENGINE_SHAPE);
            take(&VALIDATION);
            let (_, report) = load_model(&fixture, ShapeProfile::AnyQwen3, &policy).unwrap();
            assert_eq!(report.converted, converted);
            let counts = [take(&DIRECTORY), take(&ENGINE_SHAPE), take(&VALIDATION)];
            assert_eq!(counts, [1, 1, 1], "directory, config shape, tensors (converted: {converted})");
        }
    }
}
