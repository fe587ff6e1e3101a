//! QWEN3_WGPU_PREFILL_ATTENTION_TOKENS picks the prompt tokens one
//! attention_prefill workgroup serves when the engine starts (WGSL on
//! lavapipe): an unknown value is a named error from the engine's build,
//! and under every value a 300-token prompt ends in the default's logits
//! bit for bit (each value computes a token's attention as the same sums in
//! the same order; tests/kernels.rs compares the values kernel by kernel).
//! One test: the variable is the process's.

use std::path::Path;

use qwen3_wgpu::internals::kernels::{PrefillAttentionTokens, PREFILL_ATTENTION_TOKENS_ENV};
use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions};

/// The logits after a 300-token prompt (batches of 256 and 44 tokens: the
/// second no multiple of 8 or 16, its contexts across the first chunk of
/// 256 positions) on the `prompt_300tok` fixture (4 query heads on 2 K/V
/// heads), under the variable as set now.
fn logits_after_a_long_prompt() -> Vec<u32> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/prompt_300tok");
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().expect("engine");
    let model =
        engine.load(dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 1000).collect();
    let mut session = model.session_with_capacity(320).unwrap();
    session.feed(&prompt).unwrap();
    session.debug_logits().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn every_value_gives_the_default_logits_and_an_unknown_one_is_a_named_error() {
    std::env::remove_var(PREFILL_ATTENTION_TOKENS_ENV);
    let want = logits_after_a_long_prompt();

    std::env::set_var(PREFILL_ATTENTION_TOKENS_ENV, "32");
    let e = Engine::builder().policy(AdapterPolicy::Portable).build().err().expect("an unknown value fails");
    assert_eq!(e.code(), "invalid_argument");
    let msg = e.to_string();
    assert!(msg.contains(PREFILL_ATTENTION_TOKENS_ENV) && msg.contains("4, 8, 16"), "{msg}");

    for (name, tokens) in PrefillAttentionTokens::ALL {
        if tokens == PrefillAttentionTokens::DEFAULT {
            continue; // the logits wanted
        }
        std::env::set_var(PREFILL_ATTENTION_TOKENS_ENV, name);
        assert!(
            logits_after_a_long_prompt() == want,
            "{PREFILL_ATTENTION_TOKENS_ENV}={name}: not the default's logits"
        );
    }
    std::env::remove_var(PREFILL_ATTENTION_TOKENS_ENV);
}
