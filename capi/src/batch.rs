//! Batches: sessions of one model advanced together, one token each per
//! GPU step.

use qwen3_wgpu::{Batch, BatchOptions, Result, Session};

use crate::engine::{q3w_model, q3w_session};
use crate::{
    array, array_out, clear, exclusive, init_options, invalid, out, put, q3w_status, read_options, run,
    shared, Exclusive, Options, Poisonable,
};

/// Sessions of one model stepped together: each step reads the weights
/// once for all its sessions, and each session gets the token it would get
/// alone (greedy or sampled under its own parameters).
pub struct q3w_batch {
    batch: Batch,
    poisoned: bool,
}

impl Poisonable for q3w_batch {
    fn poisoned(&mut self) -> &mut bool {
        &mut self.poisoned
    }
}

// A batch may be used from any thread, one call at a time.
const _: () = {
    const fn moved_between_threads<T: Send>() {}
    moved_between_threads::<q3w_batch>();
};

/// How to create a batch (`q3w_batch_options_init` sets the defaults).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_batch_options {
    /// `sizeof(q3w_batch_options)`, set by `q3w_batch_options_init`.
    pub struct_size: usize,
    /// Sessions the batch holds at once (default 8); 0 is
    /// `Q3W_INVALID_ARGUMENT`.
    pub slots: usize,
    /// KV-cache positions of each session (default 1024): 1 up to the
    /// model's `q3w_model_max_context`, else `Q3W_CONTEXT_OVERFLOW`.
    pub capacity_per_slot: usize,
    /// Since version 2: every session's KV-cache format, a
    /// `Q3W_KV_CACHE_*` value (default `Q3W_KV_CACHE_F16`).
    pub kv_cache: u32,
}

impl Options for q3w_batch_options {
    // Version 1 ended at `capacity_per_slot`; version 2 added the KV-cache
    // format.
    const VERSION_SIZES: &'static [usize] =
        &[std::mem::offset_of!(q3w_batch_options, kv_cache), std::mem::size_of::<Self>()];
    fn defaults() -> Self {
        let d = BatchOptions::default();
        q3w_batch_options {
            struct_size: std::mem::size_of::<Self>(),
            slots: d.slots,
            capacity_per_slot: d.capacity_per_slot,
            kv_cache: crate::engine::Q3W_KV_CACHE_F16,
        }
    }
}

/// Sets `options` to the defaults and its `struct_size` to `struct_size`,
/// which is `sizeof(q3w_batch_options)` as the caller's header declares it:
/// only that many bytes are written.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_options_init(
    options: *mut q3w_batch_options,
    struct_size: usize,
) -> q3w_status {
    // SAFETY: NULL or `struct_size` writable bytes, as the caller promises.
    run("q3w_batch_options_init", || unsafe { init_options(options, struct_size, "options") })
}

/// Creates a batch over `model`: its KV pool (a cache of
/// `capacity_per_slot` positions for each of `slots` sessions) is allocated
/// here, once. `options` may be NULL (the defaults). Slots whose pool would
/// pass the device's largest buffer are `Q3W_INVALID_ARGUMENT` naming
/// `slots`. Free it with `q3w_batch_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_new(
    model: *const q3w_model,
    options: *const q3w_batch_options,
    out_batch: *mut *mut q3w_batch,
) -> q3w_status {
    run("q3w_batch_new", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_batch) };
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_batch, "out_batch")?;
        let options = unsafe { read_options(options, "options") }?;
        let options = BatchOptions::default()
            .slots(options.slots)
            .capacity_per_slot(options.capacity_per_slot)
            .kv_cache(crate::engine::kv_format(options.kv_cache)?);
        let batch = Box::new(q3w_batch { batch: model.batch(&options)?, poisoned: false });
        unsafe { put(out_batch, Box::into_raw(batch)) };
        Ok(())
    })
}

/// Frees a batch (NULL is allowed); steps it left in flight are dropped.
/// Its sessions stay valid (each keeps its slot's cache until it is freed)
/// and decode on their own.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_free(batch: *mut q3w_batch) -> q3w_status {
    run("q3w_batch_free", || {
        if !batch.is_null() {
            // SAFETY: a live batch handle, as the caller promises.
            drop(unsafe { Box::from_raw(batch) });
        }
        Ok(())
    })
}

/// A new empty session in a free slot of the batch: an ordinary session
/// (feed, next_token, sampling, fork, save all work on it alone) whose KV
/// cache is the slot's; `q3w_session_free` frees it and its slot. No free
/// slot is `Q3W_INVALID_ARGUMENT` naming `batch`.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_session(
    batch: *mut q3w_batch,
    out_session: *mut *mut q3w_session,
) -> q3w_status {
    run("q3w_batch_session", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_session) };
        let b = unsafe { exclusive(batch, "batch") }?;
        out(out_session, "out_session")?;
        let session = b.batch.session()?;
        unsafe { put(out_session, Box::into_raw(Box::new(q3w_session::new(session)))) };
        Ok(())
    })
}

/// Sessions the batch holds at once.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_slots(batch: *mut q3w_batch, out_slots: *mut usize) -> q3w_status {
    run("q3w_batch_slots", || {
        // SAFETY: the pointers are as the header says.
        let b = unsafe { exclusive(batch, "batch") }?;
        out(out_slots, "out_slots")?;
        unsafe { put(out_slots, b.batch.slots()) };
        Ok(())
    })
}

/// Slots free for `q3w_batch_session` (a freed session gives its slot back).
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_free_slots(batch: *mut q3w_batch, out_free: *mut usize) -> q3w_status {
    run("q3w_batch_free_slots", || {
        // SAFETY: the pointers are as the header says.
        let b = unsafe { exclusive(batch, "batch") }?;
        out(out_free, "out_free")?;
        unsafe { put(out_free, b.batch.free_slots()) };
        Ok(())
    })
}

/// Sets `*out_ready` to whether the batch's pipelines are built: from its
/// creation, a thread of its own builds and proves those of steps of every
/// session count up to its slots (at most 16). Steps before then give the
/// same tokens, more slowly. A host with a loading screen can poll this.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_pipelines_ready(
    batch: *mut q3w_batch,
    out_ready: *mut bool,
) -> q3w_status {
    run("q3w_batch_pipelines_ready", || {
        // SAFETY: the pointers are as the header says.
        let b = unsafe { exclusive(batch, "batch") }?;
        out(out_ready, "out_ready")?;
        unsafe { put(out_ready, b.batch.pipelines_ready()) };
        Ok(())
    })
}

/// Exclusive use of every session of a step's list: NULL entries and a
/// session listed twice are refused, naming `sessions`.
///
/// # Safety
/// Each entry is NULL or a live session handle no other call uses now.
unsafe fn session_list<'a>(handles: &[*mut q3w_session]) -> Result<Vec<Exclusive<'a, q3w_session>>> {
    for (i, &handle) in handles.iter().enumerate() {
        if handle.is_null() {
            return Err(invalid("sessions", format!("entry {i} is NULL")));
        }
        if let Some(j) = handles[..i].iter().position(|&h| h == handle) {
            return Err(invalid("sessions", format!("entries {j} and {i} are the same session")));
        }
    }
    // SAFETY: distinct live handles, as checked and as the caller promises.
    handles.iter().map(|&handle| unsafe { exclusive(handle, "sessions") }).collect()
}

/// The sessions behind `guards`, as a step takes them.
fn sessions_of<'a>(guards: &'a mut [Exclusive<'_, q3w_session>]) -> Vec<&'a mut Session> {
    guards.iter_mut().map(|g| &mut g.session).collect()
}

/// Advances each of the `n_sessions` sessions by one token in one GPU step
/// (waiting for it) and writes their tokens, in order, to `out_tokens` (room
/// for `n_sessions`): each session's token is what
/// `q3w_session_next_token` would give it, and the session is left as that
/// call leaves it. Pass any sessions of this batch: sessions join and leave
/// between steps. Before waiting, a step queues the next one for the same
/// sessions; the next call with the same list, in the same order and
/// untouched in between, finds it done or running.
///
/// Errors, before anything runs (no session changes):
/// `Q3W_INVALID_ARGUMENT` naming `sessions` (none, a NULL entry, one listed
/// twice, one not made by this batch), `logprobs` (one reporting
/// log-probabilities) or
/// `session` (a feed in progress); `Q3W_NO_PENDING_TOKEN` for a session
/// never fed; `Q3W_CONTEXT_OVERFLOW` for a full one.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_step(
    batch: *mut q3w_batch,
    sessions: *const *mut q3w_session,
    n_sessions: usize,
    out_tokens: *mut u32,
) -> q3w_status {
    run("q3w_batch_step", || {
        // SAFETY: the pointers are as the header says.
        let mut b = unsafe { exclusive(batch, "batch") }?;
        let handles = unsafe { array(sessions, n_sessions, "sessions") }?;
        let out_tokens = unsafe { array_out(out_tokens, n_sessions, "out_tokens") }?;
        let mut guards = unsafe { session_list(handles) }?;
        let tokens = b.batch.step(&mut sessions_of(&mut guards))?;
        out_tokens.copy_from_slice(&tokens);
        Ok(())
    })
}

/// `q3w_batch_step` that never waits for the GPU (call it once a frame):
/// while the step's tokens are on their way, `*out_ready` is false,
/// `out_tokens` is left as it was and every session is as it was; once
/// they are back, `*out_ready` is true and `out_tokens` holds them, the
/// sessions advanced as `q3w_batch_step` advances them. Call again with the
/// same sessions in the same order until ready. A call with another list
/// (or after a session changed: fed, truncated, stepped alone, freed) drops
/// the step in flight once it has finished, without waiting (no token is
/// lost: it advanced no session), and then submits its own. It mixes with
/// `q3w_batch_step`, which takes over (and waits for) a step in flight for
/// the same sessions. Errors as `q3w_batch_step`'s.
#[no_mangle]
pub unsafe extern "C" fn q3w_batch_try_step(
    batch: *mut q3w_batch,
    sessions: *const *mut q3w_session,
    n_sessions: usize,
    out_tokens: *mut u32,
    out_ready: *mut bool,
) -> q3w_status {
    run("q3w_batch_try_step", || {
        // SAFETY: the pointers are as the header says.
        let mut b = unsafe { exclusive(batch, "batch") }?;
        let handles = unsafe { array(sessions, n_sessions, "sessions") }?;
        let out_tokens = unsafe { array_out(out_tokens, n_sessions, "out_tokens") }?;
        out(out_ready, "out_ready")?;
        let mut guards = unsafe { session_list(handles) }?;
        let tokens = b.batch.try_step(&mut sessions_of(&mut guards))?;
        if let Some(tokens) = &tokens {
            out_tokens.copy_from_slice(tokens);
        }
        unsafe { put(out_ready, tokens.is_some()) };
        Ok(())
    })
}
