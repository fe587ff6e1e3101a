//! QWEN3_WGPU_SHADER_CHECKS: by default the matvec family's WGSL (decode,
//! batched rows, the prompt-batch products) runs without naga's runtime
//! checks; `all` keeps them in every kernel. With no index out of range the
//! two compute the same bits, so a 300-token prompt (both prompt-batch
//! programs), decode steps and a batch of sessions' steps, in both matvec
//! layouts, must end in the same logits and tokens either way: an index
//! past its array would read a clamped element under the checks and
//! something else without them. An unknown value is a named error. One
//! test: the variable is the process's.

use std::path::Path;

use qwen3_wgpu::internals::kernels::{MatvecLayout, ShaderChecks, SHADER_CHECKS_ENV};
use qwen3_wgpu::{AdapterPolicy, BatchOptions, CachePolicy, Engine, LoadOptions};

/// Logits bits after a 300-token prompt, then 4 greedy tokens, then 3 tokens
/// each of 3 sessions stepped as one batch, under the variable as set now.
fn run(layout: MatvecLayout) -> (Vec<u32>, Vec<u32>, Vec<Vec<u32>>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/prompt_300tok");
    let engine =
        Engine::builder().policy(AdapterPolicy::Portable).matvec_layout(layout).build().expect("engine");
    let model =
        engine.load(dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 1000).collect();
    let mut session = model.session_with_capacity(320).unwrap();
    session.feed(&prompt).unwrap();
    let logits = session.debug_logits().unwrap().iter().map(|v| v.to_bits()).collect();
    let tokens = (0..4).map(|_| session.next_token().unwrap()).collect();

    let mut batch = model.batch(&BatchOptions::default().slots(3).capacity_per_slot(64)).unwrap();
    let mut sessions: Vec<_> = (0..3).map(|_| batch.session().unwrap()).collect();
    let mut batched: Vec<Vec<u32>> = Vec::new();
    for (i, s) in sessions.iter_mut().enumerate() {
        let p: Vec<u32> = (0..5 + 7 * i as u32).map(|t| (t * 13 + i as u32) % 1000).collect();
        batched.push(vec![s.feed(&p).unwrap()]);
    }
    for _ in 0..3 {
        let mut refs: Vec<_> = sessions.iter_mut().collect();
        for (got, t) in batched.iter_mut().zip(batch.step(&mut refs).unwrap()) {
            got.push(t);
        }
    }
    (logits, tokens, batched)
}

#[test]
fn kernels_without_runtime_checks_compute_what_they_compute_with_them() {
    if !crate::support::alone_in_child(
        module_path!(),
        "kernels_without_runtime_checks_compute_what_they_compute_with_them",
    ) {
        return;
    }
    assert!(!ShaderChecks::DataIndexed.keeps(qwen3_wgpu::internals::kernels::Kernel::Int8MatvecNorm));
    for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
        std::env::remove_var(SHADER_CHECKS_ENV);
        let unchecked = run(layout);
        std::env::set_var(SHADER_CHECKS_ENV, "all");
        let checked = run(layout);
        assert!(
            unchecked == checked,
            "{layout:?}: the unchecked kernels' results differ from the checked ones'"
        );
    }

    std::env::set_var(SHADER_CHECKS_ENV, "some");
    let e = Engine::builder().policy(AdapterPolicy::Portable).build().err().expect("an unknown value fails");
    assert_eq!(e.code(), "invalid_argument");
    assert!(e.to_string().contains(SHADER_CHECKS_ENV) && e.to_string().contains("data-indexed, all"), "{e}");
    std::env::remove_var(SHADER_CHECKS_ENV);
}
