//! Output constraints on a session: a JSON schema, a regular expression or
//! a Lark grammar, compiled against a tokenizer's vocabulary.

use std::ffi::c_char;

use qwen3_wgpu::{Constraint, Result};

use super::{q3w_session, q3w_tokenizer};
use crate::{exclusive, invalid, out, put, q3w_status, run, shared, text};

/// Sets `constraint` (built from `tokenizer`'s vocabulary) on `session`.
///
/// # Safety
/// The pointers are as the header says.
unsafe fn set(
    session: *mut q3w_session,
    tokenizer: *const q3w_tokenizer,
    source: *const c_char,
    name: &str,
    build: impl FnOnce(&qwen3_wgpu::Tokenizer, &str) -> Result<Constraint>,
) -> Result<()> {
    // SAFETY: the pointers are as the header says.
    let mut s = unsafe { exclusive(session, "session") }?;
    let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
    let source = unsafe { text(source, name) }?;
    let constraint = build(tokenizer, source)?;
    s.session.set_constraint(Some(&constraint))
}

/// Constrains each reply of `session` (the tokens returned after a feed,
/// the feed's own included; every feed and truncate starts it over) to one
/// JSON value valid under the JSON schema `schema` (UTF-8 JSON text), with
/// no whitespace between its tokens; `q3w_session_constraint_complete`
/// says when the reply is a whole match. `tokenizer` is the checkpoint's (its
/// vocabulary is mapped once, on the first constraint: about a second for
/// Qwen3's). A schema that is not JSON or that cannot be compiled is
/// `Q3W_INVALID_ARGUMENT` naming `json_schema` (the message says why; the
/// session is left as it was).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_json_schema(
    session: *mut q3w_session,
    tokenizer: *const q3w_tokenizer,
    schema: *const c_char,
) -> q3w_status {
    run("q3w_session_set_json_schema", || {
        // SAFETY: the pointers are as the header says.
        unsafe {
            set(session, tokenizer, schema, "json_schema", |t, source| {
                let schema: serde_json::Value = serde_json::from_str(source)
                    .map_err(|e| invalid("json_schema", format!("not JSON: {e}")))?;
                Constraint::json_schema(t, &schema)
            })
        }
    })
}

/// `q3w_session_set_json_schema` for a regular expression (Rust `regex`
/// syntax) the reply must match whole; errors name `regex`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_regex(
    session: *mut q3w_session,
    tokenizer: *const q3w_tokenizer,
    regex: *const c_char,
) -> q3w_status {
    run("q3w_session_set_regex", || {
        // SAFETY: the pointers are as the header says.
        unsafe { set(session, tokenizer, regex, "regex", Constraint::regex) }
    })
}

/// `q3w_session_set_json_schema` for a Lark grammar (llguidance's dialect)
/// the reply must derive from its `start` rule; errors name `grammar`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_grammar(
    session: *mut q3w_session,
    tokenizer: *const q3w_tokenizer,
    grammar: *const c_char,
) -> q3w_status {
    run("q3w_session_set_grammar", || {
        // SAFETY: the pointers are as the header says.
        unsafe { set(session, tokenizer, grammar, "grammar", Constraint::lark) }
    })
}

/// Lifts the session's constraint (none set is fine).
#[no_mangle]
pub unsafe extern "C" fn q3w_session_clear_constraint(session: *mut q3w_session) -> q3w_status {
    run("q3w_session_clear_constraint", || {
        // SAFETY: the pointer is as the header says.
        let mut s = unsafe { exclusive(session, "session") }?;
        s.session.set_constraint(None)
    })
}

/// Sets `*out_complete` to whether the tokens the session returned since
/// its constraint was set form a whole match (only end-of-text may follow);
/// false without a constraint.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_constraint_complete(
    session: *mut q3w_session,
    out_complete: *mut bool,
) -> q3w_status {
    run("q3w_session_constraint_complete", || {
        // SAFETY: the pointers are as the header says.
        let s = unsafe { exclusive(session, "session") }?;
        out(out_complete, "out_complete")?;
        unsafe { put(out_complete, s.session.constraint_complete()) };
        Ok(())
    })
}
