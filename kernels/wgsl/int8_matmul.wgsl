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
// int8_common.wgsl, prepended by Rust.
// Preamble (from Rust): MM_ROWS, MM_TOKENS, GROUP_WORDS (u32 words per quant
// group), with (MM_ROWS / 4) * (MM_TOKENS / 4) == WG.

const ROW_QUADS: u32 = MM_ROWS / 4u;
const TOKEN_QUADS: u32 = MM_TOKENS / 4u;
const MM_WG: u32 = ROW_QUADS * TOKEN_QUADS;
// K values per chunk: half a quant group of 64 keeps both staging arrays at
// 8 KB (the quant group divides into whole chunks).
const CHUNK_K: u32 = 32u;
const CHUNK_WORDS: u32 = CHUNK_K / 4u;
// Staging loads of one chunk: inputs as vec4<f32> (4 values), weights as
// vec4<u32> (16 values).
const X_LOADS: u32 = MM_TOKENS * (CHUNK_K / 4u);
const W_LOADS: u32 = MM_ROWS * (CHUNK_K / 16u);
const X_PER: u32 = (X_LOADS + MM_WG - 1u) / MM_WG;
// One weight load per invocation at most (the staging below takes one).
const_assert W_LOADS <= MM_WG;
// w_t[k * ROW_QUADS + q]: rows 4q..4q+3 of the tile at the chunk's value k.
var<workgroup> w_t: array<vec4<f32>, CHUNK_K * ROW_QUADS>;
// x_t[k * TOKEN_QUADS + q]: tokens 4q..4q+3 at the chunk's value k.
var<workgroup> x_t: array<vec4<f32>, CHUNK_K * TOKEN_QUADS>;
// NORM: each staging load's sum of x^2 (token e / (CHUNK_K / 4)).
var<workgroup> ss_s: array<f32, X_LOADS>;

// Token `t`'s output for row `r` (SWIGLU: `r` is a gate row, `up` its up
// row's value).
fn store(r: u32, t: u32, v: f32, up: f32) {
    let yb = t * p.y_stride;
    if SWIGLU {
        y[yb + (p.row_offset + r) / 2u] = silu(v) * up;
        return;
    }
    let o = yb + p.row_offset + r;
    if ACCUMULATE {
        y[o] += v;
    } else {
        y[o] = v;
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
    let k_quads = p.k_words / 4u;
    let i = l % ROW_QUADS;
    let j = l / ROW_QUADS;
    // acc[u]: rows 4i..4i+3 for token 4j + u.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // NORM: this invocation's staging loads' sums of x^2 (the same tokens
    // in every chunk).
    var ss = array<f32, X_PER>();
    let chunks = p.k_words / CHUNK_WORDS;
    for (var c = 0u; c < chunks; c++) {
        workgroupBarrier(); // the previous chunk's readers are done
        // Inputs: load e holds token e / (CHUNK_K / 4), values 4q..4q+3.
        for (var n = 0u; n < X_PER; n++) {
            let e = l + n * MM_WG;
            if e < X_LOADS {
                let t = e / (CHUNK_K / 4u);
                let q = e % (CHUNK_K / 4u);
                var v = x[(t0 + t) * p.k_words + c * CHUNK_WORDS + q];
                if NORM {
                    ss[n] += dot(v, v);
                    v *= norm_w[c * CHUNK_WORDS + q];
                }
                let o = 4u * q * TOKEN_QUADS + t / 4u;
                let lane = t % 4u;
                x_t[o][lane] = v.x;
                x_t[o + TOKEN_QUADS][lane] = v.y;
                x_t[o + 2u * TOKEN_QUADS][lane] = v.z;
                x_t[o + 3u * TOKEN_QUADS][lane] = v.w;
            }
        }
        // Weights: load e holds row e / (CHUNK_K / 16), values 16h..16h+15.
        if l < W_LOADS {
            let r = l / (CHUNK_K / 16u);
            let h = l % (CHUNK_K / 16u);
            let row = min(row0 + r, p.rows - 1u);
            let wv = w[row * k_quads + c * (CHUNK_WORDS / 4u) + h];
            let s = scales[row * p.groups + (c * CHUNK_WORDS) / GROUP_WORDS];
            let vals = array<vec4<f32>, 4>(i8x4(wv.x) * s, i8x4(wv.y) * s, i8x4(wv.z) * s, i8x4(wv.w) * s);
            let o = 16u * h * ROW_QUADS + r / 4u;
            let lane = r % 4u;
            for (var m = 0u; m < 4u; m++) {
                let b = o + 4u * m * ROW_QUADS;
                w_t[b][lane] = vals[m].x;
                w_t[b + ROW_QUADS][lane] = vals[m].y;
                w_t[b + 2u * ROW_QUADS][lane] = vals[m].z;
                w_t[b + 3u * ROW_QUADS][lane] = vals[m].w;
            }
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
            if e < X_LOADS {
                ss_s[e] = ss[n];
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
