//! Output constraints (`Constraint`) on a small random model with Qwen3's
//! vocabulary beside the Qwen3 tokenizer: every output matches its
//! constraint (JSON checked by the `jsonschema` crate, an implementation
//! independent of llguidance), under every way the engine chooses a token.

use std::path::Path;
use std::sync::OnceLock;

use qwen3_wgpu::{
    AdapterPolicy, CachePolicy, Constraint, Engine, GenerateOptions, LoadOptions, Model, SamplingParams,
    Session, StopReason, Tokenizer, ToolChoice,
};
use serde_json::{json, Value};

fn qwen3_tokenizer_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tokenizer"))
}

/// One tokenizer for the module: its constraint vocabulary is built once.
fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_checkpoint(qwen3_tokenizer_dir()).unwrap())
}

/// A small random model with Qwen3's vocabulary (hidden 128, one layer).
fn model() -> &'static Model {
    static M: OnceLock<(tempfile::TempDir, Model)> = OnceLock::new();
    &M.get_or_init(|| small_model(None)).1
}

/// [`model`] with only Qwen3's first 8,192 tokens: every byte (ids 0-255)
/// and the commonest words, so any text can still be spelled, and a step
/// chooses among 19 times fewer logits (the many replies of the
/// statistical tests; `<|im_end|>` lies past it, so a reply ends by its
/// constraint's completion).
fn short_vocab_model() -> &'static Model {
    static M: OnceLock<(tempfile::TempDir, Model)> = OnceLock::new();
    &M.get_or_init(|| small_model(Some(8192))).1
}

fn small_model(vocab: Option<usize>) -> (tempfile::TempDir, Model) {
    {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = qwen3_wgpu::ModelConfig::qwen3_0_6b_base();
        if let Some(vocab) = vocab {
            cfg.vocab_size = vocab;
        }
        cfg.hidden_size = 128;
        cfg.intermediate_size = 256;
        cfg.num_hidden_layers = 1;
        cfg.num_attention_heads = 2;
        cfg.num_key_value_heads = 1;
        qwen3_wgpu::internals::testing::write_random_checkpoint(tmp.path(), &cfg, 11).unwrap();
        let model = engine
            .load(tmp.path(), &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() })
            .unwrap();
        (tmp, model)
    }
}

/// Schemas a game would hand the engine: enums, bounded integers and
/// strings, nested objects, bounded arrays, optional fields, no extra
/// properties.
fn schemas() -> Vec<Value> {
    vec![
        json!({
            "type": "object",
            "properties": {
                "action": { "enum": ["attack", "flee", "talk", "trade"] },
                "target": { "type": "string", "maxLength": 12 },
                "intensity": { "type": "integer", "minimum": 1, "maximum": 10 }
            },
            "required": ["action", "intensity"],
            "additionalProperties": false
        }),
        json!({
            "type": "object",
            "properties": {
                "name": { "type": "string", "minLength": 1, "maxLength": 8 },
                "stats": {
                    "type": "object",
                    "properties": {
                        "hp": { "type": "integer", "minimum": 0, "maximum": 999 },
                        "tags": { "type": "array", "items": { "enum": ["fire", "ice", "stone"] }, "maxItems": 3 }
                    },
                    "required": ["hp", "tags"],
                    "additionalProperties": false
                }
            },
            "required": ["name", "stats"],
            "additionalProperties": false
        }),
        json!({
            "type": "object",
            "properties": {
                "ok": { "type": "boolean" },
                "note": { "type": "string", "maxLength": 10 },
                "items": {
                    "type": "array",
                    "items": { "type": "integer", "minimum": -5, "maximum": 5 },
                    "minItems": 1,
                    "maxItems": 4
                }
            },
            "required": ["ok", "items"],
            "additionalProperties": false
        }),
    ]
}

/// Token budget of one reply: every schema above bounds its output well
/// below it (strings of at most 12 characters, each at most a 6-byte
/// escape).
const BUDGET: usize = 400;

/// The reply to a short prompt under `constraint`, on `session` (reset
/// first), until the constraint is complete or the budget runs out.
fn reply(session: &mut Session, constraint: &Constraint, sampling: &SamplingParams) -> (String, bool) {
    session.truncate(0).unwrap();
    session.set_sampling(sampling).unwrap();
    session.set_constraint(Some(constraint)).unwrap();
    // "The" and a few ids every vocabulary here holds.
    let mut ids = vec![session.feed(&[785, 1052, 25]).unwrap()];
    while !session.constraint_complete() && ids.len() < BUDGET {
        ids.push(session.next_token().unwrap());
    }
    (tokenizer().decode(&ids).unwrap(), session.constraint_complete())
}

/// Every token-choice path: greedy, plain sampling, top-k, top-p, min-p
/// and penalties.
fn samplers(seed: u64) -> Vec<SamplingParams> {
    let base = SamplingParams::default().temperature(1.0).seed(seed);
    vec![
        SamplingParams::greedy(),
        base.clone(),
        base.clone().top_k(40),
        base.clone().top_p(0.9),
        base.clone().min_p(0.05),
        base.repetition_penalty(1.3).presence_penalty(0.5).frequency_penalty(0.5),
    ]
}

/// The offset of the first whitespace outside a JSON string in `text`.
fn whitespace_outside_strings(text: &str) -> Option<usize> {
    let (mut in_string, mut escaped) = (false, false);
    for (i, c) in text.char_indices() {
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_string = !in_string,
            (false, _, ' ' | '\n' | '\t' | '\r') => return Some(i),
            _ => {}
        }
    }
    None
}

#[test]
fn sampled_and_greedy_json_validates_against_its_schema() {
    let mut session = short_vocab_model().session_with_capacity(512).unwrap();
    for (s, schema) in schemas().iter().enumerate() {
        let constraint = Constraint::json_schema(tokenizer(), schema).unwrap();
        let validator = jsonschema::validator_for(schema).unwrap();
        let mut runs = vec![SamplingParams::greedy()];
        runs.extend((0..50).map(|seed| SamplingParams::default().temperature(1.0).seed(seed)));
        runs.extend(samplers(1000 + s as u64));
        for sampling in &runs {
            let (text, complete) = reply(&mut session, &constraint, sampling);
            assert!(complete, "schema {s} {sampling:?}: incomplete after {BUDGET} tokens: {text:?}");
            let value: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("schema {s}: {text:?}: {e}"));
            assert!(validator.is_valid(&value), "schema {s} {sampling:?}: {text} does not validate");
            // Compact: no whitespace outside strings.
            assert!(whitespace_outside_strings(&text).is_none(), "schema {s}: not compact: {text}");
        }
    }
}

#[test]
fn regex_and_grammar_outputs_match() {
    let mut session = short_vocab_model().session_with_capacity(512).unwrap();
    let regex = Constraint::regex(tokenizer(), r"(yes|no), [0-9]{2,4} (gold|silver)\.").unwrap();
    let re = |t: &str| {
        let (answer, rest) = t.split_once(", ").expect("a comma");
        let (digits, metal) = rest.split_once(' ').expect("a space");
        ["yes", "no"].contains(&answer)
            && (2..=4).contains(&digits.len())
            && digits.bytes().all(|b| b.is_ascii_digit())
            && ["gold.", "silver."].contains(&metal)
    };
    let grammar = Constraint::lark(
        tokenizer(),
        r#"start: move ("," move)? ("," move)? ("," move)?
           move: DIR NUMBER
           DIR: "north" | "south" | "east" | "west"
           NUMBER: /[1-9]/"#,
    )
    .unwrap();
    let moves = |t: &str| {
        t.split(',').all(|m| {
            let dir = ["north", "south", "east", "west"].into_iter().find(|d| m.starts_with(d));
            dir.is_some_and(|d| m.len() == d.len() + 1 && (b'1'..=b'9').contains(&m.as_bytes()[d.len()]))
        })
    };
    for seed in 0..5 {
        for sampling in samplers(seed) {
            let (text, complete) = reply(&mut session, &regex, &sampling);
            assert!(complete && re(&text), "regex {sampling:?}: {text:?}");
            let (text, complete) = reply(&mut session, &grammar, &sampling);
            assert!(complete && moves(&text), "grammar {sampling:?}: {text:?}");
        }
    }
}

#[test]
fn generate_stops_when_the_constraint_is_complete_and_lifting_it_restores_the_free_tokens() {
    let model = model();
    let prompt = tokenizer().encode("Say yes or no:").unwrap();
    let yes_no = Constraint::regex(tokenizer(), "(yes|no)!").unwrap();
    let options = GenerateOptions::default().max_new_tokens(50).constraint(&yes_no);
    let out = model.generate_with(&prompt, &options, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(out.stop_reason, StopReason::ConstraintComplete);
    assert_eq!(out.stop_reason.as_str(), "constraint_complete");
    let text = tokenizer().decode(&out.token_ids[out.n_prompt..]).unwrap();
    assert!(text == "yes!" || text == "no!", "{text:?}");

    // A budget too small for the match: stopped by the budget, incomplete.
    let options = GenerateOptions::default()
        .max_new_tokens(1)
        .constraint(&Constraint::regex(tokenizer(), "a{30}").unwrap());
    let out = model.generate_with(&prompt, &options, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(out.stop_reason, StopReason::MaxNewTokens);

    // Lifting a constraint gives the unconstrained tokens again.
    let free = model.generate(&prompt, 8, |_| {}).unwrap().token_ids;
    let mut session = model.session_with_capacity(64).unwrap();
    session.set_constraint(Some(&yes_no)).unwrap();
    session.set_constraint(None).unwrap();
    let mut ids = prompt.clone();
    ids.push(session.feed(&prompt).unwrap());
    while ids.len() < free.len() {
        ids.push(session.next_token().unwrap());
    }
    assert_eq!(ids, free);
}

#[test]
fn bad_constraints_are_named_errors() {
    let t = tokenizer();
    let code_and_name = |e: qwen3_wgpu::Error| match e {
        qwen3_wgpu::Error::InvalidArgument { name, reason } => (name, reason),
        other => panic!("expected invalid_argument, got {other:?}"),
    };
    let (name, _) = code_and_name(Constraint::regex(t, "(unclosed").unwrap_err());
    assert_eq!(name, "regex");
    let (name, _) = code_and_name(Constraint::lark(t, "start: undefined_rule").unwrap_err());
    assert_eq!(name, "grammar");
    let (name, _) =
        code_and_name(Constraint::json_schema(t, &json!({ "type": "no-such-type" })).unwrap_err());
    assert_eq!(name, "json_schema");
    let (name, reason) =
        code_and_name(Constraint::regex(t, &"a".repeat(Constraint::MAX_SOURCE_LEN + 1)).unwrap_err());
    assert_eq!(name, "regex");
    assert!(reason.contains("MAX_SOURCE_LEN"), "{reason}");
}

/// In a batch, members with different constraints or none each get the
/// tokens they get alone (a constrained row chooses with its own mask),
/// stepped blocking or polled (the masks then computed off the caller's
/// thread); the tokens a member's constraint forces are fed as one prompt
/// batch there too, as many as alone, not stepped as rows.
#[test]
fn batch_members_keep_their_own_constraints() {
    let model = short_vocab_model();
    let regex = Constraint::regex(tokenizer(), "(yes|no), [0-9]{2}!").unwrap();
    let json = Constraint::json_schema(tokenizer(), &schemas()[0]).unwrap();
    let sampled = SamplingParams::default().temperature(1.0).seed(7);
    let members: [(Option<&Constraint>, SamplingParams); 3] =
        [(Some(&regex), SamplingParams::greedy()), (Some(&json), sampled), (None, SamplingParams::greedy())];
    let steps = 12;
    let prompt = [785u32, 1052, 25];
    // Alone: each a batch's session stepped by itself (the tokens its
    // constraint forces fed as one prompt batch, as a plain session's,
    // `forced_tokens_are_fed_not_stepped`).
    let (alone, forced_alone): (Vec<Vec<u32>>, Vec<u64>) = members
        .iter()
        .map(|(c, sampling)| {
            let single =
                model.batch(&qwen3_wgpu::BatchOptions::default().slots(1).capacity_per_slot(64)).unwrap();
            let mut s = single.session().unwrap();
            s.set_sampling(sampling).unwrap();
            s.set_constraint(*c).unwrap();
            let mut ids = vec![s.feed(&prompt).unwrap()];
            while ids.len() < steps && !s.constraint_complete() {
                ids.push(s.next_token().unwrap());
            }
            (ids, s.debug_forced_tokens())
        })
        .unzip();
    assert!(forced_alone[1] > 0 && forced_alone[2] == 0, "forced alone: {forced_alone:?}");
    // Through step, then through try_step (polled as a frame loop would).
    for polled in [false, true] {
        let mut batch =
            model.batch(&qwen3_wgpu::BatchOptions::default().slots(3).capacity_per_slot(64)).unwrap();
        let mut sessions: Vec<Session> = (0..3).map(|_| batch.session().unwrap()).collect();
        let mut got: Vec<Vec<u32>> = Vec::new();
        for (s, (c, sampling)) in sessions.iter_mut().zip(&members) {
            s.set_sampling(sampling).unwrap();
            s.set_constraint(*c).unwrap();
            got.push(vec![s.feed(&prompt).unwrap()]);
        }
        // Each step, the members not yet as long as alone (a complete
        // constraint allows only end-of-text, past this short vocabulary).
        loop {
            let active: Vec<usize> = (0..3).filter(|&i| got[i].len() < alone[i].len()).collect();
            if active.is_empty() {
                break;
            }
            let mut refs: Vec<&mut Session> =
                sessions.iter_mut().enumerate().filter(|(i, _)| active.contains(i)).map(|(_, s)| s).collect();
            let tokens = if polled {
                loop {
                    if let Some(tokens) = batch.try_step(&mut refs).unwrap() {
                        break tokens;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            } else {
                batch.step(&mut refs).unwrap()
            };
            for (&i, t) in active.iter().zip(tokens) {
                got[i].push(t);
            }
        }
        assert_eq!(got, alone, "polled: {polled}");
        let forced: Vec<u64> = sessions.iter().map(Session::debug_forced_tokens).collect();
        assert_eq!(forced, forced_alone, "polled: {polled}");
        // A member serving itself (its forced tokens, the choice after
        // them) submits no forward pass of its own: the batch steps it.
        let own_passes: Vec<u64> = sessions.iter().map(Session::debug_forward_ahead_submits).collect();
        assert_eq!(own_passes, [0, 0, 0], "polled: {polled}");
        assert!(sessions[0].constraint_complete(), "the regex completes within {steps} tokens");
        // A polled step returns the tokens and leaves the next masks to
        // other threads (the next step settles them); `step` computes them.
        let on_worker: u64 = sessions.iter().map(Session::debug_choices_on_worker).sum();
        if polled {
            // (Each constrained row's choice but the forced tokens'.)
            assert!(on_worker >= 4, "{on_worker} masks on other threads (forced {forced:?})");
        } else {
            assert_eq!(on_worker, 0);
        }
    }
}

/// The tokens a grammar forces (the rest of a fixed sentence after its
/// first word) come back without a decode step each: one prompt batch
/// runs them, and the calls that return them wait for nothing. A session
/// reporting log-probabilities steps each (every token has its record);
/// a call that drops the queued steps before the forced tokens are all
/// returned (new sampling parameters) still returns them.
#[test]
fn forced_tokens_are_fed_not_stepped() {
    let model = short_vocab_model();
    let constraint = Constraint::regex(tokenizer(), "The answer is (yes|no), said the guard\\.").unwrap();
    let reply = |logprobs: u32, interrupt: bool| {
        let mut s = model.session_with_capacity(64).unwrap();
        s.set_logprobs(logprobs).unwrap();
        s.set_constraint(Some(&constraint)).unwrap();
        let mut ids = vec![s.feed(&[785, 1052, 25]).unwrap()];
        let submits = s.debug_decode_submits();
        while !s.constraint_complete() {
            ids.push(s.next_token().unwrap());
            if interrupt && s.debug_forced_tokens() == 1 {
                s.set_sampling(&SamplingParams::greedy()).unwrap();
            }
            assert!(ids.len() < 40, "{ids:?}");
        }
        let text = tokenizer().decode(&ids).unwrap();
        assert!(
            text == "The answer is yes, said the guard." || text == "The answer is no, said the guard.",
            "{text:?}"
        );
        (ids.len() as u64, s.debug_forced_tokens(), s.debug_decode_submits() - submits)
    };
    let (n, forced, steps) = reply(0, false);
    // " answer is " and ", said the guard." are forced.
    assert!(forced >= 5, "{forced} of {n} forced");
    assert!(steps + forced < n, "{steps} decode submits for {n} tokens, {forced} forced");
    let (n, forced, steps) = reply(2, false);
    assert_eq!(forced, 0);
    assert!(steps >= n - 1, "{steps} decode submits for {n} tokens");
    let (_, forced, _) = reply(0, true);
    assert!(forced >= 5, "{forced} forced after a discard");
}

/// A constraint set once covers every reply: each feed starts it over.
#[test]
fn each_feed_starts_the_constraint_over() {
    let mut session = short_vocab_model().session_with_capacity(256).unwrap();
    session.set_constraint(Some(&Constraint::regex(tokenizer(), "(yes|no)!").unwrap())).unwrap();
    for turn in [&[785u32, 1052, 25][..], &[40, 1079], &[17]] {
        let mut ids = vec![session.feed(turn).unwrap()];
        while !session.constraint_complete() {
            ids.push(session.next_token().unwrap());
            assert!(ids.len() < 10, "{ids:?}");
        }
        let text = tokenizer().decode(&ids).unwrap();
        assert!(text == "yes!" || text == "no!", "{text:?}");
    }
}

/// A batch's member fed by polling (a frame loop's restart) leaves the
/// mask after the feed's token to other threads, as its batch's steps do,
/// and decodes the tokens of a blocking feed.
#[test]
fn a_polled_feed_of_a_batch_member_leaves_its_next_mask_to_other_threads() {
    let model = short_vocab_model();
    let json = Constraint::json_schema(tokenizer(), &schemas()[0]).unwrap();
    let prompt = [785u32, 1052, 25];
    let decode = |polled: bool| {
        let batch = model.batch(&qwen3_wgpu::BatchOptions::default().slots(1).capacity_per_slot(64)).unwrap();
        let mut s = batch.session().unwrap();
        s.set_constraint(Some(&json)).unwrap();
        let first = if polled {
            s.begin_feed(&prompt).unwrap();
            loop {
                if let qwen3_wgpu::FeedStatus::Ready(token) = s.poll_feed().unwrap() {
                    break token;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        } else {
            s.feed(&prompt).unwrap()
        };
        let on_worker = s.debug_choices_on_worker();
        let mut ids = vec![first];
        while ids.len() < 8 && !s.constraint_complete() {
            ids.push(s.next_token().unwrap());
        }
        (ids, on_worker)
    };
    let (blocking, none) = decode(false);
    let (polled, on_worker) = decode(true);
    assert_eq!(polled, blocking);
    assert_eq!((none, on_worker), (0, 1), "masks after the feed's token on other threads");
}

/// A batch of constrained rows stepped by `try_step` (no step is queued
/// behind a constrained one) records each step once: the recording
/// started at a step's submit is the next call's, not dropped for another
/// recorded after its tokens.
#[test]
fn constrained_batch_steps_are_recorded_once() {
    let model = short_vocab_model();
    let digits = Constraint::regex(tokenizer(), "[0-9]{12}").unwrap();
    let mut batch = model.batch(&qwen3_wgpu::BatchOptions::default().slots(2).capacity_per_slot(64)).unwrap();
    let mut sessions: Vec<Session> = (0..2).map(|_| batch.session().unwrap()).collect();
    for (i, s) in sessions.iter_mut().enumerate() {
        s.set_constraint(Some(&digits)).unwrap();
        s.feed(&[785u32 + i as u32, 1052, 25]).unwrap();
    }
    let mut steps = 0;
    while steps < 8 {
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        if batch.try_step(&mut refs).unwrap().is_some() {
            steps += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(sessions.iter().all(|s| s.debug_forced_tokens() == 0), "a digit was forced");
    let (on_caller, submitted_ahead, started) = batch.debug_step_recordings();
    assert_eq!(on_caller, 0);
    assert!(submitted_ahead >= steps, "{submitted_ahead} steps recorded ahead for {steps}");
    // At most the one after the last step is not submitted (yet).
    assert!(started <= submitted_ahead + 1, "{started} recordings for {submitted_ahead} submits");
}

/// Game functions as tools, in the chat template's shape.
fn game_tools() -> Vec<Value> {
    vec![
        json!({ "type": "function", "function": {
            "name": "move_to", "description": "Walk to a place.",
            "parameters": { "type": "object", "properties": {
                "place": { "enum": ["tavern", "gate", "well"] },
                "run": { "type": "boolean" } },
                "required": ["place"], "additionalProperties": false } } }),
        json!({ "type": "function", "function": {
            "name": "give", "description": "Give gold.",
            "parameters": { "type": "object", "properties": {
                "gold": { "type": "integer", "minimum": 1, "maximum": 50 },
                "to": { "type": "string", "maxLength": 10 } },
                "required": ["gold", "to"], "additionalProperties": false } } }),
    ]
}

/// `tool_choice` required or named: every reply is whole calls, of the
/// allowed tools, with arguments valid under their schemas.
#[test]
fn required_tool_calls_validate_against_their_tools() {
    let mut session = short_vocab_model().session_with_capacity(512).unwrap();
    let tools = game_tools();
    let validators: Vec<(String, jsonschema::Validator)> = tools
        .iter()
        .map(|t| {
            (
                t["function"]["name"].as_str().unwrap().to_string(),
                jsonschema::validator_for(&t["function"]["parameters"]).unwrap(),
            )
        })
        .collect();
    let choices = [ToolChoice::Required, ToolChoice::Named("give".into())];
    for choice in &choices {
        let constraint = Constraint::tool_calls(tokenizer(), &tools, choice, 2).unwrap();
        assert_eq!(constraint.kind(), "tools");
        for seed in 0..8 {
            let sampling = if seed == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams::default().temperature(1.0).seed(seed)
            };
            let (text, complete) = reply(&mut session, &constraint, &sampling);
            let parsed = qwen3_wgpu::parse_tool_calls(&text);
            assert!(complete && !parsed.incomplete && parsed.content.is_empty(), "{choice:?}: {text:?}");
            assert!((1..=2).contains(&parsed.calls.len()), "{choice:?}: {text:?}");
            assert!(text.starts_with("<tool_call>\n{\"name\": \""), "Qwen3's own layout: {text:?}");
            for call in &parsed.calls {
                if let ToolChoice::Named(name) = choice {
                    assert_eq!(&call.name, name, "{text:?}");
                }
                let (_, v) = validators.iter().find(|(n, _)| *n == call.name).expect("a known tool");
                assert!(v.is_valid(&call.arguments), "{text:?}");
            }
        }
    }
}

#[test]
fn tool_call_parsing_keeps_text_apart_and_drops_cut_calls() {
    use qwen3_wgpu::parse_tool_calls;
    let two = "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
    let r = parse_tool_calls(two);
    assert_eq!((r.content.as_str(), r.calls.len(), r.incomplete), ("Sure.", 2, false));
    assert_eq!((r.calls[0].name.as_str(), &r.calls[0].arguments), ("a", &json!({ "x": 1 })));
    assert_eq!(r.calls[1].name, "b");
    // Cut off by the budget: not a call, and incomplete.
    let r = parse_tool_calls("<tool_call>\n{\"name\": \"a\", \"argu");
    assert!(r.calls.is_empty() && r.incomplete, "{r:?}");
    // Closed but not a call (no arguments object, not JSON).
    for bad in [
        "{\"name\": \"a\"}",
        "{\"name\": 3, \"arguments\": {}}",
        "not json",
        "{\"name\": \"a\", \"arguments\": []}",
    ] {
        let r = parse_tool_calls(&format!("x<tool_call>{bad}</tool_call>y"));
        assert!(r.calls.is_empty() && r.incomplete && r.content == "xy", "{bad}: {r:?}");
    }
    let r = parse_tool_calls("no calls here");
    assert_eq!((r.content.as_str(), r.calls.len(), r.incomplete), ("no calls here", 0, false));
}

#[test]
fn bad_tool_lists_are_named_errors() {
    let t = tokenizer();
    let name_of = |e: qwen3_wgpu::Error| match e {
        qwen3_wgpu::Error::InvalidArgument { name, reason } => (name, reason),
        other => panic!("expected invalid_argument, got {other:?}"),
    };
    let (name, _) = name_of(Constraint::tool_calls(t, &[], &ToolChoice::Required, 1).unwrap_err());
    assert_eq!(name, "tools");
    let (name, reason) = name_of(
        Constraint::tool_calls(t, &[json!({"type": "function", "function": {}})], &ToolChoice::Required, 1)
            .unwrap_err(),
    );
    assert!(name == "tools" && reason.contains("entry 0"), "{reason}");
    let (name, reason) =
        name_of(Constraint::tool_calls(t, &game_tools(), &ToolChoice::Named("fly".into()), 1).unwrap_err());
    assert!(name == "tools" && reason.contains("fly"), "{reason}");
    for n in [0, Constraint::MAX_TOOL_CALLS + 1] {
        let (name, _) =
            name_of(Constraint::tool_calls(t, &game_tools(), &ToolChoice::Required, n).unwrap_err());
        assert_eq!(name, "max_calls");
    }
}

/// A constraint after a token: the reply is the free run's tokens up to
/// and including the trigger (the dormant mask changes nothing), then the
/// constraint's match; at the default lookahead, so steps queued past the
/// trigger are chosen again.
#[test]
fn a_constraint_after_a_token_leaves_the_text_before_it_free() {
    let model = short_vocab_model();
    let prompt = [785u32, 1052, 25];
    let mut free = model.session_with_capacity(64).unwrap();
    let mut run = vec![free.feed(&prompt).unwrap()];
    while run.len() < 12 {
        run.push(free.next_token().unwrap());
    }
    // The first token that did not come before it, from the fourth on.
    let at = (3..run.len()).find(|&i| !run[..i].contains(&run[i])).expect("a new token");
    let after = Constraint::regex(tokenizer(), "!!x").unwrap().after_token(run[at]);
    let mut session = model.session_with_capacity(64).unwrap();
    session.set_constraint(Some(&after)).unwrap();
    let mut ids = vec![session.feed(&prompt).unwrap()];
    while !session.constraint_complete() {
        ids.push(session.next_token().unwrap());
        assert!(ids.len() < 40, "{ids:?}");
    }
    assert_eq!(ids[..=at], run[..=at], "free up to the trigger");
    assert_eq!(tokenizer().decode(&ids[at + 1..]).unwrap(), "!!x");
}

/// A constrained session submits each step's forward pass ahead of its
/// token choice (the choice waits for the mask; the forward pass does
/// not): its tokens are those of whole steps, under greedy and sampled
/// choice, across replies started over by `truncate` and continued by
/// `feed` (each moves the GPU's position away from a forward pass queued
/// ahead), taken blocking or polled (a polled call hands the next mask
/// and the choice to the session's thread).
#[test]
fn split_steps_give_the_tokens_of_whole_steps() {
    let model = short_vocab_model();
    let constraint = Constraint::json_schema(tokenizer(), &schemas()[1]).unwrap();
    let run = |split: bool, polled: bool| {
        let mut s = model.session_with_capacity(160).unwrap();
        s.debug_split_steps(split);
        let mut out = Vec::new();
        for sampling in [SamplingParams::greedy(), SamplingParams::default().temperature(1.0).seed(7)] {
            s.truncate(0).unwrap();
            s.set_sampling(&sampling).unwrap();
            s.set_constraint(Some(&constraint)).unwrap();
            let mut ids = vec![s.feed(&[785, 1052, 25]).unwrap()];
            for round in 0..2 {
                let mut n = 0;
                while !s.constraint_complete() && n < 12 {
                    let token = if polled {
                        loop {
                            if let Some(t) = s.try_next_token().unwrap() {
                                break t;
                            }
                            std::thread::yield_now();
                        }
                    } else {
                        s.next_token().unwrap()
                    };
                    ids.push(token);
                    n += 1;
                }
                if round == 0 {
                    // The reply so far is kept; a new one starts after it.
                    ids.push(s.feed(&[1052, 25]).unwrap());
                }
            }
            out.push(ids);
        }
        (out, s.debug_forward_ahead_submits(), s.debug_choices_on_worker(), s.debug_forced_tokens())
    };
    let (whole, none, on_worker, forced) = run(false, false);
    assert_eq!((none, on_worker), (0, 0));
    // The schema's keys after a value are forced: fed, not chosen.
    assert!(forced >= 4, "{forced} forced tokens");
    for polled in [false, true] {
        let (split, ahead, on_worker, split_forced) = run(true, polled);
        assert_eq!(split_forced, forced, "polled {polled}");
        assert!(ahead >= 20, "polled {polled}: {ahead} forward passes ahead");
        // A polled call returns its token and leaves the next mask and the
        // choice to the session's thread (a feed or a truncate right after
        // it settles it first); a blocking one computes them itself.
        if polled {
            assert!(on_worker >= 20, "{on_worker} choices on the session's thread");
        } else {
            assert_eq!(on_worker, 0);
        }
        assert_eq!(split, whole, "polled {polled}");
    }
}

/// After a complete reply only end-of-text may follow: on a model with
/// the tokenizer's whole vocabulary the next tokens are end-of-text (not
/// an error from the stopped parser, nor a token of the mask before the
/// last); on one whose logits end before the end-of-text token, no token
/// the model can choose is allowed, and asking for one more is
/// `invalid_argument` naming the constraint (not an internal error after
/// choosing among -inf logits), the session left as it was: lifting the
/// constraint decodes on.
#[test]
fn only_end_of_text_follows_a_complete_reply() {
    let constraint = Constraint::regex(tokenizer(), "(yes|no)\\.").unwrap();
    // Qwen3's <|endoftext|> and <|im_end|>.
    let eos = [151643u32, 151645];
    assert_eq!(tokenizer().decode(&eos).unwrap(), "<|endoftext|><|im_end|>");
    for (model, whole_vocab) in [(model(), true), (short_vocab_model(), false)] {
        let mut s = model.session_with_capacity(64).unwrap();
        s.set_constraint(Some(&constraint)).unwrap();
        let mut ids = vec![s.feed(&[785, 1052, 25]).unwrap()];
        while !s.constraint_complete() {
            ids.push(s.next_token().unwrap());
            assert!(ids.len() < 8, "{ids:?}");
        }
        let text = tokenizer().decode(&ids).unwrap();
        assert!(text == "yes." || text == "no.", "{text:?}");
        let len = s.len();
        if whole_vocab {
            for _ in 0..2 {
                let t = s.next_token().unwrap();
                assert!(eos.contains(&t), "{t} after a complete reply");
                assert!(s.constraint_complete());
            }
            continue;
        }
        for _ in 0..2 {
            let e = s.next_token().unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{e}");
            assert!(e.to_string().contains("regex"), "{e}");
            assert_eq!(s.len(), len);
        }
        let e = s.try_next_token().unwrap_err();
        assert_eq!(e.code(), "invalid_argument", "{e}");
        s.set_constraint(None).unwrap();
        s.next_token().unwrap();
        assert_eq!(s.len(), len + 1);
    }
}
