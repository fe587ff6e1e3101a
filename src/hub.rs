//! Getting a checkpoint by its Hugging Face id (feature `hub`):
//! [`resolve`] turns `Qwen/Qwen3-0.6B-Base` into a checkpoint directory
//! that [`Engine::load`](crate::Engine::load),
//! [`Tokenizer::from_checkpoint`](crate::Tokenizer::from_checkpoint) and
//! [`ChatTemplate::from_checkpoint`](crate::ChatTemplate::from_checkpoint) read.
//!
//! Online, it downloads what the engine reads (config.json,
//! generation_config.json, tokenizer.json, tokenizer_config.json and the
//! safetensors weights, single-file or index plus shards) into the Hugging
//! Face cache through the `hf-hub` crate, reporting each file's progress,
//! and skips files the cache already holds. Offline (`HF_HUB_OFFLINE=1`,
//! [`HubOptions::offline`], or no network), it resolves from that cache
//! alone. The cache is the one Python's `huggingface_hub` uses:
//! `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`;
//! a model lives in `models--<org>--<name>/`, its branches in
//! `refs/<branch>` (a commit hash) and its files in `snapshots/<commit>/`.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use crate::checked_read::{self, MAX_JSON_FILE_LEN};
use crate::checkpoint::{parse_shard_index, SHARD_INDEX, SINGLE_FILE};
use crate::error::{Error, Result};

/// The files [`resolve`] fetches besides the weights, when the repository
/// has them: config.json is required, the rest optional.
pub const CHECKPOINT_FILES: [&str; 4] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"];

/// The variable that, set to `1` (or `true`, `yes`, `on`), keeps
/// [`resolve`] off the network.
pub const OFFLINE_ENV: &str = "HF_HUB_OFFLINE";

/// How far one file's download has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DownloadProgress<'a> {
    /// The file's name in the repository.
    pub file: &'a str,
    /// Bytes downloaded so far.
    pub bytes_done: u64,
    /// The file's size.
    pub bytes_total: u64,
}

/// A download progress callback (see [`HubOptions::on_progress`]).
pub type DownloadProgressFn = dyn Fn(DownloadProgress<'_>) -> ControlFlow<()> + Send + Sync;

/// How [`resolve`] finds a model.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct HubOptions {
    revision: Option<String>,
    offline: Option<bool>,
    cache_dir: Option<PathBuf>,
    progress: Option<Arc<DownloadProgressFn>>,
}

impl std::fmt::Debug for HubOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubOptions")
            .field("revision", &self.revision)
            .field("offline", &self.offline)
            .field("cache_dir", &self.cache_dir)
            .field("progress", &self.progress.as_ref().map(|_| "callback"))
            .finish()
    }
}

impl HubOptions {
    /// A branch, tag or commit hash (default `main`).
    pub fn revision(mut self, revision: impl Into<String>) -> Self {
        self.revision = Some(revision.into());
        self
    }

    /// Never use the network (`true`), or use it even when
    /// `HF_HUB_OFFLINE` is set (`false`). Without it: `HF_HUB_OFFLINE`.
    pub fn offline(mut self, offline: bool) -> Self {
        self.offline = Some(offline);
        self
    }

    /// The Hugging Face hub cache directory (the one holding
    /// `models--*`). Without it: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`.
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }

    /// Calls `callback` as each file downloads (files already cached are
    /// not reported). Returning [`ControlFlow::Break`] cancels:
    /// [`resolve`] then returns [`Error::Cancelled`] after the file in
    /// flight (the cache only ever holds complete files).
    pub fn on_progress(
        mut self,
        callback: impl Fn(DownloadProgress<'_>) -> ControlFlow<()> + Send + Sync + 'static,
    ) -> Self {
        self.progress = Some(Arc::new(callback));
        self
    }
}

/// The checkpoint directory of the Hugging Face model `model_id`
/// (`org/name`), downloading what is missing unless offline (see the
/// module docs). Online, a network failure falls back to the cache.
///
/// ```no_run
/// use qwen3_wgpu::hub::{resolve, HubOptions};
/// use qwen3_wgpu::{Engine, LoadOptions, Tokenizer};
/// let dir = resolve("Qwen/Qwen3-0.6B-Base", &HubOptions::default())?;
/// let model = Engine::new()?.load(&dir, &LoadOptions::default())?;
/// let tokenizer = Tokenizer::from_checkpoint(&dir)?;
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
///
/// Errors: [`Error::InvalidArgument`] for an id that is not `org/name`
/// (or a bad revision); [`Error::CheckpointNotFound`] naming the id and
/// the cache directory when the model is not cached and cannot be
/// downloaded (offline, no network, no such repository, or one without
/// config.json or safetensors weights); [`Error::CacheIo`] when the cache
/// cannot be written; [`Error::Cancelled`] when the progress callback
/// cancels.
pub fn resolve(model_id: &str, options: &HubOptions) -> Result<PathBuf> {
    check_model_id(model_id)?;
    let revision = options.revision.as_deref().unwrap_or("main");
    if revision.is_empty() || revision.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
        return Err(Error::invalid_argument(
            "revision",
            format!("{revision:?} is not a branch, tag or commit"),
        ));
    }
    let cache_dir = match &options.cache_dir {
        Some(dir) => dir.clone(),
        None => default_cache_dir()?,
    };
    let offline = match options.offline {
        Some(offline) => offline,
        None => offline_from_env(),
    };
    if offline {
        return cached_snapshot(&cache_dir, model_id, revision).map_err(|reason| {
            not_found(model_id, &cache_dir, format!("{reason} (offline: {OFFLINE_ENV} is set)"))
        });
    }
    match download(&cache_dir, model_id, revision, options.progress.as_deref()) {
        Ok(dir) => Ok(dir),
        Err(Fetch::Unreachable(e)) => {
            log::warn!("cannot reach the Hugging Face hub for {model_id} ({e}); using the local cache");
            cached_snapshot(&cache_dir, model_id, revision).map_err(|reason| {
                not_found(model_id, &cache_dir, format!("{reason}; downloading failed: {e}"))
            })
        }
        Err(Fetch::Failed(e)) => Err(e),
    }
}

/// The hub cache directory from the environment (see [`HubOptions::cache_dir`]).
fn default_cache_dir() -> Result<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("HF_HUB_CACHE") {
        return Ok(dir);
    }
    if let Some(home) = var("HF_HOME") {
        return Ok(home.join("hub"));
    }
    match dirs::home_dir() {
        Some(home) => Ok(home.join(".cache").join("huggingface").join("hub")),
        None => Err(Error::invalid_argument(
            "HF_HOME",
            "no home directory to find the Hugging Face cache in: set HF_HOME or HF_HUB_CACHE",
        )),
    }
}

/// Whether `HF_HUB_OFFLINE` asks for offline mode.
fn offline_from_env() -> bool {
    std::env::var(OFFLINE_ENV)
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// `org/name`, each part of letters, digits, `-`, `_` and `.` (not only
/// dots), as the hub allows: an id can name no path outside the cache.
fn check_model_id(model_id: &str) -> Result<()> {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.chars().all(|c| c == '.')
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match model_id.split_once('/') {
        Some((org, name)) if part_ok(org) && part_ok(name) => Ok(()),
        _ => Err(Error::invalid_argument(
            "model id",
            format!("{model_id:?} is not a Hugging Face model id of the form org/name (e.g. Qwen/Qwen3-0.6B-Base)"),
        )),
    }
}

/// The model's folder in the hub cache: `models--org--name`.
pub fn repo_folder(cache_dir: &Path, model_id: &str) -> PathBuf {
    cache_dir.join(format!("models--{}", model_id.replace('/', "--")))
}

fn not_found(model_id: &str, cache_dir: &Path, reason: String) -> Error {
    Error::CheckpointNotFound {
        path: repo_folder(cache_dir, model_id),
        reason: format!("{model_id} is not in the Hugging Face cache {}: {reason}", cache_dir.display()),
    }
}

/// The snapshot directory the cache holds for `revision` of `model_id`,
/// with config.json and weights in it; else why not.
fn cached_snapshot(cache_dir: &Path, model_id: &str, revision: &str) -> Result<PathBuf, String> {
    let repo = repo_folder(cache_dir, model_id);
    if !repo.is_dir() {
        return Err(format!("{} does not exist", repo.display()));
    }
    let ref_path = repo.join("refs").join(revision);
    let commit = match checked_read::read_file(&ref_path, "revision", checked_read::MAX_REF_FILE_LEN) {
        Ok(Some(commit)) => String::from_utf8_lossy(&commit).trim().to_string(),
        // A commit hash names its snapshot directly.
        Ok(None) | Err(_) if revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit()) => {
            revision.to_string()
        }
        Ok(None) => return Err(format!("no revision {revision} ({} does not exist)", ref_path.display())),
        Err(e) => return Err(format!("no revision {revision} ({e})")),
    };
    let valid_commit = !commit.is_empty() && commit.bytes().all(|b| b.is_ascii_alphanumeric());
    if !valid_commit {
        return Err(format!("{} does not hold a commit hash", ref_path.display()));
    }
    let snapshot = repo.join("snapshots").join(&commit);
    if !snapshot.join("config.json").is_file() {
        return Err(format!("{} has no config.json", snapshot.display()));
    }
    if !snapshot.join(SINGLE_FILE).is_file() && !snapshot.join(SHARD_INDEX).is_file() {
        return Err(format!("{} has neither {SINGLE_FILE} nor {SHARD_INDEX}", snapshot.display()));
    }
    Ok(snapshot)
}

/// Why a download did not give a directory.
enum Fetch {
    /// The hub could not be reached (or answered with a server error):
    /// the cache may still hold the model.
    Unreachable(String),
    /// Anything else: the error to return.
    Failed(Error),
}

/// Downloads what the cache lacks of `revision` of `model_id` and returns
/// its snapshot directory.
fn download(
    cache_dir: &Path,
    model_id: &str,
    revision: &str,
    progress: Option<&DownloadProgressFn>,
) -> Result<PathBuf, Fetch> {
    let cache = Cache::new(cache_dir.to_path_buf());
    let mut builder = ApiBuilder::from_cache(cache.clone()).with_progress(false);
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        builder = builder.with_endpoint(endpoint);
    }
    let api = builder.build().map_err(|e| classify(model_id, cache_dir, e))?;
    let branch = Repo::with_revision(model_id.to_string(), RepoType::Model, revision.to_string());
    let info = api.repo(branch.clone()).info().map_err(|e| classify(model_id, cache_dir, e))?;
    // The commit names a directory: only a plain hash is taken.
    if info.sha.is_empty() || !info.sha.bytes().all(|b| b.is_ascii_alphanumeric()) {
        let reason = format!("the hub answered with the commit {:?}, which is no hash", info.sha);
        return Err(Fetch::Unreachable(reason));
    }
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    // Every file from the one commit the branch points at now.
    let pinned = api.repo(Repo::with_revision(model_id.to_string(), RepoType::Model, info.sha.clone()));
    let missing = |what: &str| {
        Fetch::Failed(not_found(
            model_id,
            cache_dir,
            format!("the repository (commit {}) has no {what}", info.sha),
        ))
    };
    if !files.contains(&"config.json") {
        return Err(missing("config.json"));
    }
    for name in CHECKPOINT_FILES.iter().filter(|n| files.contains(n)) {
        fetch(&pinned, &info.sha, model_id, cache_dir, name, progress)?;
    }
    if files.contains(&SHARD_INDEX) {
        let index_path = fetch(&pinned, &info.sha, model_id, cache_dir, SHARD_INDEX, progress)?;
        let bytes = checked_read::read_required(&index_path, "shard index", MAX_JSON_FILE_LEN)
            .map_err(Fetch::Failed)?;
        let weight_map =
            parse_shard_index(&bytes).map_err(|reason| Fetch::Failed(Error::invalid(&index_path, reason)))?;
        let mut shards: Vec<&String> = weight_map.values().collect();
        shards.sort();
        shards.dedup();
        for shard in shards {
            fetch(&pinned, &info.sha, model_id, cache_dir, shard, progress)?;
        }
    } else if files.contains(&SINGLE_FILE) {
        fetch(&pinned, &info.sha, model_id, cache_dir, SINGLE_FILE, progress)?;
    } else {
        return Err(missing(&format!("safetensors weights ({SINGLE_FILE} or {SHARD_INDEX})")));
    }
    // The branch now points at the commit fetched, so an offline resolve
    // of the branch finds these files.
    let branch_cache = cache.repo(branch);
    branch_cache.create_ref(&info.sha).map_err(|e| Fetch::Failed(Error::cache_io(cache_dir, e)))?;
    Ok(repo_folder(cache_dir, model_id).join("snapshots").join(&info.sha))
}

/// One file of commit `commit` (which `repo` is pinned to): the cached
/// copy, else a download.
fn fetch(
    repo: &ApiRepo,
    commit: &str,
    model_id: &str,
    cache_dir: &Path,
    name: &str,
    progress: Option<&DownloadProgressFn>,
) -> Result<PathBuf, Fetch> {
    let cached = repo_folder(cache_dir, model_id).join("snapshots").join(commit).join(name);
    if cached.is_file() {
        return Ok(cached);
    }
    let mut reporter = Reporter { callback: progress, file: name, done: 0, total: 0, cancelled: false };
    let result = repo.download_with_progress(name, &mut reporter);
    if reporter.cancelled {
        return Err(Fetch::Failed(Error::Cancelled));
    }
    result.map_err(|e| classify(model_id, cache_dir, e))
}

/// Adapts the callback to `hf-hub`'s progress trait.
struct Reporter<'a> {
    callback: Option<&'a DownloadProgressFn>,
    file: &'a str,
    done: u64,
    total: u64,
    /// The callback asked to cancel (it is not called again).
    cancelled: bool,
}

impl Reporter<'_> {
    fn report(&mut self) {
        let Some(callback) = self.callback.filter(|_| !self.cancelled) else { return };
        let progress = DownloadProgress { file: self.file, bytes_done: self.done, bytes_total: self.total };
        self.cancelled = callback(progress).is_break();
    }
}

impl hf_hub::api::Progress for &mut Reporter<'_> {
    fn init(&mut self, size: usize, _filename: &str) {
        self.total = size as u64;
        self.done = 0;
        self.report();
    }

    fn update(&mut self, size: usize) {
        // Never past the total the server announced, so reports stay in range.
        self.done = self.done.saturating_add(size as u64).min(self.total);
        self.report();
    }

    fn finish(&mut self) {}
}

/// Sorts an `hf-hub` error: transport failures and server errors leave
/// the cache to try; local I/O is [`Error::CacheIo`]; a missing or
/// private repository is [`Error::CheckpointNotFound`].
fn classify(model_id: &str, cache_dir: &Path, e: ApiError) -> Fetch {
    match e {
        ApiError::IoError(io) => Fetch::Failed(Error::cache_io(cache_dir, io)),
        ApiError::RequestError(request) => match *request {
            ureq::Error::Status(code @ (401 | 403 | 404), _) => Fetch::Failed(not_found(
                model_id,
                cache_dir,
                format!("the hub answered {code}: no such repository, or it needs a token (HF_TOKEN or huggingface-cli login)"),
            )),
            other => Fetch::Unreachable(other.to_string()),
        },
        other => Fetch::Unreachable(other.to_string()),
    }
}
