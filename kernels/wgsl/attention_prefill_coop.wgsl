// attention_prefill_tiles.wgsl's tiles on 16x16x16 f16 x f16 + f32
// cooperative matrices (tensor cores on NVIDIA through Vulkan; 32-lane
// subgroups). Preamble (from Rust): `enable f16; enable
// wgpu_cooperative_matrix;`, the diagnostic filter that lets a subgroup's
// tiles branch on the subgroup (uniform in each, all cooperative matrices
// need), TOKENS, the generated declarations, then
// attention_prefill_tiles.wgsl.

// S tile i: positions 16i.. x the tokens, over head_dim in steps of 16.
fn score_tile(at: Chunk, i: u32, lane: u32) {
    let hd = p.head_dim;
    var s = coop_mat16x16<f32, C>();
    if i < at.full {
        let row = at.row0 + 16u * i * hd;
        for (var d = 0u; d < hd; d += 16u) {
            let k = coopLoadT<coop_mat16x16<f16, A>>(&k16[row + d], hd);
            let qt = coopLoad<coop_mat16x16<f16, B>>(&qp_s[d], hd);
            s = coopMultiplyAdd(k, qt, s);
        }
    } else {
        for (var d = 0u; d < hd; d += 16u) {
            let k = coopLoadT<coop_mat16x16<f16, A>>(&t_s[d], hd);
            let qt = coopLoad<coop_mat16x16<f16, B>>(&qp_s[d], hd);
            s = coopMultiplyAdd(k, qt, s);
        }
    }
    // Every argument of a coopStore is a `let`: naga 30 emits a coopStore
    // call's argument expressions after the store itself otherwise.
    let v = s;
    let to = &s_s[16u * i];
    let stride = WG;
    coopStore(v, to, stride);
}

// acc tile d: dims 16d.. x the tokens, over the chunk's tiles.
fn acc_tile(at: Chunk, d: u32, lane: u32) {
    let hd = p.head_dim;
    var a = coop_mat16x16<f32, C>();
    for (var i = 0u; i < at.full; i++) {
        let v = coopLoad<coop_mat16x16<f16, A>>(&v16[at.row0 + 16u * i * hd + 16u * d], hd);
        let w = coopLoad<coop_mat16x16<f16, B>>(&qp_s[16u * i], WG);
        a = coopMultiplyAdd(v, w, a);
    }
    if at.full < at.tiles {
        let v = coopLoad<coop_mat16x16<f16, A>>(&t_s[16u * d], hd);
        let w = coopLoad<coop_mat16x16<f16, B>>(&qp_s[16u * at.full], WG);
        a = coopMultiplyAdd(v, w, a);
    }
    let r = a;
    let to = &s_s[16u * d];
    coopStore(r, to, hd);
}

@compute @workgroup_size(WG)
fn attention_prefill(@builtin(local_invocation_index) idx: u32, @builtin(workgroup_id) wg: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32,
                     @builtin(subgroup_invocation_id) lane: u32) {
    attend(idx, wg, nwg, sg, lane);
}
