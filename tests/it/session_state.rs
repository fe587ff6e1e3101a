//! A session's state beyond one session, and feeding without blocking:
//! `Session::fork` (the prefix copied on the GPU), `Session::save` /
//! `Model::restore_session` (a versioned, checksummed file tied to the
//! model's weights fingerprint, written atomically), and
//! `Session::begin_feed` / `poll_feed` (one prompt batch per poll, never a
//! wait).

use std::path::{Path, PathBuf};

use qwen3_wgpu::{CachePolicy, Engine, FeedStatus, LoadOptions, Model, Session};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

fn engine() -> &'static Engine {
    crate::support::engine()
}

fn load(engine: &Engine, name: &str) -> Model {
    engine.load(fixture(name), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap()
}

/// The fixture's prompt.
fn prompt() -> Vec<u32> {
    let text = std::fs::read_to_string(fixture("gqa2_hd64").join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Greedy tokens after `first` was fed: it, then `n - 1` more.
fn continue_for(session: &mut Session, first: u32, n: usize) -> Vec<u32> {
    std::iter::once(first).chain((1..n).map(|_| session.next_token().unwrap())).collect()
}

/// The tokens a fresh session gives after being fed `ids`.
fn fresh(model: &Model, ids: &[u32], n: usize) -> Vec<u32> {
    let mut s = model.session_with_capacity(128).unwrap();
    let first = s.feed(ids).unwrap();
    continue_for(&mut s, first, n)
}

fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

/// A fork after a shared prompt continues exactly as a fresh session fed
/// the whole sequence, at the parent's capacity, a smaller and a larger one
/// (a copy per KV head when the capacity changes), and the parent is
/// undisturbed by the forks' steps, before and after its own.
#[test]
fn a_fork_continues_as_a_fresh_session_and_leaves_the_parent_alone() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let shared = prompt();
    let (b, c) = ([5u32, 17, 3, 250], [44u32, 91, 600]);
    let mut parent = model.session_with_capacity(64).unwrap();
    let first = parent.feed(&shared).unwrap();
    // The forks hold the pending token too: a feed commits it first.
    let want_b = fresh(&model, &cat(&[&shared, &[first], &b]), 6);
    let want_c = fresh(&model, &cat(&[&shared, &[first], &c]), 6);
    for capacity in [64, 24, 100] {
        let mut child = parent.fork_with_capacity(capacity).unwrap();
        assert_eq!((child.len(), child.pending(), child.capacity()), (parent.len(), Some(first), capacity));
        assert_eq!(child.tokens().unwrap(), shared);
        let got = child.feed(&b).unwrap();
        assert_eq!(continue_for(&mut child, got, 6), want_b, "capacity {capacity}");
    }
    // The parent, after its forks ran: as if they never had.
    let mut child = parent.fork().unwrap();
    let got = parent.feed(&c).unwrap();
    let mut parent_tokens = vec![got];
    // Interleaved steps: the child's do not touch the parent's KV cache.
    let got = child.feed(&b).unwrap();
    let mut child_tokens = vec![got];
    for _ in 1..6 {
        parent_tokens.push(parent.next_token().unwrap());
        child_tokens.push(child.next_token().unwrap());
    }
    assert_eq!(parent_tokens, want_c);
    assert_eq!(child_tokens, want_b);

    // A fork while steps are queued ahead of the caller: the fork holds
    // the positions taken so far and continues as the parent does.
    let mut parent = model.session_with_capacity(64).unwrap();
    let first = parent.feed(&shared).unwrap();
    let mut taken = vec![first, parent.next_token().unwrap()];
    let mut child = parent.fork().unwrap();
    assert_eq!(child.len(), shared.len() + 1);
    for _ in 0..4 {
        taken.push(parent.next_token().unwrap());
    }
    let child_next: Vec<u32> = (0..4).map(|_| child.next_token().unwrap()).collect();
    assert_eq!(child_next, taken[2..]);
    assert_eq!(taken, fresh(&model, &shared, 6));
}

#[test]
fn a_fork_smaller_than_the_context_is_context_overflow() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let mut s = model.session_with_capacity(64).unwrap();
    s.feed(&prompt()).unwrap();
    let e = s.fork_with_capacity(s.len() - 1).err().unwrap();
    assert!(matches!(e, qwen3_wgpu::Error::ContextOverflow { needed, .. } if needed == s.len()), "{e}");
    let e = s.fork_with_capacity(usize::MAX).err().unwrap();
    assert_eq!(e.code(), "context_overflow");
    // An empty session forks into an empty one.
    let empty = model.session_with_capacity(8).unwrap().fork().unwrap();
    assert!(empty.is_empty() && empty.pending().is_none());
}

/// Save, then restore: the same positions, tokens and pending token, and
/// the same next tokens, at the saved capacity and at one just large
/// enough; a smaller one is context_overflow.
#[test]
fn a_restored_session_continues_as_the_saved_one() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("npc.q3s");
    let mut s = model.session_with_capacity(64).unwrap();
    let first = s.feed(&prompt()).unwrap();
    s.next_token().unwrap();
    s.next_token().unwrap(); // steps queued ahead while saving
    s.save(&path).unwrap();
    let layers_bytes = 2 * 2 * 2 * 32 * 4; // layers * (K, V) * heads * words * 4
    let want_size = 96 + 4 * s.len() + layers_bytes * s.len();
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, want_size);
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["npc.q3s"], "no temporary file is left");

    let mut restored = model.restore_session(&path).unwrap();
    assert_eq!((restored.len(), restored.pending(), restored.capacity()), (s.len(), s.pending(), 64));
    assert_eq!(restored.tokens().unwrap(), s.tokens().unwrap());
    assert_eq!(restored.tokens().unwrap()[prompt().len()], first);
    let mut tight = model.restore_session_with_capacity(&path, s.len() + 5).unwrap();
    assert_eq!(tight.capacity(), s.len() + 5);
    let want: Vec<u32> = (0..5).map(|_| s.next_token().unwrap()).collect();
    let got: Vec<u32> = (0..5).map(|_| restored.next_token().unwrap()).collect();
    assert_eq!(got, want);
    let got: Vec<u32> = (0..5).map(|_| tight.next_token().unwrap()).collect();
    assert_eq!(got, want);
    assert_eq!(tight.next_token().unwrap_err().code(), "context_overflow");

    let e = model.restore_session_with_capacity(&path, restored.len() - 6).err().unwrap();
    assert_eq!(e.code(), "context_overflow", "{e}");
    // An empty session round-trips too.
    let empty = model.session_with_capacity(8).unwrap();
    empty.save(&path).unwrap();
    let back = model.restore_session(&path).unwrap();
    assert!(back.is_empty() && back.pending().is_none() && back.capacity() == 8);
}

/// The file's checksum is xxh3-64 of everything before the last 16 bytes.
fn reseal(bytes: &mut [u8]) {
    let end = bytes.len() - 16;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..end]);
    bytes[end..end + 8].copy_from_slice(&sum.to_le_bytes());
}

/// Damaged files are session_file_invalid, another model's file is
/// session_model_mismatch, a missing file session_io; the fingerprint does
/// not depend on how the weights were loaded.
#[test]
fn damaged_and_foreign_files_are_named_errors() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.q3s");
    let mut s = model.session_with_capacity(32).unwrap();
    s.feed(&prompt()).unwrap();
    s.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let restore = |bytes: &[u8]| {
        let p = dir.path().join("damaged.q3s");
        std::fs::write(&p, bytes).unwrap();
        model.restore_session(&p).err().map(|e| (e.code(), e.to_string()))
    };
    assert_eq!(restore(&good), None);
    // A flipped bit anywhere: the KV rows, a token, the fingerprint, the checksum.
    for at in [good.len() / 2, 80, 20, good.len() - 12] {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        let (code, message) = restore(&bad).unwrap();
        assert_eq!(code, "session_file_invalid", "byte {at}: {message}");
    }
    for len in [good.len() - 1, good.len() - 100, 50, 0] {
        let (code, message) = restore(&good[..len]).unwrap();
        assert_eq!(code, "session_file_invalid", "{len} bytes: {message}");
    }
    let mut extended = good.clone();
    extended.push(0);
    assert_eq!(restore(&extended).unwrap().0, "session_file_invalid");
    // A later format version, resealed so that only the version differs.
    let mut other_version = good.clone();
    other_version[8..12].copy_from_slice(&3u32.to_le_bytes());
    reseal(&mut other_version);
    let (code, message) = restore(&other_version).unwrap();
    assert_eq!(code, "session_file_invalid");
    assert!(message.contains("version 3"), "{message}");
    // Version 1 (f16 caches only) has no int8 flag: a file claiming one is
    // refused; the same file without it restores (the layouts agree).
    let mut v1 = good.clone();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    reseal(&mut v1);
    assert_eq!(restore(&v1), None);
    let mut v1_int8 = v1.clone();
    v1_int8[12] |= 2;
    reseal(&mut v1_int8);
    assert_eq!(restore(&v1_int8).unwrap().0, "session_file_invalid");
    // A token outside the vocabulary, resealed.
    let mut bad_token = good.clone();
    bad_token[80..84].copy_from_slice(&5000u32.to_le_bytes());
    reseal(&mut bad_token);
    let (code, message) = restore(&bad_token).unwrap();
    assert_eq!(code, "session_file_invalid");
    assert!(message.contains("5000"), "{message}");

    // Another model of the same shape, and one of another shape.
    for other in ["prompt_1tok", "mqa_hd64"] {
        let other = load(engine, other);
        assert_ne!(other.fingerprint(), model.fingerprint());
        let e = other.restore_session(&path).err().unwrap();
        assert_eq!(e.code(), "session_model_mismatch", "{e}");
        assert!(e.to_string().contains(model.fingerprint()), "{e}");
    }
    let e = model.restore_session(dir.path().join("missing.q3s")).err().unwrap();
    assert_eq!(e.code(), "session_io", "{e}");
    let e = model.restore_session(dir.path()).err().unwrap();
    assert_eq!(e.code(), "session_file_invalid", "a directory: {e}");

    // The same weights loaded through the cache (converted, then a hit)
    // have the same fingerprint, and restore the file.
    let cache = tempfile::tempdir().unwrap();
    let options = LoadOptions { cache: CachePolicy::Dir(cache.path().to_path_buf()), ..Default::default() };
    for converted in [true, false] {
        let cached = engine.load(fixture("gqa2_hd64"), &options).unwrap();
        assert_eq!(cached.load_report().converted, converted);
        assert_eq!(cached.fingerprint(), model.fingerprint());
        cached.restore_session(&path).unwrap();
    }
}

/// A save that cannot complete is session_io and leaves no file: a missing
/// directory, a parent that is a file, a target that is a directory. An
/// earlier file at the path is kept whole.
#[test]
fn a_failed_save_leaves_no_file() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let dir = tempfile::tempdir().unwrap();
    let mut s = model.session_with_capacity(32).unwrap();
    s.feed(&prompt()).unwrap();
    let listing = |d: &Path| {
        let mut names: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let e = s.save(dir.path().join("missing/s.q3s")).unwrap_err();
    assert_eq!(e.code(), "session_io", "{e}");
    assert!(listing(dir.path()).is_empty());
    std::fs::write(dir.path().join("file"), b"x").unwrap();
    let e = s.save(dir.path().join("file/s.q3s")).unwrap_err();
    assert_eq!(e.code(), "session_io", "{e}");
    std::fs::create_dir(dir.path().join("taken")).unwrap();
    std::fs::write(dir.path().join("taken/inside"), b"x").unwrap();
    let e = s.save(dir.path().join("taken")).unwrap_err();
    assert_eq!(e.code(), "session_io", "{e}");
    assert_eq!(listing(dir.path()), ["file", "taken"]);
    // Saving over an earlier file replaces it whole.
    let path = dir.path().join("s.q3s");
    s.save(&path).unwrap();
    s.next_token().unwrap();
    s.save(&path).unwrap();
    assert_eq!(model.restore_session(&path).unwrap().len(), s.len());
    assert_eq!(listing(dir.path()), ["file", "s.q3s", "taken"]);
}

/// Polls until the feed is done, checking after every call that it
/// submitted at most one batch, only once the batch before it was done
/// (`batch` positions each), and never waited on the GPU. Returns the
/// token and the submits made.
fn poll_to_the_end(s: &mut Session, batch: usize, total: usize) -> (u32, usize) {
    let (mut submits, waits) = s.debug_feed_counts();
    // The first batch is submitted by begin_feed if already recorded, else
    // by a poll.
    assert!(submits <= 1, "begin_feed submitted {submits} batches");
    loop {
        // A frame's worth of other work.
        std::thread::sleep(std::time::Duration::from_millis(1));
        let status = s.poll_feed().unwrap();
        let (now, waits_now) = s.debug_feed_counts();
        assert_eq!(waits_now, waits, "a poll waited on the GPU");
        match status {
            FeedStatus::Ready(token) => return (token, submits),
            FeedStatus::Pending { fed, total: t } => {
                assert_eq!(t, total);
                assert!(now == submits || now == submits + 1, "{submits} -> {now} submits in one poll");
                if now == submits + 1 {
                    // Every batch submitted before this one is done.
                    assert_eq!(fed, (submits * batch).min(total - 1), "submit {now}");
                }
                submits = now;
            }
            other => panic!("{other:?}"),
        }
    }
}

/// begin_feed + poll_feed give feed's token and state, one batch per poll
/// at most, each after the one before it is done, with no wait on the GPU;
/// also when steps were queued ahead and a pending token is committed
/// first.
#[test]
fn a_polled_feed_equals_feed_and_never_waits() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    // 300 positions: batches of PREFILL_BATCH (256) and 44, the last one
    // choosing the token after the prompt.
    assert_eq!(qwen3_wgpu::PREFILL_BATCH, 256);
    let long: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 1000).collect();
    let mut s = model.session_with_capacity(320).unwrap();
    let mut blocking = model.session_with_capacity(320).unwrap();
    let want = blocking.feed(&long).unwrap();
    s.begin_feed(&long).unwrap();
    assert!(s.is_feeding());
    assert_eq!(s.len(), 0);
    let (token, submits) = poll_to_the_end(&mut s, 256, 300);
    assert_eq!((token, submits), (want, 2));
    // Both batches were recorded on the session's recording thread, none
    // on the caller's (a blocking feed records its 2 there).
    assert_eq!(s.debug_inline_feed_recordings(), 0, "a polled feed recorded on the caller's thread");
    assert_eq!(blocking.debug_inline_feed_recordings(), 2);
    // Nor submitted there, the last submit included.
    assert_eq!(s.debug_inline_feed_submits(), 0, "a polled feed submitted on the caller's thread");
    assert_eq!(blocking.debug_inline_feed_submits(), 2);
    assert!(!s.is_feeding());
    assert_eq!((s.len(), s.pending()), (blocking.len(), blocking.pending()));
    assert_eq!(continue_for(&mut s, token, 5), continue_for(&mut blocking, want, 5));

    // Steps queued ahead and a pending token: begin_feed discards the
    // steps without waiting and commits the token ahead of the ids.
    let mut s = model.session_with_capacity(64).unwrap();
    let mut blocking = model.session_with_capacity(64).unwrap();
    for session in [&mut s, &mut blocking] {
        session.feed(&prompt()).unwrap();
        session.next_token().unwrap();
    }
    let (_, waits) = s.debug_feed_counts();
    let more: Vec<u32> = (0..40u32).map(|i| (i * 13 + 7) % 1000).collect();
    s.begin_feed(&more).unwrap();
    assert_eq!(s.debug_feed_counts().1, waits, "begin_feed waited for the discarded steps");
    let (token, submits) = poll_to_the_end(&mut s, 64, 41);
    let want = blocking.feed(&more).unwrap();
    assert_eq!((token, submits), (want, 1));
    assert_eq!(s.tokens().unwrap(), blocking.tokens().unwrap());
    assert_eq!(continue_for(&mut s, token, 4), continue_for(&mut blocking, want, 4));
    // One id and nothing pending: its decode step alone.
    let mut s = model.session_with_capacity(8).unwrap();
    s.begin_feed(&[7]).unwrap();
    let (token, submits) = poll_to_the_end(&mut s, 8, 1);
    assert_eq!((token, submits), (fresh(&model, &[7], 1)[0], 1));
}

/// Polled feeds take turns on the device: while one feed's prompt submit is
/// in flight (here: the ticket held), no other feed submits, whichever
/// session (conversations restarting in one frame would otherwise queue a
/// batch each ahead of the host's next frame); once it is done they go on
/// and give the blocking feeds' tokens. A dedicated engine: the ticket is
/// per device.
#[test]
fn polled_feeds_take_turns_on_the_device() {
    let engine = qwen3_wgpu::Engine::builder().policy(qwen3_wgpu::AdapterPolicy::Portable).build().unwrap();
    let model = load(&engine, "gqa2_hd64");
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|k| (0..40u32).map(|i| (i * 17 + 5 * k + 3) % 1000).collect()).collect();
    let mut sessions: Vec<Session> = (0..3).map(|_| model.session_with_capacity(64).unwrap()).collect();
    let hold = sessions[0].debug_hold_prompt_ticket().expect("the ticket is free");
    assert!(sessions[1].debug_hold_prompt_ticket().is_none(), "one ticket a device");
    for (s, p) in sessions.iter_mut().zip(&prompts) {
        s.begin_feed(p).unwrap();
    }
    for _ in 0..20 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        for s in sessions.iter_mut() {
            assert_eq!(s.poll_feed().unwrap(), FeedStatus::Pending { fed: 0, total: 40 });
            assert_eq!(s.debug_feed_counts().0, 0, "a feed submitted while another's submit was in flight");
        }
    }
    drop(hold);
    let mut tokens = vec![None; 3];
    while tokens.iter().any(Option::is_none) {
        std::thread::sleep(std::time::Duration::from_millis(1));
        for (s, t) in sessions.iter_mut().zip(tokens.iter_mut()) {
            if t.is_none() {
                if let FeedStatus::Ready(token) = s.poll_feed().unwrap() {
                    *t = Some(token);
                }
            }
        }
    }
    for (p, t) in prompts.iter().zip(tokens) {
        let mut blocking = model.session_with_capacity(64).unwrap();
        assert_eq!(t, Some(blocking.feed(p).unwrap()));
    }
}

/// While a feed is in progress every other call that runs the model or
/// changes the context is invalid_argument naming the session, and the
/// feed goes on unharmed; poll_feed without a feed is invalid_argument.
#[test]
fn calls_during_a_feed_are_named_errors() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let mut s = model.session_with_capacity(64).unwrap();
    let e = s.poll_feed().unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
    assert!(e.to_string().contains("begin_feed"), "{e}");
    let ids = prompt();
    s.begin_feed(&ids).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let errors = [
        s.feed(&[1]).err(),
        s.begin_feed(&[1]).err(),
        s.next_token().err(),
        s.try_next_token().err(),
        s.truncate(0).err(),
        s.fork().err(),
        s.save(dir.path().join("s.q3s")).err(),
        s.tokens().err(),
    ];
    for (i, e) in errors.into_iter().enumerate() {
        let e = e.unwrap_or_else(|| panic!("call {i} succeeded during a feed"));
        assert_eq!(e.code(), "invalid_argument", "call {i}: {e}");
        assert!(e.to_string().contains("session") && e.to_string().contains("poll_feed"), "{e}");
    }
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    let token = loop {
        if let FeedStatus::Ready(t) = s.poll_feed().unwrap() {
            break t;
        }
    };
    assert_eq!(token, fresh(&model, &ids, 1)[0]);
    // Bad input to begin_feed is refused before anything starts.
    assert_eq!(s.begin_feed(&[]).unwrap_err().code(), "empty_prompt");
    assert_eq!(s.begin_feed(&[5000]).unwrap_err().code(), "invalid_token_id");
    assert_eq!(s.begin_feed(&[1; 100]).unwrap_err().code(), "context_overflow");
    assert!(!s.is_feeding());
    assert_eq!(s.next_token().unwrap(), fresh(&model, &ids, 2)[1]);
}

/// A session file as the format lays it out (see `src/session/state.rs`),
/// from its fields, with its checksum and end magic.
struct Crafted<'a> {
    fingerprint: &'a [u8],
    layers: u32,
    heads: u32,
    head_dim: u32,
    capacity: u64,
    len: u64,
    /// Bytes after the header (token ids, then KV rows).
    body: Vec<u8>,
}

impl Crafted<'_> {
    fn bytes(&self) -> Vec<u8> {
        let mut b = b"Q3WSESSN".to_vec();
        b.extend_from_slice(&1u32.to_le_bytes()); // format version 1 (still read)
        b.extend_from_slice(&0u32.to_le_bytes()); // no pending token
        b.extend_from_slice(self.fingerprint);
        for v in [self.layers, self.heads, self.head_dim, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.capacity.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        assert_eq!(b.len(), 80);
        b.extend_from_slice(&self.body);
        b.extend_from_slice(&[0; 16]);
        reseal(&mut b);
        let end = b.len() - 8;
        b[end..].copy_from_slice(b"Q3WSEND\0");
        b
    }
}

/// Restores `path` on a worker thread: a run longer than a few seconds
/// (a read that never ends, a multi-terabyte allocation being filled)
/// fails the test instead of hanging it.
fn restore_within_limit(model: &Model, path: &Path) -> qwen3_wgpu::Result<Session> {
    const LIMIT: std::time::Duration = std::time::Duration::from_secs(20);
    let (model, path) = (model.clone(), path.to_path_buf());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(model.restore_session(&path));
    });
    match rx.recv_timeout(LIMIT) {
        Ok(result) => result,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("no answer within {LIMIT:?}: the restore hangs")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the restore panicked (see above)"),
    }
}

/// Headers whose sizes would make a reader allocate far more than the file
/// holds, each with a checksum that holds: a named error in-process, at
/// once, never an allocation sized by the header (the first, 100 bytes on
/// disk, claims 0 layers of 2^20 heads of 2^21 dimensions: 8 TiB a layer).
#[test]
fn crafted_headers_are_named_errors_without_huge_allocations() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let own = model.fingerprint().as_bytes().to_vec();
    assert_eq!(own.len(), 32);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crafted.q3s");
    let base =
        Crafted { fingerprint: &own, layers: 2, heads: 2, head_dim: 64, capacity: 64, len: 0, body: vec![] };
    let cases = [
        // Consistent with its own length: 0 layers, one token.
        (
            "8 TiB a layer, 0 layers",
            "session_file_invalid",
            Crafted {
                layers: 0,
                heads: 1 << 20,
                head_dim: 1 << 21,
                capacity: 1,
                len: 1,
                body: vec![0; 4],
                ..base
            },
        ),
        // The same from another model's fingerprint: intact, so another model's.
        (
            "8 TiB a layer, another model",
            "session_model_mismatch",
            Crafted {
                fingerprint: &[b'0'; 32],
                layers: 0,
                heads: 1 << 20,
                head_dim: 1 << 21,
                capacity: 1,
                len: 1,
                body: vec![0; 4],
            },
        ),
        // This model's shape and a plausible context, but a short file.
        (
            "4,000 positions in 100 bytes",
            "session_file_invalid",
            Crafted { capacity: 4096, len: 4000, body: vec![0; 4], ..base },
        ),
        // Sizes whose product overflows 64 bits.
        (
            "2^64 bytes",
            "session_file_invalid",
            Crafted {
                layers: u32::MAX,
                heads: u32::MAX,
                head_dim: u32::MAX - 1,
                capacity: u64::MAX,
                len: u64::MAX,
                ..base
            },
        ),
        // This model's shape, more positions than it holds (4,096), in a
        // file of that length: refused for the context, read only through
        // the checksum.
        (
            "past max_position_embeddings",
            "context_overflow",
            Crafted { capacity: 5000, len: 5000, body: vec![0; 5000 * (4 + 2 * 2 * 2 * 32 * 4)], ..base },
        ),
    ];
    for (name, want, crafted) in cases {
        let bytes = crafted.bytes();
        std::fs::write(&path, &bytes).unwrap();
        let started = std::time::Instant::now();
        let e = restore_within_limit(&model, &path).err().unwrap_or_else(|| panic!("{name}: restored"));
        assert_eq!(e.code(), want, "{name} ({} bytes): {e}", bytes.len());
        assert!(started.elapsed().as_secs() < 5, "{name}: {:?}", started.elapsed());
    }
    // The same layout with this model's shape and real rows restores: the
    // crafting above is the format.
    let row_bytes = 2 * 2 * 2 * 32 * 4;
    let valid = Crafted {
        capacity: 16,
        len: 3,
        body: [vec![7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0], vec![0; 3 * row_bytes]].concat(),
        ..base
    };
    std::fs::write(&path, valid.bytes()).unwrap();
    let s = restore_within_limit(&model, &path).unwrap();
    assert_eq!((s.len(), s.capacity(), s.tokens().unwrap()), (3, 16, vec![7, 8, 9]));
}

/// Only regular files are read: a FIFO (which has no writer) and a link to
/// /dev/zero (which never ends) are session_file_invalid at once; a link
/// to a session file restores it.
#[cfg(unix)]
#[test]
fn a_fifo_or_a_device_is_refused_without_reading() {
    let engine = engine();
    let model = load(engine, "gqa2_hd64");
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.q3s");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(status.success());
    let zero = dir.path().join("zero.q3s");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for path in [&fifo, &zero] {
        let e = restore_within_limit(&model, path).err().unwrap();
        assert_eq!(e.code(), "session_file_invalid", "{}: {e}", path.display());
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
    let saved = dir.path().join("saved.q3s");
    let mut s = model.session_with_capacity(16).unwrap();
    s.feed(&[5, 6, 7]).unwrap();
    s.save(&saved).unwrap();
    let link = dir.path().join("link.q3s");
    std::os::unix::fs::symlink(&saved, &link).unwrap();
    let restored = restore_within_limit(&model, &link).unwrap();
    assert_eq!((restored.tokens().unwrap(), restored.pending()), (vec![5, 6, 7], s.pending()));
}
