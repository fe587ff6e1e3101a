// First of two argmax launches (ties -> lowest index): workgroup w scans
// logits[w*chunk, (w+1)*chunk) and writes its best (value, index) to
// part_val/part_idx[w]. argmax_final reduces the parts. A single workgroup
// over a 151936-entry vocabulary would leave the GPU idle. Batched (a
// batch of sessions' steps): workgroup (w, 0, z) scans row z of the logits
// (logits[z * n ..]) into part z * (workgroups in x) + w.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> part_val: array<f32>;
@group(0) @binding(3) var<storage, read_write> part_idx: array<u32>;

@compute @workgroup_size(WG)
fn argmax_partial(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = wg.z * p.n;
    let part = wg.z * nwg.x + wg.x;
    let start = wg.x * p.chunk;
    let end = min(p.n, start + p.chunk);
    var best_v = -3.0e38;
    var best_i = NONE;
    // Ascending scan with strict '>' keeps the lowest index among equals.
    for (var i = start + lane.idx; i < end; i += WG) {
        let v = logits[row + i];
        if v > best_v || best_i == NONE {
            best_v = v;
            best_i = i;
        }
    }
    let best = wg_argmax(best_v, best_i, lane);
    if lane.idx == 0u {
        part_idx[part] = best;
        part_val[part] = select(-3.0e38, logits[row + min(best, p.n - 1u)], best != NONE);
    }
}
