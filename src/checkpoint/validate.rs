//! The checkpoint against its config.json: the tensors a config implies,
//! with their shapes, and [`Checkpoint::validate`].

use super::tensor::is_readable_dtype;
use super::{Checkpoint, MAX_LISTED_MISSING};
use crate::config::{ModelConfig, ShapeProfile};
use crate::error::{Error, Mismatch, Result};

/// Every tensor the engine reads for `cfg`, with the shape config.json
/// implies, in checkpoint order. `lm_head.weight` is listed only when the
/// embeddings are untied.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    expected_tensor_iter(cfg).collect()
}

/// Name suffixes of one layer's tensors, in checkpoint order.
const LAYER_TENSORS: [&str; 11] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

const LAYER_PREFIX: &str = "model.layers.";

/// The shape `cfg` implies for one of [`LAYER_TENSORS`].
fn layer_tensor_shape(cfg: &ModelConfig, suffix: &str) -> Option<Vec<usize>> {
    let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    Some(match suffix {
        "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![h],
        "self_attn.q_proj.weight" => vec![cfg.q_dim(), h],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![cfg.kv_dim(), h],
        "self_attn.o_proj.weight" => vec![h, cfg.q_dim()],
        "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![hd],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![inter, h],
        "mlp.down_proj.weight" => vec![h, inter],
        _ => return None,
    })
}

/// [`expected_tensors`], one at a time: a config claiming millions of
/// layers costs nothing until its names are walked.
fn expected_tensor_iter(cfg: &ModelConfig) -> impl Iterator<Item = (String, Vec<usize>)> + '_ {
    let embed = ("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, cfg.hidden_size]);
    let layers = (0..cfg.num_hidden_layers).flat_map(move |i| {
        LAYER_TENSORS.iter().map(move |suffix| {
            let shape = layer_tensor_shape(cfg, suffix).unwrap_or_default();
            (format!("{LAYER_PREFIX}{i}.{suffix}"), shape)
        })
    });
    let norm = ("model.norm.weight".to_string(), vec![cfg.hidden_size]);
    let head = (!cfg.tie_word_embeddings)
        .then(|| ("lm_head.weight".to_string(), vec![cfg.vocab_size, cfg.hidden_size]));
    std::iter::once(embed).chain(layers).chain(std::iter::once(norm)).chain(head)
}

/// How many tensors [`expected_tensors`] lists (saturating).
fn expected_tensor_count(cfg: &ModelConfig) -> usize {
    cfg.num_hidden_layers
        .saturating_mul(LAYER_TENSORS.len())
        .saturating_add(2 + usize::from(!cfg.tie_word_embeddings))
}

/// Whether the engine reads a tensor called `name` under `cfg` (the
/// inverse of [`expected_tensors`], without listing them).
fn is_expected_tensor(cfg: &ModelConfig, name: &str) -> bool {
    match name {
        "model.embed_tokens.weight" | "model.norm.weight" => true,
        "lm_head.weight" => !cfg.tie_word_embeddings,
        _ => name.strip_prefix(LAYER_PREFIX).and_then(|rest| rest.split_once('.')).is_some_and(
            |(index, suffix)| {
                // The canonical spelling only: `model.layers.01.` is not layer 1.
                let layer = index.parse::<usize>().ok().filter(|i| i.to_string() == index);
                layer.is_some_and(|i| i < cfg.num_hidden_layers) && LAYER_TENSORS.contains(&suffix)
            },
        ),
    }
}

fn shape_text(shape: &[usize]) -> String {
    format!("{shape:?}")
}

impl Checkpoint {
    /// Checks, before any conversion, that every tensor `cfg` implies exists
    /// (else [`Error::CheckpointInvalid`] listing the missing names), that
    /// the checkpoint holds no tensor the engine would ignore (q/k/v biases,
    /// a classifier head, ...: else [`Error::UnsupportedArchitecture`] with
    /// profile `qwen3` naming each, since ignoring a tensor computes
    /// another model), that every tensor read is stored as BF16, F16 or F32
    /// (else [`Error::UnsupportedDtype`]), and has the implied shape (else
    /// [`Error::UnsupportedArchitecture`] with profile `config.json` naming
    /// every wrong tensor with both shapes).
    ///
    /// A stored `lm_head.weight` is accepted and ignored when the
    /// embeddings are tied: transformers ties the head to the embedding
    /// table after loading, discarding the stored one, so the model that
    /// checkpoint defines is the one with the embedding as its head.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        #[cfg(test)]
        crate::check_counts::count(&crate::check_counts::VALIDATION);
        // Counted, not listed: config.json alone must not make this build
        // millions of names (`num_hidden_layers` may be huge).
        let present = self.locations.keys().filter(|n| is_expected_tensor(cfg, n)).count();
        let missing_count = expected_tensor_count(cfg).saturating_sub(present);
        if missing_count > 0 {
            // Every name walked is present or missing, so the walk stops
            // after at most `present + MAX_LISTED_MISSING` names.
            let listed: Vec<String> = expected_tensor_iter(cfg)
                .filter(|(n, _)| !self.locations.contains_key(n))
                .map(|(n, _)| n)
                .take(MAX_LISTED_MISSING)
                .collect();
            let mut listed = listed.join(", ");
            if missing_count > MAX_LISTED_MISSING {
                listed.push_str(&format!(" and {} more", missing_count - MAX_LISTED_MISSING));
            }
            return Err(Error::invalid(&self.dir, format!("{missing_count} missing tensor(s): {listed}")));
        }
        let mut unexpected: Vec<&String> = self
            .locations
            .keys()
            .filter(|n| !(is_expected_tensor(cfg, n) || (cfg.tie_word_embeddings && *n == "lm_head.weight")))
            .collect();
        if !unexpected.is_empty() {
            unexpected.sort();
            let mut mismatches: Vec<Mismatch> = unexpected
                .iter()
                .take(MAX_LISTED_MISSING)
                .filter_map(|n| self.tensor(n))
                .map(|t| Mismatch {
                    field: t.name.to_string(),
                    expected: "absent (the engine does not read this tensor)".into(),
                    found: format!("{:?} {}", t.dtype, shape_text(t.shape)),
                })
                .collect();
            if unexpected.len() > MAX_LISTED_MISSING {
                mismatches.push(Mismatch {
                    field: format!("{} more tensors", unexpected.len() - MAX_LISTED_MISSING),
                    expected: "absent".into(),
                    found: "present".into(),
                });
            }
            return Err(Error::UnsupportedArchitecture {
                profile: ShapeProfile::AnyQwen3.name().into(),
                mismatches,
            });
        }
        // All present, so this walks no more names than the files hold.
        let expected = expected_tensors(cfg);
        let mut wrong_shapes = Vec::new();
        for (name, shape) in &expected {
            let Some(t) = self.tensor(name) else { continue };
            if !is_readable_dtype(t.dtype) {
                return Err(Error::UnsupportedDtype {
                    tensor: name.clone(),
                    dtype: format!("{:?}", t.dtype),
                });
            }
            if t.shape != shape.as_slice() {
                wrong_shapes.push(Mismatch {
                    field: name.clone(),
                    expected: shape_text(shape),
                    found: shape_text(t.shape),
                });
            }
        }
        if !wrong_shapes.is_empty() {
            return Err(Error::UnsupportedArchitecture {
                profile: "config.json".into(),
                mismatches: wrong_shapes,
            });
        }
        Ok(())
    }
}
