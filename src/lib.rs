//! qwen3-wgpu: Qwen3 greedy decode on your own GPU through wgpu.
#![deny(missing_docs)]
#![allow(missing_docs)] // lifted once the public API is documented

pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod error;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Mismatch, Result};
