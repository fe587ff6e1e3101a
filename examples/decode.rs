//! Greedy decode from the command line.
//!
//! ```text
//! cargo run --release --example decode -- --checkpoint ./qwen3-0.6b-base \
//!     --prompt "The capital of France is" --max-new-tokens 16
//! ```
//! With `--json`, stdout's last line is one JSON object (the result, or
//! `{"error": {"code", "message"}}`). Errors exit with status 2.

use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use qwen3_wgpu::{
    AdapterPolicy, CachePolicy, Engine, Error, KernelChoice, LoadOptions, ShapeProfile, Tokenizer,
};
use serde_json::json;

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    /// Metal only (Apple GPUs); refuses any other adapter.
    Metal,
    /// Any adapter wgpu offers (Vulkan, DX12, Metal).
    Portable,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kernels {
    /// The hand-written MSL twins on Metal, WGSL elsewhere.
    Auto,
    /// WGSL everywhere.
    Wgsl,
}

#[derive(Parser)]
#[command(about = "Greedy Qwen3 decode on the GPU (int8 weights, wgpu)")]
struct Args {
    /// Hugging Face checkpoint directory (config.json + safetensors). Default:
    /// ./qwen3-0.6b-base, then the Hugging Face cache's Qwen3-0.6B-Base snapshot.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Prompt text (encoded with the checkpoint's tokenizer.json).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    #[arg(long, value_enum, default_value = "metal")]
    backend: Backend,
    /// Kernels: `auto` (the MSL twins on Metal, WGSL elsewhere) or `wgsl`
    /// (WGSL on Metal too). Default: QWEN3_WGPU_KERNELS, else auto.
    #[arg(long, value_enum)]
    kernels: Option<Kernels>,
    /// Demand the exact Qwen3-0.6B-Base shape.
    #[arg(long)]
    exact_shape: bool,
    /// Where converted weights are cached (default: the platform cache dir).
    #[arg(long, conflicts_with = "no_cache")]
    cache_dir: Option<PathBuf>,
    /// Convert in memory; read and write no cache.
    #[arg(long)]
    no_cache: bool,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    json: bool,
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

fn run(args: &Args) -> Result<serde_json::Value, Error> {
    let checkpoint = args.checkpoint.clone().unwrap_or_else(default_checkpoint);
    let policy = match args.backend {
        Backend::Metal => AdapterPolicy::MetalOnly,
        Backend::Portable => AdapterPolicy::Portable,
    };
    let mut builder = Engine::builder().policy(policy);
    if let Some(k) = args.kernels {
        builder = builder.kernels(match k {
            Kernels::Auto => KernelChoice::Auto,
            Kernels::Wgsl => KernelChoice::Wgsl,
        });
    }
    let engine = builder.build()?;
    let tokenizer = if args.prompt.is_some() || checkpoint.join("tokenizer.json").exists() {
        Some(Tokenizer::from_checkpoint(&checkpoint)?)
    } else {
        None
    };
    let prompt_ids = match (&args.prompt, &args.prompt_ids, &tokenizer) {
        (Some(text), _, Some(tok)) => tok.encode(text)?,
        (_, Some(ids), _) => ids.clone(),
        _ => return Err(Error::EmptyPrompt),
    };
    let options = LoadOptions {
        profile: if args.exact_shape { ShapeProfile::Qwen3_0_6B } else { ShapeProfile::AnyQwen3 },
        cache: match (&args.cache_dir, args.no_cache) {
            (_, true) => CachePolicy::Disabled,
            (Some(dir), _) => CachePolicy::Dir(dir.clone()),
            (None, false) => CachePolicy::Default,
        },
    };
    if prompt_ids.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let model = engine.load(&checkpoint, &options)?;
    let mut stream = tokenizer.as_ref().map(|t| t.stream());
    let echo = !args.json && args.prompt.is_some() && stream.is_some();
    if echo {
        print!("{}", args.prompt.as_deref().unwrap_or_default());
    }
    let out = model.generate(&prompt_ids, args.max_new_tokens, |id| {
        if let (false, Some(s)) = (args.json, stream.as_mut()) {
            if let Ok(piece) = s.push(id) {
                print!("{piece}");
                use std::io::Write;
                let _ = std::io::stdout().flush();
            }
        }
    });
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
            "decode {:.1} tok/s, prefill {:.1} ms ({} tokens), load {:.0} ms{} [{} via {:?}, {} kernels, stop: {}]",
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
            out.stop_reason.as_str(),
        );
    }
    Ok(json!({
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
    }))
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(v) => {
            if args.json {
                println!("{v}");
            }
        }
        Err(e) => {
            eprintln!("error [{}]: {e}", e.code());
            if args.json {
                println!("{}", json!({"error": {"code": e.code(), "message": e.to_string()}}));
            }
            std::process::exit(2);
        }
    }
}
