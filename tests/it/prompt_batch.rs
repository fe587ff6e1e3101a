//! `Session::set_prompt_batch` bounds the positions one prompt batch runs
//! (the GPU work a polled feed puts ahead of a renderer): a 300-position
//! prompt in batches of at most 64 runs in five submits instead of two,
//! blocking or polled, and decodes the tokens of the default batches; a
//! size of 0 or past the session's batch buffers is a named error that
//! changes nothing, and a fork keeps the setting.

use std::path::Path;

use qwen3_wgpu::{CachePolicy, FeedStatus, LoadOptions, Model};

fn model() -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    crate::support::engine()
        .load(dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() })
        .unwrap()
}

fn prompt() -> Vec<u32> {
    (0..300u32).map(|i| (i * 37 + 11) % 1000).collect()
}

/// The first token after the prompt and 8 more, and the prompt's submits.
fn decode(model: &Model, prompt_batch: Option<usize>, polled: bool) -> (Vec<u32>, u64) {
    let mut s = model.session_with_capacity(320).unwrap();
    if let Some(n) = prompt_batch {
        s.set_prompt_batch(n).unwrap();
    }
    let first = if polled {
        s.begin_feed(&prompt()).unwrap();
        loop {
            if let FeedStatus::Ready(token) = s.poll_feed().unwrap() {
                break token;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    } else {
        let before = s.debug_inline_feed_submits();
        let t = s.feed(&prompt()).unwrap();
        assert!(s.debug_inline_feed_submits() > before);
        t
    };
    let submits = if polled { 0 } else { s.debug_inline_feed_submits() };
    let tokens = std::iter::once(first).chain((0..8).map(|_| s.next_token().unwrap())).collect();
    (tokens, submits)
}

#[test]
fn smaller_prompt_batches_feed_the_same_tokens_in_more_submits() {
    let model = model();
    let (want, default_submits) = decode(&model, None, false);
    assert_eq!(default_submits, 2, "300 positions in batches of 256: two submits");
    let (got, submits) = decode(&model, Some(64), false);
    assert_eq!(submits, 5, "300 positions in batches of at most 64: five submits");
    assert_eq!(got, want);
    let (polled, _) = decode(&model, Some(64), true);
    assert_eq!(polled, want);

    let mut s = model.session_with_capacity(320).unwrap();
    let default = s.prompt_batch();
    assert_eq!(default, qwen3_wgpu::PREFILL_BATCH);
    for bad in [0, default + 1] {
        let e = s.set_prompt_batch(bad).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        assert!(e.to_string().contains("prompt_batch"), "{e}");
        assert_eq!(s.prompt_batch(), default, "a refused size changed the setting");
    }
    s.set_prompt_batch(64).unwrap();
    assert_eq!(s.fork().unwrap().prompt_batch(), 64);
}
