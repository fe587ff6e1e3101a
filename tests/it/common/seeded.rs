//! The fuzz tests' seeded runs: `QWEN3_WGPU_FUZZ_CASES` cases (else the
//! test's default) from seed `QWEN3_WGPU_FUZZ_SEED` (else its default),
//! case `i` at seed + i, spread over worker threads; a case that panics
//! fails naming its seed, so that `QWEN3_WGPU_FUZZ_SEED=<seed>
//! QWEN3_WGPU_FUZZ_CASES=1` replays it.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// `name`'s value as a number, else `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}

/// A case's outcome (counted by kind) and its failure, if any.
pub type CaseResult = (String, Option<String>);

/// The worker threads a CPU-bound run takes: the cores, 1 to 8.
pub fn cpu_workers() -> u64 {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8) as u64
}

/// Runs the cases on `workers` threads, worker `w` through the runner
/// `make_runner(w)` makes (a thread's own scratch lives there), prints
/// `what`, the count and the outcomes, and fails listing every failed
/// case. Returns the outcomes.
pub fn run_seeded<R>(
    what: &str,
    default_cases: u64,
    default_seed: u64,
    workers: u64,
    make_runner: impl Fn(u64) -> R + Sync,
) -> BTreeMap<String, u64>
where
    R: FnMut(u64) -> CaseResult,
{
    let cases = env_u64("QWEN3_WGPU_FUZZ_CASES", default_cases);
    let first_seed = env_u64("QWEN3_WGPU_FUZZ_SEED", default_seed);
    let workers = workers.clamp(1, cases.max(1));
    let started = Instant::now();
    let make_runner = &make_runner;
    let results: Vec<(Vec<String>, BTreeMap<String, u64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                s.spawn(move || {
                    let mut run = make_runner(w);
                    let mut failures = Vec::new();
                    let mut outcomes = BTreeMap::<String, u64>::new();
                    for i in (w..cases).step_by(workers as usize) {
                        let seed = first_seed.wrapping_add(i);
                        match catch_unwind(AssertUnwindSafe(|| run(seed))) {
                            Ok((outcome, failure)) => {
                                *outcomes.entry(outcome).or_default() += 1;
                                failures.extend(failure);
                            }
                            Err(_) => failures.push(format!("seed {seed}: panicked (message above)")),
                        }
                    }
                    (failures, outcomes)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut outcomes = BTreeMap::<String, u64>::new();
    let mut failures = Vec::new();
    for (f, o) in results {
        failures.extend(f);
        for (k, n) in o {
            *outcomes.entry(k).or_default() += n;
        }
    }
    println!(
        "{cases} {what} from seed {first_seed} on {workers} threads in {:.1} s: {outcomes:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{} of {cases} cases failed:\n{}", failures.len(), failures.join("\n"));
    outcomes
}
