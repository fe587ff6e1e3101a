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

/// Workgroup size: one head (head_dim <= 256 values) per workgroup, so a
/// few invocations suffice; 256 left most of them idle (a 256-token batch
/// of the 0.6B model runs 8,192 workgroups).
pub const NORM_ROPE_WG: u32 = 64;

/// The int8 KV cache's layout (`kv_scale_word`), which `qk_norm_rope`
/// writes and the attention kernels read, prepended to `qk_norm_rope`.
pub(super) const KV_CACHE_WGSL: &str = include_str!("../../kernels/wgsl/kv_cache.wgsl");
const _: () = assert!(NORM_ROPE_WG.is_power_of_two());

/// The grid: one workgroup per q, k and v head (`z`: tokens of a batch).
pub fn grid(n_heads: u32, n_kv_heads: u32) -> [u32; 3] {
    super::grid(n_heads + 2 * n_kv_heads)
}
