//! Greedy sessions on a model: their options and creation, feeding, the
//! next token, truncation and the session's queries (the rest of the
//! session calls are in `crate::session`).

use qwen3_wgpu::{KvFormat, SessionOptions};

use super::{q3w_model, q3w_session};
use crate::{
    array, clear, exclusive, init_options, out, put, q3w_status, read_options, run, shared, Options,
};

/// `kv_cache`: an f16 per value (the default).
pub const Q3W_KV_CACHE_F16: u32 = 0;
/// `kv_cache`: an int8 per value and an f32 scale per head and position:
/// about half the memory of f16, for a logit error of about 1.5% of the
/// logits' rms. Needs the model's head_dim a multiple of 16 (every Qwen3's
/// is 128), else `Q3W_INVALID_ARGUMENT` naming `kv_cache`.
pub const Q3W_KV_CACHE_INT8: u32 = 1;

/// The KV-cache format a `Q3W_KV_CACHE_*` value names.
pub(crate) fn kv_format(value: u32) -> qwen3_wgpu::Result<KvFormat> {
    match value {
        Q3W_KV_CACHE_F16 => Ok(KvFormat::F16),
        Q3W_KV_CACHE_INT8 => Ok(KvFormat::Int8),
        other => Err(crate::invalid("kv_cache", format!("{other} is not a Q3W_KV_CACHE_* value (0 or 1)"))),
    }
}

/// How to create a session (`q3w_session_options_init` sets the defaults).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_session_options {
    /// `sizeof(q3w_session_options)`, set by `q3w_session_options_init`.
    pub struct_size: usize,
    /// KV-cache positions, allocated once: 1 up to the model's
    /// `q3w_model_max_context`, else `Q3W_CONTEXT_OVERFLOW`; 0 (the default)
    /// means 4096, or the model's maximum if smaller.
    pub capacity: usize,
    /// Decode steps kept queued on the GPU ahead of the caller; 0 (the
    /// default) means the engine's default (4). 1 waits on every token.
    pub lookahead: usize,
    /// Since version 2: a `Q3W_KV_CACHE_*` value (default
    /// `Q3W_KV_CACHE_F16`).
    pub kv_cache: u32,
}

impl Options for q3w_session_options {
    // Version 1 ended at `lookahead`; version 2 added the KV-cache format.
    const VERSION_SIZES: &'static [usize] =
        &[std::mem::offset_of!(q3w_session_options, kv_cache), std::mem::size_of::<Self>()];
    fn defaults() -> Self {
        q3w_session_options {
            struct_size: std::mem::size_of::<Self>(),
            capacity: 0,
            lookahead: 0,
            kv_cache: Q3W_KV_CACHE_F16,
        }
    }
}

/// Sets `options` to the defaults and its `struct_size` to `struct_size`,
/// which is `sizeof(q3w_session_options)` as the caller's header declares it:
/// only that many bytes are written.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_options_init(
    options: *mut q3w_session_options,
    struct_size: usize,
) -> q3w_status {
    // SAFETY: NULL or `struct_size` writable bytes, as the caller promises.
    run("q3w_session_options_init", || unsafe { init_options(options, struct_size, "options") })
}

/// Creates a session over `model` (its KV cache allocated once). `options`
/// may be NULL. Free it with `q3w_session_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_new(
    model: *const q3w_model,
    options: *const q3w_session_options,
    out_session: *mut *mut q3w_session,
) -> q3w_status {
    run("q3w_session_new", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_session) };
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_session, "out_session")?;
        let options = unsafe { read_options(options, "options") }?;
        let mut session_options = SessionOptions::default().kv_cache(kv_format(options.kv_cache)?);
        if options.capacity > 0 {
            session_options = session_options.capacity(options.capacity);
        }
        let mut session = model.session_with(&session_options)?;
        if options.lookahead > 0 {
            session.set_lookahead(options.lookahead);
        }
        let handle = Box::new(q3w_session::new(session));
        unsafe { put(out_session, Box::into_raw(handle)) };
        Ok(())
    })
}

/// Frees a session (NULL is allowed), waiting for its queued GPU steps.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_free(session: *mut q3w_session) -> q3w_status {
    run("q3w_session_free", || {
        if !session.is_null() {
            // SAFETY: a live session handle, as the caller promises.
            drop(unsafe { Box::from_raw(session) });
        }
        Ok(())
    })
}

/// Runs `n_ids` tokens through the model (appending them to the session's
/// context, after the pending token if there is one) and writes the greedy
/// next token to `out_next`, which becomes the pending token. Every id and
/// the capacity are checked before the GPU runs: an empty array is
/// `Q3W_EMPTY_PROMPT`, an id outside the vocabulary `Q3W_INVALID_TOKEN_ID`,
/// too many tokens `Q3W_CONTEXT_OVERFLOW` (the session is left as it was).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_feed(
    session: *mut q3w_session,
    ids: *const u32,
    n_ids: usize,
    out_next: *mut u32,
) -> q3w_status {
    run("q3w_session_feed", || {
        // SAFETY: the pointers are as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        let ids = unsafe { array(ids, n_ids, "ids") }?;
        out(out_next, "out_next")?;
        let next = s.session.feed(ids)?;
        unsafe { put(out_next, next) };
        Ok(())
    })
}

/// Feeds the pending token back in and writes the next greedy token
/// (waiting for the GPU). `Q3W_NO_PENDING_TOKEN` before any feed,
/// `Q3W_CONTEXT_OVERFLOW` when the session is full.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_next_token(
    session: *mut q3w_session,
    out_token: *mut u32,
) -> q3w_status {
    run("q3w_session_next_token", || {
        // SAFETY: the pointers are as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        out(out_token, "out_token")?;
        let token = s.session.next_token()?;
        unsafe { put(out_token, token) };
        Ok(())
    })
}

/// `q3w_session_next_token` that never waits for the GPU: when the next
/// token has arrived, writes it and sets `*out_ready` to true; otherwise
/// sets `*out_ready` to false (call again later, e.g. next frame) and leaves
/// `*out_token` as it was. The tokens are those `q3w_session_next_token`
/// returns.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_try_next_token(
    session: *mut q3w_session,
    out_token: *mut u32,
    out_ready: *mut bool,
) -> q3w_status {
    run("q3w_session_try_next_token", || {
        // SAFETY: the pointers are as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        out(out_token, "out_token")?;
        out(out_ready, "out_ready")?;
        let token = s.session.try_next_token()?;
        unsafe {
            if let Some(token) = token {
                put(out_token, token);
            }
            put(out_ready, token.is_some());
        }
        Ok(())
    })
}

/// Rewinds the session to its first `len` positions (dropping the queued
/// steps and the pending token): the next feed continues from there.
/// `len` past `q3w_session_len` is `Q3W_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_truncate(session: *mut q3w_session, len: usize) -> q3w_status {
    run("q3w_session_truncate", || {
        // SAFETY: the pointer is as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        s.session.truncate(len)
    })
}

/// Positions in the KV cache (the pending token is not among them).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_len(session: *mut q3w_session, out_len: *mut usize) -> q3w_status {
    run("q3w_session_len", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_len, "out_len")?;
        unsafe { put(out_len, s.session.len()) };
        Ok(())
    })
}

/// KV-cache capacity in positions.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_capacity(
    session: *mut q3w_session,
    out_capacity: *mut usize,
) -> q3w_status {
    run("q3w_session_capacity", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_capacity, "out_capacity")?;
        unsafe { put(out_capacity, s.session.capacity()) };
        Ok(())
    })
}

/// The KV cache's format: a `Q3W_KV_CACHE_*` value (a restored or forked
/// session keeps its source's).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_kv_cache(
    session: *mut q3w_session,
    out_kv_cache: *mut u32,
) -> q3w_status {
    run("q3w_session_kv_cache", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_kv_cache, "out_kv_cache")?;
        let format = match s.session.kv_format() {
            KvFormat::Int8 => Q3W_KV_CACHE_INT8,
            _ => Q3W_KV_CACHE_F16,
        };
        unsafe { put(out_kv_cache, format) };
        Ok(())
    })
}

/// The pending token (the last one fed or returned, not yet in the KV
/// cache): `*out_has_pending` is false before any feed and after a
/// truncate, and `*out_token` is then left as it was.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_pending(
    session: *mut q3w_session,
    out_token: *mut u32,
    out_has_pending: *mut bool,
) -> q3w_status {
    run("q3w_session_pending", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_token, "out_token")?;
        out(out_has_pending, "out_has_pending")?;
        let pending = s.session.pending();
        unsafe {
            if let Some(token) = pending {
                put(out_token, token);
            }
            put(out_has_pending, pending.is_some());
        }
        Ok(())
    })
}
