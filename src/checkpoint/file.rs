//! One weights file: its memory map and parsed header, positioned reads of
//! its bytes, and its stamp (size and modification time).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::SafeTensors;

use super::SAFETENSORS_LEN_PREFIX;
use crate::config::{file_kind, regular_file_metadata};
use crate::error::{Error, Result};

/// One memory-mapped `.safetensors` file with its parsed header.
pub(super) struct WeightsFile {
    /// File name inside the checkpoint directory.
    pub(super) name: String,
    pub(super) path: PathBuf,
    /// The open file, for positioned reads of tensor data.
    file: File,
    pub(super) map: Mmap,
    /// Length of the JSON header (the `N` of the format).
    header_len: usize,
    pub(super) metadata: Metadata,
}

impl WeightsFile {
    /// Opens and maps `dir/name`. Every failure names the file: missing is
    /// [`Error::CheckpointNotFound`]; not a regular file (a directory, a
    /// FIFO whose open would block forever), unreadable, unmappable or
    /// malformed is [`Error::CheckpointInvalid`].
    pub(super) fn open(dir: &Path, name: &str) -> Result<Self> {
        let path = dir.join(name);
        if regular_file_metadata(&path)?.is_none() {
            return Err(Error::CheckpointNotFound { path, reason: "weights file does not exist".into() });
        }
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::CheckpointNotFound { path, reason: "weights file does not exist".into() })
            }
            Err(e) => return Err(Error::invalid(&path, format!("cannot open weights file: {e}"))),
        };
        // The handle's own metadata: what is mapped is a regular file even
        // if the path was swapped since the check above.
        let meta =
            file.metadata().map_err(|e| Error::invalid(&path, format!("cannot stat weights file: {e}")))?;
        if !meta.is_file() {
            let kind = file_kind(&meta.file_type());
            return Err(Error::invalid(&path, format!("is {kind}, not a regular file")));
        }
        let len = meta.len();
        if len < SAFETENSORS_LEN_PREFIX as u64 {
            // Mapping an empty file fails on some platforms; this reads better.
            return Err(Error::invalid(
                &path,
                format!("malformed safetensors: file is {len} bytes, shorter than its header length"),
            ));
        }
        // SAFETY: the map is read-only and private to this process. Its one
        // hazard is another process truncating or rewriting the file while it
        // is mapped (SIGBUS or torn reads). Checkpoint files are not modified
        // in place by their tools (downloads write elsewhere and rename), and
        // the map is what lets a multi-GB checkpoint be read without copying
        // it into the heap; callers must not edit a checkpoint while loading.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::invalid(&path, format!("cannot memory-map weights file: {e}")))?;
        // `SafeTensors::deserialize` is `read_metadata` plus a borrow of the
        // map; keeping the owned `Metadata` avoids a self-referential struct
        // while running the very same validation (header JSON, offsets
        // contiguous, sizes matching dtype*shape, buffer length exact).
        let (header_len, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| Error::invalid(&path, format!("malformed safetensors: {e}")))?;
        Ok(Self { name: name.to_string(), path, file, map, header_len, metadata })
    }

    /// The file's tensor bytes start here.
    pub(super) fn data_start(&self) -> usize {
        SAFETENSORS_LEN_PREFIX + self.header_len
    }

    /// The length prefix plus the JSON header: what identifies the file's
    /// layout for the cache key without reading the tensors.
    pub(super) fn header_bytes(&self) -> &[u8] {
        &self.map[..self.data_start()]
    }

    /// Fills `buf` from byte `offset` of the file with positioned reads.
    /// A file that ends early (truncated since it was opened) is
    /// [`Error::CheckpointInvalid`] naming it.
    pub(super) fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.saturating_add(buf.len() as u64);
        read_exact_at(&self.file, offset, buf).map_err(|e| {
            let reason = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!(
                    "file ends before byte {end} that its header promises \
                     (truncated or rewritten while being read; it was {} bytes when opened)",
                    self.map.len()
                )
            } else {
                format!("cannot read bytes {offset}..{end}: {e}")
            };
            Error::invalid(&self.path, reason)
        })
    }

    /// Size and modification time now.
    pub(super) fn stamp(&self) -> FileStamp {
        let meta = self.file.metadata().ok();
        FileStamp { len: meta.as_ref().map(|m| m.len()), modified: meta.and_then(|m| m.modified().ok()) }
    }
}

/// `read_exact` at an absolute offset, without moving a shared cursor (so
/// several threads can read one file).
pub(super) fn read_exact_at(file: &File, mut offset: u64, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        #[cfg(unix)]
        let n = std::os::unix::fs::FileExt::read_at(file, buf, offset);
        #[cfg(windows)]
        let n = std::os::windows::fs::FileExt::seek_read(file, buf, offset);
        match n {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A weights file's size and modification time, taken when the checkpoint
/// is fingerprinted and compared again before its conversion is cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    /// Size in bytes (`None` when the file could not be stat'ed).
    pub len: Option<u64>,
    /// Modification time, where the platform reports one.
    pub modified: Option<SystemTime>,
}
