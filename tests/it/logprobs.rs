//! Log-probabilities on the GPU (WGSL on lavapipe): the top-N tokens and
//! the chosen token's log-probability of the raw distribution,
//! log_softmax(logits) before penalties and temperature, against the CPU
//! (f64) log_softmax of the GPU's own logits, greedy and sampled, at every
//! lookahead; no launch when off; ties listed by lowest id.
//!
//! Tolerance: 1e-4 absolute. The GPU computes l - log(sum exp(l)) in f32
//! from per-chunk maxima and sums of exponentials; the sum's relative
//! error is a few f32 ulps per term added (~1e-6 over 4,096-logit chunks),
//! and l and the log-sum are below ~50 in magnitude, so the error is
//! ~1e-5 at most; a wrong normaliser or a wrong token is off by far more.

use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::gpu::UniformPages;
use qwen3_wgpu::internals::kernels::sample::{scratch_words, LOGPROB_RECORD_WORDS};
use qwen3_wgpu::internals::kernels::{Kernel, KernelChoice, Kernels, Launch};
use qwen3_wgpu::internals::reference::{poisoned, POISON};
use qwen3_wgpu::internals::sampling::plan_with_logprobs;
use qwen3_wgpu::internals::self_check;
use qwen3_wgpu::{AdapterPolicy, CachePolicy, Gpu, LoadOptions, Model, SamplingParams, TokenLogprobs};

const TOLERANCE: f64 = 1e-4;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64")
}

fn model() -> Model {
    let engine = crate::support::engine();
    let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
    engine.load(fixture_dir(), &options).unwrap()
}

/// A prompt of the fixture's vocabulary with repeats (for the penalties).
const PROMPT: [u32; 10] = [851, 720, 591, 720, 110, 800, 753, 591, 720, 42];

/// log_softmax of `logits` in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f64::MIN, |m, &l| m.max(l as f64));
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// The `n` most likely ids: by logit, descending, ties by lowest id.
fn top_ids(logits: &[f32], n: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    order.truncate(n);
    order
}

/// `lp` is the reference's for `token` drawn from `raw` (the logits before
/// any penalty), with `n` entries.
fn check(lp: &TokenLogprobs, token: u32, raw: &[f32], n: usize, what: &str) {
    let want = log_softmax(raw);
    assert_eq!(lp.token, token, "{what}: the record's token");
    let err = (lp.logprob as f64 - want[token as usize]).abs();
    assert!(err < TOLERANCE, "{what}: token {token}: {} vs {}", lp.logprob, want[token as usize]);
    let ids: Vec<u32> = lp.top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, top_ids(raw, n), "{what}: top ids");
    for &(id, logprob) in &lp.top {
        let err = (logprob as f64 - want[id as usize]).abs();
        assert!(err < TOLERANCE, "{what}: id {id}: {logprob} vs {}", want[id as usize]);
    }
}

/// The logits after `context` (a fresh greedy session's: the raw ones).
fn raw_logits_after(model: &Model, context: &[u32]) -> Vec<f32> {
    let mut s = model.session_with_capacity(64).unwrap();
    s.feed(context).unwrap();
    s.debug_logits().unwrap()
}

/// Greedy: the token is the argmax, and every step's log-probabilities
/// are log_softmax of that step's logits.
#[test]
fn greedy_logprobs_match_log_softmax() {
    let model = model();
    let mut s = model.session_with_capacity(48).unwrap();
    s.set_lookahead(1);
    assert!(s.last_logprobs().is_none());
    s.set_logprobs(5).unwrap();
    let mut token = s.feed(&PROMPT).unwrap();
    for step in 0..6 {
        // Lookahead 1: nothing runs past the step just returned.
        let logits = s.debug_logits().unwrap();
        assert_eq!(top_ids(&logits, 1)[0], token, "step {step}: greedy");
        check(s.last_logprobs().unwrap(), token, &logits, 5, &format!("step {step}"));
        token = s.next_token().unwrap();
    }
}

/// Sampled with penalties (which edit the logits in place): the
/// log-probabilities are still those of the raw logits, for the token
/// drawn; the same at every lookahead.
#[test]
fn sampled_logprobs_are_of_the_raw_distribution() {
    let model = model();
    let params =
        SamplingParams::default().temperature(0.9).top_k(20).top_p(0.9).repetition_penalty(1.4).seed(11);
    let run = |lookahead: usize, n: u32| -> Vec<(u32, TokenLogprobs)> {
        let mut s = model.session_with_capacity(48).unwrap();
        s.set_lookahead(lookahead);
        s.set_sampling(&params).unwrap();
        s.set_logprobs(n).unwrap();
        let mut out = vec![(s.feed(&PROMPT).unwrap(), s.last_logprobs().unwrap().clone())];
        for _ in 0..7 {
            let token = s.next_token().unwrap();
            out.push((token, s.last_logprobs().unwrap().clone()));
        }
        out
    };
    let steps = run(4, 20);
    let mut context = PROMPT.to_vec();
    for (i, (token, lp)) in steps.iter().enumerate() {
        let raw = raw_logits_after(&model, &context);
        check(lp, *token, &raw, 20, &format!("step {i}"));
        context.push(*token);
    }
    for lookahead in [1, 2, 8] {
        assert_eq!(run(lookahead, 20), steps, "lookahead {lookahead}");
    }
    // The logprobs do not change the tokens drawn.
    let mut plain = model.session_with_capacity(48).unwrap();
    plain.set_sampling(&params).unwrap();
    let mut tokens = vec![plain.feed(&PROMPT).unwrap()];
    for _ in 0..7 {
        tokens.push(plain.next_token().unwrap());
    }
    assert_eq!(tokens, steps.iter().map(|(t, _)| *t).collect::<Vec<_>>());
}

/// Off by default and after `set_logprobs(0)`: no launch and no record;
/// on: two launches more per step. Above 20: refused by name, the session
/// as it was.
#[test]
fn logprobs_off_costs_nothing_and_bad_counts_are_refused() {
    let model = model();
    let mut s = model.session_with_capacity(32).unwrap();
    let base = s.dispatches_per_token();
    s.set_logprobs(3).unwrap();
    assert_eq!(s.dispatches_per_token(), base + 2);
    let e = s.set_logprobs(21).unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    assert!(e.to_string().contains("logprobs"), "{e}");
    let token = s.feed(&PROMPT).unwrap();
    assert_eq!(s.last_logprobs().unwrap().top.len(), 3, "still 3 after the refusal");
    assert_eq!(s.last_logprobs().unwrap().token, token);
    s.set_logprobs(0).unwrap();
    assert_eq!(s.dispatches_per_token(), base);
    assert!(s.last_logprobs().is_none());
    s.next_token().unwrap();
    assert!(s.last_logprobs().is_none());
}

/// The kernels alone at awkward sizes, with the N-th place tied across
/// chunks: the ties listed are the lowest ids, the values the reference's.
#[test]
fn ties_at_the_last_place_are_the_lowest_ids() {
    let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
    let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, self_check::CHECKER).unwrap();
    assert!(kernels.report.self_check.ok, "{}", kernels.report.self_check.describe_failures());
    for (n, chunk, top_n) in
        [(3001usize, 256u32, 20u32), (3001, 1024, 1), (777, 128, 7), (9000, 4096, 20), (15, 256, 20)]
    {
        // A coarse grid: every value tied many times, across chunks.
        let logits: Vec<f32> = (0..n).map(|i| ((i * 7919) % 23) as f32 * 0.5 - 3.0).collect();
        let record = record(&gpu, &kernels, &logits, chunk, top_n);
        let entries = record[2] as usize;
        let lp = TokenLogprobs::from_record(&record);
        assert_eq!(entries, (top_n as usize).min(n), "n {n} N {top_n}");
        check(&lp, top_ids(&logits, 1)[0], &logits, entries, &format!("n {n} chunk {chunk} N {top_n}"));
    }
}

fn whole(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    b.as_entire_binding()
}

/// The greedy token choice with `top_n` log-probabilities over `logits`:
/// the record at the chosen token's position.
fn record(gpu: &Gpu, kernels: &Kernels, logits: &[f32], chunk: u32, top_n: u32) -> Vec<u32> {
    use wgpu::util::DeviceExt;
    let storage = |data: &[u8]| {
        gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: data,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        })
    };
    let n = logits.len() as u32;
    let n_tokens = 4usize;
    let pos = 1usize;
    let logits_buf = storage(bytemuck::cast_slice(logits));
    let tokens = storage(&poisoned(n_tokens));
    let step = storage(bytemuck::cast_slice(&[pos as u32, 0]));
    let scratch = storage(&poisoned(scratch_words(n, chunk)));
    let raw = storage(&poisoned(n as usize));
    let records = storage(&poisoned(n_tokens * LOGPROB_RECORD_WORDS as usize));
    let slots = (n as usize).div_ceil(256) + 64;
    let (part_val, part_idx) = (storage(&poisoned(slots)), storage(&poisoned(slots)));
    let mut uniforms = UniformPages::new(gpu);
    let launches: Vec<Launch> =
        plan_with_logprobs(&SamplingParams::default(), n, n_tokens as u32, chunk, top_n)
            .into_iter()
            .map(|l| {
                let (page, offset, size) = uniforms.push(gpu, &l.params);
                let u = wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &page,
                    offset,
                    size: wgpu::BufferSize::new(size),
                });
                let bufs = match l.kernel {
                    Kernel::SampleTopk => vec![u, whole(&logits_buf), whole(&scratch), whole(&raw)],
                    Kernel::ArgmaxPartial => vec![u, whole(&logits_buf), whole(&part_val), whole(&part_idx)],
                    Kernel::ArgmaxFinal => {
                        vec![u, whole(&part_val), whole(&part_idx), whole(&tokens), whole(&step)]
                    }
                    Kernel::LogprobFinal => vec![
                        u,
                        whole(&logits_buf),
                        whole(&scratch),
                        whole(&tokens),
                        whole(&step),
                        whole(&records),
                    ],
                    other => panic!("{other:?} in the plan"),
                };
                Launch::new(gpu, kernels, l.kernel, &bufs, l.workgroups)
            })
            .collect();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        for l in &launches {
            l.record(&mut pass, kernels);
        }
    }
    gpu.queue.submit([enc.finish()]);
    let words: Vec<u32> =
        bytemuck::pod_collect_to_vec(&gpu.download(&records, records.size() as usize).unwrap());
    let rw = LOGPROB_RECORD_WORDS as usize;
    let rec = words[(pos + 1) * rw..(pos + 2) * rw].to_vec();
    assert_ne!(rec[0], POISON, "no record at the chosen token's position");
    assert!(words[..(pos + 1) * rw].iter().all(|&w| w == POISON), "wrote before the record");
    rec
}

/// `GenerateOptions::logprobs`: one record per generated token, each the
/// session's; more than 20 is refused before any work.
#[test]
fn generate_returns_logprobs_per_token() {
    use qwen3_wgpu::GenerateOptions;
    let model = model();
    let params = SamplingParams::default().temperature(0.7).top_k(20).seed(5);
    let options = GenerateOptions::default().max_new_tokens(6).sampling(params.clone()).logprobs(2);
    let out = model.generate_with(&PROMPT, &options, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(out.logprobs.len(), out.generated_ids().len());
    let mut s = model.session_with_capacity(32).unwrap();
    s.set_sampling(&params).unwrap();
    s.set_logprobs(2).unwrap();
    let mut want = vec![(s.feed(&PROMPT).unwrap(), s.last_logprobs().unwrap().clone())];
    while want.len() < 6 {
        want.push((s.next_token().unwrap(), s.last_logprobs().unwrap().clone()));
    }
    let got: Vec<(u32, TokenLogprobs)> =
        out.generated_ids().iter().copied().zip(out.logprobs.iter().cloned()).collect();
    assert_eq!(got, want);
    assert!(model.generate(&PROMPT, 3, |_| {}).unwrap().logprobs.is_empty());
    let e = model
        .generate_with(&PROMPT, &options.logprobs(21), |_| std::ops::ControlFlow::Continue(()))
        .unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    assert!(e.to_string().contains("logprobs"), "{e}");
}
