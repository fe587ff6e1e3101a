// Shared by the sampler kernels (sample_penalty, sample_max, sample_select):
// the order-preserving key of a logit and the counter-based random draw.
// The sampler runs as WGSL on every backend (no MSL twins).

// The u32 whose unsigned order is the f32 order of `x` (for finite values
// and infinities; -0.0 sorts just below +0.0): positives get the sign bit
// set, negatives are inverted.
fn sort_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// The value of a sort key (the inverse of sort_key, bit for bit).
fn key_value(key: u32) -> f32 {
    return bitcast<f32>(select(~key, key & 0x7fffffffu, (key & 0x80000000u) != 0u));
}

// A top-k selection's candidates in workgroup memory (sample_topk's
// chunk, the merge's few), ranked in place by rank_sort; then the ranks
// [tie_first, tie_end) of the keys equal to a threshold (find_tie_group).
const CANDIDATES: u32 = 256u;
var<workgroup> cand_key: array<u32, CANDIDATES>;
var<workgroup> cand_id: array<u32, CANDIDATES>;
var<workgroup> tie_first: u32;
var<workgroup> tie_end: u32;

// Sorts cand_key/cand_id[0 .. n] (n <= CANDIDATES) by key descending, id
// ascending: each entry's rank is the count of entries before it. Uniform
// control flow.
fn rank_sort(t: u32, n: u32) {
    workgroupBarrier();
    var key = 0u;
    var id = 0u;
    var rank = 0u;
    if t < n {
        key = cand_key[t];
        id = cand_id[t];
        for (var j = 0u; j < n; j++) {
            let kj = cand_key[j];
            rank += select(0u, 1u, kj > key || (kj == key && cand_id[j] < id));
        }
    }
    workgroupBarrier();
    if t < n {
        cand_key[rank] = key;
        cand_id[rank] = id;
    }
    workgroupBarrier();
}

// After rank_sort of n candidates: writes the ranks of the first key equal
// to `theta` (a candidate's key) and one past the last to tie_first and
// tie_end (read them after a barrier).
fn find_tie_group(t: u32, n: u32, theta: u32) {
    if t < n && cand_key[t] == theta {
        if t == 0u || cand_key[t - 1u] != theta {
            tie_first = t;
        }
        if t + 1u == n || cand_key[t + 1u] != theta {
            tie_end = t + 1u;
        }
    }
}

// pcg4d (Jarzynski and Olano, "Hash Functions for GPU Rendering", 2020): a
// counter-based hash, so a draw depends on (seed, position, token id) only,
// never on how many steps ran before or were queued together.
fn pcg4d(input: vec4<u32>) -> vec4<u32> {
    var v = input * 1664525u + vec4<u32>(1013904223u);
    v.x += v.y * v.w;
    v.y += v.z * v.x;
    v.z += v.x * v.y;
    v.w += v.y * v.z;
    v = v ^ (v >> vec4<u32>(16u));
    v.x += v.y * v.w;
    v.y += v.z * v.x;
    v.z += v.x * v.y;
    v.w += v.y * v.z;
    return v;
}

// A uniform draw strictly inside (0, 1) for token `id` at position `pos`:
// the hash's top 23 bits k as (k + 0.5) / 2^23, exact in f32 (from 2^-24
// to 1 - 2^-24). 24 bits would not be: (2^24 - 0.5) / 2^24 rounds to 1.
fn uniform_draw(seed_lo: u32, seed_hi: u32, pos: u32, id: u32) -> f32 {
    let h = pcg4d(vec4<u32>(seed_lo, seed_hi, pos, id)).x;
    return (f32(h >> 9u) + 0.5) * (1.0 / 8388608.0);
}

// The Gumbel noise -ln(-ln u) of token `id`'s draw at `pos`, finite: -ln u
// is at least 2^-24 (its exact value at the largest draw), so a log that
// rounds to 0 next to 1 (WGSL allows an absolute error of 2^-21 there)
// gives the largest noise, about 16.64, rather than infinity.
fn gumbel_noise(seed_lo: u32, seed_hi: u32, pos: u32, id: u32) -> f32 {
    let u = uniform_draw(seed_lo, seed_hi, pos, id);
    return -log(max(-log(u), 5.9604645e-8));
}
