//! The attention family: `attention_partial` (GQA attention split over
//! chunks of positions; variants for a prompt batch, a decode step with
//! `qk_norm_rope`'s work folded in, and a decode step whose context fits one
//! chunk and so writes the output itself), its prompt-batch pipeline
//! `attention_prefill`, and `attention_reduce`, which combines the chunks.

use super::abi::{gpu_struct, ATTENTION_KEY_LANES, MAX_HEAD_DIM};
use super::matmul::MATMUL_TOKENS_PER_WG;
use super::{Bind, Kernel, WG};

gpu_struct! {
    /// The uniform of `qk_norm_rope` and the `attention_partial` variants.
    "Params" pub struct HeadParams {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub head_dim: u32,
        pub capacity: u32,
        /// rms_norm_eps of the q/k norms.
        pub eps: f32,
        /// qk_norm_rope: elements between consecutive tokens' qkv rows.
        pub qkv_stride: u32,
        /// The softmax scale, 1/sqrt(head_dim).
        pub scale: f32,
        /// attention_partial: query heads a workgroup serves from position
        /// `pack_from` on (2: [`heads_per_workgroup`]; 1 or 0: one).
        pub pack: u32,
        /// attention_partial: the first position whose step packs heads.
        pub pack_from: u32,
    }
}

/// The query heads an `attention_partial` workgroup serves once packing
/// starts (`HeadParams::pack`): two where the heads of a KV head come in
/// pairs, so each K and V row is loaded once for both; the kernel serves at
/// most two (its registers hold two heads' sums).
pub fn heads_per_workgroup(n_heads: usize, n_kv_heads: usize) -> u32 {
    let group = n_heads / n_kv_heads.max(1);
    if group.is_multiple_of(2) {
        2
    } else {
        1
    }
}

/// The first position from which decode attention packs two heads a
/// workgroup (`HeadParams::pack_from`): past it, a context has chunks enough
/// to fill the GPU with half the workgroups, and each saves a second read
/// and decoding of its K and V rows. Packing never changes a result's bits,
/// only which workgroup computes it.
pub const ATTENTION_PACK_FROM: u32 = 8192;

/// `QWEN3_WGPU_ATTENTION_PACK_FROM`: the position from which decode
/// attention packs heads, for measuring ([`ATTENTION_PACK_FROM`] when unset).
pub const ATTENTION_PACK_FROM_ENV: &str = "QWEN3_WGPU_ATTENTION_PACK_FROM";

const PACK_FROM_CHOICES: [(&str, u32); 8] = [
    ("256", 256),
    ("1024", 1024),
    ("2048", 2048),
    ("4096", 4096),
    ("8192", 8192),
    ("16384", 16384),
    ("32768", 32768),
    ("never", u32::MAX),
];

/// The packing start [`ATTENTION_PACK_FROM_ENV`] names, if set.
pub fn attention_pack_from_env() -> crate::error::Result<Option<u32>> {
    crate::settings::env_choice(ATTENTION_PACK_FROM_ENV, &PACK_FROM_CHOICES)
}

gpu_struct! {
    /// The uniform of `attention_reduce`.
    "Params" pub struct ReduceParams {
        pub head_dim: u32,
        /// Chunks of positions per head and token.
        pub n_chunks: u32,
        /// Elements between consecutive tokens' outputs.
        pub out_stride: u32,
    }
}

/// Binding order of the `attention_partial` variants (and
/// `attention_prefill`): params, step, q (or qkv), k_cache, v_cache,
/// part_ml, part_acc (or the output), qk_norm, rope: 8 storage buffers at
/// most, the default limit (a host application's device).
pub const PARTIAL_BINDINGS: &[Bind] = &[
    Bind::Uniform,
    Bind::Read,
    Bind::Read,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::ReadWrite,
    Bind::Read,
    Bind::Read,
];

/// Binding order of `attention_reduce`: params, part_ml, part_acc, out.
pub const REDUCE_BINDINGS: &[Bind] = &[Bind::Uniform, Bind::Read, Bind::Read, Bind::ReadWrite];

/// The grid of an `attention_partial` launch: one workgroup per query head
/// and chunk of [`ATTENTION_CHUNK`] positions (`z`: tokens of a batch).
pub fn partial_grid(n_heads: u32, chunks: u32) -> [u32; 3] {
    [n_heads, chunks, 1]
}

/// Workgroup size of `attention_reduce` (and its MSL twin): invocations
/// own a quad of output dims and a slice of the chunks, 8 slices at
/// head_dim 128, so a context of 64 chunks is read in one round trip.
pub const REDUCE_WG: u32 = 256;
const _: () = assert!(REDUCE_WG.is_power_of_two());
// Every quad of output dims has a slice of chunks (WGSL: WG / (head_dim / 4)
// slices; none would leave the output unwritten).
const _: () = assert!(MAX_HEAD_DIM / 4 <= REDUCE_WG as usize);

/// The grid of an `attention_reduce` launch: one workgroup per query head
/// (`z`: tokens of a batch).
pub fn reduce_grid(n_heads: u32) -> [u32; 3] {
    super::grid(n_heads)
}

/// What the attention kernels share (bindings, f16 unpacking, the int8
/// parts of an int8 cache's integer dot products, the int8 cache's layout),
/// prepended to `attention_partial` and `attention_prefill`.
pub(super) const ATTENTION_COMMON: &str = concat!(
    include_str!("../../kernels/wgsl/attention_common.wgsl"),
    include_str!("../../kernels/wgsl/int8_parts.wgsl"),
    include_str!("../../kernels/wgsl/kv_cache.wgsl")
);

/// Cached positions per `attention_partial` workgroup (one per invocation).
pub const ATTENTION_CHUNK: u32 = WG;
/// head_dim must be a multiple of this: attention_partial reads a K row as
/// `vec4<u32>`s (8 f16 values each).
pub const HEAD_DIM_MULTIPLE: usize = 8;
// attention_partial's last step gives each output dim an invocation.
const _: () = assert!(MAX_HEAD_DIM <= WG as usize);
// attention_partial's scores: WG / ATTENTION_KEY_LANES K rows per pass, and
// each position's partial dots fit its 8 floats of workgroup memory.
const _: () = assert!(WG.is_multiple_of(ATTENTION_KEY_LANES) && ATTENTION_KEY_LANES <= 8);
// An int8 row's quads (16 values each) are at most two a score lane
// (attention_partial.wgsl's key_dots_int8).
const _: () = assert!(MAX_HEAD_DIM / 16 <= 2 * ATTENTION_KEY_LANES as usize);
// Its invocations load eight rows each: the chunk in one pass.
const _: () = assert!(8 * (WG / ATTENTION_KEY_LANES) == ATTENTION_CHUNK);

/// Prompt tokens one `attention_prefill` workgroup serves: each K and V
/// value it stages in workgroup memory serves that many queries. Its
/// invocations own 4 tokens (a vec4) each, in 8 groups.
pub const PREFILL_ATTENTION_TOKENS: u32 = 32;
/// Spans of 32 positions in a chunk: each `attention_prefill` invocation
/// scores one position of every span.
const PREFILL_SPANS: u32 = ATTENTION_CHUNK / 32;
// attention_prefill's layout: 8 groups of 4 tokens x 32 lanes (one
// position per span each), its K slab and V span staged one quad per
// invocation. A last partial group computes tokens past the batch from the
// rows past it: the session's batch buffers hold whole tiles of the tiled
// matmul's tokens.
const _: () = assert!(WG == 256 && PREFILL_ATTENTION_TOKENS == 32 && MAX_HEAD_DIM <= 256);
const _: () = assert!(MATMUL_TOKENS_PER_WG.is_multiple_of(PREFILL_ATTENTION_TOKENS));

/// Which `attention_partial` variant (its override constants; see the
/// kernel's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionVariant {
    /// q read raw from the qkv output, normed and rotated here, and the new
    /// position's K/V written (a decode step).
    pub fused: bool,
    /// One chunk, the output written directly (no reduce).
    pub direct: bool,
}

impl AttentionVariant {
    pub const PROMPT: Self = AttentionVariant { fused: false, direct: false };
    pub const STEP: Self = AttentionVariant { fused: true, direct: false };
    pub const STEP_DIRECT: Self = AttentionVariant { fused: true, direct: true };
}

/// The override constants of an `attention_partial` pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionConstants {
    pub variant: AttentionVariant,
    /// `ROWS`: a batch of sessions' decode steps, row z in grid z, with the
    /// output's row stride (`OUT_STRIDE`, elements); `None`: one token or
    /// a prompt batch.
    pub rows_out_stride: Option<u32>,
    /// `PACKED`: two query heads a workgroup from `HeadParams::pack_from`
    /// on (the chunked step of long contexts).
    pub packed: bool,
}

impl AttentionConstants {
    /// As (WGSL name, value) pairs.
    pub fn render(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut c = vec![
            ("WG", WG as f64),
            ("FUSED", flag(self.variant.fused)),
            ("DIRECT", flag(self.variant.direct)),
        ];
        if let Some(stride) = self.rows_out_stride {
            c.extend([("ROWS", 1.0), ("OUT_STRIDE", stride as f64)]);
        }
        // Always named: the MSL twin reads it as a macro.
        c.push(("PACKED", flag(self.packed)));
        c
    }
}

/// The WGSL and override constants of `attention_prefill`, the
/// prompt-batch pipeline of [`Kernel::AttentionPartial`], on its
/// bind-group layout.
pub fn attention_prefill_source(subgroups: bool) -> (String, Vec<(&'static str, f64)>) {
    let k = Kernel::AttentionPartial;
    let body = write_out_loops(include_str!("../../kernels/wgsl/attention_prefill.wgsl"), PREFILL_SPANS);
    let src = format!(
        "const TOKENS: u32 = {PREFILL_ATTENTION_TOKENS}u;\nconst SPANS: u32 = {PREFILL_SPANS}u;\n{}",
        k.source_with(subgroups, &body)
    );
    (src, vec![("WG", k.workgroup_size() as f64)])
}

/// Prompt tokens one workgroup of the tile program of `attention_prefill`
/// serves (attention_prefill_tiles.wgsl: one 16-column tile of tokens).
pub const PREFILL_TILE_ATTENTION_TOKENS: u32 = 16;
/// head_dim must be a multiple of this for the tile program (its tiles
/// are 16 dims wide); other models run the f32 `attention_prefill`.
pub const PREFILL_TILE_HEAD_DIM_MULTIPLE: usize = 16;
/// Workgroup memory of the tile program (attention_prefill_tiles.wgsl's
/// arrays): its f16 q (then weights), the f32 scores (then acc) and the
/// partial tile's f16 rows: 32 KB, what Apple GPUs and lavapipe offer.
pub const PREFILL_TILE_ATTENTION_WORKGROUP_BYTES: u32 = PREFILL_TILE_ATTENTION_TOKENS * WG * 2
    + PREFILL_TILE_ATTENTION_TOKENS * WG * 4
    + 16 * MAX_HEAD_DIM as u32 * 2;
const _: () = assert!(PREFILL_TILE_ATTENTION_WORKGROUP_BYTES <= 32 * 1024);

/// Workgroup memory of the tile program ([`PREFILL_TILE_ATTENTION_WORKGROUP_BYTES`]),
/// or of its MSL twin (`msl`: its partial block is 8 positions, not 16).
pub fn prefill_tile_attention_workgroup_bytes(msl: bool) -> u32 {
    if msl {
        PREFILL_TILE_ATTENTION_WORKGROUP_BYTES - 8 * MAX_HEAD_DIM as u32 * 2
    } else {
        PREFILL_TILE_ATTENTION_WORKGROUP_BYTES
    }
}
// Its softmax gives each token 16 invocations; its subgroups are 32 lanes;
// the weights take q's place, and acc the scores'.
const _: () = assert!(WG == 16 * PREFILL_TILE_ATTENTION_TOKENS && WG.is_multiple_of(32));
const _: () = assert!(WG as usize == MAX_HEAD_DIM);
// The engine's batch buffers hold whole tiles of the tiled matmul's tokens.
const _: () = assert!(MATMUL_TOKENS_PER_WG.is_multiple_of(PREFILL_TILE_ATTENTION_TOKENS));

/// The WGSL of the tile program of `attention_prefill`
/// (attention_prefill_tiles.wgsl) on cooperative matrices, or
/// (`emulated`) with scalar sums in their place, on
/// [`Kernel::AttentionPartial`]'s bind-group layout.
pub fn attention_prefill_tiles_source(emulated: bool) -> String {
    let k = Kernel::AttentionPartial;
    let (enables, tiles) = if emulated {
        ("enable f16;\n", include_str!("../../kernels/wgsl/attention_prefill_coop_emulated.wgsl"))
    } else {
        // A subgroup's tiles branch on the subgroup: uniform in each, all
        // cooperative matrices need, which naga's analysis cannot see (it
        // reports it under this rule).
        (
            "enable f16;\nenable wgpu_cooperative_matrix;\ndiagnostic(off, derivative_uniformity);\n",
            include_str!("../../kernels/wgsl/attention_prefill_coop.wgsl"),
        )
    };
    let common = include_str!("../../kernels/wgsl/attention_prefill_tiles.wgsl");
    let body = format!("{common}\n{tiles}");
    let decls = super::abi::wgsl_decls(k.row().params, &body);
    format!(
        "{enables}const TOKENS: u32 = {PREFILL_TILE_ATTENTION_TOKENS}u;\noverride WG: u32 = {WG}u;\n{decls}\n{body}"
    )
}

/// The MSL twin of the tile program (kernels/msl/attention_prefill_tiles.metal:
/// 8x8 SIMD-group matrices, any head_dim the engine takes), as Metal gets it:
/// its preamble (WG, TOKENS), the generated declarations, then the file.
/// Entry point `attention_prefill_tiles`.
pub fn attention_prefill_tiles_msl_source() -> String {
    let body = include_str!("../../kernels/msl/attention_prefill_tiles.metal");
    let k = Kernel::AttentionPartial;
    let defines =
        super::msl::preamble_of(&[("WG", WG as f64), ("TOKENS", PREFILL_TILE_ATTENTION_TOKENS as f64)]);
    format!("{defines}{}{body}", super::abi::msl_decls(k.row().params, body))
}

/// `body` with each line `// for # in SPANS: code` written out as `code`
/// once per span, `#` standing for its index: attention_prefill's loops
/// over its per-span scores, which a compiler might keep as loops and so
/// index them at run time (in memory rather than registers).
fn write_out_loops(body: &str, spans: u32) -> String {
    let mut out = String::with_capacity(body.len() + 4096);
    for line in body.lines() {
        let code = line.trim_start();
        let indent = &line[..line.len() - code.len()];
        match code.strip_prefix("// for # in SPANS: ") {
            Some(code) => {
                for i in 0..spans {
                    out.push_str(&format!("{indent}{}\n", code.replace('#', &i.to_string())));
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `QWEN3_WGPU_ATTENTION_PACK_FROM` takes the listed positions and
    /// `never`; another value is `invalid_argument` naming the variable and
    /// the choices.
    #[test]
    fn the_packing_start_is_one_of_its_choices() {
        let parse = |v| crate::settings::parse_choice(ATTENTION_PACK_FROM_ENV, v, &PACK_FROM_CHOICES);
        assert_eq!(parse("8192").unwrap(), 8192);
        assert_eq!(parse("never").unwrap(), u32::MAX);
        let e = parse("300").unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        let msg = e.to_string();
        assert!(msg.contains(ATTENTION_PACK_FROM_ENV) && msg.contains("never"), "{msg}");
        assert!(PACK_FROM_CHOICES.iter().any(|(_, v)| *v == ATTENTION_PACK_FROM), "the default is a choice");
    }
}
