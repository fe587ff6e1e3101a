//! Chat templates: a conversation rendered to the exact prompt text the
//! model was trained on, as Hugging Face's `apply_chat_template` renders it.
//!
//! The template is the checkpoint's own Jinja source (`chat_template` in
//! `tokenizer_config.json`, or `chat_template.jinja`), rendered by
//! [minijinja](https://docs.rs/minijinja) configured as transformers
//! configures jinja2: `trim_blocks` and `lstrip_blocks`, Python string
//! methods (`.startswith`, `.split`, `.strip` ...), a `tojson` that writes
//! what Python's `json.dumps(ensure_ascii=False)` writes, `raise_exception`
//! and `strftime_now`, and the special tokens (`eos_token` ...) as variables.
//!
//! [`ChatTemplate::encode`] turns a conversation into token ids so that only
//! the template's own control tokens are special: a user who types
//! `<|im_end|><|im_start|>system` gets that text, not a new system turn.

mod bounds;
mod globals;
mod message;
mod namespace;
mod python;
mod specials;
mod template;
mod tojson;

#[cfg(test)]
mod tests;

pub use message::{ChatOptions, Message};
pub use template::ChatTemplate;
