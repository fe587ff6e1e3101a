//! Prints what the GPU stack offers and whether the engine can run.
//!
//! `cargo run --example doctor [-- --backend portable]`

use qwen3_wgpu::{AdapterPolicy, Engine, Gpu};

fn main() {
    let from_env = match AdapterPolicy::from_env() {
        Ok(p) => p,
        Err(e) => {
            println!("NOT READY: [{}] {e}", e.code());
            std::process::exit(2);
        }
    };
    let portable = std::env::args().any(|a| a == "portable") || from_env == Some(AdapterPolicy::Portable);
    let policy = if portable { AdapterPolicy::Portable } else { AdapterPolicy::MetalOnly };
    let adapters = Gpu::adapters();
    println!("adapters ({}):", adapters.len());
    for a in &adapters {
        let i = a.get_info();
        let f = a.features();
        let l = a.limits();
        println!("- {} [{:?}, {:?}] driver {} {}", i.name, i.backend, i.device_type, i.driver, i.driver_info);
        println!(
            "  features: subgroups={} (sizes {}..{}), f16={}, passthrough_shaders={}, timestamps={}",
            f.contains(wgpu::Features::SUBGROUP),
            i.subgroup_min_size,
            i.subgroup_max_size,
            f.contains(wgpu::Features::SHADER_F16),
            f.contains(wgpu::Features::PASSTHROUGH_SHADERS),
            f.contains(wgpu::Features::TIMESTAMP_QUERY),
        );
        println!(
            "  limits: max_storage_buffer_binding_size={} max_buffer_size={} workgroup_storage={} invocations={}",
            l.max_storage_buffer_binding_size, l.max_buffer_size, l.max_compute_workgroup_storage_size, l.max_compute_invocations_per_workgroup
        );
    }
    println!("policy: {policy:?}");
    // Builds the engine as an application would: device, probe, every kernel.
    match Engine::builder().policy(policy).build() {
        Ok(engine) => {
            let report = engine.kernel_report();
            let check = &report.self_check;
            let verdict =
                if check.ok { "ok".to_string() } else { format!("FAILED: {}", check.describe_failures()) };
            println!("self-check: {verdict} ({} pipelines, {:.1} ms)", check.pipelines, check.ms);
            if let Some((kernel, reason)) = &report.fallback {
                println!("MSL kernels rejected ({kernel}), WGSL in use: {reason}");
            }
            println!(
                "READY: {} via {:?} (kernels: {}, subgroup reductions: {})",
                engine.adapter_info().name,
                engine.adapter_info().backend,
                engine.kernel_source().as_str(),
                engine.uses_subgroups()
            )
        }
        Err(e) => {
            println!("NOT READY: [{}] {e}", e.code());
            std::process::exit(2);
        }
    }
}
