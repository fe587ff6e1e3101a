//! The conversion on all cores: the blob carved into row slots, each
//! source tensor cut into hash pieces that workers read, hash and convert,
//! and the rows that straddle pieces put together after.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;
use xxhash_rust::xxh3::{xxh3_128, Xxh3Default};

use super::quantize::quantize_checked;
use super::Target;
use crate::checkpoint::{combine_pieces, TensorSource, READ_WINDOW};
use crate::converted::{scales_len, ByteRange, QuantMatrix, WeightFormat};
use crate::error::{Error, Result};
use crate::progress::{LoadPhase, Progress};

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

/// One row of a matrix in the blob: its data, its scales and their format.
type RowSlot<'b> = (&'b mut [u8], &'b mut [u8], WeightFormat);

/// What one worker converts: a [`HASH_PIECE`](crate::checkpoint::HASH_PIECE) of a source tensor (the
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
/// cut into pieces of `piece` bytes ([`HASH_PIECE`](crate::checkpoint::HASH_PIECE), the pieces of its
/// digest, see [`TensorHasher`](crate::checkpoint::TensorHasher)): a worker
/// reads its piece once, hashes it and converts the whole rows inside it;
/// the few rows that straddle pieces are put together from the bytes the
/// workers read, and converted after. So every byte converted is a byte
/// hashed, read once, and each tensor's digest is checked against
/// `digests` (when given) before anything is returned. The output is the
/// same bytes whatever the number of threads or the piece size.
pub(super) fn convert_targets(
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
        let (q_row, s_row, format) = straddling
            .remove(&(source, r))
            .filter(|_| bytes.len() == t.row_bytes())
            .ok_or_else(|| layout_error(dir, t.name(), format_args!("row {r} split across pieces")))?;
        row.resize(t.row_len(), 0.0);
        t.row_f32(&bytes, 0, &mut row)?;
        quantize_checked(&row, q_row, s_row, format, t, r, dir)?;
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
    let (row_bytes, row_scales) = (m.row_bytes(), m.row_scale_bytes());
    if data.len() != m.rows * row_bytes || scales.len() != scales_len(m.format, m.rows * m.groups()) {
        return Err(layout_error(dir, "a matrix", format_args!("{} rows of {} columns", m.rows, m.cols)));
    }
    // The scales' padding to a whole word stays zero.
    let rows = data.chunks_exact_mut(row_bytes).zip(scales.chunks_exact_mut(row_scales));
    Ok(rows.map(|(q, s)| Some((q, s, m.format))).collect())
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
                for (i, (q_row, s_row, format)) in window_slots.iter_mut().enumerate() {
                    t.row_f32(&window, i, &mut row)?;
                    quantize_checked(&row, q_row, s_row, *format, &t, r + i, dir)?;
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
