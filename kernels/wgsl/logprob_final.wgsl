// The log-probabilities of a decode step (one workgroup, after the token
// is chosen; sample_topk ran with k = N and its statistics on, before any
// penalty): the N most likely tokens and the chosen one's, of the raw
// distribution log_softmax(logits) (before penalties and temperature).
// Writes record step.pos (the chosen token's position) of `records`:
//   [0] the chosen token, [1] its log-probability (f32 bits), [2] entries,
//   [3] 0, then (token, log-probability) per entry, most likely first,
//   ties by lowest id (the ties at the N-th place: the lowest ids).
// `src`: the logits before the penalties (their copy when a penalty ran).
// Params, Step, NONE, SAMPLE_TOP_K_MAX: generated from their Rust
// definitions (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> scratch: array<u32>;
@group(0) @binding(3) var<storage, read> tokens: array<u32>;
@group(0) @binding(4) var<storage, read> step: Step;
@group(0) @binding(5) var<storage, read_write> records: array<u32>;

var<workgroup> lse: f32;

@compute @workgroup_size(WG)
fn logprob_final(lane: Lane) {
    let t = lane.idx;
    let sel = merge_select(t, p.k, 0u, 0u);
    let theta = sel.x;
    let whole = theta == 0u && sel.z == 0u;
    // The lowest-id ties at theta that complete the N: the largest
    // inverted ids.
    var id_theta = 0u;
    if !whole {
        id_theta = merge_select(t, p.k - sel.y, 1u, theta).x;
    }
    merge_gather(t, theta, whole, true, id_theta);
    let count = merge_sort_top(t);
    if t == 0u {
        // log(sum exp(l)) from the chunks' maxima and sums.
        var m = -3.0e38;
        for (var c = 0u; c < p.parts; c++) {
            m = max(m, bitcast<f32>(scratch[chunk_record(c) + 4u]));
        }
        var s = 0.0;
        for (var c = 0u; c < p.parts; c++) {
            let rec = chunk_record(c);
            s += bitcast<f32>(scratch[rec + 5u]) * exp(bitcast<f32>(scratch[rec + 4u]) - m);
        }
        lse = m + log(s);
    }
    let norm = workgroupUniformLoad(&lse);
    let pos = step.pos;
    if pos >= p.n_tokens {
        return;
    }
    let rec = pos * p.record_words;
    if t < count {
        records[rec + 4u + 2u * t] = top_id[t];
        records[rec + 5u + 2u * t] = bitcast<u32>(key_value(top_key[t]) - norm);
    }
    if t == 0u {
        let chosen = tokens[pos];
        records[rec] = chosen;
        records[rec + 1u] = bitcast<u32>(select(-3.0e38, src[min(chosen, p.n - 1u)] - norm, chosen < p.n));
        records[rec + 2u] = count;
        records[rec + 3u] = 0u;
    }
}
