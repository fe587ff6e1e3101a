//! Output constraints on a session: a JSON schema, a regular expression, a
//! Lark grammar or tool calls, compiled against a tokenizer's vocabulary;
//! and reading tool calls out of a reply.

use std::ffi::c_char;

use qwen3_wgpu::{Constraint, Result, ToolChoice};

use super::{q3w_session, q3w_tokenizer};
use crate::owned::put_string;
use crate::{array, clear, exclusive, invalid, out, put, q3w_status, run, shared, text};

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

/// Constrains each reply of `session` to Qwen3 tool calls of the tools in
/// `tools_json` (a JSON list of `{"type": "function", "function": {"name",
/// "description", "parameters"}}`, as the chat template takes them), at
/// most `max_calls` (1 to 64) a reply, each call's arguments valid under
/// its tool's `parameters` schema. `tool_choice`: `"auto"` (free text until
/// the model's `<tool_call>` token, then calls), `"required"` (the reply is
/// calls) or a tool's name (calls of that tool). Read the calls back with
/// `q3w_parse_tool_calls`. A list that is not JSON or has an entry without
/// a name is `Q3W_INVALID_ARGUMENT` naming `tools` (and the entry); an
/// unknown tool name or a `max_calls` out of range names `tools` or
/// `max_calls`.
#[no_mangle]
pub unsafe extern "C" fn q3w_session_set_tools(
    session: *mut q3w_session,
    tokenizer: *const q3w_tokenizer,
    tools_json: *const c_char,
    tool_choice: *const c_char,
    max_calls: usize,
) -> q3w_status {
    run("q3w_session_set_tools", || {
        // SAFETY: the pointers are as the header says.
        let choice = match unsafe { text(tool_choice, "tool_choice") }? {
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            name => ToolChoice::Named(name.to_string()),
        };
        unsafe {
            set(session, tokenizer, tools_json, "tools", |t, source| {
                let tools: Vec<serde_json::Value> = serde_json::from_str(source)
                    .map_err(|e| invalid("tools", format!("not a JSON list of tools: {e}")))?;
                Constraint::tool_calls(t, &tools, &choice, max_calls)
            })
        }
    })
}

/// Reads the tool calls out of a reply's text (`text_len` bytes of UTF-8)
/// as Qwen3 writes them, into a new JSON string for `q3w_string_free`:
/// `{"content": TEXT OUTSIDE THE CALLS, "calls": [{"name", "arguments"}],
/// "incomplete": BOOL}` (`incomplete`: a call was cut off or not valid
/// JSON, and is left out). `out_len` may be NULL. Text that is not UTF-8
/// is `Q3W_INVALID_ARGUMENT` naming `text`.
#[no_mangle]
pub unsafe extern "C" fn q3w_parse_tool_calls(
    text: *const c_char,
    text_len: usize,
    out_json: *mut *mut c_char,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_parse_tool_calls", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_json) };
        let bytes = unsafe { array(text.cast::<u8>(), text_len, "text") }?;
        let text = std::str::from_utf8(bytes).map_err(|e| invalid("text", format!("not UTF-8: {e}")))?;
        out(out_json, "out_json")?;
        let reply = qwen3_wgpu::parse_tool_calls(text);
        let calls: Vec<serde_json::Value> = reply
            .calls
            .iter()
            .map(|c| serde_json::json!({ "name": c.name, "arguments": c.arguments }))
            .collect();
        let json =
            serde_json::json!({ "content": reply.content, "calls": calls, "incomplete": reply.incomplete });
        unsafe { put_string(&json.to_string(), out_json, out_len) }
    })
}
