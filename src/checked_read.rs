//! One gate for every small file the engine reads whole: config.json,
//! generation_config.json, the shard index, tokenizer.json,
//! tokenizer_config.json, chat_template.jinja and the hub cache's refs.
//!
//! A checkpoint directory is data from elsewhere, so each of these files is
//! opened without blocking (a FIFO named `tokenizer.json` would otherwise
//! wait forever for a writer), must be a regular file once symbolic links
//! are followed (a link to `/dev/zero` would otherwise be read until memory
//! runs out), must be no larger than the bound for its kind, and is read
//! through `take(limit + 1)`, so a file that grows after its size was
//! checked still cannot pass the bound. Every refusal is
//! [`Error::CheckpointInvalid`] naming the file and saying why.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// Largest JSON file of a checkpoint read: config.json,
/// generation_config.json, the shard index and tokenizer_config.json. The
/// index of a 1,000-shard checkpoint is well under 1 MiB and Qwen3's
/// tokenizer_config.json about 10 KiB; a larger file is not one of these,
/// and reading it whole could exhaust memory.
pub const MAX_JSON_FILE_LEN: u64 = 64 << 20;

/// Largest `tokenizer.json` read: 256 MiB. Qwen3's is about 11 MB and the
/// largest vocabularies published (262,144 tokens) are under 40 MB; the
/// bound leaves room for those while refusing a file that could only
/// exhaust memory.
pub const MAX_TOKENIZER_FILE_LEN: u64 = 256 << 20;

/// Largest `chat_template.jinja` read: 1 MiB. Published chat templates
/// are a few KiB to a few tens of KiB.
pub const MAX_TEMPLATE_FILE_LEN: u64 = 1 << 20;

/// Largest hub cache `refs/<revision>` file read: it holds one commit hash.
#[cfg_attr(not(feature = "hub"), allow(dead_code))]
pub(crate) const MAX_REF_FILE_LEN: u64 = 4 << 10;

/// Reads the whole of `path`, `what` naming it in errors ("tokenizer",
/// "config"). `Ok(None)` when it does not exist; [`Error::CheckpointInvalid`]
/// naming the file when it is not a regular file (after following symbolic
/// links), is larger than `limit` bytes, or cannot be read.
pub fn read_file(path: &Path, what: &str, limit: u64) -> Result<Option<Vec<u8>>> {
    let mut file = match open_nonblocking(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::invalid(path, format!("cannot open the {what} file: {e}"))),
    };
    // The kind is checked on the open file, so nothing can be swapped in
    // between the check and the read.
    let meta =
        file.metadata().map_err(|e| Error::invalid(path, format!("cannot examine the {what} file: {e}")))?;
    if !meta.is_file() {
        return Err(Error::invalid(
            path,
            format!("the {what} file is {}, not a regular file", file_kind(&meta.file_type())),
        ));
    }
    if meta.len() > limit {
        return Err(Error::invalid(
            path,
            format!("the {what} file is {} bytes, more than the {limit} read for it", meta.len()),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut file)
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| Error::invalid(path, format!("cannot read the {what} file: {e}")))?;
    if bytes.len() as u64 > limit {
        return Err(Error::invalid(
            path,
            format!("the {what} file grew past the {limit} bytes read for it while being read"),
        ));
    }
    Ok(Some(bytes))
}

/// [`read_file`] for a file that must exist: missing is
/// [`Error::CheckpointNotFound`].
pub(crate) fn read_required(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>> {
    read_file(path, what, limit)?.ok_or_else(|| Error::CheckpointNotFound {
        path: path.to_path_buf(),
        reason: format!("the {what} file does not exist"),
    })
}

/// Opens for reading without waiting for a FIFO's writer (`O_NONBLOCK`,
/// which changes nothing for the regular files that are then read).
#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)
}

/// Elsewhere, opening does not block on the special files that exist there;
/// the kind is checked first all the same.
#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            Err(std::io::Error::other(format!("is {}, not a regular file", file_kind(&m.file_type()))))
        }
        _ => File::open(path),
    }
}

/// What a file is, in words, for errors about something that should be a
/// regular file or a directory.
pub(crate) fn file_kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_char_device() {
            return "a character device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_regular_files_within_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        assert!(read_file(&path, "test", 4).unwrap().is_none());
        assert_eq!(read_required(&path, "test", 4).unwrap_err().code(), "checkpoint_not_found");
        std::fs::write(&path, b"1234").unwrap();
        assert_eq!(read_file(&path, "test", 4).unwrap().unwrap(), b"1234");
        let e = read_file(&path, "test", 3).unwrap_err();
        assert_eq!(e.code(), "checkpoint_invalid");
        assert!(e.to_string().contains("4 bytes, more than the 3"), "{e}");
        let e = read_file(dir.path(), "test", 4).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn devices_and_fifos_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let zero = dir.path().join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_file(&zero, "test", 1 << 40).unwrap_err();
        assert!(e.to_string().contains("a character device"), "{e}");
        let fifo = dir.path().join("fifo.json");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let e = read_file(&fifo, "test", 1 << 40).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
    }
}
