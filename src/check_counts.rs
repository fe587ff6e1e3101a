//! Counts of the load step's checks on this thread (test builds only), so
//! tests can hold a load to one check of each kind.

use std::cell::Cell;
use std::thread::LocalKey;

thread_local! {
    /// Checks that the checkpoint path is a directory.
    pub(crate) static DIRECTORY: Cell<usize> = const { Cell::new(0) };
    /// Checks of config.json against the shapes the engine runs.
    pub(crate) static ENGINE_SHAPE: Cell<usize> = const { Cell::new(0) };
    /// Validations of the checkpoint's tensors against its config.
    pub(crate) static VALIDATION: Cell<usize> = const { Cell::new(0) };
}

pub(crate) fn count(counter: &'static LocalKey<Cell<usize>>) {
    counter.with(|c| c.set(c.get() + 1));
}

/// The count so far, and resets it.
pub(crate) fn take(counter: &'static LocalKey<Cell<usize>>) -> usize {
    counter.with(|c| c.replace(0))
}
