//! QWEN3_WGPU_ATTENTION_PACK_FROM picks the position from which decode
//! attention runs two query heads a workgroup (read when the engine
//! starts): an unknown value is a named error from the engine's build, and
//! packing from position 256, a session's logits at positions 270-273 and a
//! batch's tokens equal, bit for bit, those of an engine that never packs,
//! over either KV cache format (each head's sums are the same operations in
//! the same order; tests/it/kernels.rs compares the pipelines kernel by
//! kernel). One test: the variable is the process's.

use std::path::Path;

use qwen3_wgpu::internals::kernels::attention::ATTENTION_PACK_FROM_ENV;
use qwen3_wgpu::{AdapterPolicy, BatchOptions, CachePolicy, Engine, KvFormat, LoadOptions, SessionOptions};

/// Logits (as bits) of a session's steps at positions 270-273 and a batch's
/// tokens, over each KV format, on an engine started with `pack_from`.
fn logits_and_tokens(pack_from: &str) -> Vec<Vec<u32>> {
    std::env::set_var(ATTENTION_PACK_FROM_ENV, pack_from);
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().expect("engine");
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
        let packs = pack_from != "never";
        assert_eq!(engine.debug_packs_attention(kv), packs, "{kv}: packing in use");
    }
    out
}

#[test]
fn packing_from_any_position_gives_the_unpacked_logits_and_an_unknown_value_is_a_named_error() {
    if !crate::support::alone_in_child(
        module_path!(),
        "packing_from_any_position_gives_the_unpacked_logits_and_an_unknown_value_is_a_named_error",
    ) {
        return;
    }
    let want = logits_and_tokens("never");
    assert!(logits_and_tokens("256") == want, "packing from 256 changed the logits or tokens");
    std::env::set_var(ATTENTION_PACK_FROM_ENV, "300");
    let e = Engine::builder().policy(AdapterPolicy::Portable).build().err().expect("an unknown value fails");
    assert_eq!(e.code(), "invalid_argument");
    let msg = e.to_string();
    assert!(msg.contains(ATTENTION_PACK_FROM_ENV) && msg.contains("never"), "{msg}");
    std::env::remove_var(ATTENTION_PACK_FROM_ENV);
}
