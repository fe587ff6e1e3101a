// Second argmax launch: one workgroup reduces the parts argmax_partial wrote
// into token[0] (largest value; ties -> lowest token index).

struct Params {
    n: u32, // parts
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part_val: array<f32>;
@group(0) @binding(2) var<storage, read> part_idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> token: array<u32>;

const NONE: u32 = 0xffffffffu;

@compute @workgroup_size(WG)
fn argmax_final(lane: Lane) {
    var best_v = -3.0e38;
    var best_i = NONE;
    for (var k = lane.idx; k < p.n; k += WG) {
        let v = part_val[k];
        let i = part_idx[k];
        if i != NONE && (best_i == NONE || v > best_v || (v == best_v && i < best_i)) {
            best_v = v;
            best_i = i;
        }
    }
    let best = wg_argmax(best_v, best_i, lane);
    if lane.idx == 0u {
        token[0] = best;
    }
}
