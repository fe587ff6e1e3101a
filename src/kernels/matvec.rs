//! The `int8_matvec` family: `y (+)= W x` over int8 or int4 rows with
//! per-group scales, three epilogue variants, two work layouts chosen per
//! device, and pipelines specialised to a launch's shape. Its params, bindings and
//! override constants are those `int8_matmul` (the prompt-batch product)
//! shares.

use super::abi::gpu_struct;
use super::Bind;
use crate::converted::{WeightFormat, QUANT_GROUP};
use crate::error::Result;

gpu_struct! {
    /// The uniform of `int8_matvec` and `int8_matmul`.
    "Params" pub struct MatvecParams {
        /// Rows in this launch (a chunk of the matrix).
        pub rows: u32,
        /// Padded row length / 4 (a multiple of 4).
        pub k_words: u32,
        /// Scales per row.
        pub groups: u32,
        /// First output element written (SWIGLU: first matrix row).
        pub row_offset: u32,
        /// NORM: elements of x (the padding is zero).
        pub n_in: u32,
        /// NORM: rms_norm_eps.
        pub eps: f32,
        /// Elements between consecutive tokens' outputs (batched prefill).
        pub y_stride: u32,
    }
}

/// Binding order: params, x, w, scales, y, norm_w, x16 (the residual's
/// f16 copy: see [`MatvecSplit::x16`]).
pub const BINDINGS: &[Bind] =
    &[Bind::Uniform, Bind::Read, Bind::Read, Bind::Read, Bind::ReadWrite, Bind::Read, Bind::ReadWrite];

/// A decode launch's bindings from a matvec launch's, in [`BINDINGS`]
/// order (params, x, w, scales, y, norm_w, x16): a normed variant whose
/// pipeline keeps the residual's f16 copy (`x16`: [`MatvecSplit::x16`])
/// reads the copy at x's slot (read-only, in 16-byte loads: on an H200 the
/// 4B gate/up took 19.9 against 22.8 µs reading it at slot 6) and finds
/// the f32 stream at slot 6, unread. `None`: the launch's bindings as
/// given (every other decode launch, and every prompt batch: they read f32
/// x).
pub fn decode_bindings<T>(variant: MatvecVariant, x16: bool, bindings: [T; 7]) -> Option<[T; 7]> {
    let [params, x, w, scales, y, norm_w, resid16] = bindings;
    (x16 && variant.norm).then_some([params, resid16, w, scales, y, norm_w, x])
}

/// The grid of a launch over `rows` rows, `rows_per_wg` per workgroup (its
/// split's, [`MatvecSplit::rows_per_wg`]; `z`: tokens of a batch).
pub fn grid(rows: u32, rows_per_wg: u32) -> [u32; 3] {
    super::grid(rows.div_ceil(rows_per_wg))
}

/// What the two int8 matrix kernels share (bindings, flags, the int8-to-float
/// conversion, the inputs' int8 parts), prepended to each.
pub(super) const INT8_COMMON: &str = concat!(
    include_str!("../../kernels/wgsl/int8_common.wgsl"),
    include_str!("../../kernels/wgsl/int8_math.wgsl"),
    include_str!("../../kernels/wgsl/int8_parts.wgsl")
);
/// The epilogue flags and int8 arithmetic alone (the second half of [`INT8_COMMON`]).
pub(super) const INT8_MATH: &str = include_str!("../../kernels/wgsl/int8_math.wgsl");

/// Workgroup size of `int8_matvec`: two 32-wide subgroups on Apple GPUs and
/// NVIDIA, eight 8-wide ones on lavapipe.
pub const MATVEC_WG: u32 = 64;
/// Output rows per `int8_matvec` workgroup (a multiple of
/// [`MATVEC_ROWS_PER_TEAM`]).
pub const MATVEC_ROWS: u32 = 8;
/// Rows one subgroup reduces at once (the kernel's vec4 of partial sums).
pub const MATVEC_ROWS_PER_TEAM: u32 = 4;
/// int8 values one lane reads per row and step (one `vec4<u32>`; twice as
/// many int4 values: [`values_per_step`]).
pub const MATVEC_VALUES_PER_LANE: u32 = 16;

/// Values one lane reads per row and step (one `vec4<u32>`) of weights in
/// `format`.
pub fn values_per_step(format: WeightFormat) -> u32 {
    MATVEC_VALUES_PER_LANE * 8 / format.bits() as u32
}
/// Whether split-K devices run the int4 gate/up matvec paired
/// ([`MatvecSplit::paired`]: its teams take 8 rows a pass, sharing each
/// step's input loads, norm and integer quantisation). Off: on an H100 the
/// 4B's gate/up launch took 21.3 µs paired against 23.2 unpaired, yet its
/// decode step lost 6.4% (338 against 361 tok/s; the 1.7B 644 against 690;
/// BENCHMARKS.md 2026-12-07). `matvec_lab --weights int4 --only "engine
/// x16 unpaired,engine x16 paired"` measures it per launch.
pub const PAIR_INT4_GATE_UP: bool = false;
/// Rows per workgroup of the split-K layout.
pub const SPLIT_K_ROWS: u32 = 4;
/// Split-K devices run matrices with more rows than this rows per team
/// (see [`MatvecLayout::split`]).
pub const SPLIT_K_MAX_ROWS: usize = 16384;
/// Workgroup size of those rows-per-team matvecs: one subgroup on NVIDIA
/// GPUs (measured by `matvec_sweep`: 32 lanes and 4 rows beat 64 and 8).
pub const LONG_MATRIX_WG: u32 = 32;
/// Workgroup sizes the split-K matvec pipelines are built with (see
/// [`MatvecLayout::workgroup_size`]; the first is [`MATVEC_WG`]).
pub const SPLIT_K_WGS: [u32; 3] = [MATVEC_WG, 128, 256];
/// Invocations a split-K matvec launch keeps to where it can: past this,
/// a halved workgroup (two steps per lane instead of one) was faster on an
/// H200 (`matvec_sweep --size`: the 4B qkv 14.4 -> 12.0 µs, the 8B qkv
/// 16.6 -> 14.7 and o 11.0 -> 10.0, none slower), the GPU already being
/// full and the longer lane hiding its latency with more loads in flight.
pub const SPLIT_K_MAX_LANES: usize = 196_608;
/// [`SPLIT_K_MAX_LANES`] for int4 weights: a lane's int4 step holds twice
/// the inputs of an int8 one (32 f32 values), so fewer lanes fill the GPU.
/// Measured on an H100 (BENCHMARKS.md 2026-12-05): the 4B down (2560 x
/// 9728, 163,840 lanes at 256 a workgroup) runs faster halved (decode 312
/// -> 325 tok/s), the 1.7B down (2048 x 6144, 131,072 lanes) slower (668
/// -> 630), so the cap lies between them.
pub const SPLIT_K_MAX_LANES_INT4: usize = 131_072;

const _: () = assert!(
    MATVEC_ROWS.is_multiple_of(MATVEC_ROWS_PER_TEAM)
        && MATVEC_WG.is_power_of_two()
        && (QUANT_GROUP as u32).is_multiple_of(MATVEC_VALUES_PER_LANE)
);

/// Epilogue of an `int8_matvec` variant (its override constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatvecVariant {
    /// `y += W x` (fused residual add).
    pub accumulate: bool,
    /// RMSNorm of x fused in (`y = W (x * rsqrt(mean(x^2) + eps) * norm_w)`).
    pub norm: bool,
    /// `y = silu(gate) * up` over a matrix whose rows interleave gate and up.
    pub swiglu: bool,
}

impl MatvecVariant {
    pub const ACCUMULATE: Self = MatvecVariant { accumulate: true, norm: false, swiglu: false };
    pub const NORM: Self = MatvecVariant { accumulate: false, norm: true, swiglu: false };
    pub const NORM_SWIGLU: Self = MatvecVariant { accumulate: false, norm: true, swiglu: true };
}

/// How `int8_matvec` splits its work, chosen once per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatvecLayout {
    /// Each subgroup takes blocks of [`MATVEC_ROWS_PER_TEAM`] rows, no
    /// barriers ([`MATVEC_ROWS`] rows per workgroup): Apple GPUs (the
    /// layout of the MSL twin), CPU adapters, and devices without subgroups.
    RowsPerTeam,
    /// The whole workgroup takes [`SPLIT_K_ROWS`] rows and splits K, then
    /// one workgroup reduction: more workgroups in flight for the small
    /// layer matrices on GPUs with many cores.
    SplitK,
}

/// Environment variable that overrides the matvec layout (`rows` or
/// `split`), for benchmarks.
pub const MATVEC_LAYOUT_ENV: &str = "QWEN3_WGPU_MATVEC_LAYOUT";

impl MatvecLayout {
    /// The names [`Self::from_name`] accepts: `rows` and `split`.
    pub const NAMES: [(&'static str, MatvecLayout); 2] =
        [("rows", MatvecLayout::RowsPerTeam), ("split", MatvecLayout::SplitK)];

    /// The layout named `rows` or `split`; anything else is
    /// `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        crate::settings::parse_choice(what, value, &Self::NAMES)
    }

    /// The layout [`MATVEC_LAYOUT_ENV`] names: `None` when it is unset,
    /// `invalid_argument` when it names no layout.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(MATVEC_LAYOUT_ENV, &Self::NAMES)
    }

    /// The layout for a device: split K on discrete and integrated GPUs
    /// other than Apple's, rows per team elsewhere.
    pub fn for_device(info: &wgpu::AdapterInfo) -> Self {
        let many_cores =
            matches!(info.device_type, wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu);
        if many_cores && info.backend != wgpu::Backend::Metal {
            MatvecLayout::SplitK
        } else {
            MatvecLayout::RowsPerTeam
        }
    }

    /// How the decode matvec of a matrix with `rows` rows of `k_words`
    /// words (its input's u32 words at int8: values / 4) in `format` runs. Split-K devices run matrices of more than
    /// [`SPLIT_K_MAX_ROWS`] rows (the LM head) rows per team, one subgroup
    /// of [`LONG_MATRIX_WG`] lanes per 4 rows: they have workgroups enough
    /// to fill the GPU without splitting K, and skip its reduction (the
    /// 0.6B LM head on an H200: 63 against 77 µs, BENCHMARKS.md).
    ///
    /// On split-K devices the decode steps also keep the residual stream in
    /// f16 ([`MatvecSplit::x16`]), and the normed matvecs (`norm`: qkv,
    /// gate/up, the LM head), which read it, run rows per team like the
    /// long matrices: with half the bytes of x per weight byte, one
    /// subgroup per 4 rows beats split K at every Qwen3 size (H200, 4B:
    /// qkv 12.2 -> 8.3 µs, gate/up 24.7 -> 17.8, LM head 130 -> 97;
    /// BENCHMARKS.md 2026-12-02), where the f32 x loads held them back.
    pub fn split(self, rows: usize, k_words: usize, norm: bool, format: WeightFormat) -> MatvecSplit {
        match self {
            MatvecLayout::SplitK if rows > SPLIT_K_MAX_ROWS || norm => MatvecSplit {
                layout: MatvecLayout::RowsPerTeam,
                workgroup_size: LONG_MATRIX_WG,
                rows_per_wg: MATVEC_ROWS_PER_TEAM,
                x16: true,
                paired: false,
            },
            _ => MatvecSplit {
                layout: self,
                workgroup_size: self.workgroup_size(rows, k_words, format),
                rows_per_wg: self.rows_per_wg(),
                x16: self.x16(),
                paired: false,
            },
        }
    }

    /// [`Self::split`] of matvec `variant`: on split-K devices, where
    /// [`PAIR_INT4_GATE_UP`], the int4 gate/up matvec runs paired
    /// ([`MatvecSplit::paired`]).
    pub fn split_for(
        self,
        variant: MatvecVariant,
        rows: usize,
        k_words: usize,
        format: WeightFormat,
    ) -> MatvecSplit {
        let split = self.split(rows, k_words, variant.norm, format);
        let pair = PAIR_INT4_GATE_UP
            && self == MatvecLayout::SplitK
            && variant.swiglu
            && format == WeightFormat::Int4;
        if pair && split.layout == MatvecLayout::RowsPerTeam {
            MatvecSplit { rows_per_wg: 2 * MATVEC_ROWS_PER_TEAM, paired: true, ..split }
        } else {
            split
        }
    }

    /// Whether decode steps on this layout's devices keep the residual
    /// stream's f16 copy ([`MatvecSplit::x16`]): split K (NVIDIA-class
    /// GPUs, where the matvecs are bound by their loads of x); not rows
    /// per team (Apple GPUs, whose MSL twins read f32 x, and CPUs).
    pub fn x16(self) -> bool {
        self == MatvecLayout::SplitK
    }

    /// Every split [`Self::split`] can give; the first is that of the
    /// matvec kernels' default pipelines ([`super::Kernel::constants`]).
    pub fn splits(self) -> Vec<MatvecSplit> {
        let at = |workgroup_size| MatvecSplit {
            layout: self,
            workgroup_size,
            rows_per_wg: self.rows_per_wg(),
            x16: self.x16(),
            paired: false,
        };
        match self {
            MatvecLayout::RowsPerTeam => vec![at(MATVEC_WG)],
            MatvecLayout::SplitK => SPLIT_K_WGS
                .into_iter()
                .map(at)
                .chain(std::iter::once(self.split(SPLIT_K_MAX_ROWS + 1, 0, false, WeightFormat::Int8)))
                .chain(std::iter::once(MatvecSplit {
                    rows_per_wg: 2 * MATVEC_ROWS_PER_TEAM,
                    paired: true,
                    ..self.split(1, 0, true, WeightFormat::Int4)
                }))
                .collect(),
        }
    }

    /// The split of the kernels' default pipelines.
    pub fn default_split(self) -> MatvecSplit {
        MatvecSplit {
            layout: self,
            workgroup_size: MATVEC_WG,
            rows_per_wg: self.rows_per_wg(),
            x16: self.x16(),
            paired: false,
        }
    }

    /// Output rows per workgroup.
    pub fn rows_per_wg(self) -> u32 {
        match self {
            MatvecLayout::RowsPerTeam => MATVEC_ROWS,
            MatvecLayout::SplitK => SPLIT_K_ROWS,
        }
    }

    /// Workgroup size of the decode matvec over `rows` rows of `k_words`
    /// words in `format`: [`MATVEC_WG`] for rows per team; for split K the
    /// smallest of [`SPLIT_K_WGS`] that gives each lane at most one step
    /// ([`values_per_step`]) per row, or the largest, halved (down to the smallest) while the
    /// launch would run more than [`SPLIT_K_MAX_LANES`] invocations
    /// ([`SPLIT_K_MAX_LANES_INT4`] for int4). A
    /// lane's steps are a chain of dependent memory round trips: one step
    /// each keeps the launch at one round trip, unless the GPU is full
    /// anyway.
    pub fn workgroup_size(self, rows: usize, k_words: usize, format: WeightFormat) -> u32 {
        match self {
            MatvecLayout::RowsPerTeam => MATVEC_WG,
            MatvecLayout::SplitK => {
                let steps = (4 * k_words).div_ceil(values_per_step(format) as usize);
                let last = SPLIT_K_WGS.len() - 1;
                let mut i = SPLIT_K_WGS.iter().position(|&w| w as usize >= steps).unwrap_or(last);
                let workgroups = rows.div_ceil(SPLIT_K_ROWS as usize);
                let max_lanes = match format {
                    WeightFormat::Int8 => SPLIT_K_MAX_LANES,
                    WeightFormat::Int4 => SPLIT_K_MAX_LANES_INT4,
                };
                while i > 0 && workgroups.saturating_mul(SPLIT_K_WGS[i] as usize) > max_lanes {
                    i -= 1;
                }
                SPLIT_K_WGS[i]
            }
        }
    }
}

/// How one matrix's decode matvec splits its work: the layout, the
/// workgroup size and the output rows per workgroup (its pipeline's `SPLIT_K`,
/// `WG` and `ROWS_PER_WG`), from [`MatvecLayout::split`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatvecSplit {
    pub layout: MatvecLayout,
    pub workgroup_size: u32,
    pub rows_per_wg: u32,
    /// The decode pipelines (one token, or a batch's rows) keep the
    /// residual stream's f16 copy (`X16`): the residual adds (o_proj,
    /// down; and the embedding) write it beside the f32 stream (binding 6),
    /// and the normed matvecs read it instead of x (bound at x's slot:
    /// [`decode_bindings`]). Prompt batches use f32 x throughout. See
    /// [`MatvecLayout::x16`].
    pub x16: bool,
    /// Rows per team only (`PAIRED`, int4 pipelines): each team takes 8
    /// rows a pass, two blocks of 4 sharing each step's inputs, and
    /// `rows_per_wg` is 8. Each row adds exactly as unpaired, so a batch's
    /// rows keep its bits. Where its pipeline is not available the launch
    /// runs [`Self::unpaired`] (whose grid the default pipeline shares).
    pub paired: bool,
}

impl MatvecSplit {
    /// The same split with teams of 4 rows.
    pub fn unpaired(self) -> Self {
        if self.paired {
            MatvecSplit { rows_per_wg: MATVEC_ROWS_PER_TEAM, paired: false, ..self }
        } else {
            self
        }
    }
}

/// The shape of one decode matvec launch (a row chunk of a matrix): the
/// `int8_matvec` pipeline specialised with it
/// ([`super::Kernels::matvec_pipeline`]) has it compiled in (its `SHAPE_*`
/// override constants) instead of reading it from the launch's uniform, so
/// its first loads wait on nothing and its index arithmetic folds (a 0.6B
/// step's matvecs on an H200: 671 against 715 µs, BENCHMARKS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatvecShape {
    /// Rows in this launch.
    pub rows: u32,
    /// Padded row length in u32 words.
    pub k_words: u32,
    /// Scales per row.
    pub groups: u32,
    /// Elements of the input (the RMSNorm's count).
    pub n_in: u32,
}

impl MatvecShape {
    /// The `SHAPE_*` override constants (the `int8_common.wgsl` names).
    pub fn constants(self) -> [(&'static str, f64); 4] {
        [
            ("SHAPE_ROWS", self.rows as f64),
            ("SHAPE_K_WORDS", self.k_words as f64),
            ("SHAPE_GROUPS", self.groups as f64),
            ("SHAPE_N_IN", self.n_in as f64),
        ]
    }
}

/// Rows of a batch of sessions' decode steps (`rows`) that one workgroup of
/// a batched matvec under `split` runs ([`MatvecConstants::rows_per_z`]):
/// split K at most [`BATCH_SPLIT_K_ROWS_PER_Z`], spread evenly over the
/// grid's z groups; rows per team all of them (its workgroups read each
/// weight quad once for four rows).
pub fn batch_rows_per_z(split: MatvecSplit, rows: u32) -> u32 {
    let rows = rows.max(1);
    match split.layout {
        MatvecLayout::SplitK => rows.div_ceil(rows.div_ceil(BATCH_SPLIT_K_ROWS_PER_Z)),
        MatvecLayout::RowsPerTeam => rows,
    }
}

/// The most batch rows a split-K workgroup runs: more z groups in flight
/// beat one workgroup running every row (H200, 16 rows: o_proj 21.1 ->
/// 18.4 us, down 30.0 -> 25.7; 8 sessions 3,055 -> 3,162 tok/s,
/// BENCHMARKS.md 2026-12-01).
pub const BATCH_SPLIT_K_ROWS_PER_Z: u32 = 4;

/// Whether a decode pipeline of `variant` over `format` weights, reading
/// the residual's f16 copy (`x16`), takes its int4 steps as integer dot
/// products against its inputs quantised to int8, 32 values a scale
/// (`IDOT`, int8_matvec.wgsl): the normed int4 matvecs (qkv, gate/up) on
/// split-K devices, whose float dequantisation, not their bytes, bounded
/// them (an H100: 4B qkv 12.0 -> 8.7 µs, gate/up 23.9 -> 18.9; BENCHMARKS.md
/// 2026-12-06 11:25). The CPU references quantise alike
/// ([`crate::reference::int_dot_input`]).
pub fn int_dot(format: WeightFormat, variant: MatvecVariant, x16: bool) -> bool {
    format == WeightFormat::Int4 && variant.norm && x16
}

/// The override constants of an `int8_matvec` pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatvecConstants {
    pub variant: MatvecVariant,
    /// `WG`, `ROWS_PER_WG` and `SPLIT_K`.
    pub split: MatvecSplit,
    /// `TOKENS`: 1 for decode, [`super::PREFILL_TOKENS_PER_WG`] for the
    /// per-token prefill pipelines.
    pub tokens: u32,
    /// The `SHAPE_*` constants of a specialised pipeline.
    pub shape: Option<MatvecShape>,
    /// `DECODE_ROWS`: the decode rows of a batch of sessions' steps, each
    /// row with the one-token arithmetic; 0: one token per grid z.
    pub decode_rows: u32,
    /// `ROWS_PER_Z`: of those rows, how many each workgroup runs in turn
    /// (grid z = g takes rows g * rows_per_z ..).
    pub rows_per_z: u32,
    /// The weights' format (`INT4`).
    pub format: WeightFormat,
}

impl MatvecConstants {
    /// A decode pipeline of `variant` under `split`, over int8 weights.
    pub fn decode(variant: MatvecVariant, split: MatvecSplit) -> Self {
        MatvecConstants {
            variant,
            split,
            tokens: 1,
            shape: None,
            decode_rows: 0,
            rows_per_z: 0,
            format: WeightFormat::Int8,
        }
    }

    /// The per-token prefill pipeline of `variant` on a device of `layout`,
    /// over int8 weights:
    /// [`super::PREFILL_TOKENS_PER_WG`] tokens per workgroup, rows per team,
    /// on the decode grid (at least as many rows per workgroup: the extra
    /// workgroups exit at once).
    pub fn prefill(variant: MatvecVariant, layout: MatvecLayout) -> Self {
        let split = MatvecSplit {
            layout: MatvecLayout::RowsPerTeam,
            workgroup_size: MATVEC_WG,
            rows_per_wg: MATVEC_ROWS.max(layout.rows_per_wg()),
            x16: false,
            paired: false,
        };
        MatvecConstants {
            variant,
            split,
            tokens: super::PREFILL_TOKENS_PER_WG,
            shape: None,
            decode_rows: 0,
            rows_per_z: 0,
            format: WeightFormat::Int8,
        }
    }

    /// Whether the pipeline's int4 steps are integer dot products
    /// ([`int_dot`]; decode pipelines only).
    pub fn int_dot(&self) -> bool {
        int_dot(self.format, self.variant, self.split.x16 && self.tokens == 1)
    }

    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut c = vec![
            ("WG", self.split.workgroup_size as f64),
            ("GROUP_WORDS", (QUANT_GROUP / 4) as f64),
            ("ROWS_PER_WG", self.split.rows_per_wg as f64),
            ("SPLIT_K", flag(self.split.layout == MatvecLayout::SplitK)),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
            ("TOKENS", self.tokens as f64),
            ("X16", flag(self.split.x16 && self.tokens == 1)),
            ("INT4", flag(self.format == WeightFormat::Int4)),
            ("IDOT", flag(self.int_dot())),
            ("PAIRED", flag(self.split.paired)),
        ];
        c.extend(self.shape.iter().flat_map(|s| s.constants()));
        if self.decode_rows > 0 {
            c.push(("DECODE_ROWS", self.decode_rows as f64));
            c.push(("ROWS_PER_Z", self.rows_per_z as f64));
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::super::Kernel;
    use super::*;

    /// Integer dot products (`IDOT`) in exactly the int4 normed decode
    /// pipelines that read the f16 residual copy, one-token and batched.
    #[test]
    fn int4_normed_decode_pipelines_on_the_f16_copy_take_integer_dot_products() {
        let idot = |c: MatvecConstants| c.render().contains(&("IDOT", 1.0));
        for layout in [MatvecLayout::SplitK, MatvecLayout::RowsPerTeam] {
            for variant in [MatvecVariant::NORM, MatvecVariant::NORM_SWIGLU, MatvecVariant::ACCUMULATE] {
                for format in [WeightFormat::Int8, WeightFormat::Int4] {
                    let split = layout.split(1024, 256, variant.norm, format);
                    let one = MatvecConstants { format, ..MatvecConstants::decode(variant, split) };
                    let rows = MatvecConstants { decode_rows: 4, rows_per_z: 4, ..one };
                    let prefill = MatvecConstants { format, ..MatvecConstants::prefill(variant, layout) };
                    let want = layout == MatvecLayout::SplitK && variant.norm && format == WeightFormat::Int4;
                    assert_eq!((idot(one), idot(rows)), (want, want), "{layout:?} {variant:?} {format:?}");
                    assert!(!idot(prefill), "{layout:?} {variant:?} {format:?} prefill");
                }
            }
        }
    }

    /// Only the int4 gate/up matvec of split-K devices runs paired (where
    /// [`PAIR_INT4_GATE_UP`]); the paired split is among `splits()` either
    /// way, so the kernel tests run it.
    #[test]
    fn the_int4_gate_up_matvec_of_split_k_devices_runs_paired() {
        let split_k = MatvecLayout::SplitK;
        let paired =
            MatvecSplit { rows_per_wg: 8, paired: true, ..split_k.split(1, 0, true, WeightFormat::Int4) };
        assert!(split_k.splits().contains(&paired));
        for layout in [MatvecLayout::SplitK, MatvecLayout::RowsPerTeam] {
            for variant in [MatvecVariant::NORM, MatvecVariant::NORM_SWIGLU, MatvecVariant::ACCUMULATE] {
                for format in [WeightFormat::Int8, WeightFormat::Int4] {
                    let split = layout.split_for(variant, 19456, 640, format);
                    let want = PAIR_INT4_GATE_UP
                        && layout == MatvecLayout::SplitK
                        && variant.swiglu
                        && format == WeightFormat::Int4;
                    assert_eq!(split.paired, want, "{layout:?} {variant:?} {format:?}");
                    assert_eq!(split.rows_per_wg, if want { 8 } else { layout.rows_per_wg() });
                    assert_eq!(split.unpaired(), layout.split(19456, 640, variant.norm, format));
                    let c = MatvecConstants { format, ..MatvecConstants::decode(variant, split) };
                    assert_eq!(c.render().contains(&("PAIRED", 1.0)), want);
                }
            }
        }
    }

    #[test]
    fn split_k_gives_each_lane_one_step_per_row_where_it_can() {
        let wg = |rows: usize, cols: usize| {
            MatvecLayout::SplitK.workgroup_size(rows, cols / 4, WeightFormat::Int8)
        };
        // Qwen3-0.6B: qkv, o, gate/up, down: one step per lane.
        assert_eq!((wg(4096, 1024), wg(1024, 2048), wg(6144, 1024), wg(1024, 3072)), (64, 128, 64, 256));
        // Short rows keep the smallest size; long ones take the largest.
        assert_eq!((wg(1024, 64), wg(1024, 1088), wg(1024, 8192)), (64, 128, 256));
        assert_eq!(MatvecLayout::RowsPerTeam.workgroup_size(4096, 768, WeightFormat::Int8), MATVEC_WG);
    }

    #[test]
    fn split_k_halves_the_workgroup_of_launches_that_fill_the_gpu() {
        let wg = |rows: usize, cols: usize| {
            MatvecLayout::SplitK.workgroup_size(rows, cols / 4, WeightFormat::Int8)
        };
        // Qwen3-4B qkv (6144 x 2560) and 8B qkv and o (6144 and 4096 x
        // 4096): 128 invocations, two steps per lane; the 4B o and down
        // (2560 rows) keep 256.
        assert_eq!((wg(6144, 2560), wg(6144, 4096), wg(4096, 4096)), (128, 128, 128));
        assert_eq!((wg(2560, 4096), wg(2560, 9728)), (256, 256));
        // Never below the smallest size, whatever the row count.
        assert_eq!(wg(1 << 30, 8192), MATVEC_WG);
    }

    /// An int4 step holds 32 values, so a row needs half the lanes of its
    /// int8 twin for one step each.
    #[test]
    fn int4_rows_take_half_the_steps() {
        let wg = |rows: usize, cols: usize| {
            MatvecLayout::SplitK.workgroup_size(rows, cols / 4, WeightFormat::Int4)
        };
        // Qwen3-0.6B o and down: 2048 and 3072 values, 64 and 96 steps.
        assert_eq!((wg(1024, 2048), wg(1024, 3072), wg(1024, 4096), wg(1024, 8192)), (64, 128, 128, 256));
        assert_eq!(values_per_step(WeightFormat::Int4), 2 * values_per_step(WeightFormat::Int8));
    }

    /// Int4 launches count as full at fewer lanes than int8's.
    #[test]
    fn int4_halves_the_workgroup_at_half_the_lanes() {
        let wg =
            |rows: usize, cols: usize, format| MatvecLayout::SplitK.workgroup_size(rows, cols / 4, format);
        // Qwen3-4B down (2560 x 9728, 304 int4 steps): 640 workgroups of
        // 256 would run 163,840 lanes; int8 keeps 256, int4 halves to 128.
        assert_eq!(wg(2560, 9728, WeightFormat::Int8), 256);
        assert_eq!(wg(2560, 9728, WeightFormat::Int4), 128);
        // The 1.7B down (2048 x 6144, 192 steps): 131,072 lanes, kept; the
        // 8B o (4096 x 4096, 128 steps) likewise.
        assert_eq!(wg(2048, 6144, WeightFormat::Int4), 256);
        assert_eq!(wg(4096, 4096, WeightFormat::Int4), 128);
    }

    #[test]
    fn every_split_has_a_pipeline_and_the_first_is_the_default() {
        for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
            let splits = layout.splits();
            assert_eq!(splits[0], layout.default_split());
            for k in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
                assert_eq!(k.split_constants(splits[0]), k.constants(layout), "{k:?} {layout:?}");
            }
            // Qwen3-0.6B's matrices (rows, k_words) and longer rows.
            for (rows, k_words) in
                [(4096, 256), (1024, 512), (6144, 256), (1024, 768), (151936, 256), (64, 4096)]
            {
                for (norm, format) in
                    [false, true].into_iter().flat_map(|n| WeightFormat::NAMES.map(|(_, f)| (n, f)))
                {
                    let split = layout.split(rows, k_words, norm, format);
                    assert!(splits.contains(&split), "{layout:?} {rows}x{k_words}");
                    // Every decode pipeline of a device keeps the f16 copy or none does.
                    assert_eq!(split.x16, layout.x16(), "{layout:?}");
                }
            }
            // The default pipeline, which serves when a split's fails to
            // build, runs any unpaired split's grid; the prompt batches'
            // per-token pipelines any split's.
            assert!(splits.iter().all(|s| s.unpaired().rows_per_wg == splits[0].rows_per_wg), "{layout:?}");
            assert!(splits.iter().all(|s| s.rows_per_wg <= MATVEC_ROWS), "{layout:?}");
        }
        let lm_head = MatvecLayout::SplitK.split(151936, 256, true, WeightFormat::Int8);
        assert_eq!((lm_head.layout, lm_head.workgroup_size), (MatvecLayout::RowsPerTeam, LONG_MATRIX_WG));
        assert_eq!(
            MatvecLayout::SplitK.split(SPLIT_K_MAX_ROWS, 256, false, WeightFormat::Int8).layout,
            MatvecLayout::SplitK
        );
        // The normed matvecs read the f16 copy rows per team.
        assert_eq!(MatvecLayout::SplitK.split(4096, 256, true, WeightFormat::Int8), lm_head);
        assert!(!MatvecLayout::RowsPerTeam.x16() && MatvecLayout::SplitK.x16());
    }

    /// X16 is set in the one-token and batched-row decode pipelines of an
    /// f16-copy split, and never in the prompt-batch pipelines.
    #[test]
    fn x16_only_in_decode_pipelines() {
        let x16 = |c: &MatvecConstants| c.render().iter().any(|&(n, v)| n == "X16" && v == 1.0);
        for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
            for v in [MatvecVariant::ACCUMULATE, MatvecVariant::NORM, MatvecVariant::NORM_SWIGLU] {
                let decode = MatvecConstants::decode(v, layout.split(1024, 256, v.norm, WeightFormat::Int8));
                assert_eq!(x16(&decode), layout.x16(), "{layout:?} {v:?}");
                let rows = MatvecConstants { decode_rows: 4, rows_per_z: 4, ..decode };
                assert_eq!(x16(&rows), layout.x16(), "{layout:?} {v:?}");
                assert!(!x16(&MatvecConstants::prefill(v, layout)), "{layout:?} {v:?}");
            }
        }
    }
}
