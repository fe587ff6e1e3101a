//! Batched decode across sessions (`Model::batch`, `Batch::step`): the
//! greedy tokens of each session in a batch are exactly those it produces
//! alone, whatever the other rows, their positions (one crossing the
//! 256-position attention chunk while others stay within one), or who
//! joins and leaves; bad input is a named error that changes nothing.

use std::path::{Path, PathBuf};

use qwen3_wgpu::{
    AdapterPolicy, Batch, BatchOptions, CachePolicy, Engine, Error, FeedStatus, LoadOptions, MatvecLayout,
    Model, SamplingParams, Session,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

fn load(layout: MatvecLayout, name: &str) -> Model {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).matvec_layout(layout).build().unwrap();
    engine.load(fixture(name), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap()
}

/// `n` token ids below `vocab`, from a seed (a small LCG: varied prompts).
fn ids(seed: u32, n: usize, vocab: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            (x >> 8) % vocab
        })
        .collect()
}

const CAPACITY: usize = 300;

/// The greedy tokens of a session of `CAPACITY` positions fed `prompt`:
/// the first, then `n - 1` more.
fn alone(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = model.session_with_capacity(CAPACITY).unwrap();
    let first = s.feed(prompt).unwrap();
    std::iter::once(first).chain((1..n).map(|_| s.next_token().unwrap())).collect()
}

/// Steps `sessions` together, appending each one's token to its stream.
fn step(batch: &mut Batch, sessions: &mut [(&mut Session, &mut Vec<u32>)]) {
    let (mut ss, outs): (Vec<&mut Session>, Vec<&mut Vec<u32>>) =
        sessions.iter_mut().map(|(s, o)| (&mut **s, &mut **o)).unzip();
    let tokens = batch.step(&mut ss).unwrap();
    assert_eq!(tokens.len(), outs.len());
    for (out, t) in outs.into_iter().zip(tokens) {
        out.push(t);
    }
}

/// Three sessions at mixed prompt lengths: `a` starts at 250 positions and
/// crosses the 256-position chunk while `b` and `c` stay within one; `c`
/// joins late, `b` leaves early (its slot freed), `a` takes steps alone in
/// between. Every stream equals the session decoded alone, and the streams
/// differ from one another (so swapped rows or slots would show).
fn batched_equals_alone(layout: MatvecLayout, name: &str) {
    let model = load(layout, name);
    let vocab = model.config().vocab_size as u32;
    let (pa, pb, pc) = (ids(1, 250, vocab), ids(2, 5, vocab), ids(3, 40, vocab));
    let n = 16;
    let want = [alone(&model, &pa, n), alone(&model, &pb, n), alone(&model, &pc, n)];
    assert!(want[0] != want[1] && want[1] != want[2] && want[0] != want[2], "{want:?}");

    let mut batch = model.batch(&BatchOptions::default().slots(3).capacity_per_slot(CAPACITY)).unwrap();
    let mut a = batch.session().unwrap();
    let mut b = batch.session().unwrap();
    let mut got_a = vec![a.feed(&pa).unwrap()];
    let mut got_b = vec![b.feed(&pb).unwrap()];
    for _ in 0..3 {
        step(&mut batch, &mut [(&mut a, &mut got_a), (&mut b, &mut got_b)]);
    }
    // c joins; rows in another order.
    let mut c = batch.session().unwrap();
    let mut got_c = vec![c.feed(&pc).unwrap()];
    for _ in 0..3 {
        step(&mut batch, &mut [(&mut c, &mut got_c), (&mut a, &mut got_a), (&mut b, &mut got_b)]);
    }
    // a alone between batch steps (its queued steps are discarded by the next batch step).
    got_a.push(a.next_token().unwrap());
    got_a.push(a.next_token().unwrap());
    for _ in 0..2 {
        step(&mut batch, &mut [(&mut b, &mut got_b), (&mut c, &mut got_c), (&mut a, &mut got_a)]);
    }
    // b leaves mid-way: its slot is free for another session.
    while got_b.len() < n {
        got_b.push(b.next_token().unwrap());
    }
    assert_eq!(got_b, want[1], "b");
    drop(b);
    assert_eq!(batch.free_slots(), 1);
    let d = batch.session().unwrap();
    drop(d);
    while got_a.len() < n || got_c.len() < n {
        match (got_a.len() < n, got_c.len() < n) {
            (true, true) => step(&mut batch, &mut [(&mut a, &mut got_a), (&mut c, &mut got_c)]),
            (true, false) => step(&mut batch, &mut [(&mut a, &mut got_a)]),
            _ => step(&mut batch, &mut [(&mut c, &mut got_c)]),
        }
    }
    assert!(a.len() > 256 && c.len() < 256, "a at {}, c at {}", a.len(), c.len());
    assert_eq!(got_a, want[0], "a");
    assert_eq!(got_c, want[2], "c");
}

#[test]
fn batched_tokens_equal_each_session_alone_rows_per_team() {
    batched_equals_alone(MatvecLayout::RowsPerTeam, "gqa2_hd64");
}

#[test]
fn batched_tokens_equal_each_session_alone_split_k_odd_dims() {
    batched_equals_alone(MatvecLayout::SplitK, "odd_dims");
}

/// The greedy tokens of a session of `capacity` positions fed `prompt`.
fn alone_with(model: &Model, capacity: usize, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = model.session_with_capacity(capacity).unwrap();
    let first = s.feed(prompt).unwrap();
    std::iter::once(first).chain((1..n).map(|_| s.next_token().unwrap())).collect()
}

fn err<T>(r: Result<T, Error>) -> Error {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

fn assert_invalid(e: Error, name: &str) {
    assert_eq!(e.code(), "invalid_argument", "{e}");
    assert!(matches!(&e, Error::InvalidArgument { name: n, .. } if n == name), "{e:?} should name {name}");
}

/// Bad options and bad steps are named errors, before anything runs: the
/// sessions are left as they were and go on decoding their own tokens.
#[test]
fn bad_batches_and_bad_steps_are_named_errors_that_change_nothing() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let options = |slots, capacity| BatchOptions::default().slots(slots).capacity_per_slot(capacity);
    assert_invalid(model.batch(&options(0, 8)).unwrap_err(), "slots");
    assert_invalid(model.batch(&options(usize::MAX / 2, 8)).unwrap_err(), "slots");
    assert_eq!(model.batch(&options(1, 0)).unwrap_err().code(), "context_overflow");
    assert_eq!(model.batch(&options(1, 4097)).unwrap_err().code(), "context_overflow");

    let capacity = 8;
    let mut batch = model.batch(&options(2, capacity)).unwrap();
    let mut a = batch.session().unwrap();
    let mut b = batch.session().unwrap();
    assert_invalid(err(batch.session()), "batch");
    assert_invalid(batch.step(&mut []).unwrap_err(), "sessions");
    assert_eq!(batch.step(&mut [&mut a]).unwrap_err().code(), "no_pending_token");
    let prompt = [11u32, 22, 33];
    let want = alone_with(&model, capacity, &prompt, capacity - prompt.len() + 1);
    let mut got = vec![a.feed(&prompt).unwrap()];
    b.feed(&[5, 6]).unwrap();

    // Sessions that hold no slot of this batch: a plain one, one of another
    // batch of the same model, one of another model's batch.
    let mut plain = model.session_with_capacity(capacity).unwrap();
    plain.feed(&[1]).unwrap();
    assert_invalid(batch.step(&mut [&mut a, &mut plain]).unwrap_err(), "sessions");
    let other_batch = model.batch(&options(1, capacity)).unwrap();
    let mut stranger = other_batch.session().unwrap();
    stranger.feed(&[1]).unwrap();
    assert_invalid(batch.step(&mut [&mut stranger, &mut a]).unwrap_err(), "sessions");
    let other_model = load(MatvecLayout::RowsPerTeam, "mqa_hd64");
    let other_model_batch = other_model.batch(&options(1, capacity)).unwrap();
    let mut foreign = other_model_batch.session().unwrap();
    foreign.feed(&[1]).unwrap();
    assert_invalid(batch.step(&mut [&mut a, &mut foreign]).unwrap_err(), "sessions");

    // A session reporting log-probabilities, and one in the middle of a
    // non-blocking feed.
    b.set_logprobs(3).unwrap();
    assert_invalid(batch.step(&mut [&mut a, &mut b]).unwrap_err(), "logprobs");
    b.set_logprobs(0).unwrap();
    b.begin_feed(&[7]).unwrap();
    assert_invalid(batch.step(&mut [&mut a, &mut b]).unwrap_err(), "session");
    while !matches!(b.poll_feed().unwrap(), FeedStatus::Ready(_)) {}

    // Nothing changed: `a` decodes its own tokens up to its capacity, then
    // a step is context_overflow (and `b` still steps).
    assert_eq!(a.len(), prompt.len());
    while a.len() < capacity {
        got.push(batch.step(&mut [&mut a]).unwrap()[0]);
    }
    assert_eq!(got, want);
    assert_eq!(batch.step(&mut [&mut b, &mut a]).unwrap_err().code(), "context_overflow");
    assert_eq!(batch.step(&mut [&mut b]).unwrap().len(), 1);
}

/// The tokens of a session of `CAPACITY` positions choosing under
/// `params`, fed `prompt`: the first, then `n - 1` more; from token
/// `switch.0` on under `switch.1` (when given).
fn alone_sampled(
    model: &Model,
    params: &SamplingParams,
    prompt: &[u32],
    n: usize,
    switch: Option<(usize, &SamplingParams)>,
) -> Vec<u32> {
    let mut s = model.session_with_capacity(CAPACITY).unwrap();
    s.set_sampling(params).unwrap();
    let mut out = vec![s.feed(prompt).unwrap()];
    while out.len() < n {
        if let Some((at, p)) = switch {
            if out.len() == at {
                s.set_sampling(p).unwrap();
            }
        }
        out.push(s.next_token().unwrap());
    }
    out
}

/// Sessions choosing under their own parameters (greedy; top-k with top-p,
/// the two-launch path; top-p with a repetition penalty, the radix path;
/// greedy with penalties) draw in a batch, seed for seed, what each draws
/// alone, at mixed prompt lengths; a session changing its parameters
/// between steps draws under the new ones from the next step on (the step
/// the batch queued ahead under the old ones is not used).
#[test]
fn sampling_sessions_draw_in_a_batch_what_they_draw_alone() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let params = [
        SamplingParams::default(),
        SamplingParams::default().temperature(0.9).top_k(20).top_p(0.95).seed(7),
        SamplingParams::default().temperature(1.0).top_p(0.9).repetition_penalty(1.3).seed(11),
        SamplingParams::default().repetition_penalty(1.5).presence_penalty(0.5),
    ];
    let reseeded = params[1].clone().seed(8);
    let prompts = [ids(1, 9, vocab), ids(2, 3, vocab), ids(3, 17, vocab), ids(4, 5, vocab)];
    let n = 14;
    let switch_at = 7;
    let want: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let switch = (i == 1).then_some((switch_at, &reseeded));
            alone_sampled(&model, &params[i], &prompts[i], n, switch)
        })
        .collect();
    // The sampled streams are not their prompts' greedy streams.
    for i in [1, 2] {
        assert_ne!(want[i], alone(&model, &prompts[i], n), "session {i} should sample");
    }

    let mut batch = model.batch(&BatchOptions::default().slots(4).capacity_per_slot(CAPACITY)).unwrap();
    let mut sessions: Vec<Session> = (0..4).map(|_| batch.session().unwrap()).collect();
    let mut got: Vec<Vec<u32>> = Vec::new();
    for (i, s) in sessions.iter_mut().enumerate() {
        s.set_sampling(&params[i]).unwrap();
        got.push(vec![s.feed(&prompts[i]).unwrap()]);
    }
    while got[0].len() < n {
        if got[1].len() == switch_at {
            sessions[1].set_sampling(&reseeded).unwrap();
        }
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        let tokens = batch.step(&mut refs).unwrap();
        for (out, t) in got.iter_mut().zip(tokens) {
            out.push(t);
        }
    }
    for i in 0..4 {
        assert_eq!(got[i], want[i], "session {i} ({:?})", params[i]);
    }
}

/// A step the batch queued ahead is dropped when a session's context
/// changed since, even where its length and pending token are back to what
/// the queued step expects (a truncation and a different token fed whose
/// prediction is the same): the next step follows the new context.
#[test]
fn a_step_queued_ahead_is_dropped_when_the_context_changed() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let mut batch = model.batch(&BatchOptions::default().slots(1).capacity_per_slot(64)).unwrap();
    let mut a = batch.session().unwrap();
    a.feed(&ids(7, 6, vocab)).unwrap();
    batch.step(&mut [&mut a]).unwrap();
    batch.step(&mut [&mut a]).unwrap(); // the next one is queued ahead
    let (len, pending) = (a.len(), a.pending().unwrap());
    let context = a.tokens().unwrap();
    // Another last token with the same prediction.
    let mut probe = model.session_with_capacity(64).unwrap();
    probe.feed(&context[..len - 1]).unwrap();
    let other = (0..vocab)
        .filter(|&x| x != context[len - 1])
        .find(|&x| {
            probe.truncate(len - 1).unwrap();
            probe.feed(&[x]).unwrap() == pending
        })
        .expect("a token with the same prediction");
    a.truncate(len - 1).unwrap();
    assert_eq!(a.feed(&[other]).unwrap(), pending);
    assert_eq!(a.len(), len);
    let got: Vec<u32> = (0..4).map(|_| batch.step(&mut [&mut a]).unwrap()[0]).collect();
    let mut edited = context[..len - 1].to_vec();
    edited.push(other);
    let want = alone_with(&model, 64, &edited, 5);
    assert_eq!(want[0], pending);
    assert_eq!(got, want[1..]);
}

/// A session of a batch works alone like any other: fork, save and
/// restore read its own slot's region of the pool (here not the first
/// slot, whose region holds another session's context), and its forks and
/// restored copies continue as it does.
#[test]
fn fork_save_and_restore_of_a_batch_session_use_its_own_region() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let mut batch = model.batch(&BatchOptions::default().slots(2).capacity_per_slot(64)).unwrap();
    let mut first = batch.session().unwrap();
    let mut second = batch.session().unwrap();
    first.feed(&ids(11, 20, vocab)).unwrap();
    second.feed(&ids(12, 9, vocab)).unwrap();
    batch.step(&mut [&mut first, &mut second]).unwrap();
    let context = second.tokens().unwrap();
    let want = alone_with(&model, 64, &context, 5);
    assert_eq!(want[0], second.pending().unwrap());

    let mut fork = second.fork().unwrap();
    let forked: Vec<u32> = (1..5).map(|_| fork.next_token().unwrap()).collect();
    assert_eq!(forked, want[1..]);
    let dir = std::env::temp_dir().join(format!("qwen3-wgpu-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("second.session");
    second.save(&path).unwrap();
    let mut restored = model.restore_session(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let again: Vec<u32> = (1..5).map(|_| restored.next_token().unwrap()).collect();
    assert_eq!(again, want[1..]);
    let own: Vec<u32> = (1..5).map(|_| batch.step(&mut [&mut second]).unwrap()[0]).collect();
    assert_eq!(own, want[1..]);
}

/// A step queued ahead for a session that is then dropped never serves the
/// session that takes its slot next, even one fed the very same context
/// (same length, pending token and feed count): the new session's own
/// token sequence gets its tokens, so it goes on alone as it should.
#[test]
fn a_step_queued_for_a_dropped_session_never_serves_the_next_in_its_slot() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let mut batch = model.batch(&BatchOptions::default().slots(1).capacity_per_slot(64)).unwrap();
    let mut a = batch.session().unwrap();
    a.feed(&ids(21, 10, vocab)).unwrap();
    batch.step(&mut [&mut a]).unwrap();
    batch.step(&mut [&mut a]).unwrap(); // the next one is queued ahead
    let context = a.tokens().unwrap();
    let len = a.len();
    drop(a);
    let mut b = batch.session().unwrap();
    b.feed(&context[..len]).unwrap();
    let want = alone_with(&model, 64, &context[..len], 5);
    let mut got = vec![b.pending().unwrap(), batch.step(&mut [&mut b]).unwrap()[0]];
    got.extend((0..3).map(|_| b.next_token().unwrap()));
    assert_eq!(got, want);
}

/// Each session's (length, pending token).
fn states(sessions: &[&mut Session]) -> Vec<(usize, Option<u32>)> {
    sessions.iter().map(|s| (s.len(), s.pending())).collect()
}

/// One `try_step`: on `None`, every session is as it was (length, pending
/// token).
fn try_once(batch: &mut Batch, sessions: &mut [&mut Session]) -> Option<Vec<u32>> {
    let before = states(sessions);
    let out = batch.try_step(sessions).unwrap();
    match &out {
        Some(tokens) => assert_eq!(tokens.len(), sessions.len()),
        None => assert_eq!(states(sessions), before, "a try_step that returned None changed a session"),
    }
    out
}

/// `try_step` until it gives the tokens, appending each to its stream.
fn try_until(batch: &mut Batch, sessions: &mut [(&mut Session, &mut Vec<u32>)]) {
    let (mut ss, outs): (Vec<&mut Session>, Vec<&mut Vec<u32>>) =
        sessions.iter_mut().map(|(s, o)| (&mut **s, &mut **o)).unzip();
    let tokens = loop {
        match try_once(batch, &mut ss) {
            Some(tokens) => break tokens,
            None => std::thread::sleep(std::time::Duration::from_micros(200)),
        }
    };
    for (out, t) in outs.into_iter().zip(tokens) {
        out.push(t);
    }
}

/// A `try_step` loop gives the tokens of a `step` loop and of each session
/// alone; each `None` leaves every session as it was, and no call waits
/// for the GPU (neither the batch nor a session counts a wait).
#[test]
fn try_step_gives_the_tokens_of_step_and_never_waits() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let prompts = [ids(31, 9, vocab), ids(32, 3, vocab), ids(33, 20, vocab)];
    let n = 10;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone_with(&model, 64, p, n)).collect();
    let options = BatchOptions::default().slots(3).capacity_per_slot(64);

    let mut batch = model.batch(&options).unwrap();
    let mut sessions: Vec<Session> = (0..3).map(|_| batch.session().unwrap()).collect();
    let mut stepped: Vec<Vec<u32>> =
        sessions.iter_mut().zip(&prompts).map(|(s, p)| vec![s.feed(p).unwrap()]).collect();
    while stepped[0].len() < n {
        let tokens = batch.step(&mut sessions.iter_mut().collect::<Vec<_>>()).unwrap();
        stepped.iter_mut().zip(tokens).for_each(|(out, t)| out.push(t));
    }
    assert_eq!(stepped, want);

    let mut batch = model.batch(&options).unwrap();
    let mut sessions: Vec<Session> = (0..3).map(|_| batch.session().unwrap()).collect();
    let mut got: Vec<Vec<u32>> =
        sessions.iter_mut().zip(&prompts).map(|(s, p)| vec![s.feed(p).unwrap()]).collect();
    let waits = |batch: &Batch, sessions: &[Session]| {
        batch.debug_blocking_waits() + sessions.iter().map(|s| s.debug_feed_counts().1).sum::<u64>()
    };
    let before = waits(&batch, &sessions);
    let (mut calls, mut nones) = (0, 0);
    while got[0].len() < n {
        calls += 1;
        match try_once(&mut batch, &mut sessions.iter_mut().collect::<Vec<_>>()) {
            Some(tokens) => got.iter_mut().zip(tokens).for_each(|(out, t)| out.push(t)),
            None => {
                nones += 1;
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
    }
    assert_eq!(got, want);
    // The first call submits and cannot have the tokens yet.
    assert!(nones > 0, "{calls} calls, none returned None");
    assert_eq!(waits(&batch, &sessions), before, "a try_step waited for the GPU");

    // A session leaves while the next step of all three is in flight: that
    // step is dropped without a wait, and the other two go on.
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone_with(&model, 64, p, n + 3)).collect();
    let [s0, _, s2] = &mut sessions[..] else { unreachable!() };
    let [g0, _, g2] = &mut got[..] else { unreachable!() };
    for _ in 0..3 {
        try_until(&mut batch, &mut [(s2, g2), (s0, g0)]);
    }
    assert_eq!([&got[0], &got[2]], [&want[0], &want[2]]);
    assert_eq!(waits(&batch, &sessions), before, "a try_step waited for the GPU");
}

/// The sessions change while a `try_step`'s step is in flight: another
/// order, another list, a session stepped alone, a `step` taking over,
/// and a session dropped and its slot taken by one fed the same context.
/// Each stream equals the session's tokens alone: no token is wrong or
/// lost, and a dropped step never serves another session.
#[test]
fn try_step_with_the_sessions_changed_mid_flight_gives_their_own_tokens() {
    let model = load(MatvecLayout::SplitK, "odd_dims");
    let vocab = model.config().vocab_size as u32;
    let (pa, pb, pc) = (ids(41, 7, vocab), ids(42, 2, vocab), ids(43, 15, vocab));
    let n = 14;
    let want =
        [alone_with(&model, 64, &pa, n), alone_with(&model, 64, &pb, n), alone_with(&model, 64, &pc, n)];
    assert!(want[0] != want[1] && want[1] != want[2] && want[0] != want[2], "{want:?}");

    let mut batch = model.batch(&BatchOptions::default().slots(3).capacity_per_slot(64)).unwrap();
    let (mut a, mut b, mut c) =
        (batch.session().unwrap(), batch.session().unwrap(), batch.session().unwrap());
    let mut got_a = vec![a.feed(&pa).unwrap()];
    let mut got_b = vec![b.feed(&pb).unwrap()];
    let mut got_c = vec![c.feed(&pc).unwrap()];

    // After a call that returns tokens, the next step of its sessions is
    // in flight. [a, b], then [b, a] (another order): a changed list never
    // returns tokens at once.
    try_until(&mut batch, &mut [(&mut a, &mut got_a), (&mut b, &mut got_b)]);
    assert!(try_once(&mut batch, &mut [&mut b, &mut a]).is_none());
    try_until(&mut batch, &mut [(&mut b, &mut got_b), (&mut a, &mut got_a)]);
    // In flight for [b, a]; then [c, a] (another list).
    try_until(&mut batch, &mut [(&mut c, &mut got_c), (&mut a, &mut got_a)]);
    // `step` takes over the step of a try_step that returned None, and
    // try_step the step `step` queued ahead.
    assert!(try_once(&mut batch, &mut [&mut a, &mut b]).is_none());
    step(&mut batch, &mut [(&mut a, &mut got_a), (&mut b, &mut got_b)]);
    step(&mut batch, &mut [(&mut a, &mut got_a), (&mut b, &mut got_b)]);
    try_until(&mut batch, &mut [(&mut a, &mut got_a), (&mut b, &mut got_b)]);
    // In flight for [a, b]; `a` steps alone, then both again.
    got_a.push(a.next_token().unwrap());
    try_until(&mut batch, &mut [(&mut a, &mut got_a), (&mut b, &mut got_b)]);
    // In flight for [b, c]; `b` is dropped and its slot taken by `d`, fed
    // b's context (same length, pending token and feed count): the step in
    // flight never serves [d, c], and d goes on as b would have, in the
    // batch and alone.
    try_until(&mut batch, &mut [(&mut b, &mut got_b), (&mut c, &mut got_c)]);
    let context = b.tokens().unwrap();
    let pending = b.pending();
    drop(b);
    let mut d = batch.session().unwrap();
    assert_eq!(Some(d.feed(&context).unwrap()), pending);
    try_until(&mut batch, &mut [(&mut d, &mut got_b), (&mut c, &mut got_c)]);
    got_b.push(d.next_token().unwrap()); // reads the token the step gave d
    while got_a.len() < n || got_b.len() < n || got_c.len() < n {
        try_until(&mut batch, &mut [(&mut d, &mut got_b), (&mut c, &mut got_c), (&mut a, &mut got_a)]);
    }
    assert_eq!(got_a[..n], want[0][..], "a");
    assert_eq!(got_b[..n], want[1][..], "b");
    assert_eq!(got_c[..n], want[2][..], "c");
}

/// `try_step` until it gives the tokens of `sessions[i]` for each `i` of
/// `rows` (ascending), each the token `alone[i]`, the same session
/// decoding alone, gives.
fn try_rows(batch: &mut Batch, sessions: &mut [Session], alone: &mut [Session], rows: &[usize]) {
    let mut picked: Vec<&mut Session> =
        sessions.iter_mut().enumerate().filter(|(i, _)| rows.contains(i)).map(|(_, s)| s).collect();
    let tokens = loop {
        match try_once(batch, &mut picked) {
            Some(tokens) => break tokens,
            None => std::thread::sleep(std::time::Duration::from_micros(200)),
        }
    };
    let want: Vec<u32> = rows.iter().map(|&i| alone[i].next_token().unwrap()).collect();
    assert_eq!(tokens, want, "rows {rows:?}");
}

/// `try_step` hands its submits to the batch's thread; a member's own
/// calls wait for them: a truncate and a feed over the positions a step
/// still on its way writes (each handed-off submit delayed) leave every
/// token equal to the session's own alone.
#[test]
fn a_members_own_calls_come_after_the_steps_handed_to_the_batchs_thread() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let mut batch = model.batch(&BatchOptions::default().slots(2).capacity_per_slot(64)).unwrap();
    batch.debug_delay_submits(std::time::Duration::from_millis(100));
    let mut sessions: Vec<Session> = (0..2).map(|_| batch.session().unwrap()).collect();
    let mut alone: Vec<Session> = (0..2).map(|_| model.session_with_capacity(64).unwrap()).collect();
    for (i, (s, own)) in sessions.iter_mut().zip(&mut alone).enumerate() {
        let prompt = ids(51 + i as u32, 6 + 2 * i, vocab);
        assert_eq!(s.feed(&prompt).unwrap(), own.feed(&prompt).unwrap());
    }
    for _ in 0..3 {
        try_rows(&mut batch, &mut sessions, &mut alone, &[0, 1]);
    }
    assert!(batch.debug_submits_on_thread() >= 4, "steps submitted on the caller's thread");
    // The step behind the last one (at the rows' lengths) is still on its
    // way: the feed rewrites that position of session 0's cache.
    let len = sessions[0].len();
    for s in [&mut sessions[0], &mut alone[0]] {
        s.truncate(len - 2).unwrap();
    }
    let new = ids(77, 5, vocab);
    assert_eq!(sessions[0].feed(&new).unwrap(), alone[0].feed(&new).unwrap());
    // Long enough for the step on its way to land: its cache rows must
    // lie under the feed's, not over them.
    std::thread::sleep(std::time::Duration::from_millis(400));
    let dir = tempfile::tempdir().unwrap();
    let (member, own) = (dir.path().join("member"), dir.path().join("alone"));
    sessions[0].save(&member).unwrap();
    alone[0].save(&own).unwrap();
    assert!(std::fs::read(&member).unwrap() == std::fs::read(&own).unwrap(), "the member's cache differs");
    for _ in 0..6 {
        try_rows(&mut batch, &mut sessions, &mut alone, &[0, 1]);
    }
}

/// `try_step` never records a step on the caller's thread: a list's first
/// step is recorded on the batch's recorder and submitted by a later call,
/// and each step after it is recorded there right after the one before is
/// submitted. A change of the sessions (one joining, one leaving, sessions
/// fed and one given other sampling parameters) is recorded anew, never
/// served by commands recorded for the sessions before it, even where the
/// rows' positions are those recorded ahead: every token equals the
/// session's own alone.
#[test]
fn try_step_records_the_next_step_ahead_and_never_submits_a_stale_recording() {
    let model = load(MatvecLayout::RowsPerTeam, "gqa2_hd64");
    let vocab = model.config().vocab_size as u32;
    let mut batch = model.batch(&BatchOptions::default().slots(3).capacity_per_slot(64)).unwrap();
    let mut sessions: Vec<Session> = (0..3).map(|_| batch.session().unwrap()).collect();
    let mut alone: Vec<Session> = (0..3).map(|_| model.session_with_capacity(64).unwrap()).collect();
    for (i, (s, own)) in sessions.iter_mut().zip(&mut alone).enumerate() {
        let prompt = ids(51 + i as u32, 4 + 3 * i, vocab);
        assert_eq!(s.feed(&prompt).unwrap(), own.feed(&prompt).unwrap());
    }
    let inline = |batch: &Batch| batch.debug_step_recordings().0;

    let steps = 6;
    for _ in 0..steps {
        try_rows(&mut batch, &mut sessions, &mut alone, &[0, 1]);
    }
    let (on_caller, ahead, _) = batch.debug_step_recordings();
    assert_eq!(on_caller, 0, "steps recorded on the caller's thread");
    // The first step, and the one behind each call that gave tokens.
    assert!(ahead > steps, "{ahead} steps recorded ahead for {steps} calls giving tokens");

    // One joins, then one leaves: each change is recorded once.
    for _ in 0..3 {
        try_rows(&mut batch, &mut sessions, &mut alone, &[0, 1, 2]);
    }
    assert_eq!(inline(&batch), 0);
    for _ in 0..3 {
        try_rows(&mut batch, &mut sessions, &mut alone, &[0, 2]);
    }
    assert_eq!(inline(&batch), 0);
    // Three calls after a change, the commands recorded ahead are for the
    // rows' next positions and the readback buffer a changed list's first
    // step copies to; each row's pending token replaced by another one fed
    // brings the rows to those positions. One of them samples from now on,
    // so commands recorded before (its row taking the batch's argmax)
    // would give it the greedy token.
    let sampled = SamplingParams::default().temperature(1.5).top_k(50).seed(5);
    for i in [0, 2] {
        if i == 0 {
            sessions[i].set_sampling(&sampled).unwrap();
            alone[i].set_sampling(&sampled).unwrap();
        }
        let token = ids(60 + i as u32, 1, vocab);
        for s in [&mut sessions[i], &mut alone[i]] {
            s.truncate(s.len()).unwrap();
        }
        assert_eq!(sessions[i].feed(&token).unwrap(), alone[i].feed(&token).unwrap());
    }
    for _ in 0..4 {
        try_rows(&mut batch, &mut sessions, &mut alone, &[0, 2]);
    }
    assert_eq!(inline(&batch), 0);
}
