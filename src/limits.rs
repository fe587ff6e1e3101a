//! The shapes the engine's kernels can run, as plain numbers: config
//! validation reads them here without depending on the kernels.

/// `head_dim` must be a multiple of this: RoPE rotates pairs of
/// dimensions, and attention reads K eight halves at a time.
pub const HEAD_DIM_MULTIPLE: usize = 8;

/// Largest `head_dim`: the attention kernels keep one head in workgroup
/// memory.
pub const MAX_HEAD_DIM: usize = 256;

#[cfg(test)]
mod tests {
    /// The kernels are compiled for these limits.
    #[test]
    fn limits_are_the_kernels() {
        assert_eq!(super::HEAD_DIM_MULTIPLE, crate::kernels::HEAD_DIM_MULTIPLE);
        assert_eq!(super::MAX_HEAD_DIM, crate::kernels::MAX_HEAD_DIM);
    }
}
