//! Tokenizers, streaming decoders and chat templates.

use std::ffi::c_char;
use std::path::Path;

use qwen3_wgpu::{ChatOptions, ChatTemplate, Message, Result, TextStream, Tokenizer};
use serde_json::Value as Json;

use crate::owned::put_string;
use crate::{
    array, clear, exclusive, init_options, invalid, optional_text, out, owned, put, q3w_status, read_options,
    run, shared, text, Options, Poisonable,
};

/// A checkpoint's tokenizer (`tokenizer.json`).
pub struct q3w_tokenizer {
    pub(crate) tokenizer: Tokenizer,
}

/// Decodes token ids one at a time into complete UTF-8 text.
pub struct q3w_text_stream {
    stream: TextStream,
    /// The last piece returned, NUL-terminated (borrowed by the caller).
    piece: Vec<u8>,
    poisoned: bool,
}

impl Poisonable for q3w_text_stream {
    fn poisoned(&mut self) -> &mut bool {
        &mut self.poisoned
    }
}

/// A checkpoint's chat template, compiled once.
pub struct q3w_chat_template {
    template: ChatTemplate,
}

// Handles the header says may be shared between threads.
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    const fn moved_between_threads<T: Send>() {}
    shared_between_threads::<q3w_tokenizer>();
    shared_between_threads::<q3w_chat_template>();
    moved_between_threads::<q3w_text_stream>();
};

/// Puts a new tokenizer handle into `out_tokenizer`.
///
/// # Safety
/// `out_tokenizer` is NULL or writable.
unsafe fn new_tokenizer(
    load: impl FnOnce() -> Result<Tokenizer>,
    out_tokenizer: *mut *mut q3w_tokenizer,
) -> Result<()> {
    // SAFETY: as the caller promises.
    unsafe { clear(out_tokenizer) };
    out(out_tokenizer, "out_tokenizer")?;
    let tokenizer = load()?;
    unsafe { put(out_tokenizer, Box::into_raw(Box::new(q3w_tokenizer { tokenizer }))) };
    Ok(())
}

/// Loads `checkpoint_dir/tokenizer.json`. Free it with `q3w_tokenizer_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_from_checkpoint(
    checkpoint_dir: *const c_char,
    out_tokenizer: *mut *mut q3w_tokenizer,
) -> q3w_status {
    run("q3w_tokenizer_from_checkpoint", || {
        // SAFETY: the pointers are as the header says.
        let dir = unsafe { text(checkpoint_dir, "checkpoint_dir") }?;
        unsafe { new_tokenizer(|| Tokenizer::from_checkpoint(Path::new(dir)), out_tokenizer) }
    })
}

/// Loads a `tokenizer.json` file. Free it with `q3w_tokenizer_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_from_file(
    path: *const c_char,
    out_tokenizer: *mut *mut q3w_tokenizer,
) -> q3w_status {
    run("q3w_tokenizer_from_file", || {
        // SAFETY: the pointers are as the header says.
        let path = unsafe { text(path, "path") }?;
        unsafe { new_tokenizer(|| Tokenizer::from_file(Path::new(path)), out_tokenizer) }
    })
}

/// Frees a tokenizer (NULL is allowed). Its text streams stay valid.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_free(tokenizer: *mut q3w_tokenizer) -> q3w_status {
    run("q3w_tokenizer_free", || {
        if !tokenizer.is_null() {
            // SAFETY: a live tokenizer handle, as the caller promises.
            drop(unsafe { Box::from_raw(tokenizer) });
        }
        Ok(())
    })
}

/// Number of ids the tokenizer knows, special tokens included.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_vocab_size(
    tokenizer: *const q3w_tokenizer,
    out_size: *mut usize,
) -> q3w_status {
    run("q3w_tokenizer_vocab_size", || {
        // SAFETY: the pointers are as the header says.
        let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
        out(out_size, "out_size")?;
        unsafe { put(out_size, tokenizer.vocab_size()) };
        Ok(())
    })
}

/// The id of a token string (`"<|im_end|>"`): `*out_found` says whether the
/// tokenizer has it (`*out_id` is left as it was when not).
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_token_id(
    tokenizer: *const q3w_tokenizer,
    token: *const c_char,
    out_id: *mut u32,
    out_found: *mut bool,
) -> q3w_status {
    run("q3w_tokenizer_token_id", || {
        // SAFETY: the pointers are as the header says.
        let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
        let token = unsafe { text(token, "token") }?;
        out(out_id, "out_id")?;
        out(out_found, "out_found")?;
        let id = tokenizer.token_id(token);
        unsafe {
            if let Some(id) = id {
                put(out_id, id);
            }
            put(out_found, id.is_some());
        }
        Ok(())
    })
}

/// Encodes with `encode` into a new token array for the caller.
///
/// # Safety
/// The pointers are as the header says for `q3w_tokenizer_encode`.
unsafe fn encode_with(
    tokenizer: *const q3w_tokenizer,
    input: *const c_char,
    out_ids: *mut *mut u32,
    out_len: *mut usize,
    encode: impl FnOnce(&Tokenizer, &str) -> Result<Vec<u32>>,
) -> Result<()> {
    // SAFETY: as the caller promises.
    unsafe { clear(out_ids) };
    let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
    let input = unsafe { text(input, "text") }?;
    out(out_ids, "out_ids")?;
    out(out_len, "out_len")?;
    let ids = encode(tokenizer, input)?;
    unsafe { put_tokens(&ids, out_ids, out_len) }
}

/// Writes a new token array and its length to the out-parameters.
///
/// # Safety
/// Both pointers are non-NULL and writable.
unsafe fn put_tokens(ids: &[u32], out_ids: *mut *mut u32, out_len: *mut usize) -> Result<()> {
    let ptr = owned::tokens(ids)?;
    // SAFETY: as the caller promises.
    unsafe {
        put(out_ids, ptr);
        put(out_len, ids.len());
    }
    Ok(())
}

/// Encodes UTF-8 `text` (no special tokens added). Special-token strings in
/// the text (`<|im_end|>`) become their control tokens: use
/// `q3w_tokenizer_encode_text` for text a user typed. `*out_ids` is a new
/// array of `*out_len` ids for `q3w_tokens_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_encode(
    tokenizer: *const q3w_tokenizer,
    text: *const c_char,
    out_ids: *mut *mut u32,
    out_len: *mut usize,
) -> q3w_status {
    // SAFETY: the pointers are as the header says.
    run("q3w_tokenizer_encode", || unsafe {
        encode_with(tokenizer, text, out_ids, out_len, Tokenizer::encode)
    })
}

/// `q3w_tokenizer_encode` with special-token strings encoded as the
/// characters they are made of, so text a user typed cannot end a turn or
/// open a system turn.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_encode_text(
    tokenizer: *const q3w_tokenizer,
    text: *const c_char,
    out_ids: *mut *mut u32,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_tokenizer_encode_text", || {
        // SAFETY: the pointers are as the header says.
        unsafe { encode_with(tokenizer, text, out_ids, out_len, Tokenizer::encode_text) }
    })
}

/// Decodes `n_ids` ids to text, special tokens included: a new string for
/// `q3w_string_free` (it may hold NUL bytes: `out_len`, which may be NULL,
/// receives its length). An id the tokenizer does not know is
/// `Q3W_INVALID_TOKEN_ID`.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokenizer_decode(
    tokenizer: *const q3w_tokenizer,
    ids: *const u32,
    n_ids: usize,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_tokenizer_decode", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_text) };
        let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
        let ids = unsafe { array(ids, n_ids, "ids") }?;
        out(out_text, "out_text")?;
        let decoded = tokenizer.decode(ids)?;
        unsafe { put_string(&decoded, out_text, out_len) }
    })
}

/// A streaming decoder over `tokenizer` (it keeps its own reference to the
/// vocabulary). Free it with `q3w_text_stream_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_text_stream_new(
    tokenizer: *const q3w_tokenizer,
    out_stream: *mut *mut q3w_text_stream,
) -> q3w_status {
    run("q3w_text_stream_new", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_stream) };
        let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
        out(out_stream, "out_stream")?;
        let stream = q3w_text_stream { stream: tokenizer.stream(), piece: vec![0], poisoned: false };
        unsafe { put(out_stream, Box::into_raw(Box::new(stream))) };
        Ok(())
    })
}

/// Frees a text stream (NULL is allowed).
#[no_mangle]
pub unsafe extern "C" fn q3w_text_stream_free(stream: *mut q3w_text_stream) -> q3w_status {
    run("q3w_text_stream_free", || {
        if !stream.is_null() {
            // SAFETY: a live text stream handle, as the caller promises.
            drop(unsafe { Box::from_raw(stream) });
        }
        Ok(())
    })
}

/// Hands the stream's new piece to the caller (borrowed).
///
/// # Safety
/// `out_text` is NULL or writable; `out_len` is NULL or writable.
unsafe fn stream_step(
    stream: *mut q3w_text_stream,
    out_text: *mut *const c_char,
    out_len: *mut usize,
    step: impl FnOnce(&mut TextStream) -> Result<String>,
) -> Result<()> {
    // SAFETY: as the caller promises.
    let mut s = unsafe { exclusive(stream, "stream") }?;
    out(out_text, "out_text")?;
    let piece = step(&mut s.stream)?;
    s.piece.clear();
    s.piece.extend_from_slice(piece.as_bytes());
    s.piece.push(0);
    unsafe {
        put(out_text, s.piece.as_ptr().cast());
        if !out_len.is_null() {
            put(out_len, piece.len());
        }
    }
    Ok(())
}

/// Pushes one id and writes the text it completes (possibly empty): bytes
/// of a character split across tokens are held back until it is complete,
/// so the pieces concatenate to `q3w_tokenizer_decode` of all ids. The text
/// is borrowed: valid until the next call on this stream (do not free it);
/// `out_len` (may be NULL) receives its length. An unknown id is
/// `Q3W_INVALID_TOKEN_ID` (the stream is left as it was).
#[no_mangle]
pub unsafe extern "C" fn q3w_text_stream_push(
    stream: *mut q3w_text_stream,
    id: u32,
    out_text: *mut *const c_char,
    out_len: *mut usize,
) -> q3w_status {
    // SAFETY: the pointers are as the header says.
    run("q3w_text_stream_push", || unsafe { stream_step(stream, out_text, out_len, |s| s.push(id)) })
}

/// Writes whatever the stream still holds back (at the end of a
/// generation), even an incomplete character (as U+FFFD), and starts it
/// afresh. Borrowed as for `q3w_text_stream_push`.
#[no_mangle]
pub unsafe extern "C" fn q3w_text_stream_finish(
    stream: *mut q3w_text_stream,
    out_text: *mut *const c_char,
    out_len: *mut usize,
) -> q3w_status {
    // SAFETY: the pointers are as the header says.
    run("q3w_text_stream_finish", || unsafe { stream_step(stream, out_text, out_len, TextStream::finish) })
}

/// Loads the chat template of the checkpoint in `checkpoint_dir`
/// (`chat_template.jinja`, else `tokenizer_config.json`'s
/// `chat_template`). Free it with `q3w_chat_template_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_chat_template_from_checkpoint(
    checkpoint_dir: *const c_char,
    out_template: *mut *mut q3w_chat_template,
) -> q3w_status {
    run("q3w_chat_template_from_checkpoint", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_template) };
        let dir = unsafe { text(checkpoint_dir, "checkpoint_dir") }?;
        out(out_template, "out_template")?;
        let template = ChatTemplate::from_checkpoint(Path::new(dir))?;
        unsafe { put(out_template, Box::into_raw(Box::new(q3w_chat_template { template }))) };
        Ok(())
    })
}

/// Compiles a chat template from its Jinja source. Free it with
/// `q3w_chat_template_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_chat_template_from_source(
    source: *const c_char,
    out_template: *mut *mut q3w_chat_template,
) -> q3w_status {
    run("q3w_chat_template_from_source", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_template) };
        let source = unsafe { text(source, "source") }?;
        out(out_template, "out_template")?;
        let template = ChatTemplate::from_source(source)?;
        unsafe { put(out_template, Box::into_raw(Box::new(q3w_chat_template { template }))) };
        Ok(())
    })
}

/// Frees a chat template (NULL is allowed).
#[no_mangle]
pub unsafe extern "C" fn q3w_chat_template_free(template: *mut q3w_chat_template) -> q3w_status {
    run("q3w_chat_template_free", || {
        if !template.is_null() {
            // SAFETY: a live chat template handle, as the caller promises.
            drop(unsafe { Box::from_raw(template) });
        }
        Ok(())
    })
}

/// One message of a conversation (UTF-8 strings, borrowed for the call).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_chat_message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: *const c_char,
    /// The message's text.
    pub content: *const c_char,
    /// NULL, or a JSON object of the message's other fields as transformers
    /// takes them (`reasoning_content`, `tool_calls`, `name` ...).
    pub extra_json: *const c_char,
}

/// How a conversation is rendered (`q3w_chat_options_init` sets the
/// defaults).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct q3w_chat_options {
    /// `sizeof(q3w_chat_options)`, set by `q3w_chat_options_init`.
    pub struct_size: usize,
    /// Nonzero (the default): end with the opening of an assistant turn.
    pub add_generation_prompt: i32,
    /// Qwen3's `enable_thinking`: -1 (the default) leaves it to the
    /// template (thinking on), 0 turns thinking off, 1 on.
    pub enable_thinking: i32,
    /// Nonzero: end inside the last message, so the model continues it
    /// (needs `add_generation_prompt` 0). Default 0.
    pub continue_final_message: i32,
    /// Nonzero: special-token strings inside contents become control
    /// tokens when encoding (transformers' behaviour). Default 0: text.
    pub special_tokens_in_content: i32,
    /// NULL, or a JSON array of tool (function) definitions.
    pub tools_json: *const c_char,
    /// NULL, or a JSON object of other template variables.
    pub variables_json: *const c_char,
}

impl Options for q3w_chat_options {
    const VERSION_SIZES: &'static [usize] = &[std::mem::size_of::<Self>()];
    fn defaults() -> Self {
        q3w_chat_options {
            struct_size: std::mem::size_of::<Self>(),
            add_generation_prompt: 1,
            enable_thinking: -1,
            continue_final_message: 0,
            special_tokens_in_content: 0,
            tools_json: std::ptr::null(),
            variables_json: std::ptr::null(),
        }
    }
}

/// Sets `options` to the defaults and its `struct_size` to `struct_size`,
/// which is `sizeof(q3w_chat_options)` as the caller's header declares it:
/// only that many bytes are written.
#[no_mangle]
pub unsafe extern "C" fn q3w_chat_options_init(
    options: *mut q3w_chat_options,
    struct_size: usize,
) -> q3w_status {
    // SAFETY: NULL or `struct_size` writable bytes, as the caller promises.
    run("q3w_chat_options_init", || unsafe { init_options(options, struct_size, "options") })
}

/// Parses an optional JSON argument.
///
/// # Safety
/// `ptr` is NULL or a NUL-terminated string.
unsafe fn json(ptr: *const c_char, name: &str) -> Result<Option<Json>> {
    // SAFETY: as the caller promises.
    match unsafe { optional_text(ptr, name) }? {
        None => Ok(None),
        Some(s) => serde_json::from_str(s).map(Some).map_err(|e| invalid(name, format!("is not JSON: {e}"))),
    }
}

/// The conversation and options the caller passed.
///
/// # Safety
/// The pointers are as the header says for `q3w_chat_template_render`.
unsafe fn conversation(
    messages: *const q3w_chat_message,
    n_messages: usize,
    options: *const q3w_chat_options,
) -> Result<(Vec<Message>, ChatOptions)> {
    // SAFETY: as the caller promises.
    let raw = unsafe { array(messages, n_messages, "messages") }?;
    let mut conversation = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let role = unsafe { text(m.role, &format!("messages[{i}].role")) }?;
        let content = unsafe { text(m.content, &format!("messages[{i}].content")) }?;
        let mut message = Message::new(role, content);
        let name = format!("messages[{i}].extra_json");
        match unsafe { json(m.extra_json, &name) }? {
            None => {}
            Some(Json::Object(extra)) => {
                if let Some(key) = ["role", "content"].into_iter().find(|k| extra.contains_key(*k)) {
                    return Err(invalid(&name, format!("sets \"{key}\": pass it as the message's {key}")));
                }
                message.extra = extra;
            }
            Some(_) => return Err(invalid(&name, "is not a JSON object")),
        }
        conversation.push(message);
    }
    let o = unsafe { read_options(options, "options") }?;
    let mut chat = ChatOptions::default()
        .add_generation_prompt(o.add_generation_prompt != 0)
        .special_tokens_in_content(o.special_tokens_in_content != 0);
    // `continue_final_message` is set as given (not through its builder,
    // which would quietly turn `add_generation_prompt` off): both set is
    // the caller's mistake, which rendering reports.
    chat.continue_final_message = o.continue_final_message != 0;
    chat = match o.enable_thinking {
        -1 => chat,
        0 => chat.enable_thinking(false),
        1 => chat.enable_thinking(true),
        other => return Err(invalid("enable_thinking", format!("{other} is not -1, 0 or 1"))),
    };
    match unsafe { json(o.tools_json, "tools_json") }? {
        None => {}
        Some(Json::Array(tools)) => chat = chat.tools(tools),
        Some(_) => return Err(invalid("tools_json", "is not a JSON array")),
    }
    match unsafe { json(o.variables_json, "variables_json") }? {
        None => {}
        Some(Json::Object(variables)) => chat.variables = variables,
        Some(_) => return Err(invalid("variables_json", "is not a JSON object")),
    }
    Ok((conversation, chat))
}

/// Renders `n_messages` messages to the prompt text, byte for byte what
/// transformers' `apply_chat_template(..., tokenize=False)` returns with
/// the same options: a new string for `q3w_string_free` (`out_len` may be
/// NULL). `options` may be NULL. An empty conversation, or one the template
/// rejects, is `Q3W_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn q3w_chat_template_render(
    template: *const q3w_chat_template,
    messages: *const q3w_chat_message,
    n_messages: usize,
    options: *const q3w_chat_options,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_chat_template_render", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_text) };
        let template = &unsafe { shared(template, "template") }?.template;
        let (messages, options) = unsafe { conversation(messages, n_messages, options) }?;
        out(out_text, "out_text")?;
        let rendered = template.render(&messages, &options)?;
        unsafe { put_string(&rendered, out_text, out_len) }
    })
}

/// Renders and encodes a conversation with `tokenizer`, ready to feed: only
/// the template's own control tokens are special (special-token strings in
/// contents are text, unless `special_tokens_in_content`). `*out_ids` is a
/// new array of `*out_len` ids for `q3w_tokens_free`.
#[no_mangle]
pub unsafe extern "C" fn q3w_chat_template_encode(
    template: *const q3w_chat_template,
    tokenizer: *const q3w_tokenizer,
    messages: *const q3w_chat_message,
    n_messages: usize,
    options: *const q3w_chat_options,
    out_ids: *mut *mut u32,
    out_len: *mut usize,
) -> q3w_status {
    run("q3w_chat_template_encode", || {
        // SAFETY: the pointers are as the header says.
        unsafe { clear(out_ids) };
        let template = &unsafe { shared(template, "template") }?.template;
        let tokenizer = &unsafe { shared(tokenizer, "tokenizer") }?.tokenizer;
        let (messages, options) = unsafe { conversation(messages, n_messages, options) }?;
        out(out_ids, "out_ids")?;
        out(out_len, "out_len")?;
        let ids = template.encode(tokenizer, &messages, &options)?;
        unsafe { put_tokens(&ids, out_ids, out_len) }
    })
}
