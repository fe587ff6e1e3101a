//! The CPU references (shared with the engine's self-check, in
//! `qwen3_wgpu::internals::reference`) plus the random inputs the tests run them on.

use qwen3_wgpu::internals::converted::{stored_scale, QUANT_GROUP};
use qwen3_wgpu::internals::kernels::quant_padded;
pub use qwen3_wgpu::internals::reference::*;
use qwen3_wgpu::WeightFormat;
use rand::{rngs::StdRng, Rng};

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

pub fn random_quant(rng: &mut StdRng, rows: usize, cols: usize) -> Quant {
    random_quant_in(rng, WeightFormat::Int8, rows, cols)
}

/// A random matrix of non-zero values of `format` (int4: -8 ..= 7).
pub fn random_quant_in(rng: &mut StdRng, format: WeightFormat, rows: usize, cols: usize) -> Quant {
    let padded = quant_padded(cols);
    let groups = padded / QUANT_GROUP;
    let (min, max) = Quant::range(format);
    let mut q = vec![0i8; rows * padded];
    for r in 0..rows {
        for c in 0..cols {
            q[r * padded + c] = rng.random_range(min..=max);
            if q[r * padded + c] == 0 {
                q[r * padded + c] = 1;
            }
        }
    }
    // Scales the format stores exactly (int4's are bf16).
    let scales = (0..rows * groups).map(|_| stored_scale(format, rng.random_range(0.001..0.02))).collect();
    Quant { rows, cols, padded, format, q, scales }
}

/// A matvec input padded like the engine's (the tail past `cols` is zero).
pub fn padded_input(rng: &mut StdRng, cols: usize) -> Vec<f32> {
    let mut x = nonzero(rng, quant_padded(cols));
    x[cols..].iter_mut().for_each(|v| *v = 0.0);
    x
}
