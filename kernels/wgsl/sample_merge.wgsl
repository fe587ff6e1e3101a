// Shared by the one-workgroup launches that merge sample_topk's per-chunk
// candidates (sample_topk_final, logprob_final): a radix select over the
// candidates, and the top entries gathered and sorted in workgroup memory.
// Each kernel declares `p` (with parts, k and region) and `scratch`.

var<workgroup> m_hist: array<atomic<u32>, 256>;
var<workgroup> m_sums: array<u32, 256>;
var<workgroup> m_chosen: vec3<u32>;
var<workgroup> m_total: u32;
// Each invocation's largest stage key, then the k-th largest of those.
var<workgroup> m_lane: array<u32, 256>;
var<workgroup> m_lower: u32;
// The entries gathered (sort keys and ids), sorted by merge_sort_top.
var<workgroup> top_key: array<u32, SAMPLE_TOP_K_MAX>;
var<workgroup> top_id: array<u32, SAMPLE_TOP_K_MAX>;
var<workgroup> top_count: atomic<u32>;

// Chunk c's record (see sample_topk).
fn chunk_record(c: u32) -> u32 {
    return p.region + c * (8u + 2u * p.k);
}

// Candidate `idx` (chunk idx / k, entry idx % k) as (sort key, id, 1), or
// (0, 0, 0) past its chunk's count.
fn candidate(idx: u32) -> vec3<u32> {
    let c = idx / p.k;
    let j = idx % p.k;
    let rec = chunk_record(c);
    if j >= scratch[rec] {
        return vec3<u32>(0u);
    }
    let key = sort_key(bitcast<f32>(scratch[rec + 8u + j]));
    return vec3<u32>(key, scratch[rec + 8u + p.k + j], 1u);
}

// The key a select stage ranks candidate `c` by, or none (.y == 0):
// stage 0 its sort key; stage 1 (the ties at `tie_key`) its inverted id,
// so the largest keys are the lowest ids.
fn stage_key(c: vec3<u32>, stage: u32, tie_key: u32) -> vec2<u32> {
    if c.z == 0u || (stage == 1u && c.x != tie_key) {
        return vec2<u32>(0u);
    }
    return vec2<u32>(select(c.x, ~c.y, stage == 1u), 1u);
}

// The k-th largest stage key of the candidates (1 <= k <= 256) by radix
// select, with the count of keys above it and equal to it: (theta, above,
// ties). Fewer than k keys in all: (0, all of them, 0). Only keys at or
// above the k-th largest of the invocations' own maxima (a lower bound of
// theta) are histogrammed, as in sample_topk. Uniform control flow.
fn merge_select(t: u32, k: u32, stage: u32, tie_key: u32) -> vec3<u32> {
    let total = p.parts * p.k;
    var mine = 0u;
    for (var idx = t; idx < total; idx += WG) {
        let s = stage_key(candidate(idx), stage, tie_key);
        if s.y != 0u {
            mine = max(mine, s.x);
        }
    }
    m_lane[t] = mine;
    workgroupBarrier();
    var rank = 0u;
    for (var j = 0u; j < 256u; j++) {
        let other = m_lane[j];
        rank += select(0u, 1u, other > mine || (other == mine && j < t));
    }
    if rank == k - 1u {
        m_lower = mine;
    }
    let lower = workgroupUniformLoad(&m_lower);
    var prefix = 0u;
    var above = 0u;
    var ties = 0u;
    for (var round = 0u; round < 4u; round++) {
        let shift = 24u - 8u * round;
        atomicStore(&m_hist[t], 0u);
        workgroupBarrier();
        for (var idx = t; idx < total; idx += WG) {
            let s = stage_key(candidate(idx), stage, tie_key);
            let in_bucket = round == 0u || (s.x >> (shift + 8u)) == (prefix >> (shift + 8u));
            if s.y != 0u && s.x >= lower && in_bucket {
                atomicAdd(&m_hist[(s.x >> shift) & 255u], 1u);
            }
        }
        workgroupBarrier();
        m_sums[t] = atomicLoad(&m_hist[t]);
        workgroupBarrier();
        for (var d = 1u; d < 256u; d = d * 2u) {
            var v = m_sums[t];
            if t + d < 256u {
                v += m_sums[t + d];
            }
            workgroupBarrier();
            m_sums[t] = v;
            workgroupBarrier();
        }
        if round == 0u {
            if t == 0u {
                m_total = m_sums[0];
            }
            let n_keys = workgroupUniformLoad(&m_total);
            if n_keys < k {
                // Fewer keys than k: all of them.
                return vec3<u32>(0u, n_keys, 0u);
            }
        }
        let incl = above + m_sums[t];
        var excl = above;
        if t < 255u {
            excl += m_sums[t + 1u];
        }
        if incl >= k && excl < k {
            m_chosen = vec3<u32>(prefix | (t << shift), excl, incl - excl);
        }
        let c = workgroupUniformLoad(&m_chosen);
        prefix = c.x;
        above = c.y;
        ties = c.z;
    }
    return vec3<u32>(prefix, above, ties);
}

// Gathers the candidates whose stage-0 key is above `theta` (all when
// `whole`), and the ties at `theta` whose inverted id is at least
// `id_theta` (when `take_ties`), into top_key/top_id. Uniform control flow.
fn merge_gather(t: u32, theta: u32, whole: bool, take_ties: bool, id_theta: u32) {
    if t == 0u {
        atomicStore(&top_count, 0u);
    }
    workgroupBarrier();
    for (var idx = t; idx < p.parts * p.k; idx += WG) {
        let c = candidate(idx);
        if c.z == 0u {
            continue;
        }
        if whole || c.x > theta || (take_ties && c.x == theta && ~c.y >= id_theta) {
            let slot = atomicAdd(&top_count, 1u);
            if slot < SAMPLE_TOP_K_MAX {
                top_key[slot] = c.x;
                top_id[slot] = c.y;
            }
        }
    }
    workgroupBarrier();
}

// Sorts the gathered entries by key, descending, ties by id, ascending
// (each entry's rank is the count of entries before it); returns their
// count (not uniform: read it through workgroup memory before a
// barrier depends on it). Uniform control flow.
fn merge_sort_top(t: u32) -> u32 {
    let count = min(atomicLoad(&top_count), SAMPLE_TOP_K_MAX);
    var key = 0u;
    var id = 0u;
    var rank = 0u;
    if t < count {
        key = top_key[t];
        id = top_id[t];
        for (var j = 0u; j < count; j++) {
            let kj = top_key[j];
            if kj > key || (kj == key && top_id[j] < id) {
                rank++;
            }
        }
    }
    workgroupBarrier();
    if t < count {
        top_key[rank] = key;
        top_id[rank] = id;
    }
    workgroupBarrier();
    return count;
}

// The few-candidates path of the merge. The vocabulary's k-th largest key
// is at least every chunk's own theta (the chunk holds k keys that large),
// and at least the ceil(k / r)-th largest of the chunks' r-th keys (that
// many chunks hold r keys that large each; r = ceil(k / parts), the lists
// are sorted): only the candidates at or above the larger bound matter,
// about k on real logits (the chunks' thetas alone leave hundreds). They
// are gathered in cand_key/cand_id and ranked there (key descending, id
// ascending).
var<workgroup> f_count: atomic<u32>;
var<workgroup> f_bound: atomic<u32>;
// The candidates gathered, and the k-th largest of them.
var<workgroup> f_total: u32;
var<workgroup> f_theta: u32;

// merge_select(t, k, 0u, 0u)'s (theta, above, ties) with a fourth word 1,
// the candidates at or above the bound sorted in cand_key/cand_id (ranks 0 ..
// above + ties include the whole tie group at theta); or .w == 0 when more
// than CANDIDATES reach the bound (the caller takes merge_select).
// Uniform control flow; the result is uniform.
fn merge_fast(t: u32, k: u32) -> vec4<u32> {
    if t == 0u {
        atomicStore(&f_count, 0u);
        atomicStore(&f_bound, 0u);
    }
    workgroupBarrier();
    for (var c = t; c < p.parts; c += WG) {
        // A chunk of at most k logits says theta 0: no bound.
        atomicMax(&f_bound, scratch[chunk_record(c) + 1u]);
    }
    let parts = p.parts;
    let r = max(1u, (k + parts - 1u) / parts);
    let need = (k + r - 1u) / r;
    var v = 0u;
    if t < parts {
        let rec = chunk_record(t);
        if scratch[rec] >= r {
            v = sort_key(bitcast<f32>(scratch[rec + 8u + r - 1u]));
        }
    }
    m_lane[t] = v;
    workgroupBarrier();
    // (More chunks than invocations: the thetas' bound alone.)
    if t < parts && parts <= WG {
        var rank = 0u;
        for (var c = 0u; c < parts; c++) {
            let other = m_lane[c];
            rank += select(0u, 1u, other > v || (other == v && c < t));
        }
        if rank == need - 1u {
            atomicMax(&f_bound, v);
        }
    }
    workgroupBarrier();
    let bound = atomicLoad(&f_bound);
    for (var idx = t; idx < p.parts * p.k; idx += WG) {
        let c = candidate(idx);
        if c.z != 0u && c.x >= bound {
            let slot = atomicAdd(&f_count, 1u);
            if slot < CANDIDATES {
                cand_key[slot] = c.x;
                cand_id[slot] = c.y;
            }
        }
    }
    workgroupBarrier();
    if t == 0u {
        f_total = atomicLoad(&f_count);
    }
    let total = workgroupUniformLoad(&f_total);
    if total > CANDIDATES {
        return vec4<u32>(0u);
    }
    rank_sort(t, total);
    if total < k {
        // Fewer candidates than k (a vocabulary of at most k): all kept.
        return vec4<u32>(0u, total, 0u, 1u);
    }
    let theta = cand_key[k - 1u];
    if t == 0u {
        f_theta = theta;
    }
    find_tie_group(t, total, theta);
    let first = workgroupUniformLoad(&tie_first);
    let end = workgroupUniformLoad(&tie_end);
    return vec4<u32>(workgroupUniformLoad(&f_theta), first, end - first, 1u);
}
