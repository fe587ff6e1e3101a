// out[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * weight, one workgroup
// per row of n elements.

struct Params {
    n: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn rms_norm(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let base = wg.x * p.n;
    var ss = 0.0;
    for (var i = lane.idx; i < p.n; i += WG) {
        let v = x[base + i];
        ss += v * v;
    }
    let total = wg_sum4(vec4<f32>(ss, 0.0, 0.0, 0.0), lane).x;
    let inv = inverseSqrt(total / f32(p.n) + p.eps);
    for (var i = lane.idx; i < p.n; i += WG) {
        out[base + i] = x[base + i] * inv * weight[i];
    }
}
