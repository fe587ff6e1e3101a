//! Files written whole or not at all: the bytes go to a temporary file with
//! a unique name beside the target, which is fsynced and renamed into place
//! ([`TempFile::persist`]), so the target name only ever holds a complete
//! file; a temporary file not persisted is deleted when dropped (an error,
//! a cancellation, a panic). Used by the conversion cache and session files.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A temporary file being written, deleted on drop unless persisted.
pub(crate) struct TempFile {
    path: PathBuf,
    dir: PathBuf,
    keep: bool,
}

impl TempFile {
    /// Creates `.{stem}.{pid}.{n}.{nanos}.tmp` in `dir`, a name no other
    /// writer (thread or process) uses, open for writing.
    pub(crate) fn create(dir: &Path, stem: &str) -> std::io::Result<(File, TempFile)> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let pid = std::process::id();
        let mut last_err = None;
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let path = dir.join(format!(".{stem}.{pid}.{n}.{nanos}.tmp"));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => return Ok((f, TempFile { path, dir: dir.to_path_buf(), keep: false })),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| std::io::Error::other("no unique temporary name")))
    }

    /// Syncs `file` (this temporary file, fully written), closes it and
    /// renames it to `target` (in the same directory), then syncs the
    /// directory so the rename itself is durable (not fatal where a
    /// directory cannot be opened or synced). Errors name the step: "sync"
    /// or "rename".
    pub(crate) fn persist(mut self, file: File, target: &Path) -> Result<(), (&'static str, std::io::Error)> {
        file.sync_all().map_err(|e| ("sync", e))?;
        drop(file);
        std::fs::rename(&self.path, target).map_err(|e| ("rename", e))?;
        self.keep = true;
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// The temporary file's name's parts after the dot and before `.tmp`:
    /// `(stem, pid)` when `name` is one of [`Self::create`]'s names.
    pub(crate) fn parse_name(name: &str) -> Option<(&str, u64)> {
        let inner = name.strip_prefix('.')?.strip_suffix(".tmp")?;
        let mut parts = inner.rsplitn(4, '.');
        let (nanos, n, pid, stem) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        // A pid too long for a u64 is still a temp name; 0 is never a writer.
        (digits(nanos) && digits(n) && digits(pid)).then(|| (stem, pid.parse().unwrap_or(0)))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_temporary_file_is_deleted_unless_persisted_and_its_name_parses() {
        let dir = tempfile::tempdir().unwrap();
        let (_, dropped) = TempFile::create(dir.path(), "a.b").unwrap();
        let dropped_path = dropped.path.clone();
        let name = dropped_path.file_name().unwrap().to_str().unwrap().to_string();
        assert_eq!(TempFile::parse_name(&name), Some(("a.b", u64::from(std::process::id()))));
        drop(dropped);
        assert!(!dropped_path.exists());

        let (mut file, kept) = TempFile::create(dir.path(), "a.b").unwrap();
        std::io::Write::write_all(&mut file, b"whole").unwrap();
        let target = dir.path().join("target");
        kept.persist(file, &target).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"whole");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "only the target is left");
        for bad in [".a.1.2.tmp", "a.1.2.3.tmp", ".a.1.x.3.tmp", ".a.1.2.3"] {
            assert_eq!(TempFile::parse_name(bad), None, "{bad}");
        }
    }
}
