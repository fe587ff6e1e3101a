// Twin of int8_matmul.wgsl (prompt batches) on SIMD-group matrices: the
// same product, bindings, params, epilogues and grid. Threadgroup (x, z)
// computes
//   y[t][row_offset + r] (+)= sum_k w[r][k] * x'[t][k]
// for the Q3W_MM_ROWS rows from x * Q3W_MM_ROWS and the Q3W_MM_TOKENS
// tokens from z * Q3W_MM_TOKENS (x' = x, or with NORM the token's RMSNorm
// of x: x * rsqrt(mean(x^2) + eps) * norm_w). As with the WGSL, every token
// of the tile is computed: the activation buffers hold whole tiles.
//
// Tile: Q3W_WG = 128 threads, four simdgroups in a 2 x 2 arrangement, each
// owning half the tile's tokens by half its rows (32 rows); its outputs
// live in 8x8 simdgroup_float8x8 accumulators, computed transposed (tokens
// down, rows across: C^T = X' W^T) so that a lane's two elements of a
// block are one token's outputs of two adjacent rows, i.e. a gate row and
// its up row under SWIGLU.
// K runs in chunks of CHUNK_K values: the chunk's weights (dequantised
// once, int8 or int4 times the group's scale, rounded to half as the
// cooperative-matrix product's are) are staged k-major (w_s[k][r], the
// right operand) and its inputs token-major as f32 (x_s[t][k], the left
// operand; un-normed values of the residual stream may exceed half's
// range), both in threadgroup memory, rows padded by 16 bytes against bank
// conflicts; each simdgroup then multiplies 8-value slices with
// simdgroup_multiply_accumulate (f32 x half in, f32 accumulate, as
// llama.cpp's kernel_mul_mm). Each thread loads the next chunk's weights
// into registers before the current chunk's multiply-adds, so the device
// reads are in flight while they run (one barrier pair a chunk).
// NORM: the sums of x^2 are gathered while staging (the same values every
// chunk per thread), reduced per token at the end, and the token's
// rsqrt(mean + eps) scales its outputs, as in the WGSL.
// The epilogue writes each lane's two elements of each accumulator
// (`thread_elements()`, whose coordinates are those tests/msl/metal_shim.h
// documents) straight to y: no threadgroup round trip.
// SIMD-group matrices need Apple GPUs (family 7 on, 32-lane simdgroups);
// elsewhere the build or the start-up self-check fails and the engine runs
// the WGSL kernels.
//
// Preamble (names prefixed Q3W_): WG (128), MM_ROWS (64), MM_TOKENS (a
// multiple of 16), GROUP_WORDS (u32 words per quant group, a multiple of
// CHUNK_K / 4), ACCUMULATE (y += W x'), NORM, SWIGLU (rows interleave gate
// 2i and up 2i + 1: y[(row_offset + r) / 2] = silu(gate) * up), INT4 (w
// holds int4 values, 8 a word, byte b value b in its low nibble and b + 4
// in its high one: `int4_position`, src/converted.rs).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

#if Q3W_WG != 128 || Q3W_MM_ROWS != 64 || Q3W_MM_TOKENS % 16 != 0
#error "the tile is 64 rows by a multiple of 16 tokens, over four simdgroups"
#endif

// K values per chunk: half a quant group of 64, so a chunk's weights are two
// uint4 words of int8 per row (int4: one, two uint2 halves), one per
// staging thread.
constant constexpr uint CHUNK_K = 32;
constant constexpr uint CHUNK_QUADS = CHUNK_K / 16; // 16-value parts of a row per chunk
// Padded row lengths of the staging arrays (half: 8 values; float: 4).
constant constexpr uint W_STRIDE = Q3W_MM_ROWS + 8;
constant constexpr uint X_STRIDE = CHUNK_K + 4;
// Tokens and rows of one simdgroup's part of the tile, in 8x8 blocks.
constant constexpr uint SG_TOKENS = Q3W_MM_TOKENS / 2;
constant constexpr uint SG_ROWS = Q3W_MM_ROWS / 2;
constant constexpr uint TB = SG_TOKENS / 8;
constant constexpr uint RB = SG_ROWS / 8;
// Input staging: units of one float4 (one token, 4 values); each thread
// takes X_PER, the same token offsets and values in every chunk.
constant constexpr uint X_UNITS = Q3W_MM_TOKENS * (CHUNK_K / 4);
constant constexpr uint X_PER = X_UNITS / Q3W_WG;
static_assert(Q3W_MM_ROWS * CHUNK_QUADS == Q3W_WG, "16 weights per thread and chunk");
static_assert(X_UNITS % Q3W_WG == 0 && Q3W_WG % (CHUNK_K / 4) == 0, "whole input units per thread");
static_assert((Q3W_GROUP_WORDS * 4) % CHUNK_K == 0, "a chunk lies in one quant group");

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

kernel void int8_matmul(
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
    uint l [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]])
{
    // w_s[k * W_STRIDE + r]: row r of the tile at the chunk's value k.
    threadgroup half w_s[CHUNK_K * W_STRIDE];
    // x_s[t * X_STRIDE + k]: token t of the tile at the chunk's value k.
    threadgroup float x_s[Q3W_MM_TOKENS * X_STRIDE];
#if Q3W_NORM
    // Each token's rsqrt(mean(x^2) + eps).
    threadgroup float inv_s[Q3W_MM_TOKENS];
#endif

    const uint row0 = (wg.x + wg.y * nwg.x) * Q3W_MM_ROWS;
    if (row0 >= p.rows) {
        return; // whole threadgroup: uniform
    }
    const uint t0 = wg.z * Q3W_MM_TOKENS;
    const uint chunks = p.k_words / (CHUNK_K / 4);

    // Weight staging: thread l loads part `wq` (16 values: a uint4 of
    // int8, a uint2 of int4) of the chunk of tile row `wr` (rows past the
    // matrix repeat its last row; their outputs are never stored).
    const uint wr = l / CHUNK_QUADS;
    const uint wq = l % CHUNK_QUADS;
    const uint w_row = min(row0 + wr, p.rows - 1);
    // Input staging: unit n of thread l is token xt + n * (WG / (CHUNK_K / 4))
    // at values 4 xq .. 4 xq + 3 of the chunk.
    const uint xq = l % (CHUNK_K / 4);
    const uint xt = l / (CHUNK_K / 4);
    constexpr uint X_TOKEN_STEP = Q3W_WG / (CHUNK_K / 4);
#if Q3W_NORM
    float ss[X_PER];
    for (uint n = 0; n < X_PER; n++) {
        ss[n] = 0.0f;
    }
#endif

    // This simdgroup's tokens and rows within the tile.
    const uint sg_t = (sg / 2) * SG_TOKENS;
    const uint sg_r = (sg % 2) * SG_ROWS;
    // acc[i * RB + j]: tokens sg_t + 8 i.., rows sg_r + 8 j.. of the tile.
    simdgroup_float8x8 acc[TB * RB];
    for (uint b = 0; b < TB * RB; b++) {
        acc[b] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }

    // Chunk c's weights of this thread (its part of row w_row) and their
    // group's scale, loaded one chunk ahead.
    const uint k0 = wq * 16;
#if Q3W_INT4
    // Words 2 wq and 2 wq + 1 of the row's uint4 c (the chunk's 32
    // values): each word's low nibbles, then its high ones.
    const device uint2* w_part = reinterpret_cast<const device uint2*>(w) + w_row * (p.k_words / 4) + wq;
    constexpr uint W_PART_STEP = 2; // uint2s a chunk
    uint2 wv = uint2(0);
#else
    const device uint4* w_part = w + w_row * (p.k_words / 4) + wq;
    constexpr uint W_PART_STEP = CHUNK_QUADS; // uint4s a chunk
    uint4 wv = uint4(0);
#endif
    const uint scale0 = w_row * p.groups;
    float ws = 0.0f;
    if (chunks > 0) {
        wv = w_part[0];
        ws = group_scale(scales, scale0);
    }

    for (uint c = 0; c < chunks; c++) {
        threadgroup_barrier(mem_flags::mem_threadgroup); // the previous chunk's readers are done
        for (uint b = 0; b < 4; b++) {
#if Q3W_INT4
            const float4 f = i4x4(wv[b / 2] >> (4 * (b % 2))) * ws;
#else
            const float4 f = i8x4(wv[b]) * ws;
#endif
            w_s[(k0 + 4 * b) * W_STRIDE + wr] = half(f.x);
            w_s[(k0 + 4 * b + 1) * W_STRIDE + wr] = half(f.y);
            w_s[(k0 + 4 * b + 2) * W_STRIDE + wr] = half(f.z);
            w_s[(k0 + 4 * b + 3) * W_STRIDE + wr] = half(f.w);
        }
        for (uint n = 0; n < X_PER; n++) {
            const uint t = xt + n * X_TOKEN_STEP;
            float4 v = x[(t0 + t) * p.k_words + c * (CHUNK_K / 4) + xq];
#if Q3W_NORM
            ss[n] += dot(v, v);
            v *= norm_w[c * (CHUNK_K / 4) + xq];
#endif
            const uint o = t * X_STRIDE + 4 * xq;
            x_s[o] = v.x;
            x_s[o + 1] = v.y;
            x_s[o + 2] = v.z;
            x_s[o + 3] = v.w;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (c + 1 < chunks) {
            // The next chunk's weights, in flight during the multiply-adds.
            wv = w_part[(c + 1) * W_PART_STEP];
            ws = group_scale(scales, scale0 + ((c + 1) * (CHUNK_K / 4)) / Q3W_GROUP_WORDS);
        }
        for (uint k = 0; k < CHUNK_K; k += 8) {
            simdgroup_float8x8 xm[TB];
            simdgroup_half8x8 wm[RB];
            for (uint i = 0; i < TB; i++) {
                simdgroup_load(xm[i], &x_s[(sg_t + 8 * i) * X_STRIDE + k], X_STRIDE);
            }
            for (uint j = 0; j < RB; j++) {
                simdgroup_load(wm[j], &w_s[k * W_STRIDE + sg_r + 8 * j], W_STRIDE);
            }
            for (uint i = 0; i < TB; i++) {
                for (uint j = 0; j < RB; j++) {
                    simdgroup_multiply_accumulate(acc[i * RB + j], xm[i], wm[j], acc[i * RB + j]);
                }
            }
        }
    }

#if Q3W_NORM
    // Token t's sum of x^2 is spread over the CHUNK_K / 4 adjacent lanes
    // (xq = 0..7) that staged its values.
    for (uint n = 0; n < X_PER; n++) {
        float s = ss[n];
        for (ushort m = 1; m < CHUNK_K / 4; m *= 2) {
            s += simd_shuffle_xor(s, m);
        }
        if (xq == 0) {
            inv_s[xt + n * X_TOKEN_STEP] = rsqrt(s / float(p.n_in) + p.eps);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
#endif

    // The lane's elements of every block: token row `fm`, matrix rows
    // `fn` and `fn + 1` (fn even), as the header of the shim documents.
    const uint quad = lane / 4;
    const uint fm = (quad & 4) + (lane / 2) % 4;
    const uint fn = (quad & 2) * 2 + (lane % 2) * 2;
    for (uint i = 0; i < TB; i++) {
        const uint tt = sg_t + 8 * i + fm;
        const uint yb = (t0 + tt) * p.y_stride;
#if Q3W_NORM
        const float inv = inv_s[tt];
#else
        const float inv = 1.0f;
#endif
        for (uint j = 0; j < RB; j++) {
            const uint r = row0 + sg_r + 8 * j + fn;
            const float2 v = float2(acc[i * RB + j].thread_elements()) * inv;
#if Q3W_SWIGLU
            if (r + 1 < p.rows) {
                y[yb + (p.row_offset + r) / 2] = silu(v.x) * v.y;
            }
#else
            for (uint e = 0; e < 2; e++) {
                if (r + e < p.rows) {
                    const uint o = yb + p.row_offset + r + e;
#if Q3W_ACCUMULATE
                    y[o] += v[e];
#else
                    y[o] = v[e];
#endif
                }
            }
#endif
        }
    }
}
