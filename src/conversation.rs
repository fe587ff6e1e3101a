//! A conversation kept on one session: the messages, rendered through the
//! checkpoint's chat template every turn, with only the tokens the session
//! lacks fed (the KV cache keeps the conversation).

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use crate::chat::{ChatOptions, ChatTemplate, Message};
use crate::engine::{GenerateOptions, Model, StopReason};
use crate::error::{Error, Result};
use crate::session::Session;
use crate::stop::StopMatcher;
use crate::tokenizer::Tokenizer;

/// The token that ends a turn in Qwen3's (ChatML) template.
const END_OF_TURN: &str = "<|im_end|>";

/// A multi-turn conversation on one [`Session`]: the messages, the chat
/// template and the tokenizer. Each [`send`](Self::send) renders the whole
/// conversation, feeds only the tokens the session does not hold yet, and
/// generates the reply, which is recorded as the assistant's message.
///
/// Where the template renders earlier turns differently from what the
/// session holds (Qwen3's drops the `<think>` blocks of earlier replies; a
/// reply's text may encode to other tokens than those generated), the
/// session is rewound with [`Session::truncate`] to the longest common
/// prefix and the rest is fed. The last generated token (the end of turn,
/// pending in the session) is never lost: the next turn's feed commits it
/// when the rendering holds it. User text is encoded with special-token
/// parsing off ([`ChatTemplate::encode`]), so a player typing
/// `<|im_end|><|im_start|>system` gets those characters, not control
/// tokens; [`ChatOptions::special_tokens_in_content`] opts in.
///
/// ```no_run
/// use std::ops::ControlFlow;
/// use qwen3_wgpu::{Chat, ChatOptions, Engine, GenerateOptions, LoadOptions, Message};
/// let engine = Engine::new()?;
/// let model = engine.load("./qwen3-0.6b", &LoadOptions::default())?;
/// let mut chat = Chat::from_checkpoint(&model, "./qwen3-0.6b".as_ref())?
///     .with_options(ChatOptions::default().enable_thinking(false));
/// chat.push(Message::system("You are Mira, the blacksmith of Oakvale."));
/// let options = GenerateOptions::default().max_new_tokens(256);
/// let reply = chat.send("Can you fix my sword?", &options, |_token, text| {
///     print!("{text}");
///     ControlFlow::Continue(())
/// })?;
/// println!("\n[{} tokens, {} fed]", reply.token_ids.len(), reply.fed_tokens);
/// chat.send("How much?", &options, |_, text| {
///     print!("{text}");
///     ControlFlow::Continue(())
/// })?;
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
pub struct Chat {
    session: Session,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    options: ChatOptions,
    messages: Vec<Message>,
    /// What the session holds: its positions' tokens, then its pending
    /// token (the last one generated, committed by the next feed).
    held: Vec<u32>,
    /// Ids that end a reply: the template's end of turn and the model's
    /// end-of-text ids.
    end_ids: Vec<u32>,
}

/// What one turn of a [`Chat`] produced.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ChatReply {
    /// The reply's text, recorded as the assistant's message: it ends before
    /// a stop string that matched, and leaves out the end of turn.
    pub text: String,
    /// The generated ids of the reply, without the end of turn (or
    /// end-of-text id) that ended it.
    pub token_ids: Vec<u32>,
    /// Why the reply ended: [`StopReason::EndOfText`] at the end of turn or
    /// an end-of-text id, else as [`crate::Model::generate_with`].
    pub stop_reason: StopReason,
    /// Tokens of the rendered conversation the reply followed.
    pub prompt_tokens: usize,
    /// How many of them were fed this turn (the rest the session held).
    pub fed_tokens: usize,
    /// Time to feed them and get the first token, ms.
    pub prefill_ms: f64,
    /// Generated tokens per second after the first.
    pub decode_tokens_per_sec: f64,
}

impl Chat {
    /// A conversation on `session` with no messages yet. The session may
    /// already hold tokens (a [`Session::fork`] of a session fed a shared
    /// system prompt, say): they are read back once, and the first turn
    /// reuses them as far as they match its rendering.
    ///
    /// Errors: [`Error::InvalidArgument`] naming `session` while a feed is
    /// in progress on it; a GPU failure reading its tokens back.
    pub fn new(session: Session, template: ChatTemplate, tokenizer: Tokenizer) -> Result<Self> {
        let mut held = session.tokens()?;
        held.extend(session.pending());
        let mut end_ids = session.model_config().eos_token_ids.clone();
        end_ids.extend(tokenizer.token_id(END_OF_TURN));
        Ok(Chat {
            session,
            template,
            tokenizer,
            options: ChatOptions::default(),
            messages: Vec::new(),
            held,
            end_ids,
        })
    }

    /// A conversation on a new session of `model` (its default capacity),
    /// with the chat template and tokenizer of the checkpoint directory
    /// `dir` ([`ChatTemplate::from_checkpoint`], [`Tokenizer::from_checkpoint`]).
    pub fn from_checkpoint(model: &Model, dir: &Path) -> Result<Self> {
        let template = ChatTemplate::from_checkpoint(dir)?;
        let tokenizer = Tokenizer::from_checkpoint(dir)?;
        Chat::new(model.session()?, template, tokenizer)
    }

    /// Renders with `options` from now on (thinking, tools, variables).
    /// `add_generation_prompt` and `continue_final_message` are set by each
    /// turn (a reply needs the generation prompt).
    pub fn with_options(mut self, options: ChatOptions) -> Self {
        self.options = options;
        self
    }

    /// Appends a message without generating: a system prompt, or earlier
    /// history.
    pub fn push(&mut self, message: Message) {
        self.messages.push(message);
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The conversation, to edit (drop old turns to make room, say): the
    /// next turn feeds whatever the edited conversation's rendering does
    /// not share with the session.
    pub fn messages_mut(&mut self) -> &mut Vec<Message> {
        &mut self.messages
    }

    /// The session the conversation is kept on.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The session, for a caller done with the conversation.
    pub fn into_session(self) -> Session {
        self.session
    }

    /// One turn: appends `user_text` as the user's message, generates the
    /// reply (see [`reply`](Self::reply)) and returns it.
    ///
    /// On failure the user's message is removed again (the conversation is
    /// as before the call).
    pub fn send(
        &mut self,
        user_text: &str,
        options: &GenerateOptions,
        on_token: impl FnMut(u32, &str) -> ControlFlow<()>,
    ) -> Result<ChatReply> {
        self.messages.push(Message::user(user_text));
        let out = self.reply(options, on_token);
        if out.is_err() {
            self.messages.pop();
        }
        out
    }

    /// Generates the assistant's reply to the conversation as it is (after
    /// [`push`](Self::push)ing a user or tool message) and records it.
    /// Renders the conversation with the generation prompt, feeds what the
    /// session lacks (rewinding to the common prefix first where needed),
    /// and generates until the end of turn (`<|im_end|>`), an end-of-text
    /// id (the model's and `options.eos_token_ids`), a stop string, the
    /// callback's `Break`, or `options.max_new_tokens`, checked on each
    /// token in that order. `on_token` gets each reply token with the text
    /// it makes final (empty while a character or a possible stop string is
    /// incomplete); those pieces are a prefix of [`ChatReply::text`], which
    /// adds what was held back at the end. The end of turn is not passed
    /// to `on_token`: it stays pending in the session, and the next turn
    /// commits it.
    ///
    /// Errors: [`Error::InvalidArgument`] for an empty stop string (`stop`),
    /// an end-of-text id outside the vocabulary (`eos_token_ids`), or while
    /// a feed is in progress (`session`); those of
    /// [`ChatTemplate::encode`] and [`Session::feed`] (`context_overflow`
    /// when the conversation outgrows the session). After a failure no
    /// reply is recorded, and the next turn resumes from what the session
    /// still holds.
    pub fn reply(
        &mut self,
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32, &str) -> ControlFlow<()>,
    ) -> Result<ChatReply> {
        let vocab = self.session.model_config().vocab_size;
        if let Some(&id) = options.eos_token_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::invalid_argument(
                "eos_token_ids",
                format!("{id} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        let mut matcher = StopMatcher::new(options.stops().iter().cloned())?;
        // The reply samples as the options say (greedy by default).
        if self.session.sampling() != &options.sampling {
            self.session.set_sampling(&options.sampling)?;
        }
        let render = self.options.clone().continue_final_message(false).add_generation_prompt(true);
        let ids = self.template.encode(&self.tokenizer, &self.messages, &render)?;
        let out = self.generate(&ids, options, &mut matcher, &mut on_token);
        if out.is_err() {
            self.resync();
        }
        let reply = out?;
        self.messages.push(self.assistant_message(&reply.text));
        Ok(reply)
    }

    fn generate(
        &mut self,
        ids: &[u32],
        options: &GenerateOptions,
        matcher: &mut StopMatcher,
        on_token: &mut impl FnMut(u32, &str) -> ControlFlow<()>,
    ) -> Result<ChatReply> {
        // Feed only what the session lacks, and at least one token (feed
        // returns the prediction after its last id).
        let common = ids.iter().zip(&self.held).take_while(|(a, b)| a == b).count();
        let keep = common.min(ids.len().saturating_sub(1));
        if keep < self.held.len() {
            // The session's last position or pending token differs from
            // the rendering: rewind to what both share. `keep` is at most
            // the session's length here, as its pending token is the last
            // of `held`.
            let keep = keep.min(self.session.len());
            self.session.truncate(keep)?;
            self.held.truncate(keep);
        }
        let start = self.held.len();
        self.session.set_constraint(options.constraint_in_use())?;
        let t0 = Instant::now();
        let mut token = self.session.feed(&ids[start..])?;
        self.held.extend_from_slice(&ids[start..]);
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut reply = ChatReply {
            text: String::new(),
            token_ids: Vec::new(),
            stop_reason: StopReason::MaxNewTokens,
            prompt_tokens: ids.len(),
            fed_tokens: ids.len() - start,
            prefill_ms,
            decode_tokens_per_sec: 0.0,
        };
        let is_end = |t: &u32| self.end_ids.contains(t) || options.eos_token_ids.contains(t);
        let mut stream = self.tokenizer.stream();
        let t1 = Instant::now();
        let mut steps = 0usize;
        let mut stopped_by_string = false;
        loop {
            // Pending in the session from here on: part of what it holds.
            self.held.push(token);
            if reply.token_ids.len() >= options.max_new_tokens {
                break;
            }
            if is_end(&token) {
                reply.stop_reason = StopReason::EndOfText;
                break;
            }
            reply.token_ids.push(token);
            let step = matcher.push(&stream.push(token)?);
            reply.text.push_str(&step.text);
            let flow = on_token(token, &step.text);
            if let Some(index) = step.stopped {
                reply.stop_reason = StopReason::StopString(index);
                stopped_by_string = true;
                break;
            }
            if flow.is_break() {
                reply.stop_reason = StopReason::Callback;
                break;
            }
            if self.session.constraint_complete() {
                reply.stop_reason = StopReason::ConstraintComplete;
                break;
            }
            if reply.token_ids.len() >= options.max_new_tokens {
                break;
            }
            token = self.session.next_token()?;
            steps += 1;
        }
        let secs = t1.elapsed().as_secs_f64();
        if steps > 0 && secs > 0.0 {
            reply.decode_tokens_per_sec = steps as f64 / secs;
        }
        if !stopped_by_string {
            // The text held back (an incomplete character, the start of a
            // stop string) is final, unless it completes a stop string.
            let step = matcher.push(&stream.finish()?);
            reply.text.push_str(&step.text);
            match step.stopped {
                Some(index) => reply.stop_reason = StopReason::StopString(index),
                None => reply.text.push_str(&matcher.finish()),
            }
        }
        Ok(reply)
    }

    /// The assistant's message for a reply's text: with tools in the
    /// options, its whole tool calls as the message's `tool_calls` and the
    /// text outside them as its content (as transformers holds a parsed
    /// reply), so the template renders the calls itself.
    fn assistant_message(&self, text: &str) -> Message {
        if self.options.tools.is_empty() {
            return Message::assistant(text);
        }
        let parsed = crate::constraint::parse_tool_calls(text);
        if parsed.calls.is_empty() {
            return Message::assistant(text);
        }
        parsed
            .calls
            .into_iter()
            .fold(Message::assistant(parsed.content), |m, call| m.with_tool_call(call.name, call.arguments))
    }

    /// After a failed turn: `held` from what the session really holds (or
    /// an empty session when even that cannot be read).
    fn resync(&mut self) {
        match self.session.tokens() {
            Ok(mut tokens) => {
                tokens.extend(self.session.pending());
                self.held = tokens;
            }
            Err(_) => {
                self.held.clear();
                let _ = self.session.truncate(0);
            }
        }
    }
}
