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
/// sequential converter (commit 0b00686); the keys again at cache formats
/// 3 (the weight format in the key) and 4 (int4 scales in bf16), the blobs
/// unchanged.
#[rustfmt::skip]
const RECORDED: &[(&str, &str, &str)] = &[
    ("mlx/gqa2_hd64", "b311463771622d4a7138b6eb8109f4ffc47c59704d42db959aecbabfccb0fac9", "1e1b8b375d642d15422a9eb051773b6a07f3a4758d3dad54cd5014352be51f4d"),
    ("mlx/gqa4_hd128", "5ebe956c2d366de3635f6743f6b36af7f6bc8c73a534e99daa86d7c788347e18", "49becccf407b65ffd1ed37af4ed8f1e5938fd8f323673313fa54a1a850f340a9"),
    ("mlx/mqa_hd64", "88388cb781158301614548969d17ea345081f2bf5b8c54b04ddad51d8d7fcda7", "277e97c62d7a57c3eb2f4a5cd6f72a062c37bc1b3047cbda45bc6a2570f035a2"),
    ("mlx/odd_dims", "50237fd948af0d2abd7c9afd5dcb711d89acd2274dd1d556553d52fc8aa16103", "77ab876688fbb01ac41f5d139da8d5e71fb74f5b8639188a45cf1e7ef4b7d0fd"),
    ("mlx/prompt_1tok", "d95e8c6faa9ac6fefa83d79d7aa180b477e61a2fa950673995842e465d4fdcbe", "7ca087123ee53a8e2c486d794fb8f641e533b1068a810eb6dfcac312f85eae56"),
    ("mlx/prompt_300tok", "8cc90b0cb852503e986d0b768d4623d5707a068cd3a60345a99b91d5fb473676", "c66106add73fc5e1215b1d82813519c5e82ae4638caaaedce42948b4e237ed45"),
    ("mlx/tied_with_stored_head", "f64f3341b34e75824065ec3ea46120e3d70f09b0d604bd09df31c2f6f2a8f199", "5fb9abf58c97444ad10914c7520919f47b358c802cbc408ca1a9f2c484815da3"),
    ("mlx/untied_head", "21b67d3cd9ff63aa960f6f23fb7b411a934139a62eba66c69b79d2420c2af1a1", "96ba4de178faec49d0b411e0027a9c32c213b44b590d5805e2acb2f8f81887e5"),
    ("tiny/F16", "0889a0cc6dc985cdb5b5e6fb2e3cff756c9394498764f501d743848dd6901c02", "6c3ac469198f391d5f3213eea898e06dbc2589c9d7eb8f9feb0de3443093affe"),
    ("tiny/F32", "0889a0cc6dc985cdb5b5e6fb2e3cff756c9394498764f501d743848dd6901c02", "54a8ab2ec8adb397e497a3cb886845e0ab7130113833129c7c2e6b3aa49c3e39"),
    ("random/straddling", "ab0cb4b68439ae879042c5b2946602389f09601365683d8bf8affdbefc9a0b49", "8ab49114c01c5481e795dc2b623bd7e219e4b98560f705ff3c97f7961959b0c4"),
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
