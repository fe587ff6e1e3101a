//! GPU time of the decode step's layer matvecs under different work splits
//! (workgroup size, rows per workgroup, split K or rows per subgroup), at
//! the Qwen3-0.6B shapes, each launched 28 times in a row as in a step
//! (every launch depending on the previous one, each on its own copy of
//! the matrix, so the weights stream from memory as in a step rather than
//! from cache), timed with timestamps at the pass's start and end, after a
//! warm-up. Random weights: only the time matters here.
//!
//! `cargo run --release --example matvec_sweep [-- --repeat N] [--copies N]
//! [--shapes] [--only LABEL,LABEL]` (`--copies 1`: every launch reads the
//! same copy, from cache when it fits: what the launch costs once its
//! weights are in L2; `--shapes`: the pipelines specialised to each shape,
//! as the engine's decode step runs them; `--only`: the named configs;
//! `--backend NAME`, else `QWEN3_WGPU_BACKEND`, else portable).

use qwen3_wgpu::internals::converted::QUANT_GROUP;
use qwen3_wgpu::internals::kernels::{
    compile, Kernel, MatvecConstants, MatvecLayout, MatvecParams, MatvecShape, MatvecSplit,
};
use qwen3_wgpu::{AdapterPolicy, Gpu};

const LAYERS: u32 = 28;

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
    let shapes = [
        Shape { name: "qkv 4096x1024 norm", rows: 4096, cols: 1024, kernel: Kernel::Int8MatvecNorm },
        Shape { name: "o 1024x2048 add", rows: 1024, cols: 2048, kernel: Kernel::Int8MatvecAccumulate },
        Shape {
            name: "gate_up 6144x1024 swiglu",
            rows: 6144,
            cols: 1024,
            kernel: Kernel::Int8MatvecNormSwiglu,
        },
        Shape { name: "down 1024x3072 add", rows: 1024, cols: 3072, kernel: Kernel::Int8MatvecAccumulate },
        // The same qkv matrix with no epilogue (y = W x): the matvec alone.
        Shape { name: "qkv 4096x1024 plain", rows: 4096, cols: 1024, kernel: Kernel::Int8MatvecNorm },
        // The LM head (one launch per step; a single copy, 156 MB, far past the cache).
        Shape { name: "lm_head 151936x1024 norm", rows: 151936, cols: 1024, kernel: Kernel::Int8MatvecNorm },
    ];
    // (label, layout, workgroup size, rows per workgroup)
    let configs: Vec<(String, MatvecLayout, u32, u32)> = vec![
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
    let max_cols = 3072usize;
    let x = gpu.storage_init("x", bytemuck::cast_slice(&vec![0.01f32; max_cols]))?;
    let norm_w = gpu.storage_init("norm_w", bytemuck::cast_slice(&vec![1.0f32; max_cols]))?;
    let y = gpu.storage_init("y", bytemuck::cast_slice(&vec![0.0f32; 151936]))?;
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
        print!(" {:>26}", s.name);
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
            let split = MatvecSplit { layout: *layout, workgroup_size: *wg, rows_per_wg: *rows_per_wg };
            let shape = shape_consts.then(|| {
                let groups = s.cols / QUANT_GROUP as u32;
                MatvecShape { rows: s.rows, k_words: s.cols / 4, groups, n_in: s.cols }
            });
            let constants = MatvecConstants { shape, ..MatvecConstants::decode(variant, split) }.render();
            let src = s.kernel.source(gpu.subgroups);
            let (pipeline, layout) =
                compile(&gpu, s.name, &src, s.kernel.entry(), s.kernel.bindings(), &constants)?;
            pipes.push((pipeline, layout));
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
                y_stride: 8192,
            };
            let u = gpu.uniform("p", bytemuck::bytes_of(&params)).unwrap();
            let entries = [
                u.as_entire_binding(),
                x.as_entire_binding(),
                mats[i][layer % mats[i].len()].0.as_entire_binding(),
                mats[i][layer % mats[i].len()].1.as_entire_binding(),
                y.as_entire_binding(),
                norm_w.as_entire_binding(),
            ];
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
        for i in 0..shapes.len() {
            // (the LM head's 28 launches read its one copy: cache helps little at 156 MB)
            print!(" {:>26.2}", time(&[i])? / LAYERS as f64);
        }
        println!(" {:>12.0}", time(&[0, 1, 2, 3])?);
    }
    Ok(())
}

/// The value of `--backend NAME` (or `--backend=NAME`), if given.
fn backend_flag(args: &[String]) -> Option<&str> {
    args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--backend") {
        Some("") => Some(args.get(i + 1).map_or("", String::as_str)),
        Some(rest) => rest.strip_prefix('='),
        None => None,
    })
}
