//! Conversion of a validated checkpoint to the engine's int8 layout: every
//! linear weight (and the embedding, and an untied LM head) becomes
//! symmetric int8 with one f32 scale per [`QUANT_GROUP`] input elements;
//! norm weights stay f32. Everything lands in one blob whose arrays start at
//! multiples of [`BLOB_ALIGN`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;
use xxhash_rust::xxh3::{xxh3_128, Xxh3Default};

use crate::checkpoint::{combine_pieces, Checkpoint, Fingerprint, TensorSource, HASH_PIECE, READ_WINDOW};
use crate::config::ModelConfig;
use crate::converted::{
    Blob, ByteRange, ConvertedModel, LayerWeights, QuantMatrix, WeightIndex, BLOB_ALIGN, QUANT_GROUP,
};
use crate::error::{Error, Result};
use crate::progress::{LoadPhase, Progress};

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
/// that would fail. The work is spread over all cores (rayon's pool), in
/// pieces of a few MiB; the bytes are the same whatever the thread count.
/// Host memory: the blob (about the int8 size of the model; checked
/// against [`available_memory`] before it is allocated) plus a few MiB of
/// read buffers; tensors are read a window of rows at a time with
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
    convert_validated(ckpt, cfg, None, &Progress::none())
}

/// [`convert`] of a checkpoint already validated against `cfg`, checking
/// every tensor's bytes against the digests of
/// `fingerprint` as it reads them: a tensor changed since the fingerprint
/// was taken is [`Error::CheckpointInvalid`], so a conversion is never
/// cached under the key of other bytes. Reports [`LoadPhase::Converting`]
/// through `progress`; [`Error::Cancelled`] when it cancels.
pub(crate) fn convert_validated(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    fingerprint: Option<&Fingerprint>,
    progress: &Progress<'_>,
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
    // into an error instead of an abort. The zeroing (and the page faults
    // of a fresh allocation) runs on all cores, into the reserved space.
    let mut storage = Vec::new();
    storage.try_reserve_exact(needed).map_err(|_| Error::OutOfMemory {
        what: what.clone(),
        needed: needed as u64,
        available: available.unwrap_or(0),
    })?;
    storage.par_extend(rayon::iter::repeat_n(0u8, needed));
    ckpt.prefetch();
    let (index, total) = plan_layout(cfg);
    let blob_start = storage.as_ptr().align_offset(BLOB_ALIGN).min(BLOB_ALIGN);
    storage.truncate(blob_start + total);
    let blob = &mut storage[blob_start..];
    let targets = plan_targets(ckpt, &index)?;
    let digests = fingerprint.map(|f| &f.tensor_digests);
    convert_targets(blob, &targets, ckpt.dir(), digests, HASH_PIECE, progress)?;
    Ok(ConvertedModel { config: cfg.clone(), index, blob: Blob::Owned(storage), blob_start })
}

/// Where one or more checkpoint tensors land in the blob.
enum Target<'c> {
    /// A norm vector, stored as f32.
    Norm { dst: ByteRange, source: TensorSource<'c> },
    /// An int8 matrix: `parts` stacked row-wise in order, or, when
    /// `interleaved`, two parts with their rows alternating (a0, b0, a1,
    /// b1, ...: the gate/up layout the SwiGLU matvec epilogue reads).
    Matrix { m: QuantMatrix, parts: Vec<TensorSource<'c>>, interleaved: bool },
}

impl Target<'_> {
    fn sources(&self) -> &[TensorSource<'_>] {
        match self {
            Target::Norm { source, .. } => std::slice::from_ref(source),
            Target::Matrix { parts, .. } => parts,
        }
    }
}

/// Every target of `index`, in blob order (the order [`plan_layout`]
/// hands out ranges in).
fn plan_targets<'c>(ckpt: &'c Checkpoint, index: &WeightIndex) -> Result<Vec<Target<'c>>> {
    let norm = |dst: ByteRange, name: &str| Ok::<_, Error>(Target::Norm { dst, source: ckpt.source(name)? });
    let matrix = |m: &QuantMatrix, names: &[&str], interleaved: bool| {
        let parts = names.iter().map(|n| ckpt.source(n)).collect::<Result<Vec<_>>>()?;
        Ok::<_, Error>(Target::Matrix { m: *m, parts, interleaved })
    };
    let mut targets = vec![matrix(&index.embed, &["model.embed_tokens.weight"], false)?];
    for (i, layer) in index.layers.iter().enumerate() {
        let t = |suffix: &str| format!("model.layers.{i}.{suffix}");
        targets.push(norm(layer.input_norm, &t("input_layernorm.weight"))?);
        let qkv = [t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"), t("self_attn.v_proj.weight")];
        targets.push(matrix(&layer.qkv, &qkv.each_ref().map(String::as_str), false)?);
        targets.push(norm(layer.q_norm, &t("self_attn.q_norm.weight"))?);
        targets.push(norm(layer.k_norm, &t("self_attn.k_norm.weight"))?);
        targets.push(matrix(&layer.o_proj, &[t("self_attn.o_proj.weight").as_str()], false)?);
        targets.push(norm(layer.post_norm, &t("post_attention_layernorm.weight"))?);
        let gate_up = [t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")];
        targets.push(matrix(&layer.gate_up, &gate_up.each_ref().map(String::as_str), true)?);
        targets.push(matrix(&layer.down, &[t("mlp.down_proj.weight").as_str()], false)?);
    }
    targets.push(norm(index.final_norm, "model.norm.weight")?);
    if let Some(head) = &index.lm_head {
        targets.push(matrix(head, &["lm_head.weight"], false)?);
    }
    Ok(targets)
}

/// A tensor or range that does not fit the layout planned from the config.
/// Validation rules this out; the checks keep a bug from panicking.
fn layout_error(dir: &Path, what: &str, detail: impl std::fmt::Display) -> Error {
    Error::invalid(dir, format!("{what} does not fit the planned layout: {detail}"))
}

/// Hands out disjoint ranges of the blob, in increasing offset order.
struct Carver<'b> {
    rest: &'b mut [u8],
    /// Blob offset of `rest[0]`.
    at: usize,
}

impl<'b> Carver<'b> {
    fn take(&mut self, r: ByteRange) -> Option<&'b mut [u8]> {
        let skip = r.offset.checked_sub(self.at)?;
        let end = skip.checked_add(r.len).filter(|&e| e <= self.rest.len())?;
        let rest = std::mem::take(&mut self.rest);
        let (taken, rest) = rest.split_at_mut(end);
        self.rest = rest;
        self.at = r.offset + r.len;
        Some(&mut taken[skip..])
    }
}

/// One row of a matrix in the blob: its int8 data and its scales.
type RowSlot<'b> = (&'b mut [u8], &'b mut [u8]);

/// What one worker converts: a [`HASH_PIECE`] of a source tensor (the
/// bytes `start..end` of it) with the output rows of the whole source rows
/// inside it; or a whole norm vector.
struct Unit<'b, 'c> {
    /// Index of the source tensor (in the order of [`Target::sources`]).
    source: usize,
    tensor: TensorSource<'c>,
    start: usize,
    end: usize,
    work: UnitWork<'b>,
}

enum UnitWork<'b> {
    /// The whole tensor, as f32, into this range.
    Norm(&'b mut [u8]),
    /// Source rows from `first_row`, each into its slot.
    Rows { first_row: usize, slots: Vec<RowSlot<'b>> },
}

/// What a unit leaves for after the parallel pass: its piece's digest
/// (when hashing) and the bytes of rows it holds only part of.
struct UnitDone {
    source: usize,
    digests: Vec<u128>,
    /// Each partial row's bytes.
    fragments: Vec<Fragment>,
}

/// Part of a row: its byte offset in the tensor and its bytes.
type Fragment = (usize, Vec<u8>);

/// Converts every target into `blob` on all cores. Each source tensor is
/// cut into pieces of `piece` bytes ([`HASH_PIECE`], the pieces of its
/// digest, see [`TensorHasher`](crate::checkpoint::TensorHasher)): a worker
/// reads its piece once, hashes it and converts the whole rows inside it;
/// the few rows that straddle pieces are put together from the bytes the
/// workers read, and converted after. So every byte converted is a byte
/// hashed, read once, and each tensor's digest is checked against
/// `digests` (when given) before anything is returned. The output is the
/// same bytes whatever the number of threads or the piece size.
fn convert_targets(
    blob: &mut [u8],
    targets: &[Target<'_>],
    dir: &Path,
    digests: Option<&HashMap<String, u128>>,
    piece: usize,
    progress: &Progress<'_>,
) -> Result<()> {
    let sources: Vec<TensorSource<'_>> = targets.iter().flat_map(|t| t.sources().iter().copied()).collect();
    progress.begin(LoadPhase::Converting, sources.iter().map(|t| t.len() as u64).sum())?;
    let hashing = digests.is_some();

    // Cut the blob into one slot per output row (and a range per norm),
    // then hand each piece the slots of its whole rows.
    let mut carver = Carver { rest: blob, at: 0 };
    let mut units = Vec::new();
    // (source, source row) -> output slot, for the rows that straddle pieces.
    let mut straddling: HashMap<(usize, usize), RowSlot<'_>> = HashMap::new();
    let mut source = 0;
    for target in targets {
        match target {
            Target::Norm { dst, source: t } => {
                let out = carver
                    .take(*dst)
                    .filter(|o| o.len() == t.rows() * t.row_len() * 4)
                    .ok_or_else(|| layout_error(dir, t.name(), format_args!("{} bytes", dst.len)))?;
                units.push(Unit { source, tensor: *t, start: 0, end: t.len(), work: UnitWork::Norm(out) });
                source += 1;
            }
            Target::Matrix { m, parts, interleaved } => {
                let mut slots = matrix_slots(&mut carver, m, dir)?;
                let rows: usize = parts.iter().map(|t| t.rows()).sum();
                if rows != m.rows
                    || (*interleaved && (parts.len() != 2 || parts[0].rows() != parts[1].rows()))
                {
                    let detail = format!("{rows} rows in {} parts, planned {}", parts.len(), m.rows);
                    return Err(layout_error(dir, parts[0].name(), detail));
                }
                let mut base = 0;
                for (p, t) in parts.iter().enumerate() {
                    if t.row_len() != m.cols {
                        let detail = format!("{} columns, planned {}", t.row_len(), m.cols);
                        return Err(layout_error(dir, t.name(), detail));
                    }
                    let out_row = |r: usize| if *interleaved { 2 * r + p } else { base + r };
                    let rb = t.row_bytes();
                    for start in (0..t.len()).step_by(piece) {
                        let end = (start + piece).min(t.len());
                        let full = start.div_ceil(rb)..end / rb;
                        let piece_slots =
                            full.clone().map(|r| slots[out_row(r)].take()).collect::<Option<Vec<_>>>();
                        let piece_slots =
                            piece_slots.ok_or_else(|| layout_error(dir, t.name(), "a row planned twice"))?;
                        let work = UnitWork::Rows { first_row: full.start, slots: piece_slots };
                        units.push(Unit { source, tensor: *t, start, end, work });
                    }
                    // Rows not inside one piece: converted after the pass.
                    for r in 0..t.rows() {
                        if let Some(slot) = slots[out_row(r)].take() {
                            straddling.insert((source, r), slot);
                        }
                    }
                    base += t.rows();
                    source += 1;
                }
            }
        }
    }

    let failed = AtomicBool::new(false);
    let results: Vec<Result<Option<UnitDone>>> = units
        .into_par_iter()
        .map(|unit| {
            if failed.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let done = convert_unit(unit, dir, hashing, piece, &failed, progress);
            if done.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            done
        })
        .collect();
    let mut piece_digests: Vec<Vec<u8>> = vec![Vec::new(); sources.len()];
    let mut fragments: HashMap<(usize, usize), Vec<Fragment>> = HashMap::new();
    for result in results {
        let Some(done) = result? else { continue };
        for d in done.digests {
            piece_digests[done.source].extend_from_slice(&d.to_le_bytes());
        }
        for (at, bytes) in done.fragments {
            let row = at / sources[done.source].row_bytes();
            fragments.entry((done.source, row)).or_default().push((at, bytes));
        }
    }
    // A unit skipped after another failed would have left its error.
    progress.check()?;
    if failed.load(Ordering::Relaxed) {
        return Err(Error::internal("a conversion worker stopped without an error"));
    }

    let mut row = Vec::new();
    for ((source, r), mut parts) in fragments {
        let t = &sources[source];
        parts.sort_by_key(|(at, _)| *at);
        let mut bytes = Vec::with_capacity(t.row_bytes());
        for (at, part) in parts {
            if at != r * t.row_bytes() + bytes.len() {
                return Err(layout_error(dir, t.name(), format_args!("row {r} pieced together with a gap")));
            }
            bytes.extend_from_slice(&part);
        }
        let (q_row, s_row) = straddling
            .remove(&(source, r))
            .filter(|_| bytes.len() == t.row_bytes())
            .ok_or_else(|| layout_error(dir, t.name(), format_args!("row {r} split across pieces")))?;
        row.resize(t.row_len(), 0.0);
        t.row_f32(&bytes, 0, &mut row)?;
        quantize_checked(&row, q_row, s_row, t, r, dir)?;
    }
    if let Some(((source, r), _)) = straddling.into_iter().next() {
        let detail = format_args!("row {r} was never read");
        return Err(layout_error(dir, sources[source].name(), detail));
    }
    if let Some(expected) = digests {
        for (t, pieces) in sources.iter().zip(&piece_digests) {
            if expected.get(t.name()) != Some(&combine_pieces(t.len() as u64, pieces)) {
                return Err(Error::invalid(
                    t.path(),
                    format!(
                        "{} changed while the checkpoint was being loaded (its bytes differ from \
                         those the cache key was computed from); nothing was cached, load it again",
                        t.name()
                    ),
                ));
            }
        }
    }
    progress.end()
}

/// One slot per row of `m`, carved from the blob.
fn matrix_slots<'b>(
    carver: &mut Carver<'b>,
    m: &QuantMatrix,
    dir: &Path,
) -> Result<Vec<Option<RowSlot<'b>>>> {
    let outside = || layout_error(dir, "a matrix", "range outside the blob");
    let data = carver.take(m.data).ok_or_else(outside)?;
    let scales = carver.take(m.scales).ok_or_else(outside)?;
    let (padded, groups) = (m.padded_cols(), m.groups());
    if data.len() != m.rows * padded || scales.len() != m.rows * groups * 4 {
        return Err(layout_error(dir, "a matrix", format_args!("{} rows of {} columns", m.rows, m.cols)));
    }
    Ok(data.chunks_exact_mut(padded).zip(scales.chunks_exact_mut(groups * 4)).map(Some).collect())
}

/// Reads, hashes and converts one unit (see [`convert_targets`]). `None`
/// when it stopped because another unit failed.
fn convert_unit(
    unit: Unit<'_, '_>,
    dir: &Path,
    hashing: bool,
    piece: usize,
    failed: &AtomicBool,
    progress: &Progress<'_>,
) -> Result<Option<UnitDone>> {
    let Unit { source, tensor: t, start, end, work } = unit;
    let rb = t.row_bytes();
    let mut done = UnitDone { source, digests: Vec::new(), fragments: Vec::new() };
    match work {
        UnitWork::Norm(out) => {
            let mut bytes = vec![0u8; t.len()];
            t.read_at(0, &mut bytes)?;
            if hashing {
                done.digests = bytes.chunks(piece).map(xxh3_128).collect();
            }
            let mut values = vec![0.0f32; t.rows() * t.row_len()];
            for (r, chunk) in values.chunks_exact_mut(t.row_len()).enumerate() {
                t.row_f32(&bytes, r, chunk)?;
            }
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(Error::invalid(
                    dir,
                    format!("{} holds a NaN or infinite value (element {i}: {})", t.name(), values[i]),
                ));
            }
            for (o, v) in out.chunks_exact_mut(4).zip(&values) {
                o.copy_from_slice(&v.to_ne_bytes());
            }
            progress.advance(bytes.len() as u64)?;
        }
        UnitWork::Rows { first_row, mut slots } => {
            let mut hasher = hashing.then(Xxh3Default::new);
            // Head: the end of a row begun in the previous piece (or, for a
            // row longer than a piece, all of this piece).
            let full_start = (first_row * rb).min(end);
            let full_end = full_start + slots.len() * rb;
            let mut fragment = |at: usize, len: usize, hasher: &mut Option<Xxh3Default>| -> Result<()> {
                if len > 0 {
                    let mut bytes = vec![0u8; len];
                    t.read_at(at, &mut bytes)?;
                    if let Some(h) = hasher {
                        h.update(&bytes);
                    }
                    progress.advance(len as u64)?;
                    done.fragments.push((at, bytes));
                }
                Ok(())
            };
            fragment(start, full_start - start, &mut hasher)?;
            let window_rows = (READ_WINDOW / rb).max(1);
            let mut window = Vec::new();
            let mut row = vec![0.0f32; t.row_len()];
            let mut r = first_row;
            for window_slots in slots.chunks_mut(window_rows) {
                if failed.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                window.resize(window_slots.len() * rb, 0);
                t.read_at(r * rb, &mut window)?;
                if let Some(h) = &mut hasher {
                    h.update(&window);
                }
                for (i, (q_row, s_row)) in window_slots.iter_mut().enumerate() {
                    t.row_f32(&window, i, &mut row)?;
                    quantize_checked(&row, q_row, s_row, &t, r + i, dir)?;
                }
                r += window_slots.len();
                progress.advance(window.len() as u64)?;
            }
            // Tail: the start of a row that ends in the next piece.
            fragment(full_end, end.saturating_sub(full_end), &mut hasher)?;
            if let Some(h) = hasher {
                done.digests.push(h.digest128());
            }
        }
    }
    Ok(Some(done))
}

/// [`quantize_row`] of row `r` of `t`, with non-finite input an error.
fn quantize_checked(
    row: &[f32],
    q_row: &mut [u8],
    s_row: &mut [u8],
    t: &TensorSource<'_>,
    r: usize,
    dir: &Path,
) -> Result<()> {
    if quantize_row(row, q_row, s_row) {
        return Ok(());
    }
    Err(Error::invalid(dir, format!("{} row {r} holds NaN or infinite values; cannot quantize", t.name())))
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
        assert!(convert_validated(&ckpt, &cfg, Some(&fp), &Progress::none()).is_ok());

        let path = tmp.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let name = "model.layers.1.mlp.down_proj.weight";
        let at = 8 + header_len + meta.info(name).unwrap().data_offsets.0 + 100;
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[bytes[at] ^ 0x01], at as u64).unwrap();

        let err =
            convert_validated(&ckpt, &cfg, Some(&fp), &Progress::none()).err().expect("a changed tensor");
        assert_eq!(err.code(), "checkpoint_invalid");
        assert!(err.to_string().contains(name) && err.to_string().contains("changed"), "{err}");
        // Without a fingerprint there is nothing to compare with.
        assert!(convert_validated(&ckpt, &cfg, None, &Progress::none()).is_ok());
        assert_ne!(ckpt.fingerprint(&cfg, 1).unwrap().key, fp.key);
    }

    /// Converts the fixture `name` in pieces of `piece` bytes, checking
    /// each tensor's digest taken in pieces of that size.
    fn convert_in_pieces(name: &str, piece: usize) -> Vec<u8> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name);
        let cfg = crate::config::load_config(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        ckpt.validate(&cfg).unwrap();
        let (index, total) = plan_layout(&cfg);
        let targets = plan_targets(&ckpt, &index).unwrap();
        let mut digests = HashMap::new();
        for t in targets.iter().flat_map(|t| t.sources()) {
            let bytes = ckpt.tensor(t.name()).unwrap().bytes;
            let pieces: Vec<u8> = bytes.chunks(piece).flat_map(|p| xxh3_128(p).to_le_bytes()).collect();
            digests.insert(t.name().to_string(), combine_pieces(bytes.len() as u64, &pieces));
        }
        let mut blob = vec![0u8; total];
        convert_targets(&mut blob, &targets, &dir, Some(&digests), piece, &Progress::none()).unwrap();
        blob
    }

    /// Pieces shorter than a row, a row long, not dividing rows, and longer:
    /// rows inside one piece, straddling two, and spanning several all
    /// convert to the bytes of the whole-tensor pieces, and every piece's
    /// bytes are hashed in order.
    #[test]
    fn any_piece_size_converts_the_same_bytes() {
        for name in ["odd_dims", "gqa2_hd64", "untied_head"] {
            let whole = convert_in_pieces(name, HASH_PIECE);
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name);
            let cfg = crate::config::load_config(&dir).unwrap();
            let model = convert(&Checkpoint::open(&dir).unwrap(), &cfg).unwrap();
            assert!(blob_bytes(&model).unwrap() == whole.as_slice(), "{name}");
            for piece in [64, 191, 192, 193, 1000, 65539] {
                assert!(convert_in_pieces(name, piece) == whole, "{name}, pieces of {piece} bytes");
            }
        }
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
