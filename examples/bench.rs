//! Decode benchmark on a checkpoint (by default a random one of the exact
//! Qwen3-0.6B-Base shape, written to a temp dir). Prints one JSON line per
//! measurement.
//!
//! `cargo run --release --example bench -- [--checkpoint DIR] [--backend portable] [--tokens 128]
//! [--contexts 128,1024] [--lookaheads 1,4]`

use std::time::Instant;

use clap::Parser;
use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions, ModelConfig};
use serde_json::json;

#[derive(Parser)]
pub struct Args {
    /// Checkpoint directory; default: a random exact-shape checkpoint in a temp dir.
    #[arg(long)]
    checkpoint: Option<std::path::PathBuf>,
    /// `metal` or `portable`. Default: QWEN3_WGPU_BACKEND, else portable.
    #[arg(long, value_name = "NAME", value_parser = |s: &str| AdapterPolicy::from_name("--backend", s))]
    backend: Option<AdapterPolicy>,
    /// New tokens timed per context length.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Context lengths (prompt tokens before the timed decode).
    #[arg(long, value_delimiter = ',', default_value = "128,1024")]
    contexts: Vec<usize>,
    /// Decode steps queued ahead of the caller (`Session::set_lookahead`);
    /// one measurement per value (1 = a wait on every token).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    lookaheads: Vec<usize>,
    /// Steps timed one by one after each decode run (CPU encode, GPU and
    /// wall time per step; medians are printed).
    #[arg(long, default_value_t = 16)]
    timed_steps: usize,
}

/// Peak resident memory of this process so far (Linux VmHWM), in MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    run(Args::parse())
}

/// The measurements (also run by `cargo bench`, benches/decode.rs).
pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let policy = match args.backend {
        Some(policy) => policy,
        None => AdapterPolicy::from_env()?.unwrap_or(AdapterPolicy::Portable),
    };
    let tmp = tempfile::tempdir()?;
    let ckpt = match &args.checkpoint {
        Some(p) => p.clone(),
        None => {
            let t = Instant::now();
            write_random_checkpoint(tmp.path(), &ModelConfig::qwen3_0_6b_base(), 1)?;
            eprintln!("wrote a random exact-shape checkpoint in {:.1} s", t.elapsed().as_secs_f64());
            tmp.path().to_path_buf()
        }
    };
    let cache = CachePolicy::Dir(tmp.path().join("cache"));
    let engine = Engine::builder().policy(policy).build()?;
    let info = engine.adapter_info().clone();
    let adapter = json!({"name": info.name, "backend": format!("{:?}", info.backend).to_lowercase(), "subgroups": engine.uses_subgroups()});

    for (what, _) in [("cold_load", ()), ("cached_load", ())] {
        let t = Instant::now();
        let model = engine.load(&ckpt, &LoadOptions { cache: cache.clone(), ..Default::default() })?;
        println!(
            "{}",
            json!({"bench": what, "load_ms": t.elapsed().as_secs_f64() * 1e3, "converted": model.load_report().converted,
                   "convert_ms": model.load_report().convert_ms, "peak_rss_mib": peak_rss_mib(), "adapter": adapter})
        );
    }
    let model = engine.load(&ckpt, &LoadOptions { cache: cache.clone(), ..Default::default() })?;
    let cfg = model.config().clone();
    // Bytes a token reads: every weight once, plus the K and V written so far.
    let weight_bytes = model.weight_bytes() as f64;
    // Warm-up (first submits, GPU clocks), not measured: up to 64 steps or
    // half a second (a CPU adapter gets through a step or two).
    {
        let mut s = model.session_with_capacity(256)?;
        s.feed(&(0..128u32).collect::<Vec<_>>())?;
        let t = Instant::now();
        for _ in 0..64 {
            s.next_token()?;
            if t.elapsed().as_secs_f64() > 0.5 {
                break;
            }
        }
    }
    for (&ctx, &lookahead) in args.contexts.iter().flat_map(|c| args.lookaheads.iter().map(move |l| (c, l))) {
        // Room for the timed steps and as many back-to-back ones.
        let capacity = ctx + args.tokens + 2 * args.timed_steps + 1;
        let mut s = model.session_with_capacity(capacity)?;
        s.set_lookahead(lookahead);
        let prompt: Vec<u32> = (0..ctx as u32).map(|i| (i * 7919) % cfg.vocab_size as u32).collect();
        let t = Instant::now();
        s.feed(&prompt)?;
        let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        let dispatches = s.dispatches_per_token();
        // The GPU's own rate at this context: steps back to back in one
        // submit (best of 3; leaves the session as it was).
        let back_to_back_us =
            (0..3).filter_map(|_| s.gpu_time_of_steps(args.timed_steps).ok().flatten()).reduce(f64::min);
        let t = Instant::now();
        for _ in 0..args.tokens {
            s.next_token()?;
        }
        let secs = t.elapsed().as_secs_f64();
        let tps = args.tokens as f64 / secs;
        // Where a step's time goes (medians of 16 timed steps).
        let mut timings = Vec::new();
        for _ in 0..args.timed_steps {
            timings.push(s.timed_step()?);
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied()
        };
        let encode_us = median(timings.iter().map(|t| t.encode_us).collect());
        let gpu_us = median(timings.iter().filter_map(|t| t.gpu_us).collect());
        let wall_us = median(timings.iter().map(|t| t.wall_us).collect());
        // KV bytes read per token at this context (f16 K and V).
        let kv = (2 * cfg.num_hidden_layers * cfg.kv_dim() * 2 * (ctx + args.tokens / 2)) as f64;
        println!(
            "{}",
            json!({"bench": "decode", "context": ctx, "tokens": args.tokens, "lookahead": lookahead, "decode_tokens_per_sec": tps,
                   "ms_per_token": 1e3 * secs / args.tokens as f64, "prefill_tokens": ctx, "prefill_ms": prefill_ms,
                   "prefill_tokens_per_sec": ctx as f64 / (prefill_ms / 1e3),
                   "bytes_per_token": weight_bytes + kv, "achieved_gb_per_s": (weight_bytes + kv) * tps / 1e9,
                   "dispatches_per_token": dispatches,
                   "gpu_weight_bytes": model.weight_bytes(), "gpu_session_bytes": s.buffer_bytes(),
                   "step_encode_us": encode_us, "step_gpu_us": gpu_us, "step_wall_us": wall_us,
                   "gpu_us_per_step_back_to_back": back_to_back_us, "adapter": adapter})
        );
    }
    Ok(())
}
