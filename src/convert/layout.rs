//! The blob's layout: where every array of a config's model lands in a
//! weight format ([`plan_layout`]), its length computed without building it
//! ([`planned_blob_len`]), and reading a converted model's blob back.

use crate::config::ModelConfig;
use crate::converted::{
    int4_position, read_scale, scale_bytes, scales_len, ByteRange, ConvertedModel, LayerWeights, QuantMatrix,
    WeightFormat, WeightIndex, BLOB_ALIGN, QUANT_GROUP,
};

/// Hands out aligned, non-overlapping ranges of a blob being planned.
struct LayoutPlanner {
    len: usize,
}

impl LayoutPlanner {
    pub(super) fn range(&mut self, len: usize) -> ByteRange {
        let offset = self.len.next_multiple_of(BLOB_ALIGN);
        self.len = offset + len;
        ByteRange { offset, len }
    }

    fn f32s(&mut self, count: usize) -> ByteRange {
        self.range(count * 4)
    }

    pub(super) fn matrix(&mut self, rows: usize, cols: usize, format: WeightFormat) -> QuantMatrix {
        let groups = cols.div_ceil(QUANT_GROUP);
        let data = self.range(rows * groups * QUANT_GROUP * format.bits() / 8);
        let scales = self.range(scales_len(format, rows * groups));
        QuantMatrix { rows, cols, format, data, scales }
    }
}

/// The length in bytes of the blob [`plan_layout`] plans for `cfg` with
/// layers in `weights`, computed with checked arithmetic and without
/// building the index; `None` when it does not fit a `usize`. Every range
/// starts at a multiple of [`BLOB_ALIGN`], so the total is the sum of the
/// aligned range lengths.
pub fn planned_blob_len(cfg: &ModelConfig, weights: WeightFormat) -> Option<usize> {
    let aligned = |len: Option<usize>| len?.checked_next_multiple_of(BLOB_ALIGN);
    let f32s = |count: usize| aligned(count.checked_mul(4));
    let matrix_in = |format: WeightFormat, rows: usize, cols: usize| {
        let padded_rows = rows.checked_mul(cols.div_ceil(QUANT_GROUP))?;
        let data = padded_rows.checked_mul(QUANT_GROUP * format.bits() / 8);
        let scales = padded_rows.checked_mul(scale_bytes(format))?.checked_next_multiple_of(4);
        aligned(data)?.checked_add(aligned(scales)?)
    };
    let matrix = |rows, cols| matrix_in(WeightFormat::Int8, rows, cols);
    let layer_matrix = |rows, cols| matrix_in(weights, rows, cols);
    let sum = |parts: &[Option<usize>]| parts.iter().try_fold(0usize, |acc, p| acc.checked_add((*p)?));
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let q_dim = cfg.num_attention_heads.checked_mul(hd)?;
    let qkv_rows = cfg.num_key_value_heads.checked_mul(hd)?.checked_mul(2)?.checked_add(q_dim)?;
    let layer = sum(&[
        f32s(h),
        layer_matrix(qkv_rows, h),
        f32s(hd),
        f32s(hd),
        layer_matrix(h, q_dim),
        f32s(h),
        layer_matrix(cfg.intermediate_size.checked_mul(2)?, h),
        layer_matrix(h, cfg.intermediate_size),
    ])?;
    let head = if cfg.tie_word_embeddings { Some(0) } else { matrix(cfg.vocab_size, h) };
    sum(&[matrix(cfg.vocab_size, h), layer.checked_mul(cfg.num_hidden_layers), f32s(h), head])
}

/// The blob layout [`convert`](super::convert) produces for `cfg` with the
/// layers' linear weights in `weights` (the embedding and the LM head are
/// int8 either way): the index, and the blob's total length in bytes.
/// Deterministic, so a cached index can be checked against it. `cfg` must
/// have passed [`load_config`](crate::config::load_config)'s checks and
/// [`planned_blob_len`] must be `Some` for it (so no size computed here can
/// overflow).
pub fn plan_layout(cfg: &ModelConfig, weights: WeightFormat) -> (WeightIndex, usize) {
    let h = cfg.hidden_size;
    let mut p = LayoutPlanner { len: 0 };
    let embed = p.matrix(cfg.vocab_size, h, WeightFormat::Int8);
    let layers = (0..cfg.num_hidden_layers)
        .map(|_| LayerWeights {
            input_norm: p.f32s(h),
            qkv: p.matrix(cfg.qkv_rows(), h, weights),
            q_norm: p.f32s(cfg.head_dim),
            k_norm: p.f32s(cfg.head_dim),
            o_proj: p.matrix(h, cfg.q_dim(), weights),
            post_norm: p.f32s(h),
            gate_up: p.matrix(2 * cfg.intermediate_size, h, weights),
            down: p.matrix(h, cfg.intermediate_size, weights),
        })
        .collect();
    let final_norm = p.f32s(h);
    let lm_head = (!cfg.tie_word_embeddings).then(|| p.matrix(cfg.vocab_size, h, WeightFormat::Int8));
    let total = p.len.next_multiple_of(BLOB_ALIGN);
    (WeightIndex { weights, embed, lm_head, layers, final_norm }, total)
}

/// The blob proper of `model`: its [`plan_layout`] length from
/// `blob_start` (a mapped cache file also holds a header before it and a
/// footer after it). `None` when the storage is shorter than the layout.
pub fn blob_bytes(model: &ConvertedModel) -> Option<&[u8]> {
    let (_, len) = plan_layout(&model.config, model.index.weights);
    model.blob.get(model.blob_start..model.blob_start.checked_add(len)?)
}

/// Dequantizes element `(row, col)` of `m` from `model` (for tests and
/// diagnostics): `q * scale`.
pub fn dequantize(model: &ConvertedModel, m: &QuantMatrix, row: usize, col: usize) -> Option<f32> {
    if row >= m.rows || col >= m.cols {
        return None;
    }
    let data = model.bytes(m.data);
    let q = match m.format {
        WeightFormat::Int8 => *data.get(row * m.row_bytes() + col)? as i8,
        WeightFormat::Int4 => {
            let (byte, high) = int4_position(col);
            let b = *data.get(row * m.row_bytes() + byte)?;
            // The nibble in a byte's high half, sign-extended by the shift.
            (if high { b } else { b << 4 }) as i8 >> 4
        }
    };
    let size = scale_bytes(m.format);
    let s_off = (row * m.groups() + col / QUANT_GROUP) * size;
    let scale = read_scale(m.format, model.bytes(m.scales).get(s_off..s_off + size)?);
    Some(f32::from(q) * scale)
}
