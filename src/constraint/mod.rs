//! Output constraints: a JSON schema, any JSON object, a regular
//! expression or a Lark grammar, compiled by llguidance against the
//! tokenizer's vocabulary and applied on the GPU as a token mask.
//!
//! Each step of a constrained session, the host computes which tokens the
//! grammar allows next (llguidance's mask, one bit per token), writes it to
//! the GPU, and `logits_mask` gives every other token a logit of -inf
//! before the penalties, the sampler's filters and draw and the greedy
//! argmax: no path can choose a forbidden token. See
//! [`Session::set_constraint`](crate::Session::set_constraint) and
//! [`GenerateOptions::constraint`](crate::GenerateOptions::constraint).

mod state;
mod tools;
mod vocabulary;

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::TokenParser;

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

pub(crate) use state::{ConstraintState, Consumed};
pub use tools::{parse_tool_calls, ParsedReply, ToolCall, ToolChoice};
pub(crate) use vocabulary::ConstraintVocabulary;

/// A compiled output constraint: what the generated text must match.
///
/// Compiling builds the tokenizer's token trie the first time (about a
/// second for Qwen3's 151,669 tokens; shared by the tokenizer's clones
/// afterwards), then the grammar (milliseconds). Cloning is cheap; each
/// session that uses a constraint keeps its own parser state.
///
/// JSON is compact: no whitespace between the grammar's tokens (a reply
/// under a schema with bounded strings and arrays has a bounded length).
///
/// ```no_run
/// # fn f(model: &qwen3_wgpu::Model, tokenizer: &qwen3_wgpu::Tokenizer) -> qwen3_wgpu::Result<()> {
/// use qwen3_wgpu::{Constraint, GenerateOptions};
/// let schema = serde_json::json!({
///     "type": "object",
///     "properties": { "action": { "enum": ["attack", "flee", "talk"] } },
///     "required": ["action"],
///     "additionalProperties": false
/// });
/// let npc = Constraint::json_schema(tokenizer, &schema)?;
/// let prompt = tokenizer.encode("The goblin sees the knight. Its move:")?;
/// let options = GenerateOptions::default().constraint(&npc);
/// let out = model.generate_with(&prompt, &options, |_| std::ops::ControlFlow::Continue(()))?;
/// let action: serde_json::Value = serde_json::from_str(&tokenizer.decode(out.generated_ids())?).expect("valid");
/// # let _ = action;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Constraint {
    kind: &'static str,
    /// The compiled grammar, cloned for each session that uses it.
    parser: Arc<Mutex<TokenParser>>,
    vocabulary: Arc<ConstraintVocabulary>,
    /// The token after which the constraint starts ([`Self::after_token`]).
    trigger: Option<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("kind", &self.kind).finish_non_exhaustive()
    }
}

impl Constraint {
    /// Longest regular expression or grammar source accepted (1 MiB).
    pub const MAX_SOURCE_LEN: usize = 1 << 20;

    /// Output that is one JSON value valid under `schema` (JSON Schema:
    /// objects, arrays, strings with lengths and patterns, numbers with
    /// bounds, enums, `anyOf`, `$ref` within the schema; llguidance's
    /// subset). An `"x-guidance"` entry in the schema sets llguidance's JSON
    /// options (e.g. `{"whitespace_flexible": true}`).
    ///
    /// Errors: [`Error::InvalidArgument`] naming `json_schema` when the
    /// schema is not one llguidance can compile (its message says why);
    /// [`Error::CheckpointInvalid`] when the tokenizer's vocabulary cannot
    /// be mapped to bytes.
    pub fn json_schema(tokenizer: &Tokenizer, schema: &serde_json::Value) -> Result<Self> {
        let mut schema = schema.clone();
        if let Some(object) = schema.as_object_mut() {
            object.entry("x-guidance").or_insert_with(|| serde_json::json!({ "whitespace_flexible": false }));
        }
        Self::compile(tokenizer, "json_schema", TopLevelGrammar::from_json_schema(schema))
    }

    /// Output that is one JSON object (any keys and values).
    ///
    /// Errors: as [`json_schema`](Self::json_schema).
    pub fn json(tokenizer: &Tokenizer) -> Result<Self> {
        let schema = serde_json::json!({ "type": "object", "x-guidance": { "whitespace_flexible": false } });
        Self::compile(tokenizer, "json", TopLevelGrammar::from_json_schema(schema))
    }

    /// Output that matches the regular expression `pattern` whole (Rust
    /// `regex` syntax, no look-around or back-references).
    ///
    /// Errors: [`Error::InvalidArgument`] naming `regex` for a pattern
    /// llguidance cannot compile or one longer than
    /// [`MAX_SOURCE_LEN`](Self::MAX_SOURCE_LEN); as
    /// [`json_schema`](Self::json_schema) for the vocabulary.
    pub fn regex(tokenizer: &Tokenizer, pattern: &str) -> Result<Self> {
        check_len("regex", pattern)?;
        Self::compile(tokenizer, "regex", TopLevelGrammar::from_regex(pattern))
    }

    /// Output that the Lark grammar `grammar` derives from its `start`
    /// rule (llguidance's Lark dialect: rules, terminals as regular
    /// expressions, `%json` for an embedded JSON schema).
    ///
    /// Errors: [`Error::InvalidArgument`] naming `grammar`, as
    /// [`regex`](Self::regex).
    pub fn lark(tokenizer: &Tokenizer, grammar: &str) -> Result<Self> {
        check_len("grammar", grammar)?;
        Self::compile(tokenizer, "grammar", TopLevelGrammar::from_lark(grammar.to_string()))
    }

    /// `"json_schema"`, `"json"`, `"regex"`, `"grammar"` or `"tools"`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// This constraint lying dormant until `token` is chosen: a reply is
    /// free (every token allowed, steps queued ahead as usual) until it
    /// holds `token`, and the tokens after it must match the constraint
    /// (the steps queued past it are discarded and chosen again under the
    /// mask). This is how a tool call is constrained once the model starts
    /// one (`<tool_call>`) without constraining the text before it
    /// ([`ToolChoice::Auto`]).
    pub fn after_token(mut self, token: u32) -> Self {
        self.trigger = Some(token);
        self
    }

    /// The token it lies dormant until ([`Self::after_token`]).
    pub(crate) fn trigger(&self) -> Option<u32> {
        self.trigger
    }

    fn compile(tokenizer: &Tokenizer, kind: &'static str, grammar: TopLevelGrammar) -> Result<Self> {
        let vocabulary = tokenizer.derived(ConstraintVocabulary::new)?;
        // llguidance turns a panic while compiling into this error too.
        let parser = vocabulary
            .factory
            .create_parser(grammar)
            .map_err(|e| Error::invalid_argument(kind, format!("cannot compile the constraint: {e}")))?;
        Ok(Self { kind, parser: Arc::new(Mutex::new(parser)), vocabulary, trigger: None })
    }

    /// A fresh parser state for one reply.
    pub(crate) fn start(&self) -> Result<ConstraintState> {
        let parser = self.parser.lock().map_err(|_| Error::internal("a constraint's lock was poisoned"))?;
        ConstraintState::new(self.clone(), parser.deep_clone(), self.vocabulary.clone())
    }
}

fn check_len(kind: &str, source: &str) -> Result<()> {
    if source.len() > Constraint::MAX_SOURCE_LEN {
        return Err(Error::invalid_argument(
            kind,
            format!(
                "{} bytes is longer than Constraint::MAX_SOURCE_LEN ({})",
                source.len(),
                Constraint::MAX_SOURCE_LEN
            ),
        ));
    }
    Ok(())
}
