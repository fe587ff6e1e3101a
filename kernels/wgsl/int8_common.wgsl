// What int8_matvec (decode steps) and int8_matmul (prompt batches) share:
// one bind-group layout and params struct (a launch's bind group serves
// both pipelines; `Params` is generated from MatvecParams,
// src/kernels/matvec.rs); int8_math.wgsl follows (the epilogue flags and
// the int8-to-float conversion). Prepended to both by Rust.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
// x: f32, token z's from element z * k_words; in X16 normed pipelines
// the residual's f16 copy instead (see x16 below; bitcast, 8 values an
// element, token z's from element z * k_words / 2), read-only so that its
// loads take 16 bytes through the read-only path.
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
// The weights' scales as f32 words (int4's bf16 pairs bitcast: group_scale).
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
// NORM: the norm weight as f32 words, zero-padded to k_words * 4, then the
// same values as f16 (element k_words + i: values 8i .. 8i + 7, two per
// word), which X16 pipelines read (otherwise unused).
@group(0) @binding(5) var<storage, read> norm_w: array<vec4<u32>>;
// X16 (decode pipelines on GPUs whose matvecs are bound by their x loads):
// the residual stream's f16 copy, element i holding x[i]'s 4 values (two
// per word), token z's from element z * y_stride / 4. ACCUMULATE writes it
// beside y (one element per block of 4 rows, written whole by one lane);
// NORM pipelines read it instead of x (half the bytes of x per weight
// byte), bound at slot 1, and find the f32 stream here, unread
// (`decode_bindings`, src/kernels/matvec.rs). Otherwise unused.
@group(0) @binding(6) var<storage, read_write> x16: array<vec2<u32>>;
override X16: bool = false;

// The launch's shape (p.rows, p.k_words, p.groups, p.n_in) compiled in,
// where the host specialises the pipeline (the decode matvecs, see
// MatvecShape in src/kernels/matvec.rs); 0: read from p. Compiled in, a lane's first
// loads wait on no uniform read, and its index arithmetic folds.
override SHAPE_ROWS: u32 = 0u;
override SHAPE_K_WORDS: u32 = 0u;
override SHAPE_GROUPS: u32 = 0u;
override SHAPE_N_IN: u32 = 0u;
fn n_rows() -> u32 {
    return select(p.rows, SHAPE_ROWS, SHAPE_ROWS != 0u);
}
fn n_k_words() -> u32 {
    return select(p.k_words, SHAPE_K_WORDS, SHAPE_K_WORDS != 0u);
}
fn n_groups() -> u32 {
    return select(p.groups, SHAPE_GROUPS, SHAPE_GROUPS != 0u);
}
fn n_inputs() -> u32 {
    return select(p.n_in, SHAPE_N_IN, SHAPE_N_IN != 0u);
}

// Scale `i` (row r's group g at r * groups + g) in either weight format.
fn group_scale(i: u32) -> f32 {
    return word_scale(scales[scale_word(i)], i);
}
