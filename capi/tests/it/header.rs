//! The checked-in header is what cbindgen generates from the sources now,
//! its status values are the crate's stable error codes in order, and every
//! entry point catches panics.
//!
//! After changing the API: `QWEN3_WGPU_UPDATE_HEADER=1 cargo test
//! --workspace --test it header::` rewrites `include/qwen3_wgpu.h` (a `-p`
//! build resolves the workspace's features differently and rebuilds every
//! dependency).

use std::path::Path;

use qwen3wgpu::{q3w_status, status_of, ERROR_STATUSES};

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn generated_header() -> String {
    let config = cbindgen::Config::from_file(manifest_dir().join("cbindgen.toml")).unwrap();
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(manifest_dir().join("src/lib.rs"))
        .generate()
        .expect("cbindgen");
    let mut bytes = Vec::new();
    bindings.write(&mut bytes);
    String::from_utf8(bytes).unwrap()
}

fn checked_in_header() -> String {
    std::fs::read_to_string(manifest_dir().join("include/qwen3_wgpu.h")).unwrap_or_default()
}

#[test]
fn the_checked_in_header_is_fresh() {
    let generated = generated_header();
    let path = manifest_dir().join("include/qwen3_wgpu.h");
    if std::env::var_os("QWEN3_WGPU_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    assert!(
        checked_in_header() == generated,
        "{} is stale: run QWEN3_WGPU_UPDATE_HEADER=1 cargo test --workspace --test it header::",
        path.display()
    );
}

/// One status per stable code, numbered from 1 in `Error::ALL_CODES`'
/// order, each spelled `Q3W_<CODE>` in the header; and every error maps to
/// the status of its code.
#[test]
fn statuses_are_the_stable_codes_in_order() {
    assert_eq!(ERROR_STATUSES.len(), qwen3_wgpu::Error::ALL_CODES.len());
    let header = checked_in_header();
    assert!(header.contains("Q3W_OK = 0,"));
    for (i, ((status, code), all)) in ERROR_STATUSES.iter().zip(qwen3_wgpu::Error::ALL_CODES).enumerate() {
        assert_eq!(*code, all);
        assert_eq!(*status as usize, i + 1, "{code}");
        let line = format!("Q3W_{} = {},", code.to_uppercase(), i + 1);
        assert!(header.contains(&line), "the header lacks {line}");
    }
    // The statuses past the last code: none.
    assert!(!header.contains(&format!("= {},", ERROR_STATUSES.len() + 1)));
    for e in one_error_of_each_code() {
        let status = status_of(&e);
        assert_ne!(status, q3w_status::Q3W_OK);
        assert_eq!(ERROR_STATUSES[status as usize - 1].1, e.code());
    }
}

fn one_error_of_each_code() -> Vec<qwen3_wgpu::Error> {
    use qwen3_wgpu::Error::*;
    let s = String::new;
    let p = std::path::PathBuf::new;
    let errors = vec![
        CheckpointNotFound { path: p(), reason: s() },
        CheckpointInvalid { path: p(), reason: s() },
        UnsupportedArchitecture { profile: s(), mismatches: vec![] },
        UnsupportedDtype { tensor: s(), dtype: s() },
        NonMetalAdapter { backend: s(), adapter: s() },
        NoGpuAdapter { reason: s() },
        GpuDeviceFailed { reason: s() },
        ShaderCompileFailed { kernel: s(), reason: s() },
        InvalidTokenId { id: 0, position: 0, vocab_size: 0 },
        EmptyPrompt,
        NoPendingToken,
        ContextOverflow { needed: 0, capacity: 0 },
        CacheIo { path: p(), reason: s() },
        InvalidArgument { name: s(), reason: s() },
        Internal { reason: s() },
        OutOfMemory { what: s(), needed: 0, available: 0 },
        SessionIo { path: p(), reason: s() },
        SessionFileInvalid { path: p(), reason: s() },
        SessionModelMismatch { path: p(), expected: s(), found: s() },
        Cancelled,
    ];
    let mut codes: Vec<_> = errors.iter().map(|e| e.code()).collect();
    codes.sort();
    let mut all = qwen3_wgpu::Error::ALL_CODES.to_vec();
    all.sort();
    assert_eq!(codes, all, "one error of each code");
    errors
}

/// Every exported function catches panics: its body runs through
/// `run("<its name>", ...)` (or `catch_unwind` for the two that return
/// strings), and each is declared in the header.
#[test]
fn every_entry_point_catches_panics() {
    let header = checked_in_header();
    let mut count = 0;
    for file in ["lib.rs", "owned.rs", "engine.rs", "session.rs", "batch.rs", "text.rs"] {
        let source = std::fs::read_to_string(manifest_dir().join("src").join(file)).unwrap();
        for (i, _) in source.match_indices("#[no_mangle]") {
            let rest = &source[i..];
            let name_start = rest.find("extern \"C\" fn ").unwrap() + "extern \"C\" fn ".len();
            let name: String =
                rest[name_start..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            // The body: up to the next item.
            let body_end =
                rest[1..].find("\n#[").or_else(|| rest[1..].find("\n/// ")).unwrap_or(rest.len() - 1);
            let body = &rest[..body_end + 1];
            assert!(
                body.contains(&format!("run(\"{name}\"")) || body.contains("catch_unwind("),
                "{file}: {name} does not catch panics"
            );
            assert!(header.contains(&format!("{name}(")), "the header lacks {name}");
            count += 1;
        }
    }
    assert!(count > 40, "{count} entry points found");
}

/// Each handle type has exactly one free function, and each thing the
/// caller frees (handles, strings, token arrays) has one.
#[test]
fn one_free_function_per_owned_thing() {
    let header = checked_in_header();
    let opaque: Vec<&str> = header
        .lines()
        .filter_map(|l| l.strip_prefix("typedef struct "))
        .filter_map(|l| l.split_once(' ').filter(|(_, rest)| rest.ends_with(';')).map(|(name, _)| name))
        .collect();
    assert_eq!(
        opaque,
        [
            "q3w_batch",
            "q3w_chat_template",
            "q3w_engine",
            "q3w_model",
            "q3w_session",
            "q3w_text_stream",
            "q3w_tokenizer"
        ]
    );
    // Declarations: `enum q3w_status q3w_engine_free(struct q3w_engine *engine);`.
    let frees: Vec<&str> = header
        .lines()
        .filter(|l| !l.starts_with("//"))
        .filter_map(|l| l.split_once('(').map(|(before, _)| before))
        .filter_map(|before| before.rsplit([' ', '*']).next())
        .filter(|name| name.ends_with("_free"))
        .collect();
    let mut expected: Vec<String> = opaque.iter().map(|t| format!("{t}_free")).collect();
    expected.extend(["q3w_string_free".to_string(), "q3w_tokens_free".to_string()]);
    expected.sort();
    let mut frees: Vec<String> = frees.iter().map(|s| s.to_string()).collect();
    frees.sort();
    assert_eq!(frees, expected);
}
