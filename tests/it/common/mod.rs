//! Shared by the kernel test suites (WGSL on a Vulkan adapter, MSL through
//! the C++ shim): one CPU reference per kernel and one set of cases, so
//! every backend runs the same inputs against the same numbers.
#![allow(dead_code)] // each test crate uses its own subset

pub mod cases;
pub mod reference;
pub mod seeded;

/// The logits' bits after a 300-token prompt (batches of 256 and 44
/// tokens: the second fills no tile of 64 and no attention group of 8 or
/// 16, its contexts across the first chunk of 256 positions) on the
/// `prompt_300tok` fixture (qkv and gate/up of 512 rows, 4 query heads on 2
/// K/V heads), under the process's environment as set now (the tests of
/// the settings read at an engine's build).
pub fn logits_after_a_long_prompt() -> Vec<u32> {
    use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/prompt_300tok");
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().expect("engine");
    let model =
        engine.load(dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 1000).collect();
    let mut session = model.session_with_capacity(320).unwrap();
    session.feed(&prompt).unwrap();
    session.debug_logits().unwrap().iter().map(|v| v.to_bits()).collect()
}
