// Twin of int8_matvec.wgsl: y[row_offset + r] (+)= sum_k w[r][k] * x'[k],
// ROWS_PER_WG rows per threadgroup, where x' = x, or with NORM the RMSNorm
// of x fused in: x' = x * rsqrt(mean(x^2) + eps) * norm_w.
// w: int8, row-major, rows zero-padded to a multiple of the quant group,
// four values packed per u32 (little-endian); one f32 scale per group
// (int4: one bf16 scale, group_scale).
// INT4: int4 values, 8 a word, byte b value b in its low nibble and b + 4
// in its high one (`int4_position`, src/converted.rs).
//
// Layout: each simdgroup takes blocks of 4 rows; its lanes stride over the
// row in steps of one uint4 per row (16 int8 values, or 32 int4 ones: two
// quads of x), accumulate the 4 rows at once and reduce with one xor tree
// (tree_sum, the WGSL's tree_sum4 order): no barriers, no threadgroup memory. NORM sums x^2 in the same loop (the
// simdgroup reads all of x anyway) and scales the 4 sums by
// rsqrt(mean + eps) at the end.
// SWIGLU: rows interleave gate (2i) and up (2i+1), so a block of 4 rows
// yields y[(row_offset + row0) / 2 + t] = silu(gate_t) * up_t, t = 0, 1.
//
// Preamble (names prefixed Q3W_): WG, GROUP_WORDS (u32 words of x per quant group), ROWS_PER_WG (a
// multiple of 4), SPLIT_K (must be 0: the WGSL's split-K layout, for GPUs
// other than Apple's, has no twin), ACCUMULATE (y += W x), NORM, SWIGLU,
// INT4.
//
// Batched (prefill): threadgroup z applies the matrix to token z's input
// x[z * k_words ..] and writes y[z * y_stride ..], each token's arithmetic
// that of a one-token step; decode runs z = 0 only.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

#if Q3W_SPLIT_K
#error "this twin implements the rows-per-simdgroup layout only"
#endif

// Scale i (row r's group g at r * groups + g): int8's f32; int4's bf16,
// two a word, the even group in the low half (`scale_bytes`,
// src/converted.rs): its bits are a float's upper half.
inline float group_scale(const device float* scales, uint i) {
#if Q3W_INT4
    return as_type<float>(uint(reinterpret_cast<const device ushort*>(scales)[i]) << 16);
#else
    return scales[i];
#endif
}

inline float silu(float g) {
    return g / (1.0f + exp(-g));
}

// The 4 int8 values of `v` as floats.
inline float4 i8x4(uint v) {
    return float4(as_type<char4>(v));
}

// The int4 values in the low nibbles of `v`'s 4 bytes as floats (a word's
// values 0..3; `v >> 4` gives values 4..7), exactly, as int8_math.wgsl's
// i4x4: nibble u = q + 8 (the sign bit flipped) in the mantissa of 2^23,
// less 2^23 + 8.
inline float4 i4x4(uint v) {
    const uint u = v ^ 0x88888888u;
    const uint4 m = uint4(u & 0xfu, (u >> 8) & 0xfu, (u >> 16) & 0xfu, (u >> 24) & 0xfu);
    return as_type<float4>(m + 0x4b000000u) - 8388616.0f;
}

inline float dot16(uint4 wv, float4 x0, float4 x1, float4 x2, float4 x3) {
    return dot(i8x4(wv.x), x0) + dot(i8x4(wv.y), x1) + dot(i8x4(wv.z), x2) + dot(i8x4(wv.w), x3);
}

// An int4 step (32 values) against x quads a (a0..a3) and b (b0..b3).
inline float dot32(
    uint4 wv, float4 a0, float4 a1, float4 a2, float4 a3, float4 b0, float4 b1, float4 b2, float4 b3)
{
    return dot(i4x4(wv.x), a0) + dot(i4x4(wv.x >> 4), a1) + dot(i4x4(wv.y), a2) + dot(i4x4(wv.y >> 4), a3)
        + dot(i4x4(wv.z), b0) + dot(i4x4(wv.z >> 4), b1) + dot(i4x4(wv.w), b2) + dot(i4x4(wv.w >> 4), b3);
}

// The simdgroup sum of `v` in one fixed order, prelude_subgroup.wgsl's
// tree_sum4 and tree_sum: an xor tree over masks lanes / 2 .. 1 (simd_sum's
// order is the compiler's), so that the WGSL batched rows can add as this
// twin does.
template <typename T>
inline T tree_sum(T v, uint lanes) {
    for (uint m = lanes / 2; m > 0; m >>= 1) {
        v += simd_shuffle_xor(v, ushort(m));
    }
    return v;
}

// Rows row0..row0+3 (rows past the end repeat the last row; store4 drops
// their results): the simdgroup's reduced dot products, NORM's rsqrt applied.
inline float4 rows4(
    constant Params& p,
    const device float4* x,
    const device uint4* w,
    const device float* scales,
    const device float4* norm_w,
    uint row0,
    uint xb,
    uint lane,
    uint lanes)
{
    const uint r1 = min(row0 + 1, p.rows - 1);
    const uint r2 = min(row0 + 2, p.rows - 1);
    const uint r3 = min(row0 + 3, p.rows - 1);
    float4 acc = float4(0.0f);
#if Q3W_NORM
    float4 ss = float4(0.0f); // (declared only where used: no unused-variable warning)
#endif
#if Q3W_INT4
    // Steps of 32 values: two quads of x, 8 float4s.
    const uint k_steps = p.k_words / 8;
    const uint steps_per_group = Q3W_GROUP_WORDS / 8;
    for (uint j = lane; j < k_steps; j += lanes) {
        float4 x0 = x[xb + 8 * j];
        float4 x1 = x[xb + 8 * j + 1];
        float4 x2 = x[xb + 8 * j + 2];
        float4 x3 = x[xb + 8 * j + 3];
        float4 x4 = x[xb + 8 * j + 4];
        float4 x5 = x[xb + 8 * j + 5];
        float4 x6 = x[xb + 8 * j + 6];
        float4 x7 = x[xb + 8 * j + 7];
#if Q3W_NORM
        ss += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3;
        ss += x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7;
        x0 *= norm_w[8 * j];
        x1 *= norm_w[8 * j + 1];
        x2 *= norm_w[8 * j + 2];
        x3 *= norm_w[8 * j + 3];
        x4 *= norm_w[8 * j + 4];
        x5 *= norm_w[8 * j + 5];
        x6 *= norm_w[8 * j + 6];
        x7 *= norm_w[8 * j + 7];
#endif
        const uint g = j / steps_per_group;
        acc.x += dot32(w[row0 * k_steps + j], x0, x1, x2, x3, x4, x5, x6, x7) * group_scale(scales, row0 * p.groups + g);
        acc.y += dot32(w[r1 * k_steps + j], x0, x1, x2, x3, x4, x5, x6, x7) * group_scale(scales, r1 * p.groups + g);
        acc.z += dot32(w[r2 * k_steps + j], x0, x1, x2, x3, x4, x5, x6, x7) * group_scale(scales, r2 * p.groups + g);
        acc.w += dot32(w[r3 * k_steps + j], x0, x1, x2, x3, x4, x5, x6, x7) * group_scale(scales, r3 * p.groups + g);
    }
#else
    const uint k_quads = p.k_words / 4;
    const uint quads_per_group = Q3W_GROUP_WORDS / 4;
    for (uint j = lane; j < k_quads; j += lanes) {
        float4 x0 = x[xb + 4 * j];
        float4 x1 = x[xb + 4 * j + 1];
        float4 x2 = x[xb + 4 * j + 2];
        float4 x3 = x[xb + 4 * j + 3];
#if Q3W_NORM
        ss += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3;
        x0 *= norm_w[4 * j];
        x1 *= norm_w[4 * j + 1];
        x2 *= norm_w[4 * j + 2];
        x3 *= norm_w[4 * j + 3];
#endif
        const uint g = j / quads_per_group;
        acc.x += dot16(w[row0 * k_quads + j], x0, x1, x2, x3) * group_scale(scales, row0 * p.groups + g);
        acc.y += dot16(w[r1 * k_quads + j], x0, x1, x2, x3) * group_scale(scales, r1 * p.groups + g);
        acc.z += dot16(w[r2 * k_quads + j], x0, x1, x2, x3) * group_scale(scales, r2 * p.groups + g);
        acc.w += dot16(w[r3 * k_quads + j], x0, x1, x2, x3) * group_scale(scales, r3 * p.groups + g);
    }
#endif
    float4 sums = tree_sum(acc, lanes);
#if Q3W_NORM
    const float t = tree_sum(ss.x + ss.y + ss.z + ss.w, lanes);
    sums *= rsqrt(t / float(p.n_in) + p.eps);
#endif
    return sums;
}

// ACCUMULATE: the value simdgroup lane `i` < 4 adds row row0 + i of token
// z onto, loaded before the sums (as int8_matvec.wgsl's prior4: the load's
// round trip overlaps the weights' instead of following the reduction).
inline float prior1(constant Params& p, device float* y, uint row0, uint i, uint z) {
#if Q3W_ACCUMULATE && !Q3W_SWIGLU
    if (i < 4 && row0 + i < p.rows) {
        return y[z * p.y_stride + p.row_offset + row0 + i];
    }
#endif
    return 0.0f;
}

// Simdgroup lane `i` < 4 writes row row0 + i of token z's output (SWIGLU:
// lane i < 2 writes output pair i of the block); ACCUMULATE adds `prior`
// (prior1's).
inline void store4(constant Params& p, device float* y, uint row0, float4 sums, uint i, uint z, float prior) {
    const uint yb = z * p.y_stride;
#if Q3W_SWIGLU
    if (i < 2 && row0 + 2 * i < p.rows) {
        const uint o = yb + (p.row_offset + row0) / 2 + i;
        y[o] = silu(sums[2 * i]) * sums[2 * i + 1];
    }
#else
    if (i < 4 && row0 + i < p.rows) {
        const uint o = yb + p.row_offset + row0 + i;
        float v = sums[i];
#if Q3W_ACCUMULATE
        v += prior;
#endif
        y[o] = v;
    }
#endif
}

kernel void int8_matvec(
    constant Params& p [[buffer(0)]],
    const device float4* x [[buffer(1)]],
    const device uint4* w [[buffer(2)]],
    const device float* scales [[buffer(3)]],
    device float* y [[buffer(4)]],
    const device float4* norm_w [[buffer(5)]],
    // The residual's f16 copy (int8_common.wgsl's X16): unused here, as
    // Metal devices' decode steps keep f32 x only.
    device uint2* x16 [[buffer(6)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint3 nwg [[threadgroups_per_grid]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_size [[threads_per_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]])
{
    const uint wg_row0 = (wg.x + wg.y * nwg.x) * Q3W_ROWS_PER_WG;
    if (wg_row0 >= p.rows) {
        return; // whole threadgroup: uniform
    }
    const uint z = wg.z;
    const uint xb = z * p.k_words;
    // A simdgroup wider than the threadgroup is partly empty.
    const uint lanes = min(sg_size, uint(Q3W_WG));
    // Each simdgroup takes whole blocks of 4 rows; a barrier-free reduction.
    for (uint rb = sg_id * 4; rb < Q3W_ROWS_PER_WG; rb += n_sg * 4) {
        const uint row0 = wg_row0 + rb;
        if (row0 < p.rows) {
            const float prior = prior1(p, y, row0, sg_lane, z);
            store4(p, y, row0, rows4(p, x, w, scales, norm_w, row0, xb, sg_lane, lanes), sg_lane, z, prior);
        }
    }
}
