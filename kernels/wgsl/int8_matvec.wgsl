// y[row_offset + r] (+)= sum_k w[r][k] * x'[k], ROWS_PER_WG rows per workgroup,
// where x' = x, or with NORM the RMSNorm of x fused in:
// x' = x * rsqrt(mean(x^2) + eps) * norm_w.
// w: int8, row-major, rows zero-padded to a multiple of the quant group,
// four values packed per u32 (little-endian); one f32 scale per group
// (int4: one bf16 scale, group_scale).
//
// Two layouts (SPLIT_K, chosen per device by the host; both read 16 int8
// values per lane and step):
// - rows per team (Apple GPUs, CPU adapters; llama.cpp's
//   kernel_mul_mv_q8_0_f32 and MLX's qmv_fast): each team
// (a subgroup where the device has them) takes blocks of ROWS_PER_TEAM = 4
// rows; its lanes stride over the row in steps of VALUES_PER_LANE = 16 int8
// values (one vec4<u32> per row per step, coalesced), accumulate the 4 rows
// at once and reduce with one tree_sum4: no barriers, no workgroup memory.
// NORM costs no extra pass: the team reads all of x once anyway, so it sums
// x^2 on the way and scales the 4 dot products by rsqrt(mean + eps) at the end.
// Every sum over lanes is a tree_ reduction of the prelude (one fixed order
// of additions), so a batched row adds exactly as its one-token step.
// - split K (GPUs with many cores, e.g. NVIDIA): the workgroup takes 4 rows
//   and all its lanes stride over K, then one workgroup reduction: four
//   times the workgroups in flight for the small layer matrices.
//
// SWIGLU (the gate/up projection): rows are stored interleaved, gate row i
// at 2i and up row i at 2i+1, so a block of 4 rows yields
// y[(row_offset + row0) / 2 + t] = silu(gate_t) * up_t for t = 0, 1.
//
// Batched (prefill): workgroup z applies the matrix to TOKENS consecutive
// tokens t = z * TOKENS + i, inputs x[t * k_words ..], outputs
// y[t * y_stride ..]. With TOKENS > 1 (the prefill pipelines of the
// ACCUMULATE variant; int8_matmul.wgsl serves the others) each weight quad
// is loaded once for all of them. Decode runs TOKENS = 1 and z = 0 only.
//
// Batched decode (several sessions' steps in one launch, DECODE_ROWS > 0
// rows, TOKENS = 1): each workgroup runs the decode body for the ROWS_PER_Z
// rows z of its grid z (rows per team: four at a time, each weight quad
// loaded once for the four), inputs x[z * k_words ..], outputs
// y[z * y_stride ..]. Every row runs the one-token arithmetic (same lanes,
// same order of additions), so a row's result is bit-identical to its
// session's step alone; the matrix is read from memory once for all rows
// (a workgroup's rows stay in its cache after the first; the grid's z
// groups run side by side and share it in the L2).
//
// X16 (decode pipelines of the split-K layout; see int8_common.wgsl): a
// normed variant reads x and its norm weights as f16 copies (half the
// bytes of its input per weight byte: the loads of x, not the arithmetic,
// bound these matvecs on an H200), the copy of x bound at x's slot; a
// residual add writes the f16 copy of the rows it adds to (slot 6).
//
// INT4 (the layers of an int4 model): w holds int4 values, 8 a word (see
// int8_math.wgsl), so a lane's step (one vec4<u32> per row) covers 32
// values, two quads of x, where an int8 step covers 16. Everything else
// (the layouts, the epilogues, the order of a row's additions in one-token
// and batched decode alike) is the same. Two options of int4 decode
// pipelines, described where they are declared: IDOT (integer dot products
// against inputs in 16-bit fixed point) and PAIRED (teams of 8 rows).
//
// Bindings, the NORM/ACCUMULATE/SWIGLU/INT4 flags, i8x4 and i4x4:
// int8_common.wgsl, prepended by Rust.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

// u32 words per quant group (QUANT_GROUP / 4), set from Rust.
override GROUP_WORDS: u32;
// Rows per workgroup (a multiple of 4), set from Rust.
override ROWS_PER_WG: u32;
override SPLIT_K: bool = false;
// Tokens per workgroup: 1 (decode) or 4 (the prefill pipelines, rows per
// team only), set from Rust.
override TOKENS: u32;
// Decode rows per workgroup (see the header); 0: one token, row wg.z.
override DECODE_ROWS: u32 = 0u;
// Decode rows per grid z (DECODE_ROWS > 0): workgroups of grid z = g run
// rows g * ROWS_PER_Z .. min((g + 1) * ROWS_PER_Z, DECODE_ROWS) - 1.
override ROWS_PER_Z: u32 = 0u;

fn dot16(wv: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
    return dot(i8x4(wv.x), x0) + dot(i8x4(wv.y), x1) + dot(i8x4(wv.z), x2) + dot(i8x4(wv.w), x3);
}

// A lane's steps per row: the rows' length in vec4<u32>s (16 int8 values
// or 32 int4 ones each).
fn k_steps() -> u32 {
    return select(n_k_words() / 4u, n_k_words() / 8u, INT4);
}

// The quant group of step j.
fn step_group(j: u32) -> u32 {
    return j / select(GROUP_WORDS / 4u, GROUP_WORDS / 8u, INT4);
}

// One token's input quad j (16 values), normed with NORM; `sq`: its x^2.
struct Quad {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    sq: vec4<f32>,
}

// Four f16 values (two words) as f32.
fn h4(lo: u32, hi: u32) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(lo), unpack2x16float(hi));
}

fn xq(b: u32, j: u32) -> Quad {
    var q: Quad;
    if X16 && NORM {
        // The same 16 values from the f16 copy, bound at x's slot: two
        // 16-byte loads from a read-only binding (measured on an H200, 4B
        // gate/up: 19.9 us against 22.8 with four 8-byte loads from the
        // read-write slot 6).
        let lo = bitcast<vec4<u32>>(x[b / 2u]);
        let hi = bitcast<vec4<u32>>(x[b / 2u + 1u]);
        q = Quad(h4(lo.x, lo.y), h4(lo.z, lo.w), h4(hi.x, hi.y), h4(hi.z, hi.w), vec4<f32>(0.0));
    } else {
        q = Quad(x[b], x[b + 1u], x[b + 2u], x[b + 3u], vec4<f32>(0.0));
    }
    if NORM {
        q.sq = q.x0 * q.x0 + q.x1 * q.x1 + q.x2 * q.x2 + q.x3 * q.x3;
        if X16 {
            // The norm weight's f16 copy: 32 bytes a quad instead of 64.
            let g0 = norm_w[n_k_words() + 2u * j];
            let g1 = norm_w[n_k_words() + 2u * j + 1u];
            q.x0 *= h4(g0.x, g0.y);
            q.x1 *= h4(g0.z, g0.w);
            q.x2 *= h4(g1.x, g1.y);
            q.x3 *= h4(g1.z, g1.w);
        } else {
            q.x0 *= bitcast<vec4<f32>>(norm_w[4u * j]);
            q.x1 *= bitcast<vec4<f32>>(norm_w[4u * j + 1u]);
            q.x2 *= bitcast<vec4<f32>>(norm_w[4u * j + 2u]);
            q.x3 *= bitcast<vec4<f32>>(norm_w[4u * j + 3u]);
        }
    }
    return q;
}

fn rows4(w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>, q: Quad) -> vec4<f32> {
    return vec4<f32>(dot16(w0, q.x0, q.x1, q.x2, q.x3), dot16(w1, q.x0, q.x1, q.x2, q.x3),
                     dot16(w2, q.x0, q.x1, q.x2, q.x3), dot16(w3, q.x0, q.x1, q.x2, q.x3));
}

// An int4 step (32 values) against x quads a and b.
fn dot32(wv: vec4<u32>, a: Quad, b: Quad) -> f32 {
    let v0 = i4x8(wv.x);
    let v1 = i4x8(wv.y);
    let v2 = i4x8(wv.z);
    let v3 = i4x8(wv.w);
    return dot(v0.lo, a.x0) + dot(v0.hi, a.x1) + dot(v1.lo, a.x2) + dot(v1.hi, a.x3)
        + dot(v2.lo, b.x0) + dot(v2.hi, b.x1) + dot(v3.lo, b.x2) + dot(v3.hi, b.x3);
}

fn rows4_i4(w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>, a: Quad, b: Quad) -> vec4<f32> {
    return vec4<f32>(dot32(w0, a, b), dot32(w1, a, b), dot32(w2, a, b), dot32(w3, a, b));
}

// An int4 step's inputs: x quads 2j and 2j + 1 of the input at x[xb ..].
struct Quads {
    a: Quad,
    b: Quad,
}

fn xq2(xb: u32, j: u32) -> Quads {
    return Quads(xq(xb + 8u * j, 2u * j), xq(xb + 8u * j + 4u, 2u * j + 1u));
}

// The scales of group g of `rows`.
fn scales4(rows: vec4<u32>, g: u32) -> vec4<f32> {
    return vec4<f32>(group_scale(rows.x * n_groups() + g), group_scale(rows.y * n_groups() + g),
                     group_scale(rows.z * n_groups() + g), group_scale(rows.w * n_groups() + g));
}

// IDOT (the int4 normed decode pipelines that read the residual's f16
// copy: `int_dot`, src/kernels/matvec.rs): a lane's step quantises its 32
// normed inputs to 16-bit fixed point (XInt8), and each row's step is 16
// integer dot products of its nibbles against them, exact in i32, scaled
// once: per weight a third of the float dequantisation's operations. The
// one-token and batched steps quantise alike, so a batch's rows keep their
// one-token bits.
override IDOT: bool = false;

// An int4 step's 32 inputs in 16-bit fixed point, as two int8 parts:
// x = (254 h + l) * scale / 254, h = round(x / scale) and l the rest in
// 254ths of a step (|l| <= 127), with scale = absmax / 127: an error of at
// most absmax / 64,516, under the f16 copy's own rounding (a single int8
// part, llama.cpp's Q8_1 input, flipped MLX's greedy tokens at a 0.04
// margin). Values 0..15 in words h0 / l0, 16..31 in h1 / l1 (4 per word,
// two's complement); bias = 8 * (254 sum(h) + sum(l)), the nibbles' offset.
struct XInt8 {
    h0: vec4<u32>,
    h1: vec4<u32>,
    l0: vec4<u32>,
    l1: vec4<u32>,
    scale: f32,
    bias: i32,
}

fn quantise_x(x: Quads) -> XInt8 {
    let m = max(max(max(abs(x.a.x0), abs(x.a.x1)), max(abs(x.a.x2), abs(x.a.x3))),
                max(max(abs(x.b.x0), abs(x.b.x1)), max(abs(x.b.x2), abs(x.b.x3))));
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    // Below 1e-30 a block counts as zero (127 / amax would overflow).
    let live = amax >= 1e-30;
    let inv = select(0.0, 127.0 / amax, live);
    let scale = select(0.0, amax / 127.0, live);
    let p0 = parts4(x.a.x0, inv, scale);
    let p1 = parts4(x.a.x1, inv, scale);
    let p2 = parts4(x.a.x2, inv, scale);
    let p3 = parts4(x.a.x3, inv, scale);
    let p4 = parts4(x.b.x0, inv, scale);
    let p5 = parts4(x.b.x1, inv, scale);
    let p6 = parts4(x.b.x2, inv, scale);
    let p7 = parts4(x.b.x3, inv, scale);
    let sum = p0.sum + p1.sum + p2.sum + p3.sum + p4.sum + p5.sum + p6.sum + p7.sum;
    return XInt8(vec4<u32>(p0.h, p1.h, p2.h, p3.h), vec4<u32>(p4.h, p5.h, p6.h, p7.h),
                 vec4<u32>(p0.l, p1.l, p2.l, p3.l), vec4<u32>(p4.l, p5.l, p6.l, p7.l), scale / 254.0, 8 * sum);
}

// sum(n * q) over 32 values: nibble words lo / hi (values 8k..8k+3 in
// lo[k], 8k+4..8k+7 in hi[k]) against int8 words q0 (values 0..15) and q1.
fn idot32(lo: vec4<u32>, hi: vec4<u32>, q0: vec4<u32>, q1: vec4<u32>) -> i32 {
    return dot4I8Packed(lo.x, q0.x) + dot4I8Packed(hi.x, q0.y) + dot4I8Packed(lo.y, q0.z)
        + dot4I8Packed(hi.y, q0.w) + dot4I8Packed(lo.z, q1.x) + dot4I8Packed(hi.z, q1.y)
        + dot4I8Packed(lo.w, q1.z) + dot4I8Packed(hi.w, q1.w);
}

// One row's int4 step against quantised inputs, in units of q.scale: its
// nibbles n = w + 8 (sign bits flipped; i4x8's order), 254 sum(n h) +
// sum(n l) - bias, exact in i32 (|.| < 2^24, so exact as f32 too).
fn idot_row(wv: vec4<u32>, q: XInt8) -> i32 {
    let m = wv ^ vec4<u32>(0x88888888u);
    let lo = m & vec4<u32>(0x0f0f0f0fu);
    let hi = (m >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
    return 254 * idot32(lo, hi, q.h0, q.h1) + idot32(lo, hi, q.l0, q.l1) - q.bias;
}

// Four rows' int4 step (before the group scales) against quantised inputs.
fn idot_rows4(w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>, q: XInt8) -> vec4<f32> {
    let d = vec4<i32>(idot_row(w0, q), idot_row(w1, q), idot_row(w2, q), idot_row(w3, q));
    return vec4<f32>(d) * q.scale;
}

// Four rows' int4 step (before the group scales) against inputs x: the
// float dequantisation (i4x8), or with IDOT the integer dot products.
fn int4_rows4(w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>, x: Quads) -> vec4<f32> {
    if IDOT {
        return idot_rows4(w0, w1, w2, w3, quantise_x(x));
    }
    return rows4_i4(w0, w1, w2, w3, x.a, x.b);
}

// step4 of int4 weights.
fn step4_i4(rows: vec4<u32>, xb: u32, j: u32) -> Partial {
    let k_steps = k_steps();
    let x = xq2(xb, j);
    let s = scales4(rows, step_group(j));
    let acc = int4_rows4(w[rows.x * k_steps + j], w[rows.y * k_steps + j], w[rows.z * k_steps + j],
                         w[rows.w * k_steps + j], x) * s;
    return Partial(acc, x.a.sq + x.b.sq);
}

// Partial sums of rows row0..row0+3 (rows past the end repeat the last
// row; store4 drops their results) over the quads (16 values) j = first,
// first + stride, ...; `ss`: the partial sum of x^2 (NORM).
struct Partial {
    acc: vec4<f32>,
    ss: vec4<f32>,
}

// Quad j of `rows` (row indices) against x's quad j (int4: step j).
fn step4(rows: vec4<u32>, xb: u32, j: u32) -> Partial {
    if INT4 {
        return step4_i4(rows, xb, j);
    }
    let k_quads = n_k_words() / 4u;
    let q = xq(xb + 4u * j, j);
    let g = j / (GROUP_WORDS / 4u);
    let s = vec4<f32>(group_scale(rows.x * n_groups() + g), group_scale(rows.y * n_groups() + g),
                      group_scale(rows.z * n_groups() + g), group_scale(rows.w * n_groups() + g));
    let acc = rows4(w[rows.x * k_quads + j], w[rows.y * k_quads + j], w[rows.z * k_quads + j],
                    w[rows.w * k_quads + j], q) * s;
    return Partial(acc, q.sq);
}

// PAIRED (rows per team, int4 decode: `MatvecSplit::paired`,
// src/kernels/matvec.rs): a team takes 8 rows a pass, two blocks of 4
// that share each step's inputs (their loads, norm and, with IDOT, their
// quantisation: the bulk of a step's work once the rows' products are
// integer dot products). Each row adds exactly as in partial4 (the same
// step expression, the first step peeled), so a batch's rows, which run
// blocks of 4, keep these bits.
override PAIRED: bool = false;

struct Partial8 {
    a: vec4<f32>,
    b: vec4<f32>,
    ss: vec4<f32>,
}

// Rows row0..row0+3, those past the end repeating the last row.
fn rows_from(row0: u32) -> vec4<u32> {
    let last = n_rows() - 1u;
    return vec4<u32>(min(row0, last), min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
}

// Step j (int4) of rows ra and rb, as step4_i4's of each.
fn step8_i4(ra: vec4<u32>, rb: vec4<u32>, xb: u32, j: u32) -> Partial8 {
    let k_steps = k_steps();
    let x = xq2(xb, j);
    let g = step_group(j);
    let sa = scales4(ra, g);
    let sb = scales4(rb, g);
    let a0 = w[ra.x * k_steps + j];
    let a1 = w[ra.y * k_steps + j];
    let a2 = w[ra.z * k_steps + j];
    let a3 = w[ra.w * k_steps + j];
    let b0 = w[rb.x * k_steps + j];
    let b1 = w[rb.y * k_steps + j];
    let b2 = w[rb.z * k_steps + j];
    let b3 = w[rb.w * k_steps + j];
    if IDOT {
        let q = quantise_x(x);
        return Partial8(idot_rows4(a0, a1, a2, a3, q) * sa, idot_rows4(b0, b1, b2, b3, q) * sb, x.a.sq + x.b.sq);
    }
    return Partial8(rows4_i4(a0, a1, a2, a3, x.a, x.b) * sa, rows4_i4(b0, b1, b2, b3, x.a, x.b) * sb,
                    x.a.sq + x.b.sq);
}

// partial4 of rows row0..row0+7 (int4), the first step peeled as there.
fn partial8(row0: u32, xb: u32, first: u32, stride: u32) -> Partial8 {
    let k_quads = k_steps();
    let ra = rows_from(row0);
    let rb = rows_from(row0 + 4u);
    var o = Partial8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    if first < k_quads {
        o = step8_i4(ra, rb, xb, first);
    }
    for (var j = first + stride; j < k_quads; j += stride) {
        let a = step8_i4(ra, rb, xb, j);
        o.a += a.a;
        o.b += a.b;
        o.ss += a.ss;
    }
    return o;
}

fn partial4(row0: u32, xb: u32, first: u32, stride: u32) -> Partial {
    let k_quads = k_steps();
    let rows = vec4<u32>(row0, min(row0 + 1u, n_rows() - 1u), min(row0 + 2u, n_rows() - 1u), min(row0 + 3u, n_rows() - 1u));
    // The first step outside the loop: straight-line code for the split-K
    // lanes, which take one step per row (measured: 5.9 against 6.75 µs for
    // the 0.6B qkv matvec on an H200).
    var o = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    if first < k_quads {
        o = step4(rows, xb, first);
    }
    for (var j = first + stride; j < k_quads; j += stride) {
        let a = step4(rows, xb, j);
        o.acc += a.acc;
        o.ss += a.ss;
    }
    return o;
}

// partial4 for 4 tokens at once (rows as in partial4; token i's input at
// x[xb + i * k_words ..]): each weight quad and scale is read once, and the
// sums live in plain registers (no arrays).
struct Partials {
    a0: vec4<f32>,
    a1: vec4<f32>,
    a2: vec4<f32>,
    a3: vec4<f32>,
    s0: vec4<f32>,
    s1: vec4<f32>,
    s2: vec4<f32>,
    s3: vec4<f32>,
}

// `peel`: the first quad's products are the sums' first values rather than
// added to zero, and that step is taken before the loop, as partial4 takes
// it (a batched decode row must add exactly as its one-token step: with the
// first step a branch inside the loop, a compiler may fuse the loop's
// multiply-adds differently, and NVIDIA's did, one ulp off in the LM head).
struct Products {
    p0: vec4<f32>,
    p1: vec4<f32>,
    p2: vec4<f32>,
    p3: vec4<f32>,
    q0: vec4<f32>,
    q1: vec4<f32>,
    q2: vec4<f32>,
    q3: vec4<f32>,
}

// step4_tokens of int4 weights.
fn step4_tokens_i4(row0: u32, r1: u32, r2: u32, r3: u32, xb: u32, j: u32) -> Products {
    let k_steps = k_steps();
    let w0 = w[row0 * k_steps + j];
    let w1 = w[r1 * k_steps + j];
    let w2 = w[r2 * k_steps + j];
    let w3 = w[r3 * k_steps + j];
    let s = scales4(vec4<u32>(row0, r1, r2, r3), step_group(j));
    let x0 = xq2(xb, j);
    let x1 = xq2(xb + n_k_words(), j);
    let x2 = xq2(xb + 2u * n_k_words(), j);
    let x3 = xq2(xb + 3u * n_k_words(), j);
    return Products(int4_rows4(w0, w1, w2, w3, x0) * s, int4_rows4(w0, w1, w2, w3, x1) * s,
                    int4_rows4(w0, w1, w2, w3, x2) * s, int4_rows4(w0, w1, w2, w3, x3) * s,
                    x0.a.sq + x0.b.sq, x1.a.sq + x1.b.sq, x2.a.sq + x2.b.sq, x3.a.sq + x3.b.sq);
}

// Quad j of rows row0, r1, r2, r3 against 4 tokens' inputs (token i at
// x[xb + i * k_words ..]): the products and the inputs' squares (int4:
// step j).
fn step4_tokens(row0: u32, r1: u32, r2: u32, r3: u32, xb: u32, j: u32) -> Products {
    if INT4 {
        return step4_tokens_i4(row0, r1, r2, r3, xb, j);
    }
    let k_quads = n_k_words() / 4u;
    let g = j / (GROUP_WORDS / 4u);
    let w0 = w[row0 * k_quads + j];
    let w1 = w[r1 * k_quads + j];
    let w2 = w[r2 * k_quads + j];
    let w3 = w[r3 * k_quads + j];
    let s = vec4<f32>(group_scale(row0 * n_groups() + g), group_scale(r1 * n_groups() + g),
                      group_scale(r2 * n_groups() + g), group_scale(r3 * n_groups() + g));
    let b = xb + 4u * j;
    let q0 = xq(b, j);
    let q1 = xq(b + n_k_words(), j);
    let q2 = xq(b + 2u * n_k_words(), j);
    let q3 = xq(b + 3u * n_k_words(), j);
    return Products(rows4(w0, w1, w2, w3, q0) * s, rows4(w0, w1, w2, w3, q1) * s, rows4(w0, w1, w2, w3, q2) * s,
                    rows4(w0, w1, w2, w3, q3) * s, q0.sq, q1.sq, q2.sq, q3.sq);
}

fn partial4_tokens(row0: u32, xb: u32, first: u32, stride: u32, peel: bool) -> Partials {
    let k_quads = k_steps();
    let r1 = min(row0 + 1u, n_rows() - 1u);
    let r2 = min(row0 + 2u, n_rows() - 1u);
    let r3 = min(row0 + 3u, n_rows() - 1u);
    var o = Partials(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0),
                     vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    var j = first;
    if peel && first < k_quads {
        let a = step4_tokens(row0, r1, r2, r3, xb, first);
        o = Partials(a.p0, a.p1, a.p2, a.p3, a.q0, a.q1, a.q2, a.q3);
        j += stride;
    }
    for (; j < k_quads; j += stride) {
        let a = step4_tokens(row0, r1, r2, r3, xb, j);
        o.a0 += a.p0;
        o.a1 += a.p1;
        o.a2 += a.p2;
        o.a3 += a.p3;
        o.s0 += a.q0;
        o.s1 += a.q1;
        o.s2 += a.q2;
        o.s3 += a.q3;
    }
    return o;
}

// The reduced dot products with NORM's rsqrt(mean(x^2) + eps) applied
// (`ss`: the reduced sum of x^2).
fn finish(sums: vec4<f32>, ss: f32) -> vec4<f32> {
    if NORM {
        return sums * inverseSqrt(ss / f32(n_inputs()) + p.eps);
    }
    return sums;
}

// A lane's partial sum of x^2 as one value (the same expression wherever a
// lane's partial enters a reduction).
fn lane_ss(ss: vec4<f32>) -> f32 {
    return ss.x + ss.y + ss.z + ss.w;
}

// ACCUMULATE: the values the store of rows row0..row0+3 of token z adds
// to, loaded by the lane that stores them (lane 0 all four with X16, team
// lane i row i otherwise). The one-token decode loads them before its sums,
// so the load's round trip overlaps the weights' instead of following the
// reduction (a residual add is a chain of dependent launches: its y was
// written launches ago and only this workgroup writes these rows now).
fn prior4(row0: u32, i: u32, z: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if ACCUMULATE && !SWIGLU {
        let o = z * p.y_stride + p.row_offset + row0;
        if X16 {
            if i == 0u {
                for (var r = 0u; r < 4u; r++) {
                    if row0 + r < n_rows() {
                        v[r] = y[o + r];
                    }
                }
            }
        } else if i < 4u && row0 + i < n_rows() {
            v[i] = y[o + i];
        }
    }
    return v;
}

// Team lane `i` < 4 writes row row0 + i of token z's output (SWIGLU: lane
// i < 2 writes output pair i of the block); ACCUMULATE adds `prior`
// (prior4's).
fn store4_onto(row0: u32, sums: vec4<f32>, i: u32, z: u32, prior: vec4<f32>) {
    let yb = z * p.y_stride;
    if SWIGLU {
        if i < 2u && row0 + 2u * i < n_rows() {
            let o = yb + (p.row_offset + row0) / 2u + i;
            y[o] = silu(sums[2u * i]) * sums[2u * i + 1u];
        }
        return;
    }
    if X16 && ACCUMULATE {
        // Lane 0 writes the block's rows and their f16 copy, one whole
        // element (row_offset and y_stride are multiples of 4).
        if i == 0u {
            var block = vec4<f32>(0.0);
            for (var r = 0u; r < 4u; r++) {
                if row0 + r < n_rows() {
                    let o = yb + p.row_offset + row0 + r;
                    let v = sums[r] + prior[r];
                    y[o] = v;
                    block[r] = v;
                }
            }
            x16[(yb + p.row_offset + row0) / 4u] = vec2<u32>(pack_f16(block.x, block.y), pack_f16(block.z, block.w));
        }
        return;
    }
    if i < 4u && row0 + i < n_rows() {
        let o = yb + p.row_offset + row0 + i;
        var v = sums[i];
        if ACCUMULATE {
            v += prior[i];
        }
        y[o] = v;
    }
}

// store4_onto with the values added to loaded now.
fn store4(row0: u32, sums: vec4<f32>, i: u32, z: u32) {
    store4_onto(row0, sums, i, z, prior4(row0, i, z));
}

@compute @workgroup_size(WG)
fn int8_matvec(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let wg_row0 = (wg.x + wg.y * nwg.x) * ROWS_PER_WG;
    if wg_row0 >= n_rows() {
        return; // whole workgroup: uniform
    }
    if TOKENS > 1u {
        matmul(lane, wg_row0, wg.z * TOKENS, false);
        return;
    }
    if DECODE_ROWS > 0u {
        // Grid z = g takes rows z0 .. z_end - 1 (ROWS_PER_Z of them, the
        // last group fewer).
        let z0 = wg.z * ROWS_PER_Z;
        let z_end = min(z0 + ROWS_PER_Z, DECODE_ROWS);
        if SPLIT_K && k_steps() <= WG {
            split_k_rows(lane, wg_row0, z0, z_end);
            return;
        }
        // Rows per team: four rows per pass over the weights (each weight
        // quad loaded once for them, each row's sums as its one-token
        // step adds them), then the rest one at a time.
        var z = z0;
        if !SPLIT_K {
            for (; z + 4u <= z_end; z += 4u) {
                matmul(lane, wg_row0, z, true);
            }
        }
        for (; z < z_end; z++) {
            decode_token(lane, wg_row0, z);
        }
        return;
    }
    decode_token(lane, wg_row0, wg.z);
}

// DECODE_ROWS rows, split K, where each lane takes one step (quad) of K at
// most: the lane loads its weight quads and scales once for every row,
// then runs each row as decode_token would (partial4's one step4, the
// same expressions, then tree_wg_sum5 and store4).
fn split_k_rows(lane: Lane, row0: u32, z0: u32, z_end: u32) {
    let k_quads = k_steps();
    let j = lane.idx;
    let has_step = j < k_quads;
    let rows = vec4<u32>(row0, min(row0 + 1u, n_rows() - 1u), min(row0 + 2u, n_rows() - 1u), min(row0 + 3u, n_rows() - 1u));
    var w0 = vec4<u32>(0u);
    var w1 = vec4<u32>(0u);
    var w2 = vec4<u32>(0u);
    var w3 = vec4<u32>(0u);
    var s = vec4<f32>(0.0);
    if has_step {
        let g = step_group(j);
        w0 = w[rows.x * k_quads + j];
        w1 = w[rows.y * k_quads + j];
        w2 = w[rows.z * k_quads + j];
        w3 = w[rows.w * k_quads + j];
        s = vec4<f32>(group_scale(rows.x * n_groups() + g), group_scale(rows.y * n_groups() + g),
                      group_scale(rows.z * n_groups() + g), group_scale(rows.w * n_groups() + g));
    }
    // Four rows per workgroup exchange (tree_wg_sum_rows4: each row's sums
    // exactly tree_wg_sum5's), then the rest one at a time.
    var z = z0;
    for (; z + 4u <= z_end; z += 4u) {
        let o0 = split_k_row(has_step, w0, w1, w2, w3, s, z, j);
        let o1 = split_k_row(has_step, w0, w1, w2, w3, s, z + 1u, j);
        let o2 = split_k_row(has_step, w0, w1, w2, w3, s, z + 2u, j);
        let o3 = split_k_row(has_step, w0, w1, w2, w3, s, z + 3u, j);
        let ss = vec4<f32>(lane_ss(o0.ss), lane_ss(o1.ss), lane_ss(o2.ss), lane_ss(o3.ss));
        let r = tree_wg_sum_rows4(o0.acc, o1.acc, o2.acc, o3.acc, ss, NORM, lane);
        store4(row0, finish(r.a0, r.s.x), lane.idx, z);
        store4(row0, finish(r.a1, r.s.y), lane.idx, z + 1u);
        store4(row0, finish(r.a2, r.s.z), lane.idx, z + 2u);
        store4(row0, finish(r.a3, r.s.w), lane.idx, z + 3u);
    }
    for (; z < z_end; z++) {
        let o = split_k_row(has_step, w0, w1, w2, w3, s, z, j);
        let r = tree_wg_sum5(o.acc, lane_ss(o.ss), NORM, lane);
        store4(row0, finish(r.v, r.s), lane.idx, z);
    }
}

// One row's step of split_k_rows (partial4's one step4 for the lane).
fn split_k_row(has_step: bool, w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>, s: vec4<f32>, z: u32,
               j: u32) -> Partial {
    var o = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    if has_step && INT4 {
        let x = xq2(z * n_k_words(), j);
        o = Partial(int4_rows4(w0, w1, w2, w3, x) * s, x.a.sq + x.b.sq);
    } else if has_step {
        let q = xq(z * n_k_words() + 4u * j, j);
        o = Partial(rows4(w0, w1, w2, w3, q) * s, q.sq);
    }
    return o;
}

// The workgroup's rows of token z's output (input x[z * k_words ..]).
fn decode_token(lane: Lane, wg_row0: u32, z: u32) {
    let xb = z * n_k_words();
    if SPLIT_K {
        // All lanes share the 4 rows; one workgroup reduction (NORM's sum
        // of squares rides along).
        let prior = prior4(wg_row0, lane.idx, z);
        let part = partial4(wg_row0, xb, lane.idx, WG);
        let r = tree_wg_sum5(part.acc, lane_ss(part.ss), NORM, lane);
        store4_onto(wg_row0, finish(r.v, r.s), lane.idx, z, prior);
        return;
    }
    // Each team takes whole blocks of 4 rows (PAIRED: 8); a barrier-free
    // team reduction.
    let tl = team_lane(lane);
    if PAIRED && INT4 {
        for (var rb = team_id(lane) * 8u; rb < ROWS_PER_WG; rb += team_count(lane) * 8u) {
            let row0 = wg_row0 + rb;
            if row0 < n_rows() {
                let prior_a = prior4(row0, tl, z);
                let prior_b = prior4(row0 + 4u, tl, z);
                let part = partial8(row0, xb, tl, team_size(lane));
                let sums_a = tree_sum4(part.a, lane);
                let sums_b = tree_sum4(part.b, lane);
                var ss = 0.0;
                if NORM {
                    ss = tree_sum(lane_ss(part.ss), lane);
                }
                store4_onto(row0, finish(sums_a, ss), tl, z, prior_a);
                if row0 + 4u < n_rows() {
                    store4_onto(row0 + 4u, finish(sums_b, ss), tl, z, prior_b);
                }
            }
        }
        return;
    }
    for (var rb = team_id(lane) * 4u; rb < ROWS_PER_WG; rb += team_count(lane) * 4u) {
        let row0 = wg_row0 + rb;
        if row0 < n_rows() {
            let prior = prior4(row0, tl, z);
            let part = partial4(row0, xb, tl, team_size(lane));
            let sums = tree_sum4(part.acc, lane);
            var ss = 0.0;
            if NORM {
                ss = tree_sum(lane_ss(part.ss), lane);
            }
            store4_onto(row0, finish(sums, ss), tl, z, prior);
        }
    }
}

// 4 tokens from `t0` on (the prefill pipelines, and four rows of a batched
// decode), rows per team: one tree_sum_rows4 for the four.
fn matmul(lane: Lane, wg_row0: u32, t0: u32, peel: bool) {
    let xb = t0 * n_k_words();
    for (var rb = team_id(lane) * 4u; rb < ROWS_PER_WG; rb += team_count(lane) * 4u) {
        let row0 = wg_row0 + rb;
        if row0 < n_rows() {
            let o = partial4_tokens(row0, xb, team_lane(lane), team_size(lane), peel);
            let ss = vec4<f32>(lane_ss(o.s0), lane_ss(o.s1), lane_ss(o.s2), lane_ss(o.s3));
            let r = tree_sum_rows4(o.a0, o.a1, o.a2, o.a3, ss, NORM, lane);
            let tl = team_lane(lane);
            store4(row0, finish(r.a0, r.s.x), tl, t0);
            store4(row0, finish(r.a1, r.s.y), tl, t0 + 1u);
            store4(row0, finish(r.a2, r.s.z), tl, t0 + 2u);
            store4(row0, finish(r.a3, r.s.w), tl, t0 + 3u);
        }
    }
}
