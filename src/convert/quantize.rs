//! Symmetric int8 and int4 quantization: rows in groups of [`QUANT_GROUP`]
//! with one scale each (f32 for int8, bf16 for int4), and the rounding of
//! one value.

use std::path::Path;

use crate::checkpoint::TensorSource;
use crate::converted::{int4_position, scale_bytes, stored_scale, write_scale, WeightFormat, QUANT_GROUP};
use crate::error::{Error, Result};

/// [`quantize_row`] or [`quantize_row_int4`], as `format` says, of row `r`
/// of `t`, with non-finite input an error.
pub(super) fn quantize_checked(
    row: &[f32],
    q_row: &mut [u8],
    s_row: &mut [u8],
    format: WeightFormat,
    t: &TensorSource<'_>,
    r: usize,
    dir: &Path,
) -> Result<()> {
    let all_finite = match format {
        WeightFormat::Int8 => quantize_row(row, q_row, s_row),
        WeightFormat::Int4 => quantize_row_int4(row, q_row, s_row),
    };
    if all_finite {
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

/// Quantizes one row to int4: `q_row` gets the nibbles, two's complement,
/// where [`int4_position`] puts them (whole groups: the padding is zero),
/// `s_row` one native-endian bf16 scale per group, the group's value of
/// largest magnitude (the first of equal ones) / -8, as llama.cpp's Q4_0,
/// rounded to bf16. With a bf16 scale (any bf16 weight / -8 is one) that
/// value becomes exactly -8; so a group of weights `q * s` with `q` in
/// [-8, 7], -8 present and `s` a bf16 value gets the scale `s` and its `q`
/// back, exactly (a scale of largest magnitude / 7 would give 7 there and
/// round the rest). Returns false when the row holds a non-finite value.
pub(super) fn quantize_row_int4(row: &[f32], q_row: &mut [u8], s_row: &mut [u8]) -> bool {
    let mut all_finite = true;
    let scale_size = scale_bytes(WeightFormat::Int4);
    let groups = row
        .chunks(QUANT_GROUP)
        .zip(q_row.chunks_mut(QUANT_GROUP / 2))
        .zip(s_row.chunks_exact_mut(scale_size));
    for ((w, q), s) in groups {
        let mut extreme = 0f32;
        for &x in w {
            all_finite &= x.is_finite();
            if x.abs() > extreme.abs() {
                extreme = x;
            }
        }
        let scale = stored_scale(WeightFormat::Int4, extreme / -8.0);
        write_scale(WeightFormat::Int4, scale, s);
        q.fill(0);
        if scale == 0.0 {
            // An all-zero group: scale 0 and q 0.
            continue;
        }
        for (c, &x) in w.iter().enumerate() {
            let (byte, high) = int4_position(c);
            let nibble = (quantize_nibble(x / scale) as u8) & 0xf;
            q[byte] |= if high { nibble << 4 } else { nibble };
        }
    }
    all_finite
}

/// Rounds half away from zero and clamps to [-127, 127] (NaN gives -127;
/// [`convert`](super::convert) reports NaN input as an error anyway).
#[inline(always)]
pub fn quantize_value(y: f32) -> i8 {
    round_clamped(y, -127.0, 127.0) as i8
}

/// Rounds half away from zero and clamps to [-8, 7], an int4 value (NaN
/// gives -8).
#[inline(always)]
pub fn quantize_nibble(y: f32) -> i8 {
    round_clamped(y, -8.0, 7.0) as i8
}

/// `y` rounded half away from zero and clamped to [min, max] (integers
/// within [-127, 127]).
///
/// `f32::round` is a libm call on baseline x86-64 and a saturating `as`
/// cast is scalarized there; both block vectorization. Clamping first (to an
/// integer bound, so clamp-then-round equals round-then-clamp), truncating,
/// and then looking at the fraction (exact, as |y| <= 127) gives the same
/// result with plain SIMD. Adding 0.5 before truncating would not:
/// 0.49999997 + 0.5 rounds up to 1.0 in f32.
#[inline(always)]
fn round_clamped(y: f32, min: f32, max: f32) -> i32 {
    // `if` forms (not f32::max/min) compile to maxps/minps; a NaN `y` fails
    // the first comparison and becomes `min`.
    let y = if y > min { y } else { min };
    let y = if y < max { y } else { max };
    // SAFETY: y is finite and within [-127, 127], so it fits an i32.
    let truncated: i32 = unsafe { y.to_int_unchecked() };
    let fraction = y - truncated as f32;
    truncated + i32::from(fraction >= 0.5) - i32::from(fraction <= -0.5)
}
