// Decode attention, split over positions (as llama.cpp's flash_attn_ext_vec
// and MLX's sdpa_vector 2-pass): workgroup (h, c) attends query head h to
// cached positions [c*CHUNK, (c+1)*CHUNK) and writes that chunk's softmax
// statistics: its max m, its sum l = sum(exp(s - m)) and
// acc = sum(exp(s - m) * v). attention_reduce combines the chunks. GQA by
// indexing: kv_head = h / (n_heads / n_kv_heads), no K/V copies. K/V: f16
// pairs packed in u32, [kv_head][capacity][head_dim/2].
// Batched (prompt tokens): workgroup (h, c, z) serves token z of the batch,
// at position step.pos + z, over positions <= its own (causal); q comes
// normed and rotated from qk_norm_rope, which also wrote the batch's K/V.
//
// Decode steps (one token) fold in qk_norm_rope's work and, at short
// contexts, the reduce, saving two dependent launches per layer:
// - FUSED: q is read raw from the qkv projection's output and normed and
//   rotated here; the workgroup whose chunk holds the new position first
//   writes that position's k (normed, rotated) and v to the caches, then
//   reads them back like any other position. The two query heads of a KV
//   head both write it, the same values.
// - DIRECT (the context fits one chunk; grid (heads, 1, 1)): the chunk's
//   result is the output, normalised and written to part_acc's binding
//   (bound to the output), no reduce.
// - ROWS (a batch of sessions' decode steps, FUSED): workgroup (h, c, z)
//   serves row z: its position and KV region come from the step binding's
//   row words, its qkv row from qkv[z * qkv_stride ..], and DIRECT writes
//   its output at z * OUT_STRIDE. The direct launch serves the rows whose
//   context fits one chunk and the chunked one (with the reduce) the
//   others, each row running exactly the code of its session's step alone.
// - PACKED (long contexts): two query heads a workgroup. From position
//   p.pack_from on, with p.pack = 2 (the heads of a KV head come in pairs),
//   workgroup h (even) serves heads h and h + 1 and workgroup h + 1 returns
//   at once, so each K and V row is loaded (and, int8, decoded) once for
//   both. Each head's result has the bits of its unpacked run: the same
//   operations in the same order, the second head in the second component.
//   A pipeline of its own: the second head's registers would slow every
//   unpacked launch (2-5% on an H100).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

override FUSED: bool = false;
override DIRECT: bool = false;
override ROWS: bool = false;
override PACKED: bool = false;
// ROWS and DIRECT: elements between rows of the output.
override OUT_STRIDE: u32 = 0u;

// FUSED: the q norm weight, then the k norm weight (head_dim each), and
// RoPE's (cos, sin) table (rope[pos * head_dim / 2 + d], as qk_norm_rope's).
@group(0) @binding(7) var<storage, read> qk_norm: array<f32>;
@group(0) @binding(8) var<storage, read> rope: array<vec2<f32>>;

// Positions per workgroup = WG (one score per invocation). q_s: the
// workgroup's (at most two) heads' q, head_dim / 4 vec4s each; e_s: each
// position's weight for both heads.
var<workgroup> q_s: array<vec4<f32>, MAX_HEAD_DIM / 2u>;
var<workgroup> e_s: array<vec2<f32>, WG>;
// The scores' partial dot products (ATTENTION_KEY_LANES per position, at
// most 8: src/kernels/attention.rs), then the V sums' slices (8 per
// invocation): scalars, each written by one invocation.
var<workgroup> acc_s: array<f32, 8u * WG>;
// KV_INT8: the scores and V sums are integer dot products (dot4I8Packed)
// of the int8 rows against 16-bit fixed-point parts (int8_parts.wgsl):
// qh_s / ql_s hold the heads' q (word w of head g at g * head_dim / 4 + w,
// relative to the head's largest magnitude), w_s each position's V weight
// (e times its V step, relative to the chunk's largest V step) as bytes
// (h of the first head, h of the second, l of the first, l of the second).
// Per int8 value a third of the float decoding's operations (the bound of
// the float-decoding kernel: BENCHMARKS.md 2026-12-06 08:34).
var<workgroup> qh_s: array<u32, MAX_HEAD_DIM / 2u>;
var<workgroup> ql_s: array<u32, MAX_HEAD_DIM / 2u>;
var<workgroup> w_s: array<u32, WG>;
// K row quad j (8 f16 values) dotted with q's dims 8j..8j+7 (q at vec4
// `qo` of q_s).
fn dot8(a: vec4<u32>, j: u32, qo: u32) -> f32 {
    return dot(q_s[qo + 2u * j], lo4(a)) + dot(q_s[qo + 2u * j + 1u], hi4(a));
}

// KV_INT8: the caches hold int8 rows (a quad is 16 values; head_dim a
// multiple of 16) and a scale per row (kv_cache.wgsl's layout,
// `kv_scale_word`): a score is the row's dot with q times its K step (scale /
// 127), and a position's weight in the V sums its e times its V step. Both
// are integer dot products against q and the weights in 16-bit fixed point
// (an error of at most 1/64,516 of the head's largest |q|, or of the
// chunk's largest V step, a value: far under the int8 rows' own 1/254).

// KV_INT8: q's parts for dims 16j..16j+15 of the head whose words start
// at `base` (qh_s, ql_s).
struct QWords {
    h: vec4<u32>,
    l: vec4<u32>,
}

fn q_words(base: u32, j: u32) -> QWords {
    let w = base + 4u * j;
    return QWords(vec4<u32>(qh_s[w], qh_s[w + 1u], qh_s[w + 2u], qh_s[w + 3u]),
                  vec4<u32>(ql_s[w], ql_s[w + 1u], ql_s[w + 2u], ql_s[w + 3u]));
}

// K row quad `a` (16 int8 values) dotted with q's parts: 254 sum(k h) +
// sum(k l), exact in i32 (|.| < 2^27) and rounded once to f32, in units of
// the head's q step / 254.
fn idot16(a: vec4<u32>, q: QWords) -> f32 {
    let h = dot4I8Packed(a.x, q.h.x) + dot4I8Packed(a.y, q.h.y) + dot4I8Packed(a.z, q.h.z) + dot4I8Packed(a.w, q.h.w);
    let l = dot4I8Packed(a.x, q.l.x) + dot4I8Packed(a.y, q.l.y) + dot4I8Packed(a.z, q.l.z) + dot4I8Packed(a.w, q.l.w);
    return f32(254 * h + l);
}

// The parts of the four values `v` of a head's q (its largest magnitude
// `amax`; zero below 1e-30).
fn q_parts(v: vec4<f32>, amax: f32) -> Parts4 {
    let live = amax >= 1e-30;
    return parts4(v, select(0.0, 127.0 / amax, live), select(0.0, amax / 127.0, live));
}

// Bytes c of the four words: result c holds byte c of r.x, r.y, r.z, r.w
// (low byte first), a 4 x 4 byte transpose in two swaps of halves.
fn transpose_bytes(r: vec4<u32>) -> vec4<u32> {
    let t0 = (r.x & 0xffffu) | (r.z << 16u);
    let t1 = (r.y & 0xffffu) | (r.w << 16u);
    let t2 = (r.x >> 16u) | (r.z & 0xffff0000u);
    let t3 = (r.y >> 16u) | (r.w & 0xffff0000u);
    return vec4<u32>((t0 & 0x00ff00ffu) | ((t1 & 0x00ff00ffu) << 8u), ((t0 >> 8u) & 0x00ff00ffu) | (t1 & 0xff00ff00u),
                     (t2 & 0x00ff00ffu) | ((t3 & 0x00ff00ffu) << 8u), ((t2 >> 8u) & 0x00ff00ffu) | (t3 & 0xff00ff00u));
}

// Four dims over four positions (`t`: a dim's bytes of the positions, as
// transpose_bytes makes them) dotted with the positions' weight bytes `w`.
fn idot_dims(t: vec4<u32>, w: u32) -> vec4<i32> {
    return vec4<i32>(dot4I8Packed(t.x, w), dot4I8Packed(t.y, w), dot4I8Packed(t.z, w), dot4I8Packed(t.w, w));
}

// Four dims over two groups of four positions (`a`, `b`: transposed as
// idot_dims takes them) weighed by their weights' parts (h words `ha`,
// `hb`, l words `la`, `lb`): 254 sum(h v) + sum(l v).
fn idot_parts(a: vec4<u32>, b: vec4<u32>, ha: u32, la: u32, hb: u32, lb: u32) -> vec4<i32> {
    return 254 * (idot_dims(a, ha) + idot_dims(b, hb)) + idot_dims(a, la) + idot_dims(b, lb);
}


// u32 words of a K/V row.
fn row_words(int8: bool) -> u32 {
    return select(p.head_dim / 2u, p.head_dim / 4u, int8);
}


// Four consecutive dims e..e+3 of one head of the qkv output (at `base`),
// their rotate-half RoPE partners (e +- head_dim/2: head_dim is a multiple
// of 8, so the four lie on one side of head_dim/2 and so do their
// partners), both norm weights (at `nbase`) and the table's (cos, sin).
struct Dims4 {
    a: vec4<f32>,
    b: vec4<f32>,
    na: vec4<f32>,
    nb: vec4<f32>,
    cosine: vec4<f32>,
    sine: vec4<f32>,
    low: bool,
}

fn load_dims4(base: u32, nbase: u32, e: u32, pos: u32) -> Dims4 {
    let half_dim = p.head_dim / 2u;
    let low = e < half_dim;
    let f = select(e - half_dim, e + half_dim, low);
    let c = pos * half_dim + e % half_dim;
    let r0 = rope[c];
    let r1 = rope[c + 1u];
    let r2 = rope[c + 2u];
    let r3 = rope[c + 3u];
    return Dims4(
        vec4<f32>(q[base + e], q[base + e + 1u], q[base + e + 2u], q[base + e + 3u]),
        vec4<f32>(q[base + f], q[base + f + 1u], q[base + f + 2u], q[base + f + 3u]),
        vec4<f32>(qk_norm[nbase + e], qk_norm[nbase + e + 1u], qk_norm[nbase + e + 2u], qk_norm[nbase + e + 3u]),
        vec4<f32>(qk_norm[nbase + f], qk_norm[nbase + f + 1u], qk_norm[nbase + f + 2u], qk_norm[nbase + f + 3u]),
        vec4<f32>(r0.x, r1.x, r2.x, r3.x),
        vec4<f32>(r0.y, r1.y, r2.y, r3.y),
        low,
    );
}

// rope(rms_norm(x) * norm) of the four dims, `inv` the head's 1/rms.
fn rope4(x: Dims4, inv: f32) -> vec4<f32> {
    let a = x.a * inv * x.na;
    let b = x.b * inv * x.nb;
    if x.low {
        return a * x.cosine - b * x.sine;
    }
    return a * x.cosine + b * x.sine;
}

// The sums of squares of the workgroup's q heads (x: the first, y: the
// second when `np` is 2; lane t of each team adds dims t, t + team size,
// ...) and, in z with `writes_kv`, k's: each team sums them itself, so
// the norms need no workgroup reduction.
fn head_squares(qb: u32, kb: u32, np: u32, writes_kv: bool, lane: Lane) -> vec4<f32> {
    let hd = p.head_dim;
    var sq = vec4<f32>(0.0);
    for (var t = team_lane(lane); t < hd; t += team_size(lane)) {
        let a = q[qb + t];
        sq.x += a * a;
        if np > 1u {
            let a1 = q[qb + hd + t];
            sq.y += a1 * a1;
        }
        if writes_kv {
            let b = q[kb + t];
            sq.z += b * b;
        }
    }
    return team_sum4(sq, lane);
}

// The new K and V rows' words, parked by their invocations (kv_words)
// for the invocations that write the rows' quads (kv_quad).
var<workgroup> kvw_s: array<u32, MAX_HEAD_DIM>;
// The first invocation holding k or v dims: after q's (np * head_dim/4 <=
// MAX_HEAD_DIM / 2), and KV_LANE0 + head_dim/2 <= WG
// (src/kernels/attention.rs asserts MAX_HEAD_DIM <= WG).
const KV_LANE0: u32 = MAX_HEAD_DIM / 2u;

// This invocation's share of the new K and V rows: `w`-th 4 dims (k's for
// w < head_dim/4, then v's), starting at dim `e`.
struct KvWords {
    k: bool,
    v: bool,
    w: u32,
    e: u32,
}

fn kv_words(lane: Lane, writes_kv: bool) -> KvWords {
    let qw = p.head_dim / 4u;
    let w = min(max(lane.idx, KV_LANE0) - KV_LANE0, 2u * qw - 1u);
    let live = writes_kv && lane.idx >= KV_LANE0 && lane.idx < KV_LANE0 + 2u * qw;
    return KvWords(live && w < qw, live && w >= qw, w, 4u * (w % qw));
}

// Quad j of the parked words (K's quads, then V's).
fn kv_quad(j: u32) -> vec4<u32> {
    return vec4<u32>(kvw_s[4u * j], kvw_s[4u * j + 1u], kvw_s[4u * j + 2u], kvw_s[4u * j + 3u]);
}

// The fused prologue's values of this invocation (fused_qk's list):
// q's four rotated dims `q` of head `g` (`q_lane`: an invocation that
// holds some), and its share `kv` of the new rows with their four values
// `kv_vals` (k's rotated, or v's).
struct FusedDims {
    q: vec4<f32>,
    g: u32,
    q_lane: bool,
    kv: KvWords,
    kv_vals: vec4<f32>,
}

fn fused_dims(h: u32, np: u32, kvh: u32, pos: u32, writes_kv: bool, lane: Lane, qkv_row: u32) -> FusedDims {
    let hd = p.head_dim;
    let qw = hd / 4u;
    let qb = qkv_row + h * hd;
    let kb = qkv_row + (p.n_heads + kvh) * hd;
    let vb = qkv_row + (p.n_heads + p.n_kv_heads + kvh) * hd;
    // q: head g's dims 4i..4i+3, in range for the inactive invocations too.
    let gi = min(lane.idx, np * qw - 1u);
    let g = gi / qw;
    let qd = load_dims4(qb + g * hd, 0u, 4u * (gi % qw), pos);
    let kv = kv_words(lane, writes_kv);
    var kd: Dims4;
    var v = vec4<f32>(0.0);
    if kv.k {
        kd = load_dims4(kb, hd, kv.e, pos);
    }
    if kv.v {
        v = vec4<f32>(q[vb + kv.e], q[vb + kv.e + 1u], q[vb + kv.e + 2u], q[vb + kv.e + 3u]);
    }
    let ss = head_squares(qb, kb, np, writes_kv, lane);
    if kv.k {
        v = rope4(kd, inverseSqrt(ss.z / f32(hd) + p.eps));
    }
    return FusedDims(rope4(qd, inverseSqrt(ss[g] / f32(hd) + p.eps)), g, lane.idx < np * qw, kv, v);
}

// FUSED: q_s = rope(rms_norm(q_h) * q_norm) for the workgroup's `np` heads
// from h; with `writes_kv`, also the new position's k_cache =
// f16(rope(rms_norm(k) * k_norm)) and v_cache = f16(v).
// Every load is issued up front, so the prologue waits on memory once:
// - invocation i < np * head_dim/4 rotates dims 4i..4i+3 of the heads'
//   q (head i / (head_dim/4)), loading their RoPE partners itself, and
//   writes q_s[i];
// - invocation KV_LANE0 + i (kv_words) rotates k's dims 4i..4i+3 likewise,
//   or loads v's, and parks them in kvw_s; invocation j < head_dim/4 then
//   writes quad j % (head_dim/8) of the new K (j < head_dim/8) or V row.
// Four dims an invocation, not a quad's eight (f16) or sixteen (int8): a
// kernel's occupancy follows its phase with the most live registers, and
// a quad's dims loaded up front made that the prologue (BENCHMARKS.md,
// 2026-12-07 22:13: per-workgroup work bounds this kernel).
// Each vector in workgroup or storage memory is written whole by one
// invocation: lanes writing different components of one vector could be
// compiled to read-modify-writes of the whole vector that lose each
// other's components.
fn fused_qk(h: u32, np: u32, kvh: u32, pos: u32, writes_kv: bool, lane: Lane, qkv_row: u32, kv_off: u32) {
    let hd = p.head_dim;
    let d = fused_dims(h, np, kvh, pos, writes_kv, lane, qkv_row);
    if d.q_lane {
        q_s[lane.idx] = d.q;
    }
    if d.kv.k || d.kv.v {
        kvw_s[2u * d.kv.w] = pack2x16float(d.kv_vals.xy);
        kvw_s[2u * d.kv.w + 1u] = pack2x16float(d.kv_vals.zw);
    }
    workgroupBarrier(); // publishes kvw_s
    if writes_kv && lane.idx < hd / 4u {
        let quads = hd / 8u;
        let row = kv_off + ((kvh * p.capacity + pos) * (hd / 2u)) / 4u + lane.idx % quads;
        let quad = kv_quad(lane.idx);
        if lane.idx < quads {
            k_cache[row] = quad;
        } else {
            v_cache[row] = quad;
        }
    }
    // Publishes q_s, and the new K/V row that other invocations read back.
    storageBarrier();
    workgroupBarrier();
}

// fused_qk with an int8 KV cache, four dims an invocation likewise:
// after one workgroup exchange of the rows' largest magnitudes (their
// scales) and the q heads' (for their int8 parts, qh_s / ql_s), which
// every invocation takes (the chunk holding the position is not known to
// be uniform), the k and v invocations park their int8 words in kvw_s and
// invocation j < head_dim/8 writes quad j % (head_dim/16) of the new K
// (j < head_dim/16) or V row, and its first the row's scale, as a whole
// vec4 (a head's scales share no vec4 with another head's). Returns the
// new K and V rows' largest magnitudes and the q heads'.
fn fused_qk_int8(h: u32, np: u32, kvh: u32, pos: u32, writes_kv: bool, lane: Lane, qkv_row: u32, kv_off: u32) -> vec4<f32> {
    let hd = p.head_dim;
    let d = fused_dims(h, np, kvh, pos, writes_kv, lane, qkv_row);
    if d.q_lane {
        q_s[lane.idx] = d.q;
    }
    let va = abs(d.kv_vals);
    let vm = max(max(va.x, va.y), max(va.z, va.w));
    let qa = abs(d.q);
    let qm = select(0.0, max(max(qa.x, qa.y), max(qa.z, qa.w)), d.q_lane);
    let mx = wg_max4(vec4<f32>(select(0.0, vm, d.kv.k), select(0.0, vm, d.kv.v), select(0.0, qm, d.g == 0u),
                               select(0.0, qm, d.g == 1u)), lane);
    if d.q_lane {
        let qp = q_parts(d.q, mx[2u + d.g]);
        qh_s[lane.idx] = qp.h;
        ql_s[lane.idx] = qp.l;
    }
    if d.kv.k || d.kv.v {
        let m = select(mx.y, mx.x, d.kv.k);
        kvw_s[d.kv.w] = pack4x8snorm(d.kv_vals * select(0.0, 1.0 / m, m > 0.0));
    }
    workgroupBarrier(); // publishes kvw_s
    if writes_kv && lane.idx < hd / 8u {
        let quads = hd / 16u;
        let j = lane.idx % quads;
        let row = kv_off + ((kvh * p.capacity + pos) * (hd / 4u)) / 4u + j;
        let sw = kv_scale_word(kv_off, kvh, pos);
        let quad = kv_quad(lane.idx);
        if lane.idx < quads {
            k_cache[row] = quad;
            if j == 0u {
                var ks = k_cache[sw / 4u];
                ks[sw % 4u] = bitcast<u32>(mx.x);
                k_cache[sw / 4u] = ks;
            }
        } else {
            v_cache[row] = quad;
            if j == 0u {
                var vs = v_cache[sw / 4u];
                vs[sw % 4u] = bitcast<u32>(mx.y);
                v_cache[sw / 4u] = vs;
            }
        }
    }
    // Publishes q_s, its parts, and the new K/V row and scales that other
    // invocations read back.
    storageBarrier();
    workgroupBarrier();
    return mx;
}

// KV_INT8, q loaded (not FUSED): the parts of the `np` heads' q in q_s,
// each head's relative to its largest magnitude (returned).
fn quantise_q(np: u32, lane: Lane) -> vec2<f32> {
    let qw = p.head_dim / 4u;
    let q_lane = lane.idx < np * qw;
    let g = min(lane.idx, np * qw - 1u) / qw;
    let qv = q_s[min(lane.idx, np * qw - 1u)];
    let qa = abs(qv);
    let qm = select(0.0, max(max(qa.x, qa.y), max(qa.z, qa.w)), q_lane);
    let mx = wg_max4(vec4<f32>(select(0.0, qm, g == 0u), select(0.0, qm, g == 1u), 0.0, 0.0), lane);
    if q_lane {
        let qp = q_parts(qv, mx[g]);
        qh_s[lane.idx] = qp.h;
        ql_s[lane.idx] = qp.l;
    }
    workgroupBarrier(); // publishes qh_s, ql_s
    return mx.xy;
}

// The score phase's loads for four K rows (ta: their first quads' indices):
// quads ja and jb of each.
struct KeyQuads {
    a0: vec4<u32>,
    a1: vec4<u32>,
    a2: vec4<u32>,
    a3: vec4<u32>,
    b0: vec4<u32>,
    b1: vec4<u32>,
    b2: vec4<u32>,
    b3: vec4<u32>,
}

fn key_quads(ta: vec4<u32>, ja: u32, jb: u32, quads: u32) -> KeyQuads {
    let a0 = k_cache[ta.x + ja];
    let a1 = k_cache[ta.y + ja];
    let a2 = k_cache[ta.z + ja];
    let a3 = k_cache[ta.w + ja];
    if quads <= ATTENTION_KEY_LANES {
        // (An int8 row at head_dim 128: one quad a lane, no second load.)
        return KeyQuads(a0, a1, a2, a3, a0, a1, a2, a3);
    }
    return KeyQuads(a0, a1, a2, a3, k_cache[ta.x + jb], k_cache[ta.y + jb], k_cache[ta.z + jb], k_cache[ta.w + jb]);
}

// Lane r's partial dots of the four rows: quads r (ja), r + L (jb) and any
// further ones (L = ATTENTION_KEY_LANES; head_dim > 16 * L); quads past the
// row (head_dim < 8 * L) add nothing.
fn key_dots(k: KeyQuads, ta: vec4<u32>, r: u32, ja: u32, jb: u32, quads: u32, qo: u32) -> vec4<f32> {
    var d = vec4<f32>(0.0);
    if r < quads {
        d = vec4<f32>(dot8(k.a0, ja, qo), dot8(k.a1, ja, qo), dot8(k.a2, ja, qo), dot8(k.a3, ja, qo));
    }
    if r + ATTENTION_KEY_LANES < quads {
        d += vec4<f32>(dot8(k.b0, jb, qo), dot8(k.b1, jb, qo), dot8(k.b2, jb, qo), dot8(k.b3, jb, qo));
    }
    for (var j = r + 2u * ATTENTION_KEY_LANES; j < quads; j += ATTENTION_KEY_LANES) {
        d += vec4<f32>(dot8(k_cache[ta.x + j], j, qo), dot8(k_cache[ta.y + j], j, qo),
                       dot8(k_cache[ta.z + j], j, qo), dot8(k_cache[ta.w + j], j, qo));
    }
    return d;
}

// KV_INT8: key_dots of int8 rows (quads ja and jb: a row has at most
// 2 * ATTENTION_KEY_LANES int8 quads, src/kernels/attention.rs), against
// one head's q parts for those quads, in units of its q step / 254.
fn key_dots_int8(k: KeyQuads, r: u32, quads: u32, qa: QWords, qb: QWords) -> vec4<f32> {
    var d = vec4<f32>(0.0);
    if r < quads {
        d = vec4<f32>(idot16(k.a0, qa), idot16(k.a1, qa), idot16(k.a2, qa), idot16(k.a3, qa));
    }
    if r + ATTENTION_KEY_LANES < quads {
        d += vec4<f32>(idot16(k.b0, qb), idot16(k.b1, qb), idot16(k.b2, qb), idot16(k.b3, qb));
    }
    return d;
}

// One head's scores from its partial dots (da: rows tv, db: rows tu of
// this lane's ATTENTION_KEY_LANES-lane slot r): parked in acc_s, then
// invocation t adds position t's (n: positions in the chunk) and returns
// its scaled score (-3e38 past the chunk; KV_INT8: the dots in units of
// `unit`, position t's); `more`: another head's follow.
// Workgroup-uniform control flow.
fn head_score(da: vec4<f32>, db: vec4<f32>, tv: vec4<u32>, tu: vec4<u32>, n: u32, r: u32, idx: u32, unit: f32,
              more: bool) -> f32 {
    for (var i = 0u; i < 4u; i++) {
        if tv[i] < n {
            acc_s[tv[i] * ATTENTION_KEY_LANES + r] = da[i];
        }
        if tu[i] < n {
            acc_s[tu[i] * ATTENTION_KEY_LANES + r] = db[i];
        }
    }
    workgroupBarrier(); // publishes the partial dots
    var s = -3.0e38;
    if idx < n {
        var d = 0.0;
        for (var i = 0u; i < ATTENTION_KEY_LANES; i++) {
            d += acc_s[idx * ATTENTION_KEY_LANES + i];
        }
        if KV_INT8 {
            d *= unit;
        }
        s = d * p.scale;
    }
    if more {
        workgroupBarrier(); // the next head's dots overwrite acc_s
    }
    return s;
}

// A V phase iteration's eight positions from `tt`, `ns` (the slices)
// apart: t and u, four each, and the rows they load, ta and tb (past
// `last`, the last row: those positions weigh 0).
struct VPositions {
    t: vec4<u32>,
    u: vec4<u32>,
    ta: vec4<u32>,
    tb: vec4<u32>,
}

fn v_positions(tt: u32, ns: u32, last: u32) -> VPositions {
    let t = vec4<u32>(tt, tt + ns, tt + 2u * ns, tt + 3u * ns);
    let u = t + vec4<u32>(4u * ns);
    return VPositions(t, u, min(t, vec4<u32>(last)), min(u, vec4<u32>(last)));
}

// The V rows' vec4s at `vb` (a dim slice's, in the first row) of eight
// positions (ta, tb), rows `row_vec4s` apart: eight independent loads.
struct VRows {
    v0: vec4<u32>,
    v1: vec4<u32>,
    v2: vec4<u32>,
    v3: vec4<u32>,
    v4: vec4<u32>,
    v5: vec4<u32>,
    v6: vec4<u32>,
    v7: vec4<u32>,
}

fn v_rows(vb: u32, ta: vec4<u32>, tb: vec4<u32>, row_vec4s: u32) -> VRows {
    return VRows(v_cache[vb + ta.x * row_vec4s], v_cache[vb + ta.y * row_vec4s], v_cache[vb + ta.z * row_vec4s],
                 v_cache[vb + ta.w * row_vec4s], v_cache[vb + tb.x * row_vec4s], v_cache[vb + tb.y * row_vec4s],
                 v_cache[vb + tb.z * row_vec4s], v_cache[vb + tb.w * row_vec4s]);
}

// Eight positions' f16 V rows (v_rows) weighed by ea and eb,
// added to dims 0..3 (`hi`: 4..7) of this invocation's 8.
fn v_sum(ea: vec4<f32>, eb: vec4<f32>, v: VRows, hi: bool) -> vec4<f32> {
    if hi {
        return ea.x * hi4(v.v0) + ea.y * hi4(v.v1) + ea.z * hi4(v.v2) + ea.w * hi4(v.v3)
            + eb.x * hi4(v.v4) + eb.y * hi4(v.v5) + eb.z * hi4(v.v6) + eb.w * hi4(v.v7);
    }
    return ea.x * lo4(v.v0) + ea.y * lo4(v.v1) + ea.z * lo4(v.v2) + ea.w * lo4(v.v3)
        + eb.x * lo4(v.v4) + eb.y * lo4(v.v5) + eb.z * lo4(v.v6) + eb.w * lo4(v.v7);
}

// Adds the V sums' slices of one head (this invocation's 8 dims in lo, hi)
// and writes its result: invocation d < head_dim adds dim d (= 8i + r) over
// the slices; `after`: after another head's (whose readers of acc_s must
// be done; the scores' were before the softmax statistics' barriers).
// Workgroup-uniform control flow.
fn write_head(lo: vec4<f32>, hi: vec4<f32>, n_slices: u32, row_quads: u32, part: u32, l: f32, z: u32, hh: u32, idx: u32,
              after: bool) {
    if after {
        workgroupBarrier();
    }
    for (var c = 0u; c < 4u; c++) {
        acc_s[8u * idx + c] = lo[c];
        acc_s[8u * idx + 4u + c] = hi[c];
    }
    workgroupBarrier();
    if idx < p.head_dim {
        let qi = idx / 8u;
        let r = idx % 8u;
        var total = 0.0;
        for (var sl = 0u; sl < n_slices; sl++) {
            total += acc_s[8u * (sl * row_quads + qi) + r];
        }
        if DIRECT {
            part_acc[z * OUT_STRIDE + hh * p.head_dim + idx] = total / l;
        } else {
            part_acc[part * p.head_dim + idx] = total;
        }
    }
}

@compute @workgroup_size(WG)
fn attention_partial(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let c = wg.y;
    let z = wg.z;
    let n_chunks = nwg.y;
    let int8 = KV_INT8;
    let start = c * WG;
    // Token z's position (a prompt batch's tokens follow the first), or row
    // z's, and the offset of its KV region (vec4 words).
    var pos = step[0] + z;
    var kv_off = 0u;
    if ROWS {
        pos = step[2u * z];
        kv_off = step[2u * z + 1u];
        if (pos < WG) != DIRECT {
            return; // the other launch serves this row (whole workgroup: uniform)
        }
    }
    // Heads served: np from h (see the header).
    let np = select(1u, 2u, PACKED && p.pack == 2u && pos >= p.pack_from);
    if h % np != 0u {
        return; // workgroup h - 1 serves this head (uniform)
    }
    // The partial results' slot of head h + g.
    let part = (z * p.n_heads + h) * n_chunks + c;
    let part1 = part + n_chunks;
    let end = min(min(pos + 1u, p.capacity), start + WG);
    if start >= end {
        // An empty chunk (past the context): contributes nothing.
        if lane.idx < np {
            part_ml[part + lane.idx * n_chunks] = vec2<f32>(-3.0e38, 0.0);
        }
        return; // whole workgroup: uniform
    }
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let kv_base = 4u * kv_off + kvh * p.capacity * row_words(int8);
    let qw = p.head_dim / 4u;

    // KV_INT8: this invocation's position's K and V steps, loaded before
    // anything else so that the scores do not wait for them (the fused
    // step's new position takes the maxima it has just computed).
    let own = start + lane.idx;
    var steps = vec2<f32>(0.0);
    if int8 && own < end {
        let w = kv_scale_word(kv_off, kvh, own);
        steps = vec2<f32>(k_step(w), v_step(w));
    }

    // KV_INT8: the heads' q steps / 254 (a score's unit in key_dots_int8).
    var q_unit = vec2<f32>(0.0);
    if FUSED {
        // One token (z = 0), or row z of a batch.
        if int8 {
            let fresh = fused_qk_int8(h, np, kvh, pos, pos >= start && pos < end, lane, z * p.qkv_stride, kv_off);
            if own == pos {
                steps = fresh.xy * (1.0 / 127.0);
            }
            q_unit = fresh.zw * (1.0 / (127.0 * 254.0));
        } else {
            fused_qk(h, np, kvh, pos, pos >= start && pos < end, lane, z * p.qkv_stride, kv_off);
        }
    } else {
        for (var i = lane.idx; i < np * qw; i += WG) {
            let o = (z * p.n_heads + h) * p.head_dim + 4u * i;
            q_s[i] = vec4<f32>(q[o], q[o + 1u], q[o + 2u], q[o + 3u]);
        }
        workgroupBarrier();
        if int8 {
            q_unit = quantise_q(np, lane) * (1.0 / (127.0 * 254.0));
        }
    }

    // The scores, K rows read coalesced: invocation (row_in, r) of L =
    // ATTENTION_KEY_LANES lanes per row takes quads r, r + L, ... of rows
    // start + row_in, + rows_per_pass, ... (eight rows: sixteen independent
    // 16-byte loads in flight at head_dim 128, so the chunk takes one round
    // trip; 8 * rows_per_pass = WG, src/kernels/attention.rs), each row's
    // dots with every head served; then head_score adds each position's.
    // One lane per row striding its own 256 bytes (the old order) made
    // every load of a subgroup touch 32 cache lines.
    let quads = row_words(int8) / 4u;
    let n = end - start;
    let rows_per_pass = WG / ATTENTION_KEY_LANES;
    let r = lane.idx % ATTENTION_KEY_LANES;
    let row_in = lane.idx / ATTENTION_KEY_LANES;
    let ja = min(r, quads - 1u);
    let jb = min(r + ATTENTION_KEY_LANES, quads - 1u);
    let kv_row0 = kv_base / 4u + start * quads;
    let tv = vec4<u32>(row_in, row_in + rows_per_pass, row_in + 2u * rows_per_pass, row_in + 3u * rows_per_pass);
    let tu = tv + vec4<u32>(4u * rows_per_pass);
    let ta = min(tv, vec4<u32>(n - 1u)) * quads + vec4<u32>(kv_row0);
    let tb = min(tu, vec4<u32>(n - 1u)) * quads + vec4<u32>(kv_row0);
    let ka = key_quads(ta, ja, jb, quads);
    let kb = key_quads(tb, ja, jb, quads);
    var da: vec4<f32>;
    var db: vec4<f32>;
    var da1 = vec4<f32>(0.0);
    var db1 = vec4<f32>(0.0);
    if int8 {
        // (Quad jb's words only where rows have one: head_dim 256.)
        let two = quads > ATTENTION_KEY_LANES;
        let qa = q_words(0u, ja);
        var qb = qa;
        if two {
            qb = q_words(0u, jb);
        }
        da = key_dots_int8(ka, r, quads, qa, qb);
        db = key_dots_int8(kb, r, quads, qa, qb);
        if np == 2u {
            let qa1 = q_words(qw, ja);
            var qb1 = qa1;
            if two {
                qb1 = q_words(qw, jb);
            }
            da1 = key_dots_int8(ka, r, quads, qa1, qb1);
            db1 = key_dots_int8(kb, r, quads, qa1, qb1);
        }
    } else {
        da = key_dots(ka, ta, r, ja, jb, quads, 0u);
        db = key_dots(kb, tb, r, ja, jb, quads, 0u);
        if np == 2u {
            da1 = key_dots(ka, ta, r, ja, jb, quads, qw);
            db1 = key_dots(kb, tb, r, ja, jb, quads, qw);
        }
    }
    // KV_INT8: a score's unit, its K step times its head's q unit.
    let unit = steps.x * q_unit;
    var s = vec2<f32>(head_score(da, db, tv, tu, n, r, lane.idx, unit.x, np == 2u), -3.0e38);
    if np == 2u {
        s.y = head_score(da1, db1, tv, tu, n, r, lane.idx, unit.y, false);
    }
    let t = start + lane.idx;
    let ml = wg_softmax_stats2(s, lane);
    let m = ml.xy;
    let l = ml.zw;
    var e = vec2<f32>(0.0);
    if t < end {
        e = exp(s - m);
    }
    // KV_INT8: l (the softmax's sum) is e's; the V sums weigh the int8 row
    // by e times its V step (at most the chunk's largest V step, v_max: e
    // <= 1), in parts relative to v_max.
    var v_max = 0.0;
    if int8 {
        v_max = wg_max(steps.y, lane);
        let live = v_max >= 1e-30;
        let wp = parts4(vec4<f32>(e * steps.y, 0.0, 0.0), select(0.0, 127.0 / v_max, live),
                        select(0.0, v_max / 127.0, live));
        w_s[lane.idx] = (wp.h & 0xffffu) | (wp.l << 16u);
    } else {
        e_s[lane.idx] = e;
    }
    workgroupBarrier(); // publishes e_s or w_s

    // Invocation (slice, i) sums dims 8i..8i+7 (one 16-byte load per
    // position) over positions start + slice, start + slice + n_slices, ...,
    // for every head served; then the slices are added.
    let row_quads = p.head_dim / 8u;
    let n_slices = WG / row_quads;
    let slice = lane.idx / row_quads;
    let i = lane.idx % row_quads;
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    var lo1 = vec4<f32>(0.0);
    var hi1 = vec4<f32>(0.0);
    if slice < n_slices && int8 {
        // Integer sums of the int8 rows weighed by w_s's parts: per group of
        // four positions, the rows' words for dims 8i..8i+3 (`lo`) and
        // 8i+4..8i+7 (`hi`: words 2i, 2i+1 of the row, half of a vec4) and
        // the four weights are byte-transposed, so that each dot4I8Packed
        // adds one dim over the four positions; h and l add up as 254 h + l
        // at once (one accumulator a dim and head: the V phase's registers
        // bound the kernel's occupancy with the prologue's). Exact in i32: a
        // slice sums at most WG / n_slices = head_dim / 8 <= 32 positions,
        // each |254 h v + l v| <= 127 * 32,385.
        let vb = kv_base / 4u + i / 2u;
        let odd = (i & 1u) == 1u;
        let row_vec4s = row_words(int8) / 4u;
        let ns = n_slices;
        let last = end - 1u;
        var lo_i = vec4<i32>(0);
        var hi_i = vec4<i32>(0);
        var lo_i1 = vec4<i32>(0);
        var hi_i1 = vec4<i32>(0);
        for (var tt = start + slice; tt < end; tt += 8u * ns) {
            let ps = v_positions(tt, ns, last);
            let v = v_rows(vb, ps.ta, ps.tb, row_vec4s);
            // Positions past the end weigh 0.
            let wa = transpose_bytes(select(vec4<u32>(0u), vec4<u32>(w_s[ps.ta.x - start], w_s[ps.ta.y - start],
                                                                     w_s[ps.ta.z - start], w_s[ps.ta.w - start]), ps.t < vec4<u32>(end)));
            let wb = transpose_bytes(select(vec4<u32>(0u), vec4<u32>(w_s[ps.tb.x - start], w_s[ps.tb.y - start],
                                                                     w_s[ps.tb.z - start], w_s[ps.tb.w - start]), ps.u < vec4<u32>(end)));
            let la = transpose_bytes(select(vec4<u32>(v.v0.x, v.v1.x, v.v2.x, v.v3.x), vec4<u32>(v.v0.z, v.v1.z, v.v2.z, v.v3.z), odd));
            let ha = transpose_bytes(select(vec4<u32>(v.v0.y, v.v1.y, v.v2.y, v.v3.y), vec4<u32>(v.v0.w, v.v1.w, v.v2.w, v.v3.w), odd));
            let lb = transpose_bytes(select(vec4<u32>(v.v4.x, v.v5.x, v.v6.x, v.v7.x), vec4<u32>(v.v4.z, v.v5.z, v.v6.z, v.v7.z), odd));
            let hb = transpose_bytes(select(vec4<u32>(v.v4.y, v.v5.y, v.v6.y, v.v7.y), vec4<u32>(v.v4.w, v.v5.w, v.v6.w, v.v7.w), odd));
            lo_i += idot_parts(la, lb, wa.x, wa.z, wb.x, wb.z);
            hi_i += idot_parts(ha, hb, wa.x, wa.z, wb.x, wb.z);
            if np == 2u {
                lo_i1 += idot_parts(la, lb, wa.y, wa.w, wb.y, wb.w);
                hi_i1 += idot_parts(ha, hb, wa.y, wa.w, wb.y, wb.w);
            }
        }
        // In units of v_max / (127 * 254).
        let unit = v_max * (1.0 / (127.0 * 254.0));
        lo = vec4<f32>(lo_i) * unit;
        hi = vec4<f32>(hi_i) * unit;
        lo1 = vec4<f32>(lo_i1) * unit;
        hi1 = vec4<f32>(hi_i1) * unit;
    }
    if slice < n_slices && !int8 {
        // Eight positions per iteration, eight independent loads in flight;
        // the last iteration's positions past the end load the last row
        // and weigh 0 (no one-at-a-time tail: each would be a round trip).
        let vb = kv_base / 4u + i;
        let row_vec4s = row_words(false) / 4u;
        let ns = n_slices;
        let last = end - 1u;
        for (var tt = start + slice; tt < end; tt += 8u * ns) {
            let ps = v_positions(tt, ns, last);
            let v = v_rows(vb, ps.ta, ps.tb, row_vec4s);
            let e0 = e_s[ps.ta.x - start];
            let e1 = e_s[ps.ta.y - start];
            let e2 = e_s[ps.ta.z - start];
            let e3 = e_s[ps.ta.w - start];
            let e4 = e_s[ps.tb.x - start];
            let e5 = e_s[ps.tb.y - start];
            let e6 = e_s[ps.tb.z - start];
            let e7 = e_s[ps.tb.w - start];
            let ma = ps.t < vec4<u32>(end);
            let mb = ps.u < vec4<u32>(end);
            let ea = select(vec4<f32>(0.0), vec4<f32>(e0.x, e1.x, e2.x, e3.x), ma);
            let eb = select(vec4<f32>(0.0), vec4<f32>(e4.x, e5.x, e6.x, e7.x), mb);
            lo += v_sum(ea, eb, v, false);
            hi += v_sum(ea, eb, v, true);
            if np == 2u {
                let ea1 = select(vec4<f32>(0.0), vec4<f32>(e0.y, e1.y, e2.y, e3.y), ma);
                let eb1 = select(vec4<f32>(0.0), vec4<f32>(e4.y, e5.y, e6.y, e7.y), mb);
                lo1 += v_sum(ea1, eb1, v, false);
                hi1 += v_sum(ea1, eb1, v, true);
            }
        }
    }
    write_head(lo, hi, n_slices, row_quads, part, l.x, z, h, lane.idx, false);
    if np == 2u {
        write_head(lo1, hi1, n_slices, row_quads, part1, l.y, z, h + 1u, lane.idx, true);
    }
    if lane.idx < np && !DIRECT {
        part_ml[part + lane.idx * n_chunks] = vec2<f32>(m[lane.idx], l[lane.idx]);
    }
}
