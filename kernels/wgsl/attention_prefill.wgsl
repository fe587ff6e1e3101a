// Prompt batches: attention_partial's batched path for TOKENS consecutive
// tokens per workgroup (4, 8 or 16, chosen in Rust), so that each K and V
// row read from memory serves TOKENS queries instead of one. Workgroup
// (h, c, z) attends query head h of tokens z * TOKENS .. z * TOKENS +
// TOKENS - 1 of the batch (positions step.pos + token, causal) to positions
// [c*WG, (c+1)*WG) and writes each token's chunk statistics (m, l) and acc
// exactly as attention_partial does for one token; attention_reduce
// combines the chunks. One score per invocation and token; vec4s carry the
// tokens four by four (GROUPS of them).
// Every TOKENS computes a token's results with the same operations in the
// same order (the same dot sums, the same max/sum reductions per vec4
// lane, the same acc sums): the values do not depend on TOKENS.
// q comes normed and rotated from qk_norm_rope, which also wrote the batch's
// K/V. Tokens past the batch (its last group may be partial) are computed
// like the others, from the rows past the batch, and never read.
// The loops whose bodies hold barriers (the per-group softmax statistics,
// the per-token acc) are written out by Rust, one copy per group or token:
// a line `// for # in GROUPS: code` (or TOKENS) becomes `code` with # = 0,
// 1, ..., so that every index into the per-token arrays is a constant and
// they stay in registers however the compiler treats such loops.
// Bindings and lo4/hi4: attention_common.wgsl, prepended by Rust after the
// preamble (TOKENS).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

const GROUPS: u32 = TOKENS / 4u;
// One workgroup array (8 KB at WG = 256), used three ways in turn, so that
// more tokens need no more workgroup memory:
// 1. the tokens' q, a piece of WG / TOKENS K quads (8 dims, two q vec4s,
//    each) at a time: token n's q vec4 i of the piece at
//    n * 2 * (WG / TOKENS) + i;
// 2. the tokens' exp(s - m), a piece of 8 * WG / TOKENS positions at a
//    time: position o of the piece, group g at o * GROUPS + g;
// 3. the slices' partial acc of one token (2 vec4s per invocation).
var<workgroup> scratch: array<vec4<f32>, 2u * WG>;

// A K row quad (lo, hi: its 8 f16 values) dotted with the 4 tokens of group
// g, dims 8j..8j+7 (j within the q piece whose tokens lie `stride` apart).
fn dot8x4(lo: vec4<f32>, hi: vec4<f32>, g: u32, j: u32, stride: u32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    for (var n = 0u; n < 4u; n++) {
        let at = (4u * g + n) * stride + 2u * j;
        r[n] = dot(scratch[at], lo) + dot(scratch[at + 1u], hi);
    }
    return r;
}

// Softmax statistics of group g of the tokens over the chunk: (m, l) and
// this invocation's exp(s - m).
struct Stats {
    m: vec4<f32>,
    l: vec4<f32>,
    e: vec4<f32>,
}

fn group_stats(g: u32, d: vec4<f32>, t: u32, end: u32, first_pos: u32, start: u32, lane: Lane) -> Stats {
    let ends = min(min(vec4<u32>(first_pos + 4u * g) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.capacity)),
                   vec4<u32>(start + WG));
    let live = vec4<u32>(t) < ends;
    var s = vec4<f32>(-3.0e38);
    if t < end {
        s = select(vec4<f32>(-3.0e38), d * p.scale, live);
    }
    let m = wg_max4(s, lane);
    let e = select(vec4<f32>(0.0), exp(s - m), live);
    return Stats(m, wg_sum4(e, lane), e);
}

// Where a workgroup's partial results go, and its slices of acc.
struct Parts {
    tok0: u32,
    h: u32,
    c: u32,
    n_chunks: u32,
    row_quads: u32,
    n_slices: u32,
}

// Token n of the group: the slices' parts of its acc (this invocation's lo
// and hi) added, and its (m, l), written.
fn finish_token(at: Parts, n: u32, lo: vec4<f32>, hi: vec4<f32>, ml: vec2<f32>, lane: Lane) {
    workgroupBarrier(); // the previous readers of scratch are done
    scratch[2u * lane.idx] = lo;
    scratch[2u * lane.idx + 1u] = hi;
    workgroupBarrier();
    // Invocation d < head_dim adds dim d (= 8i + r) over the slices.
    let part = ((at.tok0 + n) * p.n_heads + at.h) * at.n_chunks + at.c;
    if lane.idx < p.head_dim {
        let qi = lane.idx / 8u;
        let r = lane.idx % 8u;
        var total = 0.0;
        for (var sl = 0u; sl < at.n_slices; sl++) {
            total += scratch[2u * (sl * at.row_quads + qi) + r / 4u][r % 4u];
        }
        part_acc[part * p.head_dim + lane.idx] = total;
    }
    if lane.idx == 0u {
        part_ml[part] = ml;
    }
}

@compute @workgroup_size(WG)
fn attention_prefill(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let c = wg.y;
    let tok0 = wg.z * TOKENS;
    let n_chunks = nwg.y;
    let start = c * WG;
    // Token n attends to positions below its end; the last token furthest.
    let first_pos = step[0] + tok0 + 1u;
    let end = min(min(first_pos + TOKENS - 1u, p.capacity), start + WG);
    if start >= end {
        // An empty chunk for every token: contributes nothing.
        if lane.idx < TOKENS {
            part_ml[((tok0 + lane.idx) * p.n_heads + h) * n_chunks + c] = vec2<f32>(-3.0e38, 0.0);
        }
        return; // whole workgroup: uniform
    }
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let half_dim = p.head_dim / 2u;
    let kv_base = kvh * p.capacity * half_dim;

    // One position per invocation; its K row in 16-byte loads, four at a
    // time, each dotted with every token's q (q a piece at a time: the same
    // sums in the same order as in one piece, pieces being whole multiples
    // of four loads).
    let t = start + lane.idx;
    let quads = half_dim / 4u;
    let piece = WG / TOKENS;
    let stride = 2u * piece;
    let row = (kv_base + t * half_dim) / 4u;
    var d: array<vec4<f32>, GROUPS>;
    for (var j0 = 0u; j0 < quads; j0 += piece) {
        let pq = 2u * min(piece, quads - j0);
        workgroupBarrier(); // the previous piece's readers are done
        for (var i = lane.idx; i < TOKENS * pq; i += WG) {
            let n = i / pq;
            let o = ((tok0 + n) * p.n_heads + h) * p.head_dim + 8u * j0 + 4u * (i % pq);
            scratch[n * stride + i % pq] = vec4<f32>(q[o], q[o + 1u], q[o + 2u], q[o + 3u]);
        }
        workgroupBarrier();
        if t < end {
            let j1 = min(j0 + piece, quads);
            var j = j0;
            for (; j + 3u < j1; j += 4u) {
                let k0 = k_cache[row + j];
                let k1 = k_cache[row + j + 1u];
                let k2 = k_cache[row + j + 2u];
                let k3 = k_cache[row + j + 3u];
                let a0 = lo4(k0);
                let b0 = hi4(k0);
                let a1 = lo4(k1);
                let b1 = hi4(k1);
                let a2 = lo4(k2);
                let b2 = hi4(k2);
                let a3 = lo4(k3);
                let b3 = hi4(k3);
                let jl = j - j0;
                for (var g = 0u; g < GROUPS; g++) {
                    d[g] += dot8x4(a0, b0, g, jl, stride) + dot8x4(a1, b1, g, jl + 1u, stride)
                        + dot8x4(a2, b2, g, jl + 2u, stride) + dot8x4(a3, b3, g, jl + 3u, stride);
                }
            }
            for (; j < j1; j++) {
                let k = k_cache[row + j];
                let a = lo4(k);
                let b = hi4(k);
                for (var g = 0u; g < GROUPS; g++) {
                    d[g] += dot8x4(a, b, g, j - j0, stride);
                }
            }
        }
    }
    var stats: array<Stats, GROUPS>;
    // for # in GROUPS: stats[#] = group_stats(#u, d[#], t, end, first_pos, start, lane);

    // Invocation (slice, i) sums dims 8i..8i+7 (one 16-byte load per
    // position, shared by the tokens) over positions start + slice,
    // start + slice + n_slices, ... (in that order, across the pieces of
    // exp(s - m)); then the slices are added, token by token.
    let row_quads = p.head_dim / 8u;
    let n_slices = WG / row_quads;
    let slice = lane.idx / row_quads;
    let i = lane.idx % row_quads;
    let vb = kv_base / 4u + i;
    let e_piece = 8u * WG / TOKENS;
    var lo: array<vec4<f32>, TOKENS>;
    var hi: array<vec4<f32>, TOKENS>;
    for (var p0 = 0u; p0 < WG; p0 += e_piece) {
        workgroupBarrier(); // the previous readers of scratch are done
        if lane.idx >= p0 && lane.idx < p0 + e_piece {
            for (var g = 0u; g < GROUPS; g++) {
                scratch[(lane.idx - p0) * GROUPS + g] = stats[g].e;
            }
        }
        workgroupBarrier();
        if slice < n_slices {
            // The slice's first position in the piece.
            var o = slice;
            if p0 > slice {
                o = slice + (p0 - slice + n_slices - 1u) / n_slices * n_slices;
            }
            let o_end = min(p0 + e_piece, end - start);
            for (; o < o_end; o += n_slices) {
                let v = v_cache[vb + (start + o) * row_quads];
                let a = lo4(v);
                let b = hi4(v);
                for (var g = 0u; g < GROUPS; g++) {
                    let ev = scratch[(o - p0) * GROUPS + g];
                    for (var r = 0u; r < 4u; r++) {
                        lo[4u * g + r] += ev[r] * a;
                        hi[4u * g + r] += ev[r] * b;
                    }
                }
            }
        }
    }
    let at = Parts(tok0, h, c, n_chunks, row_quads, n_slices);
    // for # in TOKENS: finish_token(at, #u, lo[#], hi[#], vec2<f32>(stats[# / 4].m[# % 4], stats[# / 4].l[# % 4]), lane);
}
