//! GPU cost of one dependent dispatch on this device: 256 launches of a
//! trivial kernel in one compute pass, timed with timestamps at the pass's
//! start and end, in several shapes (shared or fresh bind groups, with or
//! without a read-write dependency, small or 256-wide workgroups). The
//! floor under the decode step's per-launch cost.
//!
//! `cargo run --release --example dispatch_floor`

use qwen3_wgpu::{AdapterPolicy, Gpu};

const N: u32 = 256;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::new(AdapterPolicy::Portable)?;
    println!("adapter: {} ({:?})", gpu.info.name, gpu.info.backend);
    let src = "@group(0) @binding(0) var<uniform> u: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
@compute @workgroup_size(WG) fn touch(@builtin(global_invocation_id) g: vec3<u32>) {
    if g.x == 0u { a[0] = a[0] + u.x; }
}";
    use qwen3_wgpu::kernels::{compile, Bind};
    for &(wg, groups, fresh) in &[(64u32, 1u32, false), (64, 1, true), (256, 1, true), (256, 512, true)] {
        let src = src.replace("WG", &wg.to_string());
        let (pipeline, layout) =
            compile(&gpu, "touch", &src, "touch", &[Bind::Uniform, Bind::ReadWrite], &[])?;
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
                    ],
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
                pass.set_pipeline(&pipeline);
                for i in 0..N as usize {
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
            "workgroup {wg:>3} x {groups:>3} groups, {} bind groups: {:.2} us per dependent dispatch",
            if fresh { "fresh" } else { "one" },
            best / N as f64
        );
    }
    Ok(())
}
