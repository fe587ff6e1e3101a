//! Per-kernel wall time of one decode step (a wait after every launch).
//!
//! `cargo run --release --example profile -- CHECKPOINT [--backend portable]`

use std::collections::BTreeMap;

use qwen3_wgpu::{AdapterPolicy, CachePolicy, Engine, LoadOptions};

fn main() -> Result<(), qwen3_wgpu::Error> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).cloned().unwrap_or_else(|| "./qwen3-0.6b-base".into());
    let policy =
        if args.iter().any(|a| a == "portable") { AdapterPolicy::Portable } else { AdapterPolicy::MetalOnly };
    let engine = Engine::builder().policy(policy).build()?;
    let model = engine.load(&dir, &LoadOptions { cache: CachePolicy::Default, ..Default::default() })?;
    let mut s = model.session_with_capacity(256)?;
    s.feed(&[1, 2, 3])?;
    let (prof, how) = match s.profile_gpu()? {
        Some(p) => (p, "GPU timestamps between launches"),
        None => (s.profile_step()?, "wall time, each launch waited on"),
    };
    let mut by: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    for (k, us) in &prof {
        let e = by.entry(format!("{k:?}")).or_default();
        e.0 += 1;
        e.1 += us;
    }
    let total: f64 = prof.iter().map(|p| p.1).sum();
    println!("{} launches, {:.0} us total ({how})", prof.len(), total);
    for (k, (n, us)) in by {
        println!("{k:24} {n:4} launches {us:10.0} us  ({:.0} us each)", us / n as f64);
    }
    Ok(())
}
