//! Building an [`Engine`]: the adapter policy or a caller's device, the
//! kernel choice and layout, and the prompt-batch programs.

use std::sync::Arc;

use super::Engine;
use crate::error::Result;
use crate::gpu::{AdapterPolicy, Gpu};
use crate::kernels::{KernelChoice, Kernels, MatvecLayout};

/// Environment variable read when the caller does not set
/// [`EngineBuilder::cooperative_matrices`]: `on` (the default) runs prompt
/// batches on cooperative matrices where the device offers them, `off`
/// keeps them on the f32 program.
pub const COOPERATIVE_MATRICES_ENV: &str = "QWEN3_WGPU_COOPERATIVE_MATRICES";

/// Builds an [`Engine`].
#[derive(Default)]
pub struct EngineBuilder {
    policy: Option<AdapterPolicy>,
    device: Option<(wgpu::Device, wgpu::Queue)>,
    no_subgroups: bool,
    kernels: Option<KernelChoice>,
    matvec_layout: Option<MatvecLayout>,
    msl_off_metal: bool,
    cooperative_matrices: Option<bool>,
    /// [`EngineBuilder::emulate_cooperative_matrices`]'s row threshold.
    emulate_coop_min_rows: Option<u32>,
    /// The packing start of decode attention in place of the default or
    /// the environment's (tests).
    attention_pack_from: Option<u32>,
}

impl EngineBuilder {
    /// Sets the adapter policy. Without it: the `QWEN3_WGPU_BACKEND`
    /// environment variable if set, else [`AdapterPolicy::MetalOnly`].
    pub fn policy(mut self, policy: AdapterPolicy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Runs on a device the host application already owns (its renderer's,
    /// say) instead of creating one. The policy still applies.
    pub fn device(mut self, device: wgpu::Device, queue: wgpu::Queue) -> Self {
        self.device = Some((device, queue));
        self
    }

    /// Uses the workgroup-memory reductions even where subgroup operations
    /// exist (for comparison and testing; slower).
    pub fn without_subgroups(mut self) -> Self {
        self.no_subgroups = true;
        self
    }

    /// Chooses the kernels: [`KernelChoice::Auto`] (the hand-written MSL
    /// twins on Metal, WGSL elsewhere) or [`KernelChoice::Wgsl`]. Without
    /// it: the `QWEN3_WGPU_KERNELS` environment variable (`wgsl` or `auto`)
    /// if set, else `Auto`.
    pub fn kernels(mut self, choice: KernelChoice) -> Self {
        self.kernels = Some(choice);
        self
    }

    /// Forces the WGSL matvec's work split (for comparison and testing).
    /// Without it: `QWEN3_WGPU_MATVEC_LAYOUT` (`rows` or `split`) if set,
    /// else the device's ([`MatvecLayout::for_device`]). The MSL twin has
    /// one layout of its own.
    pub fn matvec_layout(mut self, layout: MatvecLayout) -> Self {
        self.matvec_layout = Some(layout);
        self
    }

    /// Whether prompt batches may run on cooperative matrices where the
    /// device offers the 16x16 f16 ones with 32-lane subgroups (NVIDIA
    /// through Vulkan): the weights and inputs of each product are staged
    /// as f16 (11 significant bits; the sums stay f32) and multiplied on
    /// tensor cores (`int8_matmul_coop`), 1.5-2.1x the f32 program's
    /// prefill on an H200 (BENCHMARKS.md 2026-12-02). Over an f16 KV cache
    /// and a head_dim that is a multiple of 16, the prompt's attention runs
    /// on them too (`attention_prefill_tiles`: q and the softmax weights as
    /// f16, the scores and sums f32).
    /// Checked at start-up like every kernel, with the f32 program as
    /// fallback ([`KernelReport::cooperative_matrices`](crate::KernelReport::cooperative_matrices)); the MLX
    /// comparisons (tests/it/e2e_mlx.rs) pass with them on that device. Decode
    /// steps never use them. Memory: the model's first session makes a
    /// staging buffer of its largest matrix at 2 bytes a value plus a
    /// prompt batch of its inputs (13.1 MB for the 0.6B model, 101 MB for
    /// the 4B, 203 MB for the 8B), shared by its sessions. Without this call: the
    /// `QWEN3_WGPU_COOPERATIVE_MATRICES` environment variable (`on` or
    /// `off`) if set, else on. An adopted device ([`Self::device`]) never
    /// uses them (the engine cannot ask for the features there).
    pub fn cooperative_matrices(mut self, on: bool) -> Self {
        self.cooperative_matrices = Some(on);
        self
    }

    /// Runs the cooperative-matrix prompt-batch path where the device has f16
    /// but no cooperative matrices (Mesa's lavapipe), with a scalar product
    /// in place of the tensor-core one, for every product of at least
    /// `min_rows` rows: drives the f16 staging, its launches and its
    /// fidelity in tests. Where the device has cooperative matrices it runs
    /// the real product with the same row threshold.
    #[doc(hidden)]
    pub fn emulate_cooperative_matrices(mut self, min_rows: u32) -> Self {
        self.emulate_coop_min_rows = Some(min_rows);
        self
    }

    /// Attempts the MSL twins whatever the adapter (wgpu rejects them off
    /// Metal): drives the fallback through wgpu's own error route in tests.
    #[doc(hidden)]
    pub fn attempt_msl_on_any_adapter(mut self) -> Self {
        self.msl_off_metal = true;
        self
    }

    /// Decode attention packs two query heads a workgroup from position
    /// `pos` on, in place of `QWEN3_WGPU_ATTENTION_PACK_FROM` or the
    /// default (tests: packed steps at short contexts; every choice gives
    /// the same bits).
    #[doc(hidden)]
    pub fn attention_pack_from(mut self, pos: u32) -> Self {
        self.attention_pack_from = Some(pos);
        self
    }

    /// Picks (or adopts) the device, compiles every kernel and runs the
    /// start-up self-check ([`Engine::kernel_report`]).
    pub fn build(self) -> Result<Engine> {
        // Every setting is read before the device is touched: a bad value
        // fails fast, whatever else is wrong.
        let policy = match self.policy {
            Some(p) => p,
            None => AdapterPolicy::from_env()?.unwrap_or_default(),
        };
        let choice = match self.kernels {
            Some(c) => c,
            None => KernelChoice::from_env()?.unwrap_or_default(),
        };
        let matvec_layout = match self.matvec_layout {
            Some(l) => Some(l),
            None => MatvecLayout::from_env()?,
        };
        let coop = match self.cooperative_matrices {
            Some(on) => on,
            None => crate::settings::env_choice(COOPERATIVE_MATRICES_ENV, &[("on", true), ("off", false)])?
                .unwrap_or(true),
        };
        let mut gpu = match self.device {
            Some((device, queue)) => Gpu::from_device(device, queue, policy)?,
            None => Gpu::new_with(policy, coop, self.emulate_coop_min_rows.is_some())?,
        };
        gpu.subgroups &= !self.no_subgroups;
        gpu.coop &= gpu.subgroups;
        gpu.probe()?;
        let check = crate::self_check::CHECKER;
        let mut kernels = if self.msl_off_metal && choice == KernelChoice::Auto {
            Kernels::new_with(&gpu, true, matvec_layout, check)?
        } else {
            Kernels::new(&gpu, choice, matvec_layout, check)?
        };
        if let (true, Some(rows)) = (kernels.coop, self.emulate_coop_min_rows) {
            kernels.coop_min_rows = rows;
        }
        if let Some(pos) = self.attention_pack_from {
            kernels.attention_pack_from = pos;
        }
        let kernels = Arc::new(kernels);
        Ok(Engine { gpu, kernels })
    }
}
