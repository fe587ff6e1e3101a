//! An NPC that acts through game functions: a chat loop whose replies may
//! call tools (Qwen3's tool calls), each call run by the "game" and its
//! result fed back as a tool turn, then the NPC answers.
//!
//! ```text
//! cargo run --release --example tools -- --checkpoint ./qwen3-0.6b [--tool-choice auto|required]
//! ```
//! Each line read from stdin is the player's turn. The reply is free text
//! until the model starts a call (`--tool-choice auto`, the default), or
//! only calls (`required`); either way every call names one of the game's
//! tools with arguments valid under its schema (`Constraint::tool_calls`).
//! Each call prints as `call NAME(ARGUMENTS) -> RESULT`; after the results
//! the NPC replies once more, free. It runs on a random checkpoint too
//! (with Qwen3's tokenizer files): the calls are valid, the words nonsense.
//! End of input ends it (exit 0); a failure exits with status 2.

use std::io::BufRead;
use std::ops::ControlFlow;
use std::path::PathBuf;

use clap::Parser;
use qwen3_wgpu::{
    AdapterPolicy, CachePolicy, Chat, ChatOptions, ChatTemplate, Constraint, Engine, Error, GenerateOptions,
    LoadOptions, Message, Tokenizer, ToolChoice,
};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(version, about = "An NPC calling game functions (Qwen3 tool calls) on the GPU")]
struct Args {
    /// Hugging Face checkpoint directory of an instruct model (config.json,
    /// safetensors, tokenizer.json, tokenizer_config.json).
    #[arg(long, default_value = "./qwen3-0.6b")]
    checkpoint: PathBuf,
    /// Adapters: `metal` (Apple GPUs only) or `portable`. Default:
    /// QWEN3_WGPU_BACKEND, else metal.
    #[arg(long, value_name = "NAME", value_parser = |v: &str| AdapterPolicy::from_name("--backend", v))]
    backend: Option<AdapterPolicy>,
    /// `auto`: free text until the model starts a call; `required`: the
    /// reply is calls.
    #[arg(long, value_name = "auto|required", default_value = "auto")]
    tool_choice: String,
    /// Most new tokens per reply.
    #[arg(long, value_name = "N", default_value = "256")]
    max_new_tokens: usize,
    /// Convert the weights in memory, reading and writing no cache.
    #[arg(long)]
    no_cache: bool,
}

/// The game: the player's gold and where the NPC stands.
struct Game {
    gold: i64,
    place: String,
}

/// The game's functions, as the chat template takes them.
fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "give_gold", "description": "Give the player gold.",
            "parameters": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 100}},
                           "required": ["amount"], "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "walk_to", "description": "Walk to a place in the village.",
            "parameters": {"type": "object", "properties": {"place": {"enum": ["forge", "tavern", "gate"]}},
                           "required": ["place"], "additionalProperties": false}}}),
    ]
}

impl Game {
    /// Runs one call; its result, as the tool turn's text.
    fn run(&mut self, name: &str, arguments: &Value) -> String {
        match name {
            "give_gold" => {
                self.gold += arguments["amount"].as_i64().unwrap_or(0);
                json!({"player_gold": self.gold}).to_string()
            }
            "walk_to" => {
                self.place = arguments["place"].as_str().unwrap_or("?").to_string();
                json!({"npc_at": self.place}).to_string()
            }
            other => json!({"error": format!("no function {other}")}).to_string(),
        }
    }
}

fn run(args: &Args) -> Result<(), Error> {
    let choice = match args.tool_choice.as_str() {
        "auto" => ToolChoice::Auto,
        "required" => ToolChoice::Required,
        other => {
            return Err(Error::InvalidArgument {
                name: "--tool-choice".into(),
                reason: format!("{other:?} is not auto or required"),
            })
        }
    };
    let template = ChatTemplate::from_checkpoint(&args.checkpoint)?;
    let tokenizer = Tokenizer::from_checkpoint(&args.checkpoint)?;
    let tools = tools();
    // Compiled once (the first constraint also maps the vocabulary).
    let calls = Constraint::tool_calls(&tokenizer, &tools, &choice, 4)?;
    let mut builder = Engine::builder();
    if let Some(policy) = args.backend {
        builder = builder.policy(policy);
    }
    let engine = builder.build()?;
    let cache = if args.no_cache { CachePolicy::Disabled } else { CachePolicy::Default };
    let model = engine.load(&args.checkpoint, &LoadOptions { cache, ..Default::default() })?;
    let options = ChatOptions::default().enable_thinking(false).tools(tools);
    let mut chat = Chat::new(model.session()?, template, tokenizer)?.with_options(options);
    chat.push(Message::system("You are Mira, the blacksmith of Oakvale. Use the tools to act."));
    let acting = GenerateOptions::default().max_new_tokens(args.max_new_tokens).constraint(&calls);
    let talking = GenerateOptions::default().max_new_tokens(args.max_new_tokens);
    let mut game = Game { gold: 0, place: "forge".into() };
    for line in std::io::stdin().lock().lines() {
        let line =
            line.map_err(|e| Error::InvalidArgument { name: "stdin".into(), reason: e.to_string() })?;
        if line.trim().is_empty() {
            continue;
        }
        let reply = chat.send(&line, &acting, |_, _| ControlFlow::Continue(()))?;
        let calls = qwen3_wgpu::parse_tool_calls(&reply.text);
        if !calls.content.is_empty() {
            println!("npc: {}", calls.content);
        }
        if calls.calls.is_empty() {
            continue;
        }
        for call in &calls.calls {
            let result = game.run(&call.name, &call.arguments);
            println!("call {}({}) -> {result}", call.name, call.arguments);
            chat.push(Message::tool(result));
        }
        let answer = chat.reply(&talking, |_, _| ControlFlow::Continue(()))?;
        println!("npc: {}", answer.text.trim());
    }
    Ok(())
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if e.use_stderr() => {
            let e = Error::InvalidArgument { name: "arguments".into(), reason: e.kind().to_string() };
            eprintln!("error [{}]: {e}", e.code());
            std::process::exit(2);
        }
        Err(e) => e.exit(),
    };
    if let Err(e) = run(&args) {
        eprintln!("error [{}]: {e}", e.code());
        std::process::exit(2);
    }
}
