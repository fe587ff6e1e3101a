// Second argmax launch: one workgroup reduces the parts argmax_partial wrote
// (largest value; ties -> lowest token index), then advances the decode
// position kept on the GPU: tokens[pos + 1] = the greedy token (unless that
// position still holds a prompt token, pos + 1 < fill_end) and pos += 1.
// The next step's embedding reads tokens[pos], so steps queue up on the GPU
// without the host reading anything in between. Batched (a batch of
// sessions' steps, grid z = rows): workgroup z reduces row z's parts
// (part_val[z * n ..]) into tokens[pos + 1 + z], and the position is left
// as it was (the host sets it for each batch step).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part_val: array<f32>;
@group(0) @binding(2) var<storage, read> part_idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> step: Step;

@compute @workgroup_size(WG)
fn argmax_final(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let z = wg.z;
    var best_v = -3.0e38;
    var best_i = NONE;
    for (var k = lane.idx; k < p.n; k += WG) {
        let v = part_val[z * p.n + k];
        let i = part_idx[z * p.n + k];
        if i != NONE && (best_i == NONE || v > best_v || (v == best_v && i < best_i)) {
            best_v = v;
            best_i = i;
        }
    }
    let best = wg_argmax(best_v, best_i, lane);
    if lane.idx == 0u {
        let next = step.pos + 1u;
        if next >= step.fill_end && next + z < p.n_tokens {
            tokens[next + z] = best;
        }
        if nwg.z == 1u {
            step.pos = next;
        }
    }
}
