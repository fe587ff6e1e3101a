//! Stop strings found across piece boundaries by `StopMatcher`.

use qwen3_wgpu::StopMatcher;
use rand::{Rng, SeedableRng};

/// Feeds `pieces`; returns (text handed out, stop index, text held at the
/// end when no stop string matched).
fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
    let mut matcher = StopMatcher::new(stops.iter().copied()).unwrap();
    let mut out = String::new();
    for piece in pieces {
        let step = matcher.push(piece);
        out += &step.text;
        if let Some(index) = step.stopped {
            assert_eq!(matcher.finish(), "", "nothing is held after a stop");
            return (out, Some(index));
        }
    }
    out += &matcher.finish();
    (out, None)
}

#[test]
fn stop_string_split_over_three_pieces() {
    let mut matcher = StopMatcher::new(["<|user|>"]).unwrap();
    let step = matcher.push("Hello <|");
    assert_eq!((step.text.as_str(), step.stopped), ("Hello ", None));
    assert_eq!(matcher.held(), "<|");
    let step = matcher.push("us");
    assert_eq!((step.text.as_str(), step.stopped), ("", None));
    let step = matcher.push("er|> and more");
    assert_eq!((step.text.as_str(), step.stopped), ("", Some(0)));
    assert_eq!(matcher.stopped(), Some(0));
    // Later pieces are ignored.
    let step = matcher.push("ignored");
    assert_eq!((step.text.as_str(), step.stopped), ("", Some(0)));
}

#[test]
fn false_prefix_is_released() {
    let mut matcher = StopMatcher::new(["END"]).unwrap();
    assert_eq!(matcher.push("the E").text, "the ");
    assert_eq!(matcher.push("N").text, "");
    assert_eq!(matcher.held(), "EN");
    // "ENd" is not "END": the held text comes out with the rest.
    let step = matcher.push("d of it");
    assert_eq!((step.text.as_str(), step.stopped), ("ENd of it", None));
    // Held text that never completes comes out at the end.
    assert_eq!(matcher.push(" EN").text, " ");
    assert_eq!(matcher.finish(), "EN");
}

#[test]
fn overlapping_candidates() {
    // The stop string that completes first wins, wherever it starts.
    assert_eq!(run(&["abcd", "bc"], &["xa", "b", "cd"]), ("xa".into(), Some(1)));
    assert_eq!(run(&["abcd", "bc"], &["xabcd"]), ("xa".into(), Some(1)));
    // Completing together: the longer one (earlier start) wins.
    assert_eq!(run(&["cd", "abcd"], &["xab", "cd"]), ("x".into(), Some(1)));
    // A self-overlapping stop string: "aab" inside "aaab".
    assert_eq!(run(&["aab"], &["a", "a", "a", "b!"]), ("a".into(), Some(0)));
    // Two candidates open at once; the second completes.
    assert_eq!(run(&["<|im_end|>", "<|endoftext|>"], &["ok<|", "end", "oftext|>"]), ("ok".into(), Some(1)));
}

#[test]
fn multibyte_text_and_stop_strings() {
    assert_eq!(run(&["。\n"], &["北京", "是首都", "。", "\n下一句"]), ("北京是首都".into(), Some(0)));
    assert_eq!(run(&["日本"], &["日", "曜日", "本語"]), ("日曜".into(), Some(0)));
    assert_eq!(run(&["🙂👍"], &["a🙂", "🙂", "👍"]), ("a🙂".into(), Some(0)));
    // "è" shares its first byte with "é" but is not a prefix of it: not held.
    let mut matcher = StopMatcher::new(["é!"]).unwrap();
    assert_eq!(matcher.push("caf\u{e8}").text, "caf\u{e8}");
    assert_eq!(matcher.held(), "");
    assert_eq!(matcher.push("é").text, "");
    assert_eq!(matcher.held(), "é");
    assert_eq!(matcher.push("!").stopped, Some(0));
}

#[test]
fn empty_pieces_and_stop_at_the_very_start() {
    assert_eq!(run(&["\n\n"], &["", "\n", "", "\nrest"]), ("".into(), Some(0)));
    assert_eq!(run(&["x"], &[]), ("".into(), None));
}

#[test]
fn empty_stop_string_is_invalid_argument() {
    let err = StopMatcher::new(["ok", ""]).unwrap_err();
    assert_eq!(err.code(), "invalid_argument");
    assert!(err.to_string().contains("stop"), "{err}");
}

/// The text up to the first stop string occurrence that ends first (longest
/// among those ending together), computed on the whole text at once.
fn reference(stops: &[String], text: &str) -> (String, Option<usize>) {
    for end in (1..=text.len()).filter(|&e| text.is_char_boundary(e)) {
        let best = stops
            .iter()
            .enumerate()
            .filter(|(_, s)| text[..end].ends_with(s.as_str()))
            .max_by_key(|(i, s)| (s.len(), std::cmp::Reverse(*i)));
        if let Some((i, s)) = best {
            return (text[..end - s.len()].to_string(), Some(i));
        }
    }
    (text.to_string(), None)
}

#[test]
fn any_split_gives_the_whole_text_answer() {
    let alphabet = ['a', 'b', 'é', '日', '\n'];
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    for _ in 0..3000 {
        let word = |rng: &mut rand::rngs::StdRng, max: usize| -> String {
            (0..rng.random_range(1..=max)).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect()
        };
        let stops: Vec<String> = (0..rng.random_range(1..=3)).map(|_| word(&mut rng, 4)).collect();
        let text = word(&mut rng, 24);
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let n = rng.random_range(0..=4.min(chars.len() - i));
            pieces.push(chars[i..i + n].iter().collect::<String>());
            i += n;
        }
        let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
        let piece_refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(
            run(&stop_refs, &piece_refs),
            reference(&stops, &text),
            "stops {stops:?}, pieces {pieces:?}"
        );
    }
}
