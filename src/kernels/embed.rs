//! The `embed_lookup` family: the token's row of the int8 embedding table,
//! dequantised into the residual stream (large tables are bound in chunks;
//! the chunk holding the token writes).

use super::abi::gpu_struct;
use super::{Bind, WG};
use crate::converted::QUANT_GROUP;

gpu_struct! {
    /// The uniform of `embed_lookup`.
    "Params" pub struct EmbedParams {
        /// Padded row length / 4.
        pub k_words: u32,
        /// Scales per row.
        pub groups: u32,
        /// First table row of the bound chunk.
        pub row_start: u32,
        /// One past its last row.
        pub row_end: u32,
    }
}

/// Binding order: params, step, tokens, w, scales, x, x16 (x's f16 copy,
/// read by the decode matvecs that take x16: `MatvecSplit::x16`).
pub const BINDINGS: &[Bind] =
    &[Bind::Uniform, Bind::Read, Bind::Read, Bind::Read, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];

/// The grid: one invocation per u32 word of the row (`z`: tokens of a batch).
pub fn grid(k_words: u32) -> [u32; 3] {
    super::grid(k_words.div_ceil(WG))
}

/// The override constants of `embed_lookup`: the workgroup size and the
/// quant group (`GROUP_WORDS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EmbedConstants;

impl EmbedConstants {
    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        vec![("WG", WG as f64), ("GROUP_WORDS", (QUANT_GROUP / 4) as f64)]
    }
}
