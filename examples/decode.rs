//! Greedy decode from the command line.
//!
//! ```text
//! cargo run --release --example decode -- --checkpoint ./qwen3-0.6b-base \
//!     --prompt "The capital of France is" --max-new-tokens 16
//! ```
//! With `--json`, stdout's last line is one JSON object: the result, or
//! `{"error": {"code", "message"}}` for every failure, a malformed argument
//! included (`invalid_argument`). Errors exit with status 2; `--help` and
//! `--version` print as usual and exit 0.
//!
//! `--stop TEXT` (repeatable) ends generation when the generated text
//! contains TEXT (matched across token boundaries; needs the checkpoint's
//! tokenizer.json): the text printed, and `"text"` in the JSON, end before
//! it, and `"stop_reason"` is `stop_string` (`"stop_index"`: which one).
//!
//! `--chat` renders the `--prompt` text as one user turn through the
//! checkpoint's chat template (tokenizer_config.json) and also stops at the
//! template's end of turn (`<|im_end|>`); `--no-think` turns Qwen3's
//! thinking off. `--print-prompt` prints the exact text that would be
//! encoded (with `--json`: `{"prompt": "..."}`) and exits 0 without
//! touching the GPU or the weights.
//!
//! Sampling (greedy by default): `--temperature T` (0: greedy), `--top-k`,
//! `--top-p`, `--min-p`, `--repeat-penalty`, `--presence-penalty`,
//! `--frequency-penalty`, `--penalty-window` and `--seed` (see
//! `SamplingParams`); `--generation-config` starts from the checkpoint's
//! generation_config.json (the flags given win). The JSON's `"sampling"`
//! holds the parameters used. The same seed gives the same tokens.
//!
//! `--model ID` (with the `hub` feature) takes a Hugging Face model id
//! instead of `--checkpoint DIR`: downloaded into the Hugging Face cache,
//! or resolved from it offline (`HF_HUB_OFFLINE=1`).
//!
//! `--logprobs N` (at most 20) adds `"logprobs"` to the JSON: per generated
//! token, `{"token", "logprob", "top": [[id, logprob], ...]}`, the N most
//! likely tokens of the model's raw distribution (log_softmax of the
//! logits, before penalties and temperature).
//!
//! `--weights int4` converts the layers' weights to 4 bits (half their GPU
//! memory); the JSON's `"weights"` says which format the model runs.
//! `--kv-cache int8` keeps the KV cache in int8 (half its memory, for a
//! logit error of about 1.5% of the logits' rms); the JSON's `"kv_cache"`
//! says which.
//!
//! `--backend`, `--kernels`, `--matvec-layout`, `--cooperative-matrices`
//! and `--weights` win over the engine's environment variables
//! (`QWEN3_WGPU_BACKEND`, `QWEN3_WGPU_KERNELS`, `QWEN3_WGPU_MATVEC_LAYOUT`,
//! `QWEN3_WGPU_COOPERATIVE_MATRICES`, `QWEN3_WGPU_WEIGHTS`), which apply
//! when the flag is not given; a flag and its variable accept the same
//! names. `RUST_LOG=info` (or
//! `debug`) shows what the engine logs; warnings show by default.

use std::ffi::OsString;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::Parser;
use qwen3_wgpu::internals::checked_read;
use qwen3_wgpu::internals::kernels::MatvecLayout;
use qwen3_wgpu::{
    parse_tool_calls, AdapterPolicy, CachePolicy, ChatOptions, ChatTemplate, Constraint, Engine, Error,
    GenerateOptions, KernelChoice, KvFormat, LoadOptions, Message, SamplingParams, ShapeProfile, StopMatcher,
    StopReason, Tokenizer, ToolChoice, WeightFormat,
};
use serde_json::json;

/// A prompt given as token ids.
#[derive(Clone, Debug, PartialEq)]
struct TokenIds(Vec<u32>);

#[derive(Parser)]
#[command(version, about = "Qwen3 decode on the GPU (int8 weights, wgpu), greedy or sampled")]
struct Args {
    /// Hugging Face checkpoint directory (config.json + safetensors). Default:
    /// ./qwen3-0.6b-base, then the Hugging Face cache's Qwen3-0.6B-Base snapshot.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Hugging Face model id (`Qwen/Qwen3-0.6B-Base`) instead of
    /// --checkpoint: downloaded into the Hugging Face cache, or found there
    /// offline (HF_HUB_OFFLINE=1). Needs the `hub` feature.
    #[arg(long, value_name = "ID", conflicts_with = "checkpoint")]
    model: Option<String>,
    /// Prompt text (encoded with the checkpoint's tokenizer.json).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (`1,2,3`; spaces around an id
    /// are allowed). Needs no tokenizer.json.
    #[arg(long, value_name = "IDS", value_parser = parse_token_ids, allow_negative_numbers = true)]
    prompt_ids: Option<TokenIds>,
    /// Render --prompt as one user turn through the checkpoint's chat
    /// template (tokenizer_config.json); generation also ends at the
    /// template's end of turn (`<|im_end|>`).
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    /// With --chat: turn the template's thinking off (Qwen3's
    /// `enable_thinking=false`).
    #[arg(long)]
    no_think: bool,
    /// Print the exact text that would be encoded (the rendered chat text
    /// with --chat, else --prompt) and exit; reads no weights. With --json:
    /// `{"prompt": "..."}`.
    #[arg(long)]
    print_prompt: bool,
    /// Most new tokens to generate (0 to 18446744073709551615; more than
    /// the context holds is a context_overflow error before any decoding).
    #[arg(long, value_name = "N", default_value = "16", value_parser = parse_count, allow_negative_numbers = true)]
    max_new_tokens: usize,
    /// Stop when the generated text contains TEXT (repeatable; needs the
    /// checkpoint's tokenizer.json). The text shown ends before it.
    #[arg(long = "stop", value_name = "TEXT")]
    stops: Vec<String>,
    /// Constrain the output to one JSON value valid under the JSON schema
    /// in FILE (compact: no whitespace between tokens); needs the
    /// checkpoint's tokenizer.json. Ends with stop reason
    /// `constraint_complete` once the value is whole.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "grammar"])]
    json_schema: Option<PathBuf>,
    /// Constrain the output to match the regular expression RE whole.
    #[arg(long, value_name = "RE", conflicts_with = "grammar")]
    regex: Option<String>,
    /// Constrain the output to the Lark grammar (llguidance's dialect) in
    /// FILE.
    #[arg(long, value_name = "FILE")]
    grammar: Option<PathBuf>,
    /// Tools the model may call (with --chat): a JSON list of tool
    /// definitions (`{"type": "function", "function": {"name",
    /// "description", "parameters"}}`), rendered into the prompt; the JSON
    /// output gets "tool_calls".
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json_schema", "regex", "grammar"])]
    tools: Option<PathBuf>,
    /// With --tools: `auto` (default: free text until the model starts a
    /// call, the calls constrained to the tools' schemas), `required` (the
    /// reply is calls) or a tool's name (calls of that tool only).
    #[arg(long, value_name = "auto|required|NAME", requires = "tools")]
    tool_choice: Option<String>,
    /// Adapters: `metal` (Apple GPUs only) or `portable` (any adapter
    /// wgpu offers). Default: QWEN3_WGPU_BACKEND, else metal.
    #[arg(long, value_name = "NAME", value_parser = parse_backend)]
    backend: Option<AdapterPolicy>,
    /// Kernels: `auto` (the MSL twins on Metal, WGSL elsewhere; also `msl`)
    /// or `wgsl` (WGSL on Metal too). Default: QWEN3_WGPU_KERNELS, else auto.
    #[arg(long, value_name = "NAME", value_parser = parse_kernels)]
    kernels: Option<KernelChoice>,
    /// The WGSL matvec's work split: `rows` or `split`. Default:
    /// QWEN3_WGPU_MATVEC_LAYOUT, else the device's.
    #[arg(long, value_name = "NAME", value_parser = parse_matvec_layout)]
    matvec_layout: Option<MatvecLayout>,
    /// Prompt batches on cooperative matrices where the device offers them:
    /// `on` or `off` (experimental). Default:
    /// QWEN3_WGPU_COOPERATIVE_MATRICES, else on.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    cooperative_matrices: Option<bool>,
    /// The layers' weight format: `int8` or `int4`. Default:
    /// QWEN3_WGPU_WEIGHTS, else int8.
    #[arg(long, value_name = "NAME", value_parser = parse_weights)]
    weights: Option<WeightFormat>,
    /// The KV cache's format: `f16` (default) or `int8`.
    #[arg(long, value_name = "NAME", value_parser = parse_kv_cache, default_value = "f16")]
    kv_cache: KvFormat,
    /// Demand the exact Qwen3-0.6B-Base shape.
    #[arg(long)]
    exact_shape: bool,
    /// Where converted weights are cached (default: the platform cache dir).
    #[arg(long, conflicts_with = "no_cache")]
    cache_dir: Option<PathBuf>,
    /// Convert in memory; read and write no cache.
    #[arg(long)]
    no_cache: bool,
    /// Print one JSON object as the last line of stdout (errors included).
    #[arg(long)]
    json: bool,
    /// Sampling temperature (0, the default, and below 1e-5: greedy).
    #[arg(long, value_name = "T", allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Keep the K most likely tokens (0: off).
    #[arg(long, value_name = "K")]
    top_k: Option<u32>,
    /// Keep the most likely tokens up to probability P (1: off).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Keep tokens at least P times as likely as the top one (0: off).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    min_p: Option<f32>,
    /// Repetition penalty (Hugging Face's; 1: off; 1e-6 to 1e6).
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    repeat_penalty: Option<f32>,
    /// Presence penalty (OpenAI's; 0: off; -1e6 to 1e6).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    /// Frequency penalty (OpenAI's; 0: off; -1e6 to 1e6).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    /// Tokens of context the penalties look at (default 64).
    #[arg(long, value_name = "N")]
    penalty_window: Option<u32>,
    /// Seed of the sampling draws (default 0).
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Start from the checkpoint's generation_config.json (the sampling
    /// flags given win).
    #[arg(long)]
    generation_config: bool,
    /// Log-probabilities of the N most likely tokens with each generated
    /// token, in the JSON (at most 20).
    #[arg(long, value_name = "N", default_value_t = 0)]
    logprobs: u32,
}

impl Args {
    /// Whether a constraint flag is given (--tools is one).
    fn constrained(&self) -> bool {
        self.json_schema.is_some()
            || self.regex.is_some()
            || self.grammar.is_some()
            || self.tool_choice().is_some()
    }

    /// The tool choice that constrains the reply (`None` without --tools).
    fn tool_choice(&self) -> Option<ToolChoice> {
        self.tools.as_ref()?;
        Some(match self.tool_choice.as_deref() {
            None | Some("auto") => ToolChoice::Auto,
            Some("required") => ToolChoice::Required,
            Some(name) => ToolChoice::Named(name.to_string()),
        })
    }

    /// The tool definitions of `--tools` (a JSON list).
    fn tools(&self) -> Result<Option<Vec<serde_json::Value>>, Error> {
        let Some(path) = &self.tools else { return Ok(None) };
        let refuse = |reason: String| Error::InvalidArgument {
            name: "--tools".into(),
            reason: format!("{}: {reason}", path.display()),
        };
        let value: serde_json::Value = serde_json::from_str(&read_source("--tools", path)?)
            .map_err(|e| refuse(format!("not JSON: {e}")))?;
        let serde_json::Value::Array(tools) = value else {
            return Err(refuse("not a JSON list of tools".into()));
        };
        for (i, tool) in tools.iter().enumerate() {
            let function = tool.get("function").unwrap_or(tool);
            if !function.get("name").is_some_and(serde_json::Value::is_string) {
                return Err(refuse(format!("entry {i} has no string \"name\" (in \"function\" or itself)")));
            }
        }
        Ok(Some(tools))
    }

    /// The constraint the flags ask for, compiled against `tokenizer`.
    fn constraint(&self, tokenizer: &Tokenizer) -> Result<Constraint, Error> {
        if let (Some(choice), Some(tools)) = (self.tool_choice(), self.tools()?) {
            Constraint::tool_calls(tokenizer, &tools, &choice, Constraint::MAX_TOOL_CALLS)
        } else if let Some(path) = &self.json_schema {
            let schema = serde_json::from_str(&read_source("--json-schema", path)?).map_err(|e| {
                Error::InvalidArgument {
                    name: "--json-schema".into(),
                    reason: format!("{}: not JSON: {e}", path.display()),
                }
            })?;
            Constraint::json_schema(tokenizer, &schema)
        } else if let Some(regex) = &self.regex {
            Constraint::regex(tokenizer, regex)
        } else {
            let path = self.grammar.as_ref().ok_or_else(|| Error::InvalidArgument {
                name: "--grammar".into(),
                reason: "no constraint flag given".into(),
            })?;
            Constraint::lark(tokenizer, &read_source("--grammar", path)?)
        }
    }
    /// The sampling parameters the flags ask for (checked).
    fn sampling(&self, checkpoint: &Path) -> Result<SamplingParams, Error> {
        let mut p = if self.generation_config {
            SamplingParams::from_generation_config(checkpoint)?
        } else {
            SamplingParams::default()
        };
        if let Some(t) = self.temperature {
            p = p.temperature(t);
        }
        if let Some(k) = self.top_k {
            p = p.top_k(k);
        }
        if let Some(v) = self.top_p {
            p = p.top_p(v);
        }
        if let Some(v) = self.min_p {
            p = p.min_p(v);
        }
        if let Some(v) = self.repeat_penalty {
            p = p.repetition_penalty(v);
        }
        if let Some(v) = self.presence_penalty {
            p = p.presence_penalty(v);
        }
        if let Some(v) = self.frequency_penalty {
            p = p.frequency_penalty(v);
        }
        if let Some(v) = self.penalty_window {
            p = p.penalty_window(v);
        }
        if let Some(v) = self.seed {
            p = p.seed(v);
        }
        p.validate().map_err(|e| match e {
            // The flag's name, as the command line spells it.
            Error::InvalidArgument { name, reason } => {
                let flag = if name == "repetition_penalty" {
                    "repeat-penalty".to_string()
                } else {
                    name.replace('_', "-")
                };
                Error::InvalidArgument { name: format!("--{flag}"), reason }
            }
            other => other,
        })?;
        Ok(p)
    }
}

/// The sampling parameters as the JSON result shows them.
fn sampling_json(p: &SamplingParams) -> serde_json::Value {
    json!({
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "penalty_window": p.penalty_window,
        "seed": p.seed,
        "greedy": p.is_greedy(),
    })
}

/// `1,2,3` (spaces around an id allowed) as token ids. Every id is a whole
/// number below 2^32; empty lists and empty entries (`1,,2`) are refused
/// rather than skipped, so a typo never silently changes the prompt.
fn parse_token_ids(value: &str) -> Result<TokenIds, Error> {
    let invalid = |reason: String| Error::InvalidArgument { name: "--prompt-ids".into(), reason };
    if value.trim().is_empty() {
        return Err(invalid("no token ids given (expected comma-separated ids such as 1,2,3)".into()));
    }
    let ids = value
        .split(',')
        .enumerate()
        .map(|(i, piece)| {
            let id = piece.trim();
            if id.is_empty() {
                return Err(invalid(format!("entry {} of {value:?} is empty", i + 1)));
            }
            if !id.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid(format!(
                    "{id:?} is not a token id (a whole number from 0 to {})",
                    u32::MAX
                )));
            }
            id.parse::<u32>()
                .map_err(|_| invalid(format!("token id {id} is out of range (at most {})", u32::MAX)))
        })
        .collect::<Result<Vec<u32>, Error>>()?;
    Ok(TokenIds(ids))
}

/// A count of tokens: a whole number that fits `usize` (no sign, no spaces).
fn parse_count(value: &str) -> Result<usize, Error> {
    let invalid = |reason: String| Error::InvalidArgument { name: "--max-new-tokens".into(), reason };
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(format!("{value:?} is not a count (a whole number from 0 to {})", usize::MAX)));
    }
    value.parse().map_err(|_| invalid(format!("{value} is out of range (at most {})", usize::MAX)))
}

fn parse_backend(value: &str) -> Result<AdapterPolicy, Error> {
    AdapterPolicy::from_name("--backend", value)
}

fn parse_kernels(value: &str) -> Result<KernelChoice, Error> {
    KernelChoice::from_name("--kernels", value)
}

fn parse_matvec_layout(value: &str) -> Result<MatvecLayout, Error> {
    MatvecLayout::from_name("--matvec-layout", value)
}

fn parse_weights(value: &str) -> Result<WeightFormat, Error> {
    WeightFormat::from_name("--weights", value)
}

fn parse_kv_cache(value: &str) -> Result<KvFormat, Error> {
    KvFormat::from_name("--kv-cache", value)
}

fn parse_on_off(value: &str) -> Result<bool, Error> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(Error::InvalidArgument {
            name: "--cooperative-matrices".into(),
            reason: format!("unknown value {value:?}; allowed: on, off"),
        }),
    }
}

/// The engine's `invalid_argument` error for a command line clap refused:
/// a value parser's own error as it is, otherwise the flag clap names (or
/// `arguments`) and clap's one-line reason.
fn argument_error(e: &clap::Error) -> Error {
    use std::error::Error as _;
    if let Some(Error::InvalidArgument { name, reason }) = e.source().and_then(|s| s.downcast_ref::<Error>())
    {
        return Error::InvalidArgument { name: name.clone(), reason: reason.clone() };
    }
    let name = match e.get(ContextKind::InvalidArg) {
        // `--prompt-ids <IDS>`: the flag alone.
        Some(ContextValue::String(arg)) => arg.split_whitespace().next().unwrap_or(arg).to_string(),
        _ => "arguments".to_string(),
    };
    let rendered = e.render().to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let reason = first.strip_prefix("error: ").unwrap_or(first).to_string();
    Error::InvalidArgument { name, reason }
}

/// Whether `--json` is among the raw arguments (before any `--`): how a
/// command line clap refused still gets its JSON error.
fn json_requested(args: impl IntoIterator<Item = OsString>) -> bool {
    args.into_iter().skip(1).take_while(|a| a != "--").any(|a| a == "--json")
}

fn default_checkpoint() -> PathBuf {
    let local = PathBuf::from("./qwen3-0.6b-base");
    if local.exists() {
        return local;
    }
    let hub = std::env::var_os("HF_HUB_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HF_HOME").map(|h| Path::new(&h).join("hub")))
        .or_else(|| dirs::home_dir().map(|h| h.join(".cache/huggingface/hub")));
    if let Some(snapshots) = hub.map(|h| h.join("models--Qwen--Qwen3-0.6B-Base/snapshots")) {
        if let Ok(mut entries) = std::fs::read_dir(&snapshots) {
            if let Some(Ok(e)) = entries.next() {
                return e.path();
            }
        }
    }
    local
}

/// The checkpoint directory of Hugging Face model `id`, downloading it
/// (progress on stderr) unless the cache holds it.
#[cfg(feature = "hub")]
fn resolve_model(id: &str) -> Result<PathBuf, Error> {
    use qwen3_wgpu::hub::{resolve, HubOptions};
    let options = HubOptions::default().on_progress(|p| {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        eprint!("\rdownloading {}: {:.0} / {:.0} MiB", p.file, mib(p.bytes_done), mib(p.bytes_total));
        if p.bytes_done == p.bytes_total {
            eprintln!();
        }
        ControlFlow::Continue(())
    });
    resolve(id, &options)
}

#[cfg(not(feature = "hub"))]
fn resolve_model(id: &str) -> Result<PathBuf, Error> {
    Err(Error::InvalidArgument {
        name: "--model".into(),
        reason: format!(
            "resolving the Hugging Face id {id:?} needs the `hub` feature: \
             cargo run --release --features hub --example decode -- --model {id} ..., \
             or pass --checkpoint DIR"
        ),
    })
}

fn run(args: &Args) -> Result<serde_json::Value, Error> {
    // The tokenizer is read only when text is needed, before the GPU is
    // touched: to encode --prompt (a broken tokenizer.json is then an error
    // naming it), or to print the generated text, which --prompt-ids runs
    // can do without (a broken file costs the text, never the run).
    // Checked here rather than by clap, whose message for a missing
    // argument names no flag on its first line.
    if args.no_think && !args.chat {
        return Err(Error::InvalidArgument { name: "--no-think".into(), reason: "needs --chat".into() });
    }
    if args.tools.is_some() && !args.chat {
        return Err(Error::InvalidArgument { name: "--tools".into(), reason: "needs --chat".into() });
    }
    if (args.chat || args.print_prompt) && args.prompt.is_none() {
        let flag = if args.chat { "--chat" } else { "--print-prompt" };
        return Err(Error::InvalidArgument { name: flag.into(), reason: "needs --prompt TEXT".into() });
    }
    let checkpoint = match (&args.model, &args.checkpoint) {
        (Some(id), _) => resolve_model(id)?,
        (None, Some(dir)) => dir.clone(),
        (None, None) => default_checkpoint(),
    };
    // With --chat, the text encoded is the rendered conversation.
    let chat = match (&args.prompt, args.chat) {
        (Some(text), true) => {
            let template = ChatTemplate::from_checkpoint(&checkpoint)?;
            let mut options = ChatOptions::default();
            if args.no_think {
                options = options.enable_thinking(false);
            }
            if let Some(tools) = args.tools()? {
                options = options.tools(tools);
            }
            let conversation = [Message::user(text.clone())];
            let rendered = template.render(&conversation, &options)?;
            Some((template, conversation, options, rendered))
        }
        _ => None,
    };
    if args.print_prompt {
        let text = match &chat {
            Some((_, _, _, rendered)) => rendered.as_str(),
            None => args.prompt.as_deref().unwrap_or_default(),
        };
        if !args.json {
            print!("{text}");
        }
        return Ok(json!({ "prompt": text }));
    }
    let (prompt_ids, tokenizer) = match (&args.prompt, &args.prompt_ids) {
        (Some(_), _) if chat.is_some() => {
            let tokenizer = Tokenizer::from_checkpoint(&checkpoint)?;
            let (template, conversation, options, _) = chat.as_ref().expect("checked");
            (template.encode(&tokenizer, conversation, options)?, Some(tokenizer))
        }
        (Some(text), _) => {
            let tokenizer = Tokenizer::from_checkpoint(&checkpoint)?;
            (tokenizer.encode(text)?, Some(tokenizer))
        }
        // Stop strings are matched on the text, constraints compiled
        // against the vocabulary: the tokenizer is needed.
        (None, Some(TokenIds(ids))) if !args.stops.is_empty() || args.constrained() => {
            (ids.clone(), Some(Tokenizer::from_checkpoint(&checkpoint)?))
        }
        (None, Some(TokenIds(ids))) => {
            (ids.clone(), if args.json { None } else { text_printer(&checkpoint) })
        }
        (None, None) => return Err(Error::EmptyPrompt),
    };
    if prompt_ids.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let sampling = args.sampling(&checkpoint)?;
    let mut generate = GenerateOptions::default()
        .max_new_tokens(args.max_new_tokens)
        .sampling(sampling.clone())
        .kv_cache(args.kv_cache);
    if args.logprobs > 0 {
        generate = generate.logprobs(args.logprobs);
    }
    if args.stops.iter().any(String::is_empty) {
        let reason = "a stop string must not be empty".into();
        return Err(Error::InvalidArgument { name: "--stop".into(), reason });
    }
    // The template's end of turn ends the reply (an instruct model's
    // config.json may name only <|endoftext|>).
    if let (true, Some(end_of_turn)) = (args.chat, tokenizer.as_ref().and_then(|t| t.token_id("<|im_end|>")))
    {
        generate = generate.eos_token_ids([end_of_turn]);
    }
    if let (false, Some(t)) = (args.stops.is_empty(), tokenizer.as_ref()) {
        generate = generate.stop_strings(t, args.stops.iter().cloned());
    }
    let constraint = match tokenizer.as_ref() {
        Some(t) if args.constrained() => Some(args.constraint(t)?),
        _ => None,
    };
    if let Some(c) = &constraint {
        generate = generate.constraint(c);
    }
    // A setting left out here is read by the builder from its
    // QWEN3_WGPU_* variable, so a flag always wins over the variable. The
    // weight format's variable (read by the load) is read here with them,
    // so a bad value fails before any GPU work, as theirs do.
    let weights = match args.weights {
        Some(format) => format,
        None => WeightFormat::from_env()?.unwrap_or_default(),
    };
    let mut builder = Engine::builder();
    if let Some(policy) = args.backend {
        builder = builder.policy(policy);
    }
    if let Some(kernels) = args.kernels {
        builder = builder.kernels(kernels);
    }
    if let Some(layout) = args.matvec_layout {
        builder = builder.matvec_layout(layout);
    }
    if let Some(on) = args.cooperative_matrices {
        builder = builder.cooperative_matrices(on);
    }
    let engine = builder.build()?;
    let options = LoadOptions {
        profile: if args.exact_shape { ShapeProfile::Qwen3_0_6B } else { ShapeProfile::AnyQwen3 },
        cache: match (&args.cache_dir, args.no_cache) {
            (_, true) => CachePolicy::Disabled,
            (Some(dir), _) => CachePolicy::Dir(dir.clone()),
            (None, false) => CachePolicy::Default,
        },
        weights: Some(weights),
        ..Default::default()
    };
    let model = engine.load(&checkpoint, &options)?;
    let mut stream = tokenizer.as_ref().map(|t| t.stream());
    let echo = !args.json && args.prompt.is_some() && stream.is_some();
    if echo {
        match &chat {
            Some((_, _, _, rendered)) => print!("{rendered}"),
            None => print!("{}", args.prompt.as_deref().unwrap_or_default()),
        }
    }
    // The printed text goes through the same stop strings as the result's,
    // so nothing after a stop string is shown.
    let mut printed = StopMatcher::new(args.stops.iter().cloned())?;
    let show = |piece: String, printed: &mut StopMatcher| {
        print!("{}", printed.push(&piece).text);
        use std::io::Write;
        let _ = std::io::stdout().flush();
    };
    let out = model.generate_with(&prompt_ids, &generate, |id| {
        if let (false, Some(s)) = (args.json, stream.as_mut()) {
            if let Ok(piece) = s.push(id) {
                show(piece, &mut printed);
            }
        }
        ControlFlow::Continue(())
    });
    if let (false, Some(s), true) = (args.json, stream.as_mut(), out.is_ok()) {
        // Text held back for a character the last tokens left incomplete,
        // or for what could have begun a stop string.
        if let Ok(rest) = s.finish() {
            show(rest, &mut printed);
        }
        print!("{}", printed.finish());
    }
    if echo && out.is_err() {
        println!(); // the error goes on a line of its own
    }
    let out = out?;
    let info = engine.adapter_info();
    let report = model.load_report();
    if !args.json {
        println!();
        println!("prompt ids:    {:?}", prompt_ids);
        println!("generated ids: {:?}", out.generated_ids());
        println!(
            "decode {:.1} tok/s, prefill {:.1} ms ({} tokens), load {:.0} ms{} [{} via {:?}, {} kernels{}, {} weights{}, stop: {}]",
            out.decode_tokens_per_sec,
            out.prefill_ms,
            out.n_prompt,
            out.load_ms,
            if report.converted {
                format!(" (converted in {:.0} ms)", report.convert_ms)
            } else {
                " (cached)".into()
            },
            info.name,
            info.backend,
            engine.kernel_source().as_str(),
            if engine.kernel_report().f16_residual { ", f16 residual copy" } else { "" },
            model.weight_format().name(),
            if args.kv_cache == KvFormat::Int8 { ", int8 KV cache" } else { "" },
            out.stop_reason.as_str(),
        );
    }
    let mut result = json!({
        "token_ids": out.token_ids,
        "n_prompt": out.n_prompt,
        "generated_ids": out.generated_ids(),
        "decode_tokens_per_sec": out.decode_tokens_per_sec,
        "prefill_ms": out.prefill_ms,
        "load_ms": out.load_ms,
        "converted": out.converted,
        "stop_reason": out.stop_reason.as_str(),
        "adapter": {"name": info.name, "backend": format!("{:?}", info.backend).to_lowercase()},
        "kernels": engine.kernel_source().as_str(),
        "weights": model.weight_format().name(),
        "kv_cache": args.kv_cache.name(),
        "sampling": sampling_json(&sampling),
    });
    if let Some(text) = &out.text {
        result["text"] = json!(text);
    }
    if let (Some(_), Some(t)) = (&constraint, tokenizer.as_ref()) {
        // The constrained output: the generated text, an end-of-text token
        // that ended it left out; with --tools, the calls it made.
        let mut ids = out.generated_ids().to_vec();
        if out.stop_reason == StopReason::EndOfText {
            ids.pop();
        }
        let text = t.decode(&ids)?;
        if args.tools.is_some() {
            let reply = parse_tool_calls(&text);
            let calls: Vec<serde_json::Value> =
                reply.calls.iter().map(|c| json!({"name": c.name, "arguments": c.arguments})).collect();
            result["tool_calls"] = json!(calls);
            result["tool_calls_incomplete"] = json!(reply.incomplete);
        }
        result["text"] = json!(text);
        result["constraint_complete"] =
            json!(matches!(out.stop_reason, StopReason::ConstraintComplete | StopReason::EndOfText));
    }
    if args.logprobs > 0 {
        let per_token: Vec<serde_json::Value> = out
            .logprobs
            .iter()
            .map(|lp| json!({"token": lp.token, "logprob": lp.logprob, "top": lp.top}))
            .collect();
        result["logprobs"] = json!(per_token);
    }
    if let StopReason::StopString(index) = out.stop_reason {
        result["stop_index"] = json!(index);
    }
    let kernels = engine.kernel_report();
    let check = &kernels.self_check;
    result["self_check"] = json!({"ok": check.ok, "pipelines": check.pipelines, "ms": check.ms});
    if let Some((kernel, reason)) = &kernels.fallback {
        result["kernels_fallback"] = json!(format!("{kernel}: {reason}"));
    }
    result["cooperative_matrices"] = json!(kernels.cooperative_matrices);
    result["f16_residual"] = json!(kernels.f16_residual);
    if let Some(reason) = &kernels.cooperative_fallback {
        result["cooperative_fallback"] = json!(reason);
    }
    Ok(result)
}

/// The checkpoint's tokenizer for printing generated text, if it has a
/// usable one; a broken one is reported (naming the file) and skipped.
fn text_printer(checkpoint: &Path) -> Option<Tokenizer> {
    if !checkpoint.join("tokenizer.json").exists() {
        return None;
    }
    Tokenizer::from_checkpoint(checkpoint)
        .inspect_err(|e| log::warn!("[{}] {e}; printing token ids only", e.code()))
        .ok()
}

/// The error on stderr (one line, with its code) and, with `--json`, as the
/// last line of stdout; exit status 2.
fn fail(e: &Error, json: bool) -> ! {
    eprintln!("error [{}]: {e}", e.code());
    match e {
        // A checkpoint without a tokenizer (random_checkpoint writes none):
        // the weights are there, only text needs the file.
        Error::CheckpointNotFound { path, .. } if path.file_name().is_some_and(|n| n == "tokenizer.json") => {
            eprintln!("  this checkpoint has no tokenizer.json: pass token ids with --prompt-ids")
        }
        Error::CheckpointNotFound { .. } => eprintln!(
            "  get one: hf download Qwen/Qwen3-0.6B-Base --local-dir ./qwen3-0.6b-base \
             (or --checkpoint DIR; README, \"Run it\")"
        ),
        _ => {}
    }
    if json {
        println!("{}", json!({"error": {"code": e.code(), "message": e.to_string()}}));
    }
    std::process::exit(2);
}

/// The text of the constraint file `path` (flag `flag`), through the
/// engine's checked reader (a regular file, opened without blocking, of at
/// most `Constraint::MAX_SOURCE_LEN` bytes); a refusal names the flag.
fn read_source(flag: &str, path: &Path) -> Result<String, Error> {
    let refuse = |reason: String| Error::InvalidArgument { name: flag.into(), reason };
    let limit = Constraint::MAX_SOURCE_LEN as u64;
    let bytes = match checked_read::read_file(path, flag, limit) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Err(refuse(format!("{}: no such file", path.display()))),
        Err(e) => return Err(refuse(e.to_string())),
    };
    String::from_utf8(bytes).map_err(|e| refuse(format!("{}: not UTF-8: {e}", path.display())))
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => e.exit(),
        Err(e) => fail(&argument_error(&e), json_requested(std::env::args_os())),
    };
    match run(&args) {
        Ok(v) => {
            if args.json {
                println!("{v}");
            }
        }
        Err(e) => fail(&e, args.json),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(value: &str) -> Result<Vec<u32>, String> {
        parse_token_ids(value).map(|t| t.0).map_err(|e| {
            assert_eq!(e.code(), "invalid_argument");
            e.to_string()
        })
    }

    #[test]
    fn token_ids_are_whole_numbers_below_2_pow_32() {
        assert_eq!(ids("1,2,3"), Ok(vec![1, 2, 3]));
        assert_eq!(ids("1, 2"), Ok(vec![1, 2]));
        assert_eq!(ids(" 7 "), Ok(vec![7]));
        assert_eq!(ids("4294967295"), Ok(vec![u32::MAX]));
        for bad in ["", " ", "abc", "-1", "+1", "1,,2", "1,2,", ",1", "1 2", "4294967296", "1.0"] {
            let e = ids(bad).expect_err(bad);
            assert!(e.contains("--prompt-ids"), "{bad}: {e}");
        }
        assert!(ids("4294967296").unwrap_err().contains("out of range"));
        assert!(ids("1,,2").unwrap_err().contains("entry 2"));
    }

    #[test]
    fn counts_fit_usize() {
        assert_eq!(parse_count("0").unwrap(), 0);
        assert_eq!(parse_count("18446744073709551615").unwrap() as u64, u64::MAX.min(usize::MAX as u64));
        for bad in ["", "-1", "+1", " 1", "1e3", "99999999999999999999999"] {
            let e = parse_count(bad).expect_err(bad);
            assert_eq!(e.code(), "invalid_argument");
            assert!(e.to_string().contains("--max-new-tokens"), "{e}");
        }
    }

    #[test]
    fn flags_take_the_variables_names() {
        assert_eq!(parse_backend("PORTABLE").unwrap(), AdapterPolicy::Portable);
        assert_eq!(parse_kernels("msl").unwrap(), KernelChoice::Auto);
        assert_eq!(parse_matvec_layout("split").unwrap(), MatvecLayout::SplitK);
        let e = parse_backend("vulkan").unwrap_err().to_string();
        assert!(e.contains("--backend") && e.contains("metal, portable"), "{e}");
    }

    #[test]
    fn refused_command_lines_become_invalid_argument() {
        let parse = |argv: &[&str]| match Args::try_parse_from(argv) {
            Ok(_) => panic!("{argv:?} parsed"),
            Err(e) => argument_error(&e),
        };
        let e = parse(&["decode", "--prompt-ids", "abc"]);
        assert_eq!(e.code(), "invalid_argument");
        assert!(e.to_string().starts_with("invalid argument --prompt-ids: \"abc\""), "{e}");
        let e = parse(&["decode", "--bogus"]);
        assert!(e.to_string().contains("--bogus"), "{e}");
        let e = parse(&["decode", "--prompt", "hi", "--prompt-ids", "1"]);
        assert!(e.to_string().contains("cannot be used with"), "{e}");
        let e = parse(&["decode", "--max-new-tokens", "-1"]);
        assert!(e.to_string().contains("--max-new-tokens"), "{e}");
        assert!(json_requested(["decode", "--bogus", "--json"].map(OsString::from)));
        assert!(!json_requested(["decode", "--", "--json"].map(OsString::from)));
        assert!(!json_requested(["--json"].map(OsString::from)));
    }
}
