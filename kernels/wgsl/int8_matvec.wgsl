// y[row_offset + r] (+)= sum_k w[r][k] * x[k] for ROWS rows per workgroup.
// w: int8, row-major, rows zero-padded to a multiple of the quant group,
// four values packed per u32 (little-endian). One f32 scale per group.
// Invocations stride over the row's u32 words, so loads are coalesced;
// every invocation accumulates all ROWS rows, then one workgroup reduction.

struct Params {
    rows: u32,       // rows in this launch (a chunk of the matrix)
    k_words: u32,    // padded row length / 4
    groups: u32,     // scales per row
    row_offset: u32, // first output element written
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

// u32 words per quant group (QUANT_GROUP / 4), set from Rust.
override GROUP_WORDS: u32 = 16u;
// true: y += W x (fused residual add); false: y = W x.
override ACCUMULATE: bool = false;

const ROWS: u32 = 4u;

@compute @workgroup_size(WG)
fn int8_matvec(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row0 = (wg.x + wg.y * nwg.x) * ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    // Rows past the end repeat the last row; their results are dropped.
    var base: array<u32, 4>;
    var sbase: array<u32, 4>;
    for (var r = 0u; r < ROWS; r++) {
        let row = min(row0 + r, p.rows - 1u);
        base[r] = row * p.k_words;
        sbase[r] = row * p.groups;
    }
    var acc = vec4<f32>(0.0);
    for (var j = lane.idx; j < p.k_words; j += WG) {
        let xv = x[j];
        let g = j / GROUP_WORDS;
        acc.x += dot(vec4<f32>(unpack4xI8(w[base[0] + j])), xv) * scales[sbase[0] + g];
        acc.y += dot(vec4<f32>(unpack4xI8(w[base[1] + j])), xv) * scales[sbase[1] + g];
        acc.z += dot(vec4<f32>(unpack4xI8(w[base[2] + j])), xv) * scales[sbase[2] + g];
        acc.w += dot(vec4<f32>(unpack4xI8(w[base[3] + j])), xv) * scales[sbase[3] + g];
    }
    let s = wg_sum4(acc, lane);
    if lane.idx < ROWS && row0 + lane.idx < p.rows {
        let o = p.row_offset + row0 + lane.idx;
        var v = s[lane.idx];
        if ACCUMULATE {
            v += y[o];
        }
        y[o] = v;
    }
}
