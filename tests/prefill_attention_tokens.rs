//! QWEN3_WGPU_PREFILL_ATTENTION_TOKENS picks the prompt tokens one
//! attention_prefill workgroup serves when the engine starts (WGSL on
//! lavapipe): an unknown value is a named error from the engine's build,
//! and under every value a 300-token prompt ends in the default's logits
//! bit for bit (each value computes a token's attention as the same sums in
//! the same order; tests/kernels.rs compares the values kernel by kernel).
//! One test: the variable is the process's.

mod common;

use common::logits_after_a_long_prompt;
use qwen3_wgpu::internals::kernels::{PrefillAttentionTokens, PREFILL_ATTENTION_TOKENS_ENV};
use qwen3_wgpu::{AdapterPolicy, Engine};

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
