// What the twins that read or write the KV cache share (qk_norm_rope and
// attention_partial; prepended to their files by Rust, after the generated
// declarations): an int8 cache's rounding and layout, kv_cache.wgsl's.

// pack4x8snorm: four values in [-1, 1] as an int8 word, floor(0.5 + 127 v),
// low byte first.
static inline uint snorm8x4(float4 v) {
    return as_type<uint>(char4(floor(0.5f + 127.0f * clamp(v, float4(-1.0f), float4(1.0f)))));
}

// KV_INT8: the word (of a cache as uints) of row (kv_head, pos)'s scale:
// the int8 rows ([kv_head][capacity][head_dim / 4] words) come first, then
// the scales from a multiple of 4 words, each head's taking a multiple of 4.
// (A template: the kernels' Params differ.)
template <typename P>
static inline uint kv_scale_word(constant P& p, uint kv_head, uint pos) {
    const uint base = (p.n_kv_heads * p.capacity * (p.head_dim / 4) + 3) & ~3u;
    return base + kv_head * ((p.capacity + 3) & ~3u) + pos;
}
