//! Tests' hooks: put a (wrong) pipeline in place of one of the set's, so
//! that the self-check's tests can show it is caught.

use super::{Kernels, PipelineKey};
use crate::converted::WeightFormat;
use crate::kernels::Kernel;
use crate::kv_cache::KvFormat;

impl Kernels {
    /// Puts `pipeline` in place of `k`'s decode pipeline (the self-check's
    /// tests: a wrong kernel must be caught).
    pub(crate) fn replace_pipeline(&mut self, k: Kernel, pipeline: wgpu::ComputePipeline) {
        self.replace_pipeline_in(k, WeightFormat::Int8, pipeline);
    }

    /// [`Self::replace_pipeline`] of the pipeline over weights in `format`.
    pub(crate) fn replace_pipeline_in(
        &mut self,
        k: Kernel,
        format: WeightFormat,
        pipeline: wgpu::ComputePipeline,
    ) {
        let key = self.decode_key(k, format);
        self.cache.get_mut().unwrap_or_else(|e| e.into_inner()).insert(key, pipeline);
    }

    /// Puts `pipeline` in place of `k`'s pipeline over a KV cache in `kv`
    /// (its decode one, or `prompt_batch`, its prompt-batch program; the
    /// self-check's tests).
    pub(crate) fn replace_kv_pipeline(
        &mut self,
        k: Kernel,
        kv: KvFormat,
        prompt_batch: bool,
        pipeline: wgpu::ComputePipeline,
    ) {
        let key = if prompt_batch {
            let (per_token, _) = self.prefill_keys(k, WeightFormat::Int8);
            PipelineKey { kv, ..per_token.expect("a prompt-batch program") }
        } else {
            self.decode_key_kv(k, WeightFormat::Int8, kv)
        };
        self.cache.get_mut().unwrap_or_else(|e| e.into_inner()).insert(key, pipeline);
    }

    /// Puts `pipeline` in place of `k`'s tiled prefill pipeline (the
    /// self-check's tests).
    pub(crate) fn replace_tiled_pipeline(&mut self, k: Kernel, pipeline: wgpu::ComputePipeline) {
        self.replace_tiled_pipeline_in(k, WeightFormat::Int8, pipeline);
    }

    /// [`Self::replace_tiled_pipeline`] of the pipeline over weights in
    /// `format`.
    pub(crate) fn replace_tiled_pipeline_in(
        &mut self,
        k: Kernel,
        format: WeightFormat,
        pipeline: wgpu::ComputePipeline,
    ) {
        let key = self.prefill_keys(k, format).1.expect("a tiled prefill pipeline");
        self.cache.get_mut().unwrap_or_else(|e| e.into_inner()).insert(key, pipeline);
    }

    /// Puts `pipeline` in place of the tile program of `attention_prefill`
    /// (the self-check's tests).
    pub(crate) fn replace_attention_tiles_pipeline(&mut self, pipeline: wgpu::ComputePipeline) {
        let key = self.attention_tiles_key().expect("the set runs the tile program");
        self.cache.get_mut().unwrap_or_else(|e| e.into_inner()).insert(key, pipeline);
    }
}
