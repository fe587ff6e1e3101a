use super::*;
use std::collections::HashMap;
use std::path::Path;

use xxhash_rust::xxh3::xxh3_128;

use super::layout::{blob_bytes, plan_layout, planned_blob_len};
use super::memory::{check_host_memory, parse_mem_available};
use super::pieces::convert_targets;
use super::quantize::{quantize_nibble, quantize_row, quantize_row_int4, quantize_value};
use crate::checkpoint::{combine_pieces, Checkpoint, HASH_PIECE};
use crate::config::ModelConfig;
use crate::converted::{int4_position, read_scale, WeightFormat, QUANT_GROUP};
use crate::error::Error;
use crate::progress::Progress;

#[test]
fn planned_blob_len_matches_the_layout_and_overflows_to_none() {
    let mut cfg = ModelConfig::qwen3_0_6b_base();
    for weights in [WeightFormat::Int8, WeightFormat::Int4] {
        for tied in [true, false] {
            cfg.tie_word_embeddings = tied;
            assert_eq!(planned_blob_len(&cfg, weights), Some(plan_layout(&cfg, weights).1));
        }
        let odd =
            ModelConfig { hidden_size: 70, intermediate_size: 33, head_dim: 8, vocab_size: 3, ..cfg.clone() };
        assert_eq!(planned_blob_len(&odd, weights), Some(plan_layout(&odd, weights).1));
    }
    // Sizes config.json can imply that no usize holds.
    let huge = [
        ModelConfig { num_hidden_layers: usize::MAX / 2, ..cfg.clone() },
        ModelConfig { vocab_size: usize::MAX / 1024, ..cfg.clone() },
        ModelConfig { intermediate_size: usize::MAX / 2, ..cfg.clone() },
        ModelConfig { num_attention_heads: usize::MAX / 64, ..cfg.clone() },
    ];
    for c in &huge {
        assert_eq!(planned_blob_len(c, WeightFormat::Int8), None);
        assert_eq!(planned_blob_len(c, WeightFormat::Int4), None);
    }
}

#[test]
fn host_memory_check_names_needed_and_available() {
    assert!(check_host_memory("x", 10, Some(10)).is_ok());
    assert!(check_host_memory("x", 10, None).is_ok());
    match check_host_memory("converting", 11, Some(10)) {
        Err(e @ Error::OutOfMemory { needed: 11, available: 10, .. }) => {
            assert_eq!(e.code(), "out_of_memory");
            assert!(e.to_string().contains("converting"));
        }
        other => panic!("{other:?}"),
    }
    let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   22000000 kB\n";
    assert_eq!(parse_mem_available(meminfo), Some(22_000_000 * 1024));
    assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
}

/// A tensor rewritten (same size) between the fingerprint and the
/// conversion is caught by the conversion's own digests.
#[cfg(unix)]
#[test]
fn conversion_refuses_bytes_other_than_the_fingerprinted() {
    use std::os::unix::fs::FileExt;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/gqa2_hd64");
    let tmp = tempfile::tempdir().unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(name), tmp.path().join(name)).unwrap();
    }
    let cfg = crate::config::load_config(tmp.path()).unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let fp = ckpt.fingerprint(&cfg, 1, WeightFormat::Int8).unwrap();
    assert!(convert_validated(&ckpt, &cfg, WeightFormat::Int8, Some(&fp), &Progress::none()).is_ok());

    let path = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let at = 8 + header_len + meta.info(name).unwrap().data_offsets.0 + 100;
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&[bytes[at] ^ 0x01], at as u64).unwrap();

    let err = convert_validated(&ckpt, &cfg, WeightFormat::Int8, Some(&fp), &Progress::none())
        .err()
        .expect("a changed tensor");
    assert_eq!(err.code(), "checkpoint_invalid");
    assert!(err.to_string().contains(name) && err.to_string().contains("changed"), "{err}");
    // Without a fingerprint there is nothing to compare with.
    assert!(convert_validated(&ckpt, &cfg, WeightFormat::Int8, None, &Progress::none()).is_ok());
    assert_ne!(ckpt.fingerprint(&cfg, 1, WeightFormat::Int8).unwrap().key, fp.key);
}

/// Converts the fixture `name` in pieces of `piece` bytes, checking
/// each tensor's digest taken in pieces of that size.
fn convert_in_pieces(name: &str, piece: usize) -> Vec<u8> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name);
    let cfg = crate::config::load_config(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    ckpt.validate(&cfg).unwrap();
    let (index, total) = plan_layout(&cfg, WeightFormat::Int8);
    let targets = plan_targets(&ckpt, &index).unwrap();
    let mut digests = HashMap::new();
    for t in targets.iter().flat_map(|t| t.sources()) {
        let bytes = ckpt.tensor(t.name()).unwrap().bytes;
        let pieces: Vec<u8> = bytes.chunks(piece).flat_map(|p| xxh3_128(p).to_le_bytes()).collect();
        digests.insert(t.name().to_string(), combine_pieces(bytes.len() as u64, &pieces));
    }
    let mut blob = vec![0u8; total];
    convert_targets(&mut blob, &targets, &dir, Some(&digests), piece, &Progress::none()).unwrap();
    blob
}

/// Pieces shorter than a row, a row long, not dividing rows, and longer:
/// rows inside one piece, straddling two, and spanning several all
/// convert to the bytes of the whole-tensor pieces, and every piece's
/// bytes are hashed in order.
#[test]
fn any_piece_size_converts_the_same_bytes() {
    for name in ["odd_dims", "gqa2_hd64", "untied_head"] {
        let whole = convert_in_pieces(name, HASH_PIECE);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name);
        let cfg = crate::config::load_config(&dir).unwrap();
        let model = convert(&Checkpoint::open(&dir).unwrap(), &cfg, WeightFormat::Int8).unwrap();
        assert!(blob_bytes(&model).unwrap() == whole.as_slice(), "{name}");
        for piece in [64, 191, 192, 193, 1000, 65539] {
            assert!(convert_in_pieces(name, piece) == whole, "{name}, pieces of {piece} bytes");
        }
    }
}

#[test]
fn quantize_value_rounds_half_away_from_zero() {
    let cases: [(f32, i8); 12] = [
        (0.0, 0),
        (0.49999997, 0),
        (0.5, 1),
        (-0.5, -1),
        (1.5, 2),
        (2.5, 3),
        (-2.5, -3),
        (126.5, 127),
        (127.00001, 127),
        (-200.0, -127),
        (f32::NAN, -127),
        (-0.49999997, 0),
    ];
    for (y, want) in cases {
        assert_eq!(quantize_value(y), want, "y = {y}");
    }
    // Agrees with f32::round everywhere in range, on a fine grid.
    for i in -130_000..=130_000 {
        let y = i as f32 * 0.001 + 0.0005;
        assert_eq!(quantize_value(y), y.round().clamp(-127.0, 127.0) as i8, "y = {y}");
    }
}

#[test]
fn quantize_row_groups_and_zero_group() {
    let mut row = vec![0.0f32; 70];
    row[0] = 127.0;
    row[1] = -63.5;
    row[69] = 254.0; // second, shorter group
    let mut q = vec![0u8; 128];
    let mut s = vec![0u8; 8];
    assert!(quantize_row(&row, &mut q, &mut s));
    let s0 = f32::from_ne_bytes(s[0..4].try_into().unwrap());
    let s1 = f32::from_ne_bytes(s[4..8].try_into().unwrap());
    assert_eq!(s0, 1.0);
    assert_eq!(s1, 2.0);
    assert_eq!(q[0] as i8, 127);
    assert_eq!(q[1] as i8, -64); // -63.5 rounds away from zero
    assert_eq!(q[2] as i8, 0);
    assert_eq!(q[69] as i8, 127);
    assert!(q[70..].iter().all(|&b| b == 0));

    let zeros = vec![0.0f32; 64];
    let mut q = vec![7u8; 64];
    let mut s = vec![9u8; 4];
    assert!(quantize_row(&zeros, &mut q, &mut s));
    assert_eq!(f32::from_ne_bytes(s[..].try_into().unwrap()), 0.0);
    assert!(q.iter().all(|&b| b == 0));

    let mut bad = vec![0.0f32; 64];
    bad[3] = f32::NAN;
    assert!(!quantize_row(&bad, &mut [0u8; 64], &mut [0u8; 4]));
}

#[test]
fn quantize_nibble_rounds_half_away_from_zero_within_int4() {
    let cases: [(f32, i8); 9] = [
        (0.0, 0),
        (0.5, 1),
        (-0.5, -1),
        (6.5, 7),
        (7.49, 7),
        (-7.5, -8),
        (-8.6, -8),
        (9.0, 7),
        (f32::NAN, -8),
    ];
    for (y, want) in cases {
        assert_eq!(quantize_nibble(y), want, "y = {y}");
    }
}

/// Weights `q * s` with `q` in [-8, 7] and both extremes present in each
/// group convert to int4 losslessly: each group's scale is `s` and each
/// nibble `q`, exactly, whatever the row length (a short last group), the
/// sign of `s` and its magnitude (normal bf16 scales of 8 significant bits
/// from 2^-30 to 2^10: every scale a bf16 checkpoint's weights give); the
/// padding stays zero.
#[test]
fn int4_conversion_is_lossless_for_int4_values_with_both_extremes() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    for case in 0..300 {
        let cols = rng.random_range(2..=300usize);
        let groups = cols.div_ceil(QUANT_GROUP);
        let mut q = vec![0i8; cols];
        let mut s = vec![0f32; groups];
        for (g, (group, scale)) in q.chunks_mut(QUANT_GROUP).zip(&mut s).enumerate() {
            group.iter_mut().for_each(|v| *v = rng.random_range(-8..=7));
            // Both extremes (a group of one value holds -8 only).
            let at = rng.random_range(0..group.len());
            group[at] = -8;
            if group.len() > 1 {
                group[(at + 1 + rng.random_range(0..group.len() - 1)) % group.len()] = 7;
            }
            let mantissa = rng.random_range(1..=255) as f32 / 128.0;
            let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
            *scale = sign * mantissa * 2f32.powi(rng.random_range(-30..=10));
            assert!(group.contains(&-8), "case {case} group {g}");
        }
        let row: Vec<f32> = q.iter().enumerate().map(|(c, &v)| f32::from(v) * s[c / QUANT_GROUP]).collect();
        let padded = groups * QUANT_GROUP;
        let mut q_row = vec![0u8; padded / 2];
        let mut s_row = vec![0u8; groups * 2];
        assert!(quantize_row_int4(&row, &mut q_row, &mut s_row));
        let scales: Vec<f32> = s_row.chunks(2).map(|b| read_scale(WeightFormat::Int4, b)).collect();
        assert_eq!(scales, s, "case {case}: scales");
        for c in 0..padded {
            let (byte, high) = int4_position(c);
            let nibble = if high { q_row[byte] >> 4 } else { q_row[byte] & 0xf };
            let got = ((nibble << 4) as i8) >> 4;
            let want = q.get(c).copied().unwrap_or(0);
            assert_eq!(got, want, "case {case}: q[{c}] of {cols}");
            if c < cols {
                assert_eq!(f32::from(got) * scales[c / QUANT_GROUP], row[c], "case {case}: w[{c}]");
            }
        }
    }
}

/// Each value lands in its own nibble: the positions of a group's 64
/// values are its 32 bytes' 64 nibbles, each once, and a u32 word (4
/// bytes) holds 8 consecutive values.
#[test]
fn int4_positions_cover_each_nibble_once() {
    let mut seen = [[false; 2]; QUANT_GROUP / 2];
    for c in 0..QUANT_GROUP {
        let (byte, high) = int4_position(c);
        assert_eq!(byte / 4, c / 8, "value {c} outside its word");
        assert!(!std::mem::replace(&mut seen[byte][usize::from(high)], true), "value {c}");
    }
}

/// A group whose scale is no bf16 value (an f32 checkpoint's) gets its
/// largest magnitude / -8 rounded to the nearest bf16, and each value the
/// nibble nearest to it at that scale (within half a step, clamped).
#[test]
fn int4_scales_round_to_bf16() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(36);
    for case in 0..200 {
        let row: Vec<f32> = (0..QUANT_GROUP).map(|_| rng.random_range(-1.0f32..1.0) * 0.37).collect();
        let extreme = row.iter().copied().fold(0f32, |e, x| if x.abs() > e.abs() { x } else { e });
        let mut q_row = vec![0u8; QUANT_GROUP / 2];
        let mut s_row = vec![0u8; 2];
        assert!(quantize_row_int4(&row, &mut q_row, &mut s_row));
        let scale = read_scale(WeightFormat::Int4, &s_row);
        assert_eq!(scale, half::bf16::from_f32(extreme / -8.0).to_f32(), "case {case}");
        assert!(((scale - extreme / -8.0) / scale).abs() <= 1.0 / 256.0, "case {case}");
        for (c, &x) in row.iter().enumerate() {
            let (byte, high) = int4_position(c);
            let nibble = if high { q_row[byte] >> 4 } else { q_row[byte] & 0xf };
            let got = ((nibble << 4) as i8) >> 4;
            assert_eq!(got, quantize_nibble(x / scale), "case {case}: value {c}");
        }
    }
}

/// A Qwen3 shape of 36 layers, 32/8 heads of 128 and Qwen3's vocabulary
/// (the 4B's and the 8B's).
fn qwen3_36_layers(hidden_size: usize, intermediate_size: usize, tie_word_embeddings: bool) -> ModelConfig {
    ModelConfig {
        hidden_size,
        intermediate_size,
        num_hidden_layers: 36,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        vocab_size: 151936,
        tie_word_embeddings,
        ..ModelConfig::qwen3_0_6b_base()
    }
}

/// Qwen3-4B in int4 fits the 2.6 GB of GPU weights (the int8
/// embedding included), about 55% of its int8 size.
#[test]
fn qwen3_4b_in_int4_fits_2_6_gb() {
    let cfg = qwen3_36_layers(2560, 9728, true);
    let int4 = planned_blob_len(&cfg, WeightFormat::Int4).unwrap();
    let int8 = planned_blob_len(&cfg, WeightFormat::Int8).unwrap();
    assert!(int4 <= 2_600_000_000, "{int4} bytes");
    assert!((0.5..0.56).contains(&(int4 as f64 / int8 as f64)), "{int4} of {int8} bytes");
}

/// Qwen3-8B (untied: its int8 embedding and LM head are 1.32 GB of it) in
/// int4 fits the 5.2 GB of GPU weights.
#[test]
fn qwen3_8b_in_int4_fits_5_2_gb() {
    let cfg = qwen3_36_layers(4096, 12288, false);
    let int4 = planned_blob_len(&cfg, WeightFormat::Int4).unwrap();
    assert!(int4 <= 5_200_000_000, "{int4} bytes");
}
