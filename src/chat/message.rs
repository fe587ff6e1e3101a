//! A conversation's messages, and the options a chat template renders them with.

use serde_json::{Map, Value as Json};

/// One message of a conversation, in Hugging Face's shape: a role
/// (`system`, `user`, `assistant`, `tool`), its text, and any other field
/// the template reads (`reasoning_content`, `tool_calls`, `name` ...).
///
/// Serializes to (and deserializes from) the JSON object transformers takes,
/// so conversations stored in that form load as they are.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool` (templates may know others).
    pub role: String,
    /// The text of the message.
    pub content: String,
    /// Every other field, passed to the template as it is.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl Message {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), extra: Map::new() }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message. Qwen3's template takes a `<think>...</think>`
    /// block at the start of the content as the turn's reasoning.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// A `tool` message: the result of a tool call.
    pub fn tool(content: impl Into<String>) -> Self {
        Self::new("tool", content)
    }

    /// Sets any other field the template reads.
    pub fn with(mut self, field: impl Into<String>, value: impl Into<Json>) -> Self {
        self.extra.insert(field.into(), value.into());
        self
    }

    /// Sets `reasoning_content` (an assistant turn's thinking).
    pub fn with_reasoning(self, reasoning: impl Into<String>) -> Self {
        self.with("reasoning_content", reasoning.into())
    }

    /// Appends a call to tool `name` with `arguments` (a JSON object) to the
    /// message's `tool_calls`, in the OpenAI shape transformers uses:
    /// `{"type": "function", "function": {"name", "arguments"}}`.
    pub fn with_tool_call(mut self, name: impl Into<String>, arguments: Json) -> Self {
        let call = serde_json::json!({
            "type": "function",
            "function": { "name": name.into(), "arguments": arguments },
        });
        match self.extra.get_mut("tool_calls") {
            Some(Json::Array(calls)) => calls.push(call),
            _ => {
                self.extra.insert("tool_calls".into(), Json::Array(vec![call]));
            }
        }
        self
    }
}

/// How a conversation is rendered and encoded.
///
/// ```
/// use qwen3_wgpu::ChatOptions;
/// let options = ChatOptions::default().enable_thinking(false);
/// assert!(options.add_generation_prompt);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ChatOptions {
    /// Ends the text with the opening of an assistant turn, so the model
    /// writes the reply. Default `true` (this crate renders a conversation
    /// to generate its next turn; transformers' default is `false`).
    pub add_generation_prompt: bool,
    /// Qwen3's `enable_thinking`: `Some(false)` makes the template write an
    /// empty `<think></think>` block so the model answers without thinking.
    /// `None` (the default) leaves the variable undefined, which Qwen3's
    /// template treats as thinking on.
    pub enable_thinking: Option<bool>,
    /// Tool (function) definitions in the JSON-schema shape transformers
    /// takes; empty means no tools (the template sees `none`).
    pub tools: Vec<Json>,
    /// Other template variables (transformers' `**kwargs`).
    pub variables: Map<String, Json>,
    /// transformers' `continue_final_message`: the text ends with the last
    /// message's content, its end-of-turn token and what follows cut off, so
    /// the model continues that message (an assistant reply begun by the
    /// caller, say). Excludes `add_generation_prompt`.
    pub continue_final_message: bool,
    /// When `true`, special-token strings inside message contents and tool
    /// data become control tokens in
    /// [`ChatTemplate::encode`](super::ChatTemplate::encode), as transformers
    /// does. Default `false`: they are encoded as text.
    pub special_tokens_in_content: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking: None,
            tools: Vec::new(),
            variables: Map::new(),
            continue_final_message: false,
            special_tokens_in_content: false,
        }
    }
}

impl ChatOptions {
    /// Sets [`add_generation_prompt`](Self::add_generation_prompt).
    pub fn add_generation_prompt(mut self, yes: bool) -> Self {
        self.add_generation_prompt = yes;
        self
    }

    /// Sets [`enable_thinking`](Self::enable_thinking).
    pub fn enable_thinking(mut self, yes: bool) -> Self {
        self.enable_thinking = Some(yes);
        self
    }

    /// Sets [`tools`](Self::tools).
    pub fn tools(mut self, tools: Vec<Json>) -> Self {
        self.tools = tools;
        self
    }

    /// Sets one of [`variables`](Self::variables).
    pub fn variable(mut self, name: impl Into<String>, value: impl Into<Json>) -> Self {
        self.variables.insert(name.into(), value.into());
        self
    }

    /// Sets [`continue_final_message`](Self::continue_final_message); `true`
    /// also turns [`add_generation_prompt`](Self::add_generation_prompt) off.
    pub fn continue_final_message(mut self, yes: bool) -> Self {
        self.continue_final_message = yes;
        if yes {
            self.add_generation_prompt = false;
        }
        self
    }

    /// Sets [`special_tokens_in_content`](Self::special_tokens_in_content).
    pub fn special_tokens_in_content(mut self, yes: bool) -> Self {
        self.special_tokens_in_content = yes;
        self
    }
}
