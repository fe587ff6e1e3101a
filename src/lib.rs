#![doc = include_str!("../README.md")]

pub mod cache;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod kernels;
pub mod model;
pub mod msl;
pub mod qwen3;
#[doc(hidden)]
pub mod reference;
pub mod self_check;
pub mod session;
mod settings;
pub mod stop;
#[doc(hidden)]
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use cache::{CachePolicy, LoadReport};
pub use chat::{ChatOptions, ChatTemplate, Message};
pub use config::{ModelConfig, ShapeProfile};
pub use engine::{decode, decode_with, DecodeResult, Engine, EngineBuilder, LoadOptions, Model, StopReason};
pub use error::{Error, Mismatch, Result};
pub use gpu::{AdapterPolicy, Gpu, BACKEND_ENV};
pub use kernels::{KernelChoice, KernelReport, KernelSource, SelfCheck, KERNELS_ENV};
pub use session::{Session, StepTiming};
pub use stop::{StopMatcher, StopStep};
pub use tokenizer::{TextStream, Tokenizer};
pub use wgpu;
