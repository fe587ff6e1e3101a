//! The shapes the engine's kernels can run, as plain numbers: config
//! validation reads them here without depending on the kernels (which
//! are compiled for them: tests/it/config.rs ties the two).

/// `head_dim` must be a multiple of this: RoPE rotates pairs of
/// dimensions, and attention reads K eight halves at a time.
pub const HEAD_DIM_MULTIPLE: usize = 8;

/// Largest `head_dim`: the attention kernels keep one head in workgroup
/// memory.
pub const MAX_HEAD_DIM: usize = 256;
