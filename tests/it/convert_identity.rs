//! The parallel conversion writes exactly the bytes the sequential one
//! did: the blob and the cache key of every MLX fixture, of a small model
//! stored as F16 and as F32, and of a random model whose tensors span
//! several hash pieces with rows straddling the pieces' boundaries, hash
//! to the values recorded from the sequential converter, on one worker
//! thread and on several.

use std::path::{Path, PathBuf};

use crate::tiny_checkpoint::*;
use qwen3_wgpu::internals::checkpoint::{Checkpoint, HASH_PIECE};
use qwen3_wgpu::internals::config::load_config;
use qwen3_wgpu::internals::convert::{blob_bytes, convert};
use qwen3_wgpu::internals::load::load_model;
use qwen3_wgpu::internals::testing::write_random_checkpoint;
use qwen3_wgpu::{CachePolicy, ModelConfig, ShapeProfile, WeightFormat};
use safetensors::Dtype;
use sha2::{Digest, Sha256};

/// (case, sha256 of the converted blob, cache key), recorded from the
/// sequential converter (commit 0b00686); the keys again at cache format 3
/// (the weight format in the key), the blobs unchanged.
#[rustfmt::skip]
const RECORDED: &[(&str, &str, &str)] = &[
    ("mlx/gqa2_hd64", "b311463771622d4a7138b6eb8109f4ffc47c59704d42db959aecbabfccb0fac9", "89fa35591baa3ecb45d2852d2f521e823f7f6812abcd407ffc22b7483f21d759"),
    ("mlx/gqa4_hd128", "5ebe956c2d366de3635f6743f6b36af7f6bc8c73a534e99daa86d7c788347e18", "1c112e1ed9c1c639a7cd31e5d91df464defc724dca6db026ce18ce43addc61c2"),
    ("mlx/mqa_hd64", "88388cb781158301614548969d17ea345081f2bf5b8c54b04ddad51d8d7fcda7", "82551ba738299d7397bd6be634221c208ad6862d216481efa13530f58bd05f25"),
    ("mlx/odd_dims", "50237fd948af0d2abd7c9afd5dcb711d89acd2274dd1d556553d52fc8aa16103", "cde2e7d308a04d72c118fa07826243c0d7c6b29247d80e15fa1de3ad2963738f"),
    ("mlx/prompt_1tok", "d95e8c6faa9ac6fefa83d79d7aa180b477e61a2fa950673995842e465d4fdcbe", "b914e4ff0777f560490c282cd91f36a898cc367d766b524f2ddeb14ea528c9f0"),
    ("mlx/prompt_300tok", "8cc90b0cb852503e986d0b768d4623d5707a068cd3a60345a99b91d5fb473676", "cef2cd5a5714291fe0ef6c9678bca7319a76a72af14e53de59e8433c0433837e"),
    ("mlx/tied_with_stored_head", "f64f3341b34e75824065ec3ea46120e3d70f09b0d604bd09df31c2f6f2a8f199", "b7041145fc2464476a172d1b286e26e18f8eec6682742da0d08f05bcee71bd76"),
    ("mlx/untied_head", "21b67d3cd9ff63aa960f6f23fb7b411a934139a62eba66c69b79d2420c2af1a1", "45710901c48c7af0c7820352241f2c77e90b2e2567ba79530eaece60b27a5f62"),
    ("tiny/F16", "0889a0cc6dc985cdb5b5e6fb2e3cff756c9394498764f501d743848dd6901c02", "52ac61d5047e1f31bff5497e967111c7e44120a3de28d5289066f55fb2ad89e5"),
    ("tiny/F32", "0889a0cc6dc985cdb5b5e6fb2e3cff756c9394498764f501d743848dd6901c02", "305ff375f2c4fadace7cba15e1b881bebeb35d033b608dd71cad4537232d9633"),
    ("random/straddling", "ab0cb4b68439ae879042c5b2946602389f09601365683d8bf8affdbefc9a0b49", "e7aac15973698bd11179ee0aaa71047096594e13ca806cc561f2918dc4d9b128"),
];

/// A model whose embedding and LM head (5000 x 1000 BF16, 10 MB) span two
/// hash pieces, with a row straddling the boundary (2000-byte rows do not
/// divide a piece), an MLP wider than a piece's rows, untied embeddings.
fn straddling_config() -> ModelConfig {
    ModelConfig {
        hidden_size: 1000,
        intermediate_size: 3000,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        vocab_size: 5000,
        tie_word_embeddings: false,
        ..ModelConfig::qwen3_0_6b_base()
    }
}

/// Every case as (name, checkpoint directory), written into `tmp`.
fn cases(tmp: &Path) -> Vec<(String, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx");
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        // The recorded hashes are int8 conversions of the int8-exact fixtures.
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with("int4_"))
        .map(|p| (format!("mlx/{}", p.file_name().unwrap().to_string_lossy()), p))
        .collect();
    out.sort();
    let cfg = tiny_config();
    let tensors = make_tensors(&cfg, 3);
    for dtype in [Dtype::F16, Dtype::F32] {
        let dir = tmp.join(format!("tiny_{dtype:?}"));
        write_checkpoint(&dir, &cfg, &tensors, dtype);
        out.push((format!("tiny/{dtype:?}"), dir));
    }
    let dir = tmp.join("straddling");
    std::fs::create_dir_all(&dir).unwrap();
    let straddling = straddling_config();
    assert!(straddling.vocab_size * straddling.hidden_size * 2 > HASH_PIECE);
    assert_ne!(HASH_PIECE % (straddling.hidden_size * 2), 0);
    write_random_checkpoint(&dir, &straddling, 11).unwrap();
    out.push(("random/straddling".to_string(), dir));
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// (sha256 of the blob, cache key) of loading `dir` into an empty cache
/// (the conversion checks every tensor against the key's digests), after
/// checking that a conversion without a cache gives the same blob.
fn digest(dir: &Path) -> (String, String) {
    let cache = tempfile::tempdir().unwrap();
    let policy = CachePolicy::Dir(cache.path().to_path_buf());
    let (model, report) = load_model(dir, ShapeProfile::AnyQwen3, &policy).unwrap();
    assert!(report.converted);
    let key = report.cache_path.unwrap().file_stem().unwrap().to_string_lossy().into_owned();
    let blob = blob_bytes(&model).unwrap();
    let cfg = load_config(dir).unwrap();
    let uncached = convert(&Checkpoint::open(dir).unwrap(), &cfg, WeightFormat::Int8).unwrap();
    assert!(
        blob_bytes(&uncached).unwrap() == blob,
        "{}: converting with and without a cache differ",
        dir.display()
    );
    (hex(&Sha256::digest(blob)), key)
}

#[test]
fn conversion_bytes_match_the_sequential_converter() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = cases(tmp.path());
    assert_eq!(cases.len(), RECORDED.len());
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        for ((name, dir), (recorded, blob, key)) in cases.iter().zip(RECORDED) {
            assert_eq!(name, recorded);
            let got = pool.install(|| digest(dir));
            assert_eq!(got, (blob.to_string(), key.to_string()), "{name} on {threads} thread(s)");
        }
    }
}
