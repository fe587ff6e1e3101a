//! The `int8_matmul` family: the tiled matrix product that runs a prompt
//! batch through the normed `int8_matvec` variants (qkv, gate/up). Same
//! params ([`super::MatvecParams`]), bindings and epilogues as the matvec,
//! whose bind group it shares; the tile sizes size its workgroup arrays, so
//! they come in a `const` preamble rather than as overrides. On Metal its
//! MSL twin ([`MATMUL_MSL`], on SIMD-group matrices) takes its place, on
//! the same bind group and grid, where the MSL twins are in use; on
//! adapters with 16x16 f16 cooperative matrices and 32-lane subgroups
//! (NVIDIA through Vulkan), `int8_matmul_coop` does (the same tile and
//! grid; [`MatmulConstants::coop`]). The f32 program's tile and its
//! division among invocations ([`MatmulTile`]) are chosen at start-up
//! (`QWEN3_WGPU_MATMUL_TILE`); the others keep [`MatmulTile::BASE`]'s grid.

use super::abi::{msl_decls, wgsl_decls, GpuStruct};
use super::matvec::{MatvecParams, MatvecVariant, INT8_COMMON, INT8_MATH};
use super::msl::preamble_of;
use super::PREFILL_TOKENS_PER_WG;
use crate::converted::QUANT_GROUP;
use crate::error::Result;

/// Rows of one `int8_matmul` tile in the base tiling ([`MatmulTile::BASE`]:
/// MM_ROWS in the preamble, the grid's rows per workgroup), which the MSL
/// twin and `int8_matmul_coop` keep.
pub const MATMUL_ROWS_PER_WG: u32 = 64;
/// The most tokens of any `int8_matmul` tile (see
/// [`super::Kernel::matmul_tokens_per_wg`]): activation buffers hold a multiple.
pub const MATMUL_TOKENS_PER_WG: u32 = 64;
/// Tokens of the SwiGLU (gate/up) variant's tiles: its 6,144 rows fill an
/// H200 better in twice the workgroups of half the tokens (BENCHMARKS.md).
pub const MATMUL_SWIGLU_TOKENS_PER_WG: u32 = 32;

/// Environment variable that picks the tiling of the f32 `int8_matmul`
/// (workgroup tile, register tile, prefetch, swizzle) by name
/// ([`MatmulTile::all`]), for benchmarks.
pub const MATMUL_TILE_ENV: &str = "QWEN3_WGPU_MATMUL_TILE";

/// The f32 `int8_matmul`'s tile and how it is divided among invocations:
/// a workgroup computes `rows` rows x `tokens` tokens (SwiGLU: half the
/// tokens, see [`MATMUL_SWIGLU_TOKENS_PER_WG`]), each invocation
/// `inv_rows` rows x `inv_tokens` tokens of it in registers, reading
/// `inv_rows / 4 + inv_tokens / 4` vec4s of workgroup memory per
/// `inv_rows * inv_tokens` multiply-adds. Every tiling computes each output
/// as the same sum in the same order (the results are bit for bit those of
/// [`MatmulTile::BASE`]); only the speed differs. `int8_matmul_coop` keeps
/// the base tile's grid ([`MatmulConstants::rows`]), and the pipeline set
/// builds the MSL twin in the base tiling (its grid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatmulTile {
    /// Rows of one workgroup's tile (a multiple of its `inv_rows`).
    pub rows: u32,
    /// Tokens of one workgroup's tile for the variants other than SwiGLU,
    /// which takes half as many (both multiples of `inv_tokens`, dividing
    /// [`MATMUL_TOKENS_PER_WG`]).
    pub tokens: u32,
    /// Rows of one invocation's register tile (4 or 8).
    pub inv_rows: u32,
    /// Tokens of one invocation's register tile (4 or 8).
    pub inv_tokens: u32,
    /// Whether each chunk's memory loads are issued into registers before
    /// the previous chunk's multiply-adds (double-buffered staging: their
    /// latency hides behind arithmetic) rather than after them.
    pub prefetch: bool,
    /// Whether the staged vec4s of value k sit at quad q ^ (k / 4) rather
    /// than q: a staging invocation writes 4 values of one row quad (or
    /// token quad), and its neighbours the next values of the same quad, 4
    /// rows of the staging array apart, all in one bank group of workgroup
    /// memory (8 writes in turn where one would do); swizzled, neighbours
    /// write 8 different bank groups, and the multiply-adds' reads stay
    /// whole 128-byte lines.
    pub swizzle: bool,
    /// Whether every variant takes tiles of half the rows and half the
    /// tokens (SwiGLU: half the rows, the same tokens): four (two) times
    /// the workgroups. o_proj and down (the model's hidden size in rows:
    /// the 0.6B model's 1,024 rows x 256 tokens make 64 workgroups for an
    /// H200's 132 cores) gain most: 91.7 -> 55.7 µs and 131.3 -> 76.6 per
    /// 256-token batch; a 512-token prefill 16,050 -> 19,000-19,500 tok/s
    /// (0.6B), 2,730 -> 3,270 (4B; BENCHMARKS.md 2026-12-01).
    pub narrow: bool,
}

/// The workgroup and register tiles offered (rows x tokens, rows x tokens
/// per invocation), each with and without prefetch and swizzle.
const SHAPES: [[u32; 4]; 6] =
    [[64, 64, 4, 4], [64, 64, 8, 4], [64, 64, 4, 8], [64, 64, 8, 8], [128, 64, 8, 4], [128, 64, 8, 8]];

impl MatmulTile {
    /// The tiling before register tiles grew: 64 x 64 (SwiGLU 64 x 32),
    /// 4 x 4 per invocation, no prefetch, no swizzle; the grid the MSL twin
    /// and `int8_matmul_coop` take.
    pub const BASE: MatmulTile = MatmulTile {
        rows: MATMUL_ROWS_PER_WG,
        tokens: MATMUL_TOKENS_PER_WG,
        inv_rows: 4,
        inv_tokens: 4,
        prefetch: false,
        swizzle: false,
        narrow: false,
    };

    /// The tiling used unless [`MATMUL_TILE_ENV`] names another: the base
    /// tile (4 rows x 4 tokens per invocation), prefetching, swizzled,
    /// narrow: the fastest measured on an H200 (512-token prefill of the
    /// 0.6B shape 19,000-19,500 tok/s against 16,050 without narrow tiles;
    /// every larger register tile was slower, 8 x 8 down to 7,400 against
    /// 10,700 before the shader-checks change: BENCHMARKS.md 2026-12-01).
    pub const DEFAULT: MatmulTile =
        MatmulTile { prefetch: true, swizzle: true, narrow: true, ..MatmulTile::BASE };

    /// Every tiling offered, by name: `RxT-rxt`, a workgroup tile of R rows
    /// x T tokens (SwiGLU T / 2) in register tiles of r rows x t tokens,
    /// then `-pf` for prefetching, `-sw` for swizzled staging and `-n` for
    /// narrow tiles (R / 2 x T / 2, SwiGLU too; offered with prefetching
    /// and swizzled staging).
    pub fn all() -> Vec<(String, MatmulTile)> {
        let mut all = Vec::new();
        for narrow in [false, true] {
            for [rows, tokens, inv_rows, inv_tokens] in SHAPES {
                for (prefetch, swizzle) in [(false, false), (true, false), (false, true), (true, true)] {
                    if narrow && !(prefetch && swizzle) {
                        continue;
                    }
                    let tile = MatmulTile { rows, tokens, inv_rows, inv_tokens, prefetch, swizzle, narrow };
                    all.push((tile.name(), tile));
                }
            }
        }
        all
    }

    /// The tiling named `value` ([`Self::all`]); anything else is
    /// `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        let all = Self::all();
        crate::settings::parse_choice(what, value, &Self::choices(&all))
    }

    /// The tiling [`MATMUL_TILE_ENV`] names: `None` when it is unset,
    /// `invalid_argument` when it names none.
    pub fn from_env() -> Result<Option<Self>> {
        let all = Self::all();
        crate::settings::env_choice(MATMUL_TILE_ENV, &Self::choices(&all))
    }

    /// `all` as the settings' choices.
    fn choices(all: &[(String, MatmulTile)]) -> Vec<(&str, MatmulTile)> {
        all.iter().map(|(name, tile)| (name.as_str(), *tile)).collect()
    }

    /// This tiling's name (see [`Self::all`]).
    pub fn name(&self) -> String {
        let MatmulTile { rows, tokens, inv_rows, inv_tokens, prefetch, swizzle, narrow } = *self;
        let pf = if prefetch { "-pf" } else { "" };
        let sw = if swizzle { "-sw" } else { "" };
        let n = if narrow { "-n" } else { "" };
        format!("{rows}x{tokens}-{inv_rows}x{inv_tokens}{pf}{sw}{n}")
    }

    /// Rows of one tile (of any variant).
    pub const fn rows_for(&self) -> u32 {
        if self.narrow {
            self.rows / 2
        } else {
            self.rows
        }
    }

    /// Tokens of one tile of `variant` (SwiGLU's tile is half as many
    /// tokens as the others' unless narrow, where both are half).
    pub const fn tokens_for(&self, variant: MatvecVariant) -> u32 {
        if variant.swiglu || self.narrow {
            self.tokens / 2
        } else {
            self.tokens
        }
    }

    /// Invocations of a tile of `rows` rows x `tokens` tokens.
    pub const fn workgroup_size(&self, rows: u32, tokens: u32) -> u32 {
        (rows / self.inv_rows) * (tokens / self.inv_tokens)
    }
}

/// Whether a workgroup tile of `rows` x `tokens` in register tiles of
/// `inv_rows` x `inv_tokens` (4 or 8 each: the kernel's named
/// accumulators) has at most 256 invocations, tiles of tokens that divide
/// the activation buffers, and quads in whole groups of 8 (the swizzle).
const fn fits(rows: u32, tokens: u32, inv_rows: u32, inv_tokens: u32) -> bool {
    matches!(inv_rows, 4 | 8)
        && matches!(inv_tokens, 4 | 8)
        && rows.is_multiple_of(inv_rows)
        && tokens.is_multiple_of(inv_tokens)
        && MATMUL_TOKENS_PER_WG.is_multiple_of(tokens)
        && (rows / inv_rows) * (tokens / inv_tokens) <= 256
        && rows.is_multiple_of(32)
        && tokens.is_multiple_of(32)
}

impl Default for MatmulTile {
    fn default() -> Self {
        Self::DEFAULT
    }
}

const _: () = {
    let mut n = 0;
    while n < SHAPES.len() {
        let [rows, tokens, inv_rows, inv_tokens] = SHAPES[n];
        assert!(fits(rows, tokens, inv_rows, inv_tokens) && fits(rows, tokens / 2, inv_rows, inv_tokens));
        assert!(fits(rows / 2, tokens / 2, inv_rows, inv_tokens));
        assert!(tokens / 2 >= PREFILL_TOKENS_PER_WG);
        n += 1;
    }
};

/// The MSL twin of `int8_matmul` (kernels/msl/int8_matmul.metal).
pub const MATMUL_MSL: &str = include_str!("../../kernels/msl/int8_matmul.metal");

/// Threadgroup size of the MSL twin: four 32-lane simdgroups, each
/// multiplying a quarter of the tile on SIMD-group matrices (the grid is
/// the WGSL kernel's).
pub const MATMUL_MSL_WG: u32 = 128;

/// The cooperative-matrix program (`int8_matmul_coop`): the product over
/// operands staged as f16 by [`F16_STAGE_WGSL`].
pub const MATMUL_COOP_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop.wgsl");
/// `int8_matmul_coop`'s product without cooperative matrices, for tests on
/// adapters that have none ([`MatmulConstants::emulated`]).
pub const MATMUL_COOP_EMULATED_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop_emulated.wgsl");
/// What both cooperative-matrix products share: the tile in workgroup
/// memory and its epilogue.
pub(crate) const MATMUL_COOP_TILE_WGSL: &str = include_str!("../../kernels/wgsl/int8_matmul_coop_tile.wgsl");
/// The staging program of `int8_matmul_coop`: a launch's weights and its
/// batch's inputs as f16 in 16 x 16 blocks, in one launch.
pub const F16_STAGE_WGSL: &str = include_str!("../../kernels/wgsl/f16_stage.wgsl");
/// What both WGSL prompt-batch programs share after `int8_common.wgsl`.
const MATMUL_COMMON: &str = include_str!("../../kernels/wgsl/int8_matmul_common.wgsl");
/// The subgroup size `int8_matmul_coop` is written for (its two subgroups
/// each take 32 of a tile's tokens).
pub const MATMUL_COOP_SUB: u32 = crate::gpu::COOP_SUBGROUP_SIZE;
/// Rows and tokens of one `int8_matmul_coop` tile (its grid's rows and
/// tokens per workgroup): every variant, SwiGLU too.
pub const MATMUL_COOP_TILE: u32 = 64;
/// Workgroup size of `int8_matmul_coop` per slice of k
/// ([`COOP_KSPLITS`]): two subgroups of 64 rows x 32 tokens each (4 x 2
/// accumulators of 16 x 16).
pub const MATMUL_COOP_WG: u32 = 2 * MATMUL_COOP_SUB;

/// The slices of k `int8_matmul_coop` is built for ([`coop_ksplit`]):
/// each slice in its own pair of subgroups, the slices' sums added in
/// workgroup memory after the loop. They divide every row's 16-value
/// blocks (rows are whole quant groups of 4 blocks).
pub const COOP_KSPLITS: [u32; 3] = [1, 2, 4];
const _: () = assert!((QUANT_GROUP / 16).is_multiple_of(COOP_KSPLITS[2] as usize));

/// Environment variable that fixes every cooperative-matrix product's
/// slices of k (one of [`COOP_KSPLITS`], for benchmarks) instead of
/// [`coop_ksplit`]'s choice.
pub const COOP_KSPLIT_ENV: &str = "QWEN3_WGPU_COOP_KSPLIT";

/// The values [`COOP_KSPLIT_ENV`] takes: [`COOP_KSPLITS`].
const COOP_KSPLIT_CHOICES: [(&str, u32); 3] = [("1", 1), ("2", 2), ("4", 4)];
const _: () = assert!(
    COOP_KSPLIT_CHOICES[0].1 == COOP_KSPLITS[0]
        && COOP_KSPLIT_CHOICES[1].1 == COOP_KSPLITS[1]
        && COOP_KSPLIT_CHOICES[2].1 == COOP_KSPLITS[2]
);

/// The value [`COOP_KSPLIT_ENV`] fixes: `None` when unset,
/// `invalid_argument` naming the allowed values otherwise.
pub fn coop_ksplit_from_env() -> Result<Option<u32>> {
    crate::settings::env_choice(COOP_KSPLIT_ENV, &COOP_KSPLIT_CHOICES)
}

/// The fewest k slices' workgroups (tiles x slices) a cooperative-matrix
/// product is given, two per core of an H200 (132).
const COOP_MIN_SLICES: u32 = 256;
/// Rows of at least this many 16-value blocks (k >= 2,048) take two
/// slices or more: each subgroup's loop waits on its loads in turn, so a
/// long k is a long chain whatever the occupancy.
const COOP_LONG_K_BLOCKS: u32 = 128;

/// The slices of k of a cooperative-matrix product of `rows` rows x
/// `tokens` tokens over rows of `k_words` words: the fewest that give the
/// launch 256 workgroups (`COOP_MIN_SLICES`), and two for a long k. On an H200
/// (256-token batches, µs per launch, BENCHMARKS.md 2026-12-02): the 0.6B
/// model's o_proj and down (1,024 rows, 64 tiles) 74.5 and 84.2 with one
/// slice, 40.1 and 44.3 with four; its gate/up (384 tiles, k 1,024) 58.7
/// with one, 63.8 with four; the 4B model's gate/up (k 2,560) 437 / 349 /
/// 398 with 1 / 2 / 4.
pub fn coop_ksplit(rows: u32, k_words: u32, tokens: u32) -> u32 {
    let tiles = rows.div_ceil(MATMUL_COOP_TILE) * tokens.div_ceil(MATMUL_COOP_TILE);
    let occupancy =
        COOP_KSPLITS.into_iter().find(|k| tiles * k >= COOP_MIN_SLICES).unwrap_or(COOP_KSPLITS[2]);
    let long = if k_words / 4 >= COOP_LONG_K_BLOCKS { 2 } else { 1 };
    occupancy.max(long)
}
/// Workgroup size of `f16_stage`.
pub const F16_STAGE_WG: u32 = 256;
const _: () = assert!(
    MATMUL_COOP_TILE == MATMUL_TOKENS_PER_WG
        && MATMUL_COOP_TILE == 2 * MATMUL_COOP_SUB
        && MATMUL_SWIGLU_TOKENS_PER_WG.is_multiple_of(16)
);

const _: () = assert!(
    MATMUL_TOKENS_PER_WG.is_multiple_of(MATMUL_SWIGLU_TOKENS_PER_WG)
        && MATMUL_SWIGLU_TOKENS_PER_WG.is_multiple_of(16)
        && MATMUL_SWIGLU_TOKENS_PER_WG.is_multiple_of(PREFILL_TOKENS_PER_WG)
);
// int8_matmul's K chunks of 32 values divide the quant group.
const _: () = assert!(QUANT_GROUP.is_multiple_of(32));

/// The fewest rows a launch runs on cooperative matrices (fewer run the
/// f32 program): every launch, since the products take slices of k
/// ([`coop_ksplit`]). The 0.6B model's o_proj and down (1,024 rows, 16 x 4
/// tiles at 256 tokens) took 75 and 84 µs in one slice against 56 and 77
/// for the f32 program's narrow tiles, and take 40 and 44 in four; a
/// 512-token prefill of the 0.6B shape 25,045-25,162 -> 28,635-29,407
/// tok/s on an H200 (BENCHMARKS.md 2026-12-02).
pub const COOP_MIN_ROWS: u32 = 0;

/// Environment variable that overrides [`COOP_MIN_ROWS`] (for benchmarks):
/// one of the values [`COOP_MIN_ROWS_CHOICES`] names.
pub const COOP_MIN_ROWS_ENV: &str = "QWEN3_WGPU_COOP_MIN_ROWS";

/// The values [`COOP_MIN_ROWS_ENV`] takes.
pub const COOP_MIN_ROWS_CHOICES: [(&str, u32); 5] =
    [("0", 0), ("1024", 1024), ("2048", 2048), ("4096", 4096), ("8192", 8192)];

/// [`COOP_MIN_ROWS_ENV`]'s value: `None` when unset, `invalid_argument`
/// naming the allowed values otherwise.
pub fn coop_min_rows_from_env() -> Result<Option<u32>> {
    crate::settings::env_choice(COOP_MIN_ROWS_ENV, &COOP_MIN_ROWS_CHOICES)
}

/// Bytes of `int8_matmul_coop`'s staged weights for a launch over `rows`
/// rows of `k_words` words (rows rounded up to a tile, 2 bytes a value).
pub fn staged_weight_bytes(rows: usize, k_words: usize) -> u64 {
    (rows.next_multiple_of(MATMUL_COOP_TILE as usize) * k_words * 4 * 2) as u64
}

/// Bytes of `int8_matmul_coop`'s staged inputs for a batch of `tokens`
/// tokens (rounded up to a tile) of `k_words` words.
pub fn staged_input_bytes(tokens: usize, k_words: usize) -> u64 {
    (tokens.next_multiple_of(MATMUL_COOP_TILE as usize) * k_words * 4 * 2) as u64
}

/// The grid of the staging of a launch over `rows` rows of `k_words`
/// words and a batch of `tokens` tokens: one invocation per 16 values of
/// the rows rounded up to a tile, then one workgroup per token of the
/// tiles the product reads.
pub fn stage_grid(rows: u32, k_words: u32, tokens: u32) -> [u32; 3] {
    let quads = rows.next_multiple_of(MATMUL_COOP_TILE) * (k_words / 4);
    super::grid(quads.div_ceil(F16_STAGE_WG) + tokens.next_multiple_of(MATMUL_COOP_TILE))
}

/// Bytes of the staging range of a launch over `rows` rows of `k_words`
/// words for batches of up to `tokens` tokens: its staged weights, then
/// the inputs (at [`staged_weight_bytes`], a multiple of 256 bytes: the
/// product binds the two parts as ranges).
pub fn staged_bytes(rows: usize, k_words: usize, tokens: usize) -> u64 {
    staged_weight_bytes(rows, k_words) + staged_input_bytes(tokens, k_words)
}

/// The WGSL of `f16_stage` (normed inputs or not, by its `NORM` override:
/// see [`stage_constants`]).
pub fn stage_source() -> String {
    let decls = wgsl_decls(&MatvecParams::DEF, &format!("{INT8_MATH}{F16_STAGE_WGSL}"));
    format!(
        "const MM_ROWS: u32 = {MATMUL_COOP_TILE}u;\nconst GROUP_WORDS: u32 = {}u;\n{decls}\n{INT8_MATH}\n{F16_STAGE_WGSL}",
        QUANT_GROUP / 4
    )
}

/// The override constants of `f16_stage`: its inputs normed (`norm`) or
/// not.
pub fn stage_constants(norm: bool) -> Vec<(&'static str, f64)> {
    vec![("NORM", if norm { 1.0 } else { 0.0 })]
}

/// Tokens of one tile of `variant`'s `int8_matmul` in the base tiling.
pub fn tokens_per_wg(variant: MatvecVariant) -> u32 {
    if variant.swiglu {
        MATMUL_SWIGLU_TOKENS_PER_WG
    } else {
        MATMUL_TOKENS_PER_WG
    }
}

/// The override constants of an `int8_matmul` pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatmulConstants {
    pub variant: MatvecVariant,
    /// The cooperative-matrix program (`int8_matmul_coop`) rather than
    /// the f32 one.
    pub coop: bool,
    /// With `coop`: its emulation without cooperative matrices (the same
    /// staged operands and epilogue, a scalar product), for tests where
    /// the adapter has none.
    pub emulated: bool,
    /// The f32 program's tiling (`int8_matmul_coop` ignores it).
    pub tile: MatmulTile,
    /// `int8_matmul_coop`'s slices of k (one of [`COOP_KSPLITS`]; the f32
    /// program ignores it).
    pub coop_ksplit: u32,
}

impl MatmulConstants {
    /// Tokens of one tile (in the source's preamble, not an override): the
    /// grid's tokens per workgroup.
    pub fn tokens(&self) -> u32 {
        if self.coop {
            MATMUL_COOP_TILE
        } else {
            self.tile.tokens_for(self.variant)
        }
    }

    /// Rows of one tile: the grid's rows per workgroup.
    pub fn rows(&self) -> u32 {
        if self.coop {
            MATMUL_COOP_TILE
        } else {
            self.tile.rows_for()
        }
    }

    /// Workgroup size of the WGSL program.
    pub fn workgroup_size(&self) -> u32 {
        if self.coop {
            MATMUL_COOP_WG * self.coop_ksplit
        } else {
            self.tile.workgroup_size(self.rows(), self.tokens())
        }
    }

    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("WG", self.workgroup_size() as f64),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
        ]
    }

    /// The MSL twin's constants (prefixed `Q3W_` in its preamble): its
    /// threadgroup size, the tile, the quant group's words and the
    /// epilogue flags.
    pub fn msl_constants(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("WG", MATMUL_MSL_WG as f64),
            // The base tile whatever the tiling: the twin is written for it.
            ("MM_ROWS", MATMUL_ROWS_PER_WG as f64),
            ("MM_TOKENS", tokens_per_wg(self.variant) as f64),
            ("GROUP_WORDS", (QUANT_GROUP / 4) as f64),
            ("ACCUMULATE", flag(self.variant.accumulate)),
            ("NORM", flag(self.variant.norm)),
            ("SWIGLU", flag(self.variant.swiglu)),
        ]
    }

    /// The MSL twin's full source, as Metal gets it: the preamble of
    /// [`Self::msl_constants`], the generated declarations (the params),
    /// then kernels/msl/int8_matmul.metal.
    pub fn msl_source(&self) -> String {
        format!(
            "{}{}{MATMUL_MSL}",
            preamble_of(&self.msl_constants()),
            msl_decls(&MatvecParams::DEF, MATMUL_MSL)
        )
    }

    /// The WGSL: (for the cooperative-matrix program, its `enable`s), the
    /// tile sizes, register tiling and quant group as `const`s, the generated declarations
    /// (the params), what the matvec shares, the stores, then the kernel.
    pub fn source(&self) -> String {
        // The cooperative-matrix program binds the layout with other types
        // (its staged f16 operands): the arithmetic without the bindings.
        let (enables, common, tile, body) = match (self.coop, self.emulated) {
            // The slices' reduction branches on the subgroup: uniform in
            // each, all cooperative matrices need, which naga's analysis
            // cannot see (it reports it under this rule).
            (true, false) => (
                "enable f16;\nenable wgpu_cooperative_matrix;\ndiagnostic(off, derivative_uniformity);\n",
                INT8_MATH,
                MATMUL_COOP_TILE_WGSL,
                MATMUL_COOP_WGSL,
            ),
            (true, true) => ("enable f16;\n", INT8_MATH, MATMUL_COOP_TILE_WGSL, MATMUL_COOP_EMULATED_WGSL),
            (false, _) => ("", INT8_COMMON, "", include_str!("../../kernels/wgsl/int8_matmul.wgsl")),
        };
        let decls = wgsl_decls(&MatvecParams::DEF, &format!("{common}{MATMUL_COMMON}{tile}{body}"));
        let MatmulTile { inv_rows, inv_tokens, prefetch, swizzle, .. } = self.tile;
        let ksplit = self.coop_ksplit;
        format!(
            "{enables}const MM_ROWS: u32 = {}u;\nconst MM_TOKENS: u32 = {}u;\n\
             const COOP_KSPLIT: u32 = {ksplit}u;\n\
             const INV_ROWS: u32 = {inv_rows}u;\nconst INV_TOKENS: u32 = {inv_tokens}u;\n\
             const PREFETCH: bool = {prefetch};\nconst SWIZZLE: bool = {swizzle};\nconst GROUP_WORDS: u32 = {}u;\noverride WG: u32 = {}u;\n\
             {decls}\n{common}\n{MATMUL_COMMON}\n{tile}\n{}",
            self.rows(),
            self.tokens(),
            QUANT_GROUP / 4,
            self.workgroup_size(),
            body
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernel;

    /// Every tiling parses by its name (any case) and names itself, the
    /// base and default ones among them; an unknown name is
    /// `invalid_argument` naming the variable and every allowed value.
    #[test]
    fn tilings_parse_by_name_and_an_unknown_one_is_a_named_error() {
        let all = MatmulTile::all();
        assert_eq!(all.len(), 30);
        for (name, tile) in &all {
            assert_eq!(MatmulTile::from_name(MATMUL_TILE_ENV, &name.to_uppercase()).unwrap(), *tile);
            assert_eq!(&tile.name(), name);
        }
        assert!(
            all.iter().any(|(_, t)| *t == MatmulTile::BASE)
                && all.iter().any(|(_, t)| *t == MatmulTile::DEFAULT)
        );
        assert_eq!(MatmulTile::BASE.name(), "64x64-4x4");
        assert_eq!(MatmulTile::default().name(), "64x64-4x4-pf-sw-n");
        let e = MatmulTile::from_name(MATMUL_TILE_ENV, "16x16").unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        let msg = e.to_string();
        assert!(
            msg.contains(MATMUL_TILE_ENV) && msg.contains("64x64-4x4, 64x64-4x4-pf, 64x64-4x4-sw"),
            "{msg}"
        );
    }

    /// Each tiling's workgroup size is the one its source declares, and its
    /// register tiles cover its tile, which is the grid's (SwiGLU: half the
    /// tokens); the cooperative-matrix program takes its own 64 x 64 tile
    /// whatever the tiling.
    #[test]
    fn each_tiling_sizes_its_workgroup_to_cover_the_tile() {
        for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecNormSwiglu, Kernel::Int8MatvecAccumulate] {
            let base = kernel.matmul_constants().unwrap();
            for (name, tile) in MatmulTile::all() {
                let c = MatmulConstants { tile, ..base };
                let wg = c.workgroup_size();
                let halves = |n: u32, by: bool| if by { n / 2 } else { n };
                let want_rows = halves(tile.rows, tile.narrow);
                let want_tokens = halves(tile.tokens, tile.narrow || kernel == Kernel::Int8MatvecNormSwiglu);
                assert_eq!((c.rows(), c.tokens()), (want_rows, want_tokens), "{name}");
                assert_eq!(wg * tile.inv_rows * tile.inv_tokens, c.rows() * c.tokens(), "{name}");
                let source = c.source();
                assert!(source.contains(&format!("override WG: u32 = {wg}u;")), "{name}");
                assert!(source.contains(&format!("const MM_ROWS: u32 = {want_rows}u;")), "{name}");
                assert!(c.render().contains(&("WG", wg as f64)), "{name}");
                let coop = MatmulConstants { coop: true, ..c };
                assert_eq!((coop.rows(), coop.tokens()), (MATMUL_COOP_TILE, MATMUL_COOP_TILE));
                assert!(coop.source().contains(&format!("const MM_ROWS: u32 = {MATMUL_COOP_TILE}u;")));
            }
        }
    }

    /// The cooperative-matrix program of each tiled variant and both roles
    /// of its staging program go through the naga path a Vulkan device
    /// takes (parse, validate, overrides, SPIR-V) on every machine, also
    /// where no adapter offers cooperative matrices (CI's lavapipe). naga
    /// 30's SPIR-V writer panics on a `coopStore` whose arguments are not
    /// already emitted: this catches a kernel edit that brings that back.
    #[test]
    fn the_cooperative_matrix_programs_compile_to_spirv() {
        let tiled: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.prefill_tiled()).collect();
        assert_eq!(tiled.len(), 3, "qkv, gate/up and the accumulating products run tiled");
        let spirv = |what: &str, source: &str, constants: Vec<(&str, f64)>, entry: &str| {
            let module = naga::front::wgsl::parse_str(source)
                .unwrap_or_else(|e| panic!("{}", e.emit_to_string(source)));
            let flags = naga::valid::ValidationFlags::all();
            let info = naga::valid::Validator::new(flags, naga::valid::Capabilities::all())
                .validate(&module)
                .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(source)));
            let constants: naga::back::PipelineConstants =
                constants.into_iter().map(|(name, v)| (name.to_string(), v)).collect();
            let (module, info) =
                naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            let pipeline = naga::back::spv::PipelineOptions {
                shader_stage: naga::ShaderStage::Compute,
                entry_point: entry.into(),
            };
            let options = naga::back::spv::Options::default();
            let words = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(words.len() > 100, "{what}: {} SPIR-V words", words.len());
        };
        for kernel in tiled {
            let c = MatmulConstants { coop: true, ..kernel.matmul_constants().unwrap() };
            spirv(&format!("{kernel:?}"), &c.source(), c.render(), "int8_matmul");
            assert_eq!(c.workgroup_size(), MATMUL_COOP_WG);
            for coop_ksplit in COOP_KSPLITS {
                let c = MatmulConstants { coop_ksplit, ..c };
                assert_eq!(c.workgroup_size(), MATMUL_COOP_WG * coop_ksplit);
                spirv(&format!("{kernel:?} k/{coop_ksplit}"), &c.source(), c.render(), "int8_matmul");
            }
            let e = MatmulConstants { emulated: true, ..c };
            spirv(&format!("{kernel:?} emulated"), &e.source(), e.render(), "int8_matmul");
        }
        for norm in [false, true] {
            spirv("f16_stage", &stage_source(), stage_constants(norm), "f16_stage");
        }
    }

    /// The slices of k follow the launch's shape: four for the 0.6B
    /// model's o_proj and down (64 tiles of a 256-token batch), one for its
    /// qkv and gate/up (256 and 384 tiles, k 1,024), two for every product
    /// of k >= 2,048 with tiles enough (the 1.7B-8B models), more for a
    /// short batch; every choice is a slicing the pipeline set builds, and
    /// the variable that fixes one takes only those.
    #[test]
    fn the_slices_of_k_follow_the_launch_shape() {
        let words = |k: u32| k / 4;
        assert_eq!(coop_ksplit(1024, words(2048), 256), 4);
        assert_eq!(coop_ksplit(1024, words(3072), 256), 4);
        assert_eq!(coop_ksplit(4096, words(1024), 256), 1);
        assert_eq!(coop_ksplit(6144, words(1024), 256), 1);
        assert_eq!(coop_ksplit(4096, words(1024), 64), 4);
        assert_eq!(coop_ksplit(19456, words(2560), 256), 2);
        assert_eq!(coop_ksplit(2560, words(9728), 256), 2);
        for rows in [64, 1000, 1024, 4096, 30000] {
            for k in [64, 1024, 2048, 9728] {
                for tokens in [1, 64, 256] {
                    assert!(COOP_KSPLITS.contains(&coop_ksplit(rows, words(k), tokens)));
                }
            }
        }
        let e = crate::settings::parse_choice(COOP_KSPLIT_ENV, "3", &COOP_KSPLIT_CHOICES).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
    }

    /// Every value of the cooperative-matrix row threshold parses; another
    /// is `invalid_argument` naming the variable and the allowed values.
    #[test]
    fn the_coop_row_threshold_takes_named_values_only() {
        for (name, rows) in COOP_MIN_ROWS_CHOICES {
            assert_eq!(
                crate::settings::parse_choice(COOP_MIN_ROWS_ENV, name, &COOP_MIN_ROWS_CHOICES).unwrap(),
                rows
            );
        }
        assert!(COOP_MIN_ROWS_CHOICES.iter().any(|(_, rows)| *rows == COOP_MIN_ROWS));
        let e = crate::settings::parse_choice(COOP_MIN_ROWS_ENV, "100", &COOP_MIN_ROWS_CHOICES).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        assert!(e.to_string().contains(COOP_MIN_ROWS_ENV) && e.to_string().contains("2048"), "{e}");
    }
}
