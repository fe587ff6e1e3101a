//! The fingerprint of converted weights, which ties a saved session to the
//! weights its KV cache was computed from.

use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use xxhash_rust::xxh3::Xxh3Default;

use crate::converted::ConvertedModel;

/// The fingerprint of converted weights: xxh3-128 over the model's
/// configuration, its weight format and every byte of the blob (in 64 MiB pieces hashed
/// on all cores), as 32 hex digits. It identifies exactly what a session's
/// KV cache was computed from, however the weights were loaded (converted
/// or from the cache, from any copy of the checkpoint).
pub(crate) fn weights_fingerprint(model: &ConvertedModel) -> String {
    const PIECE: usize = 64 << 20;
    let blob = crate::convert::blob_bytes(model).unwrap_or(&[]);
    let pieces: Vec<&[u8]> = blob.chunks(PIECE).collect();
    let mut digests = vec![0u128; pieces.len()];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, pieces.len().max(1));
    let per_thread = pieces.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (out, input) in digests.chunks_mut(per_thread).zip(pieces.chunks(per_thread)) {
            s.spawn(move || {
                for (d, p) in out.iter_mut().zip(input) {
                    *d = xxhash_rust::xxh3::xxh3_128(p);
                }
            });
        }
    });
    let mut h = Xxh3Default::new();
    h.update(b"qwen3-wgpu converted weights");
    h.update(&serde_json::to_vec(&model.config).unwrap_or_default());
    h.update(model.index.weights.name().as_bytes());
    h.update(&(blob.len() as u64).to_le_bytes());
    for d in digests {
        h.update(&d.to_le_bytes());
    }
    format!("{:032x}", h.digest128())
}

/// The fingerprint of a model's converted weights, hashed on a thread of
/// its own so that a load does not wait for it (the first use does, if the
/// hash is not done by then). The thread holds the converted weights until
/// it is done, then drops them.
pub(crate) struct WeightsFingerprint {
    value: OnceLock<String>,
    hashing: Mutex<Option<JoinHandle<String>>>,
}

impl WeightsFingerprint {
    /// Starts hashing `model` ([`weights_fingerprint`]).
    pub(crate) fn start(model: ConvertedModel) -> Self {
        let model = Arc::new(model);
        let theirs = model.clone();
        let thread = std::thread::Builder::new()
            .name("qwen3-wgpu weights fingerprint".into())
            .spawn(move || weights_fingerprint(&theirs));
        match thread {
            Ok(handle) => WeightsFingerprint { value: OnceLock::new(), hashing: Mutex::new(Some(handle)) },
            // No thread to be had: hash here.
            Err(_) => WeightsFingerprint {
                value: OnceLock::from(weights_fingerprint(&model)),
                hashing: Mutex::new(None),
            },
        }
    }

    /// The fingerprint, waiting for the hash if it is still running.
    pub(crate) fn get(&self) -> &str {
        self.value.get_or_init(|| {
            let handle = self.hashing.lock().unwrap_or_else(|e| e.into_inner()).take();
            match handle.map(JoinHandle::join) {
                Some(Ok(value)) => value,
                // The hash failed (it cannot, short of a bug): a value no
                // file holds, so no session file is ever taken for this
                // model's.
                _ => {
                    use std::hash::{BuildHasher, Hasher};
                    let random = || std::collections::hash_map::RandomState::new().build_hasher().finish();
                    format!("{:016x}{:016x}", random(), random())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::weights_fingerprint;
    use crate::config::ModelConfig;
    use crate::convert::plan_layout;
    use crate::converted::{Blob, ConvertedModel, WeightFormat};

    fn model(cfg: ModelConfig, fill: impl Fn(usize) -> u8) -> ConvertedModel {
        let (index, len) = plan_layout(&cfg, WeightFormat::Int8);
        ConvertedModel { config: cfg, index, blob: Blob::Owned((0..len).map(fill).collect()), blob_start: 0 }
    }

    fn small() -> ModelConfig {
        ModelConfig {
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 32,
            vocab_size: 100,
            ..ModelConfig::qwen3_0_6b_base()
        }
    }

    /// The fingerprint changes with any byte of the weights (first, last,
    /// any other) and with the configuration, and with nothing else.
    #[test]
    fn the_fingerprint_covers_every_weight_byte_and_the_config() {
        let base = weights_fingerprint(&model(small(), |i| i as u8));
        assert_eq!(base.len(), 32);
        assert_eq!(base, weights_fingerprint(&model(small(), |i| i as u8)));
        let len = plan_layout(&small(), WeightFormat::Int8).1;
        for at in [0, len / 3, len - 1] {
            let changed = weights_fingerprint(&model(small(), |i| (i as u8) ^ u8::from(i == at)));
            assert_ne!(changed, base, "byte {at}");
        }
        let other = ModelConfig { rope_theta: 10_000.0, ..small() };
        assert_ne!(weights_fingerprint(&model(other, |i| i as u8)), base);
    }
}
