//! The kernel cases both backends run: the WGSL kernels on a Vulkan
//! adapter (tests/it/kernels.rs) and their MSL twins through the C++ shim
//! (tests/it/msl_kernels.rs). Each builds random non-zero inputs and
//! NaN-poisoned outputs, runs the launches through `run`, and checks the
//! results against the CPU references (or returns them, for the matvec, so
//! a test can expect a broken kernel to fail).

use bytemuck::bytes_of;
use half::f16;
use qwen3_wgpu::internals::kernels::{
    self, ArgmaxFinalParams, ArgmaxPartialParams, Bind, HeadParams, Kernel, MatvecParams, ReduceParams, Step,
    ATTENTION_CHUNK, MAX_HEAD_DIM,
};
use qwen3_wgpu::WeightFormat;
use rand::{rngs::StdRng, SeedableRng};

use super::reference::{
    argmax_ref, assert_close, attention_ref, attention_ref_values, f32s, matvec_ref_for, nonzero,
    norm_weight_bytes, pack_f16, padded_input, poisoned, qk_norm_rope_ref, random_quant_in, round_f16,
    to_f32, unpack_f16, POISON,
};

/// One launch: `kernel` over `grid`, `buffers` filling its bindings in
/// order (uniforms included); returns the read_write buffers, in order.
pub type Run<'a> = &'a dyn Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>>;

pub fn u32s(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn to_u32(b: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(b)
}

/// The GPU-resident step state.
pub fn step(pos: usize, fill_end: usize) -> Vec<u8> {
    bytes_of(&Step { pos: pos as u32, fill_end: fill_end as u32 }).to_vec()
}

/// `argmax_partial`'s uniform: `n` logits, `chunk` per workgroup.
pub fn argmax_partial_params(n: u32, chunk: u32) -> Vec<u8> {
    bytes_of(&ArgmaxPartialParams { n, chunk }).to_vec()
}

/// `argmax_final`'s uniform: `n` parts, `n_tokens` tokens.
pub fn argmax_final_params(n: u32, n_tokens: u32) -> Vec<u8> {
    bytes_of(&ArgmaxFinalParams { n, n_tokens }).to_vec()
}

/// `attention_reduce`'s uniform.
pub fn reduce_params(head_dim: usize, n_chunks: usize, out_stride: usize) -> Vec<u8> {
    let p =
        ReduceParams { head_dim: head_dim as u32, n_chunks: n_chunks as u32, out_stride: out_stride as u32 };
    bytes_of(&p).to_vec()
}

/// The awkward shapes every backend's qk_norm_rope test runs: (heads, kv
/// heads, head_dim, capacity, first position, tokens).
pub const QK_NORM_ROPE_SHAPES: [(usize, usize, usize, usize, usize, usize); 8] = [
    (4, 2, 64, 8, 5, 1),
    (2, 1, MAX_HEAD_DIM, 6, 3, 2), // the largest head_dim: several passes of the workgroup
    (3, 1, 200, 8, 1, 2),
    (16, 8, 128, 40, 37, 3), // a batch: positions 37, 38, 39
    (3, 1, 32, 4, 0, 1),
    (8, 8, 128, 3000, 2999, 1),
    (2, 1, 64, 4, 4, 1), // a step queued past the capacity writes nothing
    (2, 1, 64, 4, 2, 3), // a batch whose last token lies past the capacity
];

/// The awkward shapes every backend's prompt-batch attention test runs:
/// (heads, kv heads, head_dim, capacity, context of the first token, tokens).
pub const ATTENTION_SHAPES: [(usize, usize, usize, usize, usize, usize); 12] = [
    (4, 2, 64, 16, 1, 1),
    (4, 1, 64, 300, 300, 1),
    (16, 8, 128, 64, 33, 1),
    (3, 3, 32, 600, 517, 1),
    (2, 1, 128, 1100, 1025, 1),
    (8, 4, 64, 333, 290, 1),
    (2, 1, 40, 300, 257, 1), // an odd number of 8-value K loads per row
    (3, 1, 8, 20, 13, 1),
    (4, 2, 64, 1100, 100, 1), // four chunks past the context (their acc stays poisoned)
    (4, 2, 64, 600, 250, 9),  // a causal batch: contexts 250..258, across a chunk edge
    (2, 2, 32, 16, 1, 5),     // a batch from the first position
    (2, 1, 200, 300, 270, 1), // 25 K quads a row: three or four per score lane
];

/// The awkward shapes every backend's decode-step attention test runs:
/// (heads, kv heads, head_dim, capacity, position), for the direct variant
/// (one chunk) and the chunked one.
pub const ATTENTION_STEP_DIRECT_SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (4, 2, 64, 16, 0),
    (2, 1, MAX_HEAD_DIM, 200, 150), // the largest head_dim: 4 K quads per score lane
    (16, 8, 128, 300, ATTENTION_CHUNK as usize - 1), // the last position one chunk holds
    (3, 1, 40, 20, 13),
    (2, 2, 32, 256, 100),
];
/// qk_norm_rope over an int8 KV cache: (heads, kv heads, head_dim,
/// capacity, first position, tokens), head_dim a multiple of 4 (40 among
/// them) up to the largest.
pub const QK_NORM_ROPE_INT8_SHAPES: [(usize, usize, usize, usize, usize, usize); 4] =
    [(4, 2, 64, 16, 3, 5), (2, 2, 128, 40, 0, 3), (3, 3, 40, 9, 7, 2), (2, 1, 256, 4, 1, 2)];

/// attention_partial's prompt variant over an int8 KV cache: (heads, kv
/// heads, head_dim, capacity, context of the first token, tokens),
/// head_dim a multiple of 16.
pub const ATTENTION_INT8_SHAPES: [(usize, usize, usize, usize, usize, usize); 4] =
    [(4, 2, 64, 600, 300, 3), (2, 1, 128, 300, 1, 2), (3, 3, 32, 520, 513, 1), (2, 2, 256, 40, 40, 1)];

/// A decode step's attention shape: (heads, kv heads, head_dim, capacity,
/// position).
pub type StepShape = (usize, usize, usize, usize, usize);

/// The fused decode step over an int8 KV cache: the kernel and its shape,
/// direct and chunked.
pub const ATTENTION_STEP_INT8_SHAPES: [(Kernel, StepShape); 5] = [
    (Kernel::AttentionStepDirect, (4, 2, 64, 16, 0)),
    (Kernel::AttentionStepDirect, (2, 1, 256, 200, 150)),
    (Kernel::AttentionStep, (16, 8, 128, 600, 256)),
    (Kernel::AttentionStep, (4, 1, 64, 300, 299)),
    (Kernel::AttentionStep, (2, 2, 32, 1100, 700)),
];

pub const ATTENTION_STEP_CHUNKED_SHAPES: [(usize, usize, usize, usize, usize); 6] = [
    (2, 1, 200, 600, 400),
    (1, 1, 8, 33_000, 32_999), // 129 chunks: more than attention_reduce's workgroup
    (16, 8, 128, 600, ATTENTION_CHUNK as usize), // the first position of the second chunk
    (4, 2, 64, 1100, 700),
    (2, 1, 40, 300, 299), // the last position of the capacity
    (4, 1, 64, 300, 5),   // chunks past the context
];

/// One token's matvec outputs with the reference's (want, scale).
pub type MatvecOut = (Vec<f32>, Vec<f64>, Vec<f64>);

/// One matvec launch of `kernel` on a random matrix, its grid sized for
/// `rows_per_wg` rows per workgroup, over `tokens` inputs (grid z;
/// `tokens_per_wg` per workgroup, 1 for the decode pipelines; token t's
/// outputs from t * y_stride, with a gap after each): checks that the
/// elements outside the outputs are untouched and returns each token's
/// outputs with the reference's.
#[allow(clippy::too_many_arguments)]
pub fn matvec_case(
    run: Run<'_>,
    kernel: Kernel,
    rows_per_wg: u32,
    tokens_per_wg: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    let weights = Weights::Random(WeightFormat::Int8);
    batch_case(run, kernel, weights, rows_per_wg, tokens_per_wg, rows, cols, tokens, tokens, seed, false)
}

/// [`matvec_case`] for a decode pipeline that keeps the residual's f16
/// copy (`X16`): a normed variant reads x from it, bound at x's slot as the
/// engine binds it (`decode_bindings`; the reference then takes x rounded
/// to f16), a residual add writes it (binding 6), which is checked here
/// against its own outputs.
#[allow(clippy::too_many_arguments)]
pub fn matvec_case_x16(
    run: Run<'_>,
    kernel: Kernel,
    rows_per_wg: u32,
    tokens_per_wg: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    let weights = Weights::Random(WeightFormat::Int8);
    batch_case(run, kernel, weights, rows_per_wg, tokens_per_wg, rows, cols, tokens, tokens, seed, true)
}

/// [`matvec_case`] (or, with `x16`, [`matvec_case_x16`]) over a random
/// matrix of `format`.
#[allow(clippy::too_many_arguments)]
pub fn matvec_case_in(
    run: Run<'_>,
    kernel: Kernel,
    format: WeightFormat,
    x16: bool,
    rows_per_wg: u32,
    tokens_per_wg: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    let weights = Weights::Random(format);
    batch_case(run, kernel, weights, rows_per_wg, tokens_per_wg, rows, cols, tokens, tokens, seed, x16)
}

/// One launch of `kernel`'s tiled prompt-batch product (`int8_matmul`, or
/// its MSL twin) over `tokens` tokens in tiles of `tile_tokens` (grid z;
/// [`kernels::MATMUL_ROWS_PER_WG`] rows per workgroup). The product
/// computes whole tiles, so the buffers hold whole tiles, as the engine's
/// activation buffers do; the spare tokens' inputs are NaN, which must
/// reach no real token's outputs. Checks and returns what [`matvec_case`]
/// does, for the real tokens.
pub fn matmul_case(
    run: Run<'_>,
    kernel: Kernel,
    tile_tokens: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    matmul_case_in(run, kernel, kernels::MATMUL_ROWS_PER_WG, tile_tokens, rows, cols, tokens, seed)
}

/// [`matmul_case`] on tiles of `rows_per_wg` rows.
#[allow(clippy::too_many_arguments)]
pub fn matmul_case_in(
    run: Run<'_>,
    kernel: Kernel,
    rows_per_wg: u32,
    tile_tokens: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    matmul_case_for(run, kernel, WeightFormat::Int8, rows_per_wg, tile_tokens, rows, cols, tokens, seed)
}

/// [`matmul_case_in`] over a random matrix of `format`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_case_for(
    run: Run<'_>,
    kernel: Kernel,
    format: WeightFormat,
    rows_per_wg: u32,
    tile_tokens: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    let weights = Weights::Random(format);
    matmul_case_over(run, kernel, weights, rows_per_wg, tile_tokens, rows, cols, tokens, seed)
}

/// [`matmul_case_in`] over `weights`, the buffers holding whole tiles.
#[allow(clippy::too_many_arguments)]
fn matmul_case_over(
    run: Run<'_>,
    kernel: Kernel,
    weights: Weights,
    rows_per_wg: u32,
    tile_tokens: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    let buffered = tokens.div_ceil(tile_tokens) * tile_tokens;
    batch_case(run, kernel, weights, rows_per_wg, tile_tokens, rows, cols, tokens, buffered, seed, false)
}

/// [`matmul_case`] over int8 weights exact in half precision
/// ([`Weights::HalfExact`]): for products that round their weights to half
/// (the MSL twin's), compared at f32 tolerance.
pub fn matmul_case_half_exact(
    run: Run<'_>,
    kernel: Kernel,
    tile_tokens: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    seed: u64,
) -> Vec<MatvecOut> {
    let rows_per_wg = kernels::MATMUL_ROWS_PER_WG;
    matmul_case_over(run, kernel, Weights::HalfExact, rows_per_wg, tile_tokens, rows, cols, tokens, seed)
}

/// The random weights of a case.
#[derive(Clone, Copy)]
enum Weights {
    /// Non-zero values of the format with scales of full precision.
    Random(WeightFormat),
    /// int8 values with scales of 4 significant bits: every weight (at most
    /// 7 bits times its scale) exact in half precision.
    HalfExact,
}

impl Weights {
    fn format(self) -> WeightFormat {
        match self {
            Weights::Random(format) => format,
            Weights::HalfExact => WeightFormat::Int8,
        }
    }

    fn quant(self, rng: &mut StdRng, rows: usize, cols: usize) -> qwen3_wgpu::internals::reference::Quant {
        let mut m = random_quant_in(rng, self.format(), rows, cols);
        if let Weights::HalfExact = self {
            // Sign, exponent and the top 3 stored mantissa bits.
            m.scales.iter_mut().for_each(|s| *s = f32::from_bits(s.to_bits() & 0xfff0_0000));
        }
        m
    }
}

/// [`matvec_case`] with buffers for `buffered` tokens, the last
/// `buffered - tokens` of them spare (NaN inputs, outputs not checked).
#[allow(clippy::too_many_arguments)]
fn batch_case(
    run: Run<'_>,
    kernel: Kernel,
    weights: Weights,
    rows_per_wg: u32,
    tokens_per_wg: usize,
    rows: usize,
    cols: usize,
    tokens: usize,
    buffered: usize,
    seed: u64,
    x16: bool,
) -> Vec<MatvecOut> {
    let variant = kernel.matvec_variant().unwrap();
    let format = weights.format();
    let mut rng = StdRng::seed_from_u64(seed);
    let m = weights.quant(&mut rng, rows, cols);
    let xs: Vec<Vec<f32>> = (0..tokens).map(|_| padded_input(&mut rng, cols)).collect();
    let spare = vec![f32::NAN; (buffered - tokens) * m.padded];
    let norm_w = padded_input(&mut rng, cols);
    let eps = 1e-6f32;
    // SWIGLU writes one output per row pair, from (row_offset / 2).
    // (X16: the residual add writes its f16 copy in blocks of 4 rows from
    // a multiple of 4, each token's from a multiple of 4.)
    let row_offset = if variant.swiglu || x16 { 4usize } else { 3 };
    let first_out = if variant.swiglu { row_offset / 2 } else { row_offset };
    let outs = if variant.swiglu { rows / 2 } else { rows };
    // Token z's outputs start at z * y_stride (a gap after each).
    let y_stride = (first_out + outs + 5).next_multiple_of(if x16 { 4 } else { 1 });
    let y0 = nonzero(&mut rng, buffered * y_stride);
    let init = if variant.accumulate { f32s(&y0) } else { poisoned(buffered * y_stride) };
    let params = MatvecParams {
        rows: rows as u32,
        k_words: m.k_words() as u32,
        groups: m.groups() as u32,
        row_offset: row_offset as u32,
        n_in: cols as u32,
        eps,
        y_stride: y_stride as u32,
    };
    let mut grid = kernels::matvec::grid(rows as u32, rows_per_wg);
    grid[2] = buffered.div_ceil(tokens_per_wg) as u32;
    let x = [xs.concat(), spare].concat();
    // The residual's f16 copy: x's for a normed variant, else poisoned.
    let x16_init =
        if x16 && variant.norm { u32s(&pack_f16(&x)) } else { poisoned((buffered * y_stride).div_ceil(2)) };
    let bindings = [
        bytes_of(&params).to_vec(),
        f32s(&x),
        m.data(),
        m.scale_blob(),
        init,
        norm_weight_bytes(&norm_w),
        x16_init.clone(),
    ];
    // A normed X16 pipeline takes the copy at x's slot, the f32 x at 6.
    let swapped = kernels::decode_bindings(variant, x16, bindings.clone());
    let out = run(kernel, grid, swapped.as_ref().unwrap_or(&bindings));
    if swapped.is_some() {
        assert_eq!(out[1], f32s(&x), "{kernel:?}: wrote slot 6 (the f32 x, unread)");
    }
    let got = to_f32(&out[0]);
    if x16 && variant.accumulate {
        // Each token's outputs as f16 at its word z * y_stride / 2 + row,
        // the words outside them untouched.
        let halves = unpack_f16(&out[1]);
        let (words, init16) = (to_u32(&out[1]), to_u32(&x16_init));
        for (i, h) in halves.iter().enumerate() {
            let (z, r) = (i / y_stride, i % y_stride);
            if z >= tokens || !(row_offset..row_offset + rows.next_multiple_of(4)).contains(&r) {
                assert_eq!(words[i / 2], init16[i / 2], "{kernel:?}: x16 written outside the outputs at {i}");
            } else {
                let want = if r < row_offset + rows { got[i] } else { 0.0 };
                assert!((h - want).abs() <= want.abs() / 1024.0 + 1e-7, "{kernel:?}: x16[{i}] {h}, y {want}");
            }
        }
    }
    // X16 pipelines read the norm weights' f16 copy too.
    let norm_w: Vec<f32> = if x16 { round_f16(&norm_w) } else { norm_w };
    let xs: Vec<Vec<f32>> = if x16 && variant.norm { xs.iter().map(|x| round_f16(x)).collect() } else { xs };
    let mut res = Vec::new();
    for (z, x) in xs.iter().enumerate() {
        let row = &got[z * y_stride..(z + 1) * y_stride];
        let row0 = &y0[z * y_stride..(z + 1) * y_stride];
        // Elements outside the outputs are untouched.
        for i in (0..first_out).chain(first_out + outs..y_stride) {
            if variant.accumulate {
                assert_eq!(row[i], row0[i], "{kernel:?} token {z}: wrote outside the outputs at {i}");
            } else {
                assert_eq!(
                    row[i].to_bits(),
                    POISON,
                    "{kernel:?} token {z}: wrote outside the outputs at {i}"
                );
            }
        }
        let norm = variant.norm.then_some((&norm_w[..], eps));
        let acc = variant.accumulate.then_some(&row0[first_out..]);
        let int_dot = kernels::matvec::int_dot(format, variant, x16);
        let (want, scale) = matvec_ref_for(int_dot, &m, x, norm, acc, variant.swiglu);
        res.push((row[first_out..first_out + outs].to_vec(), want, scale));
    }
    res
}

/// Compares each token's outputs of a [`matvec_case`].
pub fn assert_matvec(what: &str, res: &[MatvecOut]) {
    for (z, (got, want, scale)) in res.iter().enumerate() {
        assert_close(&format!("{what} token {z}/{}", res.len()), got, want, scale, 1e-5);
    }
}

/// argmax_partial's per-chunk winners, then argmax_final's token and step,
/// for `n` random logits (with `ties`: the maximum at several places, in
/// different chunks when n is large, and within one chunk and simdgroup).
pub fn argmax_case(run: Run<'_>, n: usize, chunk: u32, ties: bool, rng: &mut StdRng) {
    let mut v = nonzero(rng, n);
    if ties && n > 3 {
        for i in [n - 1, n / 2, n / 3 + 1, n / 2 + 1, n / 2 + 33] {
            if i < n {
                v[i] = 5.0;
            }
        }
    }
    let want = argmax_ref(&v);
    let parts = kernels::argmax::parts(n as u32, chunk);
    let out = run(
        Kernel::ArgmaxPartial,
        kernels::grid(parts),
        &[
            argmax_partial_params(n as u32, chunk),
            f32s(&v),
            poisoned(parts as usize),
            poisoned(parts as usize),
        ],
    );
    let (val, idx) = (to_f32(&out[0]), to_u32(&out[1]));
    for c in 0..parts as usize {
        let lo = c * chunk as usize;
        let w = lo + argmax_ref(&v[lo..n.min(lo + chunk as usize)]);
        assert_eq!(idx[c] as usize, w, "argmax_partial n={n} chunk {c} ties={ties}");
        assert_eq!(val[c], v[w], "argmax_partial value n={n} chunk {c}");
    }
    // Position 3 of a 6-token sequence: the token goes to tokens[4] unless
    // position 4 still holds a prompt token.
    for (fill_end, writes) in [(4, true), (5, false)] {
        let f = run(
            Kernel::ArgmaxFinal,
            kernels::argmax::FINAL_GRID,
            &[argmax_final_params(parts, 6), out[0].clone(), out[1].clone(), poisoned(6), step(3, fill_end)],
        );
        assert_eq!(to_u32(&f[1]), [4, fill_end as u32], "position advances");
        for (i, t) in to_u32(&f[0]).iter().enumerate() {
            if i == 4 && writes {
                assert_eq!(*t as usize, want, "argmax n={n} ties={ties}");
            } else {
                assert_eq!(*t, POISON, "tokens[{i}] written (fill_end {fill_end})");
            }
        }
    }
}

/// qk_norm_rope on `tokens` random qkv rows (a padded stride apart) at
/// positions `pos`, `pos + 1`, ... (a token at or past the capacity: a step
/// queued past it writes nothing). Shape: (heads, kv heads, head_dim,
/// Rows of an int8 KV cache ([`qk_norm_rope_case_int8`]'s layout, the
/// kernel's `KV_INT8`): `rows` rows of `hd` int8 values (four a word), then
/// one f32 scale per row; each value dequantised (value / 127 * scale).
pub fn unpack_kv_int8(words: &[u8], nkv: usize, cap: usize, hd: usize) -> Vec<f32> {
    let scales = kv_int8_scales(words, nkv, cap, hd);
    words[..nkv * cap * hd]
        .iter()
        .enumerate()
        .map(|(i, &b)| (b as i8) as f32 / 127.0 * scales[i / hd])
        .collect()
}

/// The row scales of an int8 KV cache, row `kv_head * cap + pos`: they
/// start at a multiple of 4 words after the rows, each head's padded to a
/// multiple of 4 (the kernels' `kv_scale_at`).
pub fn kv_int8_scales(words: &[u8], nkv: usize, cap: usize, hd: usize) -> Vec<f32> {
    let base = (nkv * cap * hd / 4).next_multiple_of(4);
    let all = to_f32(&words[4 * base..]);
    let stride = cap.next_multiple_of(4);
    (0..nkv * cap).map(|r| all[(r / cap) * stride + r % cap]).collect()
}

/// Bytes of an int8 KV cache of `nkv` heads, `cap` positions.
pub fn kv_int8_bytes(nkv: usize, cap: usize, hd: usize) -> usize {
    4 * ((nkv * cap * hd / 4).next_multiple_of(4) + nkv * cap.next_multiple_of(4))
}

/// qk_norm_rope writing an int8 KV cache (`KV_INT8`): q as in
/// [`qk_norm_rope_case`]; each K and V row within half a quantisation step
/// (its largest magnitude / 127 / 2, plus the f32 rounding of its values) of
/// the reference, its scale that largest magnitude, and nothing written
/// outside the rows and scales of the batch's positions. `run` must build
/// the kernel with `KV_INT8` on. Shape as [`qk_norm_rope_case`]'s.
pub fn qk_norm_rope_case_int8(
    run: Run<'_>,
    shape: (usize, usize, usize, usize, usize, usize),
    rng: &mut StdRng,
) {
    let (nh, nkv, hd, cap, pos, tokens) = shape;
    let theta = 1_000_000f32;
    let eps = 1e-6f32;
    let rows = (nh + 2 * nkv) * hd;
    let qkv_stride = rows + 8;
    let mut qkv = nonzero(rng, tokens * qkv_stride);
    // One v head of zeros at the first token: its row is zeros, scale 0.
    if tokens > 0 && nkv > 1 {
        qkv[(nh + nkv + 1) * hd..(nh + nkv + 2) * hd].fill(0.0);
    }
    let qn = nonzero(rng, hd);
    let kn = nonzero(rng, hd);
    let params = HeadParams {
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        capacity: cap as u32,
        eps,
        qkv_stride: qkv_stride as u32,
        scale: 1.0 / (hd as f32).sqrt(),
        pack: 1,
        pack_from: u32::MAX,
    };
    let rope = qwen3_wgpu::internals::qwen3::rope_table(hd, cap, theta);
    let cache_bytes = kv_int8_bytes(nkv, cap, hd);
    let mut grid = kernels::norm_rope::grid(nh as u32, nkv as u32);
    grid[2] = tokens as u32;
    let out = run(
        Kernel::QkNormRope,
        grid,
        &[
            bytes_of(&params).to_vec(),
            step(pos, 0),
            f32s(&qkv),
            f32s(&[qn.clone(), kn.clone()].concat()),
            f32s(&rope),
            poisoned(tokens * nh * hd),
            poisoned(cache_bytes / 4),
            poisoned(cache_bytes / 4),
        ],
    );
    let q = to_f32(&out[0]);
    let (th, ep) = (theta as f64, eps as f64);
    let written = |row: usize| row % cap >= pos && row % cap < pos + tokens;
    for (cache, name) in [(&out[1], "k"), (&out[2], "v")] {
        let vals = unpack_kv_int8(cache, nkv, cap, hd);
        let scales = kv_int8_scales(cache, nkv, cap, hd);
        for row in 0..nkv * cap {
            let (g, at_pos) = (row / cap, row % cap);
            let word_rows = &cache[row * hd..(row + 1) * hd];
            if !written(row) || at_pos >= cap {
                assert!(
                    word_rows.chunks(4).all(|w| u32::from_le_bytes(w.try_into().unwrap()) == POISON),
                    "{name} row {row} written"
                );
                assert_eq!(scales[row].to_bits(), POISON, "{name} scale {row} written");
                continue;
            }
            let z = at_pos - pos;
            let head = &qkv[z * qkv_stride..];
            let want = if name == "k" {
                qk_norm_rope_ref(&head[(nh + g) * hd..(nh + g + 1) * hd], Some(&kn), at_pos, th, ep)
            } else {
                qk_norm_rope_ref(&head[(nh + nkv + g) * hd..(nh + nkv + g + 1) * hd], None, at_pos, th, ep)
            };
            let absmax = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let what = format!("{name} row of kv head {g} at {at_pos} (hd {hd})");
            assert_close(&format!("{what}: scale"), &scales[row..row + 1], &[absmax], &[absmax], 1e-3);
            let step = vec![absmax / 127.0; hd];
            assert_close(&what, &vals[row * hd..(row + 1) * hd], &want, &step, 0.5 + 2e-2);
        }
    }
    for z in 0..tokens {
        let head = |h: usize| &qkv[z * qkv_stride + h * hd..z * qkv_stride + (h + 1) * hd];
        for h in 0..nh {
            let want = qk_norm_rope_ref(head(h), Some(&qn), pos + z, th, ep);
            let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
            assert_close(
                &format!("q head {h} token {z}"),
                &q[(z * nh + h) * hd..(z * nh + h + 1) * hd],
                &want,
                &scale,
                2e-4,
            );
        }
    }
}

/// capacity, first position, tokens).
pub fn qk_norm_rope_case(run: Run<'_>, shape: (usize, usize, usize, usize, usize, usize), rng: &mut StdRng) {
    let (nh, nkv, hd, cap, pos, tokens) = shape;
    let theta = 1_000_000f32;
    let eps = 1e-6f32;
    let rows = (nh + 2 * nkv) * hd;
    let qkv_stride = rows + 8; // padded rows, as the engine's
    let qkv = nonzero(rng, tokens * qkv_stride);
    let qn = nonzero(rng, hd);
    let kn = nonzero(rng, hd);
    let params = HeadParams {
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        capacity: cap as u32,
        eps,
        qkv_stride: qkv_stride as u32,
        scale: 1.0 / (hd as f32).sqrt(),
        pack: 1,
        pack_from: u32::MAX,
    };
    let rope = qwen3_wgpu::internals::qwen3::rope_table(hd, cap, theta);
    let cache_words = nkv * cap * hd / 2;
    let mut grid = kernels::norm_rope::grid(nh as u32, nkv as u32);
    grid[2] = tokens as u32;
    let out = run(
        Kernel::QkNormRope,
        grid,
        &[
            bytes_of(&params).to_vec(),
            step(pos, 0),
            f32s(&qkv),
            f32s(&[qn.clone(), kn.clone()].concat()),
            f32s(&rope),
            poisoned(tokens * nh * hd),
            poisoned(cache_words),
            poisoned(cache_words),
        ],
    );
    let q = to_f32(&out[0]);
    let kc = unpack_f16(&out[1]);
    let vc = unpack_f16(&out[2]);
    let (th, ep) = (theta as f64, eps as f64);
    for z in 0..tokens {
        let at_pos = pos + z;
        let q_row = &q[z * nh * hd..(z + 1) * nh * hd];
        if at_pos >= cap {
            assert!(q_row.iter().all(|v| v.to_bits() == POISON), "token {z} past the capacity wrote q");
            continue;
        }
        let head = |h: usize| &qkv[z * qkv_stride + h * hd..z * qkv_stride + (h + 1) * hd];
        for h in 0..nh {
            let want = qk_norm_rope_ref(head(h), Some(&qn), at_pos, th, ep);
            let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
            let got = &q_row[h * hd..(h + 1) * hd];
            assert_close(&format!("q head {h} hd {hd} token {z}/{tokens}"), got, &want, &scale, 2e-4);
        }
        for g in 0..nkv {
            let want = qk_norm_rope_ref(head(nh + g), Some(&kn), at_pos, th, ep);
            let at = (g * cap + at_pos) * hd;
            let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
            assert_close(&format!("k head {g} token {z}"), &kc[at..at + hd], &want, &scale, 2e-3);
            let vwant = qk_norm_rope_ref(head(nh + nkv + g), None, at_pos, th, ep);
            assert_close(&format!("v head {g} token {z}"), &vc[at..at + hd], &vwant, &vec![1.0; hd], 1e-3);
        }
    }
    // Only the batch's positions of the caches are written.
    for (c, cache) in out[1..].iter().enumerate() {
        let words = to_u32(cache);
        for g in 0..nkv {
            for t in (0..cap).filter(|t| !(pos..pos + tokens).contains(t)) {
                let row = &words[(g * cap + t) * hd / 2..(g * cap + t + 1) * hd / 2];
                assert!(row.iter().all(|w| *w == POISON), "cache {c} written at position {t}");
            }
        }
    }
}

/// The attention uniform: (heads, kv heads, head_dim, capacity, eps, qkv
/// stride, scale), as the host's, packing two heads a workgroup at every
/// position where the GQA group allows (on pipelines built `PACKED`; the
/// others never pack).
fn head_params(nh: usize, nkv: usize, hd: usize, cap: usize) -> (Vec<u8>, f32) {
    let scale = 1.0 / (hd as f32).sqrt();
    let qkv_stride = (nh + 2 * nkv) * hd + 8;
    let eps = 1e-6f32;
    let p = HeadParams {
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        capacity: cap as u32,
        eps,
        qkv_stride: qkv_stride as u32,
        scale,
        pack: kernels::attention::heads_per_workgroup(nh, nkv),
        pack_from: 0,
    };
    (bytes_of(&p).to_vec(), scale)
}

/// The attention uniform for heads, KV heads, head_dim and capacity `shape`,
/// qkv rows `qkv_stride` apart, packing two heads a workgroup from
/// `pack_from` on (on pipelines built `PACKED`).
pub fn attention_params(
    shape: (usize, usize, usize, usize),
    qkv_stride: usize,
    pack_from: u32,
) -> HeadParams {
    let (nh, nkv, hd, cap) = shape;
    HeadParams {
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        capacity: cap as u32,
        eps: 1e-6,
        qkv_stride: qkv_stride as u32,
        scale: 1.0 / (hd as f32).sqrt(),
        pack: 2,
        pack_from,
    }
}

/// attention_reduce over `chunks` chunks of `parts` (part_ml, part_acc),
/// for `tokens` tokens, rows `out_stride` apart: the output buffer.
fn reduce(
    run: Run<'_>,
    parts: &[Vec<u8>],
    nh: usize,
    hd: usize,
    chunks: usize,
    tokens: usize,
    out_stride: usize,
) -> Vec<f32> {
    let out = run(
        Kernel::AttentionReduce,
        [nh as u32, 1, tokens as u32],
        &[
            reduce_params(hd, chunks, out_stride),
            parts[0].clone(),
            parts[1].clone(),
            poisoned(tokens * out_stride),
        ],
    );
    to_f32(&out[0])
}

/// attention_reduce alone on chunk results built to test its combining:
/// each chunk's max grows with its index (a later chunk of a slice always
/// rescales what came before), and the chunks past the context hold
/// (-3e38, 0) and NaN sums (never written: they must weigh nothing).
/// Shape: (heads, head_dim, chunks, of which past the context, tokens).
pub fn attention_reduce_case(run: Run<'_>, shape: (usize, usize, usize, usize, usize), rng: &mut StdRng) {
    let (nh, hd, chunks, empty, tokens) = shape;
    let parts = tokens * nh * chunks;
    let mut ml = Vec::with_capacity(2 * parts);
    let acc = nonzero(rng, parts * hd);
    let mut acc = acc;
    let sums = nonzero(rng, parts);
    for part in 0..parts {
        let c = part % chunks;
        if c >= chunks - empty {
            ml.extend([-3.0e38, 0.0]);
            acc[part * hd..(part + 1) * hd].fill(f32::NAN);
        } else {
            // Maxima rising by 0.05 a chunk (e^-6 across 120 chunks), sums in (0.5, 1.5).
            ml.extend([0.05 * c as f32 + sums[part] * 0.01, 1.0 + 0.5 * sums[part]]);
        }
    }
    let out_stride = nh * hd + 3;
    let got = reduce(run, &[f32s(&ml), f32s(&acc)], nh, hd, chunks, tokens, out_stride);
    for z in 0..tokens {
        for h in 0..nh {
            let base = (z * nh + h) * chunks;
            let live = 0..chunks - empty;
            let big_m = live.clone().map(|c| ml[2 * (base + c)] as f64).fold(f64::MIN, f64::max);
            let w = |c: usize| (ml[2 * (base + c)] as f64 - big_m).exp();
            let big_l: f64 = live.clone().map(|c| ml[2 * (base + c) + 1] as f64 * w(c)).sum();
            let want: Vec<f64> = (0..hd)
                .map(|d| live.clone().map(|c| acc[(base + c) * hd + d] as f64 * w(c)).sum::<f64>() / big_l)
                .collect();
            let at = z * out_stride + h * hd;
            let what = format!("attention_reduce {chunks} chunks ({empty} empty) hd {hd} head {h} token {z}");
            assert_close(&what, &got[at..at + hd], &want, &vec![1.0; hd], 1e-5);
        }
        let row = &got[z * out_stride..(z + 1) * out_stride];
        assert!(row[nh * hd..].iter().all(|v| v.to_bits() == POISON), "attention_reduce wrote past row {z}");
    }
}

/// The shapes of [`attention_reduce_case`]: more chunks than one pass of
/// eight loads per slice covers at head_dim 128 (64), a head_dim whose
/// quads do not divide the workgroup, one chunk.
pub const ATTENTION_REDUCE_SHAPES: [(usize, usize, usize, usize, usize); 4] =
    [(2, 128, 150, 7, 2), (3, 40, 70, 1, 1), (1, 256, 300, 44, 1), (2, 64, 1, 0, 3)];

/// attention_partial (the prompt-batch variant: q from the q buffer) then
/// attention_reduce on random q and caches, with the grid sized for the
/// capacity as the engine does (chunks past the context contribute
/// nothing), for `tokens` queries (grid z) whose contexts are seq, seq + 1,
/// ... (causal), and reduce's out_stride leaving a poisoned gap after each
/// token's row. Shape: (heads, kv heads, head_dim, capacity, context of the
/// first token, tokens).
pub fn attention_case(run: Run<'_>, shape: (usize, usize, usize, usize, usize, usize), rng: &mut StdRng) {
    attention_case_rows(run, shape, 1, Sums::F32, rng)
}

/// How an attention program sums, as its cases check it.
#[derive(Debug, Clone, Copy)]
pub struct Sums {
    /// q is rounded to f16 (the case's q is exact in f16, as the reference
    /// reads it).
    pub q_in_f16: bool,
    /// Of each output, absolute.
    pub tolerance: f64,
}

impl Sums {
    /// f32 throughout.
    pub const F32: Sums = Sums { q_in_f16: false, tolerance: 1e-4 };
    /// attention_prefill's tile program: q and the weights as f16 (the
    /// weights' rounding, 2^-12 of each, within 5e-4).
    pub const F16_TILES: Sums = Sums { q_in_f16: true, tolerance: 5e-4 };
}

/// [`attention_case`] with the q and partial-result buffers holding the
/// tokens rounded up to `rows_multiple` (as the engine's batch buffers do,
/// for kernels that serve several tokens per workgroup), for a program
/// that sums as `sums` says.
pub fn attention_case_rows(
    run: Run<'_>,
    shape: (usize, usize, usize, usize, usize, usize),
    rows_multiple: usize,
    sums: Sums,
    rng: &mut StdRng,
) {
    let (nh, nkv, hd, cap, seq, tokens) = shape;
    let rows = tokens.next_multiple_of(rows_multiple);
    let mut q = nonzero(rng, rows * nh * hd);
    if sums.q_in_f16 {
        q.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
    }
    let kv_len = nkv * cap * hd;
    let k: Vec<f16> = nonzero(rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
    let v: Vec<f16> = nonzero(rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
    let (params, scale) = head_params(nh, nkv, hd, cap);
    let out_stride = nh * hd + 3; // padded rows, as the engine's
    let chunks = cap.div_ceil(ATTENTION_CHUNK as usize);
    let unused = f32s(&[1.0; 4]);
    let out = run(
        Kernel::AttentionPartial,
        [nh as u32, chunks as u32, tokens as u32],
        &[
            params,
            step(seq - 1, 0),
            f32s(&q),
            bytemuck::cast_slice(&k).to_vec(),
            bytemuck::cast_slice(&v).to_vec(),
            poisoned(rows * 2 * nh * chunks),
            poisoned(rows * nh * chunks * hd),
            unused.clone(),
            unused,
        ],
    );
    // The caches are only read.
    assert_eq!(out[0], bytemuck::cast_slice::<f16, u8>(&k), "k_cache written");
    assert_eq!(out[1], bytemuck::cast_slice::<f16, u8>(&v), "v_cache written");
    let got = reduce(run, &out[2..4], nh, hd, chunks, tokens, out_stride);
    for z in 0..tokens {
        let qz = &q[z * nh * hd..(z + 1) * nh * hd];
        let want = attention_ref(qz, &k, &v, nh, nkv, hd, cap, seq + z, scale as f64);
        let row = &got[z * out_stride..(z + 1) * out_stride];
        let what = format!("attention seq {} hd {hd} token {z}/{tokens}", seq + z);
        assert_close(&what, &row[..nh * hd], &want, &vec![1.0; nh * hd], sums.tolerance);
        assert!(row[nh * hd..].iter().all(|v| v.to_bits() == POISON), "{what}: wrote past the row");
    }
}

/// A decode step's attention with the q/k norm, RoPE and cache write
/// folded in: `Kernel::AttentionStepDirect` (one chunk, output written
/// directly) or `Kernel::AttentionStep` (chunks over the capacity, then
/// attention_reduce), on a random qkv row at position `pos` over random
/// caches. Checks the new cache row against the references, every other
/// cache row untouched, and the output against the reference attention
/// of the normed, rotated q over the caches as written. Shape: (heads, kv
/// heads, head_dim, capacity, position).
pub fn attention_step_case(
    run: Run<'_>,
    kernel: Kernel,
    shape: (usize, usize, usize, usize, usize),
    rng: &mut StdRng,
) {
    let (nh, nkv, hd, cap, pos) = shape;
    let (fused, direct) = kernel.attention_variant().expect("an attention_partial variant");
    assert!(fused);
    let theta = 1_000_000f32;
    let (params, scale) = head_params(nh, nkv, hd, cap);
    let eps = 1e-6f64;
    let qkv = nonzero(rng, (nh + 2 * nkv) * hd + 8);
    let (qn, kn) = (nonzero(rng, hd), nonzero(rng, hd));
    let rope = qwen3_wgpu::internals::qwen3::rope_table(hd, cap, theta);
    let kv_len = nkv * cap * hd;
    let k: Vec<f16> = nonzero(rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
    let v: Vec<f16> = nonzero(rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
    let chunks = if direct { 1 } else { cap.div_ceil(ATTENTION_CHUNK as usize) };
    let out = run(
        kernel,
        kernels::attention::partial_grid(nh as u32, chunks as u32),
        &[
            params,
            step(pos, 0),
            f32s(&qkv),
            bytemuck::cast_slice(&k).to_vec(),
            bytemuck::cast_slice(&v).to_vec(),
            poisoned(2 * nh * chunks),
            // DIRECT: the output (with a gap that must stay poisoned).
            if direct { poisoned(nh * hd + 3) } else { poisoned(nh * chunks * hd) },
            f32s(&[qn.clone(), kn.clone()].concat()),
            f32s(&rope),
        ],
    );
    let (kc, vc) = (unpack_f16(&out[0]), unpack_f16(&out[1]));
    let head = |h: usize| &qkv[h * hd..(h + 1) * hd];
    let what = format!("{kernel:?} pos {pos} hd {hd}");
    for g in 0..nkv {
        for t in 0..cap {
            let at = (g * cap + t) * hd;
            if t == pos {
                let want = qk_norm_rope_ref(head(nh + g), Some(&kn), pos, theta as f64, eps);
                let sc: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
                assert_close(&format!("{what}: k head {g}"), &kc[at..at + hd], &want, &sc, 2e-3);
                let want = qk_norm_rope_ref(head(nh + nkv + g), None, pos, theta as f64, eps);
                assert_close(&format!("{what}: v head {g}"), &vc[at..at + hd], &want, &vec![1.0; hd], 1e-3);
            } else {
                let same = |c: &[f32], x: &[f16]| {
                    c[at..at + hd].iter().zip(&x[at..at + hd]).all(|(a, b)| *a == b.to_f32())
                };
                assert!(same(&kc, &k) && same(&vc, &v), "{what}: cache row {t} of kv head {g} changed");
            }
        }
    }
    let got = if direct {
        assert!(to_u32(&out[2]).iter().all(|w| *w == POISON), "{what}: (m, l) written");
        to_f32(&out[3])
    } else {
        reduce(run, &out[2..4], nh, hd, chunks, 1, nh * hd + 3)
    };
    // The reference attention: q normed and rotated in f64, the caches as
    // the kernel wrote them.
    let q: Vec<f32> = (0..nh)
        .flat_map(|h| qk_norm_rope_ref(head(h), Some(&qn), pos, theta as f64, eps))
        .map(|x| x as f32)
        .collect();
    let (k16, v16): (Vec<f16>, Vec<f16>) =
        (kc.iter().map(|x| f16::from_f32(*x)).collect(), vc.iter().map(|x| f16::from_f32(*x)).collect());
    let want = attention_ref(&q, &k16, &v16, nh, nkv, hd, cap, pos + 1, scale as f64);
    assert_close(&what, &got[..nh * hd], &want, &vec![1.0; nh * hd], 2e-4);
    assert!(got[nh * hd..].iter().all(|v| v.to_bits() == POISON), "{what}: wrote past the output");
}

/// An int8 KV cache of `rows` (`[kv_head][cap][hd]`), as the kernels
/// write one: each row as pack4x8snorm(value / its largest magnitude) and
/// that magnitude as its scale ([`kv_int8_bytes`]'s layout); with the
/// values it stands for.
pub fn kv_int8_quantize(rows: &[f32], nkv: usize, cap: usize, hd: usize) -> (Vec<u8>, Vec<f64>) {
    qwen3_wgpu::internals::reference::kv_int8_encode(rows, nkv, cap, hd)
}

/// attention_partial (the prompt variant) then attention_reduce over an
/// int8 KV cache: as [`attention_case`], against the reference over the
/// values the cache stands for; the cache is only read. `run` must build
/// attention_partial with `KV_INT8` on. Shape as [`attention_case`]'s
/// (head_dim a multiple of 16); q and the partial results hold the tokens
/// rounded up to `rows_multiple` (as [`attention_case_rows`]).
pub fn attention_case_int8(
    run: Run<'_>,
    shape: (usize, usize, usize, usize, usize, usize),
    rows_multiple: usize,
    rng: &mut StdRng,
) {
    let (nh, nkv, hd, cap, seq, tokens) = shape;
    let rows = tokens.next_multiple_of(rows_multiple);
    let q = nonzero(rng, rows * nh * hd);
    let (k, kv) = kv_int8_quantize(&nonzero(rng, nkv * cap * hd), nkv, cap, hd);
    let (v, vv) = kv_int8_quantize(&nonzero(rng, nkv * cap * hd), nkv, cap, hd);
    let (params, scale) = head_params(nh, nkv, hd, cap);
    let out_stride = nh * hd + 3;
    let chunks = cap.div_ceil(ATTENTION_CHUNK as usize);
    let unused = f32s(&[1.0; 4]);
    let out = run(
        Kernel::AttentionPartial,
        [nh as u32, chunks as u32, tokens as u32],
        &[
            params,
            step(seq - 1, 0),
            f32s(&q),
            k.clone(),
            v.clone(),
            poisoned(rows * 2 * nh * chunks),
            poisoned(rows * nh * chunks * hd),
            unused.clone(),
            unused,
        ],
    );
    assert!(out[0] == k && out[1] == v, "an int8 cache written");
    let got = reduce(run, &out[2..4], nh, hd, chunks, tokens, out_stride);
    for z in 0..tokens {
        let want = attention_ref_values(
            &q[z * nh * hd..(z + 1) * nh * hd],
            &kv,
            &vv,
            nh,
            nkv,
            hd,
            cap,
            seq + z,
            scale as f64,
        );
        let what = format!("int8 KV attention seq {} hd {hd} token {z}/{tokens}", seq + z);
        assert_close(&what, &got[z * out_stride..z * out_stride + nh * hd], &want, &vec![1.0; nh * hd], 1e-4);
    }
}

/// A fused decode step over an int8 KV cache (`kernel` with `KV_INT8`):
/// the new position's K and V rows within half a quantisation step of the
/// reference with their scales, every other row and scale unchanged, and
/// the output against the reference over the cache as the kernel left it.
/// Shape as [`attention_step_case`]'s (head_dim a multiple of 16).
pub fn attention_step_case_int8(
    run: Run<'_>,
    kernel: Kernel,
    shape: (usize, usize, usize, usize, usize),
    rng: &mut StdRng,
) {
    let (nh, nkv, hd, cap, pos) = shape;
    let (_, direct) = kernel.attention_variant().expect("an attention_partial variant");
    let theta = 1_000_000f32;
    let (params, scale) = head_params(nh, nkv, hd, cap);
    let eps = 1e-6f64;
    let qkv = nonzero(rng, (nh + 2 * nkv) * hd + 8);
    let (qn, kn) = (nonzero(rng, hd), nonzero(rng, hd));
    let rope = qwen3_wgpu::internals::qwen3::rope_table(hd, cap, theta);
    let (k, _) = kv_int8_quantize(&nonzero(rng, nkv * cap * hd), nkv, cap, hd);
    let (v, _) = kv_int8_quantize(&nonzero(rng, nkv * cap * hd), nkv, cap, hd);
    let chunks = if direct { 1 } else { cap.div_ceil(ATTENTION_CHUNK as usize) };
    let out = run(
        kernel,
        kernels::attention::partial_grid(nh as u32, chunks as u32),
        &[
            params,
            step(pos, 0),
            f32s(&qkv),
            k.clone(),
            v.clone(),
            poisoned(2 * nh * chunks),
            if direct { poisoned(nh * hd + 3) } else { poisoned(nh * chunks * hd) },
            f32s(&[qn.clone(), kn.clone()].concat()),
            f32s(&rope),
        ],
    );
    let head = |h: usize| &qkv[h * hd..(h + 1) * hd];
    let what = format!("{kernel:?} int8 KV pos {pos} hd {hd}");
    let (kc, vc) = (unpack_kv_int8(&out[0], nkv, cap, hd), unpack_kv_int8(&out[1], nkv, cap, hd));
    let (ks, vs) = (kv_int8_scales(&out[0], nkv, cap, hd), kv_int8_scales(&out[1], nkv, cap, hd));
    let (ks0, vs0) = (kv_int8_scales(&k, nkv, cap, hd), kv_int8_scales(&v, nkv, cap, hd));
    for g in 0..nkv {
        for t in 0..cap {
            let r = g * cap + t;
            if t == pos {
                let kw = qk_norm_rope_ref(head(nh + g), Some(&kn), pos, theta as f64, eps);
                let vw = qk_norm_rope_ref(head(nh + nkv + g), None, pos, theta as f64, eps);
                for (name, got, sc, want) in [("k", &kc, &ks, kw), ("v", &vc, &vs, vw)] {
                    let absmax = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                    assert_close(
                        &format!("{what}: {name} scale of head {g}"),
                        &sc[r..r + 1],
                        &[absmax],
                        &[absmax],
                        1e-3,
                    );
                    let step = vec![absmax / 127.0; hd];
                    assert_close(
                        &format!("{what}: {name} head {g}"),
                        &got[r * hd..(r + 1) * hd],
                        &want,
                        &step,
                        0.5 + 2e-2,
                    );
                }
            } else {
                let same = out[0][r * hd..(r + 1) * hd] == k[r * hd..(r + 1) * hd]
                    && out[1][r * hd..(r + 1) * hd] == v[r * hd..(r + 1) * hd];
                assert!(
                    same && ks[r] == ks0[r] && vs[r] == vs0[r],
                    "{what}: cache row {t} of kv head {g} changed"
                );
            }
        }
    }
    let got = if direct { to_f32(&out[3]) } else { reduce(run, &out[2..4], nh, hd, chunks, 1, nh * hd + 3) };
    let q: Vec<f32> = (0..nh)
        .flat_map(|h| qk_norm_rope_ref(head(h), Some(&qn), pos, theta as f64, eps))
        .map(|x| x as f32)
        .collect();
    let (kd, vd): (Vec<f64>, Vec<f64>) =
        (kc.iter().map(|x| *x as f64).collect(), vc.iter().map(|x| *x as f64).collect());
    let want = attention_ref_values(&q, &kd, &vd, nh, nkv, hd, cap, pos + 1, scale as f64);
    assert_close(&what, &got[..nh * hd], &want, &vec![1.0; nh * hd], 2e-4);
    assert!(got[nh * hd..].iter().all(|v| v.to_bits() == POISON), "{what}: wrote past the output");
}

/// argmax_final at the last position of the token array writes no token.
pub fn argmax_never_writes_past_the_token_array(run: Run<'_>) {
    // A position at the end of the token array writes no token.
    let f = run(
        Kernel::ArgmaxFinal,
        kernels::argmax::FINAL_GRID,
        &[argmax_final_params(1, 4), f32s(&[1.0]), u32s(&[0]), poisoned(5), step(3, 0)],
    );
    assert!(to_u32(&f[0]).iter().all(|t| *t == POISON), "wrote past n_tokens");
}

// ---------------------------------------------------------------------------
// SIMD-group matrices (MSL only): the probe the shim's emulation and a
// Metal device must both pass.

/// A kernel exercising SIMD-group matrices, two simdgroups at once, each
/// on its own matrices. It loads A from device memory (row stride 11), B
/// stored transposed (stride 9, `transpose_matrix`), C through threadgroup
/// memory; stores D = A B + C (stride 10) and D transposed; records the two
/// elements of A each lane holds (`thread_elements()`), stores a matrix
/// whose lanes set their elements to `2 * lane + element`, and the diagonal
/// matrix `simdgroup_float8x8(2)`. On the shim it tests the emulation; on a
/// Metal device, the element table the emulation and the `int8_matmul`
/// twin assume.
pub const MATRIX_PROBE: &str = "
kernel void matrix_probe(
    const device float* a [[buffer(0)]],
    const device float* b [[buffer(1)]],
    const device float* c [[buffer(2)]],
    device float* d [[buffer(3)]],
    device float* owned [[buffer(4)]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]])
{
    threadgroup float c_s[2 * 64];
    for (uint i = lane; i < 64; i += 32) {
        c_s[sg * 64 + i] = c[sg * 64 + i];
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 ma;
    simdgroup_float8x8 mb;
    simdgroup_float8x8 mc;
    simdgroup_float8x8 md;
    simdgroup_load(ma, a + sg * 8 * 11, 11);
    simdgroup_load(mb, b + sg * 8 * 9, 9, 0, true);
    simdgroup_load(mc, &c_s[sg * 64], 8);
    simdgroup_multiply_accumulate(md, ma, mb, mc);
    simdgroup_store(md, d + sg * 160, 10);
    simdgroup_store(md, d + sg * 160 + 80, 10, 0, true);
    device float* o = owned + sg * 192;
    o[2 * lane] = ma.thread_elements()[0];
    o[2 * lane + 1] = ma.thread_elements()[1];
    simdgroup_float8x8 labels;
    labels.thread_elements() = float2(float(2 * lane), float(2 * lane + 1));
    simdgroup_store(labels, o + 64, 8);
    simdgroup_store(simdgroup_float8x8(2.0f), o + 128, 8);
}
";

/// The bindings of [`MATRIX_PROBE`].
pub const MATRIX_PROBE_BINDINGS: [Bind; 5] =
    [Bind::Read, Bind::Read, Bind::Read, Bind::ReadWrite, Bind::ReadWrite];
/// Its threadgroup: two 32-lane simdgroups.
pub const MATRIX_PROBE_THREADGROUP: u32 = 64;

/// Which element lane `l` holds as element `e` of an 8x8 simdgroup matrix:
/// (row, column). Written bit by bit (row = lane bits 4, 2, 1; column =
/// lane bits 3, 0 and the element), independently of the shim's formula.
pub fn simdgroup_matrix_owner(l: usize, e: usize) -> (usize, usize) {
    let bit = |i: usize| (l >> i) & 1;
    (4 * bit(4) + 2 * bit(2) + bit(1), 4 * bit(3) + 2 * bit(0) + e)
}

/// An 8x8 matrix, row-major.
pub type Mat = [[f32; 8]; 8];

/// Random A, B, C for each of the probe's simdgroups, and its buffers in
/// binding order (the padding it must not read is NaN, its outputs are
/// poisoned).
pub fn matrix_probe_inputs(seed: u64) -> (Vec<[Mat; 3]>, Vec<Vec<u8>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut a, mut b, mut c) = (vec![f32::NAN; 2 * 8 * 11], vec![f32::NAN; 2 * 8 * 9], vec![0.0; 2 * 64]);
    let mut mats = Vec::new();
    for sg in 0..2 {
        let mut m = [[[0.0f32; 8]; 8]; 3];
        for (which, mat) in m.iter_mut().enumerate() {
            for (r, row) in mat.iter_mut().enumerate() {
                row.copy_from_slice(&nonzero(&mut rng, 8));
                for (col, v) in row.iter().enumerate() {
                    match which {
                        0 => a[sg * 88 + r * 11 + col] = *v,
                        1 => b[sg * 72 + col * 9 + r] = *v, // stored transposed
                        _ => c[sg * 64 + r * 8 + col] = *v,
                    }
                }
            }
        }
        mats.push(m);
    }
    (mats, vec![f32s(&a), f32s(&b), f32s(&c), poisoned(320), poisoned(384)])
}

/// Checks [`MATRIX_PROBE`]'s outputs (its read_write buffers) against plain
/// products of its inputs; the first difference, if any.
pub fn check_matrix_probe(mats: &[[Mat; 3]], out: &[Vec<u8>]) -> Result<(), String> {
    let (d, owned) = (to_f32(&out[0]), to_f32(&out[1]));
    for (sg, [a, b, c]) in mats.iter().enumerate() {
        let (d, owned) = (&d[sg * 160..(sg + 1) * 160], &owned[sg * 192..(sg + 1) * 192]);
        for r in 0..8 {
            for col in 0..8 {
                let want: f64 =
                    c[r][col] as f64 + (0..8).map(|k| a[r][k] as f64 * b[k][col] as f64).sum::<f64>();
                let tol = 1e-5 * (1.0 + (0..8).map(|k| (a[r][k] * b[k][col]).abs() as f64).sum::<f64>());
                for (at, how) in [(r * 10 + col, "D"), (80 + col * 10 + r, "D stored transposed")] {
                    if (d[at] as f64 - want).abs() > tol {
                        return Err(format!("simdgroup {sg}: {how} ({r}, {col}) = {}, want {want}", d[at]));
                    }
                }
            }
            // The stores leave the rows' padding alone.
            for at in [r * 10 + 8, r * 10 + 9, 80 + r * 10 + 8, 80 + r * 10 + 9] {
                if d[at].to_bits() != POISON {
                    return Err(format!("simdgroup {sg}: a store wrote d[{at}], past a row"));
                }
            }
        }
        for l in 0..32 {
            for e in 0..2 {
                let (r, col) = simdgroup_matrix_owner(l, e);
                let held = owned[2 * l + e];
                if held != a[r][col] {
                    return Err(format!(
                        "simdgroup {sg}: lane {l} element {e} holds {held}, not A({r}, {col})"
                    ));
                }
                if owned[64 + r * 8 + col] != (2 * l + e) as f32 {
                    return Err(format!(
                        "simdgroup {sg}: lane {l} element {e} was not stored at ({r}, {col})"
                    ));
                }
            }
        }
        for r in 0..8 {
            for col in 0..8 {
                let want = if r == col { 2.0 } else { 0.0 };
                if owned[128 + r * 8 + col] != want {
                    return Err(format!(
                        "simdgroup {sg}: simdgroup_float8x8(2) at ({r}, {col}) is not {want}"
                    ));
                }
            }
        }
    }
    Ok(())
}
