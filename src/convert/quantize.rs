//! Symmetric int8 quantization: rows in groups of [`QUANT_GROUP`] with one
//! f32 scale each, and the rounding of one value.

use std::path::Path;

use crate::checkpoint::TensorSource;
use crate::converted::QUANT_GROUP;
use crate::error::{Error, Result};

/// [`quantize_row`] of row `r` of `t`, with non-finite input an error.
pub(super) fn quantize_checked(
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
pub(super) fn quantize_row(row: &[f32], q_row: &mut [u8], s_row: &mut [u8]) -> bool {
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
/// [`convert`](super::convert) reports NaN input as an error anyway).
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
