//! GPU time of the decode step's layer matvecs under different work splits
//! (workgroup size, rows per workgroup, split K or rows per subgroup), at
//! the shapes of a Qwen3 size (`--size`, default 0.6b), each launched 28 times in a row as in a step
//! (every launch depending on the previous one, each on its own copy of
//! the matrix, so the weights stream from memory as in a step rather than
//! from cache), timed with timestamps at the pass's start and end, after a
//! warm-up. Random weights: only the time matters here.
//!
//! `cargo run --release --example matvec_sweep [-- --repeat N] [--copies N]
//! [--shapes] [--only LABEL,LABEL] [--size 0.6b|1.7b|4b|8b]` (`--copies 1`: every launch reads the
//! same copy, from cache when it fits: what the launch costs once its
//! weights are in L2; `--shapes`: the pipelines specialised to each shape,
//! as the engine's decode step runs them; `--only`: the named configs;
//! `--backend NAME`, else `QWEN3_WGPU_BACKEND`, else portable).

use qwen3_wgpu::internals::converted::QUANT_GROUP;
use qwen3_wgpu::internals::kernels::{
    compile, decode_bindings, Kernel, MatvecConstants, MatvecLayout, MatvecParams, MatvecShape, MatvecSplit,
};
use qwen3_wgpu::internals::reference::norm_weight_bytes;
use qwen3_wgpu::{AdapterPolicy, Gpu, WeightFormat};

const LAYERS: u32 = 28;
/// The label of the config that runs each shape as the engine would.
const ENGINE: &str = "engine";

/// One layer matrix of the 0.6B model and the variant the step runs on it.
struct Shape {
    name: &'static str,
    rows: u32,
    cols: u32,
    kernel: Kernel,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args: Vec<String> = std::env::args().collect();
    let policy = match backend_flag(&args) {
        Some(name) => AdapterPolicy::from_name("--backend", name)?,
        None => AdapterPolicy::from_env()?.unwrap_or(AdapterPolicy::Portable),
    };
    let gpu = Gpu::new(policy)?;
    println!("adapter: {} ({:?}), subgroups: {}", gpu.info.name, gpu.info.backend, gpu.subgroups);
    let size = args.windows(2).find(|w| w[0] == "--size").map_or("0.6b", |w| w[1].as_str());
    let shapes = shapes_of(size)?;
    // (label, layout, workgroup size, rows per workgroup)
    let configs: Vec<(String, MatvecLayout, u32, u32)> = vec![
        // Each shape under the split the engine picks on a split-K device
        // (`MatvecLayout::split`; 4 rows per workgroup in both of its layouts).
        (ENGINE.into(), MatvecLayout::SplitK, 0, 4),
        ("split wg64 r4".into(), MatvecLayout::SplitK, 64, 4),
        ("split wg128 r4".into(), MatvecLayout::SplitK, 128, 4),
        ("split wg256 r4".into(), MatvecLayout::SplitK, 256, 4),
        ("rows wg32 r4".into(), MatvecLayout::RowsPerTeam, 32, 4),
        ("rows wg32 r8".into(), MatvecLayout::RowsPerTeam, 32, 8),
        ("rows wg32 r16".into(), MatvecLayout::RowsPerTeam, 32, 16),
        ("rows wg64 r8".into(), MatvecLayout::RowsPerTeam, 64, 8),
        ("rows wg64 r16".into(), MatvecLayout::RowsPerTeam, 64, 16),
        ("rows wg128 r16".into(), MatvecLayout::RowsPerTeam, 128, 16),
        ("rows wg128 r32".into(), MatvecLayout::RowsPerTeam, 128, 32),
    ];
    let arg = |name: &str, default: u32| -> u32 {
        args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
    };
    let repeat = arg("--repeat", 5);
    let layer_copies = arg("--copies", LAYERS).clamp(1, LAYERS);
    let shape_consts = args.iter().any(|a| a == "--shapes");
    let only: Option<String> = args.windows(2).find(|w| w[0] == "--only").map(|w| w[1].clone());

    let mut seed = 0x9e3779b9u32;
    let mut rand_words = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed
            })
            .collect()
    };
    let max_cols = shapes.iter().map(|s| s.cols as usize).max().unwrap_or(0);
    let max_rows = shapes.iter().map(|s| s.rows as usize).max().unwrap_or(0);
    let x = gpu.storage_init("x", bytemuck::cast_slice(&vec![0.01f32; max_cols]))?;
    // (f32, then the f16 copy that the engine's split reads)
    let norm_w = gpu.storage_init("norm_w", &norm_weight_bytes(&vec![1.0f32; max_cols]))?;
    let y = gpu.storage_init("y", bytemuck::cast_slice(&vec![0.0f32; 2 * max_rows]))?;
    // The residual's f16 copy (the engine's split on split-K devices): x,
    // two f16 0.01 (0x211f) per word; the residual adds write their rows'.
    let x16 =
        gpu.storage_init("x16", bytemuck::cast_slice(&vec![0x211f_211fu32; max_cols.max(2 * max_rows)]))?;
    let mats: Vec<_> = shapes
        .iter()
        .map(|s| {
            let words = (s.rows * s.cols / 4) as usize;
            let groups = (s.rows * s.cols) as usize / QUANT_GROUP;
            let data = rand_words(words);
            let n_copies = if s.rows > 100_000 { 1 } else { layer_copies };
            let copies: Vec<_> = (0..n_copies)
                .map(|_| {
                    let w = gpu.storage_init(s.name, bytemuck::cast_slice(&data)).unwrap();
                    let sc = gpu.storage_init(s.name, bytemuck::cast_slice(&vec![1e-3f32; groups])).unwrap();
                    (w, sc)
                })
                .collect();
            copies
        })
        .collect();

    let ts = qwen3_wgpu::internals::gpu::Timestamps::new(&gpu, "sweep", 2);
    println!("µs per launch, {LAYERS} dependent launches, best of {repeat}");
    print!("{:18}", "config");
    for s in &shapes {
        print!(" {:>27}", s.name);
    }
    println!(" {:>12}", "4 kinds x28");
    for (label, layout, wg, rows_per_wg) in &configs {
        if let Some(o) = &only {
            if !o.split(',').any(|o| label == o) {
                continue;
            }
        }
        print!("{label:18}");
        let mut pipes = Vec::new();
        for s in &shapes {
            let mut variant = s.kernel.matvec_variant().expect("a matvec variant");
            variant.norm &= !s.name.ends_with("plain");
            let split = if label == ENGINE {
                layout.split(s.rows as usize, s.cols as usize / 4, variant.norm, WeightFormat::Int8)
            } else {
                MatvecSplit {
                    layout: *layout,
                    workgroup_size: *wg,
                    rows_per_wg: *rows_per_wg,
                    x16: false,
                    paired: false,
                }
            };
            assert_eq!(split.rows_per_wg, *rows_per_wg, "{label}: the grid below assumes it");
            let shape = shape_consts.then(|| {
                let groups = s.cols / QUANT_GROUP as u32;
                MatvecShape { rows: s.rows, k_words: s.cols / 4, groups, n_in: s.cols }
            });
            let constants = MatvecConstants { shape, ..MatvecConstants::decode(variant, split) }.render();
            let src = s.kernel.source(gpu.subgroups);
            let (pipeline, layout) =
                compile(&gpu, s.name, &src, s.kernel.entry(), s.kernel.bindings(), &constants)?;
            pipes.push((pipeline, layout, variant, split));
        }
        let bind = |i: usize, layer: usize| {
            let s = &shapes[i];
            let params = MatvecParams {
                rows: s.rows,
                k_words: s.cols / 4,
                groups: s.cols / QUANT_GROUP as u32,
                row_offset: 0,
                n_in: s.cols,
                eps: 1e-6,
                y_stride: 2 * max_rows as u32,
            };
            let u = gpu.uniform("p", bytemuck::bytes_of(&params)).unwrap();
            let entries = [
                u.as_entire_binding(),
                x.as_entire_binding(),
                mats[i][layer % mats[i].len()].0.as_entire_binding(),
                mats[i][layer % mats[i].len()].1.as_entire_binding(),
                y.as_entire_binding(),
                norm_w.as_entire_binding(),
                x16.as_entire_binding(),
            ];
            // As the engine binds a decode launch (a normed one keeping the
            // f16 copy reads it at x's slot).
            let (_, _, variant, split) = &pipes[i];
            let entries = decode_bindings(*variant, split.x16, entries.clone()).unwrap_or(entries);
            let entries: Vec<_> = entries
                .into_iter()
                .enumerate()
                .map(|(b, resource)| wgpu::BindGroupEntry { binding: b as u32, resource })
                .collect();
            gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipes[i].1,
                entries: &entries,
            })
        };
        // [layer][shape]
        let groups: Vec<Vec<_>> =
            (0..LAYERS as usize).map(|l| (0..shapes.len()).map(|i| bind(i, l)).collect()).collect();
        let time = |order: &[usize]| -> Result<f64, qwen3_wgpu::Error> {
            let mut best = f64::MAX;
            for _ in 0..repeat {
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: None,
                        timestamp_writes: Some(ts.pass_writes()),
                    });
                    for layer in &groups {
                        for &i in order {
                            pass.set_pipeline(&pipes[i].0);
                            pass.set_bind_group(0, &layer[i], &[]);
                            pass.dispatch_workgroups(shapes[i].rows.div_ceil(*rows_per_wg), 1, 1);
                        }
                    }
                }
                ts.resolve(&mut enc);
                gpu.queue.submit([enc.finish()]);
                best = best.min(ts.intervals_us(&gpu)?[0]);
            }
            Ok(best)
        };
        // Warm-up: the GPU's clocks rise under load.
        let t0 = std::time::Instant::now();
        while t0.elapsed().as_secs_f64() < 0.5 {
            time(&[0, 1, 2, 3])?;
        }
        for (i, s) in shapes.iter().enumerate() {
            // (the LM head's 28 launches read its one copy: cache helps little at 156 MB+)
            let us = time(&[i])? / LAYERS as f64;
            // int8 weights and one f32 scale per quant group
            let bytes = s.rows as f64 * s.cols as f64 * (1.0 + 4.0 / QUANT_GROUP as f64);
            print!(" {:>17.2} {:>5.2}TB/s", us, bytes / us / 1e6);
        }
        println!(" {:>12.0}", time(&[0, 1, 2, 3])?);
    }
    Ok(())
}

/// The layer matrices of a Qwen3 size (`0.6b`, `1.7b`, `4b`, `8b`: hidden,
/// intermediate, query and KV heads of 128), with the variant the step runs
/// on each, and the LM head.
fn shapes_of(size: &str) -> Result<Vec<Shape>, qwen3_wgpu::Error> {
    let (hidden, inter, heads, kv_heads) = match size {
        "0.6b" => (1024, 3072, 16, 8),
        "1.7b" => (2048, 6144, 16, 8),
        "4b" => (2560, 9728, 32, 8),
        "8b" => (4096, 12288, 32, 8),
        other => {
            return Err(qwen3_wgpu::Error::InvalidArgument {
                name: "--size".into(),
                reason: format!("{other:?} is not one of 0.6b, 1.7b, 4b, 8b"),
            })
        }
    };
    let q_dim = heads * 128;
    let qkv = q_dim + 2 * kv_heads * 128;
    let name = |what: &str, rows: u32, cols: u32| -> &'static str {
        Box::leak(format!("{what} {rows}x{cols}").into_boxed_str())
    };
    Ok(vec![
        Shape { name: name("qkv", qkv, hidden), rows: qkv, cols: hidden, kernel: Kernel::Int8MatvecNorm },
        Shape {
            name: name("o", hidden, q_dim),
            rows: hidden,
            cols: q_dim,
            kernel: Kernel::Int8MatvecAccumulate,
        },
        Shape {
            name: name("gate_up", 2 * inter, hidden),
            rows: 2 * inter,
            cols: hidden,
            kernel: Kernel::Int8MatvecNormSwiglu,
        },
        Shape {
            name: name("down", hidden, inter),
            rows: hidden,
            cols: inter,
            kernel: Kernel::Int8MatvecAccumulate,
        },
        // The same qkv matrix with no epilogue (y = W x): the matvec alone.
        Shape {
            name: name("qkv plain", qkv, hidden),
            rows: qkv,
            cols: hidden,
            kernel: Kernel::Int8MatvecNorm,
        },
        // The LM head (one launch per step; a single copy, far past the cache).
        Shape {
            name: name("lm_head", 151936, hidden),
            rows: 151936,
            cols: hidden,
            kernel: Kernel::Int8MatvecNorm,
        },
    ])
}

/// The value of `--backend NAME` (or `--backend=NAME`), if given.
fn backend_flag(args: &[String]) -> Option<&str> {
    args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--backend") {
        Some("") => Some(args.get(i + 1).map_or("", String::as_str)),
        Some(rest) => rest.strip_prefix('='),
        None => None,
    })
}
