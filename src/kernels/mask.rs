//! The `logits_mask` family: a constraint's token mask applied to the
//! logits before the token is chosen ([`crate::Constraint`]).

use super::abi::gpu_struct;
use super::{Bind, WG};

gpu_struct! {
    /// The uniform of `logits_mask`.
    "Params" pub struct MaskParams {
        /// Logits (the vocabulary).
        pub n: u32,
        /// Bits of the value a masked logit gets ([`MASKED_LOGIT`]): WGSL
        /// has no infinite literal.
        pub masked_bits: u32,
    }
}

/// What a token the constraint forbids gets: below every finite logit, so
/// the argmax, the sampler's draw and its filters all pass it over.
pub const MASKED_LOGIT: f32 = f32::NEG_INFINITY;

/// Binding order: params, mask (one bit per token), logits.
pub const BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::ReadWrite];

/// u32 words of the mask over `n` tokens.
pub fn words(n: u32) -> usize {
    n.div_ceil(32) as usize
}

/// The params over `n` logits.
pub fn params(n: u32) -> MaskParams {
    MaskParams { n, masked_bits: MASKED_LOGIT.to_bits() }
}

/// The grid: one invocation per token.
pub fn grid(n: u32) -> [u32; 3] {
    super::grid(n.div_ceil(WG))
}
