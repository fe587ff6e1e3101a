//! Sampling on the GPU (WGSL on lavapipe): the sampler kernels against the
//! CPU reference (src/reference.rs) at awkward sizes, the distribution of
//! the sampled token over many seeds (2,400 per parameter set) against the reference's by a
//! chi-square test on a small model's own logits, the penalties' edits, the
//! same tokens at every lookahead, and the greedy path unchanged.

use std::path::{Path, PathBuf};

use qwen3_wgpu::internals::gpu::UniformPages;
use qwen3_wgpu::internals::kernels::sample::{part_slots, parts, scratch_words};
use qwen3_wgpu::internals::kernels::SAMPLE_TOP_K_MAX;
use qwen3_wgpu::internals::kernels::{Kernel, KernelChoice, Kernels, Launch, SAMPLE_CHUNK};
use qwen3_wgpu::internals::reference::{
    chi_square, chi_square_critical_1e3, draw_hash, gumbel_noise, penalize_ref, poisoned, sample_probs_ref,
    sort_key, uniform_draw, POISON,
};
use qwen3_wgpu::internals::sampling::{plan, plan_radix, PlannedLaunch};
use qwen3_wgpu::internals::self_check;
use qwen3_wgpu::{AdapterPolicy, CachePolicy, Gpu, LoadOptions, Model, SamplingParams};

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

/// The sampler's launches on buffers of their own: the logits and the
/// token sequence given, reset before every draw.
struct Rig {
    gpu: Gpu,
    kernels: Kernels,
}

/// What a run of draws leaves: the drawn tokens, the final state slot's
/// threshold key of the last draw, and the buffers checked for stray writes.
struct Draws {
    tokens: Vec<u32>,
    theta: u32,
    /// The token sequence after the last draw.
    sequence: Vec<u32>,
    /// The logits after the last draw (edited by the penalties).
    logits: Vec<f32>,
}

impl Rig {
    fn new() -> Self {
        let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
        // The start-up self-check runs the sampler too: it must pass.
        let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, self_check::CHECKER).unwrap();
        assert!(kernels.report.self_check.ok, "{}", kernels.report.self_check.describe_failures());
        Rig { gpu, kernels }
    }

    fn storage(&self, label: &str, data: &[u8]) -> wgpu::Buffer {
        use wgpu::util::DeviceExt;
        self.gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: data,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        })
    }

    /// One draw per seed from `logits` at position `sequence.len() - 1`
    /// of the token sequence `sequence` (the penalties' window), `chunk`
    /// logits per workgroup, on the path [`plan`] picks. Outputs start
    /// poisoned.
    fn draws(
        &self,
        logits: &[f32],
        sequence: &[u32],
        params: &SamplingParams,
        seeds: std::ops::Range<u64>,
        chunk: u32,
    ) -> Draws {
        self.draws_planned(logits, sequence, params, seeds, chunk, plan)
    }

    /// [`Rig::draws`] with the launches of `planner` (`plan` or `plan_radix`).
    fn draws_planned(
        &self,
        logits: &[f32],
        sequence: &[u32],
        params: &SamplingParams,
        seeds: std::ops::Range<u64>,
        chunk: u32,
        planner: Planner,
    ) -> Draws {
        let gpu = &self.gpu;
        let n = logits.len() as u32;
        let n_tokens = sequence.len() + 3;
        let pos = sequence.len() - 1;
        let mut tokens = vec![POISON; n_tokens];
        tokens[..sequence.len()].copy_from_slice(sequence);
        let pristine_logits = self.storage("logits0", bytemuck::cast_slice(logits));
        let logits_buf = self.storage("logits", bytemuck::cast_slice(logits));
        let pristine_tokens = self.storage("tokens0", bytemuck::cast_slice(&tokens));
        let tokens_buf = self.storage("tokens", bytemuck::cast_slice(&tokens));
        let pristine_step = self.storage("step0", bytemuck::cast_slice(&[pos as u32, 0]));
        let step = self.storage("step", bytemuck::cast_slice(&[pos as u32, 0]));
        let scratch = self.storage("scratch", &poisoned(scratch_words(n, chunk)));
        let slots = part_slots(n, chunk);
        let part_val = self.storage("part_val", &poisoned(slots));
        let part_idx = self.storage("part_idx", &poisoned(slots));
        let count = (seeds.end - seeds.start) as usize;
        let out = self.storage("out", &poisoned(count));
        let mut uniforms = UniformPages::new(gpu);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        for (i, seed) in seeds.enumerate() {
            enc.copy_buffer_to_buffer(&pristine_logits, 0, &logits_buf, 0, logits_buf.size());
            enc.copy_buffer_to_buffer(&pristine_tokens, 0, &tokens_buf, 0, tokens_buf.size());
            enc.copy_buffer_to_buffer(&pristine_step, 0, &step, 0, step.size());
            let launches: Vec<Launch> = planner(&params.clone().seed(seed), n, n_tokens as u32, chunk)
                .into_iter()
                .map(|l| {
                    let (page, offset, size) = uniforms.push(gpu, &l.params);
                    let u = wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &page,
                        offset,
                        size: wgpu::BufferSize::new(size),
                    });
                    let bufs = match l.kernel {
                        Kernel::SamplePenalty => {
                            vec![u, whole(&tokens_buf), whole(&step), whole(&logits_buf)]
                        }
                        Kernel::SampleMax => vec![u, whole(&logits_buf), whole(&scratch)],
                        Kernel::SampleSelect => vec![
                            u,
                            whole(&logits_buf),
                            whole(&scratch),
                            whole(&step),
                            whole(&part_val),
                            whole(&part_idx),
                        ],
                        Kernel::SampleTopk => {
                            // `raw` is written only with the logprobs' flag.
                            vec![u, whole(&logits_buf), whole(&scratch), whole(&part_val)]
                        }
                        Kernel::SampleTopkFinal => {
                            vec![u, whole(&logits_buf), whole(&scratch), whole(&tokens_buf), whole(&step)]
                        }
                        Kernel::ArgmaxPartial => {
                            vec![u, whole(&logits_buf), whole(&part_val), whole(&part_idx)]
                        }
                        Kernel::ArgmaxFinal => {
                            vec![u, whole(&part_val), whole(&part_idx), whole(&tokens_buf), whole(&step)]
                        }
                        other => panic!("{other:?} in the plan"),
                    };
                    Launch::new(gpu, &self.kernels, l.kernel, &bufs, l.workgroups)
                })
                .collect();
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for l in &launches {
                    l.record(&mut pass, &self.kernels);
                }
            }
            enc.copy_buffer_to_buffer(&tokens_buf, 4 * (pos as u64 + 1), &out, 4 * i as u64, 4);
            if i % 256 == 255 {
                let done =
                    std::mem::replace(&mut enc, gpu.device.create_command_encoder(&Default::default()));
                gpu.queue.submit([done.finish()]);
            }
        }
        gpu.queue.submit([enc.finish()]);
        let words = |b: &wgpu::Buffer, n: usize| -> Vec<u32> {
            bytemuck::pod_collect_to_vec(&gpu.download(b, 4 * n).unwrap())
        };
        let passes = planner(params, n, n_tokens as u32, chunk)
            .iter()
            .filter(|l| l.kernel == Kernel::SampleSelect)
            .count();
        let scratch_now = words(&scratch, scratch_words(n, chunk));
        let theta = if passes > 0 { scratch_now[parts(n, chunk) as usize + (passes - 1) * 8 + 4] } else { 0 };
        Draws {
            tokens: words(&out, count),
            theta,
            sequence: words(&tokens_buf, n_tokens),
            logits: bytemuck::cast_slice(&words(&logits_buf, n as usize)).to_vec(),
        }
    }
}

/// Plans the token choice: [`plan`] or [`plan_radix`].
type Planner = fn(&SamplingParams, u32, u32, u32) -> Vec<PlannedLaunch>;

fn whole(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    b.as_entire_binding()
}

/// Counts of each token among `tokens`.
fn histogram(tokens: &[u32], n: usize) -> Vec<u64> {
    let mut counts = vec![0u64; n];
    for &t in tokens {
        assert!((t as usize) < n, "drew {t}, outside the vocabulary of {n}");
        counts[t as usize] += 1;
    }
    counts
}

/// Logits with awkward features: `n` values on a coarse grid (many ties),
/// the top value tied three times.
fn awkward_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as u32 % 64;
            r as f32 * 0.125 - 4.0
        })
        .collect();
    for i in [3, n / 2, n - 1] {
        v[i] = 4.5;
    }
    v
}

/// The radix path: top-k's and top-p's thresholds are the reference's exactly (keys), at
/// vocabularies that are not a multiple of the chunk, with ties at the
/// threshold; every draw is a kept token; only tokens[pos + 1] is written.
#[test]
fn thresholds_and_draws_match_the_reference_at_awkward_sizes() {
    let rig = Rig::new();
    for (n, chunk) in [(777usize, 128u32), (1000, 256), (3001, 1024), (300, 2048)] {
        let logits = awkward_logits(n, n as u64);
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for k in [1u32, 2, 3, 4, 17, 200] {
            let params = SamplingParams::default().temperature(0.9).top_k(k);
            let d = rig.draws_planned(&logits, &[5, 6], &params, 0..40, chunk, plan_radix);
            assert_eq!(d.theta, sort_key(sorted[k as usize - 1]), "n {n} chunk {chunk} k {k}: threshold");
            let probs = sample_probs_ref(&logits, 0.9, k, 1.0, 0.0);
            for &t in &d.tokens {
                assert!(probs[t as usize] > 0.0, "n {n} k {k}: drew {t}, which top-k drops");
            }
            assert_eq!(&d.sequence[..2], &[5, 6]);
            assert_eq!(&d.sequence[3..], &[POISON, POISON], "n {n} k {k}: wrote past tokens[pos + 1]");
        }
        for (k, p) in [(0u32, 0.5f32), (0, 0.9), (50, 0.7), (0, 1e-6)] {
            let params = SamplingParams::default().temperature(0.7).top_k(k).top_p(p);
            let d = rig.draws_planned(&logits, &[5, 6], &params, 0..40, chunk, plan_radix);
            let probs = sample_probs_ref(&logits, 0.7, k, p, 0.0);
            let kept_min =
                (0..n).filter(|&i| probs[i] > 0.0).map(|i| logits[i]).fold(f32::INFINITY, f32::min);
            assert_eq!(d.theta, sort_key(kept_min), "n {n} chunk {chunk} k {k} p {p}: threshold");
            for &t in &d.tokens {
                assert!(probs[t as usize] > 0.0, "n {n} k {k} p {p}: drew {t}, which the filters drop");
            }
        }
        let params = SamplingParams::default().temperature(0.5).min_p(0.3);
        let d = rig.draws_planned(&logits, &[5, 6], &params, 0..40, chunk, plan_radix);
        let probs = sample_probs_ref(&logits, 0.5, 0, 1.0, 0.3);
        assert!(d.tokens.iter().all(|&t| probs[t as usize] > 0.0), "n {n}: min-p");
    }
}

/// The kernels of a plan, in order.
fn kernels_of(launches: &[PlannedLaunch]) -> Vec<Kernel> {
    launches.iter().map(|l| l.kernel).collect()
}

/// Every token drawn is one the reference keeps; only tokens[pos + 1] is
/// written.
fn assert_kept(d: &Draws, probs: &[f64], what: &str) {
    for &t in &d.tokens {
        assert!(probs[t as usize] > 0.0, "{what}: drew {t}, which the filters drop");
    }
    assert_eq!(&d.sequence[..2], &[5, 6], "{what}");
    assert_eq!(&d.sequence[3..], &[POISON, POISON], "{what}: wrote past tokens[pos + 1]");
}

/// The two-launch top-k path keeps the reference's set (ties at the k-th
/// place all kept, across chunks that could not list them all) and draws,
/// seed for seed, the radix path's token (whose thresholds the test above
/// checks against the reference), at vocabularies that are not a multiple
/// of the chunk, k from 1 to SAMPLE_TOP_K_MAX, with top-p and min-p.
#[test]
fn top_k_path_draws_what_the_radix_path_draws() {
    let rig = Rig::new();
    let sets = [
        (0.9, 1, 1.0, 0.0),
        (0.9, 2, 1.0, 0.0),
        (0.9, 3, 1.0, 0.0),
        (0.9, 4, 1.0, 0.0),
        (0.9, 17, 1.0, 0.0),
        (0.6, 20, 0.95, 0.0),
        (0.7, 50, 0.7, 0.0),
        (0.7, 20, 1e-6, 0.0),
        (1.0, 40, 1.0, 0.3),
        (2.0, 100, 0.9, 0.0),
        (0.8, SAMPLE_TOP_K_MAX, 0.5, 0.05),
    ];
    for (n, chunk) in [(777usize, 128u32), (1000, 256), (3001, 1024), (9000, 4096), (5000, 2048)] {
        let logits = awkward_logits(n, n as u64);
        for (t, k, p, min_p) in sets {
            let params = SamplingParams::default().temperature(t).top_k(k).top_p(p).min_p(min_p);
            let what = format!("n {n} chunk {chunk} {params:?}");
            let fast = plan(&params, n as u32, 8, chunk);
            assert_eq!(kernels_of(&fast), [Kernel::SampleTopk, Kernel::SampleTopkFinal], "{what}");
            let d = rig.draws(&logits, &[5, 6], &params, 0..24, chunk);
            let radix = rig.draws_planned(&logits, &[5, 6], &params, 0..24, chunk, plan_radix);
            assert_kept(&d, &sample_probs_ref(&logits, t, k, p, min_p), &what);
            assert_eq!(d.tokens, radix.tokens, "{what}: top-k path vs radix path");
        }
    }
}

/// Logits with fewer distinct values than k, and a top value tied across
/// every chunk far more times than k: top-k keeps the whole tie group
/// (chunks list only k of theirs), and the draws are uniform over it by a
/// chi-square test (they would fall on the listed few otherwise).
#[test]
fn top_k_path_keeps_whole_tie_groups() {
    let rig = Rig::new();
    let n = 1000;
    let logits: Vec<f32> = (0..n).map(|i| [0.0f32, 1.0, 0.5, 2.0, 0.0, 1.0, 0.5][i % 7]).collect();
    for k in [5u32, 20, SAMPLE_TOP_K_MAX] {
        let params = SamplingParams::default().temperature(0.8).top_k(k);
        let what = format!("k {k}");
        let d = rig.draws(&logits, &[5, 6], &params, 0..3000, 128);
        let probs = sample_probs_ref(&logits, 0.8, k, 1.0, 0.0);
        assert_kept(&d, &probs, &what);
        let kept = probs.iter().filter(|&&p| p > 0.0).count();
        assert_eq!(kept, n / 7 + 1, "{what}: the reference keeps the top group");
        let (stat, df) = chi_square(&histogram(&d.tokens, n), &probs);
        assert!(df >= 100, "{what}: {df} degrees of freedom");
        assert!(stat < chi_square_critical_1e3(df), "{what}: chi-square {stat:.1} ({df} degrees of freedom)");
        let radix = rig.draws_planned(&logits, &[5, 6], &params, 0..200, 128, plan_radix);
        assert_eq!(&d.tokens[..200], &radix.tokens[..], "{what}: top-k path vs radix path");
    }
    // k greater than the number of distinct values (4): the k-th largest
    // is a lower group, kept whole.
    let few: Vec<f32> = (0..300).map(|i| (i % 4) as f32 * 0.25).collect();
    let params = SamplingParams::default().temperature(0.5).top_k(100);
    let d = rig.draws(&few, &[5, 6], &params, 0..400, 128);
    let probs = sample_probs_ref(&few, 0.5, 100, 1.0, 0.0);
    assert_eq!(probs.iter().filter(|&&p| p > 0.0).count(), 150);
    assert_kept(&d, &probs, "few values");
    let radix = rig.draws_planned(&few, &[5, 6], &params, 0..400, 128, plan_radix);
    assert_eq!(d.tokens, radix.tokens, "few values: top-k path vs radix path");
}

/// Chunks where far more logits than fit the candidate lists reach the
/// chunk's bound (585 ties at the top of each 4,096-logit chunk): each
/// chunk takes its radix select and, for the larger k, so does the merge;
/// the draws are the radix path's, seed for seed.
#[test]
fn top_k_path_with_more_ties_than_candidate_slots() {
    let rig = Rig::new();
    let n = 9000;
    let logits: Vec<f32> = (0..n).map(|i| [0.0f32, 1.0, 0.5, 2.0, 0.0, 1.0, 0.5][i % 7]).collect();
    for k in [5u32, 20, 100, SAMPLE_TOP_K_MAX] {
        let params = SamplingParams::default().temperature(0.8).top_k(k).top_p(0.9);
        let what = format!("k {k}");
        let d = rig.draws(&logits, &[5, 6], &params, 0..200, 4096);
        assert_kept(&d, &sample_probs_ref(&logits, 0.8, k, 0.9, 0.0), &what);
        let radix = rig.draws_planned(&logits, &[5, 6], &params, 0..200, 4096, plan_radix);
        assert_eq!(d.tokens, radix.tokens, "{what}: top-k path vs radix path");
    }
}

/// SAMPLE_TOP_K_MAX takes the two-launch path, one more the radix path;
/// top-k at or above the vocabulary is off (no filter launch); both
/// boundaries draw kept tokens.
#[test]
fn top_k_path_boundary() {
    let at = SamplingParams::default().temperature(0.9).top_k(SAMPLE_TOP_K_MAX);
    let above = at.clone().top_k(SAMPLE_TOP_K_MAX + 1);
    assert_eq!(kernels_of(&plan(&at, 3001, 8, 1024)), [Kernel::SampleTopk, Kernel::SampleTopkFinal]);
    let radix = kernels_of(&plan(&above, 3001, 8, 1024));
    assert_eq!(radix.iter().filter(|&&k| k == Kernel::SampleSelect).count(), 5, "{radix:?}");
    assert!(!radix.contains(&Kernel::SampleTopk));
    let off = kernels_of(&plan(&at, SAMPLE_TOP_K_MAX, 8, 1024));
    assert_eq!(off, [Kernel::SampleSelect, Kernel::ArgmaxFinal], "top-k >= n is off");
    let rig = Rig::new();
    let logits = awkward_logits(3001, 5);
    for params in [at, above] {
        let d = rig.draws(&logits, &[5, 6], &params, 0..40, 1024);
        assert_kept(&d, &sample_probs_ref(&logits, 0.9, params.top_k, 1.0, 0.0), &format!("{params:?}"));
    }
}

/// The penalties edit exactly the window's distinct tokens, as the
/// reference does (within one ulp: the GPU may fuse the multiply-add).
#[test]
fn penalties_edit_the_window_as_the_reference() {
    let rig = Rig::new();
    let n = 1000;
    let mut logits = awkward_logits(n, 9);
    logits[720] = -1.5;
    logits[591] = 2.25;
    logits[0] = 0.0;
    let sequence = [0u32, 851, 720, 591, 720, 110, 999, 753, 591, 720, 42, 0];
    for window in [1u32, 5, 9, 64] {
        let params = SamplingParams::default()
            .temperature(1.0)
            .repetition_penalty(1.3)
            .presence_penalty(0.5)
            .frequency_penalty(0.25)
            .penalty_window(window);
        let d = rig.draws(&logits, &sequence, &params, 0..1, 256);
        let recent = &sequence[sequence.len().saturating_sub(window as usize)..];
        let want = penalize_ref(&logits, recent, 1.3, 0.5, 0.25);
        for (i, (g, w)) in d.logits.iter().zip(&want).enumerate() {
            assert!(g.to_bits().abs_diff(w.to_bits()) <= 1, "window {window}: logit {i}: {g}, want {w}");
        }
        assert_eq!(d.logits.len(), n);
        assert_ne!(want, logits, "window {window}: the case edits nothing");
    }
}

/// The sampled next token's distribution over many seeds matches the
/// reference's (softmax of the filtered logits / T) by a chi-square test
/// at p < 1e-3, on the fixture model's own logits, for each filter and the
/// penalties; the sampler's launches in a session draw what these draw.
#[test]
fn sampled_distribution_matches_the_reference() {
    let model = model();
    let mut session = model.session_with_capacity(32).unwrap();
    session.feed(&PROMPT).unwrap();
    let raw = session.debug_logits().unwrap();
    let n = raw.len();
    let rig = Rig::new();
    let sets = [
        SamplingParams::default().temperature(0.6),
        SamplingParams::default().temperature(0.8).top_k(12),
        SamplingParams::default().temperature(0.7).top_p(0.6),
        SamplingParams::default().temperature(1.0).top_k(30).top_p(0.7),
        // Qwen3's generation_config.
        SamplingParams::default().temperature(0.6).top_k(20).top_p(0.95),
        SamplingParams::default().temperature(1.0).top_k(SAMPLE_TOP_K_MAX).min_p(0.02),
        SamplingParams::default().temperature(0.9).min_p(0.01),
        SamplingParams::default()
            .temperature(0.7)
            .repetition_penalty(1.5)
            .presence_penalty(0.3)
            .frequency_penalty(0.2),
    ];
    for (i, params) in sets.iter().enumerate() {
        let draws = 2400;
        let seeds = 1000 * i as u64..1000 * i as u64 + draws;
        let d = rig.draws(&raw, &PROMPT, params, seeds.clone(), SAMPLE_CHUNK);
        if params.top_k > 0 {
            // The top-k path draws what the radix path draws, seed for seed.
            let radix = rig.draws_planned(&raw, &PROMPT, params, seeds.clone(), SAMPLE_CHUNK, plan_radix);
            assert_eq!(d.tokens, radix.tokens, "{params:?}: top-k path vs radix path");
        }
        let window = &PROMPT[PROMPT.len().saturating_sub(params.penalty_window as usize)..];
        let logits = if params.has_penalties() {
            penalize_ref(
                &raw,
                window,
                params.repetition_penalty,
                params.presence_penalty,
                params.frequency_penalty,
            )
        } else {
            raw.clone()
        };
        let probs = sample_probs_ref(&logits, params.temperature, params.top_k, params.top_p, params.min_p);
        let (stat, df) = chi_square(&histogram(&d.tokens, n), &probs);
        let kept = probs.iter().filter(|&&p| p > 0.0).count();
        let critical = chi_square_critical_1e3(df);
        eprintln!(
            "{params:?}: {kept} kept, chi-square {stat:.1} ({df} degrees of freedom, critical {critical:.1})"
        );
        assert!(df >= 3, "{params:?}: too few bins ({df} degrees of freedom, {kept} kept)");
        assert!(
            stat < critical,
            "{params:?}: chi-square {stat:.1} >= {critical:.1} ({df} degrees of freedom)"
        );
        // The session's own launches draw the same tokens for the same seeds.
        for seed in seeds.start..seeds.start + 3 {
            session.set_sampling(&params.clone().seed(seed)).unwrap();
            session.truncate(PROMPT.len() - 1).unwrap();
            let token = session.feed(&PROMPT[PROMPT.len() - 1..]).unwrap();
            assert_eq!(
                token,
                d.tokens[(seed - seeds.start) as usize],
                "{params:?} seed {seed}: session vs rig"
            );
        }
    }
}

/// Same seed, same tokens, whatever the lookahead; another seed, other
/// tokens; greedy stays greedy after sampling.
#[test]
fn same_seed_same_tokens_at_every_lookahead() {
    let model = model();
    let params =
        SamplingParams::default().temperature(0.9).top_k(40).top_p(0.95).repetition_penalty(1.1).seed(7);
    let run = |params: &SamplingParams, lookahead: usize| -> Vec<u32> {
        let mut s = model.session_with_capacity(40).unwrap();
        s.set_lookahead(lookahead);
        s.set_sampling(params).unwrap();
        let mut tokens = vec![s.feed(&PROMPT).unwrap()];
        for _ in 0..16 {
            tokens.push(s.next_token().unwrap());
        }
        tokens
    };
    let base = run(&params, 4);
    for lookahead in [1, 2, 8] {
        assert_eq!(run(&params, lookahead), base, "lookahead {lookahead}");
    }
    assert_ne!(run(&params.clone().seed(8), 4), base, "seeds 7 and 8 drew the same tokens");
    let greedy = run(&SamplingParams::default(), 4);
    assert_ne!(greedy, base);
    // Switching mid-stream: the queued steps are dropped, the next token
    // uses the new parameters.
    let mut s = model.session_with_capacity(40).unwrap();
    s.set_sampling(&params).unwrap();
    let mut tokens = vec![s.feed(&PROMPT).unwrap(), s.next_token().unwrap()];
    s.set_sampling(&SamplingParams::default()).unwrap();
    assert_eq!(s.sampling(), &SamplingParams::default());
    for _ in 0..15 {
        tokens.push(s.next_token().unwrap());
    }
    let mut g = model.session_with_capacity(40).unwrap();
    g.feed(&PROMPT).unwrap();
    g.truncate(0).unwrap();
    let mut want = vec![g.feed(&[&PROMPT[..], &tokens[..2]].concat()).unwrap()];
    for _ in 0..14 {
        want.push(g.next_token().unwrap());
    }
    assert_eq!(&tokens[2..], &want[..], "greedy after sampling");
}

/// The default is today's greedy path: the same launches (the two argmax
/// kernels) and the fixture's expected greedy tokens.
#[test]
fn greedy_path_is_unchanged() {
    let steps = plan(&SamplingParams::default(), 1000, 40, SAMPLE_CHUNK);
    let kernels: Vec<Kernel> = steps.iter().map(|l| l.kernel).collect();
    assert_eq!(kernels, [Kernel::ArgmaxPartial, Kernel::ArgmaxFinal]);
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        expected[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    let (prompt, want) = (ids("prompt_ids"), ids("generated_ids"));
    let model = model();
    let out = model.generate(&prompt, 8, |_| {}).unwrap();
    assert_eq!(out.generated_ids(), &want[..8]);
    let options = qwen3_wgpu::GenerateOptions::default().max_new_tokens(8).sampling(SamplingParams::greedy());
    let out = model.generate_with(&prompt, &options, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(out.generated_ids(), &want[..8]);
    let sampled = options.sampling(SamplingParams::default().temperature(1.0).seed(1));
    let out = model.generate_with(&prompt, &sampled, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_ne!(out.generated_ids(), &want[..8], "sampling at T = 1 drew the greedy tokens");
}

/// Bad parameters are refused by name and leave the session as it was.
#[test]
fn bad_parameters_are_refused_by_name() {
    let model = model();
    let mut s = model.session_with_capacity(16).unwrap();
    let good = SamplingParams::default().temperature(0.5).seed(3);
    s.set_sampling(&good).unwrap();
    let e = s.set_sampling(&SamplingParams::default().top_p(0.0)).unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
    assert!(e.to_string().contains("top_p"), "{e}");
    assert_eq!(s.sampling(), &good);
    let options =
        qwen3_wgpu::GenerateOptions::default().sampling(SamplingParams::default().temperature(f32::NAN));
    let e = model.generate_with(&PROMPT, &options, |_| std::ops::ControlFlow::Continue(())).unwrap_err();
    assert!(e.to_string().contains("temperature"), "{e}");
}

/// generation_config.json: absent gives the defaults, malformed is
/// `checkpoint_invalid`, Qwen3's is read.
#[test]
fn generation_config_is_read_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(SamplingParams::from_generation_config(dir.path()).unwrap(), SamplingParams::default());
    let file = dir.path().join("generation_config.json");
    std::fs::write(&file, r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95}"#).unwrap();
    let want = SamplingParams::default().temperature(0.6).top_k(20).top_p(0.95);
    assert_eq!(SamplingParams::from_generation_config(dir.path()).unwrap(), want);
    std::fs::write(&file, r#"{"do_sample": true, "temperature": "#).unwrap();
    let e = SamplingParams::from_generation_config(dir.path()).unwrap_err();
    assert_eq!(e.code(), "checkpoint_invalid", "{e}");
}

/// The draws at the ends of the hash's range stay strictly inside (0, 1)
/// with finite noise: seed 4863 gives token 762 at position 9 a hash whose
/// top 24 bits are all set (as a 24-bit draw, (2^24 - 0.5) / 2^24 rounds
/// to 1 in f32, and its noise is infinite), seed 35279 gives token 976 one
/// whose top 24 bits are all clear. On the GPU, both paths draw the one
/// token whose logit towers over the rest (by more than the noise's width,
/// under 20), never token 762.
#[test]
fn draws_at_the_hash_extremes_stay_inside_the_unit_interval() {
    let (seed_top, id_top, seed_bottom, id_bottom, pos) = (4863u64, 762u32, 35279u64, 976u32, 9u32);
    assert_eq!(draw_hash(seed_top, pos, id_top) >> 8, 0xff_ffff);
    assert_eq!((0xff_ffff as f32 + 0.5) / 16_777_216.0, 1.0, "why 24 bits cannot be exact");
    assert_eq!(draw_hash(seed_bottom, pos, id_bottom) >> 8, 0);
    let top = uniform_draw(seed_top, pos, id_top);
    let bottom = uniform_draw(seed_bottom, pos, id_bottom);
    assert_eq!((top, bottom), (1.0 - 2f32.powi(-24), 2f32.powi(-24)));
    for u in [top, bottom] {
        assert!(u > 0.0 && u < 1.0 && gumbel_noise(u).is_finite(), "{u}: noise {}", gumbel_noise(u));
    }
    // The noise spans [-ln(24 ln 2), -ln(2^-24)], about [-2.81, 16.64].
    assert!((gumbel_noise(top) - 16.64).abs() < 0.01 && (gumbel_noise(bottom) + 2.81).abs() < 0.01);

    let rig = Rig::new();
    let n = 1000;
    let winner = 3u32;
    for id in [id_top, id_bottom] {
        // The winner at 0, a block around the extreme draw's token at -30
        // (kept by top-k 128), the rest at -50.
        let mut logits = vec![-50.0f32; n];
        logits[id as usize - 20..id as usize + 20].fill(-30.0);
        logits[winner as usize] = 0.0;
        for seed in [seed_top, seed_bottom] {
            for params in [
                SamplingParams::default().temperature(1.0),
                SamplingParams::default().temperature(1.0).top_k(SAMPLE_TOP_K_MAX),
            ] {
                let d = rig.draws(&logits, &PROMPT, &params, seed..seed + 1, SAMPLE_CHUNK);
                assert_eq!(
                    d.tokens,
                    [winner],
                    "seed {seed}, {:?}",
                    kernels_of(&plan(&params, n as u32, 13, SAMPLE_CHUNK))
                );
            }
        }
    }
}

/// At a temperature where the noise (under 20 wide) times the temperature
/// is far below the gap between the top logit and the next, every draw
/// must be the argmax. The steps' hashes hit a 24-bit draw's top value
/// (where a draw that is not strictly below 1 gets infinite noise) at some
/// token that is not the argmax with probability 1 - (1 - 2^-24)^(151,935
/// x 1,500) = 1 - e^-13.6, over 1 - 1.3e-6 (about 13.6 such steps
/// expected); the test checks these steps do hit it. (The top-k path
/// draws among 128 tokens, where such steps are rare: the extremes' test
/// above covers it.)
#[test]
fn sampling_at_a_tiny_temperature_draws_the_argmax_every_step() {
    let n = 151_936usize;
    let steps = 1_500u64;
    let pos = PROMPT.len() as u32 - 1;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut logits: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        })
        .collect();
    let argmax = 98_765u32;
    logits[argmax as usize] = 4.5;
    let t = 1e-4;
    let hit = (0..steps)
        .any(|seed| (0..n as u32).any(|id| id != argmax && draw_hash(seed, pos, id) >> 8 == 0xff_ffff));
    assert!(hit, "no step reaches the draw's top value");
    let rig = Rig::new();
    let params = SamplingParams::default().temperature(t);
    let d = rig.draws(&logits, &PROMPT, &params, 0..steps, SAMPLE_CHUNK);
    let wrong: Vec<(usize, u32)> =
        d.tokens.iter().copied().enumerate().filter(|&(_, tok)| tok != argmax).collect();
    assert!(wrong.is_empty(), "(seed, token) not the argmax: {wrong:?}");
}

/// A top-p too small for f32's normal range keeps the top logit's group
/// alone (here tied at three tokens), as any tiny top-p does.
#[test]
fn a_subnormal_top_p_keeps_the_top_group() {
    let rig = Rig::new();
    let n = 1000;
    let logits = awkward_logits(n, 9);
    let top = [3u32, n as u32 / 2, n as u32 - 1];
    for params in [
        SamplingParams::default().temperature(1.0).top_p(1e-40),
        SamplingParams::default().temperature(1.0).top_p(1e-40).top_k(SAMPLE_TOP_K_MAX),
    ] {
        params.validate().unwrap();
        let d = rig.draws(&logits, &[5, 6], &params, 0..60, SAMPLE_CHUNK);
        assert!(d.tokens.iter().all(|t| top.contains(t)), "top-k {}: {:?}", params.top_k, d.tokens);
        for t in top {
            assert!(d.tokens.contains(&t), "top-k {}: {t} never drawn", params.top_k);
        }
    }
}

/// A temperature too small to divide logits by decodes the greedy tokens
/// (the fixture's expected ones), through a session and `generate_with`.
#[test]
fn tiny_temperatures_decode_the_greedy_tokens() {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        expected[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    let (prompt, want) = (ids("prompt_ids"), ids("generated_ids"));
    let model = model();
    let d = SamplingParams::default;
    for params in [
        d().temperature(1e-40),
        d().temperature(1e-30).top_k(20).seed(11),
        d().temperature(1e-6).min_p(0.1).seed(12),
        d().temperature(3e-6).top_p(0.9).seed(13),
    ] {
        let t = params.temperature;
        let mut s = model.session_with_capacity(prompt.len() + 8).unwrap();
        s.set_sampling(&params).unwrap();
        let mut got = vec![s.feed(&prompt).unwrap()];
        for _ in 0..7 {
            got.push(s.next_token().unwrap());
        }
        assert_eq!(got, &want[..8], "temperature {t:e}");
        let options = qwen3_wgpu::GenerateOptions::default().max_new_tokens(8).sampling(params);
        let out = model.generate_with(&prompt, &options, |_| std::ops::ControlFlow::Continue(())).unwrap();
        assert_eq!(out.generated_ids(), &want[..8], "temperature {t:e}, generate_with");
    }
}

/// Penalties large enough to overflow the logits are refused by name,
/// with the bound, through a session and `generate_with`; the bound itself
/// decodes tokens of the vocabulary.
#[test]
fn extreme_penalties_are_refused_with_the_bound() {
    let model = model();
    let mut s = model.session_with_capacity(32).unwrap();
    let d = SamplingParams::default;
    for (params, field) in [
        (d().presence_penalty(-3.4e38), "presence_penalty"),
        (d().temperature(0.7).frequency_penalty(3.4e38), "frequency_penalty"),
        (d().repetition_penalty(3.4e38), "repetition_penalty"),
        (d().temperature(0.7).repetition_penalty(1e-30), "repetition_penalty"),
    ] {
        let e = s.set_sampling(&params).unwrap_err();
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains(field) && e.to_string().contains("1000000"), "{e}");
        let options = qwen3_wgpu::GenerateOptions::default().sampling(params);
        let e = model.generate_with(&PROMPT, &options, |_| std::ops::ControlFlow::Continue(())).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
    // At the bound: presence -max with frequency +max leaves a token seen
    // once as it was and bans one seen twice or more (720 and 591 in the
    // prompt); presence and frequency -max force the most frequent token
    // of the window (720, three times; a count more is 10^6 more), and
    // so again and again, whatever the draw.
    let max = SamplingParams::MAX_PENALTY;
    let vocab = model.config().vocab_size as u32;
    let run = |s: &mut qwen3_wgpu::Session, params: &SamplingParams| -> Vec<u32> {
        s.set_sampling(params).unwrap();
        s.truncate(0).unwrap();
        let mut tokens = vec![s.feed(&PROMPT).unwrap()];
        for _ in 0..4 {
            tokens.push(s.next_token().unwrap());
        }
        tokens
    };
    let banned = run(&mut s, &d().presence_penalty(-max).frequency_penalty(max));
    assert!(banned.iter().all(|&t| t < vocab && t != 720 && t != 591), "{banned:?}");
    let forcing = d().temperature(0.7).presence_penalty(-max).frequency_penalty(-max);
    for seed in 0..3 {
        assert_eq!(run(&mut s, &forcing.clone().seed(seed)), [720; 5], "seed {seed}");
    }
}
