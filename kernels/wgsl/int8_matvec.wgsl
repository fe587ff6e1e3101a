// y[row_offset + r] (+)= sum_k w[r][k] * x'[k], ROWS_PER_WG rows per workgroup,
// where x' = x, or with NORM the RMSNorm of x fused in:
// x' = x * rsqrt(mean(x^2) + eps) * norm_w (each workgroup reduces x itself,
// which costs far less than a separate launch).
// w: int8, row-major, rows zero-padded to a multiple of the quant group,
// four values packed per u32 (little-endian); one f32 scale per group.
//
// Two layouts, chosen per matrix by the host (SPLIT_K):
// - rows per team (tall matrices, e.g. the LM head): each team (a subgroup
//   where the device has them) takes blocks of 4 rows; its lanes stride over
//   the row's u32 words (coalesced loads), accumulate the 4 rows at once and
//   reduce with one team_sum4: no barriers, no workgroup memory (the layout
//   of llama.cpp's and MLX's Metal matvecs);
// - split K (matrices with few rows): the workgroup takes 4 rows and all its
//   invocations stride over K, then one workgroup reduction. More
//   workgroups in flight when rows alone cannot fill the GPU.

struct Params {
    rows: u32,       // rows in this launch (a chunk of the matrix)
    k_words: u32,    // padded row length / 4
    groups: u32,     // scales per row
    row_offset: u32, // first output element written
    n_in: u32,       // NORM: elements of x (the padding is zero)
    eps: f32,        // NORM: rms_norm_eps
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
// NORM: the norm weight, zero-padded to k_words * 4 (otherwise unused).
@group(0) @binding(5) var<storage, read> norm_w: array<vec4<f32>>;

// u32 words per quant group (QUANT_GROUP / 4), set from Rust.
override GROUP_WORDS: u32 = 16u;
// Rows per workgroup (a multiple of 4; 4 when SPLIT_K), set from Rust.
override ROWS_PER_WG: u32 = 8u;
override SPLIT_K: bool = false;
override NORM: bool = false;
// true: y += W x (fused residual add); false: y = W x.
override ACCUMULATE: bool = false;

// Partial dot products of rows row0..row0+3 with x over the u32 words
// j = first, first + stride, ... Rows past the end repeat the last row
// (their results are dropped by store4).
fn dot4_rows(row0: u32, first: u32, stride: u32, inv_rms: f32) -> vec4<f32> {
    let r1 = min(row0 + 1u, p.rows - 1u);
    let r2 = min(row0 + 2u, p.rows - 1u);
    let r3 = min(row0 + 3u, p.rows - 1u);
    let b0 = row0 * p.k_words;
    let b1 = r1 * p.k_words;
    let b2 = r2 * p.k_words;
    let b3 = r3 * p.k_words;
    var acc = vec4<f32>(0.0);
    for (var j = first; j < p.k_words; j += stride) {
        var xv = x[j];
        if NORM {
            xv *= inv_rms * norm_w[j];
        }
        let g = j / GROUP_WORDS;
        acc.x += dot(vec4<f32>(unpack4xI8(w[b0 + j])), xv) * scales[row0 * p.groups + g];
        acc.y += dot(vec4<f32>(unpack4xI8(w[b1 + j])), xv) * scales[r1 * p.groups + g];
        acc.z += dot(vec4<f32>(unpack4xI8(w[b2 + j])), xv) * scales[r2 * p.groups + g];
        acc.w += dot(vec4<f32>(unpack4xI8(w[b3 + j])), xv) * scales[r3 * p.groups + g];
    }
    return acc;
}

// Invocation `i` < 4 of the reducing group writes row row0 + i.
fn store4(row0: u32, sums: vec4<f32>, i: u32) {
    if i < 4u && row0 + i < p.rows {
        let o = p.row_offset + row0 + i;
        var v = sums[i];
        if ACCUMULATE {
            v += y[o];
        }
        y[o] = v;
    }
}

@compute @workgroup_size(WG)
fn int8_matvec(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let wg_row0 = (wg.x + wg.y * nwg.x) * ROWS_PER_WG;
    if wg_row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    var inv_rms = 1.0;
    if NORM {
        var ss = vec4<f32>(0.0);
        for (var j = lane.idx; j < p.k_words; j += WG) {
            let v = x[j];
            ss += v * v;
        }
        let t = wg_sum4(ss, lane);
        inv_rms = inverseSqrt((t.x + t.y + t.z + t.w) / f32(p.n_in) + p.eps);
    }
    if SPLIT_K {
        // All invocations share the 4 rows; one workgroup reduction.
        let sums = wg_sum4(dot4_rows(wg_row0, lane.idx, WG, inv_rms), lane);
        store4(wg_row0, sums, lane.idx);
        return;
    }
    // Each team takes whole blocks of 4 rows; a barrier-free team reduction.
    let tl = team_lane(lane);
    for (var rb = team_id(lane) * 4u; rb < ROWS_PER_WG; rb += team_count(lane) * 4u) {
        let row0 = wg_row0 + rb;
        if row0 < p.rows {
            let sums = team_sum4(dot4_rows(row0, tl, team_size(lane), inv_rms), lane);
            store4(row0, sums, tl);
        }
    }
}
