//! Sessions beyond greedy feeding: sampling parameters, log-probabilities,
//! the non-blocking feed, forking, saving and restoring, and the context's
//! tokens.

use std::ffi::c_char;
use std::path::Path;

use qwen3_wgpu::{FeedStatus, SamplingParams};

use crate::engine::{put_string, q3w_model, q3w_session};
use crate::{
    array, array_out, clear, exclusive, init_options, out, owned, put, q3w_status, read_options, run, shared,
    text, write_options, Options,
};

/// How a session chooses its tokens (`q3w_sampling_params_init` sets the
/// defaults: greedy). Applied in Hugging Face's order: penalties over the
/// last `penalty_window` tokens, temperature, top-k, top-p, min-p, then a
/// draw keyed by (`seed`, position, token id): the same seed gives the same
/// tokens on every run.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_sampling_params {
    /// `sizeof(q3w_sampling_params)`, set by `q3w_sampling_params_init`.
    pub struct_size: usize,
    /// 0 (the default) and anything below 1e-5 is greedy; else the logits
    /// are divided by it. Finite and >= 0.
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (0, the default: off).
    pub top_k: u32,
    /// Keep the smallest set of largest logits whose probability reaches
    /// `top_p`, in (0, 1] (1, the default: off).
    pub top_p: f32,
    /// Keep the tokens whose probability is at least `min_p` times the top
    /// token's, in [0, 1] (0, the default: off).
    pub min_p: f32,
    /// Hugging Face's repetition penalty, in [1e-6, 1e6] (1, the default:
    /// off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token in the window, in
    /// [-1e6, 1e6] (0, the default: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the window,
    /// in [-1e6, 1e6] (0, the default: off).
    pub frequency_penalty: f32,
    /// The penalties' window, in tokens of the context (prompt included):
    /// default 64, at most 1024.
    pub penalty_window: u32,
    /// The seed of the draws (default 0).
    pub seed: u64,
}

impl Options for q3w_sampling_params {
    const VERSION_SIZES: &'static [usize] = &[std::mem::size_of::<Self>()];
    fn defaults() -> Self {
        Self::from_params(&SamplingParams::default())
    }
}

impl q3w_sampling_params {
    fn from_params(p: &SamplingParams) -> Self {
        q3w_sampling_params {
            struct_size: std::mem::size_of::<Self>(),
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            penalty_window: p.penalty_window,
            seed: p.seed,
        }
    }

    fn to_params(self) -> SamplingParams {
        SamplingParams::default()
            .temperature(self.temperature)
            .top_k(self.top_k)
            .top_p(self.top_p)
            .min_p(self.min_p)
            .repetition_penalty(self.repetition_penalty)
            .presence_penalty(self.presence_penalty)
            .frequency_penalty(self.frequency_penalty)
            .penalty_window(self.penalty_window)
            .seed(self.seed)
    }
}

/// Sets `params` to the defaults (greedy) and its `struct_size` to
/// `struct_size`, which is `sizeof(q3w_sampling_params)` as the caller's
/// header declares it: only that many bytes are written.
#[no_mangle]
pub unsafe extern "C" fn q3w_sampling_params_init(
    params: *mut q3w_sampling_params,
    struct_size: usize,
) -> q3w_status {
    // SAFETY: NULL or `struct_size` writable bytes, as the caller promises.
    run("q3w_sampling_params_init", || unsafe { init_options(params, struct_size, "params") })
}

/// Sets `params` (initialised by `q3w_sampling_params_init`) to the
/// checkpoint's own settings, from `checkpoint_dir/generation_config.json`
/// as Hugging Face's `generate` reads them: `do_sample` false or absent is
/// greedy; otherwise its `temperature`, `top_k`, `top_p` and `min_p`; its
/// `repetition_penalty` either way. No file: greedy. The seed is 0: set it
/// afterwards. A malformed file is `Q3W_CHECKPOINT_INVALID` (`params` is
/// then left as it was).
#[no_mangle]
pub unsafe extern "C" fn q3w_sampling_params_from_generation_config(
    checkpoint_dir: *const c_char,
    params: *mut q3w_sampling_params,
) -> q3w_status {
    run("q3w_sampling_params_from_generation_config", || {
        // SAFETY: the pointers are as the header says.
        let dir = unsafe { text(checkpoint_dir, "checkpoint_dir") }?;
        out(params, "params")?;
        // The struct is checked before the file is read.
        unsafe { read_options(params, "params") }?;
        let read = SamplingParams::from_generation_config(Path::new(dir))?;
        unsafe { write_options(params, q3w_sampling_params::from_params(&read), "params") }
    })
}

/// Sets how the session chooses its next tokens: `params` NULL means
/// greedy. Steps queued ahead are discarded, so the next token already
/// follows the new parameters. A bad value is `Q3W_INVALID_ARGUMENT`
/// naming the field (the session is left as it was), as is a call while a
/// `q3w_session_begin_feed` is in progress (naming `session`). A fork
/// carries the parameters; a restored session is greedy.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_sampling(
    session: *mut q3w_session,
    params: *const q3w_sampling_params,
) -> q3w_status {
    run("q3w_session_set_sampling", || {
        // SAFETY: the pointers are as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        let params = unsafe { read_options(params, "params") }?;
        s.session.set_sampling(&params.to_params())
    })
}

/// The session's sampling parameters, written into `params` (initialised
/// by `q3w_sampling_params_init`; its `struct_size` is kept).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_sampling(
    session: *mut q3w_session,
    params: *mut q3w_sampling_params,
) -> q3w_status {
    run("q3w_session_sampling", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        let current = q3w_sampling_params::from_params(s.session.sampling());
        unsafe { write_options(params, current, "params") }
    })
}

/// The most log-probabilities a session reports per token
/// (`q3w_session_set_logprobs`).
pub const Q3W_MAX_LOGPROBS: u32 = 20;

const _: () = assert!(Q3W_MAX_LOGPROBS == qwen3_wgpu::internals::kernels::sample::MAX_LOGPROBS);

/// A token and its log-probability (natural log of its probability under
/// the model's raw logits: log_softmax, before sampling's penalties and
/// temperature), <= 0.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_logprob {
    /// The token id.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
}

/// Reports, with each token the session returns from now on (`feed`,
/// `next_token`, `try_next_token`, `poll_feed`), its log-probability and
/// those of the `n` most likely tokens (`q3w_session_last_logprobs`); 0
/// turns them off (no cost then). Steps queued ahead are discarded, so the
/// next token already reports them. More than `Q3W_MAX_LOGPROBS` is
/// `Q3W_INVALID_ARGUMENT` naming `logprobs`, a call while a
/// `q3w_session_begin_feed` is in progress `Q3W_INVALID_ARGUMENT` naming
/// `session` (the session is left as it was either way). A session
/// reporting them is refused by batch steps (`logprobs`).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_logprobs(session: *mut q3w_session, n: u32) -> q3w_status {
    run("q3w_session_set_logprobs", || {
        // SAFETY: the pointer is as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        s.session.set_logprobs(n)
    })
}

/// The most prompt positions one batch of a feed runs, the default
/// (`q3w_session_set_prompt_batch`).
pub const Q3W_PREFILL_BATCH: u32 = 256;

const _: () = assert!(Q3W_PREFILL_BATCH as usize == qwen3_wgpu::PREFILL_BATCH);

/// Sets the most prompt positions one batch of the session's feeds runs
/// (`q3w_session_feed`, `q3w_session_begin_feed`): 1 up to
/// `Q3W_PREFILL_BATCH` (or the capacity, if smaller), the default. Smaller
/// batches feed more slowly, but a polled feed then puts less GPU work
/// ahead of a renderer sharing the queue (256 positions of the 0.6B are ~8
/// ms of an H100, 64 ~2 ms). Takes effect at the next feed; a fork keeps
/// it. Anything else is `Q3W_INVALID_ARGUMENT` naming `prompt_batch` (the
/// setting is left as it was).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_prompt_batch(
    session: *mut q3w_session,
    positions: usize,
) -> q3w_status {
    run("q3w_session_set_prompt_batch", || {
        // SAFETY: the pointer is as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        s.session.set_prompt_batch(positions)
    })
}

/// The log-probabilities of the last token the session returned, when
/// `q3w_session_set_logprobs` is on: `*out_available` is true,
/// `*out_chosen` the token and its log-probability, and `*out_n_top` the
/// count N of its most likely tokens (N as set), of which the first
/// `min(N, top_capacity)` are written to `top`, most likely first (equal
/// log-probabilities by lowest id); nothing is written past
/// `top_capacity` (`top` may be NULL when it is 0), so an array of
/// `Q3W_MAX_LOGPROBS` always holds them all. Under greedy decoding the
/// chosen token is the first entry. Otherwise (off, no token returned
/// since it was set, or after a truncate) `*out_available` is false,
/// `*out_n_top` 0, and `out_chosen` and `top` are left as they were.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_last_logprobs(
    session: *mut q3w_session,
    out_chosen: *mut q3w_logprob,
    top: *mut q3w_logprob,
    top_capacity: usize,
    out_n_top: *mut usize,
    out_available: *mut bool,
) -> q3w_status {
    run("q3w_session_last_logprobs", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_chosen, "out_chosen")?;
        let top = unsafe { array_out(top, top_capacity, "top") }?;
        out(out_n_top, "out_n_top")?;
        out(out_available, "out_available")?;
        let last = s.session.last_logprobs();
        if let Some(lp) = last {
            for (slot, &(token, logprob)) in top.iter_mut().zip(&lp.top) {
                *slot = q3w_logprob { token, logprob };
            }
        }
        unsafe {
            if let Some(lp) = last {
                put(out_chosen, q3w_logprob { token: lp.token, logprob: lp.logprob });
            }
            put(out_n_top, last.map_or(0, |lp| lp.top.len()));
            put(out_available, last.is_some());
        }
        Ok(())
    })
}

/// Starts feeding `n_ids` tokens without blocking: checks them as
/// `q3w_session_feed` does (every id, the capacity, the pending token
/// committed first; the same statuses, before anything is submitted),
/// submits the first prompt batch and returns. Then call
/// `q3w_session_poll_feed` (say once a frame) until it is ready. At most
/// one prompt batch is on the GPU at a time, so a renderer sharing the GPU
/// never waits behind a backlog of prompt work.
///
/// While the feed is in progress, the calls that run the model or change
/// or read the context (`feed`, `begin_feed`, `next_token`,
/// `try_next_token`, `truncate`, `fork`, `save`, `tokens`, `set_sampling`)
/// are `Q3W_INVALID_ARGUMENT` naming `session`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_begin_feed(
    session: *mut q3w_session,
    ids: *const u32,
    n_ids: usize,
) -> q3w_status {
    run("q3w_session_begin_feed", || {
        // SAFETY: the pointers are as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        let ids = unsafe { array(ids, n_ids, "ids") }?;
        // The pending token is committed ahead of the ids.
        let total = ids.len() + usize::from(s.session.pending().is_some());
        s.session.begin_feed(ids)?;
        s.feed_total = total;
        Ok(())
    })
}

/// Advances the feed `q3w_session_begin_feed` started, never waiting for
/// the GPU. While it is under way, `*out_ready` is false and `*out_token`
/// is left as it was; once the last position's token has arrived,
/// `*out_ready` is true and `*out_token` is that token (what
/// `q3w_session_feed` would have returned; the session is then exactly as
/// after it). `out_fed` and `out_total` (each may be NULL) receive the
/// positions done and the positions the feed runs (the ids plus a pending
/// token committed ahead of them). No feed in progress is
/// `Q3W_INVALID_ARGUMENT` naming `session`; a GPU failure rewinds the
/// session to where the feed began.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_poll_feed(
    session: *mut q3w_session,
    out_token: *mut u32,
    out_ready: *mut bool,
    out_fed: *mut usize,
    out_total: *mut usize,
) -> q3w_status {
    run("q3w_session_poll_feed", || {
        // SAFETY: the pointers are as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        out(out_token, "out_token")?;
        out(out_ready, "out_ready")?;
        let (ready, fed, total) = match s.session.poll_feed()? {
            FeedStatus::Ready(token) => {
                unsafe { put(out_token, token) };
                (true, s.feed_total, s.feed_total)
            }
            FeedStatus::Pending { fed, total } => (false, fed, total),
            // A status this library does not know yet: still under way.
            _ => (false, 0, s.feed_total),
        };
        unsafe {
            put(out_ready, ready);
            if !out_fed.is_null() {
                put(out_fed, fed);
            }
            if !out_total.is_null() {
                put(out_total, total);
            }
        }
        Ok(())
    })
}

/// Whether a feed begun by `q3w_session_begin_feed` is still in progress.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_is_feeding(
    session: *mut q3w_session,
    out_feeding: *mut bool,
) -> q3w_status {
    run("q3w_session_is_feeding", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_feeding, "out_feeding")?;
        unsafe { put(out_feeding, s.session.is_feeding()) };
        Ok(())
    })
}

/// A second session holding this one's context: its KV rows, tokens and
/// pending token are copied on the GPU, its lookahead and sampling
/// parameters carried over; the two are independent afterwards (one
/// system prompt fed once can start many conversations). `capacity` 0
/// keeps this session's capacity; otherwise it is from `q3w_session_len`
/// up to the model's maximum, else `Q3W_CONTEXT_OVERFLOW`. Free the fork
/// with `q3w_session_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_fork(
    session: *mut q3w_session,
    capacity: usize,
    out_fork: *mut *mut q3w_session,
) -> q3w_status {
    run("q3w_session_fork", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_fork) };
        let s = unsafe { exclusive(session, "session") }?;
        out(out_fork, "out_fork")?;
        let fork = match capacity {
            0 => s.session.fork()?,
            n => s.session.fork_with_capacity(n)?,
        };
        unsafe { put(out_fork, Box::into_raw(Box::new(q3w_session::new(fork)))) };
        Ok(())
    })
}

/// Writes the session (its tokens, KV rows, pending token and capacity,
/// and the model's weights fingerprint) to the file `path` (UTF-8), for
/// `q3w_model_restore_session`: written to a temporary file in the same
/// directory and renamed into place, so `path` only ever holds a complete
/// file. A missing or unwritable directory is `Q3W_SESSION_IO` and leaves
/// no file. The session is left as it was.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_save(session: *mut q3w_session, path: *const c_char) -> q3w_status {
    run("q3w_session_save", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        let path = unsafe { text(path, "path") }?;
        s.session.save(path)
    })
}

/// Reads a session saved by `q3w_session_save`, at `capacity` positions
/// (0: the saved capacity; else at least the saved length, otherwise
/// `Q3W_CONTEXT_OVERFLOW`). It continues exactly as the saved session
/// would have, greedy until `q3w_session_set_sampling`. A missing file is
/// `Q3W_SESSION_IO`, a damaged one `Q3W_SESSION_FILE_INVALID`, an intact
/// file of other weights `Q3W_SESSION_MODEL_MISMATCH`. Free it with
/// `q3w_session_free`.
///
/// Any file is safe to pass: only a regular file is read (a FIFO, a device
/// or a directory is `Q3W_SESSION_FILE_INVALID` at once), and its header is
/// checked against the file's length and the model before anything it
/// sizes is allocated, so a crafted, truncated or damaged file is a status,
/// never an abort (`Q3W_OUT_OF_MEMORY` if the host cannot stage one
/// layer's rows). `*out_session` is NULL on any error.
#[no_mangle]
pub unsafe extern "C" fn q3w_model_restore_session(
    model: *const q3w_model,
    path: *const c_char,
    capacity: usize,
    out_session: *mut *mut q3w_session,
) -> q3w_status {
    run("q3w_model_restore_session", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_session) };
        let model = &unsafe { shared(model, "model") }?.model;
        let path = unsafe { text(path, "path") }?;
        out(out_session, "out_session")?;
        let session = match capacity {
            0 => model.restore_session(path)?,
            n => model.restore_session_with_capacity(path, n)?,
        };
        unsafe { put(out_session, Box::into_raw(Box::new(q3w_session::new(session)))) };
        Ok(())
    })
}

/// The model's weights fingerprint (hex text; loads of the same
/// checkpoint share it, converted or from the cache): a string for
/// `q3w_string_free`, `out_len` (may be NULL) receiving its length. Waits
/// for the fingerprint's hashing when a load has just finished.
#[no_mangle]
pub unsafe extern "C" fn q3w_model_fingerprint(
    model: *const q3w_model,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_model_fingerprint", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_text) };
        let model = &unsafe { shared(model, "model") }?.model;
        out(out_text, "out_text")?;
        unsafe { put_string(model.fingerprint(), out_text, out_len) }
    })
}

/// The token ids of the positions in the session's KV cache, in order
/// (the pending token is `q3w_session_pending`'s): `*out_ids` is a new
/// array of `*out_len` ids for `q3w_tokens_free`. Waits for the GPU.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_tokens(
    session: *mut q3w_session,
    out_ids: *mut *mut u32,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_session_tokens", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_ids) };
        let s = unsafe { exclusive(session, "session") }?;
        out(out_ids, "out_ids")?;
        out(out_len, "out_len")?;
        let ids = s.session.tokens()?;
        let ptr = owned::tokens(&ids)?;
        unsafe {
            put(out_ids, ptr);
            put(out_len, ids.len());
        }
        Ok(())
    })
}
