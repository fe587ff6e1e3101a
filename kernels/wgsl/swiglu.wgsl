// h[i] = silu(gate[i]) * up[i], with gate_up = [gate (n) | up (n)].

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> h: array<f32>;

@compute @workgroup_size(WG)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < p.n {
        let g = gate_up[i];
        h[i] = g / (1.0 + exp(-g)) * gate_up[p.n + i];
    }
}
