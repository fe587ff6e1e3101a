//! Qwen3 language models on your own GPU through [wgpu](https://wgpu.rs):
//! load a Hugging Face checkpoint, convert its weights once to int8 (cached
//! on disk), and decode on the GPU, greedy or sampled, one conversation or a
//! [`Batch`] of them.
//! Metal on Apple Silicon by default; Vulkan and DX12 through
//! [`AdapterPolicy::Portable`].
//!
//! ```no_run
//! use qwen3_wgpu::{Engine, LoadOptions, Tokenizer};
//! let engine = Engine::new()?;
//! let model = engine.load("./qwen3-0.6b-base", &LoadOptions::default())?;
//! let tokenizer = Tokenizer::from_checkpoint("./qwen3-0.6b-base".as_ref())?;
//! let mut session = model.session()?;
//! let mut text = tokenizer.stream();
//! let mut next = session.feed(&tokenizer.encode("The capital of France is")?)?;
//! for _ in 0..16 {
//!     print!("{}", text.push(next)?);
//!     next = session.next_token()?;
//! }
//! # Ok::<(), qwen3_wgpu::Error>(())
//! ```
//!
//! # The main types
//!
//! - [`Engine`]: a GPU device and the compiled kernels ([`Engine::builder`]
//!   to choose the adapter, or to share a renderer's device).
//! - [`Model`]: a loaded checkpoint ([`Engine::load`], [`LoadOptions`]);
//!   [`Model::generate_with`] runs a whole generation ([`GenerateOptions`]).
//! - [`Session`]: one context on the GPU, fed and stepped token by token,
//!   without blocking if need be; rewound, forked, saved and restored.
//! - [`Batch`]: sessions advanced together, one GPU step for all.
//! - [`SamplingParams`]: how the next token is chosen.
//! - [`Tokenizer`], [`TextStream`], [`StopMatcher`]: text in and out.
//! - [`Chat`], [`ChatTemplate`], [`Message`]: conversations with an
//!   instruct model.
//! - [`Error`]: one error type, each variant with a stable [`Error::code`].
//!
//! # The guide
//!
//! The [`guide`] holds the manual, one page per topic:
//! [the command line](guide::command_line), [loading](guide::loading),
//! [generating](guide::generating), [sampling](guide::sampling),
//! [sessions](guide::sessions), [rendering](guide::rendering),
//! [batches](guide::batches), [chat](guide::chat), [text](guide::text),
//! [errors](guide::errors), [C and C++](guide::c_api),
//! [environment variables](guide::environment),
//! [how a decode runs](guide::how_it_runs), [the Metal path](guide::metal),
//! [speed](guide::speed), [testing](guide::testing) and
//! [the source layout](guide::layout).
//!
//! # Features
//!
//! - `hub`: resolve Hugging Face model ids to checkpoint directories,
//!   downloading into the Hugging Face cache (`hub::resolve`).
#![deny(missing_docs)]

/// The README, whose Rust example is compiled as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

#[cfg(doc)]
pub mod guide;

// The model, from the outside in: the public API (`engine`, `session`,
// `tokenizer`, `error`), the graph (`qwen3`) over the session's buffers
// (`buffers`) and the weights on the GPU (`gpu_weights`), the kernels, and
// loading (`load`: `config`, `checkpoint`, `convert` into `converted`,
// `cache`).
pub(crate) mod bench;
pub(crate) mod buffers;
pub(crate) mod cache;
pub(crate) mod chat;
#[cfg(test)]
mod check_counts;
pub(crate) mod checked_read;
pub(crate) mod checkpoint;
pub(crate) mod config;
pub(crate) mod constraint;
pub(crate) mod conversation;
pub(crate) mod convert;
#[allow(missing_docs)] // reached from outside only through `internals`
pub(crate) mod converted;
pub(crate) mod engine;
pub(crate) mod error;
pub(crate) mod fingerprint;
pub(crate) mod gpu;
#[allow(missing_docs)] // reached from outside only through `internals`
pub(crate) mod gpu_weights;
#[cfg(feature = "hub")]
pub mod hub;
#[allow(missing_docs)] // reached from outside only through `internals`
pub(crate) mod kernels;
pub(crate) mod kv_cache;
pub(crate) mod limits;
pub(crate) mod load;
pub(crate) mod progress;
#[allow(missing_docs)] // reached from outside only through `internals`
pub(crate) mod qwen3;
#[allow(missing_docs)] // reached from outside only through `internals`
pub(crate) mod reference;
pub(crate) mod sampling;
pub(crate) mod self_check;
pub(crate) mod session;
mod settings;
pub(crate) mod stop;
mod temp_file;
pub(crate) mod testing;
pub(crate) mod tokenizer;

pub use cache::CachePolicy;
pub use chat::{ChatOptions, ChatTemplate, Message};
pub use config::{ModelConfig, ShapeProfile};
pub use constraint::{parse_tool_calls, Constraint, ParsedReply, ToolCall, ToolChoice};
pub use conversation::{Chat, ChatReply};
pub use converted::{WeightFormat, WEIGHTS_ENV};
pub use engine::{
    decode, decode_with, DecodeResult, Engine, EngineBuilder, GenerateOptions, LoadOptions, Model,
    StopReason, COOPERATIVE_MATRICES_ENV, DEFAULT_CAPACITY,
};
pub use error::{Error, Mismatch, Result};
pub use gpu::{AdapterPolicy, Gpu, BACKEND_ENV};
pub use kernels::{
    KernelChoice, KernelReport, KernelSource, MatvecLayout, SelfCheck, WeightKernels, KERNELS_ENV,
};
pub use kv_cache::KvFormat;
pub use load::{LoadPhase, LoadProgress, LoadProgressFn, LoadReport};
pub use sampling::{SamplingParams, TokenLogprobs};
pub use session::{
    Batch, BatchOptions, FeedStatus, Session, SessionOptions, StepTiming, DEFAULT_LOOKAHEAD, PREFILL_BATCH,
    SESSION_FORMAT_VERSION, WARM_UP_MAX_ROWS,
};
pub use stop::{StopMatcher, StopStep};
pub use tokenizer::{TextStream, Tokenizer};
pub use wgpu;

/// The engine's insides, for this crate's own tools (examples), tests and
/// benches: the checkpoint reader and converter, the cache, the kernels and
/// their CPU references, the graph, the session diagnostics. Not part of
/// the API: anything here may change in any release.
#[doc(hidden)]
pub mod internals {
    /// The decode benchmark of the `bench` example and `cargo bench`.
    pub mod bench {
        pub use crate::bench::*;
    }
    /// Session buffers, padding, the RoPE table.
    pub mod buffers {
        pub use crate::buffers::*;
    }
    /// The converted-weights cache: file format and housekeeping.
    pub mod cache {
        pub use crate::cache::*;
    }
    /// The one checked reader of small files (regular files only, opened
    /// without blocking, size-bounded), for the tools' own input files.
    pub mod checked_read {
        pub use crate::checked_read::read_file;
    }
    /// Reading and validating safetensors checkpoints.
    pub mod checkpoint {
        pub use crate::checkpoint::*;
    }
    /// config.json and the shape checks.
    pub mod config {
        pub use crate::config::*;
    }
    /// BF16/F16/F32 to int8 conversion.
    pub mod convert {
        pub use crate::convert::*;
    }
    /// The converted model's layout (int8 matrices, scales, norms in one blob).
    pub mod converted {
        pub use crate::converted::*;
    }
    /// Adapter, device, buffers, uniform pages, timestamps, readback.
    pub mod gpu {
        pub use crate::gpu::*;
    }
    /// Converted weights on the GPU.
    pub mod gpu_weights {
        pub use crate::gpu_weights::*;
    }
    /// Kernel table, tuning, compilation and launches.
    pub mod kernels {
        pub use crate::kernels::*;
    }
    /// The KV cache's formats and layout.
    pub mod kv_cache {
        pub use crate::kv_cache::*;
    }
    /// The kernels' shape limits.
    pub mod limits {
        pub use crate::limits::*;
    }
    /// The load step: config, checkpoint, convert or cache.
    pub mod load {
        pub use crate::load::*;
    }
    /// MSL sources and preambles.
    pub mod msl {
        pub use crate::kernels::msl::*;
    }
    /// The Qwen3 forward pass as launches.
    pub mod qwen3 {
        pub use crate::qwen3::*;
    }
    /// CPU references of the kernels.
    pub mod reference {
        pub use crate::reference::*;
    }
    /// The token choice's launches under sampling parameters.
    pub mod sampling {
        pub use crate::sampling::*;
    }
    /// The kernels' check against their CPU references at engine build.
    pub mod self_check {
        pub use crate::self_check::*;
    }
    /// The decode runtime and its diagnostics.
    pub mod session {
        pub use crate::session::*;
    }
    /// Random checkpoints for tests and benchmarks.
    pub mod testing {
        pub use crate::testing::*;
    }
}
