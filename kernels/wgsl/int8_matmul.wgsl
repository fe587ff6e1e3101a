// Prompt batches: the prefill pipelines of int8_matvec's variants, as a
// tiled matrix-matrix product. Workgroup (x, z) computes
//   y[t][row_offset + r] (+)= sum_k w[r][k] * x'[t][k]
// for the MM_ROWS rows from x * MM_ROWS and the MM_TOKENS tokens from
// z * MM_TOKENS (x' = x, or with NORM the token's RMSNorm of x, as in
// int8_matvec). K runs in chunks of CHUNK_K values: the chunk's weights
// (converted to f32 once, times their scale) and inputs (normed once) are
// staged in workgroup memory transposed, k-major, so that invocation (i, j)
// reads one vec4 of rows 4i..4i+3 and one of tokens 4j..4j+3 per k and adds
// their outer product: 2 workgroup loads per 16 multiply-adds. Each weight
// is read from memory once per MM_TOKENS tokens, each input once per
// MM_ROWS rows.
// Same bindings, params and epilogues (ACCUMULATE, NORM, SWIGLU; token t's
// inputs at x[t * k_words ..], outputs at y[t * y_stride ..]) as int8_matvec:
// int8_common.wgsl, then int8_matmul_common.wgsl (the stores), prepended by
// Rust.
// Preamble (from Rust): MM_ROWS, MM_TOKENS, GROUP_WORDS (u32 words per quant
// group), with (MM_ROWS / 4) * (MM_TOKENS / 4) == WG.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

const ROW_QUADS: u32 = MM_ROWS / 4u;
const TOKEN_QUADS: u32 = MM_TOKENS / 4u;
const MM_WG: u32 = ROW_QUADS * TOKEN_QUADS;
// K values per chunk: half a quant group of 64 keeps both staging arrays at
// 8 KB (the quant group divides into whole chunks).
const CHUNK_K: u32 = 32u;
const CHUNK_WORDS: u32 = CHUNK_K / 4u;
// Staging of one chunk. Each staged vec4 is written whole by one
// invocation (invocations writing different components of one vector could
// be compiled to read-modify-writes that lose each other's components), so
// a staging unit loads four tokens' or four rows' values and transposes
// them itself. Input unit: tokens 4tq..4tq+3 at values 4q..4q+3 (four
// vec4<f32> loads); weight unit: rows 4rq..4rq+3 at values 4v..4v+3 (one
// u32 word of each row).
const X_LOADS: u32 = MM_TOKENS * (CHUNK_K / 4u);
const X_UNITS: u32 = TOKEN_QUADS * CHUNK_WORDS;
const W_UNITS: u32 = ROW_QUADS * CHUNK_WORDS;
const X_PER: u32 = (X_UNITS + MM_WG - 1u) / MM_WG;
// One weight unit per invocation at most (the staging below takes one).
const_assert W_UNITS <= MM_WG;
// w_t[k * ROW_QUADS + q]: rows 4q..4q+3 of the tile at the chunk's value k.
var<workgroup> w_t: array<vec4<f32>, CHUNK_K * ROW_QUADS>;
// x_t[k * TOKEN_QUADS + q]: tokens 4q..4q+3 at the chunk's value k.
var<workgroup> x_t: array<vec4<f32>, CHUNK_K * TOKEN_QUADS>;
// NORM: each token's sums of x^2 over values 4q..4q+3 of every chunk, at
// token * (CHUNK_K / 4) + q.
var<workgroup> ss_s: array<f32, X_LOADS>;

@compute @workgroup_size(WG)
fn int8_matmul(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row0 = (wg.x + wg.y * nwg.x) * MM_ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    let t0 = wg.z * MM_TOKENS;
    let k_quads = p.k_words / 4u;
    let i = l % ROW_QUADS;
    let j = l / ROW_QUADS;
    // acc[u]: rows 4i..4i+3 for token 4j + u.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // NORM: this invocation's input units' sums of x^2, one per token (the
    // same tokens and values mod CHUNK_K in every chunk).
    var ss = array<vec4<f32>, X_PER>();
    let chunks = p.k_words / CHUNK_WORDS;
    for (var c = 0u; c < chunks; c++) {
        workgroupBarrier(); // the previous chunk's readers are done
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
                let o = 4u * q * TOKEN_QUADS + tq;
                x_t[o] = vec4<f32>(v0.x, v1.x, v2.x, v3.x);
                x_t[o + TOKEN_QUADS] = vec4<f32>(v0.y, v1.y, v2.y, v3.y);
                x_t[o + 2u * TOKEN_QUADS] = vec4<f32>(v0.z, v1.z, v2.z, v3.z);
                x_t[o + 3u * TOKEN_QUADS] = vec4<f32>(v0.w, v1.w, v2.w, v3.w);
            }
        }
        // Weights: unit l holds rows 4rq..4rq+3 at values 4v..4v+3 (word v
        // of the chunk; rows past the matrix repeat its last row).
        if l < W_UNITS {
            let rq = l / CHUNK_WORDS;
            let v = l % CHUNK_WORDS;
            let word = c * CHUNK_WORDS + v;
            let g = (c * CHUNK_WORDS) / GROUP_WORDS;
            let r0 = min(row0 + 4u * rq, p.rows - 1u);
            let r1 = min(row0 + 4u * rq + 1u, p.rows - 1u);
            let r2 = min(row0 + 4u * rq + 2u, p.rows - 1u);
            let r3 = min(row0 + 4u * rq + 3u, p.rows - 1u);
            let a0 = i8x4(w[r0 * k_quads + word / 4u][word % 4u]) * scales[r0 * p.groups + g];
            let a1 = i8x4(w[r1 * k_quads + word / 4u][word % 4u]) * scales[r1 * p.groups + g];
            let a2 = i8x4(w[r2 * k_quads + word / 4u][word % 4u]) * scales[r2 * p.groups + g];
            let a3 = i8x4(w[r3 * k_quads + word / 4u][word % 4u]) * scales[r3 * p.groups + g];
            let o = 4u * v * ROW_QUADS + rq;
            w_t[o] = vec4<f32>(a0.x, a1.x, a2.x, a3.x);
            w_t[o + ROW_QUADS] = vec4<f32>(a0.y, a1.y, a2.y, a3.y);
            w_t[o + 2u * ROW_QUADS] = vec4<f32>(a0.z, a1.z, a2.z, a3.z);
            w_t[o + 3u * ROW_QUADS] = vec4<f32>(a0.w, a1.w, a2.w, a3.w);
        }
        workgroupBarrier();
        for (var k = 0u; k < CHUNK_K; k++) {
            let a = w_t[k * ROW_QUADS + i];
            let b = x_t[k * TOKEN_QUADS + j];
            acc0 += a * b.x;
            acc1 += a * b.y;
            acc2 += a * b.z;
            acc3 += a * b.w;
        }
    }
    var inv = vec4<f32>(1.0);
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
        // Token t's sum of x^2 is spread over ss_s[t * (CHUNK_K / 4) ..].
        var s = vec4<f32>(0.0);
        for (var q = 0u; q < CHUNK_K / 4u; q++) {
            let b = 4u * j * (CHUNK_K / 4u) + q;
            s += vec4<f32>(ss_s[b], ss_s[b + CHUNK_K / 4u], ss_s[b + 2u * (CHUNK_K / 4u)],
                           ss_s[b + 3u * (CHUNK_K / 4u)]);
        }
        inv = inverseSqrt(s / f32(p.n_in) + p.eps);
    }
    let accs = array<vec4<f32>, 4>(acc0 * inv.x, acc1 * inv.y, acc2 * inv.z, acc3 * inv.w);
    let r = row0 + 4u * i;
    let t = t0 + 4u * j;
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
