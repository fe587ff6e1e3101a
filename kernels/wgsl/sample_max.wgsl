// The largest logit of each chunk of p.chunk logits (one workgroup each),
// to scratch[wg]: the sampler's later launches reduce them to M, the scale
// of the masses exp((l - M) / T) and the base of min-p's threshold.
// Params: generated from its Rust definition (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> scratch: array<u32>;

@compute @workgroup_size(WG)
fn sample_max(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let start = wg.x * p.chunk;
    let end = min(p.n, start + p.chunk);
    var m = -3.0e38;
    for (var i = start + lane.idx; i < end; i += WG) {
        m = max(m, logits[i]);
    }
    m = wg_max(m, lane);
    if lane.idx == 0u {
        scratch[wg.x] = bitcast<u32>(m);
    }
}
