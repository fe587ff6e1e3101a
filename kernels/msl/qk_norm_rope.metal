// Twin of qk_norm_rope.wgsl. One launch per layer and token, one
// threadgroup per head of the fused qkv projection output:
//   query heads:  q_out = rope(rms_norm(q_h) * q_norm)
//   key heads:    k_cache[kv_h][pos] = half(rope(rms_norm(k_h) * k_norm))
//   value heads:  v_cache[kv_h][pos] = half(v_h)
// RoPE is rotate-half with (cos, sin) from the host's f64 table. The caches
// hold half pairs packed in uint, layout [kv_head][capacity][head_dim / 2].
// Batched (prefill): threadgroup (h, 0, z) handles token z of the batch, at
// position step.pos + z, reading qkv[z] and writing q_out[z].
// KV_INT8 (Q3W_KV_INT8): the caches hold int8 rows, four values a word
// ([kv_head][capacity][head_dim / 4]), then one float scale per row, the
// row's largest magnitude (kv_cache.metal's kv_scale_word, as
// qk_norm_rope.wgsl's kv_scale_at); a value is its int8 / 127 times the
// scale.
// Preamble (names prefixed Q3W_): WG, KV_INT8.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

kernel void qk_norm_rope(
    constant Params& p [[buffer(0)]],
    const device Step* step [[buffer(1)]],
    const device float* qkv [[buffer(2)]],
    const device float* qk_norm [[buffer(3)]], // q norm weight, then k norm weight
    // rope[pos * head_dim / 2 + d] = (cos, sin) of pos * theta^(-2d/head_dim)
    const device float2* rope [[buffer(4)]],
    device float* q_out [[buffer(5)]],
    device uint* k_cache [[buffer(6)]],
    device uint* v_cache [[buffer(7)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]])
{
    threadgroup float head[MAX_HEAD_DIM];
    // KV_INT8: the rotated k head.
    threadgroup float rotated[MAX_HEAD_DIM];
    threadgroup float red[Q3W_WG]; // one slot per simdgroup

    const uint h = wg.x;
    const uint z = wg.z;
    const uint pos = step->pos + z;
    const uint hd = p.head_dim;
    const uint half_dim = hd / 2;
    const uint src = z * p.qkv_stride + h * hd;
    const uint q_dst = (z * p.n_heads + h) * hd;
    const uint kv_first = p.n_heads;
    const uint v_first = p.n_heads + p.n_kv_heads;
    if (pos >= p.capacity) {
        return; // queued past the capacity: results are never read
    }
    if (h >= v_first) {
        // Value head: no norm, no rope; straight into the cache.
        const uint kv = h - v_first;
        if (Q3W_KV_INT8) {
            float m = 0.0f;
            for (uint d = lid; d < hd; d += Q3W_WG) {
                m = max(m, abs(qkv[src + d]));
            }
            // The threadgroup's largest: simdgroup maxima, then every lane's.
            const float sm = simd_max(m);
            if (sg_lane == 0) {
                red[sg_id] = sm;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            float absmax = red[0];
            for (uint i = 1; i < n_sg; i++) {
                absmax = max(absmax, red[i]);
            }
            const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
            const uint dst = (kv * p.capacity + pos) * (hd / 4);
            for (uint i = lid; i < hd / 4; i += Q3W_WG) {
                const uint e = src + 4 * i;
                v_cache[dst + i] = snorm8x4(float4(qkv[e], qkv[e + 1], qkv[e + 2], qkv[e + 3]) * inv);
            }
            if (lid == 0) {
                v_cache[kv_scale_word(p, kv, pos)] = as_type<uint>(absmax);
            }
            return;
        }
        const uint dst = (kv * p.capacity + pos) * half_dim;
        for (uint i = lid; i < half_dim; i += Q3W_WG) {
            v_cache[dst + i] = as_type<uint>(half2(float2(qkv[src + 2 * i], qkv[src + 2 * i + 1])));
        }
        return;
    }
    float ss = 0.0f;
    for (uint d = lid; d < hd; d += Q3W_WG) {
        const float v = qkv[src + d];
        ss += v * v;
    }
    // Threadgroup sum: simdgroup sums, then every lane adds the partials.
    const float s = simd_sum(ss);
    if (sg_lane == 0) {
        red[sg_id] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint i = 0; i < n_sg; i++) {
        total += red[i];
    }
    const float inv = rsqrt(total / float(hd) + p.eps);
    const bool is_q = h < kv_first;
    for (uint d = lid; d < hd; d += Q3W_WG) {
        const float nw = is_q ? qk_norm[d] : qk_norm[hd + d];
        head[d] = qkv[src + d] * inv * nw;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint rope_base = pos * half_dim;
    if (is_q) {
        for (uint d = lid; d < half_dim; d += Q3W_WG) {
            const float2 cs = rope[rope_base + d];
            const float a = head[d];
            const float b = head[d + half_dim];
            q_out[q_dst + d] = a * cs.x - b * cs.y;
            q_out[q_dst + d + half_dim] = b * cs.x + a * cs.y;
        }
    } else if (Q3W_KV_INT8) {
        // The rotated row in `rotated` and its largest magnitude first, then
        // each lane writes four dims as one word. (`red` is free: every lane
        // read the sum before the barrier above.)
        const uint kv = h - kv_first;
        float m = 0.0f;
        for (uint d = lid; d < hd; d += Q3W_WG) {
            const float2 cs = rope[rope_base + d % half_dim];
            const float r = d < half_dim ? head[d] * cs.x - head[d + half_dim] * cs.y
                                         : head[d] * cs.x + head[d - half_dim] * cs.y;
            rotated[d] = r;
            m = max(m, abs(r));
        }
        const float sm = simd_max(m);
        if (sg_lane == 0) {
            red[sg_id] = sm;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup); // publishes `rotated` and the maxima
        float absmax = red[0];
        for (uint i = 1; i < n_sg; i++) {
            absmax = max(absmax, red[i]);
        }
        const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
        const uint dst = (kv * p.capacity + pos) * (hd / 4);
        for (uint i = lid; i < hd / 4; i += Q3W_WG) {
            const uint d = 4 * i;
            k_cache[dst + i] = snorm8x4(float4(rotated[d], rotated[d + 1], rotated[d + 2], rotated[d + 3]) * inv);
        }
        if (lid == 0) {
            k_cache[kv_scale_word(p, kv, pos)] = as_type<uint>(absmax);
        }
    } else {
        // Each lane writes the packed pair (2i, 2i+1): compute both.
        const uint kv = h - kv_first;
        const uint dst = (kv * p.capacity + pos) * half_dim;
        for (uint i = lid; i < half_dim; i += Q3W_WG) {
            float2 pair;
            for (uint e = 0; e < 2; e++) {
                const uint d = 2 * i + e;
                const float2 cs = rope[rope_base + d % half_dim];
                if (d < half_dim) {
                    pair[e] = head[d] * cs.x - head[d + half_dim] * cs.y;
                } else {
                    pair[e] = head[d] * cs.x + head[d - half_dim] * cs.y;
                }
            }
            k_cache[dst + i] = as_type<uint>(half2(pair));
        }
    }
}
