//! The logits a checkpoint's converted model gives at every position of a
//! fixed token sequence, for measuring the weight formats' error against a
//! float32 forward pass (`scripts/logit_error.py` reads both files).
//!
//! `cargo run --release --example dump_logits -- CHECKPOINT OUT [--positions N (1024)]
//! [--context N (0)] [--weights int8|int4] [--kv-cache f16|int8] [--backend metal|portable]`
//!
//! Feeds a prompt of `--context` ids first (one prompt, as a conversation's
//! history), then writes `OUT` (one row of `vocab_size` little-endian f32
//! per dumped position, each the logits after feeding that position's
//! token, one token per step as a reply decodes) and `OUT.ids.json` (every
//! id fed, the context's first, and `context`).

use std::io::Write;

use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, KvFormat, LoadOptions, SessionOptions, WeightFormat};

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
        return Err("usage: dump_logits CHECKPOINT OUT [--positions N] [--context N] [--weights int8|int4] \
             [--kv-cache f16|int8] [--backend NAME]"
            .into());
    };
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    let positions = match flag("--positions") {
        Some(v) => v.parse::<usize>().map_err(|e| format!("--positions {v:?}: {e}"))?,
        None => 1024,
    };
    let context = match flag("--context") {
        Some(v) => v.parse::<usize>().map_err(|e| format!("--context {v:?}: {e}"))?,
        None => 0,
    };
    let kv_cache = match flag("--kv-cache") {
        Some(name) => KvFormat::from_name("--kv-cache", name)?,
        None => KvFormat::F16,
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
    let ids: Vec<u32> =
        (0..(context + positions) as u64).map(|i| ((i * 2_654_435_761 + 17) % vocab) as u32).collect();
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    // Room for the step each feed records ahead.
    let capacity = context + positions + 8;
    let mut session = model.session_with(&SessionOptions::default().capacity(capacity).kv_cache(kv_cache))?;
    if context > 0 {
        session.feed(&ids[..context])?;
        session.truncate(session.len())?;
    }
    for &id in &ids[context..] {
        session.feed(&[id])?;
        for v in session.debug_logits()? {
            file.write_all(&v.to_le_bytes())?;
        }
        // Drop the pending prediction, which the next feed would take in
        // ahead of the next id.
        session.truncate(session.len())?;
    }
    file.flush()?;
    let ids_json = serde_json::json!({"ids": ids, "context": context, "vocab_size": vocab,
                                      "weights": model.weight_format().name(), "kv_cache": kv_cache.name()});
    std::fs::write(format!("{out}.ids.json"), ids_json.to_string())?;
    println!(
        "wrote {positions} positions of {vocab} logits after {context} to {out} ({} weights, {kv_cache} KV cache)",
        model.weight_format()
    );
    Ok(())
}
