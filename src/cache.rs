//! The on-disk cache of converted weights: where it lives, the file format
//! (read fully verified, written atomically) and the directory's
//! housekeeping. [`crate::load`] decides when to read or write it.
//!
//! # Cache file format (`<cache_dir>/<key>.q3w`)
//!
//! `<key>` is [`Checkpoint::fingerprint`](crate::checkpoint::Checkpoint::fingerprint): a sha256 over the cache format
//! version, the [`WeightFormat`] (so the int8 and int4 entries of one
//! checkpoint coexist), [`QUANT_GROUP`](crate::converted::QUANT_GROUP), config.json,
//! generation_config.json, every weights file's name, size and
//! safetensors header, and a digest of every byte of every tensor the
//! engine reads. So a checkpoint edited in place (even to the same sizes)
//! gets a new key and is converted again. Integers are little-endian except
//! the blob's scales (f32, int4's bf16) and f32 norms, which are
//! native-endian (guarded by the byte-order marker).
//!
//! | offset | size | content |
//! |---|---|---|
//! | 0 | 8 | magic `Q3WCACHE` |
//! | 8 | 4 | format version ([`CACHE_FORMAT_VERSION`]) |
//! | 12 | 4 | byte-order marker `0x01020304` in native order |
//! | 16 | 8 | header length `H` |
//! | 24 | 8 | blob offset `B` (a multiple of 4096, >= 104 + `H`) |
//! | 32 | 8 | blob length `L` |
//! | 40 | 64 | key, lower-case hex |
//! | 104 | `H` | JSON header: `{"config": ModelConfig, "index": WeightIndex, "blob_len": L, "source": checkpoint directory, "weights": "int8" or "int4"}` |
//! | 104 + `H` | | zero padding up to `B` |
//! | `B` | `L` | the blob (see [`crate::converted`]) |
//! | `B + L` | 4 | crc32 of the header bytes followed by the blob bytes |
//! | `B + L + 4` | 4 | zero |
//! | `B + L + 8` | 8 | end magic `Q3WEND\0\0` |
//!
//! A file that fails any check (size, magics, version, byte order, key,
//! lengths, checksum, header contents, layout) is logged, deleted and
//! rebuilt; it is never used. Files are written to a unique temporary name
//! in the same directory, fsynced and renamed into place, so the final name
//! only ever holds a complete file.
//!
//! Housekeeping after each write, so the directory does not grow without
//! bound: cache files of this format are deleted whose `source` is the same
//! checkpoint directory and whose `weights` the same format under another
//! key (the checkpoint changed since) or a directory that no longer exists (the checkpoint was deleted or
//! moved; a moved one converts again at its new path once its file is
//! gone).
//!
//! Temporary files are named `.<key>.<pid>.<n>.<nanos>.tmp` after their
//! writer's process id. Every load that uses the cache directory (cache
//! hits included) deletes the temporary files whose writer is no longer
//! running (a process killed mid-write) and those no writer has touched
//! for [`ABANDONED_TEMP_AGE`] (a reused process id, or a platform where
//! liveness cannot be asked).
//!
//! # What binds an entry to its checkpoint
//!
//! - The key: every byte the conversion reads is hashed (xxh3, in
//!   parallel; a cached load of Qwen3-0.6B hashes its 1.2 GB in a fraction
//!   of a second), so no edit, however small, reuses an old entry.
//! - The conversion re-hashes each tensor as it reads it and fails with
//!   `checkpoint_invalid` when the bytes differ from those the key was
//!   computed from, so an entry never holds weights other than its key's.
//! - Each weights file's size and modification time are taken before the
//!   hash; when either differs after the hash (a hit) or after the
//!   conversion (before the write), the checkpoint was written to while it
//!   was read: the load fails with `checkpoint_invalid` and nothing is
//!   cached. This cheap check catches a file still being copied or
//!   rewritten; the digests catch every other change.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::convert::{blob_bytes, plan_layout, planned_blob_len};
use crate::converted::{Blob, ConvertedModel, WeightFormat, WeightIndex, BLOB_ALIGN};
use crate::error::{Error, Result};
use crate::progress::{LoadPhase, Progress};
use crate::temp_file::TempFile;

/// Version of the cache file format; part of the key and of the preamble.
/// Bump it whenever the format or the conversion changes (3: the weight
/// format in the key, the header and each matrix of the index; 4: int4
/// scales in bf16).
pub const CACHE_FORMAT_VERSION: u32 = 4;

/// Extension of cache files.
pub const CACHE_EXTENSION: &str = "q3w";

const MAGIC: &[u8; 8] = b"Q3WCACHE";
const END_MAGIC: &[u8; 8] = b"Q3WEND\0\0";
const BYTE_ORDER_MARKER: u32 = 0x0102_0304;
const KEY_LEN: usize = 64;
/// Bytes before the JSON header.
pub const PREAMBLE_LEN: usize = 40 + KEY_LEN;
/// Bytes after the blob.
pub const FOOTER_LEN: usize = 16;
/// The blob starts at a multiple of this, so a memory map of the file hands
/// the GPU upload page-aligned data.
pub const BLOB_FILE_ALIGN: usize = 4096;
const _: () = assert!(BLOB_FILE_ALIGN.is_multiple_of(BLOB_ALIGN));

/// Temporary cache files untouched for this long are taken for the
/// leftovers of a killed writer even when a process of the writer's id
/// runs (a writer writes its file within seconds).
pub const ABANDONED_TEMP_AGE: Duration = Duration::from_secs(600);

/// Where converted weights are cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CachePolicy {
    /// `dirs::cache_dir()/qwen3-wgpu`. Failing to write there is only
    /// logged: the converted model is still returned.
    Default,
    /// This directory (created if needed). Failing to write there is
    /// [`Error::CacheIo`].
    Dir(PathBuf),
    /// Never read or write a cache.
    Disabled,
}

/// The directory `policy` names, or `None` for no caching (disabled, or no
/// platform cache directory for [`CachePolicy::Default`]).
pub fn cache_dir(policy: &CachePolicy) -> Option<PathBuf> {
    match policy {
        CachePolicy::Default => {
            let dir = dirs::cache_dir().map(|d| d.join("qwen3-wgpu"));
            if dir.is_none() {
                log::warn!("no platform cache directory; the converted weights will not be cached");
            }
            dir
        }
        CachePolicy::Dir(d) => Some(d.clone()),
        CachePolicy::Disabled => None,
    }
}

#[derive(serde::Serialize)]
struct HeaderOut<'a> {
    config: &'a ModelConfig,
    index: &'a WeightIndex,
    blob_len: usize,
    /// The checkpoint directory converted (canonical where possible): what
    /// the housekeeping matches on, with `weights`.
    source: &'a str,
    weights: WeightFormat,
}

#[derive(serde::Deserialize)]
struct HeaderIn {
    config: ModelConfig,
    index: WeightIndex,
    blob_len: usize,
}

/// The magic and format version at the start of a cache file's preamble.
fn check_format(preamble: &[u8]) -> Result<(), String> {
    if &preamble[0..8] != MAGIC {
        return Err("bad magic".into());
    }
    let version = u32_at(preamble, 8);
    if version != CACHE_FORMAT_VERSION {
        return Err(format!("format version {version}, expected {CACHE_FORMAT_VERSION}"));
    }
    Ok(())
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

/// Why a cache file was not used.
enum Rejected {
    /// The file must not be used, for this reason.
    Invalid(String),
    /// The load was cancelled while the file was verified.
    Cancelled,
}

impl From<String> for Rejected {
    fn from(reason: String) -> Self {
        Rejected::Invalid(reason)
    }
}

impl From<&str> for Rejected {
    fn from(reason: &str) -> Self {
        Rejected::Invalid(reason.to_string())
    }
}

/// Bytes checksummed between two progress reports while a cache file is
/// verified.
const VERIFY_CHUNK: usize = 8 << 20;

/// Reads and fully verifies a cache file of `cfg` converted to `weights`, reporting the checksum's pass
/// over it as [`LoadPhase::ReadingCache`]. `Ok(Ok(None))`: no file.
/// `Ok(Err)`: the reason the file must not be used. `Err`:
/// [`Error::Cancelled`] (the file is left as it is).
pub(crate) fn read_cache(
    path: &Path,
    key: &str,
    cfg: &ModelConfig,
    weights: WeightFormat,
    progress: &Progress<'_>,
) -> Result<Result<Option<ConvertedModel>, String>> {
    match verify_cache(path, key, cfg, weights, progress) {
        Ok(model) => Ok(Ok(model)),
        Err(Rejected::Invalid(reason)) => Ok(Err(reason)),
        Err(Rejected::Cancelled) => Err(Error::Cancelled),
    }
}

/// [`read_cache`]'s work.
fn verify_cache(
    path: &Path,
    key: &str,
    cfg: &ModelConfig,
    weights: WeightFormat,
    progress: &Progress<'_>,
) -> Result<Option<ConvertedModel>, Rejected> {
    // The type first: opening a FIFO for reading would block until a writer came.
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => return Err("not a regular file".into()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot stat: {e}").into()),
    }
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot open: {e}").into()),
    };
    let file_len = file.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    if !file.metadata().map(|m| m.is_file()).unwrap_or(false) {
        return Err("not a regular file".into());
    }
    if file_len < (PREAMBLE_LEN + FOOTER_LEN) as u64 {
        return Err(format!("truncated: {file_len} bytes").into());
    }
    // SAFETY: read-only private map. Cache files are only ever replaced by
    // rename, never rewritten in place, so a concurrent writer swaps the
    // inode instead of changing the bytes under this map; only outside
    // tampering with the file could (as with any mmap) fault the reader.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot memory-map: {e}"))?;
    let b: &[u8] = &map;
    // From here every index into `b` is below PREAMBLE_LEN or checked.
    check_format(b)?;
    let marker = u32::from_ne_bytes([b[12], b[13], b[14], b[15]]);
    if marker != BYTE_ORDER_MARKER {
        return Err("written on a host with another byte order".into());
    }
    if &b[40..40 + KEY_LEN] != key.as_bytes() {
        return Err("key does not match the checkpoint".into());
    }
    let to_usize = |v: u64, what: &str| usize::try_from(v).map_err(|_| format!("{what} {v} too large"));
    let header_len = to_usize(u64_at(b, 16), "header length")?;
    let blob_offset = to_usize(u64_at(b, 24), "blob offset")?;
    let blob_len = to_usize(u64_at(b, 32), "blob length")?;
    let header_end = PREAMBLE_LEN.checked_add(header_len).ok_or("header length overflows")?;
    if !blob_offset.is_multiple_of(BLOB_FILE_ALIGN) || blob_offset < header_end {
        return Err(format!("blob offset {blob_offset} misplaced (header ends at {header_end})").into());
    }
    let blob_end = blob_offset.checked_add(blob_len).ok_or("blob length overflows")?;
    let expected_len = blob_end.checked_add(FOOTER_LEN).ok_or("blob length overflows")?;
    if expected_len as u64 != file_len {
        return Err(format!(
            "file is {file_len} bytes, its preamble implies {expected_len} (truncated or extended)"
        )
        .into());
    }
    let header = &b[PREAMBLE_LEN..header_end];
    let blob = &b[blob_offset..blob_end];
    let footer = &b[blob_end..];
    if &footer[8..16] != END_MAGIC {
        return Err("bad end magic".into());
    }
    let mut crc = crc32fast::Hasher::new();
    let cancelled = |_| Rejected::Cancelled;
    progress.begin(LoadPhase::ReadingCache, (header.len() + blob.len()) as u64).map_err(cancelled)?;
    crc.update(header);
    progress.advance(header.len() as u64).map_err(cancelled)?;
    for chunk in blob.chunks(VERIFY_CHUNK) {
        crc.update(chunk);
        progress.advance(chunk.len() as u64).map_err(cancelled)?;
    }
    progress.end().map_err(cancelled)?;
    let (computed, stored) = (crc.finalize(), u32_at(footer, 0));
    if computed != stored {
        return Err(format!("checksum mismatch (stored {stored:08x}, computed {computed:08x})").into());
    }
    let parsed: HeaderIn = serde_json::from_slice(header).map_err(|e| format!("malformed header: {e}"))?;
    if parsed.blob_len != blob_len {
        return Err("header and preamble disagree on the blob length".into());
    }
    if &parsed.config != cfg {
        return Err("cached config differs from config.json".into());
    }
    // The index must be exactly what conversion would produce, so every
    // range the GPU side reads is in bounds and aligned.
    if planned_blob_len(cfg, weights) != Some(blob_len) {
        return Err("blob length differs from the planned layout".into());
    }
    let (planned, planned_len) = plan_layout(cfg, weights);
    if parsed.index != planned || planned_len != blob_len {
        return Err("weight index differs from the planned layout".into());
    }
    Ok(Some(ConvertedModel {
        config: parsed.config,
        index: parsed.index,
        blob: Blob::Mapped(map),
        blob_start: blob_offset,
    }))
}

/// Writes `model` to `path` atomically (see the module docs), reporting
/// [`LoadPhase::WritingCache`] through `progress` (bytes: the whole file).
/// Errors: [`Error::CacheIo`]; [`Error::Cancelled`] when `progress`
/// cancels. On any error the temporary file is deleted and `path` is left
/// as it was.
pub(crate) fn write_cache(
    path: &Path,
    key: &str,
    source: &str,
    model: &ConvertedModel,
    progress: &Progress<'_>,
) -> Result<()> {
    let io = |what: &str, e: &dyn std::fmt::Display| Error::cache_io(path, format!("{what}: {e}"));
    if key.len() != KEY_LEN {
        return Err(io("bad key", &key));
    }
    let blob = blob_bytes(model).ok_or_else(|| io("bad blob", &"blob_start past the end"))?;
    let header = serde_json::to_vec(&HeaderOut {
        config: &model.config,
        index: &model.index,
        blob_len: blob.len(),
        source,
        weights: model.index.weights,
    })
    .map_err(|e| io("cannot serialize header", &e))?;
    let blob_offset = (PREAMBLE_LEN + header.len()).next_multiple_of(BLOB_FILE_ALIGN);

    let mut preamble = Vec::with_capacity(PREAMBLE_LEN);
    preamble.extend_from_slice(MAGIC);
    preamble.extend_from_slice(&CACHE_FORMAT_VERSION.to_le_bytes());
    preamble.extend_from_slice(&BYTE_ORDER_MARKER.to_ne_bytes());
    preamble.extend_from_slice(&(header.len() as u64).to_le_bytes());
    preamble.extend_from_slice(&(blob_offset as u64).to_le_bytes());
    preamble.extend_from_slice(&(blob.len() as u64).to_le_bytes());
    preamble.extend_from_slice(key.as_bytes());
    debug_assert_eq!(preamble.len(), PREAMBLE_LEN);

    let padding = vec![0u8; blob_offset - PREAMBLE_LEN - header.len()];
    let file_len = blob_offset + blob.len() + FOOTER_LEN;
    progress.begin(LoadPhase::WritingCache, file_len as u64)?;

    let dir = path.parent().ok_or_else(|| io("bad cache path", &"no parent directory"))?;
    let (mut file, temp) = TempFile::create(dir, key).map_err(|e| io("cannot create temporary file", &e))?;
    // The checksum is taken as the blob is written: one pass over it.
    let mut crc = crc32fast::Hasher::new();
    crc.update(&header);
    let leading = [&preamble[..], &header, &padding];
    let blob_chunks = blob.chunks(WRITE_CHUNK);
    for (i, part) in leading.into_iter().chain(blob_chunks).enumerate() {
        if i >= leading.len() {
            crc.update(part);
        }
        file.write_all(part).map_err(|e| io("cannot write cache file", &e))?;
        progress.advance(part.len() as u64)?;
    }
    let mut footer = Vec::with_capacity(FOOTER_LEN);
    footer.extend_from_slice(&crc.finalize().to_le_bytes());
    footer.extend_from_slice(&[0u8; 4]);
    footer.extend_from_slice(END_MAGIC);
    file.write_all(&footer).map_err(|e| io("cannot write cache file", &e))?;
    // The last chance to cancel before the file takes its final name.
    progress.advance(footer.len() as u64)?;
    progress.end()?;
    temp.persist(file, path).map_err(|(step, e)| match step {
        "sync" => io("cannot sync cache file", &e),
        _ => io("cannot rename cache file into place", &e),
    })
}

/// Bytes written between two progress reports.
const WRITE_CHUNK: usize = 8 << 20;

/// The housekeeping after writing the cache file of `key` for the checkpoint
/// `source` converted to `weights` into `dir` (see the module docs).
/// Failures are only logged: a file another process holds, or one that
/// vanished meanwhile, stays or goes on its own.
pub(crate) fn remove_stale_files(dir: &Path, key: &str, source: &str, weights: WeightFormat) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let own = format!("{key}.{CACHE_EXTENSION}");
    let extension = format!(".{CACHE_EXTENSION}");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        let stale = if let Some(writer) = temp_writer(name) {
            is_abandoned_temp(&entry, writer)
        } else if name != own && name.ends_with(&extension) {
            cache_source(&path).is_some_and(|(s, w)| (s == source && w == weights) || !Path::new(&s).is_dir())
        } else {
            false
        };
        if stale {
            match std::fs::remove_file(&path) {
                Ok(()) => log::info!("deleted stale weight cache file {}", path.display()),
                Err(e) => log::warn!("cannot delete stale weight cache file {}: {e}", path.display()),
            }
        }
    }
}

/// The writer's process id when `name` is a temporary cache file
/// (`TempFile::create` named after a key): `.{64 hex}.{pid}.{n}.{nanos}.tmp`.
fn temp_writer(name: &str) -> Option<u64> {
    let (stem, pid) = TempFile::parse_name(name)?;
    (stem.len() == KEY_LEN && stem.bytes().all(|b| b.is_ascii_hexdigit())).then_some(pid)
}

/// Whether the temporary file `entry`, written by process `writer`, is
/// abandoned: its writer is not running, or it has not been touched for
/// [`ABANDONED_TEMP_AGE`].
fn is_abandoned_temp(entry: &std::fs::DirEntry, writer: u64) -> bool {
    if writer != u64::from(std::process::id()) && process_alive(writer) == Some(false) {
        return true;
    }
    let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    age.is_some_and(|a| a >= ABANDONED_TEMP_AGE)
}

/// Whether a process with id `pid` runs on this host; `None` when that
/// cannot be told (not unix, or an id that is no process id).
fn process_alive(pid: u64) -> Option<bool> {
    #[cfg(unix)]
    {
        let pid = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
        // SAFETY: signal 0 sends nothing; kill only checks that the process
        // exists and may be signalled. EPERM means it exists (another user's).
        let rc = unsafe { libc::kill(pid, 0) };
        if rc == 0 {
            return Some(true);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ESRCH) => Some(false),
            Some(libc::EPERM) => Some(true),
            _ => None,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        None
    }
}

/// Deletes the abandoned temporary files (see the module docs) in `dir`.
/// Failures are only logged, and a missing directory is no error.
pub(crate) fn remove_abandoned_temp_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(writer) = name.to_str().and_then(temp_writer) else { continue };
        if is_abandoned_temp(&entry, writer) {
            let path = entry.path();
            match std::fs::remove_file(&path) {
                Ok(()) => log::info!("deleted abandoned temporary cache file {}", path.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => log::warn!("cannot delete abandoned temporary cache file {}: {e}", path.display()),
            }
        }
    }
}

/// The `source` and `weights` of a cache file of this format version, read
/// from its preamble and JSON header only; `None` for anything else.
fn cache_source(path: &Path) -> Option<(String, WeightFormat)> {
    use std::io::Read;
    #[derive(serde::Deserialize)]
    struct Source {
        source: Option<String>,
        weights: WeightFormat,
    }
    let mut file = File::open(path).ok()?;
    let mut preamble = [0u8; PREAMBLE_LEN];
    file.read_exact(&mut preamble).ok()?;
    check_format(&preamble).ok()?;
    // A header is a few hundred kB at most; anything larger is not ours.
    let header_len = usize::try_from(u64_at(&preamble, 16)).ok().filter(|&n| n <= 1 << 24)?;
    let mut header = vec![0u8; header_len];
    file.read_exact(&mut header).ok()?;
    let Source { source, weights } = serde_json::from_slice(&header).ok()?;
    Some((source?, weights))
}
