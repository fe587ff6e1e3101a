//! Engines, models and sessions.

mod model;
mod sessions;

use std::ffi::c_char;

use qwen3_wgpu::{AdapterPolicy, Engine, KernelChoice, Model, Session};

pub(crate) use crate::owned::put_string;
use crate::{
    clear, init_options, invalid, out, put, q3w_status, read_options, run, shared, Options, Poisonable,
};
pub use model::*;
pub use sessions::*;

/// A GPU device with the engine's kernels compiled for it.
pub struct q3w_engine {
    engine: Engine,
}

/// A model loaded on an engine's device (its weights on the GPU).
pub struct q3w_model {
    pub(crate) model: Model,
}

/// A decoding session over a model: its KV cache and queued steps.
pub struct q3w_session {
    pub(crate) session: Session,
    /// Positions of the feed in progress (`q3w_session_begin_feed`), for
    /// `q3w_session_poll_feed` to report once it is ready.
    pub(crate) feed_total: usize,
    pub(crate) poisoned: bool,
}

impl q3w_session {
    /// A new handle over `session`.
    pub(crate) fn new(session: Session) -> Self {
        q3w_session { session, feed_total: 0, poisoned: false }
    }
}

impl Poisonable for q3w_session {
    fn poisoned(&mut self) -> &mut bool {
        &mut self.poisoned
    }
}

// Handles the header says may be shared between threads.
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    const fn moved_between_threads<T: Send>() {}
    shared_between_threads::<q3w_engine>();
    shared_between_threads::<q3w_model>();
    moved_between_threads::<q3w_session>();
};

/// `adapter_policy`: `QWEN3_WGPU_BACKEND` from the environment when set
/// (`metal` or `portable`), else Metal only.
pub const Q3W_ADAPTER_POLICY_DEFAULT: u32 = 0;
/// `adapter_policy`: Apple GPUs through Metal only; any other adapter is
/// `Q3W_NON_METAL_ADAPTER`.
pub const Q3W_ADAPTER_POLICY_METAL_ONLY: u32 = 1;
/// `adapter_policy`: any adapter (Vulkan, DX12, Metal), the same kernels.
pub const Q3W_ADAPTER_POLICY_PORTABLE: u32 = 2;

/// `kernels`: `QWEN3_WGPU_KERNELS` from the environment when set, else auto.
pub const Q3W_KERNELS_DEFAULT: u32 = 0;
/// `kernels`: the hand-written MSL kernels on Metal, WGSL elsewhere.
pub const Q3W_KERNELS_AUTO: u32 = 1;
/// `kernels`: WGSL everywhere.
pub const Q3W_KERNELS_WGSL: u32 = 2;

/// How to create an engine (`q3w_engine_options_init` sets the defaults).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_engine_options {
    /// `sizeof(q3w_engine_options)`, set by `q3w_engine_options_init`.
    pub struct_size: usize,
    /// A `Q3W_ADAPTER_POLICY_*` value (default `Q3W_ADAPTER_POLICY_DEFAULT`).
    pub adapter_policy: u32,
    /// A `Q3W_KERNELS_*` value (default `Q3W_KERNELS_DEFAULT`).
    pub kernels: u32,
}

impl Options for q3w_engine_options {
    const VERSION_SIZES: &'static [usize] = &[std::mem::size_of::<Self>()];
    fn defaults() -> Self {
        q3w_engine_options {
            struct_size: std::mem::size_of::<Self>(),
            adapter_policy: Q3W_ADAPTER_POLICY_DEFAULT,
            kernels: Q3W_KERNELS_DEFAULT,
        }
    }
}

/// Sets `options` to the defaults and its `struct_size` to `struct_size`,
/// which is `sizeof(q3w_engine_options)` as the caller's header declares it:
/// only that many bytes are written.
#[no_mangle]
pub unsafe extern "C" fn q3w_engine_options_init(
    options: *mut q3w_engine_options,
    struct_size: usize,
) -> q3w_status {
    // SAFETY: NULL or `struct_size` writable bytes, as the caller promises.
    run("q3w_engine_options_init", || unsafe { init_options(options, struct_size, "options") })
}

/// Creates an engine: picks the adapter under the policy, compiles the
/// kernels and runs their start-up self-check. `options` may be NULL (the
/// defaults). Free it with `q3w_engine_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_engine_new(
    options: *const q3w_engine_options,
    out_engine: *mut *mut q3w_engine,
) -> q3w_status {
    run("q3w_engine_new", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_engine) };
        out(out_engine, "out_engine")?;
        let options = unsafe { read_options(options, "options") }?;
        let mut builder = Engine::builder();
        builder = match options.adapter_policy {
            Q3W_ADAPTER_POLICY_DEFAULT => builder,
            Q3W_ADAPTER_POLICY_METAL_ONLY => builder.policy(AdapterPolicy::MetalOnly),
            Q3W_ADAPTER_POLICY_PORTABLE => builder.policy(AdapterPolicy::Portable),
            other => {
                return Err(invalid(
                    "adapter_policy",
                    format!("{other} is not a Q3W_ADAPTER_POLICY_* value (0, 1 or 2)"),
                ))
            }
        };
        builder = match options.kernels {
            Q3W_KERNELS_DEFAULT => builder,
            Q3W_KERNELS_AUTO => builder.kernels(KernelChoice::Auto),
            Q3W_KERNELS_WGSL => builder.kernels(KernelChoice::Wgsl),
            other => {
                return Err(invalid("kernels", format!("{other} is not a Q3W_KERNELS_* value (0, 1 or 2)")))
            }
        };
        let engine = Box::new(q3w_engine { engine: builder.build()? });
        unsafe { put(out_engine, Box::into_raw(engine)) };
        Ok(())
    })
}

/// Frees an engine (NULL is allowed). Models loaded on it stay valid.
#[no_mangle]
pub unsafe extern "C" fn q3w_engine_free(engine: *mut q3w_engine) -> q3w_status {
    run("q3w_engine_free", || {
        if !engine.is_null() {
            // SAFETY: a live engine handle, as the caller promises.
            drop(unsafe { Box::from_raw(engine) });
        }
        Ok(())
    })
}

/// Describes the engine's adapter and kernels, e.g.
/// `"Apple M2 (metal, msl kernels)"`: a string for `q3w_string_free`;
/// `out_len` (may be NULL) receives its length in bytes.
#[no_mangle]
pub unsafe extern "C" fn q3w_engine_describe(
    engine: *const q3w_engine,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_engine_describe", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_text) };
        let engine = &unsafe { shared(engine, "engine") }?.engine;
        out(out_text, "out_text")?;
        let info = engine.adapter_info();
        let description =
            format!("{} ({}, {} kernels)", info.name, info.backend.to_str(), engine.kernel_source().as_str());
        unsafe { put_string(&description, out_text, out_len) }
    })
}
