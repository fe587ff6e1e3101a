//! The decode benchmark behind the `bench` example and `cargo bench`
//! (benches/decode.rs): cold and cached load, decode tok/s per context and
//! lookahead, prefill, GPU and CPU time per step, GPU memory, achieved
//! bandwidth and dispatches per token, one JSON line each. With
//! `--sampling T,K,P`, each context also decodes sampling (temperature T,
//! top-k K, top-p P) and a `sampling_cost` line sets its GPU time per step
//! beside greedy's. With `--sessions N,N,...`, each context also decodes
//! N sessions together through a `Batch` (one GPU step per token of every
//! session): a `batched_decode` line per count, and a table of aggregate
//! and per-session tokens/s on stderr.
//!
//! A context too close to the model's `max_position_embeddings` for the
//! positions a measurement adds runs at the largest context that fits:
//! each line's `"context"` is the one measured, `"context_requested"` the
//! one asked for.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;

use crate::buffers::PREFILL_BATCH;
use crate::cache::CachePolicy;
use crate::config::ModelConfig;
use crate::converted::WeightFormat;
use crate::engine::{Engine, LoadOptions};
use crate::error::{Error, Result};
use crate::gpu::AdapterPolicy;
use crate::kernels::{Kernel, ATTENTION_CHUNK, SAMPLE_CHUNK};
use crate::kv_cache::KvFormat;
use crate::sampling::SamplingParams;
use crate::testing::write_random_checkpoint;

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// Checkpoint directory; `None`: a random exact-shape checkpoint in a temporary directory.
    pub checkpoint: Option<PathBuf>,
    /// `None`: `QWEN3_WGPU_BACKEND`, else portable.
    pub backend: Option<AdapterPolicy>,
    /// New tokens timed per context length.
    pub tokens: usize,
    /// Context lengths (prompt tokens before the timed decode).
    pub contexts: Vec<usize>,
    /// Decode steps queued ahead of the caller (`Session::set_lookahead`);
    /// one measurement per value (1 = a wait on every token).
    pub lookaheads: Vec<usize>,
    /// Steps timed one by one after each decode run (CPU encode, GPU and
    /// wall time per step; medians are printed).
    pub timed_steps: usize,
    /// Also measure sampling under these parameters, beside greedy.
    pub sampling: Option<SamplingParams>,
    /// Session counts decoded together through a batch (none: no batched
    /// measurement).
    pub sessions: Vec<usize>,
    /// A JSON schema file: also measure greedy decode under it (replies
    /// until complete, beside the same number of free tokens); needs
    /// `tokenizer`.
    pub constraint: Option<PathBuf>,
    /// The directory of the tokenizer.json constraints compile against.
    pub tokenizer: Option<PathBuf>,
    /// The layers' weight format; `None`: `QWEN3_WGPU_WEIGHTS`, else int8.
    pub weights: Option<WeightFormat>,
    /// The KV cache's format (default f16).
    pub kv_cache: KvFormat,
    /// Prompt positions one batch of a feed runs
    /// (`Session::set_prompt_batch`); `None`: the session's default.
    pub prompt_batch: Option<usize>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            checkpoint: None,
            backend: None,
            tokens: 128,
            contexts: vec![128, 1024],
            lookaheads: vec![4],
            timed_steps: 16,
            sampling: None,
            sessions: Vec::new(),
            constraint: None,
            tokenizer: None,
            weights: None,
            kv_cache: KvFormat::F16,
            prompt_batch: None,
        }
    }
}

/// The options' help text.
pub const BENCH_USAGE: &str = "options: [--checkpoint DIR] [--backend metal|portable] [--tokens N (128)] \
[--contexts N,N,... (128,1024)] [--lookaheads N,N,... (4)] [--timed-steps N (16)] \
[--sampling T,K,P (e.g. 0.7,20,0.95: also measure sampling)] \
[--sessions N,N,... (e.g. 1,4,8,16: also decode that many sessions together, batched)] \
[--constraint SCHEMA.json --tokenizer DIR (also measure decode under a JSON schema)] \
[--weights int8|int4 (QWEN3_WGPU_WEIGHTS, else int8)] [--kv-cache f16|int8 (f16)] \
[--prompt-batch N (prompt positions per batch, 1 to 256; 256)]";

impl BenchOptions {
    /// Parses `--name value` or `--name=value` arguments (the program
    /// name left out). An unknown flag or a malformed value is
    /// [`Error::InvalidArgument`] naming it.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self> {
        let mut options = BenchOptions::default();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) => (f.to_string(), Some(v.to_string())),
                None => (arg, None),
            };
            let known = [
                "--checkpoint",
                "--backend",
                "--tokens",
                "--contexts",
                "--lookaheads",
                "--timed-steps",
                "--sampling",
                "--sessions",
                "--constraint",
                "--tokenizer",
                "--weights",
                "--kv-cache",
                "--prompt-batch",
            ];
            if !known.contains(&flag.as_str()) {
                return Err(Error::invalid_argument(flag, format!("unknown option; {BENCH_USAGE}")));
            }
            let value = match inline.or_else(|| args.next()) {
                Some(v) => v,
                None => return Err(Error::invalid_argument(flag, "needs a value")),
            };
            let count = |v: &str| {
                v.trim().parse::<usize>().map_err(|e| Error::invalid_argument(&flag, format!("{v:?}: {e}")))
            };
            match flag.as_str() {
                "--checkpoint" => options.checkpoint = Some(PathBuf::from(value)),
                "--backend" => options.backend = Some(AdapterPolicy::from_name(&flag, &value)?),
                "--tokens" => options.tokens = count(&value)?,
                "--timed-steps" => options.timed_steps = count(&value)?,
                "--contexts" => {
                    // A measurement feeds a prompt of the context's length: at least one id.
                    let positive = |v: &str| match count(v)? {
                        0 => Err(Error::invalid_argument(&flag, "a context of 0 positions: give 1 or more")),
                        n => Ok(n),
                    };
                    options.contexts = value.split(',').map(positive).collect::<Result<_>>()?
                }
                "--sampling" => options.sampling = Some(parse_sampling(&flag, &value)?),
                "--constraint" => options.constraint = Some(PathBuf::from(value)),
                "--tokenizer" => options.tokenizer = Some(PathBuf::from(value)),
                "--weights" => options.weights = Some(WeightFormat::from_name(&flag, &value)?),
                "--kv-cache" => options.kv_cache = KvFormat::from_name(&flag, &value)?,
                "--prompt-batch" => options.prompt_batch = Some(count(&value)?),
                "--sessions" => {
                    options.sessions = value.split(',').map(count).collect::<Result<_>>()?;
                    if options.sessions.contains(&0) {
                        return Err(Error::invalid_argument(flag, "a batch holds at least one session"));
                    }
                }
                _ => options.lookaheads = value.split(',').map(count).collect::<Result<_>>()?,
            }
        }
        Ok(options)
    }
}

/// `T,K,P` as sampling parameters (checked).
fn parse_sampling(flag: &str, value: &str) -> Result<SamplingParams> {
    let bad = || Error::invalid_argument(flag, format!("{value:?} is not T,K,P (e.g. 0.7,20,0.95)"));
    let parts: Vec<&str> = value.split(',').map(str::trim).collect();
    let [t, k, p] = parts[..] else { return Err(bad()) };
    let params = SamplingParams::default()
        .temperature(t.parse().map_err(|_| bad())?)
        .top_k(k.parse().map_err(|_| bad())?)
        .top_p(p.parse().map_err(|_| bad())?)
        .seed(1);
    params.validate().map_err(|e| Error::invalid_argument(flag, e.to_string()))?;
    Ok(params)
}

/// The launches that choose the token (argmax or sampler).
fn chooses_token(kernel: Kernel) -> bool {
    use crate::kernels::Family;
    matches!(kernel.row().family, Family::Argmax | Family::Sample | Family::SampleMerge)
}

/// The sampling parameters as the JSON lines show them.
fn sampling_json(p: &SamplingParams) -> serde_json::Value {
    json!({"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
           "repetition_penalty": p.repetition_penalty, "seed": p.seed})
}

/// A directory under the system's temporary directory, deleted on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<Self> {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let dir = std::env::temp_dir().join(format!("qwen3-wgpu-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Peak resident memory of this process so far (Linux VmHWM), in MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

/// Runs the measurements, printing one JSON line each.
pub fn run(args: &BenchOptions) -> Result<(), Box<dyn std::error::Error>> {
    let policy = match args.backend {
        Some(policy) => policy,
        None => AdapterPolicy::from_env()?.unwrap_or(AdapterPolicy::Portable),
    };
    let tmp = TempDir::new()?;
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
    let load_options = LoadOptions { cache, weights: args.weights, ..Default::default() };
    let engine = Engine::builder().policy(policy).build()?;
    let info = engine.adapter_info().clone();
    // The setup every line reports: the adapter, and the layers' weight format.
    let adapter = json!({"weights": load_options.weight_format()?.name(), "kv_cache": args.kv_cache.name(), "name": info.name, "backend": format!("{:?}", info.backend).to_lowercase(), "subgroups": engine.uses_subgroups(),
                         "cooperative_matrices": engine.kernel_report().cooperative_matrices,
                         "cooperative_fallback": engine.kernel_report().cooperative_fallback});

    for (what, _) in [("cold_load", ()), ("cached_load", ())] {
        let t = Instant::now();
        let model = engine.load(&ckpt, &load_options)?;
        println!(
            "{}",
            json!({"bench": what, "load_ms": t.elapsed().as_secs_f64() * 1e3, "converted": model.load_report().converted,
                   "convert_ms": model.load_report().convert_ms, "peak_rss_mib": peak_rss_mib(), "adapter": adapter})
        );
    }
    let model = engine.load(&ckpt, &load_options)?;
    let cfg = model.config().clone();
    // Bytes a token reads: every weight once, plus the K and V written so far.
    let weight_bytes = model.weight_bytes() as f64;
    // Warm-up (first submits and first uses of each pipeline, GPU clocks),
    // not measured: a prompt of two batches (a whole one and the last, with
    // the token choice after it) and steps past the first attention chunk,
    // then a short prompt and steps inside it (the direct attention), each
    // up to 64 steps or half a second (a CPU adapter gets through a step or
    // two). On a fresh machine a 0.5 s warm-up of short steps alone left
    // the first context's figures 30% low (BENCHMARKS.md, 2026-12-05
    // 19:40). (Inside the model's positions, however few.)
    let max_positions = cfg.max_position_embeddings;
    let chunk = ATTENTION_CHUNK as usize;
    for (capacity, prompt) in
        [(PREFILL_BATCH + chunk / 2 + 64, PREFILL_BATCH + chunk / 2), (chunk, chunk / 2)]
    {
        let capacity = capacity.min(max_positions);
        let prompt = prompt.min(capacity - 1).max(1);
        let mut s = session(&model, capacity, args.kv_cache)?;
        s.feed(&(0..prompt as u32).map(|i| i % cfg.vocab_size as u32).collect::<Vec<_>>())?;
        let t = Instant::now();
        for _ in 0..64.min(capacity - prompt) {
            s.next_token()?;
            if t.elapsed().as_secs_f64() > 0.5 {
                break;
            }
        }
    }
    let modes: Vec<Option<&SamplingParams>> =
        std::iter::once(None).chain(args.sampling.as_ref().map(Some)).collect();
    for (&requested, &lookahead) in
        args.contexts.iter().flat_map(|c| args.lookaheads.iter().map(move |l| (c, l)))
    {
        // Room for the timed steps and as many back-to-back ones.
        let extra = args.tokens + 2 * args.timed_steps + 1;
        let ctx = fitted_context(requested, extra, max_positions)?;
        // GPU time per step back to back, and of the token choice alone, per mode.
        let mut costs = Vec::new();
        for &mode in &modes {
            let capacity = ctx + extra;
            let mut s = session(&model, capacity, args.kv_cache)?;
            s.set_lookahead(lookahead);
            if let Some(n) = args.prompt_batch {
                s.set_prompt_batch(n)?;
            }
            if let Some(params) = mode {
                s.set_sampling(params)?;
            }
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
                json!({"bench": "decode", "context": ctx, "context_requested": requested, "tokens": args.tokens, "lookahead": lookahead, "prompt_batch": s.prompt_batch(), "decode_tokens_per_sec": tps,
                   "ms_per_token": 1e3 * secs / args.tokens as f64, "prefill_tokens": ctx, "prefill_ms": prefill_ms,
                   "prefill_tokens_per_sec": ctx as f64 / (prefill_ms / 1e3),
                   "bytes_per_token": weight_bytes + kv, "achieved_gb_per_s": (weight_bytes + kv) * tps / 1e9,
                   "dispatches_per_token": dispatches,
                   "gpu_weight_bytes": model.weight_bytes(), "gpu_session_bytes": s.buffer_bytes(),
                   "step_encode_us": encode_us, "step_gpu_us": gpu_us, "step_wall_us": wall_us,
                   "gpu_us_per_step_back_to_back": back_to_back_us, "adapter": adapter,
                   "sampling": mode.map(sampling_json)})
            );
            // The token choice's launches alone, in sequence (last: the
            // session's results after it are not the model's).
            let choose_us = s.gpu_time_of(|k| chooses_token(k.kernel))?;
            let greedy = SamplingParams::default();
            let choose_launches =
                crate::sampling::plan(mode.unwrap_or(&greedy), cfg.vocab_size as u32, 0, SAMPLE_CHUNK).len();
            costs.push((back_to_back_us, choose_us, choose_launches));
        }
        if let [(Some(greedy), g_choose, g_launches), (Some(sampled), s_choose, s_launches)] = costs[..] {
            println!(
                "{}",
                json!({"bench": "sampling_cost", "context": ctx, "lookahead": lookahead,
                   "sampling": args.sampling.as_ref().map(sampling_json),
                   "greedy_gpu_us_per_step": greedy, "sampled_gpu_us_per_step": sampled,
                   "overhead_pct": 100.0 * (sampled - greedy) / greedy,
                   "greedy_choice_gpu_us": g_choose, "sampled_choice_gpu_us": s_choose,
                   "greedy_choice_launches": g_launches, "sampled_choice_launches": s_launches, "adapter": adapter})
            );
        }
    }
    if let Some(schema) = &args.constraint {
        let dir = args
            .tokenizer
            .as_ref()
            .ok_or_else(|| Error::invalid_argument("--tokenizer", "--constraint needs it"))?;
        let tokenizer = crate::Tokenizer::from_checkpoint(dir)?;
        let schema: serde_json::Value = serde_json::from_slice(&std::fs::read(schema)?)?;
        let t = Instant::now();
        let constraint = crate::Constraint::json_schema(&tokenizer, &schema)?;
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        for &requested in &args.contexts {
            let ctx =
                fitted_context(requested, CONSTRAINED_REPLY_BUDGET.max(args.tokens) + 2, max_positions)?;
            let r = constrained_decode(&model, &constraint, (ctx, args.kv_cache), args.tokens)?;
            println!(
                "{}",
                json!({"bench": "constrained_decode", "context": ctx, "context_requested": requested, "replies": r.replies, "tokens": r.tokens,
                   "constrained_tokens_per_sec": r.constrained, "free_tokens_per_sec": r.free,
                   "free_lookahead1_tokens_per_sec": r.free_lookahead1, "ratio": r.constrained / r.free,
                   "first_compile_ms": compile_ms, "adapter": adapter})
            );
        }
    }
    let mut table = Vec::new();
    for &requested in &args.contexts {
        let ctx = fitted_context(requested, args.tokens + BATCH_MIN_WARM_STEPS + 1, max_positions)?;
        for &n in &args.sessions {
            let r = batched_decode(&model, (ctx, args.kv_cache), n, args.tokens)?;
            let (aggregate, per_session, step_ms) = (r.aggregate, r.per_session, r.step_ms);
            println!(
                "{}",
                json!({"bench": "batched_decode", "context": ctx, "context_requested": requested, "sessions": n, "tokens": args.tokens,
                   "aggregate_tokens_per_sec": aggregate, "per_session_tokens_per_sec": per_session,
                   "ms_per_step": step_ms, "pipelines_wait_ms": r.pipelines_wait_ms, "warm_steps": r.warm_steps,
                   "adapter": adapter})
            );
            table.push((ctx, n, aggregate, per_session, step_ms));
        }
    }
    if !table.is_empty() {
        eprintln!("context  sessions  aggregate tok/s  per-session tok/s  ms/step");
        for (ctx, n, aggregate, per_session, step_ms) in table {
            eprintln!("{ctx:>7}  {n:>8}  {aggregate:>15.0}  {per_session:>17.0}  {step_ms:>7.3}");
        }
    }
    Ok(())
}

/// The context a measurement asked for at `requested` positions runs at,
/// when it adds `extra` positions: `requested`, or the largest context
/// whose `extra` positions still fit the model's `max_positions` (said on
/// stderr). At least one position of context; `invalid_argument` when
/// even that does not fit.
fn fitted_context(requested: usize, extra: usize, max_positions: usize) -> Result<usize> {
    if requested + extra <= max_positions {
        return Ok(requested);
    }
    let fitted = max_positions.saturating_sub(extra);
    if fitted == 0 {
        return Err(Error::invalid_argument(
            "--tokens",
            format!(
                "a measurement adds {extra} positions (the timed tokens and steps), more than the \
                 model's max_position_embeddings ({max_positions}) leave room for"
            ),
        ));
    }
    eprintln!(
        "context {requested} + the {extra} positions a measurement adds exceed max_position_embeddings \
         ({max_positions}): measuring at context {fitted}"
    );
    Ok(fitted)
}

/// Tokens a constrained reply may take before it counts as incomplete.
const CONSTRAINED_REPLY_BUDGET: usize = 512;

/// Steps a batch takes at most before it is timed (it stops after
/// [`BATCH_WARM_SECS`], having taken at least [`BATCH_MIN_WARM_STEPS`]).
const BATCH_WARM_STEPS: usize = 64;
/// Steps a batch takes at least before it is timed.
const BATCH_MIN_WARM_STEPS: usize = 2;
/// How long a batch steps before it is timed: the GPU's clocks fall while
/// the host waits (a fresh process's first batch ran at half its speed).
const BATCH_WARM_SECS: f64 = 0.5;

/// Rates of [`constrained_decode`], tokens/s.
struct ConstrainedRates {
    replies: usize,
    tokens: usize,
    constrained: f64,
    free: f64,
    free_lookahead1: f64,
}

/// Greedy replies under `constraint` after a `ctx`-token prompt, until at
/// least `tokens` tokens (each reply until complete), against as many free
/// tokens (default lookahead, and lookahead 1) on the same session.
fn constrained_decode(
    model: &crate::Model,
    constraint: &crate::Constraint,
    (ctx, kv): (usize, KvFormat),
    tokens: usize,
) -> Result<ConstrainedRates> {
    let budget = CONSTRAINED_REPLY_BUDGET;
    let mut s = session(model, ctx + budget.max(tokens) + 2, kv)?;
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| (i * 7919) % model.config().vocab_size as u32).collect();
    s.feed(&prompt[..ctx - 1])?;
    // One reply from the last prompt token; returns its token count.
    let reply = |s: &mut crate::Session, c: Option<&crate::Constraint>, n: usize| -> Result<usize> {
        s.truncate(ctx - 1)?;
        s.set_constraint(c)?;
        s.feed(&prompt[ctx - 1..])?;
        let mut count = 1;
        while count < n && !s.constraint_complete() {
            s.next_token()?;
            count += 1;
        }
        Ok(count)
    };
    reply(&mut s, Some(constraint), budget)?; // warm-up
    let (mut replies, mut done) = (0, 0);
    let t = Instant::now();
    while done < tokens {
        done += reply(&mut s, Some(constraint), budget)?;
        replies += 1;
    }
    let constrained = done as f64 / t.elapsed().as_secs_f64();
    let per_reply = done.div_ceil(replies);
    let mut free = |lookahead: usize| -> Result<f64> {
        s.set_lookahead(lookahead);
        let t = Instant::now();
        let mut n = 0;
        for _ in 0..replies {
            n += reply(&mut s, None, per_reply)?;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    };
    let free_default = free(crate::session::DEFAULT_LOOKAHEAD)?;
    let free_lookahead1 = free(1)?;
    Ok(ConstrainedRates { replies, tokens: done, constrained, free: free_default, free_lookahead1 })
}

/// A session of `capacity` positions over a KV cache in `kv`.
fn session(model: &crate::Model, capacity: usize, kv: KvFormat) -> Result<crate::Session> {
    model.session_with(&crate::SessionOptions::default().capacity(capacity).kv_cache(kv))
}

/// Decodes `n` sessions together through a batch: each fed its own
/// `ctx`-token prompt, then `tokens` batch steps timed, once the batch's
/// pipelines are ready ([`crate::Batch::pipelines_ready`]) and after up to
/// [`BATCH_WARM_STEPS`] untimed ones.
fn batched_decode(
    model: &crate::Model,
    (ctx, kv): (usize, KvFormat),
    n: usize,
    tokens: usize,
) -> Result<BatchedRates> {
    // Room for the timed steps, and for the warm-up's (taken back after
    // it) as far as the model's positions allow (the context leaves room
    // for at least BATCH_MIN_WARM_STEPS).
    let max_positions = model.config().max_position_embeddings;
    let capacity = (ctx + tokens.max(BATCH_WARM_STEPS) + 1)
        .min(max_positions)
        .max(ctx + tokens + BATCH_MIN_WARM_STEPS + 1);
    let warm = BATCH_WARM_STEPS.min(capacity - ctx - 1);
    let options = crate::BatchOptions::default().slots(n).capacity_per_slot(capacity).kv_cache(kv);
    let mut batch = model.batch(&options)?;
    let vocab = model.config().vocab_size as u32;
    let mut sessions = Vec::with_capacity(n);
    let mut last_ids = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = batch.session()?;
        let prompt: Vec<u32> = (0..ctx as u32).map(|t| (t * 7919 + i as u32 * 104_729) % vocab).collect();
        s.feed(&prompt)?;
        sessions.push(s);
        last_ids.push(prompt[ctx - 1]);
    }
    let mut rows: Vec<&mut crate::Session> = sessions.iter_mut().collect();
    let t = Instant::now();
    batch.debug_wait_for_pipelines();
    let pipelines_wait_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let mut warm_steps = 0;
    while warm_steps < warm {
        batch.step(&mut rows)?;
        warm_steps += 1;
        if warm_steps >= BATCH_MIN_WARM_STEPS && t.elapsed().as_secs_f64() > BATCH_WARM_SECS {
            break;
        }
    }
    // Back to the context asked for: the prompt again from its last id.
    for (s, &id) in rows.iter_mut().zip(&last_ids) {
        s.truncate(ctx - 1)?;
        s.feed(&[id])?;
    }
    let t = Instant::now();
    for _ in 0..tokens {
        batch.step(&mut rows)?;
    }
    let secs = t.elapsed().as_secs_f64();
    let per_session = tokens as f64 / secs;
    Ok(BatchedRates {
        aggregate: per_session * n as f64,
        per_session,
        step_ms: 1e3 * secs / tokens as f64,
        pipelines_wait_ms,
        warm_steps,
    })
}

/// What [`batched_decode`] measured.
struct BatchedRates {
    /// Tokens/s of all sessions together.
    aggregate: f64,
    /// Tokens/s of each session.
    per_session: f64,
    /// Milliseconds a timed step took.
    step_ms: f64,
    /// How long the batch's pipelines took to be ready after its sessions'
    /// prompts were fed ([`crate::Batch::pipelines_ready`]).
    pipelines_wait_ms: f64,
    /// Untimed steps taken before timing.
    warm_steps: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A context near the model's limit is measured at the largest one
    /// that fits; one that leaves no room at all is a named error.
    #[test]
    fn contexts_at_the_models_limit_fit_its_positions() {
        assert_eq!(fitted_context(128, 40, 4096).unwrap(), 128);
        assert_eq!(fitted_context(4056, 40, 4096).unwrap(), 4056);
        assert_eq!(fitted_context(4096, 40, 4096).unwrap(), 4056);
        assert_eq!(fitted_context(32768, 545, 32768).unwrap(), 32223);
        let e = fitted_context(8, 4096, 4096).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        assert!(e.to_string().contains("max_position_embeddings (4096)"), "{e}");
    }

    #[test]
    fn options_parse_both_forms_and_name_bad_ones() {
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o = BenchOptions::parse(args("--contexts 16,32 --tokens=4 --backend portable")).unwrap();
        assert_eq!(o.contexts, [16, 32]);
        assert_eq!(o.tokens, 4);
        assert_eq!(o.backend, Some(AdapterPolicy::Portable));
        assert_eq!(o.lookaheads, BenchOptions::default().lookaheads);
        assert!(o.sessions.is_empty());
        assert_eq!(BenchOptions::parse(args("--sessions 1,4,8,16")).unwrap().sessions, [1, 4, 8, 16]);
        assert_eq!(BenchOptions::parse(args("--weights int4")).unwrap().weights, Some(WeightFormat::Int4));
        assert_eq!(BenchOptions::default().weights, None);
        assert_eq!(BenchOptions::parse(args("--kv-cache INT8")).unwrap().kv_cache, KvFormat::Int8);
        assert_eq!(BenchOptions::default().kv_cache, KvFormat::F16);
        assert_eq!(BenchOptions::parse(args("--prompt-batch 64")).unwrap().prompt_batch, Some(64));
        assert_eq!(BenchOptions::default().prompt_batch, None);
        let o = BenchOptions::parse(args("--sampling 0.7,20,0.95")).unwrap();
        assert_eq!(
            o.sampling,
            Some(SamplingParams::default().temperature(0.7).top_k(20).top_p(0.95).seed(1))
        );
        let bad_ones = [
            "--tokens x",
            "--frobnicate 1",
            "--contexts",
            "--sampling 0.7,20",
            "--sampling -1,0,1",
            "--sessions 4,0",
            "--contexts 128,0",
            "--weights int5",
            "--kv-cache int4",
            "--prompt-batch x",
        ];
        for bad in bad_ones {
            let e = BenchOptions::parse(args(bad)).unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{bad}: {e}");
        }
    }

    /// The token choice's GPU time counts every launch of every plan (the
    /// two-launch path's and the log-probabilities' included), and nothing
    /// of the forward pass.
    #[test]
    fn the_choice_cost_counts_every_choice_launch() {
        let d = SamplingParams::default;
        let sets = [
            d(),
            d().repetition_penalty(1.2),
            d().temperature(0.6).top_k(20).top_p(0.95),
            d().temperature(0.6).top_p(0.95),
            d().temperature(0.6).top_k(500).top_p(0.95).min_p(0.1),
        ];
        for params in &sets {
            for logprobs in [0, 5] {
                for l in crate::sampling::plan_with_logprobs(params, 151_936, 64, SAMPLE_CHUNK, logprobs) {
                    assert!(chooses_token(l.kernel), "{:?} of {params:?}", l.kernel);
                }
            }
        }
        assert!(!chooses_token(Kernel::Int8MatvecNorm) && !chooses_token(Kernel::AttentionStep));
    }
}
