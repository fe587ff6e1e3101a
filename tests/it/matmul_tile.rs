//! QWEN3_WGPU_MATMUL_TILE picks the prompt-batch product's tiling when the
//! engine starts (WGSL on lavapipe): an unknown value is a named error from
//! the engine's build, and under the base tiling and a tiling of each
//! grid the others take (128-row tiles run half the workgroups of 64-row ones,
//! narrow ones up to four times as many), a 300-token prompt ends
//! in the default tiling's logits bit for bit (every tiling computes each
//! output as the same sum in the same order; tests/it/kernels.rs runs every
//! tiling against the base one kernel by kernel). One test: the variable
//! is the process's.

use crate::common;

use common::logits_after_a_long_prompt;
use qwen3_wgpu::internals::kernels::{MatmulTile, MATMUL_TILE_ENV};
use qwen3_wgpu::{AdapterPolicy, Engine};

#[test]
fn every_tiling_gives_the_default_logits_and_an_unknown_one_is_a_named_error() {
    if !crate::support::alone_in_child(
        module_path!(),
        "every_tiling_gives_the_default_logits_and_an_unknown_one_is_a_named_error",
    ) {
        return;
    }
    std::env::remove_var(MATMUL_TILE_ENV);
    let want = logits_after_a_long_prompt();

    std::env::set_var(MATMUL_TILE_ENV, "8x8");
    let e = Engine::builder().policy(AdapterPolicy::Portable).build().err().expect("an unknown tiling fails");
    assert_eq!(e.code(), "invalid_argument");
    let msg = e.to_string();
    assert!(msg.contains(MATMUL_TILE_ENV) && msg.contains("128x64-8x8-pf-sw"), "{msg}");

    // The base tiling and one of each grid the others take beside the
    // default's (64-row narrow): 64-row tiles in 8 x 8 register tiles,
    // 128-row ones (half the workgroups), 128-row narrow ones.
    // tests/it/kernels.rs runs every tiling against the base kernel by
    // kernel, on the grid its constants give.
    let tilings = ["64x64-4x4", "64x64-8x8-pf-sw", "128x64-8x4-pf-sw", "128x64-8x8-pf-sw-n"];
    let all = MatmulTile::all();
    for name in tilings {
        let tile = all.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name} is offered")).1;
        assert_eq!(name == "64x64-4x4", tile == MatmulTile::BASE);
        std::env::set_var(MATMUL_TILE_ENV, name);
        assert!(
            logits_after_a_long_prompt() == want,
            "{MATMUL_TILE_ENV}={name}: not the default tiling's logits"
        );
    }
    std::env::remove_var(MATMUL_TILE_ENV);
}
