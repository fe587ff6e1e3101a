// token[0] = argmax(logits[0..n]) (ties -> lowest index), one workgroup.

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> token: array<u32>;

@compute @workgroup_size(WG)
fn argmax(lane: Lane) {
    var best_v = -3.0e38;
    var best_i = 0xffffffffu;
    // Ascending scan with strict '>' keeps the lowest index among equals.
    for (var i = lane.idx; i < p.n; i += WG) {
        let v = logits[i];
        if v > best_v || best_i == 0xffffffffu {
            best_v = v;
            best_i = i;
        }
    }
    let best = wg_argmax(best_v, best_i, lane);
    if lane.idx == 0u {
        token[0] = best;
    }
}
