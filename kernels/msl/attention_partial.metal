// Decode attention, split over positions (twin of attention_partial.wgsl):
// threadgroup (h, c) attends query head h to cached positions
// [c*WG, (c+1)*WG) and writes that chunk's softmax statistics: its max m,
// its sum l = sum(exp(s - m)) and acc = sum(exp(s - m) * v).
// attention_reduce combines the chunks. GQA by indexing: kv_head =
// h / (n_heads / n_kv_heads). K/V: half pairs packed in uint,
// [kv_head][capacity][head_dim/2]. Batched (prompt tokens): threadgroup
// (h, c, z) serves token z of the batch, at position step.pos + z, over
// positions <= its own (causal), q normed and rotated by qk_norm_rope.
// Decode steps (one token):
// - FUSED: q is read raw from the qkv projection's output and normed and
//   rotated here; the threadgroup whose chunk holds the new position first
//   writes that position's k (normed, rotated) and v to the caches (both
//   query heads of a KV head write the same values), then reads them back.
// - DIRECT (one chunk, grid (heads, 1, 1)): the chunk's result is the
//   output, normalised and written to part_acc's binding (bound to the
//   output); no reduce.
// Preamble: WG (= positions per chunk), FUSED, DIRECT.

#include <metal_stdlib>
using namespace metal;

struct Params {
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;
    uint capacity;
    float eps;       // FUSED: rms_norm_eps of the q/k norms
    uint qkv_stride; // (qk_norm_rope's; unused here)
    float scale;     // softmax scale, 1/sqrt(head_dim)
};

// The decode position, kept on the GPU (see qk_norm_rope).
struct Step {
    uint pos;
    uint fill_end;
};

constant constexpr uint MAX_HEAD_DIM = 256;

// A K row quad (8 halves) dotted with the matching 8 dims of q (qa, qb).
static inline float dot8(float4 qa, float4 qb, uint4 a) {
    return dot(qa, float4(float2(as_type<half2>(a.x)), float2(as_type<half2>(a.y))))
        + dot(qb, float4(float2(as_type<half2>(a.z)), float2(as_type<half2>(a.w))));
}

// The first and last 4 of the 8 halves of a V row quad.
static inline float4 lo4(uint4 a) {
    return float4(float2(as_type<half2>(a.x)), float2(as_type<half2>(a.y)));
}
static inline float4 hi4(uint4 a) {
    return float4(float2(as_type<half2>(a.z)), float2(as_type<half2>(a.w)));
}

// Element d of rotate-half RoPE: a = x[d], b = x[d +- head_dim/2], cs the
// table's (cos, sin) for d mod head_dim/2; `low`: d < head_dim/2.
static inline float rope_at(float a, float b, float2 cs, bool low) {
    return low ? a * cs.x - b * cs.y : a * cs.x + b * cs.y;
}

kernel void attention_partial(
    constant Params& p [[buffer(0)]],
    const device Step* step [[buffer(1)]],
    // FUSED: the qkv projection's output (q, k, v heads); else each
    // token's normed, rotated q.
    const device float* q [[buffer(2)]],
    device uint4* k_cache [[buffer(3)]], // 8 halves per load (head_dim % 8 == 0)
    device uint4* v_cache [[buffer(4)]], // 8 halves per load
    device float2* part_ml [[buffer(5)]],  // [token][head][chunk]: (m, l)
    // [token][head][chunk][head_dim]; DIRECT: the output, [head][head_dim]
    device float* part_acc [[buffer(6)]],
    const device float* qk_norm [[buffer(7)]], // FUSED: q norm weight, then k norm weight
    const device float2* rope [[buffer(8)]],   // FUSED: rope[pos * head_dim / 2 + d] = (cos, sin)
    uint3 wg [[threadgroup_position_in_grid]],
    uint3 nwg [[threadgroups_per_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]])
{
    threadgroup float4 q_s[MAX_HEAD_DIM / 4];
    threadgroup float e_s[WG];
    threadgroup float4 acc_s[2 * WG];
    threadgroup float red[WG]; // one slot per simdgroup
    threadgroup float2 red2[WG];
    threadgroup float qh[MAX_HEAD_DIM]; // FUSED: normed q and k, before rotation
    threadgroup float kh[MAX_HEAD_DIM];

    const uint h = wg.x;
    const uint c = wg.y;
    const uint z = wg.z;
    const uint n_chunks = nwg.y;
    const uint part = (z * p.n_heads + h) * n_chunks + c;
    const uint start = c * WG;
    const uint end = min(min(step->pos + z + 1, p.capacity), start + WG);
    if (start >= end) {
        // An empty chunk (past the context): contributes nothing.
        if (lid == 0) {
            part_ml[part] = float2(-3.0e38f, 0.0f);
        }
        return; // whole threadgroup: uniform
    }
    const uint kvh = h / (p.n_heads / p.n_kv_heads);
    const uint half_dim = p.head_dim / 2;
    const uint kv_base = kvh * p.capacity * half_dim;

    if (FUSED) {
        // q_s = rope(rms_norm(q_h) * q_norm); the chunk holding the new
        // position also writes its k = rope(rms_norm(k) * k_norm) and v.
        const uint pos = step->pos; // one token: z = 0
        const bool writes_kv = pos >= start && pos < end;
        const uint hd = p.head_dim;
        const uint q_src = h * hd;
        const uint k_src = (p.n_heads + kvh) * hd;
        const uint v_src = (p.n_heads + p.n_kv_heads + kvh) * hd;
        float2 sq = float2(0.0f);
        for (uint d = lid; d < hd; d += WG) {
            const float a = q[q_src + d];
            sq.x += a * a;
            if (writes_kv) {
                const float b = q[k_src + d];
                sq.y += b * b;
            }
        }
        const float2 ssg = float2(simd_sum(sq.x), simd_sum(sq.y));
        if (sg_lane == 0) {
            red2[sg_id] = ssg;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float2 ss = float2(0.0f);
        for (uint i = 0; i < n_sg; i++) {
            ss += red2[i];
        }
        const float inv_q = rsqrt(ss.x / float(hd) + p.eps);
        const float inv_k = rsqrt(ss.y / float(hd) + p.eps);
        for (uint d = lid; d < hd; d += WG) {
            qh[d] = q[q_src + d] * inv_q * qk_norm[d];
            if (writes_kv) {
                kh[d] = q[k_src + d] * inv_k * qk_norm[hd + d];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const uint base = pos * half_dim;
        for (uint i = lid; i < hd / 4; i += WG) {
            float4 r;
            for (uint e = 0; e < 4; e++) {
                const uint d = 4 * i + e;
                r[e] = rope_at(qh[d], qh[(d + half_dim) % hd], rope[base + d % half_dim], d < half_dim);
            }
            q_s[i] = r;
        }
        if (writes_kv) {
            const uint row = (kvh * p.capacity + pos) * half_dim;
            for (uint i = lid; i < hd / 8; i += WG) {
                uint4 w;
                for (uint e = 0; e < 4; e++) {
                    const uint d = 8 * i + 2 * e;
                    const float k0 = rope_at(kh[d], kh[(d + half_dim) % hd], rope[base + d % half_dim], d < half_dim);
                    const uint d1 = d + 1;
                    const float k1 =
                        rope_at(kh[d1], kh[(d1 + half_dim) % hd], rope[base + d1 % half_dim], d1 < half_dim);
                    w[e] = as_type<uint>(half2(float2(k0, k1)));
                }
                k_cache[row / 4 + i] = w;
            }
            for (uint i = lid; i < hd / 8; i += WG) {
                const uint v = v_src + 8 * i;
                v_cache[row / 4 + i] = uint4(as_type<uint>(half2(float2(q[v], q[v + 1]))),
                    as_type<uint>(half2(float2(q[v + 2], q[v + 3]))), as_type<uint>(half2(float2(q[v + 4], q[v + 5]))),
                    as_type<uint>(half2(float2(q[v + 6], q[v + 7]))));
            }
        }
        // The new row is read back below by other lanes.
        threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
    } else {
        for (uint i = lid; i < p.head_dim / 4; i += WG) {
            const uint o = (z * p.n_heads + h) * p.head_dim + 4 * i;
            q_s[i] = float4(q[o], q[o + 1], q[o + 2], q[o + 3]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // One position per lane; its K row in 16-byte loads, four at a time
    // (independent loads in flight instead of a chain of one).
    const uint t = start + lid;
    float s = -3.0e38f;
    if (t < end) {
        const uint quads = half_dim / 4;
        const uint row = (kv_base + t * half_dim) / 4;
        float4 d = float4(0.0f);
        uint j = 0;
        for (; j + 3 < quads; j += 4) {
            const uint4 a = k_cache[row + j];
            const uint4 b = k_cache[row + j + 1];
            const uint4 c = k_cache[row + j + 2];
            const uint4 e = k_cache[row + j + 3];
            d += float4(dot8(q_s[2 * j], q_s[2 * j + 1], a), dot8(q_s[2 * j + 2], q_s[2 * j + 3], b),
                        dot8(q_s[2 * j + 4], q_s[2 * j + 5], c), dot8(q_s[2 * j + 6], q_s[2 * j + 7], e));
        }
        for (; j < quads; j++) {
            d.x += dot8(q_s[2 * j], q_s[2 * j + 1], k_cache[row + j]);
        }
        s = (d.x + d.y + d.z + d.w) * p.scale;
    }
    // Threadgroup max: simdgroup maxima, then every lane combines them.
    const float sm = simd_max(s);
    if (sg_lane == 0) {
        red[sg_id] = sm;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float m = red[0];
    for (uint i = 1; i < n_sg; i++) {
        m = max(m, red[i]);
    }
    const float e = t < end ? exp(s - m) : 0.0f;
    e_s[lid] = e;
    // Threadgroup sum; its barriers also publish e_s. The first one lets
    // every lane finish reading the maxima before red is reused.
    const float se = simd_sum(e);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg_lane == 0) {
        red[sg_id] = se;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float l = 0.0f;
    for (uint i = 0; i < n_sg; i++) {
        l += red[i];
    }

    // Lane (slice, i) sums dims 8i..8i+7 (one 16-byte load per position)
    // over positions start + slice, start + slice + n_slices, ...; then the
    // slices are added.
    const uint row_quads = p.head_dim / 8;
    const uint n_slices = WG / row_quads;
    const uint slice = lid / row_quads;
    const uint i = lid % row_quads;
    float4 lo = float4(0.0f);
    float4 hi = float4(0.0f);
    if (slice < n_slices) {
        // Four positions per iteration: four independent loads in flight.
        const uint vb = kv_base / 4 + i;
        uint tt = start + slice;
        for (; tt + 3 * n_slices < end; tt += 4 * n_slices) {
            const uint t1 = tt + n_slices;
            const uint t2 = t1 + n_slices;
            const uint t3 = t2 + n_slices;
            const uint4 v0 = v_cache[vb + tt * row_quads];
            const uint4 v1 = v_cache[vb + t1 * row_quads];
            const uint4 v2 = v_cache[vb + t2 * row_quads];
            const uint4 v3 = v_cache[vb + t3 * row_quads];
            const float e0 = e_s[tt - start];
            const float e1 = e_s[t1 - start];
            const float e2 = e_s[t2 - start];
            const float e3 = e_s[t3 - start];
            lo += e0 * lo4(v0) + e1 * lo4(v1) + e2 * lo4(v2) + e3 * lo4(v3);
            hi += e0 * hi4(v0) + e1 * hi4(v1) + e2 * hi4(v2) + e3 * hi4(v3);
        }
        for (; tt < end; tt += n_slices) {
            const uint4 v = v_cache[vb + tt * row_quads];
            lo += e_s[tt - start] * lo4(v);
            hi += e_s[tt - start] * hi4(v);
        }
    }
    acc_s[2 * lid] = lo;
    acc_s[2 * lid + 1] = hi;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Lane d < head_dim adds dim d (= 8i + r) over the slices.
    if (lid < p.head_dim) {
        const uint qi = lid / 8;
        const uint r = lid % 8;
        float total = 0.0f;
        for (uint sl = 0; sl < n_slices; sl++) {
            total += acc_s[2 * (sl * row_quads + qi) + r / 4][r % 4];
        }
        if (DIRECT) {
            part_acc[h * p.head_dim + lid] = total / l;
        } else {
            part_acc[part * p.head_dim + lid] = total;
        }
    }
    if (lid == 0 && !DIRECT) {
        part_ml[part] = float2(m, l);
    }
}
