// Prompt batches on cooperative matrices: int8_matmul's product, from
// operands that f16_stage.wgsl staged as f16 in 16 x 16 blocks (the launch's
// weights dequantised, the batch's inputs normed), with 16x16x16
// f16 x f16 + f32 subgroup matrices (tensor cores on NVIDIA through
// Vulkan), for adapters that offer them with 32-lane subgroups. Workgroup
// (x, z) computes
//   y[t][row_offset + r] (+)= sum_k w16[r][k] * x16[t][k]
// for the MM_ROWS = 64 rows from x * 64 and the MM_TOKENS = 64 tokens from
// z * 64, with the epilogues of int8_matmul (int8_matmul_common.wgsl).
// 2 x COOP_KSPLIT subgroups: each 64 rows x 32 tokens (4 x 2 accumulators)
// over one of COOP_KSPLIT contiguous slices of k (more loads in flight per
// core: the loop waits on load latency, not on arithmetic). Every operand
// is loaded straight from its staged buffer (a block is one contiguous
// 512-byte range), so the loop has no barrier. The slices' accumulators
// are summed in workgroup memory (c_s), last slice first, and the epilogue
// (ACCUMULATE, SWIGLU, the row bounds) runs from there.
// Binding 1 is the staged inputs and binding 2 the staged weights (the
// matvec's layout, other buffers bound); 3 and 5 are not read.
// Preamble (from Rust): `enable f16; enable wgpu_cooperative_matrix;`, the
// diagnostic filter that lets the slices' reduction branch on the subgroup,
// MM_ROWS, MM_TOKENS, COOP_KSPLIT, the generated Params,
// int8_math.wgsl, int8_matmul_common.wgsl and int8_matmul_coop_tile.wgsl
// (c_s, the epilogue).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x16: array<f16>;
@group(0) @binding(2) var<storage, read> w16: array<f16>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(COOP_WG)
fn int8_matmul(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let row0 = (wg.x + wg.y * nwg.x) * MM_ROWS;
    if row0 >= p.rows {
        return; // whole workgroup: uniform
    }
    // 16-value blocks per row; a block row of 16 rows (tokens) is
    // `blocks * 256` values. k_words is a multiple of the quant group's
    // (16 words: 4 blocks), so COOP_KSPLIT (1, 2 or 4) divides `blocks`.
    let blocks = p.k_words / 4u;
    let a0 = (row0 / 16u) * blocks * 256u;
    let a1 = a0 + blocks * 256u;
    let a2 = a1 + blocks * 256u;
    let a3 = a2 + blocks * 256u;
    let st = (sg % 2u) * 32u; // this subgroup's tokens in the tile
    let slice = sg / 2u; // its slice of k
    let b0 = ((wg.z * MM_TOKENS + st) / 16u) * blocks * 256u;
    let b1 = b0 + blocks * 256u;
    let k_end = (slice + 1u) * (blocks / COOP_KSPLIT) * 256u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();
    for (var k = slice * (blocks / COOP_KSPLIT) * 256u; k < k_end; k += 256u) {
        let wa0 = coopLoadT<coop_mat16x16<f16, A>>(&w16[a0 + k], 16u);
        let wa1 = coopLoadT<coop_mat16x16<f16, A>>(&w16[a1 + k], 16u);
        let wa2 = coopLoadT<coop_mat16x16<f16, A>>(&w16[a2 + k], 16u);
        let wa3 = coopLoadT<coop_mat16x16<f16, A>>(&w16[a3 + k], 16u);
        let xb0 = coopLoad<coop_mat16x16<f16, B>>(&x16[b0 + k], 16u);
        let xb1 = coopLoad<coop_mat16x16<f16, B>>(&x16[b1 + k], 16u);
        c00 = coopMultiplyAdd(wa0, xb0, c00);
        c01 = coopMultiplyAdd(wa0, xb1, c01);
        c10 = coopMultiplyAdd(wa1, xb0, c10);
        c11 = coopMultiplyAdd(wa1, xb1, c11);
        c20 = coopMultiplyAdd(wa2, xb0, c20);
        c21 = coopMultiplyAdd(wa2, xb1, c21);
        c30 = coopMultiplyAdd(wa3, xb0, c30);
        c31 = coopMultiplyAdd(wa3, xb1, c31);
    }
    // Accumulator (i, j): rows 16i.., tokens st + 16j.. of the tile. Every
    // argument of a coopStore is a `let`: naga 30 emits a coopStore call's
    // argument expressions after the store itself otherwise.
    let stride = MM_ROWS;
    let p00 = &c_s[st * MM_ROWS];
    let p01 = &c_s[(st + 16u) * MM_ROWS];
    let p10 = &c_s[st * MM_ROWS + 16u];
    let p11 = &c_s[(st + 16u) * MM_ROWS + 16u];
    let p20 = &c_s[st * MM_ROWS + 32u];
    let p21 = &c_s[(st + 16u) * MM_ROWS + 32u];
    let p30 = &c_s[st * MM_ROWS + 48u];
    let p31 = &c_s[(st + 16u) * MM_ROWS + 48u];
    // The last slice stores its sums; each slice before adds what c_s
    // holds and stores, in turn.
    for (var s = COOP_KSPLIT; s > 0u; s--) {
        if slice == s - 1u {
            if s < COOP_KSPLIT {
                c00 += coopLoad<coop_mat16x16<f32, C>>(p00, stride);
                c01 += coopLoad<coop_mat16x16<f32, C>>(p01, stride);
                c10 += coopLoad<coop_mat16x16<f32, C>>(p10, stride);
                c11 += coopLoad<coop_mat16x16<f32, C>>(p11, stride);
                c20 += coopLoad<coop_mat16x16<f32, C>>(p20, stride);
                c21 += coopLoad<coop_mat16x16<f32, C>>(p21, stride);
                c30 += coopLoad<coop_mat16x16<f32, C>>(p30, stride);
                c31 += coopLoad<coop_mat16x16<f32, C>>(p31, stride);
            }
            let v00 = c00;
            let v01 = c01;
            let v10 = c10;
            let v11 = c11;
            let v20 = c20;
            let v21 = c21;
            let v30 = c30;
            let v31 = c31;
            coopStore(v00, p00, stride);
            coopStore(v01, p01, stride);
            coopStore(v10, p10, stride);
            coopStore(v11, p11, stride);
            coopStore(v20, p20, stride);
            coopStore(v21, p21, stride);
            coopStore(v30, p30, stride);
            coopStore(v31, p31, stride);
        }
        workgroupBarrier();
    }
    store_tile(l, row0, wg.z);
}
