//! Prints what the GPU stack offers and whether the engine can run.
//!
//! `cargo run --example doctor [-- --backend metal|portable]` (`portable`
//! alone also works). Without `--backend`: `QWEN3_WGPU_BACKEND`, else metal.

use qwen3_wgpu::{AdapterPolicy, Engine, Gpu, KvFormat, WeightFormat};

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The flag wins; without it the engine's variable (read as the builder reads it).
    let policy = match backend_flag(&args) {
        Some(name) => AdapterPolicy::from_name("--backend", name),
        None if args.iter().any(|a| a == "portable") => Ok(AdapterPolicy::Portable),
        None => AdapterPolicy::from_env().map(Option::unwrap_or_default),
    };
    let policy = match policy {
        Ok(p) => p,
        Err(e) => {
            println!("NOT READY: [{}] {e}", e.code());
            std::process::exit(2);
        }
    };
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
            let formats: Vec<&str> = report.weight_formats.iter().map(|f| f.name()).collect();
            println!("weight formats: {}", formats.join(", "));
            if let Some((kernel, reason)) = &report.fallback {
                println!("MSL kernels rejected ({kernel}), WGSL in use: {reason}");
            }
            // The other formats' pipelines, which a load in them would
            // build and prove first.
            for &format in report.weight_formats.iter().filter(|&&f| f != WeightFormat::default()) {
                match engine.prepare_weights(format) {
                    Ok(k) => {
                        let check = &k.self_check;
                        println!(
                            "{format} products: {} kernels, self-check ok ({} pipelines, {:.1} ms)",
                            k.source.as_str(),
                            check.pipelines,
                            check.ms
                        );
                        if let Some(reason) = &k.fallback {
                            println!("{format} MSL products rejected, WGSL in use: {reason}");
                        }
                    }
                    Err(e) => {
                        println!("NOT READY: {format} weights: [{}] {e}", e.code());
                        std::process::exit(2);
                    }
                }
            }
            // The int8 KV cache's pipelines, which its first session would
            // build and prove.
            match engine.prepare_kv_cache(KvFormat::Int8) {
                Ok(check) => println!(
                    "int8 KV cache: {} kernels, self-check ok ({} pipelines, {:.1} ms)",
                    engine.kv_cache_source(KvFormat::Int8).as_str(),
                    check.pipelines,
                    check.ms
                ),
                Err(e) => {
                    println!("NOT READY: int8 KV cache: [{}] {e}", e.code());
                    std::process::exit(2);
                }
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

/// The value of `--backend NAME` (or `--backend=NAME`), if given.
fn backend_flag(args: &[String]) -> Option<&str> {
    args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--backend") {
        Some("") => Some(args.get(i + 1).map_or("", String::as_str)),
        Some(rest) => rest.strip_prefix('='),
        None => None,
    })
}
