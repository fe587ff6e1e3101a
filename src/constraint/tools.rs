//! Qwen3 tool calls: the grammar that makes a reply one or more calls of
//! the given tools (`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`,
//! as Qwen3's chat template asks for them), and the parser that reads the
//! calls back out of a reply's text.

use serde_json::{json, Value};

use super::Constraint;
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// Which tools a reply may or must call ([`Constraint::tool_calls`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolChoice {
    /// The reply is free text until the model starts a call (Qwen3's
    /// `<tool_call>` token); from there on it is calls of any of the
    /// tools, constrained as with [`Required`](Self::Required).
    Auto,
    /// The reply is one or more calls, of any of the tools.
    Required,
    /// The reply is one or more calls of the tool of this name.
    Named(String),
}

/// One call of a tool: its name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// The arguments, as the tool's `parameters` schema describes them.
    pub arguments: Value,
}

/// A reply's text read as Qwen3 writes tool calls ([`parse_tool_calls`]).
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct ParsedReply {
    /// The text outside the calls (trimmed).
    pub content: String,
    /// The whole calls, in order.
    pub calls: Vec<ToolCall>,
    /// True when the text ends inside a call (cut off by the token budget,
    /// or not valid JSON): that call is not among `calls`.
    pub incomplete: bool,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Reads the tool calls out of a reply's text: each
/// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace
/// around the JSON allowed) is a [`ToolCall`]; the text outside them is the
/// content. A call whose JSON does not parse, lacks a string `name` or an
/// object `arguments`, or that is not closed, is left out and marks the
/// reply incomplete.
///
/// ```
/// let reply = qwen3_wgpu::parse_tool_calls(
///     "Let me look.\n<tool_call>\n{\"name\": \"open_door\", \"arguments\": {\"door\": 3}}\n</tool_call>",
/// );
/// assert_eq!(reply.content, "Let me look.");
/// assert_eq!(reply.calls[0].name, "open_door");
/// assert_eq!(reply.calls[0].arguments["door"], 3);
/// assert!(!reply.incomplete);
/// ```
pub fn parse_tool_calls(text: &str) -> ParsedReply {
    let mut reply = ParsedReply::default();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        content.push_str(&rest[..start]);
        let body = &rest[start + OPEN.len()..];
        let Some(end) = body.find(CLOSE) else {
            reply.incomplete = true;
            rest = "";
            break;
        };
        match call_of(&body[..end]) {
            Some(call) => reply.calls.push(call),
            None => reply.incomplete = true,
        }
        rest = &body[end + CLOSE.len()..];
    }
    content.push_str(rest);
    reply.content = content.trim().to_string();
    reply
}

fn call_of(json: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(json.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = value.get("arguments")?;
    arguments.is_object().then(|| ToolCall { name, arguments: arguments.clone() })
}

impl Constraint {
    /// Most calls [`tool_calls`](Self::tool_calls) lets one reply make.
    pub const MAX_TOOL_CALLS: usize = 64;

    /// A reply that is 1 to `max_calls` Qwen3 tool calls (one per line; with
    /// [`ToolChoice::Auto`], free text until the model's `<tool_call>`
    /// token, then the calls), each
    /// `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>` with
    /// NAME one of `tools` (all, or the one `choice` names) and ARGS valid
    /// under that tool's `parameters` schema. `tools` are the chat
    /// template's: `{"type": "function", "function": {"name", "description",
    /// "parameters"}}` (or the inner object alone). The JSON is written as
    /// Qwen3 writes it (`", "` and `": "` separators). Read the calls back
    /// with [`parse_tool_calls`].
    ///
    /// A reply can always add a call until `max_calls`, so a model that
    /// never chooses end-of-text makes `max_calls` of them: 1 for "one
    /// action per turn".
    ///
    /// Errors: [`Error::InvalidArgument`] naming `max_calls` outside 1 to
    /// [`MAX_TOOL_CALLS`](Self::MAX_TOOL_CALLS); naming `tools` for an empty list,
    /// an entry without a string name (the message names the entry) or a
    /// name `choice` does not find; naming `grammar` when llguidance cannot
    /// compile a tool's parameters schema.
    pub fn tool_calls(
        tokenizer: &Tokenizer,
        tools: &[Value],
        choice: &ToolChoice,
        max_calls: usize,
    ) -> Result<Self> {
        if !(1..=Self::MAX_TOOL_CALLS).contains(&max_calls) {
            return Err(Error::invalid_argument(
                "max_calls",
                format!("{max_calls} is not from 1 to Constraint::MAX_TOOL_CALLS ({})", Self::MAX_TOOL_CALLS),
            ));
        }
        let mut variants = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            let function = tool.get("function").unwrap_or(tool);
            let name = function.get("name").and_then(Value::as_str).ok_or_else(|| {
                Error::invalid_argument(
                    "tools",
                    format!("entry {i} has no string \"name\" (in \"function\" or itself)"),
                )
            })?;
            if let ToolChoice::Named(wanted) = choice {
                if wanted != name {
                    continue;
                }
            }
            let parameters =
                function.get("parameters").cloned().unwrap_or_else(|| json!({ "type": "object" }));
            variants.push(json!({
                "type": "object",
                "properties": { "name": { "const": name }, "arguments": parameters },
                "required": ["name", "arguments"],
                "additionalProperties": false
            }));
        }
        if variants.is_empty() {
            let reason = match choice {
                ToolChoice::Named(name) => format!("no tool is named {name:?}"),
                _ => "no tools given".into(),
            };
            return Err(Error::invalid_argument("tools", reason));
        }
        let schema = json!({
            "anyOf": variants,
            "x-guidance": { "item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false }
        });
        // The first call's opening (after the trigger token, for auto),
        // then at most `max_calls - 1` further calls, each optional.
        let body = format!("%json {schema} \"\\n{CLOSE}\"");
        let first = match choice {
            ToolChoice::Auto => "\"\\n\"".to_string(),
            _ => format!("\"{OPEN}\\n\""),
        };
        let more = format!(" (\"\\n{OPEN}\\n\" {body})?").repeat(max_calls - 1);
        let grammar = format!("start: {first} {body}{more}\n");
        let mut constraint = Self::lark(tokenizer, &grammar)?;
        constraint.kind = "tools";
        if *choice == ToolChoice::Auto {
            let trigger = tokenizer.token_id(OPEN).ok_or_else(|| {
                Error::invalid_argument(
                    "tools",
                    format!("tool choice auto needs the tokenizer's {OPEN} token"),
                )
            })?;
            constraint = constraint.after_token(trigger);
        }
        Ok(constraint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tokenizer");
        Tokenizer::from_checkpoint(&dir).unwrap()
    }

    /// Auto: dormant (everything allowed) until `<tool_call>`, then a call
    /// as Qwen3 writes it is allowed token by token and completes it; a
    /// call of an unknown tool is not allowed.
    #[test]
    fn auto_wakes_at_the_tool_call_token() {
        let t = tokenizer();
        let tools = [
            json!({"type": "function", "function": {"name": "give", "parameters": {"type": "object",
            "properties": {"gold": {"type": "integer"}}, "required": ["gold"], "additionalProperties": false}}}),
        ];
        let c = Constraint::tool_calls(&t, &tools, &ToolChoice::Auto, 1).unwrap();
        let trigger = t.token_id(OPEN).unwrap();
        assert_eq!(c.trigger(), Some(trigger));
        let mut state = c.start().unwrap();
        for id in t.encode("Here you go. <").unwrap() {
            assert!(state.allows(id) && !state.consume(id).unwrap() && state.is_dormant());
        }
        assert!(state.consume(trigger).unwrap(), "the trigger wakes it");
        assert!(!state.is_dormant() && !state.is_complete());
        let call = t.encode("\n{\"name\": \"give\", \"arguments\": {\"gold\": 5}}\n</tool_call>").unwrap();
        for &id in &call {
            assert!(state.allows(id), "token {id} of the call");
            state.consume(id).unwrap();
        }
        assert!(state.is_complete());

        let mut state = c.start().unwrap();
        state.consume(trigger).unwrap();
        let wrong = t.encode("\n{\"name\": \"take\"").unwrap();
        assert!(wrong.iter().any(|&id| {
            let allowed = state.allows(id);
            if allowed {
                state.consume(id).unwrap();
            }
            !allowed
        }));
    }
}
