//! The C ABI's tests: one binary, one module per subject
//! (`cargo test -p qwen3-wgpu-capi --test it header::` runs one).

mod c_programs;
mod errors;
mod header;
