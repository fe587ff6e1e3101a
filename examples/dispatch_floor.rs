//! GPU cost of one dependent dispatch on this device: 256 launches of a
//! trivial kernel in one compute pass, timed with timestamps at the pass's
//! start and end, in several shapes (shared or fresh bind groups, with or
//! without a read-write dependency, small or 256-wide workgroups). The
//! floor under the decode step's per-launch cost.
//!
//! `cargo run --release --example dispatch_floor [-- --backend NAME]`
//! (without it: `QWEN3_WGPU_BACKEND`, else portable)

use qwen3_wgpu::internals::kernels::Kernel;
use qwen3_wgpu::{AdapterPolicy, Gpu};

const N: u32 = 256;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args: Vec<String> = std::env::args().collect();
    let policy = match backend_flag(&args) {
        Some(name) => AdapterPolicy::from_name("--backend", name)?,
        None => AdapterPolicy::from_env()?.unwrap_or(AdapterPolicy::Portable),
    };
    let gpu = Gpu::new(policy)?;
    println!("adapter: {} ({:?})", gpu.info.name, gpu.info.backend);
    let plain = "@group(0) @binding(0) var<uniform> u: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
@compute @workgroup_size(WG) fn touch(@builtin(global_invocation_id) g: vec3<u32>) {
    if g.x == 0u { a[0] = a[0] + u.x; }
}";
    // The same, with what the engine's reductions use: workgroup memory,
    // barriers and a subgroup operation.
    let reducing = "@group(0) @binding(0) var<uniform> u: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
var<workgroup> red: array<vec4<f32>, WG>;
@compute @workgroup_size(WG) fn touch(@builtin(local_invocation_index) i: u32, @builtin(global_invocation_id) g: vec3<u32>) {
    let s = subgroupAdd(f32(i));
    red[i] = vec4<f32>(s);
    workgroupBarrier();
    if g.x == 0u { a[0] = a[0] + u.x + u32(red[WG - 1u].x); }
}";
    use qwen3_wgpu::internals::kernels::{compile, Bind};
    // (kernel, workgroup size, workgroups, fresh bind groups; the last case
    // switches between 8 pipelines of the same kernel, as the decode step
    // switches kernels on almost every launch)
    let wide = "@group(0) @binding(0) var<uniform> u: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
@group(0) @binding(2) var<storage, read> b0: array<u32>;
@group(0) @binding(3) var<storage, read> b1: array<u32>;
@group(0) @binding(4) var<storage, read_write> b2: array<u32>;
@group(0) @binding(5) var<storage, read> b3: array<u32>;
@compute @workgroup_size(WG) fn touch(@builtin(global_invocation_id) g: vec3<u32>) {
    if g.x == 0u { a[0] = a[0] + u.x + b0[7] + b1[9] + b3[11]; b2[g.x] = 1u; }
}";
    // The engine's subgroup prelude (its Lane builtins) around a trivial
    // body, and the engine's argmax_final itself.
    let prelude = qwen3_wgpu::internals::kernels::reduction_prelude(true);
    let lanes = format!(
        "{prelude}
@group(0) @binding(0) var<uniform> u: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
@compute @workgroup_size(WG) fn touch(lane: Lane) {{
    let s = subgroupAdd(lane.sg_id + lane.n_sg + lane.sg_size + lane.sg_lane);
    if lane.idx == 0u {{ a[0] = a[0] + u.x + s; }}
}}"
    );
    let cases = [
        ("lanes", 256u32, 1u32, true),
        ("argmax_final", 256, 1, true),
        ("wide", 64u32, 1u32, true),
        ("wide", 256, 512, true),
        ("switch8", 64u32, 1u32, true),
        ("switch8", 256, 512, true),
        ("plain", 64u32, 1u32, false),
        ("plain", 64, 1, true),
        ("plain", 256, 1, true),
        ("plain", 256, 512, true),
        ("reducing", 64, 1, true),
        ("reducing", 256, 1, true),
        ("reducing", 256, 512, true),
    ];
    for &(kind, wg, groups, fresh) in &cases {
        if kind == "reducing" && !gpu.subgroups {
            continue;
        }
        let src = match kind {
            "reducing" => reducing.replace("WG", &wg.to_string()),
            "wide" => wide.replace("WG", &wg.to_string()),
            "lanes" => lanes.clone(),
            "argmax_final" => Kernel::ArgmaxFinal.source(true),
            _ => plain.replace("WG", &wg.to_string()),
        };
        let constants: Vec<(&str, f64)> =
            if matches!(kind, "lanes" | "argmax_final") { vec![("WG", wg as f64)] } else { vec![] };
        let entry = if kind == "argmax_final" { "argmax_final" } else { "touch" };
        let binds: &[Bind] = if kind == "wide" {
            &[Bind::Uniform, Bind::ReadWrite, Bind::Read, Bind::Read, Bind::ReadWrite, Bind::Read]
        } else if kind == "argmax_final" {
            Kernel::ArgmaxFinal.bindings()
        } else {
            &[Bind::Uniform, Bind::ReadWrite]
        };
        // Big buffers, as the weights and KV cache are (64 MiB each).
        let big: Vec<_> = (0..4).map(|_| gpu.storage("big", 64 << 20)).collect();
        let n_pipelines = if kind == "switch8" { 8 } else { 1 };
        let mut pipelines = Vec::new();
        let mut layout = None;
        for i in 0..n_pipelines {
            // Distinct modules: a constant in the source differs.
            let src = src.replace("a[0] + u.x", &format!("a[0] + u.x + {i}u"));
            let (p, l) = compile(&gpu, "touch", &src, entry, binds, &constants)?;
            pipelines.push(p);
            layout = Some(l);
        }
        let layout = layout.expect("one pipeline");
        let buf = gpu.storage("a", 256);
        let bgs: Vec<_> = (0..if fresh { N } else { 1 })
            .map(|i| {
                let u = gpu.uniform("u", bytemuck::cast_slice(&[i, 0u32, 0, 0])).unwrap();
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &layout,
                    entries: &[
                        wgpu::BindGroupEntry { binding: 0, resource: u.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 1, resource: buf.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 2, resource: big[0].as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 3, resource: big[1].as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 4, resource: big[2].as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 5, resource: big[3].as_entire_binding() },
                    ][..binds.len()],
                })
            })
            .collect();
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: None,
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut best = f64::MAX;
        for _ in 0..5 {
            let rb = gpu.readback("t", 16);
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &set,
                        beginning_of_pass_write_index: Some(0),
                        end_of_pass_write_index: Some(1),
                    }),
                });
                for i in 0..N as usize {
                    if i == 0 || pipelines.len() > 1 {
                        pass.set_pipeline(&pipelines[i % pipelines.len()]);
                    }
                    pass.set_bind_group(0, &bgs[i % bgs.len()], &[]);
                    pass.dispatch_workgroups(groups, 1, 1);
                }
            }
            enc.resolve_query_set(&set, 0..2, &resolve, 0);
            enc.copy_buffer_to_buffer(&resolve, 0, &rb, 0, 16);
            gpu.queue.submit([enc.finish()]);
            let t: Vec<u64> = bytemuck::pod_collect_to_vec(&gpu.read(&rb)?);
            let us = (t[1] - t[0]) as f64 * gpu.queue.get_timestamp_period() as f64 / 1e3;
            best = best.min(us);
        }
        println!(
            "{kind:>8} kernel, workgroup {wg:>3} x {groups:>3} groups, {} bind groups: {:.2} us per dependent dispatch",
            if fresh { "fresh" } else { "one" },
            best / N as f64
        );
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
