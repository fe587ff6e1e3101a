// Prompt batches: the prefill pipelines of int8_matvec's variants, as a
// tiled matrix-matrix product. Workgroup (x, z) computes
//   y[t][row_offset + r] (+)= sum_k w[r][k] * x'[t][k]
// for the MM_ROWS rows from x * MM_ROWS and the MM_TOKENS tokens from
// z * MM_TOKENS (x' = x, or with NORM the token's RMSNorm of x, as in
// int8_matvec). K runs in chunks of CHUNK_K values: the chunk's weights
// (converted to f32 once, times their scale) and inputs (normed once) are
// staged in workgroup memory transposed, k-major, in vec4s of 4 rows or 4
// tokens. Invocation (i, j) owns a register tile of INV_ROWS rows x
// INV_TOKENS tokens: per k it reads INV_ROWS / 4 + INV_TOKENS / 4 vec4s and
// adds their outer product, INV_ROWS * INV_TOKENS multiply-adds (4 x 4: 2
// loads per 16; 8 x 4: 3 per 32; 8 x 8: 4 per 64). Its row quads are i
// (and i + ROW_BLOCKS) and its token quads j (and j + TOKEN_BLOCKS), so
// that neighbouring invocations read neighbouring vec4s (whole 128-byte
// lines of workgroup memory, no bank conflicts). Each weight is read from
// memory once per MM_TOKENS tokens, each input once per MM_ROWS rows.
// Every output is the same sum in the same order whatever the tile: the
// same staged values, k ascending, one multiply-add each.
// SWIZZLE: value k's vec4 of quad q sits at quad q ^ (k / 4) of the
// staging arrays' row k (within aligned groups of 8 quads). A staging
// invocation writes values 4v..4v+3 of one quad, its neighbours those of
// v + 1, ... of the same quad: unswizzled, 4 rows apart, the same bank
// group, 8 writes in turn; swizzled, 8 bank groups at once. The
// multiply-adds' reads of one k still cover whole 128-byte lines.
// PREFETCH: a chunk's memory loads go to registers before the previous
// chunk is multiplied, so their latency hides behind its arithmetic; the
// values are converted (and normalised) as they are stored to workgroup
// memory, after it.
// Same bindings, params and epilogues (ACCUMULATE, NORM, SWIGLU; token t's
// inputs at x[t * k_words ..], outputs at y[t * y_stride ..]) as int8_matvec:
// int8_common.wgsl, then int8_matmul_common.wgsl (the stores), prepended by
// Rust.
// Preamble (from Rust, src/kernels/matmul.rs): MM_ROWS, MM_TOKENS
// (multiples of 32), INV_ROWS, INV_TOKENS (4 or 8, dividing them),
// PREFETCH, SWIZZLE,
// GROUP_WORDS (u32 words per quant group), with
// (MM_ROWS / INV_ROWS) * (MM_TOKENS / INV_TOKENS) == WG.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

const ROW_QUADS: u32 = MM_ROWS / 4u;
const TOKEN_QUADS: u32 = MM_TOKENS / 4u;
// Row and token quads of one invocation's register tile.
const INV_ROW_QUADS: u32 = INV_ROWS / 4u;
const INV_TOKEN_QUADS: u32 = INV_TOKENS / 4u;
// Invocations along the tile's rows and along its tokens.
const ROW_BLOCKS: u32 = ROW_QUADS / INV_ROW_QUADS;
const TOKEN_BLOCKS: u32 = TOKEN_QUADS / INV_TOKEN_QUADS;
const MM_WG: u32 = ROW_BLOCKS * TOKEN_BLOCKS;
const_assert ROW_BLOCKS * INV_ROW_QUADS == ROW_QUADS && TOKEN_BLOCKS * INV_TOKEN_QUADS == TOKEN_QUADS;
const_assert ROW_QUADS % 8u == 0u && TOKEN_QUADS % 8u == 0u;
// K values per chunk: half a quant group of 64 keeps both staging arrays
// small (the quant group divides into whole chunks).
const CHUNK_K: u32 = 32u;
const CHUNK_WORDS: u32 = CHUNK_K / 4u;
// Staging of one chunk. Each staged vec4 is written whole by one
// invocation (invocations writing different components of one vector could
// be compiled to read-modify-writes that lose each other's components), so
// a staging unit loads four tokens' or four rows' values and transposes
// them itself. Input unit: tokens 4tq..4tq+3 at values 4q..4q+3 (four
// vec4<f32> loads); weight unit: rows 4rq..4rq+3 at values 4v..4v+3 (one
// u32 word of each row). Invocation l takes units l, l + MM_WG, ...: the
// same units of every chunk.
const X_LOADS: u32 = MM_TOKENS * (CHUNK_K / 4u);
const X_UNITS: u32 = TOKEN_QUADS * CHUNK_WORDS;
const W_UNITS: u32 = ROW_QUADS * CHUNK_WORDS;
const X_PER: u32 = (X_UNITS + MM_WG - 1u) / MM_WG;
const W_PER: u32 = (W_UNITS + MM_WG - 1u) / MM_WG;
// w_t[k * ROW_QUADS + (q ^ swizzle(k))]: rows 4q..4q+3 of the tile at the
// chunk's value k.
var<workgroup> w_t: array<vec4<f32>, CHUNK_K * ROW_QUADS>;
// x_t[k * TOKEN_QUADS + (q ^ swizzle(k))]: tokens 4q..4q+3 at the chunk's
// value k.
var<workgroup> x_t: array<vec4<f32>, CHUNK_K * TOKEN_QUADS>;
// The swizzle of the staging arrays' row k (see SWIZZLE): XORed into the
// quad index.
fn swizzle(k: u32) -> u32 {
    return select(0u, k / 4u, SWIZZLE);
}
// NORM: each token's sums of x^2 over values 4q..4q+3 of every chunk, at
// token * (CHUNK_K / 4) + q.
var<workgroup> ss_s: array<f32, X_LOADS>;

// One chunk's staging units as loaded from memory, before they are
// converted and stored transposed (the loads of the next chunk are in
// flight meanwhile, under PREFETCH): xs[4n + m] is token 4tq + m of input
// unit n and nws[n] its norm weights; wq[4n + m] and wsc[4n + m] are the
// weight word (int4: shifted, see load_chunk) and scale of row 4rq + m of
// weight unit n.
var<private> xs: array<vec4<f32>, 4u * X_PER>;
var<private> nws: array<vec4<f32>, X_PER>;
var<private> wq: array<u32, 4u * W_PER>;
var<private> wsc: array<f32, 4u * W_PER>;
// NORM: this invocation's input units' sums of x^2, one per token (the
// same tokens and values mod CHUNK_K in every chunk).
var<private> ss: array<vec4<f32>, X_PER>;

// Loads chunk c's staging units of invocation l into registers.
fn load_chunk(l: u32, c: u32, row0: u32, t0: u32) {
    let k_quads = p.k_words / 4u;
    // Inputs: unit e holds tokens 4tq..4tq+3 at values 4q..4q+3.
    for (var n = 0u; n < X_PER; n++) {
        let e = l + n * MM_WG;
        if e < X_UNITS {
            let tq = e / CHUNK_WORDS;
            let q = e % CHUNK_WORDS;
            let xb = (t0 + 4u * tq) * p.k_words + c * CHUNK_WORDS + q;
            xs[4u * n] = x[xb];
            xs[4u * n + 1u] = x[xb + p.k_words];
            xs[4u * n + 2u] = x[xb + 2u * p.k_words];
            xs[4u * n + 3u] = x[xb + 3u * p.k_words];
            if NORM {
                nws[n] = bitcast<vec4<f32>>(norm_w[c * CHUNK_WORDS + q]);
            }
        }
    }
    // Weights: unit e holds rows 4rq..4rq+3 at values 4v..4v+3 (word v of
    // the chunk; rows past the matrix repeat its last row).
    for (var n = 0u; n < W_PER; n++) {
        let e = l + n * MM_WG;
        if e < W_UNITS {
            let rq = e / CHUNK_WORDS;
            let v = e % CHUNK_WORDS;
            let word = c * CHUNK_WORDS + v;
            let g = (c * CHUNK_WORDS) / GROUP_WORDS;
            for (var m = 0u; m < 4u; m++) {
                let r = min(row0 + 4u * rq + m, p.rows - 1u);
                if INT4 {
                    // Values 4 word .. + 3: half of int4 word word / 2,
                    // shifted to its low nibbles (i4x4's).
                    let w4 = word / 2u;
                    wq[4u * n + m] = w[r * (k_quads / 2u) + w4 / 4u][w4 % 4u] >> (4u * (word % 2u));
                } else {
                    wq[4u * n + m] = w[r * k_quads + word / 4u][word % 4u];
                }
                wsc[4u * n + m] = group_scale(r * p.groups + g);
            }
        }
    }
}

// A weight unit's 4 values as loaded (int4: in its low nibbles).
fn unit4(v: u32) -> vec4<f32> {
    if INT4 {
        return i4x4(v);
    }
    return i8x4(v);
}

// Normalises (NORM: adding the inputs' squares to ss first) and converts
// the staging units in registers and stores them to x_t and w_t,
// transposed.
fn store_chunk(l: u32) {
    for (var n = 0u; n < X_PER; n++) {
        let e = l + n * MM_WG;
        if e < X_UNITS {
            let tq = e / CHUNK_WORDS;
            let q = e % CHUNK_WORDS;
            var v0 = xs[4u * n];
            var v1 = xs[4u * n + 1u];
            var v2 = xs[4u * n + 2u];
            var v3 = xs[4u * n + 3u];
            if NORM {
                ss[n] += vec4<f32>(dot(v0, v0), dot(v1, v1), dot(v2, v2), dot(v3, v3));
                let nw = nws[n];
                v0 *= nw;
                v1 *= nw;
                v2 *= nw;
                v3 *= nw;
            }
            let o = 4u * q * TOKEN_QUADS + (tq ^ swizzle(4u * q));
            x_t[o] = vec4<f32>(v0.x, v1.x, v2.x, v3.x);
            x_t[o + TOKEN_QUADS] = vec4<f32>(v0.y, v1.y, v2.y, v3.y);
            x_t[o + 2u * TOKEN_QUADS] = vec4<f32>(v0.z, v1.z, v2.z, v3.z);
            x_t[o + 3u * TOKEN_QUADS] = vec4<f32>(v0.w, v1.w, v2.w, v3.w);
        }
    }
    for (var n = 0u; n < W_PER; n++) {
        let e = l + n * MM_WG;
        if e < W_UNITS {
            let rq = e / CHUNK_WORDS;
            let v = e % CHUNK_WORDS;
            let a0 = unit4(wq[4u * n]) * wsc[4u * n];
            let a1 = unit4(wq[4u * n + 1u]) * wsc[4u * n + 1u];
            let a2 = unit4(wq[4u * n + 2u]) * wsc[4u * n + 2u];
            let a3 = unit4(wq[4u * n + 3u]) * wsc[4u * n + 3u];
            let o = 4u * v * ROW_QUADS + (rq ^ swizzle(4u * v));
            w_t[o] = vec4<f32>(a0.x, a1.x, a2.x, a3.x);
            w_t[o + ROW_QUADS] = vec4<f32>(a0.y, a1.y, a2.y, a3.y);
            w_t[o + 2u * ROW_QUADS] = vec4<f32>(a0.z, a1.z, a2.z, a3.z);
            w_t[o + 3u * ROW_QUADS] = vec4<f32>(a0.w, a1.w, a2.w, a3.w);
        }
    }
}

// Token quad tq's factors 1 / rms (NORM; else 1).
fn token_inv(tq: u32) -> vec4<f32> {
    var inv = vec4<f32>(1.0);
    if NORM {
        // Token t's sum of x^2 is spread over ss_s[t * (CHUNK_K / 4) ..].
        var s = vec4<f32>(0.0);
        for (var q = 0u; q < CHUNK_K / 4u; q++) {
            let b = 4u * tq * (CHUNK_K / 4u) + q;
            s += vec4<f32>(ss_s[b], ss_s[b + CHUNK_K / 4u], ss_s[b + 2u * (CHUNK_K / 4u)],
                           ss_s[b + 3u * (CHUNK_K / 4u)]);
        }
        inv = inverseSqrt(s / f32(p.n_in) + p.eps);
    }
    return inv;
}

// Stores rows r..r+3 of tokens t..t+3 (c0 token t, ..., c3 token t + 3),
// each token's times its factor in `inv`.
fn store_quad(c0: vec4<f32>, c1: vec4<f32>, c2: vec4<f32>, c3: vec4<f32>, inv: vec4<f32>, r: u32, t: u32) {
    let accs = array<vec4<f32>, 4>(c0 * inv.x, c1 * inv.y, c2 * inv.z, c3 * inv.w);
    for (var u = 0u; u < 4u; u++) {
        let a = accs[u];
        if SWIGLU {
            if r + 1u < p.rows {
                store(r, t + u, a.x, a.y);
            }
            if r + 3u < p.rows {
                store(r + 2u, t + u, a.z, a.w);
            }
        } else {
            for (var m = 0u; m < 4u; m++) {
                if r + m < p.rows {
                    store(r + m, t + u, a[m], 0.0);
                }
            }
        }
    }
}

// Register tiles of 4 or 8 rows by 4 or 8 tokens, in named accumulators (no
// array a compiler might leave in memory): the constant conditions below
// drop the ones a tiling does not use.
const TWO_ROW_QUADS: bool = INV_ROW_QUADS == 2u;
const TWO_TOKEN_QUADS: bool = INV_TOKEN_QUADS == 2u;
const_assert INV_ROW_QUADS <= 2u && INV_TOKEN_QUADS <= 2u;

@compute @workgroup_size(WG)
fn int8_matmul(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row0 = (wg.x + wg.y * nwg.x) * MM_ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    let t0 = wg.z * MM_TOKENS;
    let i = l % ROW_BLOCKS;
    let j = l / ROW_BLOCKS;
    // r<m>t<u>: row quad i + m * ROW_BLOCKS for the invocation's token u,
    // token 4 (j + (u / 4) * TOKEN_BLOCKS) + u % 4.
    var r0t0 = vec4<f32>(0.0);
    var r0t1 = vec4<f32>(0.0);
    var r0t2 = vec4<f32>(0.0);
    var r0t3 = vec4<f32>(0.0);
    var r0t4 = vec4<f32>(0.0);
    var r0t5 = vec4<f32>(0.0);
    var r0t6 = vec4<f32>(0.0);
    var r0t7 = vec4<f32>(0.0);
    var r1t0 = vec4<f32>(0.0);
    var r1t1 = vec4<f32>(0.0);
    var r1t2 = vec4<f32>(0.0);
    var r1t3 = vec4<f32>(0.0);
    var r1t4 = vec4<f32>(0.0);
    var r1t5 = vec4<f32>(0.0);
    var r1t6 = vec4<f32>(0.0);
    var r1t7 = vec4<f32>(0.0);
    let chunks = p.k_words / CHUNK_WORDS;
    if PREFETCH {
        load_chunk(l, 0u, row0, t0);
    }
    for (var c = 0u; c < chunks; c++) {
        if !PREFETCH {
            load_chunk(l, c, row0, t0);
        }
        workgroupBarrier(); // the previous chunk's readers are done
        store_chunk(l);
        workgroupBarrier();
        if PREFETCH && c + 1u < chunks {
            load_chunk(l, c + 1u, row0, t0);
        }
        for (var k = 0u; k < CHUNK_K; k++) {
            let s = swizzle(k);
            let a0 = w_t[k * ROW_QUADS + (i ^ s)];
            let b0 = x_t[k * TOKEN_QUADS + (j ^ s)];
            r0t0 += a0 * b0.x;
            r0t1 += a0 * b0.y;
            r0t2 += a0 * b0.z;
            r0t3 += a0 * b0.w;
            var a1 = vec4<f32>(0.0);
            if TWO_ROW_QUADS {
                a1 = w_t[k * ROW_QUADS + ((i + ROW_BLOCKS) ^ s)];
                r1t0 += a1 * b0.x;
                r1t1 += a1 * b0.y;
                r1t2 += a1 * b0.z;
                r1t3 += a1 * b0.w;
            }
            if TWO_TOKEN_QUADS {
                let b1 = x_t[k * TOKEN_QUADS + ((j + TOKEN_BLOCKS) ^ s)];
                r0t4 += a0 * b1.x;
                r0t5 += a0 * b1.y;
                r0t6 += a0 * b1.z;
                r0t7 += a0 * b1.w;
                if TWO_ROW_QUADS {
                    r1t4 += a1 * b1.x;
                    r1t5 += a1 * b1.y;
                    r1t6 += a1 * b1.z;
                    r1t7 += a1 * b1.w;
                }
            }
        }
    }
    if NORM {
        for (var n = 0u; n < X_PER; n++) {
            let e = l + n * MM_WG;
            if e < X_UNITS {
                let tq = e / CHUNK_WORDS;
                let q = e % CHUNK_WORDS;
                for (var m = 0u; m < 4u; m++) {
                    ss_s[(4u * tq + m) * CHUNK_WORDS + q] = ss[n][m];
                }
            }
        }
        workgroupBarrier();
    }
    let r0 = row0 + 4u * i;
    let r1 = row0 + 4u * (i + ROW_BLOCKS);
    let inv0 = token_inv(j);
    store_quad(r0t0, r0t1, r0t2, r0t3, inv0, r0, t0 + 4u * j);
    if TWO_ROW_QUADS {
        store_quad(r1t0, r1t1, r1t2, r1t3, inv0, r1, t0 + 4u * j);
    }
    if TWO_TOKEN_QUADS {
        let inv1 = token_inv(j + TOKEN_BLOCKS);
        let t1 = t0 + 4u * (j + TOKEN_BLOCKS);
        store_quad(r0t4, r0t5, r0t6, r0t7, inv1, r0, t1);
        if TWO_ROW_QUADS {
            store_quad(r1t4, r1t5, r1t6, r1t7, inv1, r1, t1);
        }
    }
}
