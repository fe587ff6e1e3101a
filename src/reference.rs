//! CPU references of the kernels, in f64, with the magnitude each output's
//! tolerance scales with: the kernel tests (WGSL on Vulkan, the MSL twins
//! through the C++ shim) and the engine's start-up self-check
//! ([`crate::self_check`]) compare against the same functions.

use half::f16;

use crate::converted::{int4_position, scale_blob, stored_scale, WeightFormat, QUANT_GROUP};
use crate::kernels::quant_padded;

/// Fills outputs before a run: a NaN, so an element never written fails.
pub const POISON: u32 = 0x7fc0_dead;

pub fn poisoned(n_words: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![POISON; n_words]).to_vec()
}

pub fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn to_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}

/// The first element where `|got - want| > rel * scale` (or `got` is not
/// finite), described; `None` when every element is close.
pub fn first_mismatch(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{what}: {} values, expected {}", got.len(), want.len()));
    }
    got.iter().zip(want).zip(scale).enumerate().find_map(|(i, ((g, w), s))| {
        let tol = rel * s.max(1e-6);
        (!(g.is_finite() && ((*g as f64) - w).abs() <= tol))
            .then(|| format!("{what}[{i}]: got {g}, want {w} (tolerance {tol})"))
    })
}

/// Asserts `|got - want| <= rel * scale` element-wise (and finite).
pub fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64) {
    if let Some(m) = first_mismatch(what, got, want, scale, rel) {
        panic!("{m}");
    }
}

/// `n` deterministic pseudo-random non-zero values in +-[0.05, 1]
/// (xorshift64*, for checks that must not depend on a random crate).
pub fn pseudo_nonzero(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            let v = 0.05 + 0.95 * r;
            if s & (1 << 20) != 0 {
                v
            } else {
                -v
            }
        })
        .collect()
}

/// A quantised matrix in the engine's layout: rows zero-padded to
/// [`QUANT_GROUP`] values, one scale per group (each a value `format`
/// stores exactly: bf16 for int4); `q` holds one value an element (within
/// [-8, 7] for int4), [`Quant::data`] and [`Quant::scale_blob`] the bytes
/// the GPU reads.
pub struct Quant {
    pub rows: usize,
    pub cols: usize,
    pub padded: usize,
    pub format: WeightFormat,
    pub q: Vec<i8>,
    pub scales: Vec<f32>,
}

impl Quant {
    pub fn w(&self, r: usize, c: usize) -> f64 {
        self.q[r * self.padded + c] as f64 * self.scales[r * self.groups() + c / QUANT_GROUP] as f64
    }
    /// The values as stored: bytes (int8) or nibbles where
    /// [`int4_position`] puts them.
    pub fn data(&self) -> Vec<u8> {
        match self.format {
            WeightFormat::Int8 => bytemuck::cast_slice(&self.q).to_vec(),
            WeightFormat::Int4 => {
                let mut out = vec![0u8; self.q.len() / 2];
                for (row, q) in out.chunks_mut(self.padded / 2).zip(self.q.chunks(self.padded)) {
                    for (c, &v) in q.iter().enumerate() {
                        let (byte, high) = int4_position(c);
                        let nibble = (v as u8) & 0xf;
                        row[byte] |= if high { nibble << 4 } else { nibble };
                    }
                }
                out
            }
        }
    }
    /// The scales as stored ([`scale_blob`]).
    pub fn scale_blob(&self) -> Vec<u8> {
        scale_blob(self.format, &self.scales)
    }
    pub fn k_words(&self) -> usize {
        self.padded / 4
    }
    pub fn groups(&self) -> usize {
        self.padded / QUANT_GROUP
    }

    /// A deterministic int8 matrix of non-zero values in `-127..=127`
    /// (the padding zero) with scales in [0.001, 0.02].
    pub fn pseudo(seed: u64, rows: usize, cols: usize) -> Self {
        Self::pseudo_in(WeightFormat::Int8, seed, rows, cols)
    }

    /// [`Self::pseudo`] in `format` (int4: non-zero values in `-8..=7`).
    pub fn pseudo_in(format: WeightFormat, seed: u64, rows: usize, cols: usize) -> Self {
        let padded = quant_padded(cols);
        let values = pseudo_nonzero(seed, rows * cols);
        let (min, max) = Self::range(format);
        let mut q = vec![0i8; rows * padded];
        for r in 0..rows {
            for c in 0..cols {
                let v =
                    (values[r * cols + c] * -f32::from(min)).round().clamp(f32::from(min), f32::from(max));
                q[r * padded + c] = if v == 0.0 { 1 } else { v as i8 };
            }
        }
        let groups = padded / QUANT_GROUP;
        let scales = pseudo_nonzero(seed ^ 0x5ca1e, rows * groups)
            .iter()
            .map(|v| stored_scale(format, 0.001 + 0.019 * v.abs()))
            .collect();
        Quant { rows, cols, padded, format, q, scales }
    }

    /// The values `format` holds: [-127, 127] or [-8, 7].
    pub fn range(format: WeightFormat) -> (i8, i8) {
        match format {
            WeightFormat::Int8 => (-127, 127),
            WeightFormat::Int4 => (-8, 7),
        }
    }
}

pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// `int8_matvec` (over the matrix's format): the values written at `y[out_offset..]`, with their
/// tolerance scales. `norm`: the fused RMSNorm (weight, eps); `y0`: the
/// accumulated values (`y += W x`); `swiglu`: rows interleave gate and up,
/// output i = silu(row 2i . x) * (row 2i+1 . x).
pub fn matvec_ref(
    m: &Quant,
    x: &[f32],
    norm: Option<(&[f32], f32)>,
    y0: Option<&[f32]>,
    swiglu: bool,
) -> (Vec<f64>, Vec<f64>) {
    let cols = m.cols;
    let xe: Vec<f64> = match norm {
        Some((w, eps)) => {
            let inv = rms_scale(&x[..cols], eps);
            x.iter().zip(w).map(|(v, w)| *v as f64 * inv * *w as f64).collect()
        }
        None => x.iter().map(|v| *v as f64).collect(),
    };
    matvec_ref_of(m, &xe, y0, swiglu)
}

/// [`matvec_ref`] of a pipeline that takes integer dot products where
/// `int_dot` ([`crate::kernels::matvec::int_dot`]): a normed one's input x
/// * norm_w quantised as [`int_dot_input`], times the norm's rsqrt.
pub fn matvec_ref_for(
    int_dot: bool,
    m: &Quant,
    x: &[f32],
    norm: Option<(&[f32], f32)>,
    y0: Option<&[f32]>,
    swiglu: bool,
) -> (Vec<f64>, Vec<f64>) {
    let Some((norm_w, eps)) = norm.filter(|_| int_dot) else { return matvec_ref(m, x, norm, y0, swiglu) };
    let inv = rms_scale(&x[..m.cols], eps);
    let xe: Vec<f64> = int_dot_input(x, norm_w).iter().map(|v| *v as f64 * inv).collect();
    matvec_ref_of(m, &xe, y0, swiglu)
}

/// rsqrt(mean(x^2) + eps).
fn rms_scale(x: &[f32], eps: f32) -> f64 {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    1.0 / (ms + eps as f64).sqrt()
}

/// What an `IDOT` matvec multiplies its int4 weights by: x * norm_w (f32
/// products), each block of 32 values in 16-bit fixed point as the kernel
/// computes it (int8_matvec.wgsl's `XInt8`): h = round(v * 127 / absmax),
/// l = round((v - h * absmax / 127) * 254 * 127 / absmax), the value (254 h
/// + l) * absmax / 127 / 254 (a block under 1e-30 as zeros).
pub fn int_dot_input(x: &[f32], norm_w: &[f32]) -> Vec<f32> {
    // The kernel's rounding: an fma with 1.5 * 2^23 rounds once to an integer.
    const MAGIC: f32 = 12582912.0;
    let v: Vec<f32> = x.iter().zip(norm_w).map(|(a, b)| a * b).collect();
    v.chunks(32)
        .flat_map(|block| {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (inv, scale) = if amax >= 1e-30 { (127.0 / amax, amax / 127.0) } else { (0.0, 0.0) };
            block
                .iter()
                .map(move |&v| {
                    let h = v.mul_add(inv, MAGIC) - MAGIC;
                    let r = (-h).mul_add(scale, v);
                    let l = r.mul_add(inv * 254.0, MAGIC) - MAGIC;
                    ((254.0 * h as f64 + l as f64) * (scale / 254.0) as f64) as f32
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// [`matvec_ref`] over the effective inputs `xe`.
fn matvec_ref_of(m: &Quant, xe: &[f64], y0: Option<&[f32]>, swiglu: bool) -> (Vec<f64>, Vec<f64>) {
    let cols = m.cols;
    let dot = |r: usize| (0..cols).map(|c| m.w(r, c) * xe[c]).sum::<f64>();
    let mag = |r: usize| (0..cols).map(|c| (m.w(r, c) * xe[c]).abs()).sum::<f64>() + 1.0;
    if swiglu {
        (0..m.rows / 2)
            .map(|i| {
                let (g, u) = (dot(2 * i), dot(2 * i + 1));
                (silu(g) * u, mag(2 * i) * (u.abs() + 1.0) + mag(2 * i + 1) * (g.abs() + 1.0))
            })
            .unzip()
    } else {
        (0..m.rows).map(|r| (dot(r) + y0.map_or(0.0, |y| y[r] as f64), mag(r))).unzip()
    }
}

/// Index of the largest value, the lowest one among equals.
pub fn argmax_ref(v: &[f32]) -> usize {
    let mut best = 0;
    for i in 0..v.len() {
        if v[i] > v[best] {
            best = i;
        }
    }
    best
}

/// Rotate-half RoPE of one head at `pos`.
pub fn rope_ref(v: &[f64], pos: usize, theta: f64) -> Vec<f64> {
    let d = v.len();
    let half = d / 2;
    let mut out = vec![0.0; d];
    for i in 0..half {
        let a = pos as f64 * theta.powf(-((2 * i) as f64) / d as f64);
        let (s, c) = a.sin_cos();
        out[i] = v[i] * c - v[i + half] * s;
        out[i + half] = v[i + half] * c + v[i] * s;
    }
    out
}

pub fn norm_ref(v: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
    let ms: f64 = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    v.iter().zip(w).map(|(x, w)| *x as f64 * inv * *w as f64).collect()
}

/// `qk_norm_rope` for one head of the qkv vector: a query head (q_norm +
/// RoPE), a key head (k_norm + RoPE) or a value head (as is).
pub fn qk_norm_rope_ref(head: &[f32], norm_w: Option<&[f32]>, pos: usize, theta: f64, eps: f64) -> Vec<f64> {
    match norm_w {
        Some(w) => rope_ref(&norm_ref(head, w, eps), pos, theta),
        None => head.iter().map(|v| *v as f64).collect(),
    }
}

/// `v` as f16, two values per word (the residual's f16 copy; a zero pads
/// an odd count).
pub fn pack_f16(v: &[f32]) -> Vec<u32> {
    v.chunks(2)
        .map(|p| {
            let h = |i: usize| f16::from_f32(p.get(i).copied().unwrap_or(0.0)).to_bits() as u32;
            h(0) | (h(1) << 16)
        })
        .collect()
}

/// `v` rounded to f16 (what a matvec reading the f16 copy sees).
pub fn round_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| f16::from_f32(*x).to_f32()).collect()
}

/// f16 values, two per word, as f32.
pub fn unpack_f16(words: &[u8]) -> Vec<f32> {
    let h: Vec<u16> = bytemuck::pod_collect_to_vec(words);
    h.iter().map(|b| f16::from_bits(*b).to_f32()).collect()
}

/// Decode attention of every query head over positions `0..seq` of f16
/// caches laid out `[kv_head][cap][hd]` (GQA: head h reads kv head
/// h / (nh / nkv)). Returns `[nh][hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    nh: usize,
    nkv: usize,
    hd: usize,
    cap: usize,
    seq: usize,
    scale: f64,
) -> Vec<f64> {
    let (k, v): (Vec<f64>, Vec<f64>) =
        (k.iter().map(|x| x.to_f64()).collect(), v.iter().map(|x| x.to_f64()).collect());
    attention_ref_values(q, &k, &v, nh, nkv, hd, cap, seq, scale)
}

/// The layout of an int8 KV cache of `nkv` heads at `cap` positions.
fn int8_layout(nkv: usize, cap: usize, hd: usize) -> crate::kv_cache::KvLayout {
    let format = crate::kv_cache::KvFormat::Int8;
    crate::kv_cache::KvLayout { format, kv_heads: nkv, head_dim: hd, capacity: cap }
}

/// An int8 KV cache ([`KvFormat::Int8`](crate::KvFormat)) of `nkv` heads
/// at `cap` positions holding `rows` (`[kv_head][cap][hd]`), laid out as
/// [`KvLayout`](crate::kv_cache::KvLayout) says: each row's values as
/// round(127 v / the row's largest magnitude), that magnitude as its
/// scale (0 for a row of zeros). Returns the bytes and the values they
/// stand for.
pub fn kv_int8_encode(rows: &[f32], nkv: usize, cap: usize, hd: usize) -> (Vec<u8>, Vec<f64>) {
    let layout = int8_layout(nkv, cap, hd);
    let mut bytes = vec![0u8; layout.bytes() as usize];
    let mut values = Vec::with_capacity(rows.len());
    for (r, row) in rows.chunks(hd).enumerate() {
        let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
        for (d, &v) in row.iter().enumerate() {
            let q = (0.5 + 127.0 * (v * inv).clamp(-1.0, 1.0)).floor() as i8;
            bytes[r * hd + d] = q as u8;
            values.push(q as f64 / 127.0 * absmax as f64);
        }
        let at = layout.scales_at(r / cap).unwrap_or(0) as usize + 4 * (r % cap);
        bytes[at..at + 4].copy_from_slice(&absmax.to_le_bytes());
    }
    (bytes, values)
}

/// The values an int8 KV cache's bytes stand for (the layout of
/// [`kv_int8_encode`]), `[kv_head][cap][hd]`.
pub fn kv_int8_decode(bytes: &[u8], nkv: usize, cap: usize, hd: usize) -> Vec<f64> {
    let layout = int8_layout(nkv, cap, hd);
    (0..nkv * cap * hd)
        .map(|i| {
            let r = i / hd;
            let at = layout.scales_at(r / cap).unwrap_or(0) as usize + 4 * (r % cap);
            let scale = f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
            (bytes[i] as i8) as f64 / 127.0 * scale as f64
        })
        .collect()
}

/// [`attention_ref`] over caches of any element type, as f64 values
/// (`[kv_head][cap][hd]`; an int8 cache dequantised).
#[allow(clippy::too_many_arguments)]
pub fn attention_ref_values(
    q: &[f32],
    k: &[f64],
    v: &[f64],
    nh: usize,
    nkv: usize,
    hd: usize,
    cap: usize,
    seq: usize,
    scale: f64,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(nh * hd);
    for h in 0..nh {
        let g = h / (nh / nkv);
        let kv = |t: usize, d: usize, x: &[f64]| x[(g * cap + t) * hd + d];
        let s: Vec<f64> = (0..seq)
            .map(|t| (0..hd).map(|d| q[h * hd + d] as f64 * kv(t, d, k)).sum::<f64>() * scale)
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = e.iter().sum();
        out.extend((0..hd).map(|d| (0..seq).map(|t| e[t] * kv(t, d, v)).sum::<f64>() / l));
    }
    out
}

/// The sampler's order-preserving u32 key of a logit (`sort_key` in
/// kernels/wgsl/sample_common.wgsl).
pub fn sort_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// pcg4d (`pcg4d` in kernels/wgsl/sample_common.wgsl), bit for bit: the
/// counter-based hash behind the sampler's draws.
pub fn pcg4d(input: [u32; 4]) -> [u32; 4] {
    let mut v = input.map(|x| x.wrapping_mul(1664525).wrapping_add(1013904223));
    let mix = |v: &mut [u32; 4]| {
        v[0] = v[0].wrapping_add(v[1].wrapping_mul(v[3]));
        v[1] = v[1].wrapping_add(v[2].wrapping_mul(v[0]));
        v[2] = v[2].wrapping_add(v[0].wrapping_mul(v[1]));
        v[3] = v[3].wrapping_add(v[1].wrapping_mul(v[2]));
    };
    mix(&mut v);
    v = v.map(|x| x ^ (x >> 16));
    mix(&mut v);
    v
}

/// The hash word a draw for token `id` at position `pos` under `seed` is
/// made from (`uniform_draw` in kernels/wgsl/sample_common.wgsl).
pub fn draw_hash(seed: u64, pos: u32, id: u32) -> u32 {
    pcg4d([seed as u32, (seed >> 32) as u32, pos, id])[0]
}

/// The sampler's uniform draw for token `id` at position `pos` under
/// `seed`, bit for bit as the kernels make it: the hash's top 23 bits `k`
/// as `(k + 0.5) / 2^23`, exact in f32, so strictly inside (0, 1) (from
/// 2^-24 to 1 - 2^-24).
pub fn uniform_draw(seed: u64, pos: u32, id: u32) -> f32 {
    ((draw_hash(seed, pos, id) >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// The Gumbel noise `-ln(-ln u)` of the draw `u` as the kernels bound it:
/// `-ln u` is at least 2^-24 (its exact value at the largest draw, about
/// 16.64 of noise), so a `ln` that rounds to 0 next to 1 still gives
/// finite noise.
pub fn gumbel_noise(u: f32) -> f32 {
    -(-u.ln()).max(GUMBEL_MIN_EXPONENTIAL).ln()
}

/// The least `-ln u` the Gumbel noise takes (2^-24; `gumbel_noise`).
pub const GUMBEL_MIN_EXPONENTIAL: f32 = 1.0 / 16_777_216.0;

/// The sampling penalties applied to `logits` over the window `recent` (the
/// last tokens of the context, already cut to the window), in the kernel's
/// f32 operations: each distinct token once, repetition (Hugging Face:
/// `l < 0 ? l * r : l / r`), then `l -= presence + frequency * count`.
pub fn penalize_ref(
    logits: &[f32],
    recent: &[u32],
    repetition: f32,
    presence: f32,
    frequency: f32,
) -> Vec<f32> {
    let mut out = logits.to_vec();
    let mut seen = std::collections::HashSet::new();
    for &t in recent {
        if t as usize >= logits.len() || !seen.insert(t) {
            continue;
        }
        let count = recent.iter().filter(|&&u| u == t).count() as f32;
        let mut l = logits[t as usize];
        if repetition != 1.0 {
            l = if l < 0.0 { l * repetition } else { l / repetition };
        }
        if presence != 0.0 || frequency != 0.0 {
            l -= presence + frequency * count;
        }
        out[t as usize] = l;
    }
    out
}

/// The tokens sampling keeps and each one's probability (0 for the others),
/// in f64, from the (already penalised) `logits`, as Hugging Face's warpers
/// apply them with temperature `t` in order: top-k (`k`, 0 off: the k-th
/// largest logit is the threshold, ties kept), top-p (`top_p`, 1 off: over
/// the top-k set renormalised, the largest threshold whose mass from the
/// top reaches `top_p`; ties at it kept), min-p (`min_p`, 0 off: logits at
/// least `max + t ln(min_p)`, in the kernel's f32 operations), then the
/// softmax of `logit / t` over what is kept.
pub fn sample_probs_ref(logits: &[f32], t: f32, k: u32, top_p: f32, min_p: f32) -> Vec<f64> {
    let n = logits.len();
    let mut sorted: Vec<f32> = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let max = sorted[0];
    let mut theta = f32::NEG_INFINITY;
    if k > 0 && (k as usize) < n {
        theta = sorted[k as usize - 1];
    }
    let weight = |l: f32| ((l as f64 - max as f64) / t as f64).exp();
    if top_p < 1.0 {
        let kept: Vec<f32> = sorted.iter().copied().filter(|&l| l >= theta).collect();
        let z: f64 = kept.iter().map(|&l| weight(l)).sum();
        let mut cum = 0.0;
        for &l in &kept {
            cum += weight(l);
            if cum >= top_p as f64 * z {
                theta = l;
                break;
            }
        }
    }
    let floor = if min_p > 0.0 { max + t * min_p.ln() } else { f32::NEG_INFINITY };
    let keep = |l: f32| l >= theta && l >= floor;
    let z: f64 = logits.iter().filter(|&&l| keep(l)).map(|&l| weight(l)).sum();
    logits.iter().map(|&l| if keep(l) { weight(l) / z } else { 0.0 }).collect()
}

/// The chi-square statistic of `counts` against `probs` (expected counts
/// `probs * total`), bins with an expected count below 5 merged into one
/// (with what they observed), and its degrees of freedom (merged bins - 1).
/// A token drawn where `probs` is 0 counts as infinite.
pub fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize) {
    let total: u64 = counts.iter().sum();
    let mut stat = 0.0;
    let mut bins = 0usize;
    let (mut small_obs, mut small_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            if c > 0 {
                return (f64::INFINITY, 0);
            }
            continue;
        }
        let e = p * total as f64;
        if e < 5.0 {
            small_obs += c as f64;
            small_exp += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            bins += 1;
        }
    }
    if small_exp > 0.0 {
        stat += (small_obs - small_exp).powi(2) / small_exp;
        bins += 1;
    }
    (stat, bins.saturating_sub(1))
}

/// The chi-square statistic that `df` degrees of freedom exceed with
/// probability about 1e-3 (Wilson-Hilferty, z = 3.09; close enough for a
/// fixed test threshold at any `df` >= 1).
pub fn chi_square_critical_1e3(df: usize) -> f64 {
    let k = df.max(1) as f64;
    let z = 3.090_232;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// A norm weight buffer's bytes as the matvecs bind it: `padded` (the
/// weights zero-padded to whole quant groups) as f32, then as f16 (what
/// decode steps that keep the residual's f16 copy read; `int8_common.wgsl`).
pub fn norm_weight_bytes(padded: &[f32]) -> Vec<u8> {
    let f32s = bytemuck::cast_slice::<f32, u8>(padded).iter().copied();
    f32s.chain(padded.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer dot products' inputs are within 1/64,516 of their
    /// block's largest value (16-bit fixed point), finer than an f16
    /// rounding of that value; a block of nothing but tiny values is zero.
    #[test]
    fn int_dot_inputs_keep_sixteen_bits_of_each_block() {
        let x = pseudo_nonzero(7, 32 * 9);
        let mut g = pseudo_nonzero(8, 32 * 9);
        g[32..64].iter_mut().for_each(|v| *v *= 1e-34); // block 1 under 1e-30
        let got = int_dot_input(&x, &g);
        for (b, (block, xs)) in got.chunks(32).zip(x.chunks(32).zip(g.chunks(32))).enumerate() {
            let v: Vec<f32> = xs.0.iter().zip(xs.1).map(|(a, b)| a * b).collect();
            let amax = v.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (q, v)) in block.iter().zip(&v).enumerate() {
                if b == 1 {
                    assert_eq!(*q, 0.0, "block {b} value {i}");
                } else {
                    let err = (q - v).abs();
                    assert!(err <= amax / 64_516.0 * 1.01, "block {b} value {i}: {q} for {v} (max {amax})");
                    assert!(err <= amax / 4096.0, "finer than f16's rounding of the block's largest value");
                }
            }
        }
    }
}
