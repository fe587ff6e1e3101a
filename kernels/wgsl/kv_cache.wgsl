// An int8 KV cache's layout, shared by the kernel that writes it
// (qk_norm_rope) and those that read it (attention_partial,
// attention_prefill); prepended to each by Rust. The caches hold int8
// rows, four values a word ([kv_head][capacity][head_dim / 4]), then one
// f32 scale per row, the row's largest magnitude: a value is
// unpack4x8snorm(word) * scale. The scales start at a multiple of 4 words
// and each head's take a multiple of 4, so no vec4 of scales holds two
// heads' (attention_partial writes one as a whole vec4). The twins' copy:
// kernels/msl/kv_cache.metal; the host's: src/kv_cache.rs (KvLayout).

// The word of row (kv_head, pos)'s scale in the cache region at vec4 word
// `kv_off` (a batch slot's; 0 for a session's own cache).
fn kv_scale_word(kv_off: u32, kv_head: u32, pos: u32) -> u32 {
    let base = (p.n_kv_heads * p.capacity * (p.head_dim / 4u) + 3u) & ~3u;
    return 4u * kv_off + base + kv_head * ((p.capacity + 3u) & ~3u) + pos;
}
