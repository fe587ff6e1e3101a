// Prompt batches on 16 x 16 matrix tiles: attention_prefill's outputs
// (each token's chunk statistics (m, l) and acc, combined by
// attention_reduce) from two tile products per workgroup, for adapters
// with cooperative matrices (attention_prefill_coop.wgsl; its emulation
// without them, attention_prefill_coop_emulated.wgsl, computes the same
// tiles with scalar sums). Workgroup (h, c, z) attends query head h of the
// TOKENS (16) tokens z * TOKENS .. (positions step.pos + token, causal) to
// the chunk's positions [c * WG, (c + 1) * WG):
//   S = K Q^T           (positions x tokens: 16-position tiles, f32 sums of
//                        f16 K rows and f16 q, in s_s)
//   P = exp(S * scale - m), m and l = sum P per token (f32, P rounded to f16
//                        once, in qp_s over q; l sums the rounded weights)
//   acc^T = V^T P^T     (dims x tokens: 16-dim tiles, in s_s again)
// Subgroup sg (of WG / 32) computes the S tiles sg, sg + 8, .. and the
// acc tiles sg, sg + 8, .. . Full 16-position tiles are read straight from
// the f16 cache; the chunk's last partial tile (positions past the
// context, which may lie past the binding, are not read) from a copy in
// workgroup memory with zeros past the context: K's, then V's. The arrays
// take 32 KB, what Apple GPUs and lavapipe offer.
// head_dim is a multiple of 16 (Rust runs attention_prefill otherwise).
// Bindings: attention_common.wgsl's, the caches as f16 values (the
// f16 cache only; an int8 one runs attention_prefill).
// Preamble (from Rust): `enable f16;` (and the cooperative matrices'),
// TOKENS, the generated Params, Step and MAX_HEAD_DIM.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> k16: array<f16>;
@group(0) @binding(4) var<storage, read_write> v16: array<f16>;
@group(0) @binding(5) var<storage, read_write> part_ml: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> part_acc: array<f32>;

// The tokens' q (f16): token t's dims at t * head_dim; then P: token t's
// weights at t * WG + position (TOKENS * WG = TOKENS * MAX_HEAD_DIM values,
// Rust checks).
var<workgroup> qp_s: array<f16, TOKENS * WG>;
// S: token t's scores at t * WG + position; then the softmax's partial
// maxima and sums; then acc: token t's dims at t * head_dim.
var<workgroup> s_s: array<f32, TOKENS * WG>;
// The partial tile's K (then V) rows: position o's dims at o * head_dim.
var<workgroup> t_s: array<f16, 16u * MAX_HEAD_DIM>;

// Where the workgroup's chunk lies.
struct Chunk {
    h: u32,
    c: u32,
    tok0: u32,
    n_chunks: u32,
    start: u32,
    // Token 0's end (its position + 1); token t's is first_pos + t.
    first_pos: u32,
    // Positions of the chunk some token attends to; full 16-position
    // tiles of them, and tiles with the partial one.
    live: u32,
    full: u32,
    tiles: u32,
    // The chunk's first row in the caches (f16 values).
    row0: u32,
}

fn chunk_at(wg: vec3<u32>, nwg: vec3<u32>) -> Chunk {
    let start = wg.y * WG;
    let tok0 = wg.z * TOKENS;
    let first_pos = step[0] + tok0 + 1u;
    let end = min(min(first_pos + TOKENS - 1u, p.capacity), start + WG);
    let live = select(0u, end - start, end > start);
    let kvh = wg.x / (p.n_heads / p.n_kv_heads);
    let row0 = (kvh * p.capacity + start) * p.head_dim;
    return Chunk(wg.x, wg.y, tok0, nwg.y, start, first_pos, live, live / 16u, (live + 15u) / 16u, row0);
}

// Copies the partial tile's rows of `cache` (0: K, 1: V) into t_s.
fn stage_tail(idx: u32, at: Chunk, cache: u32) {
    if at.full == at.tiles {
        return; // uniform
    }
    for (var e = idx; e < 16u * p.head_dim; e += WG) {
        let o = 16u * at.full + e / p.head_dim;
        var v = f16(0.0);
        if o < at.live {
            let i = at.row0 + o * p.head_dim + e % p.head_dim;
            if cache == 0u {
                v = k16[i];
            } else {
                v = v16[i];
            }
        }
        t_s[e] = v;
    }
}

// q as f16 (clamped to its range), and the partial tile's K rows.
fn stage(idx: u32, at: Chunk) {
    for (var e = idx; e < TOKENS * p.head_dim; e += WG) {
        let t = e / p.head_dim;
        let x = q[((at.tok0 + t) * p.n_heads + at.h) * p.head_dim + e % p.head_dim];
        qp_s[e] = f16(clamp(x, -65504.0, 65504.0));
    }
    stage_tail(idx, at, 0u);
}

// Whether token t attends to chunk position o.
fn attends(at: Chunk, t: u32, o: u32) -> bool {
    return o < at.live && at.start + o < min(at.first_pos + t, p.capacity);
}

// The tokens' statistics over the chunk and their weights P (in qp_s):
// invocation (t, j) = (idx / 16, idx % 16) takes positions j, j + 16, ..
// of token t, its scores held while s_s takes the partial maxima (at
// t * WG + j) and sums (at t * WG + 16 + j). Restages the partial tile
// with V's rows meanwhile.
fn softmax(idx: u32, at: Chunk) {
    let t = idx / 16u;
    let j = idx % 16u;
    var sc: array<f32, 16>;
    var m = -3.0e38;
    for (var k = 0u; k < 16u; k++) {
        let o = j + 16u * k;
        sc[k] = select(-3.0e38, s_s[t * WG + o] * p.scale, attends(at, t, o));
        m = max(m, sc[k]);
    }
    stage_tail(idx, at, 1u);
    workgroupBarrier(); // every score read
    s_s[t * WG + j] = m;
    workgroupBarrier();
    m = s_s[t * WG];
    for (var i = 1u; i < 16u; i++) {
        m = max(m, s_s[t * WG + i]);
    }
    var l = 0.0;
    for (var k = 0u; k < 16u; k++) {
        let o = j + 16u * k;
        let w = select(f16(0.0), f16(exp(sc[k] - m)), attends(at, t, o));
        qp_s[t * WG + o] = w;
        l += f32(w);
    }
    s_s[t * WG + 16u + j] = l;
    workgroupBarrier();
    if j == 0u {
        l = 0.0;
        for (var i = 0u; i < 16u; i++) {
            l += s_s[t * WG + 16u + i];
        }
        part_ml[((at.tok0 + t) * p.n_heads + at.h) * at.n_chunks + at.c] = vec2<f32>(m, l);
    }
    workgroupBarrier(); // the sums read before acc overwrites s_s
}

// Each token's acc (from s_s) into part_acc.
fn store_acc(idx: u32, at: Chunk) {
    for (var e = idx; e < TOKENS * p.head_dim; e += WG) {
        let t = e / p.head_dim;
        let part = ((at.tok0 + t) * p.n_heads + at.h) * at.n_chunks + at.c;
        part_acc[part * p.head_dim + e % p.head_dim] = s_s[e];
    }
}

// The whole workgroup's work; subgroup `sg` (of WG / 32, lane `lane`)
// computes the tiles score_tile and acc_tile (the program's) say.
fn attend(idx: u32, wg: vec3<u32>, nwg: vec3<u32>, sg: u32, lane: u32) {
    let at = chunk_at(wg, nwg);
    if at.live == 0u {
        // An empty chunk for every token: contributes nothing.
        if idx < TOKENS {
            part_ml[((at.tok0 + idx) * p.n_heads + at.h) * at.n_chunks + at.c] = vec2<f32>(-3.0e38, 0.0);
        }
        return; // whole workgroup: uniform
    }
    stage(idx, at);
    workgroupBarrier();
    for (var i = sg; i < at.tiles; i += WG / 32u) {
        score_tile(at, i, lane);
    }
    workgroupBarrier();
    softmax(idx, at);
    for (var d = sg; d < p.head_dim / 16u; d += WG / 32u) {
        acc_tile(at, d, lane);
    }
    workgroupBarrier();
    store_acc(idx, at);
}
