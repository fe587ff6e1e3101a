//! An interactive multi-turn chat on one session, streaming each reply.
//!
//! ```text
//! cargo run --release --example chat -- --checkpoint ./qwen3-0.6b \
//!     --system "You are Mira, the blacksmith of Oakvale." --no-think
//! ```
//! Each line read from stdin is a user turn. The conversation is rendered
//! through the checkpoint's chat template every turn, and only what the
//! session does not already hold is fed: the KV cache keeps the whole
//! conversation. Where the rendering of earlier turns differs from what the
//! session holds (Qwen3's template drops the `<think>` blocks of earlier
//! replies), the session is rewound to the common prefix first. A reply
//! ends at the template's end of turn (`<|im_end|>`), an end-of-text id of
//! the checkpoint, or `--max-new-tokens`; `[n tokens, t tok/s]` follows it.
//! End of input ends the chat (exit 0). A failed turn prints
//! `error [code]: message` and is forgotten; a failure before the first
//! turn (arguments, checkpoint, GPU) exits with status 2.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use clap::error::ErrorKind;
use clap::Parser;
use qwen3_wgpu::{
    AdapterPolicy, ChatOptions, ChatTemplate, Engine, Error, LoadOptions, Message, Session, Tokenizer,
};

#[derive(Parser)]
#[command(version, about = "Interactive Qwen3 chat on the GPU (int8 weights, wgpu)")]
struct Args {
    /// Hugging Face checkpoint directory of an instruct model (config.json,
    /// safetensors, tokenizer.json, tokenizer_config.json).
    #[arg(long, default_value = "./qwen3-0.6b")]
    checkpoint: PathBuf,
    /// Adapters: `metal` (Apple GPUs only) or `portable` (any adapter
    /// wgpu offers). Default: QWEN3_WGPU_BACKEND, else metal.
    #[arg(long, value_name = "NAME", value_parser = parse_backend)]
    backend: Option<AdapterPolicy>,
    /// A system message opening the conversation.
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Most new tokens per reply.
    #[arg(long, value_name = "N", default_value = "512")]
    max_new_tokens: usize,
    /// Turn the template's thinking off (Qwen3's `enable_thinking=false`).
    #[arg(long)]
    no_think: bool,
}

fn parse_backend(value: &str) -> Result<AdapterPolicy, Error> {
    AdapterPolicy::from_name("--backend", value)
}

/// One conversation on one session, and the tokens that session holds.
struct Chat {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    options: ChatOptions,
    messages: Vec<Message>,
    session: Session,
    /// What the session holds: its KV cache's positions, then its pending
    /// token (the last one returned, committed by the next `feed`).
    held: Vec<u32>,
    /// Ids that end a reply: the template's end of turn and the config's.
    end_ids: Vec<u32>,
    max_new_tokens: usize,
}

impl Chat {
    /// One turn: `text` as the user's message, the reply streamed to
    /// stdout. On failure the user's message is dropped and the session
    /// rewound to empty, so the next turn starts from a known state.
    fn turn(&mut self, text: &str) -> Result<(), Error> {
        self.messages.push(Message::user(text));
        let out = self.reply();
        if out.is_err() {
            self.messages.pop();
            self.held.clear();
            self.session.truncate(0)?;
        }
        out
    }

    fn reply(&mut self) -> Result<(), Error> {
        let ids = self.template.encode(&self.tokenizer, &self.messages, &self.options)?;
        // Feed only what the session lacks, and at least one token (feed
        // returns the prediction after its last id).
        let common = ids.iter().zip(&self.held).take_while(|(a, b)| a == b).count();
        let keep = common.min(ids.len().saturating_sub(1));
        if keep < self.held.len() {
            // The session's last position (or pending token) differs from
            // the new rendering: rewind to what both share. `keep` never
            // exceeds the KV positions here, as the pending token is the
            // last of `held`.
            self.session.truncate(keep.min(self.session.len()))?;
            self.held.truncate(keep.min(self.session.len()));
        }
        let start = self.held.len();
        let started = Instant::now();
        let mut token = self.session.feed(&ids[start..])?;
        self.held.extend_from_slice(&ids[start..]);
        let mut stream = self.tokenizer.stream();
        let mut reply = Vec::new();
        let mut stdout = std::io::stdout();
        let mut first_at = None;
        while !self.end_ids.contains(&token) && reply.len() < self.max_new_tokens {
            reply.push(token);
            self.held.push(token);
            let piece = stream.push(token)?;
            print!("{piece}");
            let _ = stdout.flush();
            first_at.get_or_insert_with(Instant::now);
            if reply.len() == self.max_new_tokens {
                break;
            }
            token = self.session.next_token()?;
        }
        if reply.is_empty() || self.end_ids.contains(&token) {
            // Pending, not part of the reply: the next feed commits it (or
            // the next turn's rewind drops it where the rendering differs).
            self.held.push(token);
        }
        println!("{}", stream.finish()?);
        let n = reply.len();
        // Decode speed over the tokens after the first (the first came
        // with the prompt's prefill).
        let rate = match first_at {
            Some(t) if n > 1 => (n - 1) as f64 / t.elapsed().as_secs_f64().max(1e-9),
            _ => 0.0,
        };
        println!(
            "[{n} tokens, {rate:.1} tok/s; prompt {} tokens, {} fed, {:.0} ms]",
            ids.len(),
            ids.len() - start,
            started.elapsed().as_secs_f64() * 1e3
        );
        let content = self.tokenizer.decode(&reply)?;
        self.messages.push(Message::assistant(content));
        Ok(())
    }
}

fn start(args: &Args) -> Result<Chat, Error> {
    let checkpoint = &args.checkpoint;
    // Template and tokenizer first: a checkpoint without them fails before
    // the GPU is touched.
    let template = ChatTemplate::from_checkpoint(checkpoint)?;
    let tokenizer = Tokenizer::from_checkpoint(checkpoint)?;
    let mut builder = Engine::builder();
    if let Some(policy) = args.backend {
        builder = builder.policy(policy);
    }
    let engine = builder.build()?;
    let model = engine.load(checkpoint, &LoadOptions::default())?;
    let session = model.session()?;
    let mut end_ids = model.config().eos_token_ids.clone();
    end_ids.extend(tokenizer.token_id("<|im_end|>"));
    let mut options = ChatOptions::default();
    if args.no_think {
        options = options.enable_thinking(false);
    }
    let messages = args.system.iter().map(|s| Message::system(s.clone())).collect();
    Ok(Chat {
        tokenizer,
        template,
        options,
        messages,
        session,
        held: Vec::new(),
        end_ids,
        max_new_tokens: args.max_new_tokens,
    })
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => e.exit(),
        Err(e) => {
            // The same one-line form as every other error.
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or_default();
            let reason = first.strip_prefix("error: ").unwrap_or(first).to_string();
            let e = Error::InvalidArgument { name: "arguments".into(), reason };
            eprintln!("error [{}]: {e}", e.code());
            std::process::exit(2);
        }
    };
    let mut chat = match start(&args) {
        Ok(chat) => chat,
        Err(e) => {
            eprintln!("error [{}]: {e}", e.code());
            std::process::exit(2);
        }
    };
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        print!("> ");
        let _ = std::io::stdout().flush();
        let line = match lines.next() {
            Some(Ok(line)) => line,
            Some(Err(e)) => {
                eprintln!("error: reading stdin: {e}");
                std::process::exit(2);
            }
            None => break,
        };
        if line.trim().is_empty() {
            continue;
        }
        if let Err(e) = chat.turn(&line) {
            eprintln!("error [{}]: {e}", e.code());
        }
    }
    println!();
}
