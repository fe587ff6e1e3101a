// A constraint's token mask, in place on the logits, before every other
// launch that chooses the token (penalties, sampler, argmax): a token whose
// bit is clear gets -inf, so no path can choose it. One bit per token, bit
// t % 32 of word t / 32 (llguidance's layout); one invocation per token.
// Params: generated from its Rust definition (src/kernels/mask.rs),
// prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mask: array<u32>;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;

@compute @workgroup_size(WG)
fn logits_mask(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let t = wg.x * WG + lane.idx;
    if t < p.n && (mask[t / 32u] & (1u << (t % 32u))) == 0u {
        logits[t] = bitcast<f32>(p.masked_bits);
    }
}
