//! How a session's KV cache stores its rows: [`KvFormat`], and the byte
//! layout of one layer's K (or V) region in each format ([`KvLayout`]),
//! which the kernels (`qk_norm_rope.wgsl`'s `kv_scale_at`,
//! `attention_common.wgsl`'s `kv_scale_word`), the buffers, forks and
//! session files share.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::limits::{HEAD_DIM_MULTIPLE, KV_INT8_HEAD_DIM_MULTIPLE};

/// How the KV cache stores keys and values.
///
/// `F16` (the default) keeps every value as an f16. `Int8` keeps each
/// head's row of a position as `head_dim` int8 values and one f32 scale,
/// the row's largest magnitude (a value is `q / 127 * scale`): half the
/// memory per position, and half the bytes decode attention reads at long
/// contexts, for a rounding error of at most half a step (`scale / 254`)
/// per value. One scale per row rather than per group of dims: RoPE and the
/// q/k norms leave a row's magnitudes even, and a row's scale is found in
/// the one workgroup that writes it. Needs `head_dim` a multiple of 16
/// (every Qwen3 model has 128).
///
/// ```no_run
/// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
/// use qwen3_wgpu::{KvFormat, SessionOptions};
/// let session = model.session_with(&SessionOptions::default().capacity(16_384).kv_cache(KvFormat::Int8))?;
/// println!("{} bytes on the GPU", session.buffer_bytes());
/// # Ok(())
/// # }
/// ```
///
/// ```
/// use qwen3_wgpu::KvFormat;
/// assert_eq!(KvFormat::from_name("--kv-cache", "INT8")?, KvFormat::Int8);
/// assert_eq!(KvFormat::default().name(), "f16");
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum KvFormat {
    /// An f16 per value.
    #[default]
    F16,
    /// An int8 per value and an f32 scale per head and position.
    Int8,
}

impl KvFormat {
    /// Every format.
    pub const ALL: [KvFormat; 2] = [KvFormat::F16, KvFormat::Int8];

    /// The names [`Self::from_name`] accepts, and [`Self::name`] gives.
    pub const NAMES: [(&'static str, KvFormat); 2] = [("f16", KvFormat::F16), ("int8", KvFormat::Int8)];

    /// `f16` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::Int8 => "int8",
        }
    }

    /// The format named `f16` or `int8` (any case); anything else is
    /// `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        crate::settings::parse_choice(what, value, &Self::NAMES)
    }

    /// Whether a model of `head_dim` can keep its cache in this format
    /// (int8: [`KV_INT8_HEAD_DIM_MULTIPLE`]).
    pub(crate) fn fits_head_dim(self, head_dim: usize) -> bool {
        match self {
            KvFormat::F16 => head_dim.is_multiple_of(HEAD_DIM_MULTIPLE),
            KvFormat::Int8 => head_dim.is_multiple_of(KV_INT8_HEAD_DIM_MULTIPLE),
        }
    }

    /// Bytes of one head's row of one position (scales apart).
    fn row_bytes(self, head_dim: usize) -> u64 {
        match self {
            KvFormat::F16 => 2 * head_dim as u64,
            KvFormat::Int8 => head_dim as u64,
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one layer's K (or V) values lie in a session's region of
/// `capacity` positions: the rows `[kv_head][capacity][row]`, then (int8)
/// the f32 scales, starting at a multiple of 16 bytes, each head's
/// `capacity` rounded up to 4 (so that no vec4 of scales holds two
/// heads').
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// How values are stored.
    pub format: KvFormat,
    /// KV heads (`num_key_value_heads`).
    pub kv_heads: usize,
    /// Values per head's row.
    pub head_dim: usize,
    /// Positions of the region.
    pub capacity: usize,
}

impl KvLayout {
    /// The layout of a region of `capacity` positions of `cfg`'s model.
    pub fn new(cfg: &ModelConfig, capacity: usize, format: KvFormat) -> Self {
        KvLayout { format, kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim, capacity }
    }

    /// Bytes of one head's row of one position.
    pub fn row_bytes(&self) -> u64 {
        self.format.row_bytes(self.head_dim)
    }

    /// Bytes of the rows of every head.
    fn rows_bytes(&self) -> u64 {
        (self.kv_heads * self.capacity) as u64 * self.row_bytes()
    }

    /// Byte offset of head `kv_head`'s scales (int8), else `None`.
    pub fn scales_at(&self, kv_head: usize) -> Option<u64> {
        (self.format == KvFormat::Int8).then(|| {
            self.rows_bytes().next_multiple_of(16) + 4 * (kv_head * self.capacity.next_multiple_of(4)) as u64
        })
    }

    /// Bytes of the region (unpadded).
    pub fn bytes(&self) -> u64 {
        match self.format {
            KvFormat::F16 => self.rows_bytes(),
            KvFormat::Int8 => self.scales_at(self.kv_heads).unwrap_or(0),
        }
    }

    /// Bytes a position takes per layer, K or V: its rows and scales.
    pub fn position_bytes(&self) -> u64 {
        let scale = if self.format == KvFormat::Int8 { 4 } else { 0 };
        self.kv_heads as u64 * (self.row_bytes() + scale)
    }

    /// The spans holding positions `0..len` of the region: per head, its
    /// rows, then (int8) per head, its scales, as `(byte offset, bytes)`.
    /// Session files store a layer's K (then V) as these spans in order.
    pub fn spans(&self, len: usize) -> Vec<(u64, u64)> {
        let rows = (0..self.kv_heads)
            .map(|h| ((h * self.capacity) as u64 * self.row_bytes(), len as u64 * self.row_bytes()));
        let scales = (0..self.kv_heads).filter_map(|h| Some((self.scales_at(h)?, 4 * len as u64)));
        rows.chain(scales).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The int8 scales start where the kernels' `kv_scale_at` says: after
    /// the rows, rounded up to 4 words, each head's capacity rounded to 4.
    #[test]
    fn int8_scales_follow_the_kernels_layout() {
        let l = KvLayout { format: KvFormat::Int8, kv_heads: 3, head_dim: 16, capacity: 5 };
        // kv_scale_at: base = (heads * capacity * head_dim / 4 + 3) & ~3 words.
        let base_words = (3 * 5 * 16 / 4 + 3) & !3;
        assert_eq!(l.scales_at(0), Some(4 * base_words as u64));
        assert_eq!(l.scales_at(2), Some(4 * (base_words + 2 * 8) as u64));
        assert_eq!(l.bytes(), 4 * (base_words + 3 * 8) as u64);
        assert_eq!(l.spans(2).len(), 6);
        let f = KvLayout { format: KvFormat::F16, ..l };
        assert_eq!(f.bytes(), 3 * 5 * 32);
        assert_eq!(f.scales_at(0), None);
        assert_eq!(f.spans(2), vec![(0, 64), (160, 64), (320, 64)]);
    }
}
