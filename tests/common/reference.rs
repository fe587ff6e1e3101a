//! CPU references of the decode kernels, in f64 on plain slices. Each
//! returns what a kernel should produce and, where the comparison needs
//! one, the scale its tolerance is relative to.

/// `y = W x'` for `m` (see [`super::Quant`]), where x' = x, or with
/// `norm = Some((norm_w, eps))` the RMSNorm of x's first `m.cols` values
/// times norm_w. Returns (want, scale): scale = sum |w x'| + 1.
pub fn matvec_ref(m: &super::Quant, x: &[f32], norm: Option<(&[f32], f32)>) -> (Vec<f64>, Vec<f64>) {
    let cols = m.cols;
    let xe: Vec<f64> = match norm {
        Some((norm_w, eps)) => {
            let ms = x[..cols].iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            x.iter().zip(norm_w).map(|(v, w)| *v as f64 * inv * *w as f64).collect()
        }
        None => x.iter().map(|v| *v as f64).collect(),
    };
    let mut want = Vec::with_capacity(m.rows);
    let mut scale = Vec::with_capacity(m.rows);
    for r in 0..m.rows {
        let (mut dot, mut mag) = (0.0, 0.0);
        for (c, xv) in xe[..cols].iter().enumerate() {
            let t = m.w(r, c) * xv;
            dot += t;
            mag += t.abs();
        }
        want.push(dot);
        scale.push(mag + 1.0);
    }
    (want, scale)
}

/// Rotate-half RoPE of one head at position `pos`.
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

/// RMSNorm of one head times its weight.
pub fn norm_ref(v: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
    let ms: f64 = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    v.iter().zip(w).map(|(x, w)| *x as f64 * inv * *w as f64).collect()
}

/// qk_norm_rope on the fused qkv vector ([n_heads q | n_kv k | n_kv v] heads
/// of `head_dim`): (q heads roped, k heads roped, v heads), each flat.
pub struct QkNormRopeWant {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_ref(
    qkv: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    pos: usize,
    theta: f64,
    eps: f64,
) -> QkNormRopeWant {
    let hd = head_dim;
    let head = |h: usize| &qkv[h * hd..(h + 1) * hd];
    let q = (0..n_heads).flat_map(|h| rope_ref(&norm_ref(head(h), q_norm, eps), pos, theta)).collect();
    let k = (0..n_kv_heads)
        .flat_map(|g| rope_ref(&norm_ref(head(n_heads + g), k_norm, eps), pos, theta))
        .collect();
    let v = (0..n_kv_heads).flat_map(|g| head(n_heads + n_kv_heads + g).iter().map(|v| *v as f64)).collect();
    QkNormRopeWant { q, k, v }
}

/// Decode attention of every query head over positions 0..seq of the
/// caches (`[kv_head][capacity][head_dim]` f16, given as f64), GQA by
/// `kv_head = h / (n_heads / n_kv_heads)`. Returns the `[head][head_dim]`
/// output.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
    q: &[f32],
    k: &[f64],
    v: &[f64],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    seq: usize,
    scale: f64,
) -> Vec<f64> {
    let hd = head_dim;
    let mut out = Vec::with_capacity(n_heads * hd);
    for h in 0..n_heads {
        let g = h / (n_heads / n_kv_heads);
        let kv = |t: usize, d: usize, x: &[f64]| x[(g * capacity + t) * hd + d];
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

/// Index of the largest value (ties -> lowest index).
pub fn argmax_ref(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}
