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
// runs from there. Only the normed variants run tiled (matmul.rs `tiled`),
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
// NORM: lanes per token in the first pass (a power of two dividing SUB).
const TOKEN_LANES: u32 = N_SUB * SUB / MM_TOKENS;
const_assert TOKEN_LANES * MM_TOKENS == N_SUB * SUB && SUB % TOKEN_LANES == 0u;

// w_s[r * CHUNK_K + k]: row r of the tile at the chunk's value k (an A
// operand, row-major).
var<workgroup> w_s: array<f16, MM_ROWS * CHUNK_K>;
// x_s[t * CHUNK_K + k]: token t at value k (a B operand, column-major).
var<workgroup> x_s: array<f16, MM_TOKENS * CHUNK_K>;
// c_s[t * MM_ROWS + r]: the tile's products (column-major).
var<workgroup> c_s: array<f32, MM_ROWS * MM_TOKENS>;
// NORM: token t's rsqrt(mean(x^2) + eps).
var<workgroup> inv_s: array<f32, MM_TOKENS>;

@compute @workgroup_size(WG)
fn int8_matmul(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let row0 = (wg.x + wg.y * nwg.x) * MM_ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    let t0 = wg.z * MM_TOKENS;
    let k_quads = p.k_words / 4u;
    if NORM {
        // TOKEN_LANES neighbouring lanes per token, every lane at once: a
        // token's sum of squares is one round of loads, not one per token.
        let t = l / TOKEN_LANES;
        let xb = (t0 + t) * p.k_words;
        var ss = 0.0;
        for (var q = l % TOKEN_LANES; q < p.k_words; q += TOKEN_LANES) {
            let v = x[xb + q];
            ss += dot(v, v);
        }
        for (var m = 1u; m < TOKEN_LANES; m *= 2u) {
            ss += subgroupShuffleXor(ss, m);
        }
        if l % TOKEN_LANES == 0u {
            inv_s[t] = inverseSqrt(ss / f32(p.n_in) + p.eps);
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
        // Weights: unit e is word v of row r (rows past the matrix repeat
        // its last row; their products are never stored).
        for (var e = l; e < MM_ROWS * CHUNK_WORDS; e += WG) {
            let r = e / CHUNK_WORDS;
            let v = e % CHUNK_WORDS;
            let row = min(row0 + r, p.rows - 1u);
            let word = c * CHUNK_WORDS + v;
            let f = i8x4(w[row * k_quads + word / 4u][word % 4u]) * scales[row * p.groups + word / GROUP_WORDS];
            let o = r * CHUNK_K + 4u * v;
            w_s[o] = f16(f.x);
            w_s[o + 1u] = f16(f.y);
            w_s[o + 2u] = f16(f.z);
            w_s[o + 3u] = f16(f.w);
        }
        // Inputs: unit e is values 4q..4q+3 of token t.
        for (var e = l; e < MM_TOKENS * CHUNK_WORDS; e += WG) {
            let t = e / CHUNK_WORDS;
            let q = e % CHUNK_WORDS;
            var v = x[(t0 + t) * p.k_words + c * CHUNK_WORDS + q];
            if NORM {
                v *= norm_w[c * CHUNK_WORDS + q] * inv_s[t];
            }
            let o = t * CHUNK_K + 4u * q;
            x_s[o] = f16(v.x);
            x_s[o + 1u] = f16(v.y);
            x_s[o + 2u] = f16(v.z);
            x_s[o + 3u] = f16(v.w);
        }
        workgroupBarrier();
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
    for (var e = l; e < MM_ROWS * MM_TOKENS; e += WG) {
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
