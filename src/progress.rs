//! Load progress: the phases of a load, what each reports, and the
//! reporter the loading steps share (which turns the caller's `Break` into
//! [`Error::Cancelled`]).

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// A phase of loading a model, in the order the phases run: [`Hashing`](Self::Hashing)
/// (only with a cache), then [`ReadingCache`](Self::ReadingCache) on a cache hit or
/// [`Converting`](Self::Converting) and [`WritingCache`](Self::WritingCache) (only
/// with a cache) on a miss, then [`Uploading`](Self::Uploading).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LoadPhase {
    /// Hashing every tensor byte the engine reads, for the cache key.
    Hashing,
    /// Reading and verifying the cached conversion (its checksum covers
    /// every byte).
    ReadingCache,
    /// Converting the checkpoint's weights to int8; bytes are those of the
    /// checkpoint's tensors.
    Converting,
    /// Writing the converted weights to the cache file.
    WritingCache,
    /// Uploading the converted weights to the GPU.
    Uploading,
}

impl LoadPhase {
    /// The phase's stable name: `hashing`, `reading_cache`, `converting`,
    /// `writing_cache` or `uploading`.
    pub fn as_str(&self) -> &'static str {
        match self {
            LoadPhase::Hashing => "hashing",
            LoadPhase::ReadingCache => "reading_cache",
            LoadPhase::Converting => "converting",
            LoadPhase::WritingCache => "writing_cache",
            LoadPhase::Uploading => "uploading",
        }
    }
}

/// How far a load has come: the phase, and the bytes of it done out of its
/// total. Within a phase `bytes_done` never decreases; each phase is first
/// reported with 0 bytes done, and, unless the load fails or is cancelled,
/// last with `bytes_done == bytes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadProgress {
    /// The phase running.
    pub phase: LoadPhase,
    /// Bytes of the phase done.
    pub bytes_done: u64,
    /// Bytes the phase handles in all.
    pub bytes_total: u64,
}

/// A load progress callback (see [`LoadOptions::on_progress`](crate::LoadOptions::on_progress)):
/// returning [`ControlFlow::Break`] cancels the load.
pub type LoadProgressFn = dyn Fn(LoadProgress) -> ControlFlow<()> + Send + Sync;

/// Reports a load's progress to an optional callback, from any thread, and
/// remembers a cancellation. Reports are serialized and never go backwards
/// within a phase; a thread that finds another reporting skips its report
/// (a later one carries its bytes), so a slow callback never stalls the
/// workers.
pub struct Progress<'a> {
    callback: Option<&'a LoadProgressFn>,
    /// Bytes done in the current phase.
    done: AtomicU64,
    cancelled: AtomicBool,
    /// The current phase, its total and the bytes last reported.
    reported: Mutex<(LoadPhase, u64, u64)>,
}

impl<'a> Progress<'a> {
    /// Reports to `callback` (nothing when `None`; then nothing cancels).
    pub fn new(callback: Option<&'a LoadProgressFn>) -> Self {
        Progress {
            callback,
            done: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            reported: Mutex::new((LoadPhase::Hashing, 0, 0)),
        }
    }

    /// Reports nothing and never cancels.
    pub fn none() -> Progress<'static> {
        Progress::new(None)
    }

    /// Starts `phase`, of `total` bytes, reporting 0 bytes done.
    /// [`Error::Cancelled`] when the load was (or now is) cancelled.
    pub fn begin(&self, phase: LoadPhase, total: u64) -> Result<()> {
        self.check()?;
        let Some(callback) = self.callback else { return Ok(()) };
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        self.done.store(0, Ordering::Relaxed);
        *reported = (phase, total, 0);
        self.call(callback, phase, 0, total)
    }

    /// Counts `bytes` more done in the current phase and reports the total
    /// so far unless another thread is reporting. [`Error::Cancelled`] when
    /// the load was (or now is) cancelled.
    pub fn advance(&self, bytes: u64) -> Result<()> {
        self.check()?;
        let Some(callback) = self.callback else { return Ok(()) };
        self.done.fetch_add(bytes, Ordering::Relaxed);
        let Ok(mut reported) = self.reported.try_lock() else { return Ok(()) };
        let (phase, total, last) = *reported;
        // Read under the lock: whoever reports next sees at least this.
        let done = self.done.load(Ordering::Relaxed).min(total);
        if done <= last {
            return Ok(());
        }
        reported.2 = done;
        self.call(callback, phase, done, total)
    }

    /// Ends the current phase: reports its bytes done if a report was
    /// skipped. [`Error::Cancelled`] when the load was (or now is) cancelled.
    pub fn end(&self) -> Result<()> {
        self.check()?;
        let Some(callback) = self.callback else { return Ok(()) };
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        let (phase, total, last) = *reported;
        let done = self.done.load(Ordering::Relaxed).min(total);
        if done <= last {
            return Ok(());
        }
        reported.2 = done;
        self.call(callback, phase, done, total)
    }

    /// [`Error::Cancelled`] once the callback has asked to cancel.
    pub fn check(&self) -> Result<()> {
        match self.cancelled.load(Ordering::Relaxed) {
            true => Err(Error::Cancelled),
            false => Ok(()),
        }
    }

    /// Whether the callback has asked to cancel.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    fn call(&self, callback: &LoadProgressFn, phase: LoadPhase, done: u64, total: u64) -> Result<()> {
        let progress = LoadProgress { phase, bytes_done: done, bytes_total: total };
        if callback(progress).is_break() {
            self.cancelled.store(true, Ordering::Relaxed);
            return Err(Error::Cancelled);
        }
        Ok(())
    }
}
