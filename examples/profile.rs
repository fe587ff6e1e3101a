//! GPU time per kernel of one decode step (timestamps between launches,
//! or the wall time of each launch waited on where the device has no
//! timestamps inside passes). With `--repeat N` every launch runs N times
//! back to back, and the first run is reported beside the later ones (the
//! later runs find their inputs in cache and their predecessor finished).
//!
//! `cargo run --release --example profile -- CHECKPOINT [portable | --backend NAME] [--repeat N] [--context N]
//! [--sampling T,K,P] [--sessions N] [--kv-cache f16|int8]` (without a backend: `QWEN3_WGPU_BACKEND`, else metal). `--sampling` profiles the
//! step with the sampler's launches (temperature, top-k, top-p; seed 1) in place of the argmax.
//! `--sessions N` profiles one batched step of N sessions (`Batch`) at the context instead.

use std::collections::BTreeMap;

use qwen3_wgpu::{AdapterPolicy, BatchOptions, CachePolicy, Engine, LoadOptions, SamplingParams};

fn main() -> Result<(), qwen3_wgpu::Error> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).cloned().unwrap_or_else(|| "./qwen3-0.6b-base".into());
    // A policy left unset is read by the builder from QWEN3_WGPU_BACKEND.
    let mut builder = Engine::builder();
    if let Some(name) = backend_flag(&args) {
        builder = builder.policy(AdapterPolicy::from_name("--backend", name)?);
    } else if args.iter().any(|a| a == "portable") {
        builder = builder.policy(AdapterPolicy::Portable);
    }
    let engine = builder.build()?;
    let model = engine.load(&dir, &LoadOptions { cache: CachePolicy::Default, ..Default::default() })?;
    let flag =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)?.parse::<usize>().ok());
    let context = flag("--context").unwrap_or(3).max(1);
    let kv_cache = match args.iter().position(|a| a == "--kv-cache") {
        Some(i) => qwen3_wgpu::KvFormat::from_name("--kv-cache", args.get(i + 1).map_or("", String::as_str))?,
        None => qwen3_wgpu::KvFormat::F16,
    };
    let session_options =
        |capacity: usize| qwen3_wgpu::SessionOptions::default().capacity(capacity).kv_cache(kv_cache);
    let mut s = model.session_with(&session_options(context + 16))?;
    if let Some(i) = args.iter().position(|a| a == "--sampling") {
        let v: Vec<f32> =
            args.get(i + 1).map_or("", |v| v.as_str()).split(',').filter_map(|x| x.parse().ok()).collect();
        let [t, k, p] = v[..] else {
            eprintln!("--sampling takes T,K,P (e.g. 0.6,20,0.95)");
            std::process::exit(2);
        };
        s.set_sampling(&SamplingParams::default().temperature(t).top_k(k as u32).top_p(p).seed(1))?;
    }
    let vocab = model.config().vocab_size as u32;
    s.feed(&(0..context as u32).map(|i| (i * 7919) % vocab).collect::<Vec<_>>())?;
    // Warm-up, in a session of its own: the GPU's clocks rise under load
    // (an idle GPU runs the first steps several times slower).
    let mut warm = model.session_with_capacity(4096)?;
    warm.feed(&[1, 2, 3])?;
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs_f64() < 1.0 && warm.len() + 1 < warm.capacity() {
        warm.next_token()?;
    }
    drop(warm);
    if let Some(n) = flag("--prefill") {
        // One prompt batch of n tokens after the context, per kernel.
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 104729) % vocab).collect();
        let mut p = model.session_with(&session_options(context + n + 16))?;
        p.feed(&(0..context as u32).map(|i| (i * 7919) % vocab).collect::<Vec<_>>())?;
        if let Some(prof) = p.profile_prefill(&ids)? {
            let mut by: BTreeMap<String, (usize, f64)> = BTreeMap::new();
            for (k, us) in &prof {
                let e = by.entry(k.to_string()).or_default();
                e.0 += 1;
                e.1 += us[0];
            }
            let total: f64 = prof.iter().map(|p| p.1[0]).sum();
            println!("prefill batch of {n} tokens after {context}: {} launches, {total:.0} us", prof.len());
            for (k, (launches, us)) in by {
                println!("{k:42} {launches:4} launches {us:10.0} us  ({:.1} us each)", us / launches as f64);
            }
        }
    }
    if let Some(n) = flag("--sessions") {
        // One batched step of n sessions at the context, per kernel (the
        // median of 5 steps per launch).
        let mut batch =
            model.batch(&BatchOptions::default().slots(n.max(1)).capacity_per_slot(context + 16))?;
        let mut sessions = (0..n.max(1)).map(|_| batch.session()).collect::<Result<Vec<_>, _>>()?;
        for (i, b) in sessions.iter_mut().enumerate() {
            b.feed(&(0..context as u32).map(|j| (j * 7919 + i as u32) % vocab).collect::<Vec<_>>())?;
        }
        let mut runs: Vec<Vec<(qwen3_wgpu::internals::kernels::LaunchKind, f64)>> = Vec::new();
        for _ in 0..5 {
            let mut refs: Vec<&mut qwen3_wgpu::Session> = sessions.iter_mut().collect();
            match batch.profile_step(&mut refs)? {
                Some(p) => runs.push(p),
                None => break,
            }
        }
        if let Some(first) = runs.first() {
            let mut by: BTreeMap<String, (usize, f64)> = BTreeMap::new();
            let mut total = 0.0;
            for (i, (k, _)) in first.iter().enumerate() {
                let mut v: Vec<f64> = runs.iter().map(|r| r[i].1).collect();
                v.sort_by(f64::total_cmp);
                let us = v[v.len() / 2];
                total += us;
                let e = by.entry(k.to_string()).or_default();
                e.0 += 1;
                e.1 += us;
            }
            println!(
                "batched step of {n} sessions at context {context}: {} launches, {total:.0} us",
                first.len()
            );
            for (k, (launches, us)) in by {
                println!("{k:42} {launches:4} launches {us:10.0} us  ({:.1} us each)", us / launches as f64);
            }
        }
        return Ok(());
    }
    // Too many repeats is the session's invalid_argument, not a truncated count.
    let repeat = flag("--repeat").map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX));
    let (prof, how) = match s.profile_gpu(repeat)? {
        Some(p) => (p, "GPU timestamps between launches"),
        None => {
            let p = s.profile_step()?.into_iter().map(|(k, us)| (k, vec![us])).collect();
            (p, "wall time, each launch waited on")
        }
    };
    // kernel -> (launches, first runs' µs, later runs' µs, later runs)
    let mut by: BTreeMap<String, (usize, f64, f64, usize)> = BTreeMap::new();
    for (k, runs) in &prof {
        let e = by.entry(k.to_string()).or_default();
        e.0 += 1;
        e.1 += runs[0];
        e.2 += runs[1..].iter().sum::<f64>();
        e.3 += runs.len() - 1;
    }
    let total: f64 = prof.iter().map(|p| p.1[0]).sum();
    println!("context {context}: {} launches, {:.0} us total in first runs ({how})", prof.len(), total);
    for (k, (n, first, later, n_later)) in by {
        print!("{k:42} {n:4} launches {first:10.0} us  ({:.1} us each)", first / n as f64);
        if n_later > 0 {
            print!("  repeated back to back: {:.1} us each", later / n_later as f64);
        }
        println!();
    }
    // Each kind of launch alone, in sequence, with no timestamps between
    // launches: its cost inside the step, free of the timestamps' own cost.
    let kinds: Vec<_> = {
        let mut v: Vec<_> = prof.iter().map(|p| p.0).collect();
        v.sort_by_key(|k| k.to_string());
        v.dedup();
        v
    };
    let all = (0..5).filter_map(|_| s.gpu_time_of(|_| true).ok().flatten()).fold(f64::MAX, f64::min);
    if all < f64::MAX {
        println!("whole step, pass timestamps only: {all:.0} us");
        for k in kinds {
            let n = prof.iter().filter(|p| p.0 == k).count();
            let alone =
                (0..5).filter_map(|_| s.gpu_time_of(|x| x == k).ok().flatten()).fold(f64::MAX, f64::min);
            println!(
                "{:42} {n:4} launches alone: {alone:8.0} us ({:.1} us each)",
                k.to_string(),
                alone / n as f64
            );
        }
    }
    Ok(())
}

/// The value of `--backend NAME` (or `--backend=NAME`), if given.
fn backend_flag(args: &[String]) -> Option<&str> {
    args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--backend") {
        Some("") => Some(args.get(i + 1).map_or("", String::as_str)),
        Some(rest) => rest.strip_prefix('='),
        None => None,
    })
}
