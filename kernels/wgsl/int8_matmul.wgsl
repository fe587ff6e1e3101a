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
// loads per 16; 8 x 4: 3 per 32; 8 x 8: 4 per 64). Its row quads are i,
// i + ROW_BLOCKS, ... and its token quads j, j + TOKEN_BLOCKS, ..., so
// that neighbouring invocations read neighbouring vec4s (whole 128-byte
// lines of workgroup memory, no bank conflicts). Each weight is read from
// memory once per MM_TOKENS tokens, each input once per MM_ROWS rows.
// Every output is the same sum in the same order whatever the tile: the
// same staged values, k ascending, one multiply-add each.
// PREFETCH: a chunk's memory loads (and conversion) go to registers while
// the previous chunk is multiplied, so their latency hides behind its
// arithmetic; the registers are then stored to workgroup memory.
// Same bindings, params and epilogues (ACCUMULATE, NORM, SWIGLU; token t's
// inputs at x[t * k_words ..], outputs at y[t * y_stride ..]) as int8_matvec:
// int8_common.wgsl, then int8_matmul_common.wgsl (the stores), prepended by
// Rust.
// Preamble (from Rust, src/kernels/matmul.rs): MM_ROWS, MM_TOKENS,
// INV_ROWS, INV_TOKENS (multiples of 4 dividing them), PREFETCH,
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
// w_t[k * ROW_QUADS + q]: rows 4q..4q+3 of the tile at the chunk's value k.
var<workgroup> w_t: array<vec4<f32>, CHUNK_K * ROW_QUADS>;
// x_t[k * TOKEN_QUADS + q]: tokens 4q..4q+3 at the chunk's value k.
var<workgroup> x_t: array<vec4<f32>, CHUNK_K * TOKEN_QUADS>;
// NORM: each token's sums of x^2 over values 4q..4q+3 of every chunk, at
// token * (CHUNK_K / 4) + q.
var<workgroup> ss_s: array<f32, X_LOADS>;

// One chunk's staging units as loaded, before they are stored transposed:
// xs[4n + m] is token 4tq + m of input unit n; ws[4n + m] row 4rq + m of
// weight unit n.
var<private> xs: array<vec4<f32>, 4u * X_PER>;
var<private> ws: array<vec4<f32>, 4u * W_PER>;
// NORM: this invocation's input units' sums of x^2, one per token (the
// same tokens and values mod CHUNK_K in every chunk).
var<private> ss: array<vec4<f32>, X_PER>;

// Loads (and normalises, and converts) chunk c's staging units of
// invocation l into xs and ws.
fn load_chunk(l: u32, c: u32, row0: u32, t0: u32) {
    let k_quads = p.k_words / 4u;
    // Inputs: unit e holds tokens 4tq..4tq+3 at values 4q..4q+3.
    for (var n = 0u; n < X_PER; n++) {
        let e = l + n * MM_WG;
        if e < X_UNITS {
            let tq = e / CHUNK_WORDS;
            let q = e % CHUNK_WORDS;
            let xb = (t0 + 4u * tq) * p.k_words + c * CHUNK_WORDS + q;
            var v0 = x[xb];
            var v1 = x[xb + p.k_words];
            var v2 = x[xb + 2u * p.k_words];
            var v3 = x[xb + 3u * p.k_words];
            if NORM {
                ss[n] += vec4<f32>(dot(v0, v0), dot(v1, v1), dot(v2, v2), dot(v3, v3));
                let nw = norm_w[c * CHUNK_WORDS + q];
                v0 *= nw;
                v1 *= nw;
                v2 *= nw;
                v3 *= nw;
            }
            xs[4u * n] = v0;
            xs[4u * n + 1u] = v1;
            xs[4u * n + 2u] = v2;
            xs[4u * n + 3u] = v3;
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
                ws[4u * n + m] = i8x4(w[r * k_quads + word / 4u][word % 4u]) * scales[r * p.groups + g];
            }
        }
    }
}

// Stores the staging units in xs and ws to x_t and w_t, transposed.
fn store_chunk(l: u32) {
    for (var n = 0u; n < X_PER; n++) {
        let e = l + n * MM_WG;
        if e < X_UNITS {
            let tq = e / CHUNK_WORDS;
            let q = e % CHUNK_WORDS;
            let v0 = xs[4u * n];
            let v1 = xs[4u * n + 1u];
            let v2 = xs[4u * n + 2u];
            let v3 = xs[4u * n + 3u];
            let o = 4u * q * TOKEN_QUADS + tq;
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
            let a0 = ws[4u * n];
            let a1 = ws[4u * n + 1u];
            let a2 = ws[4u * n + 2u];
            let a3 = ws[4u * n + 3u];
            let o = 4u * v * ROW_QUADS + rq;
            w_t[o] = vec4<f32>(a0.x, a1.x, a2.x, a3.x);
            w_t[o + ROW_QUADS] = vec4<f32>(a0.y, a1.y, a2.y, a3.y);
            w_t[o + 2u * ROW_QUADS] = vec4<f32>(a0.z, a1.z, a2.z, a3.z);
            w_t[o + 3u * ROW_QUADS] = vec4<f32>(a0.w, a1.w, a2.w, a3.w);
        }
    }
}

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
    // acc[(4n + u) * INV_ROW_QUADS + m]: row quad i + m * ROW_BLOCKS for
    // token 4 (j + n * TOKEN_BLOCKS) + u.
    var acc = array<vec4<f32>, INV_ROW_QUADS * INV_TOKENS>();
    // This invocation's row quads at one k.
    var a = array<vec4<f32>, INV_ROW_QUADS>();
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
            for (var m = 0u; m < INV_ROW_QUADS; m++) {
                a[m] = w_t[k * ROW_QUADS + i + m * ROW_BLOCKS];
            }
            for (var n = 0u; n < INV_TOKEN_QUADS; n++) {
                let b = x_t[k * TOKEN_QUADS + j + n * TOKEN_BLOCKS];
                for (var m = 0u; m < INV_ROW_QUADS; m++) {
                    let o = 4u * n * INV_ROW_QUADS + m;
                    acc[o] += a[m] * b.x;
                    acc[o + INV_ROW_QUADS] += a[m] * b.y;
                    acc[o + 2u * INV_ROW_QUADS] += a[m] * b.z;
                    acc[o + 3u * INV_ROW_QUADS] += a[m] * b.w;
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
    for (var n = 0u; n < INV_TOKEN_QUADS; n++) {
        let tq = j + n * TOKEN_BLOCKS;
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
        let t = t0 + 4u * tq;
        for (var u = 0u; u < 4u; u++) {
            for (var m = 0u; m < INV_ROW_QUADS; m++) {
                let v = acc[(4u * n + u) * INV_ROW_QUADS + m] * inv[u];
                let r = row0 + 4u * (i + m * ROW_BLOCKS);
                if SWIGLU {
                    if r + 1u < p.rows {
                        store(r, t + u, v.x, v.y);
                    }
                    if r + 3u < p.rows {
                        store(r + 2u, t + u, v.z, v.w);
                    }
                } else {
                    for (var e = 0u; e < 4u; e++) {
                        if r + e < p.rows {
                            store(r + e, t + u, v[e], 0.0);
                        }
                    }
                }
            }
        }
    }
}
