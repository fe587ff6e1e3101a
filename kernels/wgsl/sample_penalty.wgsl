// Sampling penalties, in place on the logits, before any other sampler
// launch (one workgroup): over the window of the last p.window tokens of the
// context (tokens[pos + 1 - window ..= pos], the prompt included), each
// distinct token t once, with c its count in the window:
//   repetition (Hugging Face): l = l < 0 ? l * r : l / r
//   presence and frequency (OpenAI): l -= presence + frequency * c
// Params, Step, MAX_PENALTY_WINDOW: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> step: Step;
@group(0) @binding(3) var<storage, read_write> logits: array<f32>;

var<workgroup> recent: array<u32, MAX_PENALTY_WINDOW>;

@compute @workgroup_size(WG)
fn sample_penalty(lane: Lane) {
    let end = min(step.pos + 1u, p.n_tokens);
    let len = min(min(end, p.window), MAX_PENALTY_WINDOW);
    let start = end - len;
    for (var j = lane.idx; j < len; j += WG) {
        recent[j] = tokens[start + j];
    }
    workgroupBarrier();
    for (var j = lane.idx; j < len; j += WG) {
        let t = recent[j];
        if t >= p.n {
            continue;
        }
        // Only a token's first occurrence edits its logit: no two
        // invocations write the same entry.
        var first = true;
        for (var q = 0u; q < j; q++) {
            if recent[q] == t {
                first = false;
                break;
            }
        }
        if !first {
            continue;
        }
        var count = 1u;
        for (var q = j + 1u; q < len; q++) {
            count += select(0u, 1u, recent[q] == t);
        }
        var l = logits[t];
        if p.repetition_penalty != 1.0 {
            l = select(l / p.repetition_penalty, l * p.repetition_penalty, l < 0.0);
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            l = l - (p.presence_penalty + p.frequency_penalty * f32(count));
        }
        logits[t] = l;
    }
}
