// attention_prefill_tiles.wgsl's tiles without cooperative matrices, for
// testing its path where none exist (CI's lavapipe has f16 but no
// cooperative matrices): the same operands read from the same places, each
// tile value a plain f32 sum of f16 x f16 terms in order; "subgroup" sg is
// invocations 32 sg .. 32 sg + 31, each computing 8 of a tile's 256
// values. Selected only by `EngineBuilder::emulate_cooperative_matrices`.
// Preamble (from Rust): `enable f16;`, TOKENS, the generated
// declarations, then attention_prefill_tiles.wgsl.

// K value (position o of tile i, dim d): from the cache or the partial
// tile's copy.
fn k_at(at: Chunk, i: u32, o: u32, d: u32) -> f32 {
    if i < at.full {
        return f32(k16[at.row0 + (16u * i + o) * p.head_dim + d]);
    }
    return f32(t_s[o * p.head_dim + d]);
}

fn v_at(at: Chunk, i: u32, o: u32, d: u32) -> f32 {
    if i < at.full {
        return f32(v16[at.row0 + (16u * i + o) * p.head_dim + d]);
    }
    return f32(t_s[o * p.head_dim + d]);
}

fn score_tile(at: Chunk, i: u32, lane: u32) {
    for (var e = lane; e < 256u; e += 32u) {
        let o = e % 16u;
        let t = e / 16u;
        var s = 0.0;
        for (var d = 0u; d < p.head_dim; d++) {
            s += k_at(at, i, o, d) * f32(qp_s[t * p.head_dim + d]);
        }
        s_s[t * WG + 16u * i + o] = s;
    }
}

fn acc_tile(at: Chunk, dt: u32, lane: u32) {
    for (var e = lane; e < 256u; e += 32u) {
        let d = 16u * dt + e % 16u;
        let t = e / 16u;
        var a = 0.0;
        for (var i = 0u; i < at.tiles; i++) {
            for (var o = 0u; o < 16u; o++) {
                a += v_at(at, i, o, d) * f32(qp_s[t * WG + 16u * i + o]);
            }
        }
        s_s[t * p.head_dim + d] = a;
    }
}

@compute @workgroup_size(WG)
fn attention_prefill(@builtin(local_invocation_index) idx: u32, @builtin(workgroup_id) wg: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>) {
    attend(idx, wg, nwg, idx / 32u, idx % 32u);
}
