// Prompt batches: the prefill pipelines of int8_matvec's variants, as a
// tiled matrix-matrix product. Workgroup (x, z) computes
//   y[t][row_offset + r] (+)= sum_k w[r][k] * x'[t][k]
// for the MM_ROWS rows from x * MM_ROWS and the MM_TOKENS tokens from
// z * MM_TOKENS (x' = x, or with NORM the token's RMSNorm of x, as in
// int8_matvec). K runs in chunks of one quant group: the chunk's weights
// (converted to f32 once, times their scale) and inputs (normed once) are
// staged in workgroup memory, then invocation (i, j) adds rows 2i, 2i+1 for
// tokens 2j, 2j+1 from there. Each weight is read from memory once per
// MM_TOKENS tokens, each input once per MM_ROWS rows: the per-token matvec
// re-reads the inputs for every 4 rows, which is what bounds it on a batch.
// Same bindings, params and epilogues (ACCUMULATE, NORM, SWIGLU; token t's
// inputs at x[t * k_words ..], outputs at y[t * y_stride ..]) as int8_matvec:
// int8_common.wgsl, prepended by Rust.
// Preamble (from Rust): MM_ROWS, MM_TOKENS, GROUP_WORDS (u32 words per quant
// group), with (MM_ROWS / 2) * (MM_TOKENS / 2) == WG.

const ROW_PAIRS: u32 = MM_ROWS / 2u;
const TOKEN_PAIRS: u32 = MM_TOKENS / 2u;
// vec4s of one row's (or token's) chunk; rows padded by one so the row
// pairs' reads spread over the memory banks.
const CHUNK: u32 = GROUP_WORDS;
const STRIDE: u32 = GROUP_WORDS + 1u;
// The chunk's weights (f32, scaled): even rows, odd rows.
var<workgroup> w_even: array<vec4<f32>, ROW_PAIRS * STRIDE>;
var<workgroup> w_odd: array<vec4<f32>, ROW_PAIRS * STRIDE>;
// The chunk's (normed) inputs, token t at t * CHUNK.
var<workgroup> x_s: array<vec4<f32>, MM_TOKENS * CHUNK>;
// NORM: per-invocation sums of x^2, then per token.
var<workgroup> ss_s: array<f32, MM_TOKENS * CHUNK>;

// Token `t`'s output for row `r` of the tile (rows past the matrix are
// skipped); SWIGLU: `r` is a gate row, `r + 1` its up row.
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
    let i = l % ROW_PAIRS;
    let j = l / ROW_PAIRS;
    var acc = vec4<f32>(0.0); // (row 2i, token 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1)
    if NORM {
        // Each invocation sums into its own staging slots (workgroup memory
        // starts undefined).
        for (var e = l; e < MM_TOKENS * CHUNK; e += WG) {
            ss_s[e] = 0.0;
        }
    }
    for (var c = 0u; c < p.groups; c++) {
        workgroupBarrier(); // the previous chunk's readers are done
        // Inputs: MM_TOKENS x CHUNK vec4s, normed and squared on the way.
        for (var e = l; e < MM_TOKENS * CHUNK; e += WG) {
            let t = e / CHUNK;
            let q = e % CHUNK;
            var v = x[(t0 + t) * p.k_words + c * CHUNK + q];
            if NORM {
                ss_s[e] += dot(v, v);
                v *= norm_w[c * CHUNK + q];
            }
            x_s[e] = v;
        }
        // Weights: MM_ROWS rows x GROUP_WORDS words, 4 words per load.
        for (var e = l; e < MM_ROWS * (CHUNK / 4u); e += WG) {
            let r = e / (CHUNK / 4u);
            let q = e % (CHUNK / 4u);
            let row = min(row0 + r, p.rows - 1u);
            let wv = w[row * k_quads + c * (CHUNK / 4u) + q];
            let s = scales[row * p.groups + c];
            let o = (r / 2u) * STRIDE + 4u * q;
            let vals = array<vec4<f32>, 4>(i8x4(wv.x) * s, i8x4(wv.y) * s, i8x4(wv.z) * s, i8x4(wv.w) * s);
            for (var k = 0u; k < 4u; k++) {
                if r % 2u == 0u {
                    w_even[o + k] = vals[k];
                } else {
                    w_odd[o + k] = vals[k];
                }
            }
        }
        workgroupBarrier();
        let wb = i * STRIDE;
        let xa = (2u * j) * CHUNK;
        let xb = xa + CHUNK;
        for (var q = 0u; q < CHUNK; q++) {
            let a = w_even[wb + q];
            let b = w_odd[wb + q];
            let u = x_s[xa + q];
            let v = x_s[xb + q];
            acc += vec4<f32>(dot(a, u), dot(a, v), dot(b, u), dot(b, v));
        }
    }
    var inv = vec2<f32>(1.0);
    if NORM {
        // Token t's sum of x^2 is spread over ss_s[t * CHUNK ..][..CHUNK].
        workgroupBarrier();
        var s = vec2<f32>(0.0);
        for (var q = 0u; q < CHUNK; q++) {
            s += vec2<f32>(ss_s[2u * j * CHUNK + q], ss_s[(2u * j + 1u) * CHUNK + q]);
        }
        inv = inverseSqrt(s / f32(p.n_in) + p.eps);
    }
    let r = row0 + 2u * i;
    let t = t0 + 2u * j;
    if SWIGLU {
        if r + 1u < p.rows {
            store(r, t, acc.x * inv.x, acc.z * inv.x);
            store(r, t + 1u, acc.y * inv.y, acc.w * inv.y);
        }
        return;
    }
    if r < p.rows {
        store(r, t, acc.x * inv.x, 0.0);
        store(r, t + 1u, acc.y * inv.y, 0.0);
    }
    if r + 1u < p.rows {
        store(r + 1u, t, acc.z * inv.x, 0.0);
        store(r + 1u, t + 1u, acc.w * inv.y, 0.0);
    }
}
