// The top-k candidates of each chunk of p.chunk logits (one workgroup
// each; p.k <= SAMPLE_TOP_K_MAX): the first launch of the sampler's top-k
// path (sample_topk_final merges them) and of the log-probabilities
// (logprob_final). Invocation t holds logits start + j WG + t (coalesced
// loads) as sort keys in registers.
//
// The chunk's k-th largest key theta is at least the k-th largest of the
// invocations' own maxima (k invocations hold a key that large): the keys at
// or above that bound are few (about k on real logits), so they are
// gathered in workgroup memory and ranked there (key descending, id
// ascending), and the first k ranks are written, sorted. Where more than
// CANDIDATES keys reach the bound (many ties), a radix select over the keys
// (8 bits per pass, four passes) finds theta instead, the count of keys
// above it and of keys equal to it, and the chunk writes every logit above
// theta and the lowest-id ties at theta up to k in all (a prefix sum over
// the invocations places them). Either way the list is written sorted
// (key descending, id ascending), and any element of the
// vocabulary's top-k that is not written is a tie at its chunk's theta,
// which the chunk's record says (theta, ties, ties written). A chunk of at
// most k logits writes them all (theta 0).
//
// Chunk c's record in scratch, at p.region + c * (8 + 2 k) words:
//   [0] candidates written, [1] theta (0: the whole chunk), [2] keys equal
//   to theta, [3] of those written, [4] the chunk's largest logit and [5]
//   the sum of exp(l - that) over the chunk (bit 0 of p.flags: the
//   log-probabilities' statistics), [8 ..] k values (f32 bits), then k ids.
// Bit 1 of p.flags copies the chunk's logits to `raw` (the
// log-probabilities read the logits from before the penalties).
// Params, SAMPLE_TOP_K_MAX: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> scratch: array<u32>;
@group(0) @binding(3) var<storage, read_write> raw: array<f32>;

// Logits per invocation at most (chunk <= 16 WG).
const MAX_PER_LANE: u32 = 16u;

var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> sums: array<u32, 256>;
// The digit chosen so far: (prefix, keys above its bucket, keys in it).
var<workgroup> chosen: vec3<u32>;
// Each invocation's largest key, then the k-th largest of those.
var<workgroup> lane_max: array<u32, 256>;
var<workgroup> lower_bound: u32;
// The same maxima, four to an entry.
var<workgroup> lane_max4: array<vec4<u32>, 64>;
// How many keys reach the bound (they go to cand_key/cand_id,
// sample_common.wgsl).
var<workgroup> cand_count: atomic<u32>;
var<workgroup> cand_total: u32;

@compute @workgroup_size(WG)
fn sample_topk(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let t = lane.idx;
    let start = wg.x * p.chunk;
    let end = min(p.n, start + p.chunk);
    let len = end - start;
    let out = p.region + wg.x * (8u + 2u * p.k);
    let k = p.k;
    let whole = len <= k;
    var keys: array<u32, MAX_PER_LANE>;
    var local_max = -3.0e38;
    var mine = 0u;
    for (var j = 0u; j < MAX_PER_LANE; j++) {
        let i = start + j * WG + t;
        var key = 0u;
        if i < end {
            let l = logits[i];
            key = sort_key(l);
            local_max = max(local_max, l);
            mine = max(mine, key);
            if (p.flags & 2u) != 0u {
                raw[i] = l;
            }
        }
        keys[j] = key;
    }
    if (p.flags & 1u) != 0u {
        let m = wg_max(local_max, lane);
        var s = 0.0;
        for (var j = 0u; j < MAX_PER_LANE; j++) {
            if start + j * WG + t < end {
                s += exp(key_value(keys[j]) - m);
            }
        }
        s = wg_sum4(vec4<f32>(s, 0.0, 0.0, 0.0), lane).x;
        if t == 0u {
            scratch[out + 4u] = bitcast<u32>(m);
            scratch[out + 5u] = bitcast<u32>(s);
        }
    }
    // The bound: the k-th largest of the invocations' maxima (by rank,
    // ties by invocation). With more than k logits at least k invocations
    // hold one (k <= WG), so an invocation without logits (0) never
    // reaches rank k; a whole chunk takes every logit (bound 0).
    // (Four maxima per workgroup-memory read: the ranking loop is the
    // launch's longest part. Whole-vector stores only.)
    lane_max[t] = mine;
    if t == 0u {
        atomicStore(&cand_count, 0u);
        lower_bound = 0u;
    }
    workgroupBarrier();
    if t < 64u {
        lane_max4[t] = vec4<u32>(lane_max[4u * t], lane_max[4u * t + 1u], lane_max[4u * t + 2u], lane_max[4u * t + 3u]);
    }
    workgroupBarrier();
    if !whole {
        var rank = 0u;
        for (var q = 0u; q < 64u; q++) {
            let o = lane_max4[q];
            let j = 4u * q;
            rank += select(0u, 1u, o.x > mine || (o.x == mine && j < t));
            rank += select(0u, 1u, o.y > mine || (o.y == mine && j + 1u < t));
            rank += select(0u, 1u, o.z > mine || (o.z == mine && j + 2u < t));
            rank += select(0u, 1u, o.w > mine || (o.w == mine && j + 3u < t));
        }
        if rank == k - 1u {
            lower_bound = mine;
        }
    }
    let lower = workgroupUniformLoad(&lower_bound);
    for (var j = 0u; j < MAX_PER_LANE; j++) {
        let i = start + j * WG + t;
        if i < end && keys[j] >= lower {
            let slot = atomicAdd(&cand_count, 1u);
            if slot < CANDIDATES {
                cand_key[slot] = keys[j];
                cand_id[slot] = i;
            }
        }
    }
    workgroupBarrier();
    if t == 0u {
        cand_total = atomicLoad(&cand_count);
    }
    let total = workgroupUniformLoad(&cand_total);
    if total > CANDIDATES {
        topk_radix(t, start, end, out);
        return;
    }
    rank_sort(t, total);
    let vals = out + 8u;
    let ids = vals + k;
    if t < min(k, total) {
        scratch[vals + t] = bitcast<u32>(key_value(cand_key[t]));
        scratch[ids + t] = cand_id[t];
    }
    if whole {
        if t == 0u {
            scratch[out] = len;
            scratch[out + 1u] = 0u;
            scratch[out + 2u] = 0u;
            scratch[out + 3u] = 0u;
        }
        return;
    }
    // At least k candidates: the bound is at most the k-th largest key.
    let theta = cand_key[k - 1u];
    find_tie_group(t, total, theta);
    workgroupBarrier();
    if t == 0u {
        scratch[out] = k;
        scratch[out + 1u] = theta;
        scratch[out + 2u] = tie_end - tie_first;
        scratch[out + 3u] = k - tie_first;
    }
}

// The many-ties path: theta by radix select over the chunk's keys (each
// invocation holding its ceil(chunk / WG) consecutive logits, so the
// invocation order is the id order), then the logits above theta and the
// lowest-id ties, placed by a prefix sum. Uniform control flow.
fn topk_radix(t: u32, start: u32, end: u32, out: u32) {
    let len = end - start;
    let per = (p.chunk + WG - 1u) / WG;
    let first = start + t * per;
    var own = 0u;
    if first < end {
        own = min(per, end - first);
    }
    var keys: array<u32, MAX_PER_LANE>;
    for (var j = 0u; j < own; j++) {
        keys[j] = sort_key(logits[first + j]);
    }
    let k = p.k;
    let whole = len <= k;
    var theta = 0u;
    var above = 0u;
    var ties = 0u;
    if !whole {
        // The k-th largest of the invocations' maxima (by rank, ties by
        // invocation): an invocation without logits counts 0, a bound
        // that excludes nothing.
        var mine = 0u;
        for (var j = 0u; j < own; j++) {
            mine = max(mine, keys[j]);
        }
        lane_max[t] = mine;
        workgroupBarrier();
        var rank = 0u;
        for (var j = 0u; j < 256u; j++) {
            let other = lane_max[j];
            rank += select(0u, 1u, other > mine || (other == mine && j < t));
        }
        if rank == k - 1u {
            lower_bound = mine;
        }
        let lower = workgroupUniformLoad(&lower_bound);
        var prefix = 0u;
        for (var round = 0u; round < 4u; round++) {
            let shift = 24u - 8u * round;
            atomicStore(&hist[t], 0u);
            workgroupBarrier();
            for (var j = 0u; j < own; j++) {
                let key = keys[j];
                let in_bucket = round == 0u || (key >> (shift + 8u)) == (prefix >> (shift + 8u));
                if key >= lower && in_bucket {
                    atomicAdd(&hist[(key >> shift) & 255u], 1u);
                }
            }
            workgroupBarrier();
            sums[t] = atomicLoad(&hist[t]);
            suffix_sums(t);
            // Keys from the top through bin t, and above it.
            let incl = above + sums[t];
            var excl = above;
            if t < 255u {
                excl += sums[t + 1u];
            }
            if incl >= k && excl < k {
                chosen = vec3<u32>(prefix | (t << shift), excl, incl - excl);
            }
            let c = workgroupUniformLoad(&chosen);
            prefix = c.x;
            above = c.y;
            ties = c.z;
        }
        theta = prefix;
    }
    // Places: keys above theta first, then the ties, each in id order.
    var n_above = 0u;
    var n_tie = 0u;
    for (var j = 0u; j < own; j++) {
        let key = keys[j];
        if whole || key > theta {
            n_above++;
        } else if key == theta {
            n_tie++;
        }
    }
    // At most 4,096 of each: both counts in one word.
    let mine = n_above | (n_tie << 16u);
    sums[t] = mine;
    prefix_sums(t);
    let before = sums[t] - mine;
    var a_slot = before & 0xffffu;
    var t_slot = before >> 16u;
    let need = k - above;
    // Gathered in workgroup memory (k <= CANDIDATES), then written sorted
    // as the few-candidates path writes them (the merge reads each list's
    // r-th entry).
    workgroupBarrier();
    for (var j = 0u; j < own; j++) {
        let key = keys[j];
        let id = first + j;
        if whole || key > theta {
            cand_key[a_slot] = key;
            cand_id[a_slot] = id;
            a_slot++;
        } else if key == theta {
            if t_slot < need {
                cand_key[above + t_slot] = key;
                cand_id[above + t_slot] = id;
            }
            t_slot++;
        }
    }
    let written = select(k, len, whole);
    rank_sort(t, written);
    if t < written {
        scratch[out + 8u + t] = bitcast<u32>(key_value(cand_key[t]));
        scratch[out + 8u + k + t] = cand_id[t];
    }
    if t == 0u {
        scratch[out] = select(k, len, whole);
        scratch[out + 1u] = theta;
        scratch[out + 2u] = select(ties, 0u, whole);
        scratch[out + 3u] = select(need, 0u, whole);
    }
}


// sums[t] = the sum of sums[t ..] (WG == 256 bins; uniform control flow).
fn suffix_sums(t: u32) {
    workgroupBarrier();
    for (var d = 1u; d < 256u; d = d * 2u) {
        var v = sums[t];
        if t + d < 256u {
            v += sums[t + d];
        }
        workgroupBarrier();
        sums[t] = v;
        workgroupBarrier();
    }
}

// sums[t] = the sum of sums[..= t] (uniform control flow).
fn prefix_sums(t: u32) {
    workgroupBarrier();
    for (var d = 1u; d < 256u; d = d * 2u) {
        var v = sums[t];
        if t >= d {
            v += sums[t - d];
        }
        workgroupBarrier();
        sums[t] = v;
        workgroupBarrier();
    }
}
