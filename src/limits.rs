//! The shapes the engine's kernels can run, as plain numbers: config
//! validation reads them here without depending on the kernels (which
//! are compiled for them: tests/it/config.rs ties the two).

/// `head_dim` must be a multiple of this: RoPE rotates pairs of
/// dimensions, and attention reads K eight halves at a time.
pub const HEAD_DIM_MULTIPLE: usize = 8;

/// `head_dim` of a model with an int8 KV cache must be a multiple of this:
/// attention reads an int8 K row sixteen values (a vec4 of words) at a
/// time.
pub const KV_INT8_HEAD_DIM_MULTIPLE: usize = 16;

/// Largest `head_dim`: the attention kernels keep one head in workgroup
/// memory.
pub const MAX_HEAD_DIM: usize = 256;
