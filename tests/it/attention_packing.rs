//! Decode attention packing two query heads a workgroup
//! (`EngineBuilder::attention_pack_from`, `QWEN3_WGPU_ATTENTION_PACK_FROM`):
//! packing from position 256, a session's logits at positions 270-273 and a
//! batch's tokens equal, bit for bit, those of an engine that does not pack
//! there, over either KV cache format (each head's sums are the same
//! operations in the same order; tests/it/kernels.rs compares the pipelines
//! kernel by kernel).

use std::path::Path;

use qwen3_wgpu::{AdapterPolicy, BatchOptions, CachePolicy, Engine, KvFormat, LoadOptions, SessionOptions};

/// Logits (as bits) of a session's steps at positions 270-273 and a batch's
/// tokens, over each KV format, on `engine`; and whether it packed.
fn logits_and_tokens(engine: &Engine) -> (Vec<Vec<u32>>, [bool; 2]) {
    // 4 query heads over 2 KV heads: packs.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    let model =
        engine.load(dir, &LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }).unwrap();
    let prompt = |n: u32, salt: u32| -> Vec<u32> { (0..n).map(|i| (i * 37 + salt) % 1000).collect() };
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut out = Vec::new();
    for kv in [KvFormat::F16, KvFormat::Int8] {
        let mut s = model.session_with(&SessionOptions::default().capacity(300).kv_cache(kv)).unwrap();
        s.feed(&prompt(270, 11)).unwrap();
        for _ in 0..4 {
            out.push(bits(s.debug_logits().unwrap()));
            s.next_token().unwrap();
        }
        let options = BatchOptions::default().slots(2).capacity_per_slot(300).kv_cache(kv);
        let mut batch = model.batch(&options).unwrap();
        let (mut a, mut b) = (batch.session().unwrap(), batch.session().unwrap());
        // Row b crosses the packing start: its rows before and after.
        let mut tokens = vec![a.feed(&prompt(270, 5)).unwrap(), b.feed(&prompt(252, 3)).unwrap()];
        for _ in 0..6 {
            tokens.extend(batch.step(&mut [&mut a, &mut b]).unwrap());
        }
        assert!(b.len() > 256, "both rows reach the packing start");
        out.push(tokens);
    }
    (out, [KvFormat::F16, KvFormat::Int8].map(|kv| engine.debug_packs_attention(kv)))
}

#[test]
fn packing_from_any_position_gives_the_unpacked_logits() {
    // The shared engine packs from 8,192 on: not in these sessions.
    let (want, packed) = logits_and_tokens(crate::support::engine());
    assert_eq!(packed, [false, false]);
    let engine = Engine::builder().policy(AdapterPolicy::Portable).attention_pack_from(256).build().unwrap();
    let (got, packed) = logits_and_tokens(&engine);
    assert_eq!(packed, [true, true], "packing in use");
    assert!(got == want, "packing from 256 changed the logits or tokens");
}
