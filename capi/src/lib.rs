//! The C ABI of [`qwen3_wgpu`]: opaque handles over the engine, models,
//! sessions, batches, tokenizers, streaming decoders and chat templates,
//! built as a shared library (`libqwen3wgpu.so` / `.dylib`), a static
//! library (`libqwen3wgpu.a`) and a Rust library (for this crate's tests). The
//! header, `include/qwen3_wgpu.h`, is generated from these sources by
//! cbindgen.
//!
//! # Rules every function follows
//!
//! - **Status.** Every function returns a [`q3w_status`]: `Q3W_OK` (0) or one
//!   value per stable error code of the Rust crate (`Error::code`), in the
//!   order of `Error::ALL_CODES`. [`q3w_last_error_message`] returns the
//!   message of the last call made on the calling thread (empty after
//!   success), valid until the thread's next call. [`q3w_last_error_message`]
//!   and [`q3w_status_name`] themselves return strings, not statuses.
//! - **Arguments.** A NULL pointer where a value is needed, a string that is
//!   not UTF-8, an unknown option value or a misaligned array is
//!   `Q3W_INVALID_ARGUMENT`, naming the parameter. Options structs are
//!   optional (NULL means the defaults), as are the `out_len` of returned
//!   strings. On failure, output handles and strings are set to NULL (when
//!   their pointer is not NULL); other outputs are left as they were.
//! - **Panics.** No panic crosses the boundary: each entry point catches one
//!   and returns `Q3W_INTERNAL` with the panic's message. A panic during a
//!   call that changes a session or a text stream leaves that handle in an
//!   unknown state: every later call on it returns `Q3W_INTERNAL` (freeing
//!   it still works). The library must be built with `panic = "unwind"`
//!   (the default).
//! - **Ownership.** Each thing the caller owns has exactly one free
//!   function: `q3w_engine_free`, `q3w_model_free`, `q3w_session_free`
//!   (also for a batch's sessions), `q3w_batch_free`, `q3w_tokenizer_free`, `q3w_text_stream_free`, `q3w_chat_template_free`,
//!   `q3w_string_free` (every `char *` returned through an out-parameter)
//!   and `q3w_tokens_free` (every `uint32_t *` returned). Each accepts NULL.
//!   Strings returned as `const char *` are borrowed and never freed. Handles
//!   keep what they need alive: a model outlives its engine's handle, a
//!   session its model's and its batch's, a text stream its tokenizer's.
//! - **Threads.** Engines, models, tokenizers and chat templates may be used
//!   from several threads at once. A session, a batch or a text stream may
//!   be used from any thread, one call at a time (a batch step uses each
//!   of its sessions for the call).
//! - **Options structs** start with `struct_size`, set by their `_init`
//!   function, which takes the struct's size as the caller's header
//!   declares it (`q3w_load_options_init(&options, sizeof options)`):
//!   fields added in later versions go at the end, and the library reads
//!   and writes only the `struct_size` bytes the caller's header knew (a
//!   program built against an older header keeps working with a newer
//!   library, and a newer header's fields must be zero for an older one).
//!
//! # Safety
//!
//! Every entry point is `unsafe`: pointers must be NULL or point to what the
//! header says (a live handle from this library, a NUL-terminated string,
//! `n` readable elements), and a handle must not be used after it is freed.

// The C names are the Rust names (`q3w_session`, `Q3W_OK`): cbindgen copies
// them into the header as they are.
#![allow(non_camel_case_types)]
// The safety contract is the same for every entry point: the crate
// documentation's "Safety" section states it once.
#![allow(clippy::missing_safety_doc)]
#![deny(missing_docs)]

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use qwen3_wgpu::{Error, Result};

mod batch;
mod constraint;
mod engine;
mod owned;
mod session;
mod text;

pub use batch::*;
pub use constraint::*;
pub use engine::*;
pub use owned::{q3w_string_free, q3w_tokens_free};
pub use session::*;
pub use text::*;

/// The status every function returns: `Q3W_OK`, or the stable error code
/// of what went wrong (`q3w_status_name` gives its name, as the Rust crate's
/// `Error::code()` spells it). New codes are added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum q3w_status {
    /// Success.
    Q3W_OK = 0,
    /// The checkpoint directory or one of its required files does not exist.
    Q3W_CHECKPOINT_NOT_FOUND = 1,
    /// A checkpoint file exists but cannot be parsed.
    Q3W_CHECKPOINT_INVALID = 2,
    /// The checkpoint is not a shape this engine (or the requested profile) accepts.
    Q3W_UNSUPPORTED_CHECKPOINT_ARCHITECTURE = 3,
    /// A tensor is stored in a dtype the converter does not read.
    Q3W_UNSUPPORTED_DTYPE = 4,
    /// Under the default Metal-only policy, the adapter found is not Metal.
    Q3W_NON_METAL_ADAPTER = 5,
    /// No GPU adapter (of the allowed backends) exists.
    Q3W_NO_GPU_ADAPTER = 6,
    /// The device could not be created, was lost, or reported an error.
    Q3W_GPU_DEVICE_FAILED = 7,
    /// A kernel failed to compile or to build a pipeline.
    Q3W_SHADER_COMPILE_FAILED = 8,
    /// A token id is not below the vocabulary size.
    Q3W_INVALID_TOKEN_ID = 9,
    /// Decoding needs at least one prompt token.
    Q3W_EMPTY_PROMPT = 10,
    /// A decode step was asked for before any token was fed.
    Q3W_NO_PENDING_TOKEN = 11,
    /// The tokens do not fit the session's KV cache.
    Q3W_CONTEXT_OVERFLOW = 12,
    /// Reading or writing the converted-weights cache failed.
    Q3W_CACHE_IO = 13,
    /// An argument is not one the library accepts (the message names it).
    Q3W_INVALID_ARGUMENT = 14,
    /// A bug in the library (a panic included): please report the message.
    Q3W_INTERNAL = 15,
    /// An allocation is larger than the memory available.
    Q3W_OUT_OF_MEMORY = 16,
    /// A session file cannot be read or written (a missing file, a missing
    /// or unwritable directory, a full disk).
    Q3W_SESSION_IO = 17,
    /// A file given to restore a session is not an intact session file of
    /// this format version.
    Q3W_SESSION_FILE_INVALID = 18,
    /// An intact session file saved from other weights.
    Q3W_SESSION_MODEL_MISMATCH = 19,
    /// The caller cancelled the operation (a load progress callback).
    Q3W_CANCELLED = 20,
}

/// Each error status with its stable code, in `Error::ALL_CODES`' order. The
/// array's length is that of `Error::ALL_CODES`, so a code added there fails
/// to compile here until it has a status (and `tests/it/header.rs` checks
/// each pair against `Error::ALL_CODES`).
pub const ERROR_STATUSES: [(q3w_status, &str); Error::ALL_CODES.len()] = [
    (q3w_status::Q3W_CHECKPOINT_NOT_FOUND, "checkpoint_not_found"),
    (q3w_status::Q3W_CHECKPOINT_INVALID, "checkpoint_invalid"),
    (q3w_status::Q3W_UNSUPPORTED_CHECKPOINT_ARCHITECTURE, "unsupported_checkpoint_architecture"),
    (q3w_status::Q3W_UNSUPPORTED_DTYPE, "unsupported_dtype"),
    (q3w_status::Q3W_NON_METAL_ADAPTER, "non_metal_adapter"),
    (q3w_status::Q3W_NO_GPU_ADAPTER, "no_gpu_adapter"),
    (q3w_status::Q3W_GPU_DEVICE_FAILED, "gpu_device_failed"),
    (q3w_status::Q3W_SHADER_COMPILE_FAILED, "shader_compile_failed"),
    (q3w_status::Q3W_INVALID_TOKEN_ID, "invalid_token_id"),
    (q3w_status::Q3W_EMPTY_PROMPT, "empty_prompt"),
    (q3w_status::Q3W_NO_PENDING_TOKEN, "no_pending_token"),
    (q3w_status::Q3W_CONTEXT_OVERFLOW, "context_overflow"),
    (q3w_status::Q3W_CACHE_IO, "cache_io"),
    (q3w_status::Q3W_INVALID_ARGUMENT, "invalid_argument"),
    (q3w_status::Q3W_INTERNAL, "internal"),
    (q3w_status::Q3W_OUT_OF_MEMORY, "out_of_memory"),
    (q3w_status::Q3W_SESSION_IO, "session_io"),
    (q3w_status::Q3W_SESSION_FILE_INVALID, "session_file_invalid"),
    (q3w_status::Q3W_SESSION_MODEL_MISMATCH, "session_model_mismatch"),
    (q3w_status::Q3W_CANCELLED, "cancelled"),
];

/// The status of an error: the one whose code is `e.code()`.
pub fn status_of(e: &Error) -> q3w_status {
    // A code missing here cannot happen (ERROR_STATUSES has one entry per
    // code, checked by test); `internal` is the honest answer if it did.
    ERROR_STATUSES.iter().find(|(_, code)| *code == e.code()).map_or(q3w_status::Q3W_INTERNAL, |(s, _)| *s)
}

thread_local! {
    /// The message of the last call on this thread (empty after success).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A NUL inside the message (from a path, say) would cut it short.
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|m| *m.borrow_mut() = message);
}

/// The message of the last call made on this thread: empty when it
/// succeeded, else what went wrong (the status's code is not repeated).
/// Valid until the next call on this thread; never NULL.
#[no_mangle]
pub extern "C" fn q3w_last_error_message() -> *const c_char {
    static EMPTY: &CStr = c"";
    catch_unwind(|| LAST_ERROR.with(|m| m.borrow().as_ptr())).unwrap_or(EMPTY.as_ptr())
}

/// The stable name of a status (`"ok"`, `"invalid_argument"` ...), as the
/// Rust crate's `Error::code()` spells it; `"unknown"` for a value that is
/// no status. A static string: never freed, never NULL.
#[no_mangle]
pub extern "C" fn q3w_status_name(status: i32) -> *const c_char {
    // One name per status: `ok`, then every code (a new code fails the build here).
    static NAMES: [&CStr; Error::ALL_CODES.len() + 1] = [
        c"ok",
        c"checkpoint_not_found",
        c"checkpoint_invalid",
        c"unsupported_checkpoint_architecture",
        c"unsupported_dtype",
        c"non_metal_adapter",
        c"no_gpu_adapter",
        c"gpu_device_failed",
        c"shader_compile_failed",
        c"invalid_token_id",
        c"empty_prompt",
        c"no_pending_token",
        c"context_overflow",
        c"cache_io",
        c"invalid_argument",
        c"internal",
        c"out_of_memory",
        c"session_io",
        c"session_file_invalid",
        c"session_model_mismatch",
        c"cancelled",
    ];
    let name = catch_unwind(|| usize::try_from(status).ok().and_then(|i| NAMES.get(i)).copied());
    name.ok().flatten().unwrap_or(c"unknown").as_ptr()
}

/// Runs the body of the entry point `function`: catches a panic (as
/// `Q3W_INTERNAL`, with its message), turns an error into its status and
/// records the message for [`q3w_last_error_message`].
pub(crate) fn run(function: &str, body: impl FnOnce() -> Result<()>) -> q3w_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            set_last_error("");
            q3w_status::Q3W_OK
        }
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            status_of(&e)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".into());
            let e = Error::Internal { reason: format!("panic in {function}: {what}") };
            set_last_error(&e.to_string());
            q3w_status::Q3W_INTERNAL
        }
    }
}

/// `Q3W_INVALID_ARGUMENT` naming the parameter `name`.
pub(crate) fn invalid(name: &str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument { name: name.into(), reason: reason.into() }
}

/// The value behind a handle the caller passed (shared use).
///
/// # Safety
/// `ptr` is NULL or a live handle of type `T`.
pub(crate) unsafe fn shared<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { ptr.as_ref() }.ok_or_else(|| invalid(name, "is NULL"))
}

/// A handle that a panic during a call can leave half-changed.
pub(crate) trait Poisonable {
    /// Set when a call panicked while changing the handle.
    fn poisoned(&mut self) -> &mut bool;
}

/// Exclusive use of a handle for one call: refused when an earlier call
/// panicked inside it, and marks it so when this call panics.
pub(crate) struct Exclusive<'a, T: Poisonable>(&'a mut T);

impl<T: Poisonable> Drop for Exclusive<'_, T> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            *self.0.poisoned() = true;
        }
    }
}

impl<T: Poisonable> std::ops::Deref for Exclusive<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &*self.0
    }
}

impl<T: Poisonable> std::ops::DerefMut for Exclusive<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut *self.0
    }
}

/// The value behind a handle the caller passed, for a call that changes it.
///
/// # Safety
/// `ptr` is NULL or a live handle of type `T`, used by no other call now.
pub(crate) unsafe fn exclusive<'a, T: Poisonable>(ptr: *mut T, name: &str) -> Result<Exclusive<'a, T>> {
    // SAFETY: the caller passes NULL or a live handle no other call uses.
    let handle = unsafe { ptr.as_mut() }.ok_or_else(|| invalid(name, "is NULL"))?;
    if *handle.poisoned() {
        return Err(Error::Internal {
            reason: format!("{name}: an earlier call panicked while changing it; free it"),
        });
    }
    Ok(Exclusive(handle))
}

/// Checks an out-parameter before any work is done.
pub(crate) fn out<T>(ptr: *mut T, name: &str) -> Result<()> {
    if ptr.is_null() {
        return Err(invalid(name, "is NULL"));
    }
    Ok(())
}

/// Writes `value` to an out-parameter checked by [`out`].
///
/// # Safety
/// `ptr` is non-NULL, aligned and writable.
pub(crate) unsafe fn put<T>(ptr: *mut T, value: T) {
    // SAFETY: as the caller promises.
    unsafe { ptr.write(value) }
}

/// Sets an out-parameter to NULL (when it is not NULL itself): a failed
/// call leaves no stale pointer behind.
///
/// # Safety
/// `ptr` is NULL or aligned and writable.
pub(crate) unsafe fn clear<T>(ptr: *mut *mut T) {
    if !ptr.is_null() {
        // SAFETY: as the caller promises.
        unsafe { ptr.write(std::ptr::null_mut()) }
    }
}

/// A NUL-terminated UTF-8 string the caller passed.
///
/// # Safety
/// `ptr` is NULL or a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn text<'a>(ptr: *const c_char, name: &str) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(invalid(name, "is NULL"));
    }
    // SAFETY: a NUL-terminated string, as the caller promises.
    let bytes = unsafe { CStr::from_ptr(ptr) };
    bytes.to_str().map_err(|e| invalid(name, format!("is not UTF-8 ({e})")))
}

/// [`text`] where NULL means "not given".
///
/// # Safety
/// As [`text`].
pub(crate) unsafe fn optional_text<'a>(ptr: *const c_char, name: &str) -> Result<Option<&'a str>> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: as the caller promises.
    unsafe { text(ptr, name) }.map(Some)
}

/// An array of `n` elements the caller passed (NULL allowed when `n` is 0).
///
/// # Safety
/// `ptr` is NULL or points to `n` readable elements that outlive `'a`.
pub(crate) unsafe fn array<'a, T>(ptr: *const T, n: usize, name: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(invalid(name, format!("is NULL with a count of {n}")));
    }
    if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(invalid(name, format!("is not aligned to {} bytes", std::mem::align_of::<T>())));
    }
    if n.checked_mul(std::mem::size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
        return Err(invalid(name, format!("a count of {n} elements is larger than any array")));
    }
    // SAFETY: non-NULL, aligned, `n` elements within isize::MAX bytes, as
    // the caller promises.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// An array of `n` elements the caller passed for the library to fill
/// (NULL allowed when `n` is 0): checked as [`array`] checks its input.
///
/// # Safety
/// `ptr` is NULL or points to `n` writable elements that outlive `'a`,
/// used by nothing else during the call.
pub(crate) unsafe fn array_out<'a, T>(ptr: *mut T, n: usize, name: &str) -> Result<&'a mut [T]> {
    // SAFETY: as the caller promises; `array` checks NULL, alignment and size.
    let checked = unsafe { array(ptr.cast_const(), n, name) }?;
    if checked.is_empty() {
        return Ok(&mut []);
    }
    // SAFETY: the same checked elements, writable as the caller promises.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, n) })
}

/// An options struct the caller passed: `struct_size` first, fields added
/// later at the end. Options structs have no padding (every byte belongs
/// to a field), so copying a prefix of one copies whole fields.
pub(crate) trait Options: Copy {
    /// The struct's size in each released version of the header, oldest
    /// first; the last is `size_of::<Self>()`. A `struct_size` below the
    /// last must be one of these (a size inside a field is refused). Never
    /// changes once released: a new version appends a size.
    const VERSION_SIZES: &'static [usize];
    /// The defaults its `_init` function sets.
    fn defaults() -> Self;
}

/// Checks a caller's `struct_size` against the versions of `T`.
fn check_struct_size<T: Options>(size: usize, name: &str) -> Result<()> {
    let known = std::mem::size_of::<T>();
    debug_assert_eq!(T::VERSION_SIZES.last(), Some(&known));
    if size >= known || T::VERSION_SIZES.contains(&size) {
        return Ok(());
    }
    Err(invalid(
        name,
        format!(
            "struct_size is {size}, not the size of any version of the struct ({:?} bytes; call its _init function with sizeof)",
            T::VERSION_SIZES
        ),
    ))
}

/// Reads an options struct: NULL means the defaults; `struct_size` bytes
/// are read (fields past them keep their defaults), and bytes past the
/// fields this library knows must be zero (a newer header's fields that
/// this library would otherwise silently ignore).
///
/// # Safety
/// `ptr` is NULL or points to `struct_size` readable bytes whose fields
/// this library knows are of their types (every bit pattern of which is
/// valid).
pub(crate) unsafe fn read_options<T: Options>(ptr: *const T, name: &str) -> Result<T> {
    let mut value = T::defaults();
    if ptr.is_null() {
        return Ok(value);
    }
    if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(invalid(name, format!("is not aligned to {} bytes", std::mem::align_of::<T>())));
    }
    // SAFETY: every options struct starts with `size_t struct_size`.
    let size = unsafe { ptr.cast::<usize>().read() };
    check_struct_size::<T>(size, name)?;
    let known = std::mem::size_of::<T>();
    // SAFETY: the caller's struct has `size` readable bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), size) };
    if let Some(at) = bytes.iter().skip(known).position(|&b| b != 0) {
        return Err(invalid(
            name,
            format!("sets byte {} of a newer version's fields; this library knows {known} bytes", known + at),
        ));
    }
    let n = size.min(known);
    // SAFETY: `n` bytes fit both and end at a field boundary (a version's
    // size); every field is valid for any bits.
    unsafe { std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), (&mut value as *mut T).cast::<u8>(), n) };
    Ok(value)
}

/// Writes `value` into the caller's struct as far as its `struct_size`
/// reaches (fields of an older header are left out; a newer header's
/// fields past this library's are left as they are), keeping that
/// `struct_size`.
///
/// # Safety
/// `ptr` is NULL or points to `struct_size` writable bytes.
pub(crate) unsafe fn write_options<T: Options>(ptr: *mut T, value: T, name: &str) -> Result<()> {
    out(ptr, name)?;
    if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(invalid(name, format!("is not aligned to {} bytes", std::mem::align_of::<T>())));
    }
    // SAFETY: every options struct starts with `size_t struct_size`.
    let size = unsafe { ptr.cast::<usize>().read() };
    check_struct_size::<T>(size, name)?;
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes are writable and end at a field boundary; the
    // struct has no padding, so all `n` bytes of `value` are initialised.
    unsafe {
        std::ptr::copy_nonoverlapping((&value as *const T).cast::<u8>(), ptr.cast::<u8>(), n);
        ptr.cast::<usize>().write(size);
    }
    Ok(())
}

/// Writes an options struct's defaults (its `_init` function) into the
/// caller's `struct_size` bytes: the fields of the caller's version get
/// their defaults, fields of a newer header than this library's are
/// zeroed (unset), and `struct_size` is set. So a program built with an
/// older header never has more bytes written than its struct holds.
///
/// # Safety
/// `ptr` is NULL or points to `struct_size` writable bytes.
pub(crate) unsafe fn init_options<T: Options>(ptr: *mut T, struct_size: usize, name: &str) -> Result<()> {
    out(ptr, name)?;
    check_struct_size::<T>(struct_size, "struct_size")?;
    if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(invalid(name, format!("is not aligned to {} bytes", std::mem::align_of::<T>())));
    }
    // SAFETY: `struct_size` writable bytes, as the caller promises; then
    // `write_options` reads the size just written.
    unsafe {
        std::ptr::write_bytes(ptr.cast::<u8>(), 0, struct_size);
        ptr.cast::<usize>().write(struct_size);
        write_options(ptr, T::defaults(), name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic inside an entry point's body becomes `Q3W_INTERNAL` with the
    /// panic's message and the function's name, and the thread's message is
    /// cleared by the next successful call. (The C tests provoke a real
    /// panic through a tokenizer; this one needs no fixture.)
    #[test]
    fn a_panic_is_internal_with_its_message() {
        let status = run("q3w_example", || panic!("the bookkeeping broke"));
        assert_eq!(status, q3w_status::Q3W_INTERNAL);
        let message = unsafe { CStr::from_ptr(q3w_last_error_message()) }.to_str().unwrap().to_string();
        assert!(message.contains("panic in q3w_example: the bookkeeping broke"), "{message}");
        assert_eq!(run("q3w_example", || Ok(())), q3w_status::Q3W_OK);
        assert_eq!(unsafe { CStr::from_ptr(q3w_last_error_message()) }.to_bytes(), b"");
    }

    /// The message is per thread: another thread's failure does not touch
    /// this thread's message.
    #[test]
    fn the_message_is_per_thread() {
        run("q3w_example", || Err(invalid("here", "this thread")));
        std::thread::spawn(|| run("q3w_example", || Err(invalid("there", "another thread")))).join().unwrap();
        let message = unsafe { CStr::from_ptr(q3w_last_error_message()) }.to_str().unwrap().to_string();
        assert_eq!(message, "invalid argument here: this thread");
    }

    struct Thing {
        value: u32,
        poisoned: bool,
    }

    impl Poisonable for Thing {
        fn poisoned(&mut self) -> &mut bool {
            &mut self.poisoned
        }
    }

    /// A panic while a handle is changed poisons it: later calls are
    /// refused with `internal` instead of running on a half-changed state.
    #[test]
    fn a_panic_while_changing_a_handle_poisons_it() {
        let mut thing = Thing { value: 1, poisoned: false };
        let ptr: *mut Thing = &mut thing;
        let status = run("q3w_example", || {
            let mut t = unsafe { exclusive(ptr, "thing") }?;
            t.value = 2;
            panic!("half-way");
        });
        assert_eq!(status, q3w_status::Q3W_INTERNAL);
        let status = run("q3w_example", || unsafe { exclusive(ptr, "thing") }.map(|_| ()));
        assert_eq!(status, q3w_status::Q3W_INTERNAL);
        let message = unsafe { CStr::from_ptr(q3w_last_error_message()) }.to_str().unwrap().to_string();
        assert!(message.contains("thing: an earlier call panicked"), "{message}");
        assert!(thing.poisoned);
    }

    #[test]
    fn status_names_follow_the_enum() {
        for (status, code) in ERROR_STATUSES {
            let name = unsafe { CStr::from_ptr(q3w_status_name(status as i32)) };
            assert_eq!(name.to_str().unwrap(), code);
        }
        assert_eq!(unsafe { CStr::from_ptr(q3w_status_name(0)) }.to_bytes(), b"ok");
        assert_eq!(unsafe { CStr::from_ptr(q3w_status_name(21)) }.to_bytes(), b"unknown");
        assert_eq!(unsafe { CStr::from_ptr(q3w_status_name(-1)) }.to_bytes(), b"unknown");
    }

    #[test]
    fn arrays_are_checked_before_they_are_read() {
        let ids = [1u32, 2];
        assert_eq!(unsafe { array(ids.as_ptr(), 2, "ids") }.unwrap(), &[1, 2]);
        assert!(unsafe { array::<u32>(std::ptr::null(), 0, "ids") }.unwrap().is_empty());
        for (ptr, n) in [
            (std::ptr::null(), 1),
            (ids.as_ptr().cast::<u8>().wrapping_add(1).cast::<u32>(), 1),
            (ids.as_ptr(), usize::MAX / 2),
        ] {
            let e = unsafe { array(ptr, n, "ids") }.unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{e}");
        }
    }
}
