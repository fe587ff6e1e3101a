// int8_matmul_coop's product without cooperative matrices, for testing
// its path where none exist (CI's lavapipe has f16 but no cooperative
// matrices): the same staged f16 operands (f16_stage.wgsl), bindings, tile,
// grid and epilogue; each product a plain f32 sum of f16 x f16 terms over
// k in order. Selected only by `EngineBuilder::emulate_cooperative_matrices`.
// Preamble (from Rust): `enable f16;`, MM_ROWS, MM_TOKENS, the generated
// Params, int8_math.wgsl, int8_matmul_common.wgsl and
// int8_matmul_coop_tile.wgsl.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x16: array<f16>;
@group(0) @binding(2) var<storage, read> w16: array<f16>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

// Value (r, k) of a blocked operand whose rows are `blocks` blocks long.
fn blocked(r: u32, k: u32, blocks: u32) -> u32 {
    return ((r / 16u) * blocks + k / 16u) * 256u + (r % 16u) * 16u + k % 16u;
}

@compute @workgroup_size(COOP_WG)
fn int8_matmul(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row0 = (wg.x + wg.y * nwg.x) * MM_ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    let blocks = p.k_words / 4u;
    for (var e = l; e < MM_ROWS * MM_TOKENS; e += COOP_WG) {
        let r = row0 + e % MM_ROWS;
        let t = wg.z * MM_TOKENS + e / MM_ROWS;
        var sum = 0.0;
        for (var k = 0u; k < blocks * 16u; k++) {
            sum += f32(w16[blocked(r, k, blocks)]) * f32(x16[blocked(t, k, blocks)]);
        }
        c_s[e] = sum;
    }
    workgroupBarrier();
    store_tile(l, row0, wg.z);
}
