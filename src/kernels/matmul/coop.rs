//! The cooperative-matrix program's shape and costs: its tile and
//! workgroup, the slices of k a launch takes, the fewest rows it runs, and
//! the f16 staging of its operands.

use super::{F16_STAGE_WGSL, MATMUL_SWIGLU_TOKENS_PER_WG, MATMUL_TOKENS_PER_WG};
use crate::converted::{WeightFormat, QUANT_GROUP};
use crate::error::Result;
use crate::kernels::abi::{wgsl_decls, GpuStruct};
use crate::kernels::matvec::{MatvecParams, INT8_MATH};
use crate::kernels::PREFILL_TOKENS_PER_WG;

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
pub(super) const COOP_KSPLIT_CHOICES: [(&str, u32); 3] = [("1", 1), ("2", 2), ("4", 4)];
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
    crate::kernels::grid(quads.div_ceil(F16_STAGE_WG) + tokens.next_multiple_of(MATMUL_COOP_TILE))
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
/// not, its weights in `format`.
pub fn stage_constants(norm: bool, format: WeightFormat) -> Vec<(&'static str, f64)> {
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    vec![("NORM", flag(norm)), ("INT4", flag(format == WeightFormat::Int4))]
}
