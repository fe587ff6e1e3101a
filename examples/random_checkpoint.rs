//! Writes a random Qwen3 checkpoint (BF16, Hugging Face layout) of the
//! exact Qwen3-0.6B-Base shape, for benchmarks and trying the engine.
//!
//! `cargo run --release --example random_checkpoint -- OUT_DIR [SEED]`

use qwen3_wgpu::testing::write_random_checkpoint;
use qwen3_wgpu::ModelConfig;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(out) = args.next() else {
        eprintln!("usage: random_checkpoint OUT_DIR [SEED]");
        std::process::exit(2);
    };
    let seed = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let cfg = ModelConfig::qwen3_0_6b_base();
    let dir = std::path::Path::new(&out);
    if let Err(e) = std::fs::create_dir_all(dir)
        .map_err(|e| e.to_string())
        .and_then(|_| write_random_checkpoint(dir, &cfg, seed).map_err(|e| e.to_string()))
    {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    println!("wrote {}", dir.display());
}
