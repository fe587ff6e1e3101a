// x = dequantised row `tokens[step.pos]` of an int8 table (and its f16
// copy x16), if that row lies
// in this launch's chunk [row_start, row_end) (large tables are bound in
// chunks; exactly one chunk writes). An out-of-range id writes nothing.
// Batched (prefill): workgroup z embeds tokens[step.pos + z] into
// x[z * k_words ..].
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust, then int8_math.wgsl (pack_f16).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: Step;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read> w: array<u32>;
@group(0) @binding(4) var<storage, read> scales: array<f32>;
@group(0) @binding(5) var<storage, read_write> x: array<vec4<f32>>;
// The residual's f16 copy (int8_common.wgsl's X16), two values per word.
@group(0) @binding(6) var<storage, read_write> x16: array<vec2<u32>>;

override GROUP_WORDS: u32;

@compute @workgroup_size(WG)
fn embed_lookup(@builtin(global_invocation_id) gid: vec3<u32>) {
    let z = gid.z;
    let t = tokens[min(step.pos + z, arrayLength(&tokens) - 1u)];
    let j = gid.x;
    if t < p.row_start || t >= p.row_end || j >= p.k_words {
        return;
    }
    let r = t - p.row_start;
    let v = vec4<f32>(unpack4xI8(w[r * p.k_words + j])) * scales[r * p.groups + j / GROUP_WORDS];
    x[z * p.k_words + j] = v;
    x16[z * p.k_words + j] = vec2<u32>(pack_f16(v.x, v.y), pack_f16(v.z, v.w));
}
