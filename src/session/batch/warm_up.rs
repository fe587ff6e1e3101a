//! A batch's row pipelines built before its steps need them: a thread of
//! the batch's own builds and proves the batched-row matvec pipelines of
//! every session count it can step (up to [`WARM_UP_MAX_ROWS`]), the full
//! count first (a step of fewer rows may run in it meanwhile:
//! [`crate::qwen3::padded_rows`]), so its steps run at their steady speed
//! from the first (a step with no such pipeline ready runs each row
//! through the one-token pipeline: the same tokens, the matrices read once
//! per row; a blocking step builds what is missing on the caller's
//! thread).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::gpu_weights::ModelGpu;
use crate::qwen3::BatchForward;

/// The largest session count a batch's warm-up builds pipelines for
/// (larger counts build theirs on first use): each count costs one
/// pipeline build and proof per matrix shape (~6 for a Qwen3).
pub const WARM_UP_MAX_ROWS: usize = 16;

/// The warm-up thread; dropping it (the batch) stops it after the build
/// in progress and waits for that (none is left inside the driver as the
/// process exits: a C host that frees the batch and returns from `main`
/// would otherwise exit under a thread compiling in the driver).
pub(super) struct WarmUp {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl WarmUp {
    /// Starts building `forward`'s row pipelines for 1..=`slots` rows
    /// (at most [`WARM_UP_MAX_ROWS`]), the most rows first. `None` if
    /// the system refused a thread (each count's pipelines are then built
    /// on first use).
    pub(super) fn start(model: Arc<ModelGpu>, forward: &BatchForward, slots: usize) -> Option<WarmUp> {
        let specs = forward.matvec_specs();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let counts = (1..=slots.min(WARM_UP_MAX_ROWS) as u32).rev();
        let build = move || {
            for rows in counts {
                for &(kernel, split, shape, format) in &specs {
                    if stopped.load(Ordering::Relaxed) {
                        return;
                    }
                    model.kernels.warm_rows_pipeline(&model.gpu, kernel, split, shape, format, rows);
                }
            }
        };
        let thread = std::thread::Builder::new().name("qwen3-wgpu batch warm-up".into()).spawn(build).ok()?;
        Some(WarmUp { stop, thread: Some(thread) })
    }

    /// Whether every pipeline is built (or failed and will not be used).
    pub(super) fn is_done(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits until [`Self::is_done`].
    pub(super) fn wait(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for WarmUp {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wait();
    }
}
