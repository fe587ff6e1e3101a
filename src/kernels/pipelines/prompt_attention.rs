//! Which program a prompt batch's attention runs: `attention_prefill`'s
//! tile program (on cooperative matrices, their emulation, or its MSL twin
//! on SIMD-group matrices) where the set has it and it takes the model and
//! KV cache, else `attention_prefill` itself.

use super::{Kernels, PipelineKey, Program};
use crate::converted::WeightFormat;
use crate::kernels::choice::KernelSource;
use crate::kernels::{Constants, Kernel, PREFILL_ATTENTION_TOKENS};
use crate::kv_cache::KvFormat;

impl Kernels {
    /// The key of `attention_prefill`'s tile program (over an f16 KV
    /// cache), where the set runs it.
    pub(super) fn attention_tiles_key(&self) -> Option<PipelineKey> {
        let program = match self.source {
            KernelSource::Msl => Program::AttentionPrefillTilesMsl,
            KernelSource::Wgsl => Program::AttentionPrefillTiles { emulated: self.coop_emulated },
        };
        self.attention_tiles.then_some(PipelineKey {
            kernel: Kernel::AttentionPartial,
            program,
            constants: Constants::Workgroup(Kernel::AttentionPartial.workgroup_size()),
            kv: KvFormat::F16,
        })
    }

    /// The prompt-batch pipeline of [`Kernel::AttentionPartial`] for a
    /// model of `head_dim` over a KV cache in `kv`, and its tokens per
    /// workgroup: the tile program where the set runs it and it takes the
    /// model and cache (`attention_tiles_key_for`), else
    /// `attention_prefill` (built with the set, or with the cache's
    /// format: [`Self::prepare_kv`]).
    pub(crate) fn attention_prefill_for(
        &self,
        kv: KvFormat,
        head_dim: usize,
    ) -> (wgpu::ComputePipeline, u32) {
        match self.attention_tiles_key_for(kv, head_dim) {
            Some(key) => (self.built(key), crate::kernels::attention::PREFILL_TILE_ATTENTION_TOKENS),
            None => (self.attention_prefill_f32(kv), PREFILL_ATTENTION_TOKENS),
        }
    }

    /// The key of the tile program where the set runs it and it takes a
    /// model of `head_dim` over a KV cache in `kv`: an f16 cache, and a
    /// head_dim that is a multiple of its tiles' (16 on cooperative
    /// matrices, 8 on SIMD-group ones).
    pub(super) fn attention_tiles_key_for(&self, kv: KvFormat, head_dim: usize) -> Option<PipelineKey> {
        let key = self.attention_tiles_key()?;
        let multiple = match key.program {
            Program::AttentionPrefillTilesMsl => crate::kernels::HEAD_DIM_MULTIPLE,
            _ => crate::kernels::attention::PREFILL_TILE_HEAD_DIM_MULTIPLE,
        };
        (kv == KvFormat::F16 && head_dim.is_multiple_of(multiple)).then_some(key)
    }

    /// `attention_prefill` itself over a KV cache in `kv` (f32 sums; its
    /// tokens per workgroup are [`PREFILL_ATTENTION_TOKENS`]).
    pub(crate) fn attention_prefill_f32(&self, kv: KvFormat) -> wgpu::ComputePipeline {
        let (per_token, _) = self.prefill_keys(Kernel::AttentionPartial, WeightFormat::Int8);
        self.built(PipelineKey { kv, ..per_token.expect("attention_partial's prompt-batch program") })
    }
}
