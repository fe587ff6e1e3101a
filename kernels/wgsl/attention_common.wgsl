// What the attention kernels share (attention_partial's variants and
// attention_prefill): the bindings up to the partial results, and
// the f16 unpacking of K/V rows. Prepended to each by Rust.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;

// KV_INT8: the caches hold int8 rows, four values a word, and a scale per
// row after them (kv_cache.wgsl's layout, `kv_scale_word`); head_dim a
// multiple of 16. (Declared before its first use: naga 30's override
// processing panics otherwise.)
override KV_INT8: bool = false;
// The decode Step's words: word 0 is the position (the batch's first token
// for a prompt batch). ROWS (attention_partial over a batch of sessions'
// steps): row z's position at word 2z, and at 2z + 1 the offset of its
// session's region in the K/V caches, in vec4<u32> words.
@group(0) @binding(1) var<storage, read> step: array<u32>;
// FUSED: the qkv projection's output (q heads, then k heads, then v heads);
// otherwise each token's normed, rotated q.
@group(0) @binding(2) var<storage, read> q: array<f32>;
// K and V rows are read 8 f16 values (4 words) at a time: head_dim is a
// multiple of 8.
@group(0) @binding(3) var<storage, read_write> k_cache: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<vec4<u32>>;
// [token][head][chunk]: (m, l)
@group(0) @binding(5) var<storage, read_write> part_ml: array<vec2<f32>>;
// [token][head][chunk][head_dim]; DIRECT: the attention output,
// [head][head_dim] (one binding for both keeps the kernel within 8 storage
// buffers, the default limit a host application's device may have).
@group(0) @binding(6) var<storage, read_write> part_acc: array<f32>;

// The first and last 4 of the 8 f16 values of a V row quad.
fn lo4(a: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y));
}
fn hi4(a: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w));
}

// KV_INT8: the quantisation step of the row whose scale is at word `w`
// (its largest magnitude / 127): a value is its int8 `i8x4` times this.
fn k_step(w: u32) -> f32 {
    return bitcast<f32>(k_cache[w / 4u][w % 4u]) * (1.0 / 127.0);
}

fn v_step(w: u32) -> f32 {
    return bitcast<f32>(v_cache[w / 4u][w % 4u]) * (1.0 / 127.0);
}

// The four int8 values of `w` (low byte first) as floats, without
// int-to-float conversions (a quarter of the FP32 rate on NVIDIA, and the
// bound of an int8 cache's attention with unpack4x8snorm): each byte, made
// unsigned by flipping its sign bit, is the low mantissa of 2^23 + b.
fn i8x4(w: u32) -> vec4<f32> {
    let u = w ^ 0x80808080u;
    let b = vec4<u32>(u & 0xffu, (u >> 8u) & 0xffu, (u >> 16u) & 0xffu, u >> 24u);
    return bitcast<vec4<f32>>(b | vec4<u32>(0x4b000000u)) - vec4<f32>(8388736.0);
}

// Dims 0..3 and 4..7 of the 8 dims of a K or V row held by `a` (f16: the
// whole vec4, values; int8: its first or, `odd`, second half, as integers
// to be scaled by the row's `k_step` / `v_step`).
fn v_lo(a: vec4<u32>, odd: bool, int8: bool) -> vec4<f32> {
    if int8 {
        return i8x4(select(a.x, a.z, odd));
    }
    return lo4(a);
}

fn v_hi(a: vec4<u32>, odd: bool, int8: bool) -> vec4<f32> {
    if int8 {
        return i8x4(select(a.y, a.w, odd));
    }
    return hi4(a);
}
