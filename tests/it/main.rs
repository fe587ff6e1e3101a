//! The crate's integration tests: one binary, one module per subject
//! (`cargo test --test it cache::` runs one subject). `common` holds the
//! kernel cases and their CPU references that every backend runs,
//! `tiny_checkpoint` the small checkpoints built on the fly, and `support`
//! the child process for tests that change the environment.

mod common;
mod support;
mod tiny_checkpoint;

mod api;
mod attention_packing;
mod bad_inputs;
mod batch;
mod bench_cli;
mod cache;
mod cache_faults;
mod chat_session;
mod chat_template;
mod checkpoint;
mod cli;
mod config;
mod constraints;
mod conversion;
mod convert_identity;
mod docs;
mod e2e_mlx;
mod errors;
mod exact_shape;
mod frame_loop;
mod fuzz_inputs;
mod generate;
#[cfg(feature = "hub")]
mod hub;
mod int4;
mod kernels;
mod kv_int8;
mod load_progress;
mod logprobs;
mod matmul_tile;
mod metal_kernels;
mod module_graph;
mod msl_kernels;
mod prompt_batch;
mod sampling;
mod session_state;
mod shader_checks;
mod stop_strings;
mod template_fuzz;
mod tokenizer;
