//! The one compile path: WGSL (checked by naga first, specialised with
//! override constants) or hand-written MSL (a passthrough module, Metal
//! only), each into a compute pipeline on an explicit bind-group layout.
//! Compile and validation errors become `shader_compile_failed`.

use super::Bind;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// The code a pipeline is built from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Code<'a> {
    /// WGSL with its override constants; `checked`: whether naga's runtime
    /// checks (index clamping, loop bounding) stay in (see
    /// [`ShaderChecks::keeps`]).
    Wgsl { source: &'a str, constants: &'a [(&'a str, f64)], checked: bool },
    /// MSL, whose constants are in its preamble; the threadgroup size to
    /// dispatch with.
    Msl { source: &'a str, workgroup_size: u32 },
}

/// The bind-group layout a kernel's binding list describes.
pub fn bind_group_layout(gpu: &Gpu, label: &str, bindings: &[Bind]) -> wgpu::BindGroupLayout {
    let entries: Vec<_> = bindings
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupLayoutEntry {
            binding: i as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: match b {
                Bind::Uniform => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                Bind::Read | Bind::ReadWrite => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: *b == Bind::Read },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
            },
            count: None,
        })
        .collect();
    gpu.device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(label), entries: &entries })
}

/// Compiles WGSL `source` and builds a pipeline for `entry` with an explicit
/// layout; compile and validation errors become `shader_compile_failed`.
pub fn compile(
    gpu: &Gpu,
    label: &str,
    source: &str,
    entry: &str,
    bindings: &[Bind],
    constants: &[(&str, f64)],
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    compile_for_layout(gpu, label, source, entry, bindings, constants, None)
}

/// [`compile`], reusing `layout` (so bind groups made for another pipeline
/// of the same kernel work with this one) when given.
pub fn compile_for_layout(
    gpu: &Gpu,
    label: &str,
    source: &str,
    entry: &str,
    bindings: &[Bind],
    constants: &[(&str, f64)],
    layout: Option<&wgpu::BindGroupLayout>,
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    build(gpu, label, Code::Wgsl { source, constants, checked: true }, entry, bindings, layout)
}

/// Builds a pipeline from hand-written MSL (a passthrough module, Metal
/// only) with the explicit layout `bindings` describe: binding i of group 0
/// is `[[buffer(i)]]`. Compile and validation errors (caught by an error
/// scope) and panics in the backend become `shader_compile_failed`.
pub fn compile_msl(
    gpu: &Gpu,
    label: &str,
    source: &str,
    entry: &str,
    bindings: &[Bind],
    workgroup_size: u32,
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    build(gpu, label, Code::Msl { source, workgroup_size }, entry, bindings, None)
}

/// Builds `code`'s pipeline for `entry` on `layout`, or on a new layout of
/// `bindings`.
pub(crate) fn build(
    gpu: &Gpu,
    label: &str,
    code: Code<'_>,
    entry: &str,
    bindings: &[Bind],
    layout: Option<&wgpu::BindGroupLayout>,
) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
    let kernel = match code {
        Code::Wgsl { .. } => label.to_string(),
        Code::Msl { .. } => format!("{label} (MSL)"),
    };
    let fail = |reason: String| Error::ShaderCompileFailed { kernel: kernel.clone(), reason };
    // naga first: its error names the line, and a parse failure never
    // reaches the device. The parsed program is then specialised to its
    // constants (its constant branches resolved), when naga can.
    let mut specialised = None;
    if let Code::Wgsl { source, constants, .. } = code {
        let module = naga::front::wgsl::parse_str(source).map_err(|e| fail(e.emit_to_string(source)))?;
        if !module.entry_points.iter().any(|e| e.name == entry) {
            return Err(fail(format!("no entry point named {entry}")));
        }
        specialised = super::constant_branches::specialise_module(&module, entry, constants);
    }
    let pipeline = || {
        gpu.scoped(
            || {
                let layout = layout.cloned().unwrap_or_else(|| bind_group_layout(gpu, label, bindings));
                let pl = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(label),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
                let (module, compilation_options) = match code {
                    Code::Wgsl { source, constants, checked } => {
                        // The specialised module, else the WGSL as written.
                        let (source, constants) = match specialised.take() {
                            Some(module) => {
                                (wgpu::ShaderSource::Naga(std::borrow::Cow::Owned(module)), &[][..])
                            }
                            None => (wgpu::ShaderSource::Wgsl(source.into()), constants),
                        };
                        let desc = wgpu::ShaderModuleDescriptor { label: Some(label), source };
                        let module = if checked {
                            gpu.device.create_shader_module(desc)
                        } else {
                            // SAFETY: only kernels that index through their params,
                            // grid, lane ids and the positions the engine writes come
                            // here (ShaderChecks::keeps); the host sizes every
                            // binding for the params, the
                            // kernel tests run them at awkward shapes against the
                            // checked build bit for bit (tests/it/shader_checks.rs),
                            // and their MSL twins run on Metal under the same
                            // contract.
                            unsafe {
                                gpu.device.create_shader_module_trusted(
                                    desc,
                                    wgpu::ShaderRuntimeChecks::unchecked(),
                                )
                            }
                        };
                        (
                            module,
                            wgpu::PipelineCompilationOptions {
                                constants,
                                zero_initialize_workgroup_memory: false,
                            },
                        )
                    }
                    Code::Msl { source, workgroup_size } => {
                        let entry_points = [wgpu::PassthroughShaderEntryPoint {
                            name: entry.into(),
                            workgroup_size: (workgroup_size, 1, 1),
                        }];
                        // SAFETY: the source is one of the MSL twins: its buffer
                        // slots are checked against `bindings`
                        // (tests/it/msl_kernels.rs), it is executed against the CPU
                        // references through the C++ shim, and it guards every
                        // access against the sizes in its params. Off Metal,
                        // wgpu itself rejects the module (a validation error):
                        // the fallback's tests run that real route on Vulkan.
                        let module = unsafe {
                            gpu.device.create_shader_module_passthrough(
                                wgpu::ShaderModuleDescriptorPassthrough {
                                    label: Some(label),
                                    entry_points: entry_points.as_slice().into(),
                                    msl: Some(source.into()),
                                    ..Default::default()
                                },
                            )
                        };
                        (module, Default::default())
                    }
                };
                let pipeline = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(label),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options,
                    cache: None,
                });
                Ok((pipeline, layout))
            },
            fail,
        )
    };
    // The Metal backend may panic on a passthrough module it cannot build,
    // and naga's SPIR-V writer on a construct it does not support (seen with
    // cooperative matrices): either is a failed build (with a fallback),
    // never a panic out of the engine.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(pipeline))
        .unwrap_or_else(|_| Err(fail("the shader compiler panicked while building the pipeline".into())))
}

/// The environment variable that keeps naga's runtime checks in every WGSL
/// kernel (`all`), a diagnostic for a suspected out-of-range index.
pub const SHADER_CHECKS_ENV: &str = "QWEN3_WGPU_SHADER_CHECKS";

/// Which WGSL kernels keep naga's runtime checks (every index clamped to
/// its array, every loop bounded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShaderChecks {
    /// The kernels with an MSL twin (the matvec family with its
    /// prompt-batch products, attention, q/k norm and RoPE, the argmax)
    /// drop them: they index only through their params, grid, lane ids and
    /// the positions the engine writes, bounded by each session's capacity
    /// before a step is queued, exactly as their twins do, which run
    /// without checks on Metal. The others, which index through data a
    /// caller or a sampler supplies (token ids, sampler candidates), keep
    /// them. On an H200 the checks cost the prompt-batch product half its
    /// speed and prefill attention a quarter (BENCHMARKS.md, 2026-12-01).
    DataIndexed,
    /// Every kernel keeps them.
    All,
}

impl ShaderChecks {
    const NAMES: [(&'static str, ShaderChecks); 2] =
        [("data-indexed", ShaderChecks::DataIndexed), ("all", ShaderChecks::All)];

    /// The choice [`SHADER_CHECKS_ENV`] names: `None` when unset; an
    /// unknown value is `invalid_argument`.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(SHADER_CHECKS_ENV, &Self::NAMES)
    }

    /// Whether `kernel`'s WGSL keeps the checks.
    pub fn keeps(self, kernel: super::Kernel) -> bool {
        self == ShaderChecks::All || kernel.row().msl.is_none()
    }
}
