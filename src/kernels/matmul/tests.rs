use super::coop::{
    coop_ksplit, stage_constants, stage_source, COOP_KSPLITS, COOP_KSPLIT_CHOICES, COOP_KSPLIT_ENV,
    COOP_MIN_ROWS, COOP_MIN_ROWS_CHOICES, COOP_MIN_ROWS_ENV, MATMUL_COOP_TILE, MATMUL_COOP_WG,
};
use super::tile::{MatmulTile, MATMUL_TILE_ENV};
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
        all.iter().any(|(_, t)| *t == MatmulTile::BASE) && all.iter().any(|(_, t)| *t == MatmulTile::DEFAULT)
    );
    assert_eq!(MatmulTile::BASE.name(), "64x64-4x4");
    assert_eq!(MatmulTile::default().name(), "64x64-4x4-pf-sw-n");
    let e = MatmulTile::from_name(MATMUL_TILE_ENV, "16x16").unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
    let msg = e.to_string();
    assert!(msg.contains(MATMUL_TILE_ENV) && msg.contains("64x64-4x4, 64x64-4x4-pf, 64x64-4x4-sw"), "{msg}");
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
/// already emitted: this catches a kernel edit that brings that back. The
/// same for each program specialised to its constants, as the engine
/// hands it to wgpu (`kernels::specialise`).
#[test]
fn the_cooperative_matrix_programs_compile_to_spirv() {
    let tiled: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.prefill_tiled()).collect();
    assert_eq!(tiled.len(), 3, "qkv, gate/up and the accumulating products run tiled");
    let spirv = |what: &str, source: &str, constants: Vec<(&str, f64)>, entry: &str| {
        let module =
            naga::front::wgsl::parse_str(source).unwrap_or_else(|e| panic!("{}", e.emit_to_string(source)));
        let flags = naga::valid::ValidationFlags::all();
        let info = naga::valid::Validator::new(flags, naga::valid::Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(source)));
        let values: naga::back::PipelineConstants =
            constants.iter().map(|&(name, v)| (name.to_string(), v)).collect();
        let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, None, &values)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let pipeline = naga::back::spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: entry.into(),
        };
        let options = naga::back::spv::Options::default();
        let words = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(words.len() > 100, "{what}: {} SPIR-V words", words.len());
        // The module the engine hands wgpu: the program specialised first.
        let specialised = crate::kernels::specialise(source, entry, &constants)
            .unwrap_or_else(|| panic!("{what}: naga could not specialise it"));
        let info = naga::valid::Validator::new(flags, naga::valid::Capabilities::all())
            .validate(&specialised)
            .unwrap_or_else(|e| panic!("{what} (specialised): {e}"));
        let words = naga::back::spv::write_vec(&specialised, &info, &options, Some(&pipeline))
            .unwrap_or_else(|e| panic!("{what} (specialised): {e}"));
        assert!(words.len() > 100, "{what} (specialised): {} SPIR-V words", words.len());
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
    // The prompt attention's tile program and its emulation.
    for emulated in [false, true] {
        let source = crate::kernels::attention::attention_prefill_tiles_source(emulated);
        let wg = crate::kernels::Constants::Workgroup(crate::kernels::WG).render();
        spirv(&format!("attention_prefill tiles (emulated: {emulated})"), &source, wg, "attention_prefill");
    }
    for norm in [false, true] {
        for format in [WeightFormat::Int8, WeightFormat::Int4] {
            spirv("f16_stage", &stage_source(), stage_constants(norm, format), "f16_stage");
        }
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
