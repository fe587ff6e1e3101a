//! The argmax family: greedy sampling on the GPU in two launches,
//! `argmax_partial` (each workgroup's best of [`ARGMAX_CHUNK`] logits) and
//! `argmax_final` (the best of those, written as the next token; it also
//! advances the GPU-resident position). Ties go to the lowest token id.

use super::abi::gpu_struct;
use super::Bind;

gpu_struct! {
    /// The uniform of `argmax_partial`.
    "Params" pub struct ArgmaxPartialParams {
        /// Logits.
        pub n: u32,
        /// Logits per workgroup.
        pub chunk: u32,
    }
}

gpu_struct! {
    /// The uniform of `argmax_final`.
    "Params" pub struct ArgmaxFinalParams {
        /// Parts (`argmax_partial`'s workgroups).
        pub n: u32,
        /// Length of `tokens` (capacity + 1).
        pub n_tokens: u32,
    }
}

/// Logits per `argmax_partial` workgroup.
pub const ARGMAX_CHUNK: u32 = 1024;

/// `argmax_partial`'s workgroups (the parts `argmax_final` reduces) over
/// `n` logits, `chunk` per workgroup.
pub fn parts(n: u32, chunk: u32) -> u32 {
    n.div_ceil(chunk)
}

/// `argmax_final`'s grid: one workgroup.
pub const FINAL_GRID: [u32; 3] = [1, 1, 1];

/// Binding order of `argmax_partial`: params, logits, part_val, part_idx.
pub const PARTIAL_BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];

/// Binding order of `argmax_final`: params, part_val, part_idx, tokens, step.
pub const FINAL_BINDINGS: &[Bind] =
    &[Bind::Uniform, Bind::Read, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];
