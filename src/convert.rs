//! Conversion of a validated checkpoint to the engine's int8 layout: every
//! linear weight (and the embedding, and an untied LM head) becomes
//! symmetric int8 with one f32 scale per [`QUANT_GROUP`] input elements;
//! norm weights stay f32. Everything lands in one blob whose arrays start at
//! multiples of [`BLOB_ALIGN`].

use std::collections::HashMap;
use std::path::Path;

use crate::checkpoint::{Checkpoint, Fingerprint, TensorReader};
use crate::config::ModelConfig;
use crate::converted::{
    Blob, ByteRange, ConvertedModel, LayerWeights, QuantMatrix, WeightIndex, BLOB_ALIGN, QUANT_GROUP,
};
use crate::error::{Error, Result};

/// Hands out aligned, non-overlapping ranges of a blob being planned.
struct LayoutPlanner {
    len: usize,
}

impl LayoutPlanner {
    fn range(&mut self, len: usize) -> ByteRange {
        let offset = self.len.next_multiple_of(BLOB_ALIGN);
        self.len = offset + len;
        ByteRange { offset, len }
    }

    fn f32s(&mut self, count: usize) -> ByteRange {
        self.range(count * 4)
    }

    fn matrix(&mut self, rows: usize, cols: usize) -> QuantMatrix {
        let groups = cols.div_ceil(QUANT_GROUP);
        let data = self.range(rows * groups * QUANT_GROUP);
        let scales = self.range(rows * groups * 4);
        QuantMatrix { rows, cols, data, scales }
    }
}

/// The length in bytes of the blob [`plan_layout`] plans for `cfg`,
/// computed with checked arithmetic and without building the index; `None`
/// when it does not fit a `usize`. Every range starts at a multiple of
/// [`BLOB_ALIGN`], so the total is the sum of the aligned range lengths.
pub fn planned_blob_len(cfg: &ModelConfig) -> Option<usize> {
    let aligned = |len: Option<usize>| len?.checked_next_multiple_of(BLOB_ALIGN);
    let f32s = |count: usize| aligned(count.checked_mul(4));
    let matrix = |rows: usize, cols: usize| {
        let padded_rows = rows.checked_mul(cols.div_ceil(QUANT_GROUP))?;
        aligned(padded_rows.checked_mul(QUANT_GROUP))?.checked_add(aligned(padded_rows.checked_mul(4))?)
    };
    let sum = |parts: &[Option<usize>]| parts.iter().try_fold(0usize, |acc, p| acc.checked_add((*p)?));
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let q_dim = cfg.num_attention_heads.checked_mul(hd)?;
    let qkv_rows = cfg.num_key_value_heads.checked_mul(hd)?.checked_mul(2)?.checked_add(q_dim)?;
    let layer = sum(&[
        f32s(h),
        matrix(qkv_rows, h),
        f32s(hd),
        f32s(hd),
        matrix(h, q_dim),
        f32s(h),
        matrix(cfg.intermediate_size.checked_mul(2)?, h),
        matrix(h, cfg.intermediate_size),
    ])?;
    let head = if cfg.tie_word_embeddings { Some(0) } else { matrix(cfg.vocab_size, h) };
    sum(&[matrix(cfg.vocab_size, h), layer.checked_mul(cfg.num_hidden_layers), f32s(h), head])
}

/// Bytes of host memory a new allocation can get without pushing the
/// system into swap or the OOM killer: `MemAvailable` of /proc/meminfo on
/// Linux; `None` where that is not known (other systems, or unreadable).
pub fn available_memory() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        parse_mem_available(&meminfo)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// `MemAvailable` in bytes from the text of /proc/meminfo.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// [`Error::OutOfMemory`] when `needed` bytes exceed `available` (unknown
/// availability passes: the allocation itself is then the check).
pub fn check_host_memory(what: &str, needed: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(available) if needed > available => {
            Err(Error::OutOfMemory { what: what.to_string(), needed, available })
        }
        _ => Ok(()),
    }
}

/// The blob layout [`convert`] produces for `cfg`: the index, and the
/// blob's total length in bytes. Deterministic, so a cached index can be
/// checked against it. `cfg` must have passed
/// [`load_config`](crate::config::load_config)'s checks and
/// [`planned_blob_len`] must be `Some` for it (so no size computed here can
/// overflow).
pub fn plan_layout(cfg: &ModelConfig) -> (WeightIndex, usize) {
    let h = cfg.hidden_size;
    let mut p = LayoutPlanner { len: 0 };
    let embed = p.matrix(cfg.vocab_size, h);
    let layers = (0..cfg.num_hidden_layers)
        .map(|_| LayerWeights {
            input_norm: p.f32s(h),
            qkv: p.matrix(cfg.qkv_rows(), h),
            q_norm: p.f32s(cfg.head_dim),
            k_norm: p.f32s(cfg.head_dim),
            o_proj: p.matrix(h, cfg.q_dim()),
            post_norm: p.f32s(h),
            gate_up: p.matrix(2 * cfg.intermediate_size, h),
            down: p.matrix(h, cfg.intermediate_size),
        })
        .collect();
    let final_norm = p.f32s(h);
    let lm_head = (!cfg.tie_word_embeddings).then(|| p.matrix(cfg.vocab_size, h));
    let total = p.len.next_multiple_of(BLOB_ALIGN);
    (WeightIndex { embed, lm_head, layers, final_norm }, total)
}

/// Converts a checkpoint to int8 (see the module docs) into one owned blob.
///
/// The checkpoint is validated against `cfg` first (see
/// [`Checkpoint::validate`]), so no conversion work is done for a checkpoint
/// that would fail. Host memory: the blob (about the int8 size of the model;
/// checked against [`available_memory`] before it is allocated) plus a few
/// MiB of read buffers; tensors are read a window of rows at a time with
/// positioned reads (a checkpoint truncated meanwhile is an error, not a
/// crash).
///
/// Errors: those of [`Checkpoint::validate`]; [`Error::OutOfMemory`] when
/// the blob does not fit in the memory available (or its size overflows);
/// [`Error::CheckpointInvalid`] naming the tensor when any tensor (matrix
/// or norm vector) holds NaN or infinity, or naming the file when a weights
/// file ends before its header says.
pub fn convert(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<ConvertedModel> {
    ckpt.validate(cfg)?;
    convert_validated(ckpt, cfg, None)
}

/// [`convert`] of a checkpoint already validated against `cfg`, checking
/// every tensor's bytes against the digests of
/// `fingerprint` as it reads them: a tensor changed since the fingerprint
/// was taken is [`Error::CheckpointInvalid`], so a conversion is never
/// cached under the key of other bytes.
pub(crate) fn convert_validated(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    fingerprint: Option<&Fingerprint>,
) -> Result<ConvertedModel> {
    let what = format!("converting {} to int8 (held in memory until it is cached)", ckpt.dir().display());
    let available = available_memory();
    let needed = planned_blob_len(cfg).and_then(|n| n.checked_add(BLOB_ALIGN));
    let Some(needed) = needed else {
        return Err(Error::OutOfMemory { what, needed: u64::MAX, available: available.unwrap_or(0) });
    };
    check_host_memory(&what, needed as u64, available)?;
    // Zeroed up front: the row padding and all-zero groups are then already
    // right. A Vec<u8> is only byte-aligned; over-allocate and start the
    // blob at the first BLOB_ALIGN boundary so every array is aligned in
    // host memory too (f32 views need it). The Vec never grows, so its
    // buffer never moves. `try_reserve_exact` turns a refused allocation
    // into an error instead of an abort.
    let mut storage = Vec::new();
    storage.try_reserve_exact(needed).map_err(|_| Error::OutOfMemory {
        what: what.clone(),
        needed: needed as u64,
        available: available.unwrap_or(0),
    })?;
    storage.resize(needed, 0u8);
    ckpt.prefetch();
    let (index, total) = plan_layout(cfg);
    let blob_start = storage.as_ptr().align_offset(BLOB_ALIGN).min(BLOB_ALIGN);
    storage.truncate(blob_start + total);
    let blob = &mut storage[blob_start..];
    let max_cols = cfg.hidden_size.max(cfg.intermediate_size).max(cfg.q_dim());
    let mut row = vec![0.0f32; max_cols];
    let digests = fingerprint.map(|f| &f.tensor_digests);
    let mut q = Quantizer { blob, row: &mut row, dir: ckpt.dir(), digests };

    q.matrix(&index.embed, vec![ckpt.reader("model.embed_tokens.weight")?])?;
    for (i, layer) in index.layers.iter().enumerate() {
        let t = |suffix: &str| ckpt.reader(&format!("model.layers.{i}.{suffix}"));
        q.norm(layer.input_norm, t("input_layernorm.weight")?)?;
        q.matrix(
            &layer.qkv,
            vec![t("self_attn.q_proj.weight")?, t("self_attn.k_proj.weight")?, t("self_attn.v_proj.weight")?],
        )?;
        q.norm(layer.q_norm, t("self_attn.q_norm.weight")?)?;
        q.norm(layer.k_norm, t("self_attn.k_norm.weight")?)?;
        q.matrix(&layer.o_proj, vec![t("self_attn.o_proj.weight")?])?;
        q.norm(layer.post_norm, t("post_attention_layernorm.weight")?)?;
        q.matrix_interleaved(&layer.gate_up, t("mlp.gate_proj.weight")?, t("mlp.up_proj.weight")?)?;
        q.matrix(&layer.down, vec![t("mlp.down_proj.weight")?])?;
    }
    q.norm(index.final_norm, ckpt.reader("model.norm.weight")?)?;
    if let Some(head) = &index.lm_head {
        q.matrix(head, vec![ckpt.reader("lm_head.weight")?])?;
    }
    Ok(ConvertedModel { config: cfg.clone(), index, blob: Blob::Owned(storage), blob_start })
}

/// Writes tensors into their planned ranges of the blob.
struct Quantizer<'a> {
    blob: &'a mut [u8],
    /// Scratch for one row in f32.
    row: &'a mut [f32],
    /// The checkpoint directory, for errors.
    dir: &'a Path,
    /// What each tensor's bytes must hash to, when a cache key was taken.
    digests: Option<&'a HashMap<String, u128>>,
}

/// A tensor or range that does not fit the layout planned from the config.
/// Validation rules this out; the checks keep a bug from panicking.
fn layout_error(dir: &Path, what: &str, detail: impl std::fmt::Display) -> Error {
    Error::invalid(dir, format!("{what} does not fit the planned layout: {detail}"))
}

impl Quantizer<'_> {
    fn norm(&mut self, dst: ByteRange, mut t: TensorReader<'_>) -> Result<()> {
        let values = t.to_f32_vec()?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                self.dir,
                format!("{} holds a NaN or infinite value (element {i}: {})", t.name(), values[i]),
            ));
        }
        let out = self
            .blob
            .get_mut(dst.offset..dst.offset + dst.len)
            .filter(|o| o.len() == values.len() * 4)
            .ok_or_else(|| layout_error(self.dir, t.name(), format_args!("{} values", values.len())))?;
        for (o, v) in out.chunks_exact_mut(4).zip(&values) {
            o.copy_from_slice(&v.to_ne_bytes());
        }
        self.finish(t)
    }

    /// Checks a fully read tensor's digest against the cache key's.
    fn finish(&self, t: TensorReader<'_>) -> Result<()> {
        let (name, path) = (t.name(), t.path());
        let digest = t.finish()?;
        match self.digests {
            Some(expected) if expected.get(name) != Some(&digest) => Err(Error::invalid(
                path,
                format!(
                    "{name} changed while the checkpoint was being loaded (its bytes differ from \
                     those the cache key was computed from); nothing was cached, load it again"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Quantizes `parts` (stacked row-wise, in order) into `m`.
    fn matrix(&mut self, m: &QuantMatrix, parts: Vec<TensorReader<'_>>) -> Result<()> {
        let counts: Vec<usize> = parts.iter().map(|t| t.rows()).collect();
        let order = counts.into_iter().enumerate().flat_map(|(p, rows)| (0..rows).map(move |r| (p, r)));
        self.rows(m, parts, order)
    }

    /// Quantizes `a` and `b` into `m` with their rows interleaved (a0, b0,
    /// a1, b1, ...): the gate/up layout the SwiGLU matvec epilogue reads.
    fn matrix_interleaved(
        &mut self,
        m: &QuantMatrix,
        a: TensorReader<'_>,
        b: TensorReader<'_>,
    ) -> Result<()> {
        if a.rows() != b.rows() {
            let detail = format!("{} rows, {} has {}", a.rows(), b.name(), b.rows());
            return Err(layout_error(self.dir, a.name(), detail));
        }
        let order = (0..a.rows()).flat_map(|r| [(0, r), (1, r)]);
        self.rows(m, vec![a, b], order)
    }

    /// Quantizes row `r` of `parts[p]` for each `(p, r)` of `order` into
    /// consecutive rows of `m`.
    fn rows(
        &mut self,
        m: &QuantMatrix,
        mut parts: Vec<TensorReader<'_>>,
        order: impl Iterator<Item = (usize, usize)>,
    ) -> Result<()> {
        let dir = self.dir;
        let (padded, groups) = (m.padded_cols(), m.groups());
        // Data precedes scales (see `LayoutPlanner::matrix`), so one split
        // gives both regions mutably.
        let outside = || layout_error(dir, "a matrix", "range outside the blob");
        let scales_from_data = m
            .scales
            .offset
            .checked_sub(m.data.offset)
            .filter(|&gap| gap >= m.data.len)
            .ok_or_else(outside)?;
        let region = self.blob.get_mut(m.data.offset..m.scales.offset + m.scales.len).ok_or_else(outside)?;
        let (data, rest) = region.split_at_mut(scales_from_data);
        let data = &mut data[..m.data.len];
        let scales = &mut rest[..m.scales.len];
        let row = self
            .row
            .get_mut(..m.cols)
            .ok_or_else(|| layout_error(dir, "a matrix", format_args!("{} columns", m.cols)))?;
        for t in &parts {
            if t.row_len() != m.cols {
                let detail = format!("{} columns, planned {}", t.row_len(), m.cols);
                return Err(layout_error(dir, t.name(), detail));
            }
        }

        let mut data_rows = data.chunks_exact_mut(padded);
        let mut scale_rows = scales.chunks_exact_mut(groups * 4);
        let mut rows_done = 0;
        for (p, r) in order {
            let t = &mut parts[p];
            let (Some(q_row), Some(s_row)) = (data_rows.next(), scale_rows.next()) else {
                let detail = format!("more than the planned {} rows", m.rows);
                return Err(layout_error(dir, t.name(), detail));
            };
            t.row_f32(r, row)?;
            if !quantize_row(row, q_row, s_row) {
                return Err(Error::invalid(
                    dir,
                    format!("{} row {r} holds NaN or infinite values; cannot quantize", t.name()),
                ));
            }
            rows_done += 1;
        }
        if rows_done != m.rows {
            let detail = format!("{rows_done} rows, planned {}", m.rows);
            return Err(layout_error(dir, "a matrix", detail));
        }
        for t in parts {
            self.finish(t)?;
        }
        Ok(())
    }
}

/// Quantizes one row: `q_row` gets int8 values (its padding stays as it
/// is, zero), `s_row` one native-endian f32 scale per group. Returns false
/// when the row holds a non-finite value.
fn quantize_row(row: &[f32], q_row: &mut [u8], s_row: &mut [u8]) -> bool {
    let mut all_finite = true;
    let groups = row.chunks(QUANT_GROUP).zip(q_row.chunks_mut(QUANT_GROUP)).zip(s_row.chunks_exact_mut(4));
    for ((w, q), s) in groups {
        // Full groups go through fixed-size arrays so the compiler can
        // unroll and vectorize them; only a row's short last group does not.
        let scale = match (<&[f32; QUANT_GROUP]>::try_from(w), <&mut [u8; QUANT_GROUP]>::try_from(&mut *q)) {
            (Ok(w), Ok(q)) => quantize_group(w, q, &mut all_finite),
            _ => quantize_group(w, q, &mut all_finite),
        };
        s.copy_from_slice(&scale.to_ne_bytes());
    }
    all_finite
}

/// Quantizes one group into `q` (same length or longer; the excess is
/// left alone) and returns its scale. Clears `all_finite` on NaN/infinity.
#[inline(always)]
fn quantize_group<W, Q>(w: &W, q: &mut Q, all_finite: &mut bool) -> f32
where
    W: AsRef<[f32]> + ?Sized,
    Q: AsMut<[u8]> + ?Sized,
{
    let (w, q) = (w.as_ref(), q.as_mut());
    // Eight independent lanes: a single running max is a serial chain the
    // compiler may not reorder. `if a > m` is exactly `maxps`. Multiplying
    // by zero gives NaN for NaN and infinity and 0 otherwise, so the lane
    // sums detect non-finite input without a branch.
    let mut max_lanes = [0f32; 8];
    let mut poison = [0f32; 8];
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            let a = c[i].abs();
            max_lanes[i] = if a > max_lanes[i] { a } else { max_lanes[i] };
            poison[i] += c[i] * 0.0;
        }
    }
    for &x in chunks.remainder() {
        let a = x.abs();
        max_lanes[0] = if a > max_lanes[0] { a } else { max_lanes[0] };
        poison[0] += x * 0.0;
    }
    let absmax = max_lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
    if poison.iter().sum::<f32>() != 0.0 {
        *all_finite = false;
    }
    let scale = absmax / 127.0;
    if scale == 0.0 {
        // An all-zero group: scale 0 and q 0.
        q[..w.len()].fill(0);
        return scale;
    }
    for (q, &x) in q.iter_mut().zip(w) {
        *q = quantize_value(x / scale) as u8;
    }
    scale
}

/// Rounds half away from zero and clamps to [-127, 127] (NaN gives -127;
/// [`convert`] reports NaN input as an error anyway).
///
/// `f32::round` is a libm call on baseline x86-64 and a saturating `as`
/// cast is scalarized there; both block vectorization. Clamping first (to an
/// integer bound, so clamp-then-round equals round-then-clamp), truncating,
/// and then looking at the fraction (exact, as |y| <= 127) gives the same
/// result with plain SIMD. Adding 0.5 before truncating would not:
/// 0.49999997 + 0.5 rounds up to 1.0 in f32.
#[inline(always)]
pub fn quantize_value(y: f32) -> i8 {
    // `if` forms (not f32::max/min) compile to maxps/minps; a NaN `y` fails
    // the first comparison and becomes -127.
    let y = if y > -127.0 { y } else { -127.0 };
    let y = if y < 127.0 { y } else { 127.0 };
    // SAFETY: y is finite and within [-127, 127], so it fits an i32.
    let truncated: i32 = unsafe { y.to_int_unchecked() };
    let fraction = y - truncated as f32;
    let rounded = truncated + i32::from(fraction >= 0.5) - i32::from(fraction <= -0.5);
    rounded as i8
}

/// The blob proper of `model`: its [`plan_layout`] length from
/// `blob_start` (a mapped cache file also holds a header before it and a
/// footer after it). `None` when the storage is shorter than the layout.
pub fn blob_bytes(model: &ConvertedModel) -> Option<&[u8]> {
    let (_, len) = plan_layout(&model.config);
    model.blob.get(model.blob_start..model.blob_start.checked_add(len)?)
}

/// Dequantizes element `(row, col)` of `m` from `model` (for tests and
/// diagnostics): `data * scale`.
pub fn dequantize(model: &ConvertedModel, m: &QuantMatrix, row: usize, col: usize) -> Option<f32> {
    if row >= m.rows || col >= m.cols {
        return None;
    }
    let data = model.bytes(m.data);
    let q = *data.get(row * m.padded_cols() + col)? as i8;
    let s_off = (row * m.groups() + col / QUANT_GROUP) * 4;
    let s = model.bytes(m.scales).get(s_off..s_off + 4)?;
    let scale = f32::from_ne_bytes([s[0], s[1], s[2], s[3]]);
    Some(f32::from(q) * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planned_blob_len_matches_the_layout_and_overflows_to_none() {
        let mut cfg = ModelConfig::qwen3_0_6b_base();
        for tied in [true, false] {
            cfg.tie_word_embeddings = tied;
            assert_eq!(planned_blob_len(&cfg), Some(plan_layout(&cfg).1));
        }
        let odd =
            ModelConfig { hidden_size: 70, intermediate_size: 33, head_dim: 8, vocab_size: 3, ..cfg.clone() };
        assert_eq!(planned_blob_len(&odd), Some(plan_layout(&odd).1));
        // Sizes config.json can imply that no usize holds.
        let huge = [
            ModelConfig { num_hidden_layers: usize::MAX / 2, ..cfg.clone() },
            ModelConfig { vocab_size: usize::MAX / 1024, ..cfg.clone() },
            ModelConfig { intermediate_size: usize::MAX / 2, ..cfg.clone() },
            ModelConfig { num_attention_heads: usize::MAX / 64, ..cfg.clone() },
        ];
        for c in &huge {
            assert_eq!(planned_blob_len(c), None);
        }
    }

    #[test]
    fn host_memory_check_names_needed_and_available() {
        assert!(check_host_memory("x", 10, Some(10)).is_ok());
        assert!(check_host_memory("x", 10, None).is_ok());
        match check_host_memory("converting", 11, Some(10)) {
            Err(e @ Error::OutOfMemory { needed: 11, available: 10, .. }) => {
                assert_eq!(e.code(), "out_of_memory");
                assert!(e.to_string().contains("converting"));
            }
            other => panic!("{other:?}"),
        }
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   22000000 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(22_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
    }

    /// A tensor rewritten (same size) between the fingerprint and the
    /// conversion is caught by the conversion's own digests.
    #[cfg(unix)]
    #[test]
    fn conversion_refuses_bytes_other_than_the_fingerprinted() {
        use std::os::unix::fs::FileExt;
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
        let tmp = tempfile::tempdir().unwrap();
        for name in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture.join(name), tmp.path().join(name)).unwrap();
        }
        let cfg = crate::config::load_config(tmp.path()).unwrap();
        let ckpt = Checkpoint::open(tmp.path()).unwrap();
        let fp = ckpt.fingerprint(&cfg, 1).unwrap();
        assert!(convert_validated(&ckpt, &cfg, Some(&fp)).is_ok());

        let path = tmp.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let name = "model.layers.1.mlp.down_proj.weight";
        let at = 8 + header_len + meta.info(name).unwrap().data_offsets.0 + 100;
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[bytes[at] ^ 0x01], at as u64).unwrap();

        let err = convert_validated(&ckpt, &cfg, Some(&fp)).err().expect("a changed tensor");
        assert_eq!(err.code(), "checkpoint_invalid");
        assert!(err.to_string().contains(name) && err.to_string().contains("changed"), "{err}");
        // Without a fingerprint there is nothing to compare with.
        assert!(convert_validated(&ckpt, &cfg, None).is_ok());
        assert_ne!(ckpt.fingerprint(&cfg, 1).unwrap().key, fp.key);
    }

    #[test]
    fn quantize_value_rounds_half_away_from_zero() {
        let cases: [(f32, i8); 12] = [
            (0.0, 0),
            (0.49999997, 0),
            (0.5, 1),
            (-0.5, -1),
            (1.5, 2),
            (2.5, 3),
            (-2.5, -3),
            (126.5, 127),
            (127.00001, 127),
            (-200.0, -127),
            (f32::NAN, -127),
            (-0.49999997, 0),
        ];
        for (y, want) in cases {
            assert_eq!(quantize_value(y), want, "y = {y}");
        }
        // Agrees with f32::round everywhere in range, on a fine grid.
        for i in -130_000..=130_000 {
            let y = i as f32 * 0.001 + 0.0005;
            assert_eq!(quantize_value(y), y.round().clamp(-127.0, 127.0) as i8, "y = {y}");
        }
    }

    #[test]
    fn quantize_row_groups_and_zero_group() {
        let mut row = vec![0.0f32; 70];
        row[0] = 127.0;
        row[1] = -63.5;
        row[69] = 254.0; // second, shorter group
        let mut q = vec![0u8; 128];
        let mut s = vec![0u8; 8];
        assert!(quantize_row(&row, &mut q, &mut s));
        let s0 = f32::from_ne_bytes(s[0..4].try_into().unwrap());
        let s1 = f32::from_ne_bytes(s[4..8].try_into().unwrap());
        assert_eq!(s0, 1.0);
        assert_eq!(s1, 2.0);
        assert_eq!(q[0] as i8, 127);
        assert_eq!(q[1] as i8, -64); // -63.5 rounds away from zero
        assert_eq!(q[2] as i8, 0);
        assert_eq!(q[69] as i8, 127);
        assert!(q[70..].iter().all(|&b| b == 0));

        let zeros = vec![0.0f32; 64];
        let mut q = vec![7u8; 64];
        let mut s = vec![9u8; 4];
        assert!(quantize_row(&zeros, &mut q, &mut s));
        assert_eq!(f32::from_ne_bytes(s[..].try_into().unwrap()), 0.0);
        assert!(q.iter().all(|&b| b == 0));

        let mut bad = vec![0.0f32; 64];
        bad[3] = f32::NAN;
        assert!(!quantize_row(&bad, &mut [0u8; 64], &mut [0u8; 4]));
    }
}
