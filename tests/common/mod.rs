//! Helpers shared by the kernel tests: inputs, poisoning, comparison, and
//! the CPU references (reference.rs).
#![allow(dead_code)] // each test binary uses its own subset

pub mod reference;

use rand::{rngs::StdRng, Rng};

pub const POISON: u32 = 0x7fc0_dead; // a NaN

pub fn poisoned(n_words: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![POISON; n_words]).to_vec()
}

pub fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn u32s(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn to_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}

pub fn to_u32(b: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(b)
}

/// `got[i]` within `rel * scale[i]` of `want[i]` (and finite), or the first
/// element that is not.
pub fn check_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} instead of {}", got.len(), want.len()));
    }
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = rel * s.max(1e-6);
        if !(g.is_finite() && ((*g as f64) - w).abs() <= tol) {
            return Err(format!("{what}[{i}]: got {g}, want {w} (tolerance {tol})"));
        }
    }
    Ok(())
}

pub fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64) {
    if let Err(e) = check_close(what, got, want, scale, rel) {
        panic!("{e}");
    }
}

/// Random non-zero values in +-[0.05, 1].
pub fn nonzero(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = rng.random_range(0.05..1.0);
            if rng.random_bool(0.5) {
                v
            } else {
                -v
            }
        })
        .collect()
}

/// An int8 matrix as the engine stores it: rows zero-padded to a multiple
/// of the quant group (64), one scale per group.
pub struct Quant {
    pub rows: usize,
    pub cols: usize,
    pub padded: usize,
    pub q: Vec<i8>,
    pub scales: Vec<f32>,
}

pub fn random_quant(rng: &mut StdRng, rows: usize, cols: usize) -> Quant {
    let padded = cols.div_ceil(64) * 64;
    let groups = padded / 64;
    let mut q = vec![0i8; rows * padded];
    for r in 0..rows {
        for c in 0..cols {
            q[r * padded + c] = rng.random_range(-127..=127);
            if q[r * padded + c] == 0 {
                q[r * padded + c] = 1;
            }
        }
    }
    let scales = (0..rows * groups).map(|_| rng.random_range(0.001..0.02)).collect();
    Quant { rows, cols, padded, q, scales }
}

impl Quant {
    pub fn w(&self, r: usize, c: usize) -> f64 {
        self.q[r * self.padded + c] as f64 * self.scales[r * (self.padded / 64) + c / 64] as f64
    }
    pub fn data(&self) -> Vec<u8> {
        bytemuck::cast_slice(&self.q).to_vec()
    }
}

pub fn unpack_f16(words: &[u8]) -> Vec<f32> {
    let h: Vec<u16> = bytemuck::pod_collect_to_vec(words);
    h.iter().map(|b| half::f16::from_bits(*b).to_f32()).collect()
}
