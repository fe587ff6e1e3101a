// Decode attention, second launch: one workgroup per query head combines
// the chunks attention_partial wrote:
//   M = max_c m_c,  L = sum_c l_c exp(m_c - M),
//   out = sum_c acc_c exp(m_c - M) / L.
// M and L are reduced over the workgroup (one chunk per invocation), so
// each invocation's output loop is a single pass over the chunks, four
// independent loads at a time. Batched (prefill): workgroup (h, 0, z)
// combines token z's chunks into out[z * out_stride ..].
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part_ml: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> part_acc: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// exp(m_c - M) for chunk c (0 for a chunk past the context, l_c = 0).
fn weight(ml: vec2<f32>, big_m: f32) -> f32 {
    return select(0.0, exp(ml.x - big_m), ml.y > 0.0);
}

// a * exp(m_c - M), or 0 for a chunk past the context (whose acc was never
// written and may hold anything).
fn term(a: f32, ml: vec2<f32>, big_m: f32) -> f32 {
    return select(0.0, a * exp(ml.x - big_m), ml.y > 0.0);
}

@compute @workgroup_size(WG)
fn attention_reduce(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let z = wg.z;
    let base = (z * nwg.x + h) * p.n_chunks;
    var m = -3.0e38;
    for (var c = lane.idx; c < p.n_chunks; c += WG) {
        m = max(m, part_ml[base + c].x);
    }
    let big_m = wg_max(m, lane);
    var l = 0.0;
    for (var c = lane.idx; c < p.n_chunks; c += WG) {
        let ml = part_ml[base + c];
        l += ml.y * weight(ml, big_m);
    }
    let big_l = wg_sum4(vec4<f32>(l, 0.0, 0.0, 0.0), lane).x;
    for (var d = lane.idx; d < p.head_dim; d += WG) {
        let a = base * p.head_dim + d;
        var o = 0.0;
        var c = 0u;
        for (; c + 3u < p.n_chunks; c += 4u) {
            let a0 = part_acc[a + c * p.head_dim];
            let a1 = part_acc[a + (c + 1u) * p.head_dim];
            let a2 = part_acc[a + (c + 2u) * p.head_dim];
            let a3 = part_acc[a + (c + 3u) * p.head_dim];
            o += term(a0, part_ml[base + c], big_m) + term(a1, part_ml[base + c + 1u], big_m)
                + term(a2, part_ml[base + c + 2u], big_m) + term(a3, part_ml[base + c + 3u], big_m);
        }
        for (; c < p.n_chunks; c++) {
            o += term(part_acc[a + c * p.head_dim], part_ml[base + c], big_m);
        }
        out[z * p.out_stride + h * p.head_dim + d] = o / big_l;
    }
}
