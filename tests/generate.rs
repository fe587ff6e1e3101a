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
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
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
