// Decode attention, second launch: one workgroup per query head combines
// the chunks attention_partial wrote:
//   M = max_c m_c,  L = sum_c l_c exp(m_c - M),
//   out = sum_c acc_c exp(m_c - M) / L.

struct Params {
    head_dim: u32,
    n_chunks: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part_ml: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> part_acc: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn attention_reduce(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let h = wg.x;
    let base = h * p.n_chunks;
    var big_m = -3.0e38;
    for (var c = 0u; c < p.n_chunks; c++) {
        big_m = max(big_m, part_ml[base + c].x);
    }
    var big_l = 0.0;
    for (var c = 0u; c < p.n_chunks; c++) {
        let ml = part_ml[base + c];
        if ml.y > 0.0 {
            big_l += ml.y * exp(ml.x - big_m);
        }
    }
    for (var d = lane.idx; d < p.head_dim; d += WG) {
        var o = 0.0;
        for (var c = 0u; c < p.n_chunks; c++) {
            let ml = part_ml[base + c];
            if ml.y > 0.0 {
                o += part_acc[(base + c) * p.head_dim + d] * exp(ml.x - big_m);
            }
        }
        out[h * p.head_dim + d] = o / big_l;
    }
}
