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
use qwen3_wgpu::{CachePolicy, ModelConfig, ShapeProfile};
use safetensors::Dtype;
use sha2::{Digest, Sha256};

/// (case, sha256 of the converted blob, cache key), recorded from the
/// sequential converter (commit 0b00686).
#[rustfmt::skip]
const RECORDED: &[(&str, &str, &str)] = &[
    ("mlx/gqa2_hd64", "b311463771622d4a7138b6eb8109f4ffc47c59704d42db959aecbabfccb0fac9", "2803cb7c0f72ba3661fb85854376bf68fed912d7777ebb47a90fbb9f8b817a34"),
    ("mlx/gqa4_hd128", "5ebe956c2d366de3635f6743f6b36af7f6bc8c73a534e99daa86d7c788347e18", "171288c38fb254ff5b2512051a7fd91952009a601146adc985474d18c40ad7f5"),
    ("mlx/mqa_hd64", "88388cb781158301614548969d17ea345081f2bf5b8c54b04ddad51d8d7fcda7", "67480957fd701eaa5429b265ca35c33162e1bdbd8ef642bd74c4e2306a2d2c6d"),
    ("mlx/odd_dims", "50237fd948af0d2abd7c9afd5dcb711d89acd2274dd1d556553d52fc8aa16103", "f2cbe68b1709e434a5abe7e2b550d1175914e0db34268aeb4282e29bf7fc4771"),
    ("mlx/prompt_1tok", "d95e8c6faa9ac6fefa83d79d7aa180b477e61a2fa950673995842e465d4fdcbe", "f63182c6096e7ca726fcb9f3555101bbce2201a562a5e95ecab6f4eaaccf2e0a"),
    ("mlx/prompt_300tok", "8cc90b0cb852503e986d0b768d4623d5707a068cd3a60345a99b91d5fb473676", "0b3d3d25df3a783d2f0cc5cfe21eb6fc86590d9b7423681341caca8aed317241"),
    ("mlx/tied_with_stored_head", "f64f3341b34e75824065ec3ea46120e3d70f09b0d604bd09df31c2f6f2a8f199", "0e566febd419d7536a970621217d9346b8869ea4a41d875f6da09190ac6c9f0d"),
    ("mlx/untied_head", "21b67d3cd9ff63aa960f6f23fb7b411a934139a62eba66c69b79d2420c2af1a1", "90e9cd1bd084b39601119e70a4a18ad3f364325856c69835be91327ed6cecab7"),
    ("tiny/F16", "0889a0cc6dc985cdb5b5e6fb2e3cff756c9394498764f501d743848dd6901c02", "538aabd3f7352fe9f30944f23d9b2d4bf738f426b3af3bf697f24dbea42f7de5"),
    ("tiny/F32", "0889a0cc6dc985cdb5b5e6fb2e3cff756c9394498764f501d743848dd6901c02", "dd01c4932120f2d5438dfc13c28ac60760b2eaf7dd59c4f1f135cf0d217778b9"),
    ("random/straddling", "ab0cb4b68439ae879042c5b2946602389f09601365683d8bf8affdbefc9a0b49", "a40222eccc047bb9b15c429dc4d1d1d6d842665d8f5de3a98bf918997812d853"),
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
    let uncached = convert(&Checkpoint::open(dir).unwrap(), &cfg).unwrap();
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
