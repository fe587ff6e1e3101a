// Prompt batches on cooperative matrices: int8_matmul's product (same tile,
// grid, bindings, params and epilogues; workgroup (x, z) computes
//   y[t][row_offset + r] (+)= sum_k w[r][k] * x'[t][k]
// for the MM_ROWS rows from x * MM_ROWS and the MM_TOKENS tokens from
// z * MM_TOKENS) with 16x16x16 f16 x f16 + f32 subgroup matrices (tensor
// cores on NVIDIA through Vulkan), for adapters that offer them with
// 32-lane subgroups. Each subgroup owns a block of SUB rows x SUB tokens as
// 2 x 2 accumulators.
// K runs in chunks of CHUNK_K values staged in workgroup memory as f16:
// the weights dequantised (int8 * scale), the inputs normed first (NORM:
// each token's rsqrt(mean(x^2) + eps) from a first pass, then
// x * norm_w * rsqrt): both O(1), far inside f16's range, with 11
// significant bits, so a dot product is off by ~1e-4 of its terms'
// magnitude (the self-check allows 1e-3). The accumulators land in
// workgroup memory and the epilogue (ACCUMULATE, SWIGLU, the row bounds)
// runs from there. Only the SwiGLU variant runs it (matmul.rs `coop_pays`),
// so NORM is always set here.
// Preamble (from Rust): `enable f16; enable wgpu_cooperative_matrix;`,
// MM_ROWS, MM_TOKENS (multiples of SUB), GROUP_WORDS, the WG override
// (= (MM_ROWS / SUB) * (MM_TOKENS / SUB) * 32), the generated Params,
// int8_common.wgsl and int8_matmul_common.wgsl.

const SUB: u32 = 32u;
const SUB_ROWS: u32 = MM_ROWS / SUB;
const N_SUB: u32 = SUB_ROWS * (MM_TOKENS / SUB);
const CHUNK_K: u32 = 32u;
const CHUNK_WORDS: u32 = CHUNK_K / 4u;
const_assert MM_ROWS % SUB == 0u && MM_TOKENS % SUB == 0u;
const_assert GROUP_WORDS % CHUNK_WORDS == 0u;
// The workgroup: one subgroup per block (the WG override is set to this).
const COOP_WG: u32 = N_SUB * SUB;
// NORM: lanes per token in the first pass, each summing 8 loads at once.
const TOKEN_LANES: u32 = COOP_WG / MM_TOKENS;
const_assert TOKEN_LANES * MM_TOKENS == COOP_WG && GROUP_WORDS % (8u * TOKEN_LANES) == 0u;
// A chunk's staging units per invocation: weight units of 16 values (one
// vec4<u32>, row r, words 4j..4j+3 of the chunk) and input units of 4
// (one vec4<f32>, token t, values 4q..4q+3).
const W_UNITS: u32 = MM_ROWS * (CHUNK_WORDS / 4u);
const W_PER: u32 = W_UNITS / COOP_WG;
const X_UNITS: u32 = MM_TOKENS * CHUNK_WORDS;
const X_PER: u32 = X_UNITS / COOP_WG;
const_assert W_PER * COOP_WG == W_UNITS && X_PER * COOP_WG == X_UNITS;

// w_s[r * CHUNK_K + k]: row r of the tile at the chunk's value k (an A
// operand, row-major).
var<workgroup> w_s: array<f16, MM_ROWS * CHUNK_K>;
// x_s[t * CHUNK_K + k]: token t at value k (a B operand, column-major).
var<workgroup> x_s: array<f16, MM_TOKENS * CHUNK_K>;
// c_s[t * MM_ROWS + r]: the tile's products (column-major).
var<workgroup> c_s: array<f32, MM_ROWS * MM_TOKENS>;
// NORM: token t's rsqrt(mean(x^2) + eps).
var<workgroup> inv_s: array<f32, MM_TOKENS>;

// One chunk's raw weights, scales, inputs and norm weights, held in
// registers: loaded while the previous chunk multiplies.
struct Chunk {
    w: array<vec4<u32>, W_PER>,
    s: array<f32, W_PER>,
    x: array<vec4<f32>, X_PER>,
    n: array<vec4<f32>, X_PER>,
}

fn load_chunk(c: u32, l: u32, row0: u32, t0: u32) -> Chunk {
    var ch: Chunk;
    let k_quads = p.k_words / 4u;
    for (var i = 0u; i < W_PER; i++) {
        let e = l + i * COOP_WG;
        // Rows past the matrix repeat its last row (never stored).
        let row = min(row0 + e / (CHUNK_WORDS / 4u), p.rows - 1u);
        let quad = c * (CHUNK_WORDS / 4u) + e % (CHUNK_WORDS / 4u);
        ch.w[i] = w[row * k_quads + quad];
        ch.s[i] = scales[row * p.groups + (4u * quad) / GROUP_WORDS];
    }
    for (var i = 0u; i < X_PER; i++) {
        let e = l + i * COOP_WG;
        let q = c * CHUNK_WORDS + e % CHUNK_WORDS;
        ch.x[i] = x[(t0 + e / CHUNK_WORDS) * p.k_words + q];
        if NORM {
            ch.n[i] = norm_w[q];
        }
    }
    return ch;
}

// Writes a loaded chunk to workgroup memory as f16: weights times their
// scale, inputs (NORM) normed.
fn stage_chunk(ch: Chunk, l: u32) {
    for (var i = 0u; i < W_PER; i++) {
        let e = l + i * COOP_WG;
        let o = (e / (CHUNK_WORDS / 4u)) * CHUNK_K + 16u * (e % (CHUNK_WORDS / 4u));
        for (var j = 0u; j < 4u; j++) {
            let f = i8x4(ch.w[i][j]) * ch.s[i];
            w_s[o + 4u * j] = f16(f.x);
            w_s[o + 4u * j + 1u] = f16(f.y);
            w_s[o + 4u * j + 2u] = f16(f.z);
            w_s[o + 4u * j + 3u] = f16(f.w);
        }
    }
    for (var i = 0u; i < X_PER; i++) {
        let e = l + i * COOP_WG;
        let t = e / CHUNK_WORDS;
        var v = ch.x[i];
        if NORM {
            v *= ch.n[i] * inv_s[t];
        }
        let o = t * CHUNK_K + 4u * (e % CHUNK_WORDS);
        x_s[o] = f16(v.x);
        x_s[o + 1u] = f16(v.y);
        x_s[o + 2u] = f16(v.z);
        x_s[o + 3u] = f16(v.w);
    }
}

@compute @workgroup_size(COOP_WG)
fn int8_matmul(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let row0 = (wg.x + wg.y * nwg.x) * MM_ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    let t0 = wg.z * MM_TOKENS;
    var ch = load_chunk(0u, l, row0, t0);
    if NORM {
        // TOKEN_LANES neighbouring lanes per token, 8 independent loads
        // in flight per lane (a row's words are a multiple of 16).
        let t = l / TOKEN_LANES;
        let xb = (t0 + t) * p.k_words;
        var ss = vec4<f32>(0.0);
        for (var q = l % TOKEN_LANES; q < p.k_words; q += 8u * TOKEN_LANES) {
            var v: array<vec4<f32>, 8>;
            for (var u = 0u; u < 8u; u++) {
                v[u] = x[xb + q + u * TOKEN_LANES];
            }
            for (var u = 0u; u < 8u; u += 2u) {
                ss += vec4<f32>(dot(v[u], v[u]), dot(v[u + 1u], v[u + 1u]), 0.0, 0.0);
            }
        }
        var sum = ss.x + ss.y;
        for (var m = 1u; m < TOKEN_LANES; m *= 2u) {
            sum += subgroupShuffleXor(sum, m);
        }
        if l % TOKEN_LANES == 0u {
            inv_s[t] = inverseSqrt(sum / f32(p.n_in) + p.eps);
        }
    }
    // This subgroup's block: rows sr.., tokens st.. of the tile.
    let sr = (sg % SUB_ROWS) * SUB;
    let st = (sg / SUB_ROWS) * SUB;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    let chunks = p.k_words / CHUNK_WORDS;
    for (var c = 0u; c < chunks; c++) {
        workgroupBarrier(); // the previous chunk's readers are done (and inv_s is written)
        stage_chunk(ch, l);
        workgroupBarrier();
        if c + 1u < chunks {
            ch = load_chunk(c + 1u, l, row0, t0); // in flight during the products
        }
        for (var kk = 0u; kk < CHUNK_K; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&w_s[sr * CHUNK_K + kk], CHUNK_K);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&w_s[(sr + 16u) * CHUNK_K + kk], CHUNK_K);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&x_s[st * CHUNK_K + kk], CHUNK_K);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&x_s[(st + 16u) * CHUNK_K + kk], CHUNK_K);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
    }
    // Every argument of a coopStore is a `let`: naga 30 emits a coopStore
    // call's argument expressions after the store itself otherwise.
    let stride = MM_ROWS;
    let b = st * MM_ROWS + sr;
    let v00 = c00;
    let v01 = c01;
    let v10 = c10;
    let v11 = c11;
    let p00 = &c_s[b];
    let p10 = &c_s[b + 16u];
    let p01 = &c_s[b + 16u * MM_ROWS];
    let p11 = &c_s[b + 16u * MM_ROWS + 16u];
    coopStore(v00, p00, stride);
    coopStore(v10, p10, stride);
    coopStore(v01, p01, stride);
    coopStore(v11, p11, stride);
    workgroupBarrier();
    for (var e = l; e < MM_ROWS * MM_TOKENS; e += COOP_WG) {
        let r = e % MM_ROWS;
        let row = row0 + r;
        let t = t0 + e / MM_ROWS;
        if SWIGLU {
            // Even rows are gates, each followed by its up row.
            if r % 2u == 0u && row + 1u < p.rows {
                store(row, t, c_s[e], c_s[e + 1u]);
            }
        } else if row < p.rows {
            store(row, t, c_s[e], 0.0);
        }
    }
}
