//! The f32 program's tilings: the workgroup tile, each invocation's share
//! of it in registers, and the one chosen by name at start-up.

use super::{MATMUL_ROWS_PER_WG, MATMUL_TOKENS_PER_WG};
use crate::error::Result;
use crate::kernels::matvec::MatvecVariant;
use crate::kernels::PREFILL_TOKENS_PER_WG;

/// Environment variable that picks the tiling of the f32 `int8_matmul`
/// (workgroup tile, register tile, prefetch, swizzle) by name
/// ([`MatmulTile::all`]), for benchmarks.
pub const MATMUL_TILE_ENV: &str = "QWEN3_WGPU_MATMUL_TILE";

/// The f32 `int8_matmul`'s tile and how it is divided among invocations:
/// a workgroup computes `rows` rows x `tokens` tokens (SwiGLU: half the
/// tokens, see [`MATMUL_SWIGLU_TOKENS_PER_WG`](super::MATMUL_SWIGLU_TOKENS_PER_WG)), each invocation
/// `inv_rows` rows x `inv_tokens` tokens of it in registers, reading
/// `inv_rows / 4 + inv_tokens / 4` vec4s of workgroup memory per
/// `inv_rows * inv_tokens` multiply-adds. Every tiling computes each output
/// as the same sum in the same order (the results are bit for bit those of
/// [`MatmulTile::BASE`]); only the speed differs. `int8_matmul_coop` keeps
/// the base tile's grid ([`MatmulConstants::rows`](super::MatmulConstants::rows)), and the pipeline set
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
