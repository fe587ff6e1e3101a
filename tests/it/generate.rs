//! Generation with stopping: end-of-text ids, stop strings matched on the
//! decoded text across token boundaries, a callback, a token budget.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use qwen3_wgpu::{
    AdapterPolicy, CachePolicy, Engine, GenerateOptions, LoadOptions, Model, StopReason, Tokenizer,
};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64")
}

/// The Qwen3 tokenizer: the fixture's ids (< 1000) are byte-level tokens
/// and early merges of it, so they decode to text.
fn tokenizer() -> Tokenizer {
    Tokenizer::from_checkpoint(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tokenizer"))
        .unwrap()
}

/// The prompt and the 32 greedy tokens the reference produced.
fn expected() -> (Vec<u32>, Vec<u32>) {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (ids("prompt_ids"), ids("generated_ids"))
}

fn model() -> Model {
    let engine = crate::support::engine();
    engine.load(fixture(), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap()
}

/// The text of each token as a stream hands it out.
fn pieces(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut stream = tokenizer.stream();
    ids.iter().map(|&id| stream.push(id).unwrap()).collect()
}

#[test]
fn a_stop_string_across_token_boundaries_stops_early() {
    let model = model();
    let tokenizer = tokenizer();
    let (prompt, want) = expected();
    let pieces = pieces(&tokenizer, &want);
    // A stop string made of the end of one token's text and the start of
    // the next one's: no single token holds it.
    let j = (4..want.len() - 1)
        .find(|&j| pieces[j].chars().count() >= 2 && !pieces[j + 1].is_empty())
        .expect("two neighbouring tokens with text");
    let tail: String = pieces[j].chars().rev().take(2).collect::<Vec<_>>().into_iter().rev().collect();
    let stop = format!("{tail}{}", pieces[j + 1].chars().next().unwrap());
    let full: String = pieces.concat();
    let at = full.find(&stop).unwrap();
    // Tokens up to the one completing the first occurrence.
    let mut end = 0;
    let n = pieces
        .iter()
        .position(|p| {
            end += p.len();
            end >= at + stop.len()
        })
        .unwrap()
        + 1;
    let before_last: usize = pieces[..n - 1].iter().map(String::len).sum();
    assert!(at < before_last, "the stop string {stop:?} must span a token boundary");
    assert!(n < want.len());

    let options =
        GenerateOptions::default().max_new_tokens(want.len()).stop_strings(&tokenizer, ["never here", &stop]);
    let mut seen = Vec::new();
    let out = model
        .generate_with(&prompt, &options, |t| {
            seen.push(t);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(out.stop_reason, StopReason::StopString(1));
    assert_eq!(out.stop_reason.as_str(), "stop_string");
    assert_eq!(out.generated_ids(), &want[..n]);
    assert_eq!(seen, out.generated_ids());
    assert_eq!(out.text.as_deref(), Some(&full[..at]));
}

#[test]
fn the_callback_stops_after_n_tokens() {
    let model = model();
    let (prompt, want) = expected();
    let mut calls = 0;
    let out = model
        .generate_with(&prompt, &GenerateOptions::default().max_new_tokens(20), |_| {
            calls += 1;
            if calls == 5 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!(calls, 5);
    assert_eq!(out.stop_reason, StopReason::Callback);
    assert_eq!(out.stop_reason.as_str(), "callback");
    assert_eq!(out.generated_ids(), &want[..5]);
    assert_eq!(out.text, None, "no stop strings, no text");
}

#[test]
fn an_extra_end_of_text_id_stops_and_is_kept() {
    let model = model();
    let tokenizer = tokenizer();
    let (prompt, want) = expected();
    // The first occurrence of the fourth token ends generation.
    let eos = want[3];
    let first = want.iter().position(|&t| t == eos).unwrap();
    let options = GenerateOptions::default()
        .max_new_tokens(30)
        .eos_token_ids([eos])
        .stop_strings(&tokenizer, ["never here"]);
    let out = model.generate_with(&prompt, &options, |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(out.stop_reason, StopReason::EndOfText);
    assert_eq!(out.generated_ids(), &want[..=first]);
    // The text leaves the end-of-text token out.
    assert_eq!(out.text.unwrap(), tokenizer.decode(&want[..first]).unwrap());
}

/// Stop strings that never match change nothing: the greedy tokens are the
/// reference's, and the text is all of them.
#[test]
fn greedy_tokens_are_unchanged_without_a_match() {
    let model = model();
    let tokenizer = tokenizer();
    let (prompt, want) = expected();
    let options =
        GenerateOptions::default().max_new_tokens(want.len()).stop_strings(&tokenizer, ["never here"]);
    let out = model.generate_with(&prompt, &options, |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(out.stop_reason, StopReason::MaxNewTokens);
    assert_eq!(out.generated_ids(), &want[..]);
    assert_eq!(out.text.unwrap(), tokenizer.decode(&want).unwrap());
    let plain = model.generate(&prompt, want.len(), |_| {}).unwrap();
    assert_eq!(plain.generated_ids(), &want[..]);
    assert_eq!((plain.stop_reason, plain.text), (StopReason::MaxNewTokens, None));
}

#[test]
fn bad_options_are_named_errors() {
    let model = model();
    let (prompt, _) = expected();
    let go = |options: &GenerateOptions| model.generate_with(&prompt, options, |_| ControlFlow::Continue(()));
    let e = go(&GenerateOptions::default().stop_strings(&tokenizer(), ["ok", ""])).unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
    assert!(e.to_string().contains("stop"), "{e}");
    let e = go(&GenerateOptions::default().eos_token_ids([1000])).unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
    assert!(e.to_string().contains("eos_token_ids"), "{e}");
}

/// `generate` allocates the prompt and the budget, not a fixed 4,096
/// positions: fewer for a short generation, and more when the model's
/// `max_position_embeddings` allows (the fixture with 8,192 positions).
#[test]
fn the_session_holds_the_prompt_and_the_budget() {
    let model = model();
    let (prompt, want) = expected();
    let out = model.generate(&prompt, 5, |_| {}).unwrap();
    assert_eq!(out.kv_capacity, prompt.len() + 4);
    assert_eq!(out.generated_ids(), &want[..5]);
    let small = model.session_with_capacity(out.kv_capacity).unwrap().buffer_bytes();
    assert!(small < model.session().unwrap().buffer_bytes());
    assert_eq!(model.generate(&prompt, 0, |_| {}).unwrap().kv_capacity, 0);

    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = 8192.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(fixture().join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let long =
        engine.load(dir.path(), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let budget = 8192 - prompt.len() + 1;
    let out =
        long.generate_with(&prompt, &GenerateOptions::default().max_new_tokens(budget), |_| {
            ControlFlow::Break(())
        })
        .unwrap();
    assert_eq!(out.kv_capacity, 8192);
    assert_eq!(out.generated_ids(), &want[..1]);
    assert_eq!(long.session_with_capacity(8192).unwrap().capacity(), 8192);
    let e = long.generate(&prompt, budget + 1, |_| {}).unwrap_err();
    assert_eq!(e.code(), "context_overflow");
    assert!(matches!(e, qwen3_wgpu::Error::ContextOverflow { needed: 8193, capacity: 8192 }), "{e}");
}

/// Greedy tokens after `first` was fed: it, then `n - 1` more.
fn continue_for(session: &mut qwen3_wgpu::Session, first: u32, n: usize) -> Vec<u32> {
    std::iter::once(first).chain((1..n).map(|_| session.next_token().unwrap())).collect()
}

/// `truncate` rewinds: after A+B (and steps queued ahead of the caller),
/// truncating to A and feeding C gives the tokens of a fresh session fed A+C.
#[test]
fn truncate_rewinds_to_a_prefix() {
    let model = model();
    let (a, _) = expected();
    let b = [5u32, 17, 3, 250];
    let c = [44u32, 91, 600];
    let a_c: Vec<u32> = a.iter().chain(&c).copied().collect();
    let mut fresh = model.session_with_capacity(64).unwrap();
    let first = fresh.feed(&a_c).unwrap();
    let want = continue_for(&mut fresh, first, 6);

    for (batched, generated) in [(true, 0), (false, 3)] {
        let mut s = model.session_with_capacity(64).unwrap();
        if batched {
            s.feed(&a.iter().chain(&b).copied().collect::<Vec<_>>()).unwrap();
        } else {
            s.feed(&a).unwrap();
            s.feed(&b).unwrap();
        }
        // Steps queued ahead past the truncation point are discarded.
        for _ in 0..generated {
            s.next_token().unwrap();
        }
        let before = s.len();
        let e = s.truncate(before + 1).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        assert!(e.to_string().contains("len"), "{e}");
        assert_eq!(s.len(), before);
        s.truncate(a.len()).unwrap();
        assert_eq!(s.len(), a.len());
        assert_eq!(s.pending(), None);
        assert_eq!(s.next_token().unwrap_err().code(), "no_pending_token");
        let first = s.feed(&c).unwrap();
        assert_eq!(continue_for(&mut s, first, 6), want, "batched {batched}, generated {generated}");
        // Back to nothing: a fresh start.
        s.truncate(0).unwrap();
        assert!(s.is_empty());
        let first = s.feed(&a_c).unwrap();
        assert_eq!(continue_for(&mut s, first, 6), want);
    }
}

/// `feed` after a generation commits the pending (last generated) token
/// before the new text: the session then equals a fresh one fed the whole
/// conversation, that token included.
#[test]
fn feed_after_generation_keeps_the_last_generated_token() {
    let model = model();
    let (prompt, want) = expected();
    let more = [5u32, 17, 3];
    let mut s = model.session_with_capacity(64).unwrap();
    let first = s.feed(&prompt).unwrap();
    let reply = continue_for(&mut s, first, 6);
    assert_eq!(reply, want[..6]);
    assert_eq!(s.pending(), Some(reply[5]));
    assert_eq!(s.len(), prompt.len() + 5, "the last generated token is not yet in the KV cache");
    let first = s.feed(&more).unwrap();
    assert_eq!(s.len(), prompt.len() + reply.len() + more.len());
    let after = continue_for(&mut s, first, 6);

    let conversation: Vec<u32> = prompt.iter().chain(&reply).chain(&more).copied().collect();
    let mut fresh = model.session_with_capacity(64).unwrap();
    let first = fresh.feed(&conversation).unwrap();
    assert_eq!(after, continue_for(&mut fresh, first, 6));

    // The committed token counts against the capacity.
    let mut full = model.session_with_capacity(prompt.len() + 1).unwrap();
    full.feed(&prompt).unwrap();
    let e = full.feed(&[5]).unwrap_err();
    assert!(
        matches!(e, qwen3_wgpu::Error::ContextOverflow { needed, .. } if needed == prompt.len() + 2),
        "{e}"
    );
    // Dropping it instead: truncate to the current length first.
    full.truncate(full.len()).unwrap();
    full.feed(&[5]).unwrap();
    assert_eq!(full.len(), prompt.len() + 1);
}
