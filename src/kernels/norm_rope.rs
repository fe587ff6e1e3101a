//! The `qk_norm_rope` family: q/k RMSNorm, RoPE and the KV-cache write for
//! a prompt batch (decode steps fold this work into attention). Its uniform
//! is the attention kernels' [`super::HeadParams`].

use super::Bind;

/// Binding order: params, step, qkv, qk_norm, rope, q_out, k_cache, v_cache.
pub const BINDINGS: &[Bind] = &[
    Bind::Uniform,
    Bind::Read,
    Bind::Read,
    Bind::Read,
    Bind::Read,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::ReadWrite,
];

/// The grid: one workgroup per q, k and v head (`z`: tokens of a batch).
pub fn grid(n_heads: u32, n_kv_heads: u32) -> [u32; 3] {
    super::grid(n_heads + 2 * n_kv_heads)
}
