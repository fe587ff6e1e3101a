//! The logits a checkpoint's converted model gives at every position of a
//! fixed token sequence, for measuring the weight formats' error against a
//! float32 forward pass (`scripts/logit_error.py` reads both files).
//!
//! `cargo run --release --example dump_logits -- CHECKPOINT OUT [--positions N (1024)]
//! [--weights int8|int4] [--backend metal|portable]`
//!
//! Writes `OUT` (one row of `vocab_size` little-endian f32 per position,
//! each the logits after feeding that position's token, one token per
//! step as a reply decodes) and `OUT.ids.json` (the token ids).

use std::io::Write;

use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions, WeightFormat};

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [checkpoint, out, ..] = &args[..] else {
        return Err(
            "usage: dump_logits CHECKPOINT OUT [--positions N] [--weights int8|int4] [--backend NAME]".into(),
        );
    };
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    let positions = match flag("--positions") {
        Some(v) => v.parse::<usize>().map_err(|e| format!("--positions {v:?}: {e}"))?,
        None => 1024,
    };
    let mut options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
    if let Some(name) = flag("--weights") {
        options = options.weights(WeightFormat::from_name("--weights", name)?);
    }
    let mut builder = Engine::builder();
    if let Some(name) = flag("--backend") {
        builder = builder.policy(AdapterPolicy::from_name("--backend", name)?);
    }
    let engine = builder.build()?;
    let model = engine.load(checkpoint, &options)?;
    let vocab = model.config().vocab_size as u64;
    // Spread over the whole vocabulary, the same for every format.
    let ids: Vec<u32> = (0..positions as u64).map(|i| ((i * 2_654_435_761 + 17) % vocab) as u32).collect();
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    // Room for the step each feed records ahead.
    let mut session = model.session_with_capacity(positions + 8)?;
    for &id in &ids {
        session.feed(&[id])?;
        for v in session.debug_logits()? {
            file.write_all(&v.to_le_bytes())?;
        }
        // Drop the pending prediction, which the next feed would take in
        // ahead of the next id.
        session.truncate(session.len())?;
    }
    file.flush()?;
    let ids_json =
        serde_json::json!({"ids": ids, "vocab_size": vocab, "weights": model.weight_format().name()});
    std::fs::write(format!("{out}.ids.json"), ids_json.to_string())?;
    println!("wrote {positions} positions of {vocab} logits to {out} ({} weights)", model.weight_format());
    Ok(())
}
