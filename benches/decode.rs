//! `cargo bench`: the `bench` example's measurements (one JSON line per
//! configuration: cold and cached load, decode tok/s per context and
//! lookahead, prefill, GPU and CPU time per step, GPU memory, achieved
//! bandwidth, dispatches per token) on a random checkpoint of the exact
//! Qwen3-0.6B-Base shape, under the portable policy.
//!
//! Cargo passes its own flags, so the example's options come from
//! `QWEN3_WGPU_BENCH_ARGS`, e.g.
//! `QWEN3_WGPU_BENCH_ARGS="--contexts 128,512,4096 --lookaheads 4,8" cargo bench`.
//! On a CPU adapter (lavapipe) use few tokens: `--contexts 16 --tokens 4`.

use qwen3_wgpu::internals::bench::{run, BenchOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let extra = std::env::var("QWEN3_WGPU_BENCH_ARGS").unwrap_or_default();
    run(&BenchOptions::parse(extra.split_whitespace().map(String::from))?)
}
