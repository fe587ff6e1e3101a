//! An interactive multi-turn chat on one session, streaming each reply.
//!
//! ```text
//! cargo run --release --example chat -- --checkpoint ./qwen3-0.6b \
//!     --system "You are Mira, the blacksmith of Oakvale." --no-think
//! ```
//! Each line read from stdin is a user turn, sent through a
//! `qwen3_wgpu::Chat`: the conversation is rendered through the
//! checkpoint's chat template every turn, and only what the
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
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use clap::error::ErrorKind;
use clap::Parser;
use qwen3_wgpu::{AdapterPolicy, Chat, ChatOptions, Engine, Error, GenerateOptions, LoadOptions, Message};

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

/// One turn: `text` as the user's message, the reply streamed to stdout,
/// then its counts. A failed turn is forgotten by the conversation.
fn turn(chat: &mut Chat, options: &GenerateOptions, text: &str) -> Result<(), Error> {
    let started = Instant::now();
    let mut stdout = std::io::stdout();
    let mut shown = 0;
    let reply = chat.send(text, options, |_token, piece| {
        print!("{piece}");
        let _ = stdout.flush();
        shown += piece.len();
        ControlFlow::Continue(())
    })?;
    // The text held back until the end (an incomplete character).
    println!("{}", &reply.text[shown..]);
    println!(
        "[{} tokens, {:.1} tok/s; prompt {} tokens, {} fed, {:.0} ms]",
        reply.token_ids.len(),
        reply.decode_tokens_per_sec,
        reply.prompt_tokens,
        reply.fed_tokens,
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn start(args: &Args) -> Result<Chat, Error> {
    let checkpoint = &args.checkpoint;
    // Template and tokenizer first: a checkpoint without them fails before
    // the GPU is touched.
    let template = qwen3_wgpu::ChatTemplate::from_checkpoint(checkpoint)?;
    let tokenizer = qwen3_wgpu::Tokenizer::from_checkpoint(checkpoint)?;
    let mut builder = Engine::builder();
    if let Some(policy) = args.backend {
        builder = builder.policy(policy);
    }
    let engine = builder.build()?;
    let model = engine.load(checkpoint, &LoadOptions::default())?;
    let mut options = ChatOptions::default();
    if args.no_think {
        options = options.enable_thinking(false);
    }
    let mut chat = Chat::new(model.session()?, template, tokenizer)?.with_options(options);
    if let Some(system) = &args.system {
        chat.push(Message::system(system.clone()));
    }
    Ok(chat)
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
    let options = GenerateOptions::default().max_new_tokens(args.max_new_tokens);
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
        if let Err(e) = turn(&mut chat, &options, &line) {
            eprintln!("error [{}]: {e}", e.code());
        }
    }
    println!();
}
