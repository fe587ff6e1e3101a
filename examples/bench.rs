//! Decode benchmark on a checkpoint (by default a random one of the exact
//! Qwen3-0.6B-Base shape, written to a temp dir). Prints one JSON line per
//! measurement (the measurements: `internals::bench`, also run by `cargo bench`).
//!
//! `cargo run --release --example bench -- [--checkpoint DIR] [--backend portable] [--tokens 128]
//! [--contexts 128,1024] [--lookaheads 1,4] [--timed-steps 16] [--sessions 1,4,8,16]`

use qwen3_wgpu::internals::bench::{run, BenchOptions, BENCH_USAGE};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{BENCH_USAGE}");
        return Ok(());
    }
    run(&BenchOptions::parse(args)?)
}
