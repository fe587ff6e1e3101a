//! Conversion of a validated checkpoint to the engine's layout: every
//! linear weight becomes symmetric int8 or int4 (the layers', as the
//! [`WeightFormat`] says; the embedding and an untied LM head always int8)
//! with one scale (f32; bf16 in int4) per
//! [`QUANT_GROUP`](crate::converted::QUANT_GROUP) input elements; norm
//! weights stay f32. Everything lands in one blob
//! whose arrays start at multiples of [`BLOB_ALIGN`].

mod layout;
mod memory;
mod pieces;
mod quantize;
#[cfg(test)]
mod tests;

use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, Fingerprint, TensorSource, HASH_PIECE};
use crate::config::ModelConfig;
use crate::converted::{Blob, ByteRange, ConvertedModel, QuantMatrix, WeightFormat, WeightIndex, BLOB_ALIGN};
use crate::error::{Error, Result};
use crate::progress::Progress;
pub use layout::{blob_bytes, dequantize, plan_layout, planned_blob_len};
pub use memory::{available_memory, check_host_memory};
use pieces::convert_targets;
pub use quantize::{quantize_nibble, quantize_value};

/// Converts a checkpoint, its layers to `weights` (see the module docs),
/// into one owned blob.
///
/// The checkpoint is validated against `cfg` first (see
/// [`Checkpoint::validate`]), so no conversion work is done for a checkpoint
/// that would fail. The work is spread over all cores (rayon's pool), in
/// pieces of a few MiB; the bytes are the same whatever the thread count.
/// Host memory: the blob (about the converted size of the model; checked
/// against [`available_memory`] before it is allocated) plus a few MiB of
/// read buffers; tensors are read a window of rows at a time with
/// positioned reads (a checkpoint truncated meanwhile is an error, not a
/// crash).
///
/// Errors: those of [`Checkpoint::validate`]; [`Error::OutOfMemory`] when
/// the blob does not fit in the memory available (or its size overflows);
/// [`Error::CheckpointInvalid`] naming the tensor when any tensor (matrix
/// or norm vector) holds NaN or infinity, or naming the file when a weights
/// file ends before its header says.
pub fn convert(ckpt: &Checkpoint, cfg: &ModelConfig, weights: WeightFormat) -> Result<ConvertedModel> {
    ckpt.validate(cfg)?;
    convert_validated(ckpt, cfg, weights, None, &Progress::none())
}

/// [`convert`] of a checkpoint already validated against `cfg`, checking
/// every tensor's bytes against the digests of
/// `fingerprint` as it reads them: a tensor changed since the fingerprint
/// was taken is [`Error::CheckpointInvalid`], so a conversion is never
/// cached under the key of other bytes. Reports [`LoadPhase::Converting`](crate::LoadPhase::Converting)
/// through `progress`; [`Error::Cancelled`] when it cancels.
pub(crate) fn convert_validated(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    weights: WeightFormat,
    fingerprint: Option<&Fingerprint>,
    progress: &Progress<'_>,
) -> Result<ConvertedModel> {
    let what =
        format!("converting {} to {weights} (held in memory until it is cached)", ckpt.dir().display());
    let available = available_memory();
    let needed = planned_blob_len(cfg, weights).and_then(|n| n.checked_add(BLOB_ALIGN));
    let Some(needed) = needed else {
        return Err(Error::OutOfMemory { what, needed: u64::MAX, available: available.unwrap_or(0) });
    };
    check_host_memory(&what, needed as u64, available)?;
    // Zeroed up front: the row padding and all-zero groups are then already
    // right. A Vec<u8> is only byte-aligned; over-allocate and start the
    // blob at the first BLOB_ALIGN boundary so every array is aligned in
    // host memory too (f32 views need it). The Vec never grows, so its
    // buffer never moves. `try_reserve_exact` turns a refused allocation
    // into an error instead of an abort. The zeroing (and the page faults
    // of a fresh allocation) runs on all cores, into the reserved space.
    let mut storage = Vec::new();
    storage.try_reserve_exact(needed).map_err(|_| Error::OutOfMemory {
        what: what.clone(),
        needed: needed as u64,
        available: available.unwrap_or(0),
    })?;
    storage.par_extend(rayon::iter::repeat_n(0u8, needed));
    ckpt.prefetch();
    let (index, total) = plan_layout(cfg, weights);
    let blob_start = storage.as_ptr().align_offset(BLOB_ALIGN).min(BLOB_ALIGN);
    storage.truncate(blob_start + total);
    let blob = &mut storage[blob_start..];
    let targets = plan_targets(ckpt, &index)?;
    let digests = fingerprint.map(|f| &f.tensor_digests);
    convert_targets(blob, &targets, ckpt.dir(), digests, HASH_PIECE, progress)?;
    Ok(ConvertedModel { config: cfg.clone(), index, blob: Blob::Owned(storage), blob_start })
}

/// Where one or more checkpoint tensors land in the blob.
enum Target<'c> {
    /// A norm vector, stored as f32.
    Norm { dst: ByteRange, source: TensorSource<'c> },
    /// A quantised matrix: `parts` stacked row-wise in order, or, when
    /// `interleaved`, two parts with their rows alternating (a0, b0, a1,
    /// b1, ...: the gate/up layout the SwiGLU matvec epilogue reads).
    Matrix { m: QuantMatrix, parts: Vec<TensorSource<'c>>, interleaved: bool },
}

impl Target<'_> {
    fn sources(&self) -> &[TensorSource<'_>] {
        match self {
            Target::Norm { source, .. } => std::slice::from_ref(source),
            Target::Matrix { parts, .. } => parts,
        }
    }
}

/// Every target of `index`, in blob order (the order [`plan_layout`]
/// hands out ranges in).
fn plan_targets<'c>(ckpt: &'c Checkpoint, index: &WeightIndex) -> Result<Vec<Target<'c>>> {
    let norm = |dst: ByteRange, name: &str| Ok::<_, Error>(Target::Norm { dst, source: ckpt.source(name)? });
    let matrix = |m: &QuantMatrix, names: &[&str], interleaved: bool| {
        let parts = names.iter().map(|n| ckpt.source(n)).collect::<Result<Vec<_>>>()?;
        Ok::<_, Error>(Target::Matrix { m: *m, parts, interleaved })
    };
    let mut targets = vec![matrix(&index.embed, &["model.embed_tokens.weight"], false)?];
    for (i, layer) in index.layers.iter().enumerate() {
        let t = |suffix: &str| format!("model.layers.{i}.{suffix}");
        targets.push(norm(layer.input_norm, &t("input_layernorm.weight"))?);
        let qkv = [t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"), t("self_attn.v_proj.weight")];
        targets.push(matrix(&layer.qkv, &qkv.each_ref().map(String::as_str), false)?);
        targets.push(norm(layer.q_norm, &t("self_attn.q_norm.weight"))?);
        targets.push(norm(layer.k_norm, &t("self_attn.k_norm.weight"))?);
        targets.push(matrix(&layer.o_proj, &[t("self_attn.o_proj.weight").as_str()], false)?);
        targets.push(norm(layer.post_norm, &t("post_attention_layernorm.weight"))?);
        let gate_up = [t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")];
        targets.push(matrix(&layer.gate_up, &gate_up.each_ref().map(String::as_str), true)?);
        targets.push(matrix(&layer.down, &[t("mlp.down_proj.weight").as_str()], false)?);
    }
    targets.push(norm(index.final_norm, "model.norm.weight")?);
    if let Some(head) = &index.lm_head {
        targets.push(matrix(head, &["lm_head.weight"], false)?);
    }
    Ok(targets)
}
