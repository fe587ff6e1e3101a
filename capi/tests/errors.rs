//! Every error path of the C functions: the status (the crate's stable
//! code) and the thread's message, called as C calls them.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

use qwen3wgpu::q3w_status::*;
use qwen3wgpu::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/mlx/gqa2_hd64")
}

fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3-tokenizer")
}

fn c(s: impl AsRef<str>) -> CString {
    CString::new(s.as_ref()).unwrap()
}

fn c_path(p: &Path) -> CString {
    c(p.to_str().unwrap())
}

fn message() -> String {
    unsafe { CStr::from_ptr(q3w_last_error_message()) }.to_str().unwrap().to_string()
}

/// Asserts the status and that the message contains each of `words`.
#[track_caller]
fn expect(status: q3w_status, want: q3w_status, words: &[&str]) {
    let m = message();
    assert_eq!(status, want, "message: {m}");
    for w in words {
        assert!(m.contains(w), "{m:?} lacks {w:?}");
    }
}

struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

/// One portable engine for the whole test binary (engines and models may
/// be shared between threads).
fn shared_engine() -> *mut q3w_engine {
    static ENGINE: OnceLock<Shared<q3w_engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let mut options = unsafe { std::mem::zeroed::<q3w_engine_options>() };
            assert_eq!(unsafe { q3w_engine_options_init(&mut options) }, Q3W_OK);
            options.adapter_policy = Q3W_ADAPTER_POLICY_PORTABLE;
            let mut engine = null_mut();
            expect(unsafe { q3w_engine_new(&options, &mut engine) }, Q3W_OK, &[]);
            Shared(engine)
        })
        .0
}

fn no_cache() -> q3w_load_options {
    let mut options = unsafe { std::mem::zeroed::<q3w_load_options>() };
    assert_eq!(unsafe { q3w_load_options_init(&mut options) }, Q3W_OK);
    options.cache_policy = Q3W_CACHE_DISABLED;
    options
}

fn shared_model() -> *mut q3w_model {
    static MODEL: OnceLock<Shared<q3w_model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let mut model = null_mut();
            let dir = c_path(&fixture());
            expect(
                unsafe { q3w_model_load(shared_engine(), dir.as_ptr(), &no_cache(), &mut model) },
                Q3W_OK,
                &[],
            );
            Shared(model)
        })
        .0
}

fn new_session(capacity: usize) -> *mut q3w_session {
    let mut options = unsafe { std::mem::zeroed::<q3w_session_options>() };
    assert_eq!(unsafe { q3w_session_options_init(&mut options) }, Q3W_OK);
    options.capacity = capacity;
    let mut session = null_mut();
    expect(unsafe { q3w_session_new(shared_model(), &options, &mut session) }, Q3W_OK, &[]);
    session
}

fn shared_tokenizer() -> *mut q3w_tokenizer {
    static TOKENIZER: OnceLock<Shared<q3w_tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let mut tokenizer = null_mut();
            let dir = c_path(&tokenizer_dir());
            expect(unsafe { q3w_tokenizer_from_checkpoint(dir.as_ptr(), &mut tokenizer) }, Q3W_OK, &[]);
            Shared(tokenizer)
        })
        .0
}

#[test]
fn null_handles_and_out_pointers_are_invalid_arguments() {
    let mut token = 0u32;
    let mut size = 0usize;
    let mut ready = false;
    let ids = [1u32];
    unsafe {
        expect(
            q3w_session_feed(null_mut(), ids.as_ptr(), 1, &mut token),
            Q3W_INVALID_ARGUMENT,
            &["session: is NULL"],
        );
        expect(q3w_session_next_token(null_mut(), &mut token), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        expect(
            q3w_session_try_next_token(null_mut(), &mut token, &mut ready),
            Q3W_INVALID_ARGUMENT,
            &["session"],
        );
        expect(q3w_session_truncate(null_mut(), 0), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        expect(q3w_session_len(null_mut(), &mut size), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        expect(q3w_model_vocab_size(null(), &mut size), Q3W_INVALID_ARGUMENT, &["model: is NULL"]);
        let mut model = null_mut();
        let dir = c_path(&fixture());
        expect(
            q3w_model_load(null(), dir.as_ptr(), null(), &mut model),
            Q3W_INVALID_ARGUMENT,
            &["engine: is NULL"],
        );
        expect(
            q3w_model_load(shared_engine(), null(), null(), &mut model),
            Q3W_INVALID_ARGUMENT,
            &["checkpoint_dir: is NULL"],
        );
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), null(), null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["out_model: is NULL"],
        );
        let mut session = null_mut();
        expect(q3w_session_new(null(), null(), &mut session), Q3W_INVALID_ARGUMENT, &["model: is NULL"]);
        let s = new_session(8);
        expect(
            q3w_session_feed(s, null(), 1, &mut token),
            Q3W_INVALID_ARGUMENT,
            &["ids: is NULL with a count of 1"],
        );
        expect(
            q3w_session_feed(s, ids.as_ptr(), 1, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["out_next: is NULL"],
        );
        // Nothing was fed by the refused calls.
        expect(q3w_session_len(s, &mut size), Q3W_OK, &[]);
        assert_eq!(size, 0);
        assert_eq!(q3w_session_free(s), Q3W_OK);
        let mut out_ids = null_mut();
        let mut n = 0usize;
        let text = c("hello");
        expect(
            q3w_tokenizer_encode(null(), text.as_ptr(), &mut out_ids, &mut n),
            Q3W_INVALID_ARGUMENT,
            &["tokenizer: is NULL"],
        );
        expect(
            q3w_tokenizer_encode(shared_tokenizer(), null(), &mut out_ids, &mut n),
            Q3W_INVALID_ARGUMENT,
            &["text: is NULL"],
        );
        let mut stream = null_mut();
        expect(q3w_text_stream_new(null(), &mut stream), Q3W_INVALID_ARGUMENT, &["tokenizer: is NULL"]);
        let mut piece = null();
        expect(
            q3w_text_stream_push(null_mut(), 1, &mut piece, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["stream: is NULL"],
        );
        let mut rendered = null_mut();
        expect(
            q3w_chat_template_render(null(), null(), 0, null(), &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["template: is NULL"],
        );
        expect(q3w_engine_options_init(null_mut()), Q3W_INVALID_ARGUMENT, &["options: is NULL"]);
        // Freeing NULL is allowed, as free(NULL) is.
        assert_eq!(q3w_engine_free(null_mut()), Q3W_OK);
        assert_eq!(q3w_session_free(null_mut()), Q3W_OK);
        assert_eq!(message(), "");
    }
}

#[test]
fn bad_option_values_are_invalid_arguments() {
    unsafe {
        let mut options = std::mem::zeroed::<q3w_engine_options>();
        let mut engine = std::ptr::dangling_mut::<q3w_engine>(); // not NULL: a failure resets it
                                                                 // Never initialised: struct_size 0.
        expect(q3w_engine_new(&options, &mut engine), Q3W_INVALID_ARGUMENT, &["options", "struct_size is 0"]);
        assert!(engine.is_null());
        assert_eq!(q3w_engine_options_init(&mut options), Q3W_OK);
        options.adapter_policy = 7;
        expect(q3w_engine_new(&options, &mut engine), Q3W_INVALID_ARGUMENT, &["adapter_policy", "7 is not"]);
        options.adapter_policy = Q3W_ADAPTER_POLICY_PORTABLE;
        options.kernels = 3;
        expect(q3w_engine_new(&options, &mut engine), Q3W_INVALID_ARGUMENT, &["kernels", "3 is not"]);

        let dir = c_path(&fixture());
        let mut model = null_mut();
        let mut load = no_cache();
        load.cache_policy = 9;
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
            Q3W_INVALID_ARGUMENT,
            &["cache_policy"],
        );
        load.cache_policy = Q3W_CACHE_DIR;
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
            Q3W_INVALID_ARGUMENT,
            &["cache_dir: is NULL"],
        );
        load = no_cache();
        load.shape_profile = 2;
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
            Q3W_INVALID_ARGUMENT,
            &["shape_profile"],
        );

        // A newer header's struct: bytes past the fields known here must be
        // zero (a field this library would ignore is refused).
        #[repr(C)]
        struct Newer {
            known: q3w_session_options,
            added: u64,
        }
        let mut newer = Newer { known: std::mem::zeroed(), added: 0 };
        assert_eq!(q3w_session_options_init(&mut newer.known), Q3W_OK);
        newer.known.struct_size = std::mem::size_of::<Newer>();
        newer.known.capacity = 8;
        let mut session = null_mut();
        let known = &newer.known as *const q3w_session_options;
        expect(q3w_session_new(shared_model(), known, &mut session), Q3W_OK, &[]);
        let mut capacity = 0;
        assert_eq!(q3w_session_capacity(session, &mut capacity), Q3W_OK);
        assert_eq!(capacity, 8);
        assert_eq!(q3w_session_free(session), Q3W_OK);
        newer.added = 1;
        let known = &newer.known as *const q3w_session_options;
        expect(
            q3w_session_new(shared_model(), known, &mut session),
            Q3W_INVALID_ARGUMENT,
            &["options", "newer version"],
        );
    }
}

#[cfg(not(target_os = "macos"))]
#[test]
fn metal_only_off_apple_is_non_metal_adapter() {
    unsafe {
        let mut options = std::mem::zeroed::<q3w_engine_options>();
        assert_eq!(q3w_engine_options_init(&mut options), Q3W_OK);
        options.adapter_policy = Q3W_ADAPTER_POLICY_METAL_ONLY;
        let mut engine = null_mut();
        expect(q3w_engine_new(&options, &mut engine), Q3W_NON_METAL_ADAPTER, &["Metal"]);
        assert!(engine.is_null());
    }
}

#[test]
fn checkpoint_errors() {
    let scratch = tempfile::tempdir().unwrap();
    unsafe {
        let mut model = std::ptr::dangling_mut::<q3w_model>();
        let missing = c_path(&scratch.path().join("no-such-checkpoint"));
        expect(
            q3w_model_load(shared_engine(), missing.as_ptr(), &no_cache(), &mut model),
            Q3W_CHECKPOINT_NOT_FOUND,
            &["no-such-checkpoint"],
        );
        assert!(model.is_null());
        let dir = c_path(&fixture());
        let mut load = no_cache();
        load.shape_profile = Q3W_SHAPE_QWEN3_0_6B;
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
            Q3W_UNSUPPORTED_CHECKPOINT_ARCHITECTURE,
            &["hidden_size"],
        );
        // A cache directory that is a file.
        let file = scratch.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let file = c_path(&file);
        load = no_cache();
        load.cache_policy = Q3W_CACHE_DIR;
        load.cache_dir = file.as_ptr();
        expect(q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model), Q3W_CACHE_IO, &["a-file"]);

        let mut tokenizer = null_mut();
        expect(
            q3w_tokenizer_from_checkpoint(missing.as_ptr(), &mut tokenizer),
            Q3W_CHECKPOINT_NOT_FOUND,
            &[],
        );
        let broken = scratch.path().join("tokenizer.json");
        std::fs::write(&broken, b"{ not json").unwrap();
        let broken = c_path(&broken);
        expect(
            q3w_tokenizer_from_file(broken.as_ptr(), &mut tokenizer),
            Q3W_CHECKPOINT_INVALID,
            &["tokenizer.json"],
        );
        let mut template = null_mut();
        expect(
            q3w_chat_template_from_checkpoint(missing.as_ptr(), &mut template),
            Q3W_CHECKPOINT_NOT_FOUND,
            &[],
        );
        let source = c("{% for m in messages %}");
        expect(q3w_chat_template_from_source(source.as_ptr(), &mut template), Q3W_CHECKPOINT_INVALID, &[]);
    }
}

#[test]
fn session_errors() {
    unsafe {
        let mut session = null_mut();
        let mut options = std::mem::zeroed::<q3w_session_options>();
        assert_eq!(q3w_session_options_init(&mut options), Q3W_OK);
        options.capacity = 4097;
        expect(
            q3w_session_new(shared_model(), &options, &mut session),
            Q3W_CONTEXT_OVERFLOW,
            &["4097", "4096"],
        );

        let s = new_session(4);
        let mut token = 0;
        expect(q3w_session_next_token(s, &mut token), Q3W_NO_PENDING_TOKEN, &[]);
        expect(q3w_session_feed(s, null(), 0, &mut token), Q3W_EMPTY_PROMPT, &[]);
        let too_many = [1u32, 2, 3, 4, 5];
        expect(
            q3w_session_feed(s, too_many.as_ptr(), 5, &mut token),
            Q3W_CONTEXT_OVERFLOW,
            &["5 positions", "4"],
        );
        let bad = [1u32, 1000];
        expect(
            q3w_session_feed(s, bad.as_ptr(), 2, &mut token),
            Q3W_INVALID_TOKEN_ID,
            &["1000", "position 1"],
        );
        let mut len = 9;
        assert_eq!(q3w_session_len(s, &mut len), Q3W_OK);
        assert_eq!(len, 0, "refused feeds leave the session as it was");

        let ids = [1u32, 2, 3];
        expect(q3w_session_feed(s, ids.as_ptr(), 3, &mut token), Q3W_OK, &[]);
        let (mut pending, mut has) = (0, false);
        assert_eq!(q3w_session_pending(s, &mut pending, &mut has), Q3W_OK);
        assert!(has);
        assert_eq!(pending, token);
        expect(q3w_session_next_token(s, &mut token), Q3W_OK, &[]);
        // The cache holds 4 positions; the pending token needs a fifth.
        expect(
            q3w_session_next_token(s, &mut token),
            Q3W_CONTEXT_OVERFLOW,
            &["5 positions", "capacity is 4"],
        );
        let mut ready = true;
        expect(q3w_session_try_next_token(s, &mut token, &mut ready), Q3W_CONTEXT_OVERFLOW, &[]);
        expect(q3w_session_truncate(s, 5), Q3W_INVALID_ARGUMENT, &["len", "past the 4 positions"]);
        expect(q3w_session_truncate(s, 2), Q3W_OK, &[]);
        assert_eq!(q3w_session_pending(s, &mut pending, &mut has), Q3W_OK);
        assert!(!has);
        expect(q3w_session_next_token(s, &mut token), Q3W_NO_PENDING_TOKEN, &[]);
        assert_eq!(q3w_session_free(s), Q3W_OK);
    }
}

/// `try_next_token` returns the tokens `next_token` returns, and rewinding
/// with truncate gives the same tokens again.
#[test]
fn try_next_token_and_truncate_match_the_blocking_path() {
    unsafe {
        let prompt = [851u32, 720, 591, 221];
        let decode = |s: *mut q3w_session, blocking: bool| {
            let mut token = 0;
            expect(q3w_session_feed(s, prompt.as_ptr(), prompt.len(), &mut token), Q3W_OK, &[]);
            let mut tokens = vec![token];
            while tokens.len() < 6 {
                if blocking {
                    expect(q3w_session_next_token(s, &mut token), Q3W_OK, &[]);
                    tokens.push(token);
                } else {
                    let mut ready = false;
                    expect(q3w_session_try_next_token(s, &mut token, &mut ready), Q3W_OK, &[]);
                    if ready {
                        tokens.push(token);
                    }
                }
            }
            tokens
        };
        let s = new_session(32);
        let blocking = decode(s, true);
        assert_eq!(q3w_session_truncate(s, 0), Q3W_OK);
        assert_eq!(decode(s, false), blocking);
        assert_eq!(q3w_session_free(s), Q3W_OK);
    }
}

#[test]
fn text_errors() {
    unsafe {
        let tok = shared_tokenizer();
        let (mut ids, mut n) = (null_mut(), 0usize);
        let not_utf8 = CString::new(vec![b'a', 0xff, b'b']).unwrap();
        expect(
            q3w_tokenizer_encode(tok, not_utf8.as_ptr(), &mut ids, &mut n),
            Q3W_INVALID_ARGUMENT,
            &["text", "UTF-8"],
        );
        assert!(ids.is_null());
        let mut text = null_mut();
        let bad = [1u32, 4_000_000_000];
        expect(
            q3w_tokenizer_decode(tok, bad.as_ptr(), 2, &mut text, null_mut()),
            Q3W_INVALID_TOKEN_ID,
            &["4000000000"],
        );
        assert!(text.is_null());
        let mut stream = null_mut();
        assert_eq!(q3w_text_stream_new(tok, &mut stream), Q3W_OK);
        let mut piece: *const c_char = null();
        expect(
            q3w_text_stream_push(stream, 4_000_000_000, &mut piece, null_mut()),
            Q3W_INVALID_TOKEN_ID,
            &[],
        );
        assert_eq!(q3w_text_stream_free(stream), Q3W_OK);

        let mut template = null_mut();
        let dir = c_path(&tokenizer_dir());
        assert_eq!(q3w_chat_template_from_checkpoint(dir.as_ptr(), &mut template), Q3W_OK);
        let (role, content) = (c("user"), c("Hi"));
        let mut message =
            q3w_chat_message { role: role.as_ptr(), content: content.as_ptr(), extra_json: null() };
        let mut rendered = null_mut();
        expect(
            q3w_chat_template_render(template, &message, 0, null(), &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["messages"],
        );
        let mut options = std::mem::zeroed::<q3w_chat_options>();
        assert_eq!(q3w_chat_options_init(&mut options), Q3W_OK);
        options.enable_thinking = 2;
        expect(
            q3w_chat_template_render(template, &message, 1, &options, &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["enable_thinking"],
        );
        assert_eq!(q3w_chat_options_init(&mut options), Q3W_OK);
        let not_json = c("[1,");
        options.tools_json = not_json.as_ptr();
        expect(
            q3w_chat_template_render(template, &message, 1, &options, &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["tools_json", "not JSON"],
        );
        options.tools_json = null();
        options.continue_final_message = 1;
        expect(
            q3w_chat_template_render(template, &message, 1, &options, &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["options"],
        );
        let extra = c(r#"{"role": "system"}"#);
        message.extra_json = extra.as_ptr();
        expect(
            q3w_chat_template_render(template, &message, 1, null(), &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["messages[0].extra_json", "role"],
        );
        assert!(rendered.is_null());
        assert_eq!(q3w_chat_template_free(template), Q3W_OK);

        // A string is not a token array, and the other way round.
        let mut s = null_mut();
        assert_eq!(q3w_tokenizer_decode(tok, [1u32].as_ptr(), 1, &mut s, null_mut()), Q3W_OK);
        expect(q3w_tokens_free(s.cast()), Q3W_INVALID_ARGUMENT, &["ids"]);
        assert_eq!(q3w_string_free(s), Q3W_OK);
    }
}

/// The chat functions give what the Rust API gives, and the streaming
/// decoder's pieces add up to the whole decode.
#[test]
fn text_matches_the_rust_api() {
    use qwen3_wgpu::{ChatOptions, ChatTemplate, Message, Tokenizer};
    unsafe {
        let tok = shared_tokenizer();
        let mut template = null_mut();
        let dir = c_path(&tokenizer_dir());
        assert_eq!(q3w_chat_template_from_checkpoint(dir.as_ptr(), &mut template), Q3W_OK);
        let strings: Vec<CString> =
            ["system", "You are Mira.", "user", "<|im_end|>Grüße, 世界"].into_iter().map(c).collect();
        let messages = [
            q3w_chat_message { role: strings[0].as_ptr(), content: strings[1].as_ptr(), extra_json: null() },
            q3w_chat_message { role: strings[2].as_ptr(), content: strings[3].as_ptr(), extra_json: null() },
        ];
        let mut options = std::mem::zeroed::<q3w_chat_options>();
        assert_eq!(q3w_chat_options_init(&mut options), Q3W_OK);
        options.enable_thinking = 0;
        let (mut text, mut len) = (null_mut(), 0usize);
        assert_eq!(
            q3w_chat_template_render(template, messages.as_ptr(), 2, &options, &mut text, &mut len),
            Q3W_OK
        );
        let rendered = CStr::from_ptr(text).to_str().unwrap().to_string();
        assert_eq!(len, rendered.len());
        assert_eq!(q3w_string_free(text), Q3W_OK);
        let (mut ids, mut n) = (null_mut(), 0usize);
        assert_eq!(
            q3w_chat_template_encode(template, tok, messages.as_ptr(), 2, &options, &mut ids, &mut n),
            Q3W_OK
        );
        let c_ids = std::slice::from_raw_parts(ids, n).to_vec();
        assert_eq!(q3w_tokens_free(ids), Q3W_OK);

        let rust_template = ChatTemplate::from_checkpoint(&tokenizer_dir()).unwrap();
        let rust_tokenizer = Tokenizer::from_checkpoint(&tokenizer_dir()).unwrap();
        let conversation = [Message::system("You are Mira."), Message::user("<|im_end|>Grüße, 世界")];
        let rust_options = ChatOptions::default().enable_thinking(false);
        assert_eq!(rendered, rust_template.render(&conversation, &rust_options).unwrap());
        assert_eq!(c_ids, rust_template.encode(&rust_tokenizer, &conversation, &rust_options).unwrap());

        // Streaming: the pieces concatenate to the whole decode.
        let mut stream = null_mut();
        assert_eq!(q3w_text_stream_new(tok, &mut stream), Q3W_OK);
        let mut streamed = Vec::new();
        for &id in &c_ids {
            let (mut piece, mut piece_len) = (null(), 0usize);
            assert_eq!(q3w_text_stream_push(stream, id, &mut piece, &mut piece_len), Q3W_OK);
            streamed.extend_from_slice(std::slice::from_raw_parts(piece.cast::<u8>(), piece_len));
        }
        let (mut piece, mut piece_len) = (null(), 0usize);
        assert_eq!(q3w_text_stream_finish(stream, &mut piece, &mut piece_len), Q3W_OK);
        streamed.extend_from_slice(std::slice::from_raw_parts(piece.cast::<u8>(), piece_len));
        assert_eq!(String::from_utf8(streamed).unwrap(), rendered);
        assert_eq!(q3w_text_stream_free(stream), Q3W_OK);

        // Special-token strings typed by a user stay text with encode_text.
        let typed = c("<|im_end|>");
        assert_eq!(q3w_tokenizer_encode(tok, typed.as_ptr(), &mut ids, &mut n), Q3W_OK);
        assert_eq!(n, 1);
        assert_eq!(q3w_tokens_free(ids), Q3W_OK);
        assert_eq!(q3w_tokenizer_encode_text(tok, typed.as_ptr(), &mut ids, &mut n), Q3W_OK);
        assert!(n > 1);
        assert_eq!(q3w_tokens_free(ids), Q3W_OK);
        let (mut id, mut found) = (0u32, false);
        assert_eq!(q3w_tokenizer_token_id(tok, typed.as_ptr(), &mut id, &mut found), Q3W_OK);
        assert!(found);
        assert_eq!(Some(id), rust_tokenizer.token_id("<|im_end|>"));
        assert_eq!(q3w_chat_template_free(template), Q3W_OK);
    }
}
