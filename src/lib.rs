//! qwen3-wgpu: Qwen3 greedy decode on your own GPU through wgpu.

pub mod config;
pub mod error;
pub mod gpu;
pub mod kernels;
pub mod model;
pub mod qwen3;
pub mod session;
pub mod weights;

pub use error::{Error, Mismatch, Result};
pub use gpu::{AdapterPolicy, Gpu};
pub use session::Session;
