// Staging for the cooperative-matrix prompt-batch product
// (int8_matmul_coop.wgsl): a launch's weights and its batch's inputs as f16
// in 16 x 16 blocks, each block 256 contiguous values (512 bytes), so that
// a subgroup loads a matrix operand from one contiguous range (loads with
// the row length as stride ran at less than half the speed on an H200).
// One launch stages both (one dependent launch fewer per product). Same
// bind-group layout and params as the matvec; binding 4 is the staging
// range, written as u32 pairs of f16 (pack2x16float): the weights first,
// then the inputs (the product binds the two parts as its operands).
//
// Grid: 1-D over x and y, the weights' workgroups first (one invocation
// per 16 values of a row), then one per token of the tiles the product
// reads:
//   w16[block (r / 16, k / 16)][r % 16][k % 16] = f16(q[r][k] * scale[r][k / GROUP])
//   (q int8, or int4 with INT4)
//   for the launch's rows rounded up to MM_ROWS (the spare rows are zero);
//   x16[block (t / 16, k / 16)][t % 16][k % 16] = f16(x'[t][k])
//   with x' = x, or with NORM its RMSNorm times norm_w (as int8_matvec).
// A grid split over y may run workgroups past the last token's: they stage
// the input rows after it while the staging range holds them (never read)
// and stop at its end.
// Params (generated from MatvecParams), MM_ROWS, GROUP_WORDS and the
// overrides (int8_math.wgsl) are prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read_write> staged: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> norm_w: array<vec4<f32>>;

const STAGE_WG: u32 = 256u;
// 16-value quads per quant group.
const GROUP_QUADS: u32 = GROUP_WORDS / 4u;

var<workgroup> sums: array<f32, STAGE_WG>;

// Eight values as one vec4 of f16 pairs.
fn pack8(lo: vec4<f32>, hi: vec4<f32>) -> vec4<u32> {
    return vec4<u32>(pack2x16float(lo.xy), pack2x16float(lo.zw), pack2x16float(hi.xy), pack2x16float(hi.zw));
}

// The vec4<u32> index of values (r, k..k+7) of a blocked matrix whose rows
// are `blocks` 16-value blocks long (k a multiple of 8).
fn blocked8(r: u32, k: u32, blocks: u32) -> u32 {
    return (((r / 16u) * blocks + k / 16u) * 256u + (r % 16u) * 16u + k % 16u) / 8u;
}

@compute @workgroup_size(STAGE_WG)
fn f16_stage(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wg: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let quads = p.k_words / 4u; // 16-value blocks per row
    let rows = (p.rows + MM_ROWS - 1u) / MM_ROWS * MM_ROWS;
    let weight_wgs = (rows * quads + STAGE_WG - 1u) / STAGE_WG;
    let f = wg.x + wg.y * nwg.x;
    if f < weight_wgs {
        let q = f * STAGE_WG + l;
        if q >= rows * quads {
            return;
        }
        let r = q / quads;
        let c = q % quads;
        var lo = vec4<u32>(0u);
        var hi = vec4<u32>(0u);
        if r < p.rows && INT4 {
            // The quad's 16 int4 values: two words of a vec4 of 32.
            let v4 = w[(r * quads + c) / 2u];
            let v = select(v4.xy, v4.zw, c % 2u == 1u);
            let s = group_scale(r * p.groups + c / GROUP_QUADS);
            let a = i4x8(v.x);
            let b = i4x8(v.y);
            lo = pack8(a.lo * s, a.hi * s);
            hi = pack8(b.lo * s, b.hi * s);
        } else if r < p.rows {
            let v = w[r * quads + c];
            let s = group_scale(r * p.groups + c / GROUP_QUADS);
            lo = pack8(i8x4(v.x) * s, i8x4(v.y) * s);
            hi = pack8(i8x4(v.z) * s, i8x4(v.w) * s);
        }
        let o = blocked8(r, 16u * c, quads);
        staged[o] = lo;
        staged[o + 1u] = hi;
        return;
    }
    // Inputs: token t, at x's row t; its staged rows follow the weights'
    // (rows * k_words / 2 vec4s).
    let t = f - weight_wgs;
    let x0 = rows * p.k_words / 2u;
    if x0 + (t / 16u + 1u) * 8u * p.k_words > arrayLength(&staged) {
        return; // whole workgroup: uniform
    }
    let xb = t * p.k_words;
    var inv = 1.0;
    if NORM {
        var ss = 0.0;
        for (var i = l; i < p.k_words; i += STAGE_WG) {
            let v = x[xb + i];
            ss += dot(v, v);
        }
        sums[l] = ss;
        workgroupBarrier();
        for (var half = STAGE_WG / 2u; half > 0u; half /= 2u) {
            if l < half {
                sums[l] += sums[l + half];
            }
            workgroupBarrier();
        }
        inv = inverseSqrt(sums[0] / f32(p.n_in) + p.eps);
    }
    for (var j = l; j < p.k_words / 2u; j += STAGE_WG) {
        var a = x[xb + 2u * j];
        var b = x[xb + 2u * j + 1u];
        if NORM {
            a *= norm_w[2u * j] * inv;
            b *= norm_w[2u * j + 1u] * inv;
        }
        staged[x0 + blocked8(t, 8u * j, quads)] = pack8(a, b);
    }
}

// Scale `i` (row r's group g at r * groups + g) in either weight format.
fn group_scale(i: u32) -> f32 {
    return word_scale(scales[scale_word(i)], i);
}
