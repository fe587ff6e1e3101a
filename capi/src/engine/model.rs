//! Loading a model: the load options, progress reports through a C
//! callback, and the model's queries.

use std::ffi::{c_char, c_void, CStr};
use std::ops::ControlFlow;
use std::panic::catch_unwind;
use std::path::PathBuf;

use qwen3_wgpu::{CachePolicy, LoadOptions, LoadPhase, LoadProgress, ShapeProfile, WeightFormat};

use super::{q3w_engine, q3w_model};
use crate::{
    clear, init_options, invalid, optional_text, out, put, q3w_status, read_options, run, shared, text,
    Options,
};

/// `cache_policy`: the platform cache directory's `qwen3-wgpu/` (failing to
/// write there is only logged).
pub const Q3W_CACHE_DEFAULT: u32 = 0;
/// `cache_policy`: the directory `cache_dir` (created if needed; failing to
/// write there is `Q3W_CACHE_IO`).
pub const Q3W_CACHE_DIR: u32 = 1;
/// `cache_policy`: never read or write converted weights.
pub const Q3W_CACHE_DISABLED: u32 = 2;

/// `shape_profile`: any Qwen3 shape the engine runs.
pub const Q3W_SHAPE_ANY_QWEN3: u32 = 0;
/// `shape_profile`: exactly Qwen3-0.6B's shape, else
/// `Q3W_UNSUPPORTED_CHECKPOINT_ARCHITECTURE`.
pub const Q3W_SHAPE_QWEN3_0_6B: u32 = 1;

/// `weights`: the format `QWEN3_WGPU_WEIGHTS` names, else int8.
pub const Q3W_WEIGHTS_DEFAULT: u32 = 0;
/// `weights`: int8 layer weights (one f32 scale per group of 64).
pub const Q3W_WEIGHTS_INT8: u32 = 1;
/// `weights`: 4-bit layer weights (one f32 scale per group of 64), about
/// 57% of int8's memory; the embedding and the LM head stay int8.
pub const Q3W_WEIGHTS_INT4: u32 = 2;

/// How to load a checkpoint (`q3w_load_options_init` sets the defaults).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_load_options {
    /// `sizeof(q3w_load_options)`, set by `q3w_load_options_init`.
    pub struct_size: usize,
    /// A `Q3W_CACHE_*` value (default `Q3W_CACHE_DEFAULT`).
    pub cache_policy: u32,
    /// A `Q3W_SHAPE_*` value (default `Q3W_SHAPE_ANY_QWEN3`).
    pub shape_profile: u32,
    /// The cache directory with `Q3W_CACHE_DIR` (UTF-8); NULL otherwise.
    pub cache_dir: *const c_char,
    /// Since version 2: NULL (the default), or called as the load
    /// progresses (see `q3w_load_progress_fn`); returning anything but
    /// `Q3W_PROGRESS_CONTINUE` cancels the load.
    pub progress: q3w_load_progress_fn,
    /// Since version 2: passed to `progress` as it is (default NULL).
    pub progress_user_data: *mut c_void,
    /// Since version 3: a `Q3W_WEIGHTS_*` value (default
    /// `Q3W_WEIGHTS_DEFAULT`). Int8 and int4 conversions of one checkpoint
    /// are cached side by side.
    pub weights: u32,
}

impl Options for q3w_load_options {
    // Version 1 ended at `cache_dir`; version 2 added the progress
    // callback, version 3 the weight format.
    const VERSION_SIZES: &'static [usize] = &[
        std::mem::offset_of!(q3w_load_options, progress),
        std::mem::offset_of!(q3w_load_options, weights),
        std::mem::size_of::<Self>(),
    ];
    fn defaults() -> Self {
        q3w_load_options {
            struct_size: std::mem::size_of::<Self>(),
            cache_policy: Q3W_CACHE_DEFAULT,
            shape_profile: Q3W_SHAPE_ANY_QWEN3,
            cache_dir: std::ptr::null(),
            progress: None,
            progress_user_data: std::ptr::null_mut(),
            weights: Q3W_WEIGHTS_DEFAULT,
        }
    }
}

/// A load progress callback: `phase` is a `Q3W_LOAD_PHASE_*` value,
/// `bytes_done` of `bytes_total` bytes of that phase are done. Each phase
/// is reported first with 0 bytes done and, unless the load fails or is
/// cancelled, last with `bytes_done == bytes_total`; within a phase
/// `bytes_done` never decreases. Called on the loading thread or on the
/// load's worker threads, one call at a time; it must return (not throw a
/// C++ exception or `longjmp` out). Returns `Q3W_PROGRESS_CONTINUE` to go
/// on; any other value cancels the load: `q3w_model_load` then returns
/// `Q3W_CANCELLED` and leaves no cache or temporary file behind.
pub type q3w_load_progress_fn = Option<
    unsafe extern "C" fn(user_data: *mut c_void, phase: u32, bytes_done: u64, bytes_total: u64) -> i32,
>;

/// Returned by a `q3w_load_progress_fn`: go on loading.
pub const Q3W_PROGRESS_CONTINUE: i32 = 0;
/// Returned by a `q3w_load_progress_fn` (as is any value but
/// `Q3W_PROGRESS_CONTINUE`): cancel the load.
pub const Q3W_PROGRESS_CANCEL: i32 = 1;

/// Load phase: hashing every tensor byte the engine reads, for the cache
/// key (only with a cache).
pub const Q3W_LOAD_PHASE_HASHING: u32 = 1;
/// Load phase: reading and verifying the cached conversion.
pub const Q3W_LOAD_PHASE_READING_CACHE: u32 = 2;
/// Load phase: converting the checkpoint's weights to int8.
pub const Q3W_LOAD_PHASE_CONVERTING: u32 = 3;
/// Load phase: writing the converted weights to the cache file.
pub const Q3W_LOAD_PHASE_WRITING_CACHE: u32 = 4;
/// Load phase: uploading the converted weights to the GPU.
pub const Q3W_LOAD_PHASE_UPLOADING: u32 = 5;

/// Each load phase with its `Q3W_LOAD_PHASE_*` value, in the order they run.
const LOAD_PHASES: [(LoadPhase, u32); 5] = [
    (LoadPhase::Hashing, Q3W_LOAD_PHASE_HASHING),
    (LoadPhase::ReadingCache, Q3W_LOAD_PHASE_READING_CACHE),
    (LoadPhase::Converting, Q3W_LOAD_PHASE_CONVERTING),
    (LoadPhase::WritingCache, Q3W_LOAD_PHASE_WRITING_CACHE),
    (LoadPhase::Uploading, Q3W_LOAD_PHASE_UPLOADING),
];

/// The stable name of a `Q3W_LOAD_PHASE_*` value (`"hashing"`,
/// `"reading_cache"`, `"converting"`, `"writing_cache"`, `"uploading"`),
/// as the Rust crate's `LoadPhase::as_str` spells it; `"unknown"` for any
/// other value. A static string: never freed, never NULL.
#[no_mangle]
pub extern "C" fn q3w_load_phase_name(phase: u32) -> *const c_char {
    static NAMES: [&CStr; 5] = [c"hashing", c"reading_cache", c"converting", c"writing_cache", c"uploading"];
    let name = catch_unwind(|| LOAD_PHASES.iter().position(|(_, value)| *value == phase).map(|i| NAMES[i]));
    name.ok().flatten().unwrap_or(c"unknown").as_ptr()
}

/// The caller's `user_data`, handed back to its callback from whichever
/// thread reports progress (the callback's contract says it may be).
#[derive(Clone, Copy)]
struct UserData(*mut c_void);

// SAFETY: the pointer is only handed back to the caller's callback, which
// the header documents as called from the load's threads.
unsafe impl Send for UserData {}
unsafe impl Sync for UserData {}

impl UserData {
    fn get(self) -> *mut c_void {
        self.0
    }
}

/// The load options' progress callback as the Rust crate takes it.
fn progress_callback(
    callback: unsafe extern "C" fn(*mut c_void, u32, u64, u64) -> i32,
    user_data: *mut c_void,
) -> impl Fn(LoadProgress) -> ControlFlow<()> + Send + Sync + 'static {
    let user_data = UserData(user_data);
    move |p: LoadProgress| {
        // A phase newer than this table is reported as 0 ("unknown").
        let phase = LOAD_PHASES.iter().find(|(lp, _)| *lp == p.phase).map_or(0, |(_, v)| *v);
        // SAFETY: the caller's callback, with the caller's pointer.
        match unsafe { callback(user_data.get(), phase, p.bytes_done, p.bytes_total) } {
            Q3W_PROGRESS_CONTINUE => ControlFlow::Continue(()),
            _ => ControlFlow::Break(()),
        }
    }
}

/// Sets `options` to the defaults and its `struct_size` to `struct_size`,
/// which is `sizeof(q3w_load_options)` as the caller's header declares it:
/// only that many bytes are written.
#[no_mangle]
pub unsafe extern "C" fn q3w_load_options_init(
    options: *mut q3w_load_options,
    struct_size: usize,
) -> q3w_status {
    // SAFETY: NULL or `struct_size` writable bytes, as the caller promises.
    run("q3w_load_options_init", || unsafe { init_options(options, struct_size, "options") })
}

/// Loads a Hugging Face Qwen3 checkpoint directory (`config.json` and
/// safetensors) onto the engine's device: validates it, converts it to int8
/// or int4 (`options->weights`) or reads the cached conversion, and uploads it. `options` may be NULL.
/// Free the model with `q3w_model_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_model_load(
    engine: *const q3w_engine,
    checkpoint_dir: *const c_char,
    options: *const q3w_load_options,
    out_model: *mut *mut q3w_model,
) -> q3w_status {
    run("q3w_model_load", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_model) };
        let engine = &unsafe { shared(engine, "engine") }?.engine;
        let dir = unsafe { text(checkpoint_dir, "checkpoint_dir") }?;
        out(out_model, "out_model")?;
        let options = unsafe { read_options(options, "options") }?;
        let cache_dir = unsafe { optional_text(options.cache_dir, "cache_dir") }?;
        let cache = match (options.cache_policy, cache_dir) {
            (Q3W_CACHE_DIR, Some(dir)) => CachePolicy::Dir(PathBuf::from(dir)),
            (Q3W_CACHE_DIR, None) => return Err(invalid("cache_dir", "is NULL with Q3W_CACHE_DIR")),
            (Q3W_CACHE_DEFAULT | Q3W_CACHE_DISABLED, Some(_)) => {
                return Err(invalid("cache_dir", "is set, but cache_policy is not Q3W_CACHE_DIR"))
            }
            (Q3W_CACHE_DEFAULT, None) => CachePolicy::Default,
            (Q3W_CACHE_DISABLED, None) => CachePolicy::Disabled,
            (other, _) => {
                return Err(invalid(
                    "cache_policy",
                    format!("{other} is not a Q3W_CACHE_* value (0, 1 or 2)"),
                ))
            }
        };
        let profile = match options.shape_profile {
            Q3W_SHAPE_ANY_QWEN3 => ShapeProfile::AnyQwen3,
            Q3W_SHAPE_QWEN3_0_6B => ShapeProfile::Qwen3_0_6B,
            other => {
                return Err(invalid("shape_profile", format!("{other} is not a Q3W_SHAPE_* value (0 or 1)")))
            }
        };
        let mut load = LoadOptions { profile, cache, ..Default::default() };
        match options.weights {
            Q3W_WEIGHTS_DEFAULT => {}
            Q3W_WEIGHTS_INT8 => load = load.weights(WeightFormat::Int8),
            Q3W_WEIGHTS_INT4 => load = load.weights(WeightFormat::Int4),
            other => {
                return Err(invalid("weights", format!("{other} is not a Q3W_WEIGHTS_* value (0, 1 or 2)")))
            }
        }
        if let Some(callback) = options.progress {
            load = load.on_progress(progress_callback(callback, options.progress_user_data));
        } else if !options.progress_user_data.is_null() {
            return Err(invalid("progress_user_data", "is set, but progress is NULL"));
        }
        let model = engine.load(dir, &load)?;
        unsafe { put(out_model, Box::into_raw(Box::new(q3w_model { model }))) };
        Ok(())
    })
}

/// Frees a model (NULL is allowed). Its sessions stay valid.
#[no_mangle]
pub unsafe extern "C" fn q3w_model_free(model: *mut q3w_model) -> q3w_status {
    run("q3w_model_free", || {
        if !model.is_null() {
            // SAFETY: a live model handle, as the caller promises.
            drop(unsafe { Box::from_raw(model) });
        }
        Ok(())
    })
}

/// The model's vocabulary size: token ids run from 0 to this less one.
#[no_mangle]
pub unsafe extern "C" fn q3w_model_vocab_size(model: *const q3w_model, out_size: *mut usize) -> q3w_status {
    run("q3w_model_vocab_size", || {
        // SAFETY: the pointers are as the header says.
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_size, "out_size")?;
        unsafe { put(out_size, model.config().vocab_size) };
        Ok(())
    })
}

/// The format of the model's layer weights: `Q3W_WEIGHTS_INT8` or
/// `Q3W_WEIGHTS_INT4` (never `Q3W_WEIGHTS_DEFAULT`).
#[no_mangle]
pub unsafe extern "C" fn q3w_model_weights(model: *const q3w_model, out_weights: *mut u32) -> q3w_status {
    run("q3w_model_weights", || {
        // SAFETY: the pointers are as the header says.
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_weights, "out_weights")?;
        let weights = match model.weight_format() {
            WeightFormat::Int4 => Q3W_WEIGHTS_INT4,
            _ => Q3W_WEIGHTS_INT8,
        };
        unsafe { put(out_weights, weights) };
        Ok(())
    })
}

/// The most positions a session of this model can hold
/// (`max_position_embeddings`).
#[no_mangle]
pub unsafe extern "C" fn q3w_model_max_context(
    model: *const q3w_model,
    out_positions: *mut usize,
) -> q3w_status {
    run("q3w_model_max_context", || {
        // SAFETY: the pointers are as the header says.
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_positions, "out_positions")?;
        unsafe { put(out_positions, model.config().max_position_embeddings) };
        Ok(())
    })
}

/// Whether `token` is one of the checkpoint's end-of-text ids
/// (`eos_token_id` of config.json and generation_config.json).
#[no_mangle]
pub unsafe extern "C" fn q3w_model_is_end_of_text(
    model: *const q3w_model,
    token: u32,
    out_is_end: *mut bool,
) -> q3w_status {
    run("q3w_model_is_end_of_text", || {
        // SAFETY: the pointers are as the header says.
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_is_end, "out_is_end")?;
        unsafe { put(out_is_end, model.config().eos_token_ids.contains(&token)) };
        Ok(())
    })
}
