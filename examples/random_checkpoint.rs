//! Writes a random Qwen3 checkpoint (BF16, Hugging Face layout) of the
//! exact Qwen3-0.6B-Base shape, for benchmarks and trying the engine.
//!
//! `cargo run --release --example random_checkpoint -- OUT_DIR [SEED]`

use clap::Parser;
use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::ModelConfig;

#[derive(Parser)]
#[command(about = "Writes a random Qwen3 checkpoint of the exact Qwen3-0.6B-Base shape")]
struct Args {
    /// Directory to write config.json and model.safetensors into (created if missing)
    out_dir: std::path::PathBuf,
    /// Seed of the random weights
    #[arg(default_value_t = 1)]
    seed: u64,
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let cfg = ModelConfig::qwen3_0_6b_base();
    let dir = args.out_dir.as_path();
    let written =
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display())).and_then(|_| {
            write_random_checkpoint(dir, &cfg, args.seed).map_err(|e| format!("[{}]: {e}", e.code()))
        });
    if let Err(e) = written {
        eprintln!("error {e}");
        std::process::exit(2);
    }
    println!("wrote {}", dir.display());
}
