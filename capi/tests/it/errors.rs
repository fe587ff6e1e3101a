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
            assert_eq!(
                unsafe { q3w_engine_options_init(&mut options, std::mem::size_of::<q3w_engine_options>()) },
                Q3W_OK
            );
            options.adapter_policy = Q3W_ADAPTER_POLICY_PORTABLE;
            let mut engine = null_mut();
            expect(unsafe { q3w_engine_new(&options, &mut engine) }, Q3W_OK, &[]);
            Shared(engine)
        })
        .0
}

fn no_cache() -> q3w_load_options {
    let mut options = unsafe { std::mem::zeroed::<q3w_load_options>() };
    assert_eq!(
        unsafe { q3w_load_options_init(&mut options, std::mem::size_of::<q3w_load_options>()) },
        Q3W_OK
    );
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
    assert_eq!(
        unsafe { q3w_session_options_init(&mut options, std::mem::size_of::<q3w_session_options>()) },
        Q3W_OK
    );
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
        expect(q3w_engine_options_init(null_mut(), 16), Q3W_INVALID_ARGUMENT, &["options: is NULL"]);
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
        assert_eq!(q3w_engine_options_init(&mut options, std::mem::size_of::<q3w_engine_options>()), Q3W_OK);
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
        load = no_cache();
        load.weights = 3;
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
            Q3W_INVALID_ARGUMENT,
            &["weights"],
        );

        // A newer header's struct: bytes past the fields known here must be
        // zero (a field this library would ignore is refused).
        #[repr(C)]
        struct Newer {
            known: q3w_session_options,
            added: u64,
        }
        let mut newer = Newer { known: std::mem::zeroed(), added: 0 };
        assert_eq!(
            q3w_session_options_init(&mut newer.known, std::mem::size_of::<q3w_session_options>()),
            Q3W_OK
        );
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

/// `kv_cache` picks a session's (and a batch's sessions') KV-cache format,
/// which `q3w_session_kv_cache` reports; a version-1 options struct (which
/// ends before it) gets f16; an unknown value is invalid, naming it.
#[test]
fn the_kv_cache_option_is_honoured_and_checked() {
    unsafe {
        let kv_of = |session: *mut q3w_session| {
            let mut format = 99;
            assert_eq!(q3w_session_kv_cache(session, &mut format), Q3W_OK);
            assert_eq!(q3w_session_free(session), Q3W_OK);
            format
        };
        let mut options = std::mem::zeroed::<q3w_session_options>();
        assert_eq!(
            q3w_session_options_init(&mut options, std::mem::size_of::<q3w_session_options>()),
            Q3W_OK
        );
        assert_eq!(options.kv_cache, Q3W_KV_CACHE_F16);
        options.capacity = 16;
        options.kv_cache = Q3W_KV_CACHE_INT8;
        let mut session = null_mut();
        expect(q3w_session_new(shared_model(), &options, &mut session), Q3W_OK, &[]);
        assert_eq!(kv_of(session), Q3W_KV_CACHE_INT8);
        options.struct_size = std::mem::offset_of!(q3w_session_options, kv_cache);
        expect(q3w_session_new(shared_model(), &options, &mut session), Q3W_OK, &[]);
        assert_eq!(kv_of(session), Q3W_KV_CACHE_F16);
        options.struct_size = std::mem::size_of::<q3w_session_options>();
        options.kv_cache = 7;
        expect(q3w_session_new(shared_model(), &options, &mut session), Q3W_INVALID_ARGUMENT, &["kv_cache"]);
        assert!(session.is_null());

        let mut batch_options = std::mem::zeroed::<q3w_batch_options>();
        assert_eq!(
            q3w_batch_options_init(&mut batch_options, std::mem::size_of::<q3w_batch_options>()),
            Q3W_OK
        );
        batch_options.slots = 1;
        batch_options.capacity_per_slot = 16;
        batch_options.kv_cache = Q3W_KV_CACHE_INT8;
        let mut batch = null_mut();
        expect(q3w_batch_new(shared_model(), &batch_options, &mut batch), Q3W_OK, &[]);
        expect(q3w_batch_session(batch, &mut session), Q3W_OK, &[]);
        assert_eq!(kv_of(session), Q3W_KV_CACHE_INT8);
        assert_eq!(q3w_batch_free(batch), Q3W_OK);
        batch_options.kv_cache = 2;
        let mut batch = null_mut();
        expect(
            q3w_batch_new(shared_model(), &batch_options, &mut batch),
            Q3W_INVALID_ARGUMENT,
            &["kv_cache"],
        );
    }
}

#[cfg(not(target_os = "macos"))]
#[test]
fn metal_only_off_apple_is_non_metal_adapter() {
    unsafe {
        let mut options = std::mem::zeroed::<q3w_engine_options>();
        assert_eq!(q3w_engine_options_init(&mut options, std::mem::size_of::<q3w_engine_options>()), Q3W_OK);
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
        assert_eq!(
            q3w_session_options_init(&mut options, std::mem::size_of::<q3w_session_options>()),
            Q3W_OK
        );
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
        assert_eq!(q3w_chat_options_init(&mut options, std::mem::size_of::<q3w_chat_options>()), Q3W_OK);
        options.enable_thinking = 2;
        expect(
            q3w_chat_template_render(template, &message, 1, &options, &mut rendered, null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["enable_thinking"],
        );
        assert_eq!(q3w_chat_options_init(&mut options, std::mem::size_of::<q3w_chat_options>()), Q3W_OK);
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
        assert_eq!(q3w_chat_options_init(&mut options, std::mem::size_of::<q3w_chat_options>()), Q3W_OK);
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

fn sampling_params() -> q3w_sampling_params {
    let mut params = unsafe { std::mem::zeroed::<q3w_sampling_params>() };
    assert_eq!(
        unsafe { q3w_sampling_params_init(&mut params, std::mem::size_of::<q3w_sampling_params>()) },
        Q3W_OK
    );
    params
}

/// `weights` picks the layers' format, and the model reports the one it
/// holds; the default is int8 (QWEN3_WGPU_WEIGHTS unset in the tests).
#[test]
fn the_weights_option_picks_the_layers_format() {
    unsafe {
        let dir = c_path(&fixture());
        for (asked, held) in [
            (Q3W_WEIGHTS_DEFAULT, Q3W_WEIGHTS_INT8),
            (Q3W_WEIGHTS_INT8, Q3W_WEIGHTS_INT8),
            (Q3W_WEIGHTS_INT4, Q3W_WEIGHTS_INT4),
        ] {
            let mut load = no_cache();
            load.weights = asked;
            let mut model = null_mut();
            expect(q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model), Q3W_OK, &[]);
            let mut weights = 99;
            assert_eq!(q3w_model_weights(model, &mut weights), Q3W_OK);
            assert_eq!(weights, held, "asked for {asked}");
            assert_eq!(q3w_model_free(model), Q3W_OK);
        }
        expect(q3w_model_weights(shared_model(), null_mut()), Q3W_INVALID_ARGUMENT, &["out_weights"]);
    }
}

/// An `_init` function writes only the bytes of the caller's version: a
/// program built with the first header's `q3w_load_options` (which ended
/// at `cache_dir`) keeps the bytes after it, and loads with it.
#[test]
fn init_writes_only_the_callers_version() {
    const V1: usize = std::mem::offset_of!(q3w_load_options, progress);
    unsafe {
        // The first version's struct, followed by bytes the caller owns.
        #[repr(C)]
        struct V1Struct {
            bytes: [usize; V1 / 8],
            after: [u8; 32],
        }
        let mut v1 = V1Struct { bytes: [0; V1 / 8], after: [0xa5; 32] };
        let options = (&mut v1 as *mut V1Struct).cast::<q3w_load_options>();
        assert_eq!(q3w_load_options_init(options, V1), Q3W_OK);
        assert_eq!(v1.after, [0xa5; 32], "init wrote past the caller's struct");
        assert_eq!(v1.bytes[0], V1, "struct_size is the caller's");
        // It reads as the defaults (no progress callback) and loads.
        (*options).cache_policy = Q3W_CACHE_DISABLED;
        let mut model = null_mut();
        let dir = c_path(&fixture());
        expect(q3w_model_load(shared_engine(), dir.as_ptr(), options, &mut model), Q3W_OK, &[]);
        assert_eq!(q3w_model_free(model), Q3W_OK);

        // A size inside a field is no version's size.
        let mut load = no_cache();
        for size in [0, 8, V1 + 4] {
            load.struct_size = size;
            expect(
                q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
                Q3W_INVALID_ARGUMENT,
                &["options", &format!("struct_size is {size}")],
            );
            expect(q3w_load_options_init(&mut load, size), Q3W_INVALID_ARGUMENT, &["struct_size"]);
        }
        // A newer header's struct: its unknown fields are zeroed.
        #[repr(C)]
        struct Newer {
            known: q3w_sampling_params,
            added: u64,
        }
        let mut newer = Newer { known: std::mem::zeroed(), added: u64::MAX };
        assert_eq!(q3w_sampling_params_init(&mut newer.known, std::mem::size_of::<Newer>()), Q3W_OK);
        assert_eq!(newer.added, 0);
        assert_eq!(newer.known.struct_size, std::mem::size_of::<Newer>());
        assert_eq!(newer.known.penalty_window, 64);
    }
}

/// The progress callback sees the phases in order and cancels the load:
/// `Q3W_CANCELLED`, no model, nothing in the cache directory. User data
/// without a callback is refused.
#[test]
fn a_progress_callback_cancels_a_load() {
    struct Seen {
        phases: Vec<u32>,
        cancel_at: u32,
        monotonic: bool,
        last: (u32, u64),
    }
    unsafe extern "C" fn on_progress(
        user_data: *mut std::ffi::c_void,
        phase: u32,
        done: u64,
        total: u64,
    ) -> i32 {
        let seen = unsafe { &mut *user_data.cast::<Seen>() };
        if seen.phases.last() != Some(&phase) {
            seen.phases.push(phase);
            seen.monotonic &= done == 0;
        } else {
            seen.monotonic &= done >= seen.last.1;
        }
        seen.monotonic &= done <= total;
        seen.last = (phase, done);
        if phase == seen.cancel_at {
            Q3W_PROGRESS_CANCEL
        } else {
            Q3W_PROGRESS_CONTINUE
        }
    }
    let scratch = tempfile::tempdir().unwrap();
    let cache = c_path(&scratch.path().join("cache"));
    let dir = c_path(&fixture());
    unsafe {
        let mut seen =
            Seen { phases: vec![], cancel_at: Q3W_LOAD_PHASE_WRITING_CACHE, monotonic: true, last: (0, 0) };
        let mut load = no_cache();
        load.cache_policy = Q3W_CACHE_DIR;
        load.cache_dir = cache.as_ptr();
        load.progress_user_data = (&mut seen as *mut Seen).cast();
        let mut model = std::ptr::dangling_mut::<q3w_model>();
        expect(
            q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model),
            Q3W_INVALID_ARGUMENT,
            &["progress_user_data"],
        );
        load.progress = Some(on_progress);
        expect(q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model), Q3W_CANCELLED, &[]);
        assert!(model.is_null());
        assert_eq!(
            seen.phases,
            [Q3W_LOAD_PHASE_HASHING, Q3W_LOAD_PHASE_CONVERTING, Q3W_LOAD_PHASE_WRITING_CACHE]
        );
        let left: Vec<_> = std::fs::read_dir(scratch.path().join("cache")).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");

        seen = Seen { phases: vec![], cancel_at: 0, monotonic: true, last: (0, 0) };
        load.progress_user_data = (&mut seen as *mut Seen).cast();
        expect(q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model), Q3W_OK, &[]);
        assert_eq!(
            seen.phases,
            [
                Q3W_LOAD_PHASE_HASHING,
                Q3W_LOAD_PHASE_CONVERTING,
                Q3W_LOAD_PHASE_WRITING_CACHE,
                Q3W_LOAD_PHASE_UPLOADING
            ]
        );
        assert!(seen.monotonic);
        assert_eq!(q3w_model_free(model), Q3W_OK);
        // From the cache now.
        seen = Seen { phases: vec![], cancel_at: 0, monotonic: true, last: (0, 0) };
        load.progress_user_data = (&mut seen as *mut Seen).cast();
        expect(q3w_model_load(shared_engine(), dir.as_ptr(), &load, &mut model), Q3W_OK, &[]);
        assert_eq!(
            seen.phases,
            [Q3W_LOAD_PHASE_HASHING, Q3W_LOAD_PHASE_READING_CACHE, Q3W_LOAD_PHASE_UPLOADING]
        );
        assert_eq!(q3w_model_free(model), Q3W_OK);
    }
    let name = |phase| unsafe { CStr::from_ptr(q3w_load_phase_name(phase)) }.to_str().unwrap();
    use qwen3_wgpu::LoadPhase::*;
    for (phase, rust) in [
        (Q3W_LOAD_PHASE_HASHING, Hashing),
        (Q3W_LOAD_PHASE_READING_CACHE, ReadingCache),
        (Q3W_LOAD_PHASE_CONVERTING, Converting),
        (Q3W_LOAD_PHASE_WRITING_CACHE, WritingCache),
        (Q3W_LOAD_PHASE_UPLOADING, Uploading),
    ] {
        assert_eq!(name(phase), rust.as_str());
    }
    assert_eq!(name(0), "unknown");
    assert_eq!(name(6), "unknown");
}

/// Sampling parameters: each bad value is refused naming its field (the
/// session left as it was), the session reports what it samples with, the
/// same seed gives the same tokens, and generation_config.json is read as
/// the Rust API reads it.
#[test]
fn sampling_parameters() {
    let prompt = [851u32, 720, 591, 221];
    unsafe {
        let s = new_session(32);
        let mut params = sampling_params();
        assert_eq!(params.temperature, 0.0);
        assert_eq!(params.top_p, 1.0);
        assert_eq!(params.repetition_penalty, 1.0);
        for (field, set) in [
            (
                "temperature",
                (|p: &mut q3w_sampling_params| p.temperature = -1.0) as fn(&mut q3w_sampling_params),
            ),
            ("temperature", |p| p.temperature = f32::NAN),
            ("top_p", |p| p.top_p = 0.0),
            ("min_p", |p| p.min_p = 1.5),
            ("repetition_penalty", |p| p.repetition_penalty = 0.0),
            ("presence_penalty", |p| p.presence_penalty = f32::INFINITY),
            ("penalty_window", |p| p.penalty_window = 1025),
        ] {
            let mut bad = sampling_params();
            set(&mut bad);
            expect(q3w_session_set_sampling(s, &bad), Q3W_INVALID_ARGUMENT, &[field]);
        }
        expect(q3w_session_set_sampling(null_mut(), &params), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        let mut current = sampling_params();
        current.seed = 99;
        assert_eq!(q3w_session_sampling(s, &mut current), Q3W_OK);
        assert_eq!((current.temperature, current.seed), (0.0, 0), "still greedy");

        params.temperature = 1.0;
        params.top_k = 50;
        params.seed = 3;
        assert_eq!(q3w_session_set_sampling(s, &params), Q3W_OK);
        assert_eq!(q3w_session_sampling(s, &mut current), Q3W_OK);
        assert_eq!((current.temperature, current.top_k, current.seed), (1.0, 50, 3));
        let decode = |s: *mut q3w_session| {
            let mut token = 0;
            expect(q3w_session_feed(s, prompt.as_ptr(), prompt.len(), &mut token), Q3W_OK, &[]);
            let mut tokens = vec![token];
            while tokens.len() < 8 {
                expect(q3w_session_next_token(s, &mut token), Q3W_OK, &[]);
                tokens.push(token);
            }
            tokens
        };
        let first = decode(s);
        assert_eq!(q3w_session_truncate(s, 0), Q3W_OK);
        assert_eq!(decode(s), first, "the same seed, the same tokens");
        // A fork samples as its original does.
        assert_eq!(q3w_session_truncate(s, 0), Q3W_OK);
        let mut fork = null_mut();
        assert_eq!(q3w_session_fork(s, 0, &mut fork), Q3W_OK);
        assert_eq!(q3w_session_sampling(fork, &mut current), Q3W_OK);
        assert_eq!((current.temperature, current.top_k, current.seed), (1.0, 50, 3));
        assert_eq!(decode(fork), first);
        assert_eq!(q3w_session_free(fork), Q3W_OK);
        // The Rust API's tokens.
        let engine =
            qwen3_wgpu::Engine::builder().policy(qwen3_wgpu::AdapterPolicy::Portable).build().unwrap();
        let model = engine
            .load(
                fixture(),
                &qwen3_wgpu::LoadOptions { cache: qwen3_wgpu::CachePolicy::Disabled, ..Default::default() },
            )
            .unwrap();
        let mut rust = model.session_with_capacity(32).unwrap();
        rust.set_sampling(&qwen3_wgpu::SamplingParams::default().temperature(1.0).top_k(50).seed(3)).unwrap();
        let mut expected = vec![rust.feed(&prompt).unwrap()];
        while expected.len() < 8 {
            expected.push(rust.next_token().unwrap());
        }
        assert_eq!(first, expected);
        // NULL: greedy again.
        assert_eq!(q3w_session_set_sampling(s, null()), Q3W_OK);
        assert_eq!(q3w_session_sampling(s, &mut current), Q3W_OK);
        assert_eq!(current.temperature, 0.0);
        assert_eq!(q3w_session_free(s), Q3W_OK);

        // generation_config.json: none (greedy), sampling, malformed.
        let scratch = tempfile::tempdir().unwrap();
        let dir = c_path(scratch.path());
        let mut read = sampling_params();
        read.temperature = 5.0;
        assert_eq!(q3w_sampling_params_from_generation_config(dir.as_ptr(), &mut read), Q3W_OK);
        assert_eq!(read.temperature, 0.0);
        std::fs::write(
            scratch.path().join("generation_config.json"),
            r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}"#,
        )
        .unwrap();
        assert_eq!(q3w_sampling_params_from_generation_config(dir.as_ptr(), &mut read), Q3W_OK);
        assert_eq!((read.temperature, read.top_k, read.top_p, read.repetition_penalty), (0.6, 20, 0.95, 1.1));
        assert_eq!(read.struct_size, std::mem::size_of::<q3w_sampling_params>());
        std::fs::write(scratch.path().join("generation_config.json"), "{ not json").unwrap();
        expect(
            q3w_sampling_params_from_generation_config(dir.as_ptr(), &mut read),
            Q3W_CHECKPOINT_INVALID,
            &["generation_config.json"],
        );
        assert_eq!(read.temperature, 0.6, "left as it was");
        expect(
            q3w_sampling_params_from_generation_config(dir.as_ptr(), null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["params: is NULL"],
        );
    }
}

/// The non-blocking feed gives the blocking feed's token and progress;
/// while it runs, every call that runs the model or touches the context is
/// refused naming `session`, and polling without a feed is refused too.
#[test]
fn the_non_blocking_feed() {
    let prompt = [851u32, 720, 591, 221, 110];
    unsafe {
        let blocking = new_session(16);
        let mut expected = 0;
        assert_eq!(q3w_session_feed(blocking, prompt.as_ptr(), prompt.len(), &mut expected), Q3W_OK);

        let s = new_session(16);
        let (mut token, mut ready, mut fed, mut total) = (0u32, true, 9usize, 0usize);
        expect(
            q3w_session_poll_feed(s, &mut token, &mut ready, null_mut(), null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["session", "begin_feed"],
        );
        expect(q3w_session_begin_feed(s, null(), 0), Q3W_EMPTY_PROMPT, &[]);
        let bad = [1u32, 1000];
        expect(q3w_session_begin_feed(s, bad.as_ptr(), 2), Q3W_INVALID_TOKEN_ID, &["1000"]);
        let long = [1u32; 17];
        expect(q3w_session_begin_feed(s, long.as_ptr(), 17), Q3W_CONTEXT_OVERFLOW, &[]);

        assert_eq!(q3w_session_begin_feed(s, prompt.as_ptr(), prompt.len()), Q3W_OK);
        let mut feeding = false;
        assert_eq!(q3w_session_is_feeding(s, &mut feeding), Q3W_OK);
        assert!(feeding);
        let mut other = 0u32;
        let mut n = 0usize;
        let mut ids = null_mut();
        let mut fork = null_mut();
        let path = c_path(&tempfile::tempdir().unwrap().path().join("s.q3s"));
        let greedy = sampling_params();
        for status in [
            q3w_session_feed(s, prompt.as_ptr(), 1, &mut other),
            q3w_session_begin_feed(s, prompt.as_ptr(), 1),
            q3w_session_next_token(s, &mut other),
            q3w_session_try_next_token(s, &mut other, &mut ready),
            q3w_session_truncate(s, 0),
            q3w_session_fork(s, 0, &mut fork),
            q3w_session_save(s, path.as_ptr()),
            q3w_session_tokens(s, &mut ids, &mut n),
            q3w_session_set_sampling(s, &greedy),
        ] {
            expect(status, Q3W_INVALID_ARGUMENT, &["session", "poll_feed"]);
        }
        assert!(fork.is_null() && ids.is_null());
        let mut polls = 0;
        loop {
            assert_eq!(q3w_session_poll_feed(s, &mut token, &mut ready, &mut fed, &mut total), Q3W_OK);
            polls += 1;
            assert_eq!(total, prompt.len());
            assert!(fed <= total);
            if ready {
                break;
            }
        }
        assert!(polls >= 1);
        assert_eq!((token, fed), (expected, prompt.len()));
        assert_eq!(q3w_session_is_feeding(s, &mut feeding), Q3W_OK);
        assert!(!feeding);
        // The session is as after the blocking feed: the next tokens agree,
        // and a second non-blocking feed commits the pending token first.
        let (mut a, mut b) = (0, 0);
        assert_eq!(q3w_session_next_token(s, &mut a), Q3W_OK);
        assert_eq!(q3w_session_next_token(blocking, &mut b), Q3W_OK);
        assert_eq!(a, b);
        assert_eq!(q3w_session_begin_feed(s, prompt.as_ptr(), 2), Q3W_OK);
        assert_eq!(q3w_session_feed(blocking, prompt.as_ptr(), 2, &mut b), Q3W_OK);
        loop {
            assert_eq!(q3w_session_poll_feed(s, &mut a, &mut ready, &mut fed, &mut total), Q3W_OK);
            assert_eq!(total, 3, "the pending token and two ids");
            if ready {
                break;
            }
        }
        assert_eq!(a, b);
        assert_eq!(q3w_session_free(s), Q3W_OK);
        assert_eq!(q3w_session_free(blocking), Q3W_OK);
    }
}

/// Fork, save and restore: capacities, the file errors, and the restored
/// context.
#[test]
fn fork_save_and_restore() {
    let prompt = [851u32, 720, 591, 221, 110];
    let scratch = tempfile::tempdir().unwrap();
    unsafe {
        let s = new_session(16);
        let mut token = 0;
        assert_eq!(q3w_session_feed(s, prompt.as_ptr(), prompt.len(), &mut token), Q3W_OK);
        let mut fork = std::ptr::dangling_mut::<q3w_session>();
        expect(q3w_session_fork(s, 3, &mut fork), Q3W_CONTEXT_OVERFLOW, &[]);
        assert!(fork.is_null());
        expect(q3w_session_fork(s, 5000, &mut fork), Q3W_CONTEXT_OVERFLOW, &[]);
        expect(q3w_session_fork(null_mut(), 0, &mut fork), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        expect(q3w_session_fork(s, 0, null_mut()), Q3W_INVALID_ARGUMENT, &["out_fork: is NULL"]);
        assert_eq!(q3w_session_fork(s, 64, &mut fork), Q3W_OK);
        let mut capacity = 0;
        assert_eq!(q3w_session_capacity(fork, &mut capacity), Q3W_OK);
        assert_eq!(capacity, 64);

        // The context's tokens: the prompt (the pending token is not among
        // them).
        let (mut ids, mut n) = (null_mut(), 0usize);
        assert_eq!(q3w_session_tokens(fork, &mut ids, &mut n), Q3W_OK);
        assert_eq!(std::slice::from_raw_parts(ids, n), &prompt);
        assert_eq!(q3w_tokens_free(ids), Q3W_OK);

        let missing_dir = c_path(&scratch.path().join("no-such-dir/s.q3s"));
        expect(q3w_session_save(s, missing_dir.as_ptr()), Q3W_SESSION_IO, &["no-such-dir"]);
        assert!(!scratch.path().join("no-such-dir").exists());
        let path = scratch.path().join("s.q3s");
        let c_file = c_path(&path);
        assert_eq!(q3w_session_save(s, c_file.as_ptr()), Q3W_OK);

        let mut restored = std::ptr::dangling_mut::<q3w_session>();
        let missing = c_path(&scratch.path().join("missing.q3s"));
        expect(
            q3w_model_restore_session(shared_model(), missing.as_ptr(), 0, &mut restored),
            Q3W_SESSION_IO,
            &["missing.q3s"],
        );
        assert!(restored.is_null());
        expect(
            q3w_model_restore_session(shared_model(), c_file.as_ptr(), 2, &mut restored),
            Q3W_CONTEXT_OVERFLOW,
            &[],
        );
        let damaged = scratch.path().join("damaged.q3s");
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&damaged, bytes).unwrap();
        let c_damaged = c_path(&damaged);
        expect(
            q3w_model_restore_session(shared_model(), c_damaged.as_ptr(), 0, &mut restored),
            Q3W_SESSION_FILE_INVALID,
            &["damaged.q3s"],
        );
        assert_eq!(q3w_model_restore_session(shared_model(), c_file.as_ptr(), 0, &mut restored), Q3W_OK);
        assert_eq!(q3w_session_capacity(restored, &mut capacity), Q3W_OK);
        assert_eq!(capacity, 16);

        // Original, fork and restored copy continue alike.
        let (mut pending, mut has) = (0, false);
        assert_eq!(q3w_session_pending(restored, &mut pending, &mut has), Q3W_OK);
        assert!(has);
        assert_eq!(pending, token);
        let next = |s: *mut q3w_session| {
            let mut t = 0;
            assert_eq!(q3w_session_next_token(s, &mut t), Q3W_OK);
            t
        };
        let expected: Vec<u32> = (0..4).map(|_| next(s)).collect();
        assert_eq!((0..4).map(|_| next(fork)).collect::<Vec<_>>(), expected);
        assert_eq!((0..4).map(|_| next(restored)).collect::<Vec<_>>(), expected);

        let (mut text, mut len) = (null_mut(), 0usize);
        assert_eq!(q3w_model_fingerprint(shared_model(), &mut text, &mut len), Q3W_OK);
        let fingerprint = CStr::from_ptr(text).to_str().unwrap().to_string();
        assert_eq!(len, fingerprint.len());
        assert!(!fingerprint.is_empty());
        assert_eq!(q3w_string_free(text), Q3W_OK);
        for h in [s, fork, restored] {
            assert_eq!(q3w_session_free(h), Q3W_OK);
        }
    }
}

fn batch_options(slots: usize, capacity: usize) -> q3w_batch_options {
    let mut options = unsafe { std::mem::zeroed::<q3w_batch_options>() };
    assert_eq!(
        unsafe { q3w_batch_options_init(&mut options, std::mem::size_of::<q3w_batch_options>()) },
        Q3W_OK
    );
    assert_eq!((options.slots, options.capacity_per_slot), (8, 1024), "the defaults");
    options.slots = slots;
    options.capacity_per_slot = capacity;
    options
}

/// Batches: bad options, a full batch, and every bad step list are named
/// errors that leave the sessions and the caller's token array as they
/// were; a step after them decodes as usual; `try_step` writes nothing
/// until ready; a freed batch's sessions decode on alone.
#[test]
fn batch_errors() {
    unsafe {
        let model = shared_model();
        let mut batch = null_mut();
        expect(q3w_batch_new(null(), null(), &mut batch), Q3W_INVALID_ARGUMENT, &["model: is NULL"]);
        expect(q3w_batch_new(model, null(), null_mut()), Q3W_INVALID_ARGUMENT, &["out_batch: is NULL"]);
        expect(q3w_batch_new(model, &batch_options(0, 8), &mut batch), Q3W_INVALID_ARGUMENT, &["slots"]);
        expect(q3w_batch_new(model, &batch_options(1, 0), &mut batch), Q3W_CONTEXT_OVERFLOW, &[]);
        expect(q3w_batch_new(model, &batch_options(1, 4097), &mut batch), Q3W_CONTEXT_OVERFLOW, &["4096"]);
        assert!(batch.is_null());
        expect(q3w_batch_new(model, &batch_options(2, 8), &mut batch), Q3W_OK, &[]);
        let (mut a, mut b, mut c) = (null_mut(), null_mut(), null_mut());
        expect(q3w_batch_session(batch, &mut a), Q3W_OK, &[]);
        expect(q3w_batch_session(batch, &mut b), Q3W_OK, &[]);
        expect(q3w_batch_session(batch, &mut c), Q3W_INVALID_ARGUMENT, &["batch", "all 2 slots"]);
        assert!(c.is_null());
        let (mut slots, mut free) = (0, 9);
        assert_eq!(q3w_batch_slots(batch, &mut slots), Q3W_OK);
        assert_eq!(q3w_batch_free_slots(batch, &mut free), Q3W_OK);
        assert_eq!((slots, free), (2, 0));
        let mut ready = false;
        for _ in 0..60_000 {
            assert_eq!(q3w_batch_pipelines_ready(batch, &mut ready), Q3W_OK);
            if ready {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(ready, "the batch's pipelines were not built within a minute");
        expect(q3w_batch_pipelines_ready(batch, null_mut()), Q3W_INVALID_ARGUMENT, &["out_ready"]);
        expect(q3w_batch_pipelines_ready(null_mut(), &mut ready), Q3W_INVALID_ARGUMENT, &["batch"]);

        let mut tokens = [u32::MAX; 2];
        let mut ready = true;
        expect(q3w_batch_step(batch, [a].as_ptr(), 1, tokens.as_mut_ptr()), Q3W_NO_PENDING_TOKEN, &[]);
        let mut token = 0;
        expect(q3w_session_feed(a, [1u32, 2, 3].as_ptr(), 3, &mut token), Q3W_OK, &[]);
        expect(q3w_session_feed(b, [4u32].as_ptr(), 1, &mut token), Q3W_OK, &[]);
        let plain = new_session(8);
        expect(q3w_session_feed(plain, [4u32].as_ptr(), 1, &mut token), Q3W_OK, &[]);
        let lists: [(&[*mut q3w_session], &[&str]); 4] = [
            (&[], &["sessions", "empty"]),
            (&[a, null_mut()], &["sessions", "entry 1 is NULL"]),
            (&[a, b, a], &["sessions", "entries 0 and 2 are the same session"]),
            (&[plain, a], &["sessions", "no slot of this batch"]),
        ];
        for (list, words) in lists {
            let out = tokens.as_mut_ptr();
            expect(q3w_batch_step(batch, list.as_ptr(), list.len(), out), Q3W_INVALID_ARGUMENT, words);
            let status = q3w_batch_try_step(batch, list.as_ptr(), list.len(), out, &mut ready);
            expect(status, Q3W_INVALID_ARGUMENT, words);
        }
        expect(q3w_batch_step(batch, null(), 2, tokens.as_mut_ptr()), Q3W_INVALID_ARGUMENT, &["sessions"]);
        let both = [a, b];
        expect(
            q3w_batch_step(null_mut(), both.as_ptr(), 2, tokens.as_mut_ptr()),
            Q3W_INVALID_ARGUMENT,
            &["batch"],
        );
        expect(q3w_batch_step(batch, both.as_ptr(), 2, null_mut()), Q3W_INVALID_ARGUMENT, &["out_tokens"]);
        expect(
            q3w_batch_try_step(batch, both.as_ptr(), 2, tokens.as_mut_ptr(), null_mut()),
            Q3W_INVALID_ARGUMENT,
            &["out_ready"],
        );
        expect(q3w_session_set_logprobs(b, 2), Q3W_OK, &[]);
        expect(
            q3w_batch_step(batch, both.as_ptr(), 2, tokens.as_mut_ptr()),
            Q3W_INVALID_ARGUMENT,
            &["logprobs"],
        );
        expect(q3w_session_set_logprobs(b, 0), Q3W_OK, &[]);
        assert!(ready, "refused calls leave out_ready as it was");
        assert_eq!(tokens, [u32::MAX; 2], "refused steps write no token");
        let mut len = 0;
        assert_eq!(q3w_session_len(a, &mut len), Q3W_OK);
        assert_eq!(len, 3, "refused steps leave the sessions as they were");

        // What each session gives alone, then the batch's tokens.
        let want: Vec<Vec<u32>> = [&[1u32, 2, 3][..], &[4u32]]
            .iter()
            .map(|prompt| {
                let s = new_session(8);
                let mut t = 0;
                expect(q3w_session_feed(s, prompt.as_ptr(), prompt.len(), &mut t), Q3W_OK, &[]);
                let mut out = vec![];
                for _ in 0..3 {
                    expect(q3w_session_next_token(s, &mut t), Q3W_OK, &[]);
                    out.push(t);
                }
                assert_eq!(q3w_session_free(s), Q3W_OK);
                out
            })
            .collect();
        let mut got = vec![vec![], vec![]];
        expect(q3w_batch_step(batch, both.as_ptr(), 2, tokens.as_mut_ptr()), Q3W_OK, &[]);
        got[0].push(tokens[0]);
        got[1].push(tokens[1]);
        while got[0].len() < 3 {
            tokens = [u32::MAX; 2];
            expect(q3w_batch_try_step(batch, both.as_ptr(), 2, tokens.as_mut_ptr(), &mut ready), Q3W_OK, &[]);
            if ready {
                got[0].push(tokens[0]);
                got[1].push(tokens[1]);
            } else {
                assert_eq!(tokens, [u32::MAX; 2], "not ready: no token written");
            }
        }
        assert_eq!(got, want);

        // A freed session gives its slot back; a freed batch's sessions
        // decode on alone.
        assert_eq!(q3w_session_free(b), Q3W_OK);
        assert_eq!(q3w_batch_free_slots(batch, &mut free), Q3W_OK);
        assert_eq!(free, 1);
        assert_eq!(q3w_batch_free(batch), Q3W_OK);
        expect(q3w_session_next_token(a, &mut token), Q3W_OK, &[]);
        assert_eq!(q3w_session_free(a), Q3W_OK);
        assert_eq!(q3w_session_free(plain), Q3W_OK);
        assert_eq!(q3w_batch_free(null_mut()), Q3W_OK);
    }
}

/// The prompt batch size: NULL, 0 and more than the session's batches
/// hold are named errors that leave the setting; a smaller one feeds the
/// token the default batches give.
#[test]
fn prompt_batch_errors() {
    unsafe {
        let prompt: Vec<u32> = (0..200u32).map(|i| (i * 37 + 11) % 1000).collect();
        let first = |s: *mut q3w_session| {
            let mut token = u32::MAX;
            expect(q3w_session_feed(s, prompt.as_ptr(), prompt.len(), &mut token), Q3W_OK, &[]);
            token
        };
        let want = first(new_session(300));
        let s = new_session(300);
        expect(q3w_session_set_prompt_batch(null_mut(), 64), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        expect(q3w_session_set_prompt_batch(s, 0), Q3W_INVALID_ARGUMENT, &["prompt_batch"]);
        let past = Q3W_PREFILL_BATCH as usize + 1;
        expect(q3w_session_set_prompt_batch(s, past), Q3W_INVALID_ARGUMENT, &["prompt_batch", "257"]);
        expect(q3w_session_set_prompt_batch(s, 48), Q3W_OK, &[]);
        assert_eq!(first(s), want);
    }
}

/// Log-probabilities: the bound on N, a feed in progress, the out-pointers;
/// nothing to report before a token, after turning them off and after a
/// truncate; and a read never writes past the caller's capacity.
#[test]
fn logprob_errors() {
    unsafe {
        let s = new_session(16);
        expect(q3w_session_set_logprobs(null_mut(), 3), Q3W_INVALID_ARGUMENT, &["session: is NULL"]);
        expect(q3w_session_set_logprobs(s, Q3W_MAX_LOGPROBS + 1), Q3W_INVALID_ARGUMENT, &["logprobs", "21"]);
        expect(q3w_session_set_logprobs(s, Q3W_MAX_LOGPROBS), Q3W_OK, &[]);
        let untouched = q3w_logprob { token: 7, logprob: 1.0 };
        let mut chosen = untouched;
        let mut top = [untouched; 4];
        let (mut n, mut available) = (9, true);
        let read =
            |chosen: &mut q3w_logprob, top: &mut [q3w_logprob], n: &mut usize, available: &mut bool| {
                q3w_session_last_logprobs(s, chosen, top.as_mut_ptr(), top.len(), n, available)
            };
        expect(read(&mut chosen, &mut top, &mut n, &mut available), Q3W_OK, &[]);
        assert_eq!((n, available), (0, false), "no token yet");
        assert_eq!((chosen.token, top[0].token), (7, 7));
        let mut token = 0;
        expect(q3w_session_begin_feed(s, [5u32, 6].as_ptr(), 2), Q3W_OK, &[]);
        expect(q3w_session_set_logprobs(s, 2), Q3W_INVALID_ARGUMENT, &["session"]);
        let mut ready = false;
        while !ready {
            expect(q3w_session_poll_feed(s, &mut token, &mut ready, null_mut(), null_mut()), Q3W_OK, &[]);
        }
        expect(read(&mut chosen, &mut top, &mut n, &mut available), Q3W_OK, &[]);
        assert!(available);
        assert_eq!((n, chosen.token, top[0].token), (20, token, token));
        assert!(top.iter().all(|e| e.token != 7 && e.logprob <= 0.0));
        // Only the capacity is written; NULL with a capacity of 0 is fine.
        let mut two = [untouched; 3];
        let status = q3w_session_last_logprobs(s, &mut chosen, two.as_mut_ptr(), 2, &mut n, &mut available);
        expect(status, Q3W_OK, &[]);
        assert_eq!((two[0].token, two[1].token, two[2].token, n), (top[0].token, top[1].token, 7, 20));
        let status = q3w_session_last_logprobs(s, &mut chosen, null_mut(), 0, &mut n, &mut available);
        expect(status, Q3W_OK, &[]);
        let status = q3w_session_last_logprobs(s, &mut chosen, null_mut(), 2, &mut n, &mut available);
        expect(status, Q3W_INVALID_ARGUMENT, &["top", "NULL"]);
        let status = q3w_session_last_logprobs(s, null_mut(), null_mut(), 0, &mut n, &mut available);
        expect(status, Q3W_INVALID_ARGUMENT, &["out_chosen"]);
        let status = q3w_session_last_logprobs(s, &mut chosen, null_mut(), 0, null_mut(), &mut available);
        expect(status, Q3W_INVALID_ARGUMENT, &["out_n_top"]);
        let status = q3w_session_last_logprobs(s, &mut chosen, null_mut(), 0, &mut n, null_mut());
        expect(status, Q3W_INVALID_ARGUMENT, &["out_available"]);
        // A truncate drops them; so does turning them off.
        expect(q3w_session_truncate(s, 1), Q3W_OK, &[]);
        expect(read(&mut chosen, &mut top, &mut n, &mut available), Q3W_OK, &[]);
        assert_eq!((n, available), (0, false));
        expect(q3w_session_feed(s, [8u32].as_ptr(), 1, &mut token), Q3W_OK, &[]);
        expect(q3w_session_set_logprobs(s, 0), Q3W_OK, &[]);
        expect(q3w_session_next_token(s, &mut token), Q3W_OK, &[]);
        expect(read(&mut chosen, &mut top, &mut n, &mut available), Q3W_OK, &[]);
        assert_eq!((n, available), (0, false));
        assert_eq!(q3w_session_free(s), Q3W_OK);
    }
}
