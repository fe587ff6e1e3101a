use crate::{AdapterPolicy, CachePolicy, Engine, LoadOptions, Model};

fn fixture_model() -> Model {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
    engine.load(fixture, &options).unwrap()
}

/// A non-blocking call submits at most one batch of steps (a frame
/// pays for one submit per call, not for refilling the whole
/// lookahead), the next submit is recorded ahead meanwhile, and the
/// tokens are those of blocking calls, whatever the lookahead.
#[test]
fn try_next_token_submits_at_most_once_per_call_and_records_ahead() {
    let model = fixture_model();
    let prompt = [1u32, 2, 3];
    let mut blocking = model.session_with_capacity(40).unwrap();
    let mut want = vec![blocking.feed(&prompt).unwrap()];
    while blocking.len() < blocking.capacity() {
        want.push(blocking.next_token().unwrap());
    }
    for lookahead in [1, 2, 4, 8] {
        let mut s = model.session_with_capacity(40).unwrap();
        s.set_lookahead(lookahead);
        let mut got = vec![s.feed(&prompt).unwrap()];
        // The first submit after the feed is being recorded already.
        let first = s.prerecorded.as_ref().map(|p| p.positions.clone());
        assert_eq!(first, Some(s.gpu_pos..s.gpu_pos + s.steps_per_submit()), "lookahead {lookahead}");
        let waits = s.debug_feed_counts().1;
        let mut recorded_ahead = false;
        while s.len() < s.capacity() {
            let before = s.debug_decode_submits();
            let token = s.try_next_token().unwrap();
            assert!(
                s.debug_decode_submits() <= before + 1,
                "lookahead {lookahead}: several submits in one call"
            );
            // Once steps are queued, the next submit is being recorded
            // (unless the capacity leaves no room for one).
            if let Some(p) = &s.prerecorded {
                assert_eq!(p.positions.start, s.gpu_pos, "lookahead {lookahead}");
                recorded_ahead = true;
            }
            match token {
                Some(t) => got.push(t),
                None => std::thread::sleep(std::time::Duration::from_micros(200)),
            }
        }
        assert!(recorded_ahead, "lookahead {lookahead}: nothing recorded ahead");
        assert_eq!(got, want, "lookahead {lookahead}");
        assert_eq!(s.debug_feed_counts().1, waits, "lookahead {lookahead}: a non-blocking call waited");
    }
}

/// The recorder's launches are the forward pass's at every position:
/// one attention launch per layer within the first chunk, chunks and
/// their reduction past it, and the packed attention's (a pipeline of its
/// own) from the packing start on, in a session that reaches it.
#[test]
fn recorded_steps_are_the_forward_pass_steps() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).attention_pack_from(600).build().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    let model =
        engine.load(fixture, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let chunk = crate::kernels::ATTENTION_CHUNK as usize;
    let own_pipelines = |l: &crate::kernels::Launch| l.decode_pipeline.is_some();
    for capacity in [8, 1000] {
        let s = model.session_with_capacity(capacity).unwrap();
        assert_eq!(s.forward.pack_from(), (capacity > 600).then_some(600));
        let launches = super::recorder::StepLaunches::of(&s.forward);
        for pos in [0, 1, chunk - 1, chunk, chunk + 1, 599, 600, 3 * chunk] {
            let want: Vec<_> =
                s.forward.step_at(pos).map(|l| (l.kind(), l.workgroups, own_pipelines(l))).collect();
            let got: Vec<_> =
                launches.at(pos).iter().map(|l| (l.kind(), l.workgroups, own_pipelines(l))).collect();
            assert_eq!(got, want, "capacity {capacity} position {pos}");
        }
        assert_ne!(launches.at(0).len(), launches.at(chunk).len());
        let owned = |pos| launches.at(pos).iter().filter(|l| own_pipelines(l)).count();
        let packed = if capacity > 600 { 2 } else { 0 }; // one a layer
        assert_eq!(owned(600) - owned(599), packed, "capacity {capacity}");
    }
}

/// Counts past the capacity are refused whatever their size (no
/// wrapping `len + n`, no readback buffer per requested step), and
/// leave the session as it was.
#[test]
fn huge_counts_are_refused_not_wrapped() {
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    let options = LoadOptions { cache: CachePolicy::Disabled, ..Default::default() };
    let model = engine.load(fixture, &options).unwrap();
    let decode = |lookahead: Option<usize>| {
        let mut s = model.session_with_capacity(6).unwrap();
        if let Some(steps) = lookahead {
            s.set_lookahead(steps);
            assert!(s.slots.len() <= s.capacity() + 1, "{} readbacks", s.slots.len());
        }
        let mut tokens = vec![s.feed(&[1, 2]).unwrap()];
        let e = s.gpu_time_of_steps(usize::MAX).unwrap_err();
        assert_eq!(e.code(), "context_overflow", "{e}");
        assert_eq!(s.len(), 2);
        while s.len() < s.capacity() {
            tokens.push(s.next_token().unwrap());
        }
        assert_eq!(s.next_token().unwrap_err().code(), "context_overflow");
        tokens
    };
    assert_eq!(decode(Some(usize::MAX)), decode(None));
    let mut s = model.session_with_capacity(6).unwrap();
    s.feed(&[1, 2]).unwrap();
    let e = s.profile_gpu(u32::MAX).unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    assert!(e.to_string().contains("repeats"), "{e}");
    assert_eq!(s.len(), 2);
}
