//! GPU plumbing: adapter policy, device creation (or adoption of a host
//! app's device), error capture, buffers and readback.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Environment variable a host app (or its tests) can set to choose the
/// adapter policy without code changes: `metal` or `portable`.
pub const BACKEND_ENV: &str = "QWEN3_WGPU_BACKEND";

/// Which GPU adapters the engine accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdapterPolicy {
    /// Apple GPUs through Metal only (the shipped, tuned target). Any other
    /// adapter is refused with `non_metal_adapter`.
    #[default]
    MetalOnly,
    /// Any adapter wgpu offers (Vulkan, DX12, Metal; GL last). The same
    /// kernels run; this is how the engine is tested and benchmarked off Apple.
    Portable,
}

impl AdapterPolicy {
    /// The names [`Self::from_name`] accepts: `metal` and `portable`.
    pub const NAMES: [(&'static str, AdapterPolicy); 2] =
        [("metal", AdapterPolicy::MetalOnly), ("portable", AdapterPolicy::Portable)];

    /// The policy named `metal` or `portable` (case-insensitive); anything
    /// else is `invalid_argument` naming `what` (a flag or variable).
    pub fn from_name(what: &str, value: &str) -> Result<Self> {
        crate::settings::parse_choice(what, value, &Self::NAMES)
    }

    /// The policy named by [`BACKEND_ENV`]: `None` when it is unset,
    /// `invalid_argument` when it names no policy.
    pub fn from_env() -> Result<Option<Self>> {
        crate::settings::env_choice(BACKEND_ENV, &Self::NAMES)
    }

    /// Refuses an adapter this policy does not accept.
    pub fn check(self, info: &wgpu::AdapterInfo) -> Result<()> {
        if self == AdapterPolicy::MetalOnly && info.backend != wgpu::Backend::Metal {
            return Err(Error::NonMetalAdapter {
                backend: format!("{:?}", info.backend),
                adapter: info.name.clone(),
            });
        }
        Ok(())
    }
}

/// Preference order when several adapters exist (lower is better).
fn adapter_rank(info: &wgpu::AdapterInfo) -> u32 {
    use wgpu::{Backend, DeviceType};
    let backend = match info.backend {
        Backend::Metal => 0,
        Backend::Vulkan => 1,
        Backend::Dx12 => 2,
        _ => 5, // GL: no subgroups, slow buffers
    };
    let kind = match info.device_type {
        DeviceType::DiscreteGpu => 0,
        DeviceType::IntegratedGpu => 1,
        DeviceType::VirtualGpu => 2,
        DeviceType::Cpu => 3,
        DeviceType::Other => 4,
    };
    backend * 10 + kind
}

/// An owned or adopted wgpu device with what the engine learned about it.
#[derive(Clone)]
pub struct Gpu {
    /// The device the engine records on.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter's name, backend and driver.
    pub info: wgpu::AdapterInfo,
    /// True when kernels use subgroup reductions.
    pub subgroups: bool,
    /// True when the device was created with 16x16x16 f16 cooperative
    /// matrices (f32 sums) and has 32-lane subgroups: prompt batches may
    /// run `int8_matmul_coop` ([`coop_supported`]).
    pub coop: bool,
    /// With `coop`: the device has no cooperative matrices but f16, and
    /// prompt batches run `int8_matmul_coop`'s emulation (tests:
    /// [`crate::EngineBuilder::emulate_cooperative_matrices`]).
    pub coop_emulated: bool,
    /// What the engine's own handlers saw on a device it created (an
    /// adopted device keeps its host's handlers: the engine relies on its
    /// error scopes there).
    faults: Arc<Mutex<Faults>>,
    /// Held while a polled feed's prompt submit is on the queue
    /// ([`Gpu::try_prompt_ticket`]).
    prompt_gate: Arc<AtomicBool>,
}

/// The right to put one polled feed's prompt submit on the queue: at most
/// one is in flight on a device, whichever session or model it serves, so
/// a frame a host submits meanwhile queues behind one prompt batch at most
/// (several conversations restarting in one frame would otherwise queue
/// one batch each). Released when dropped: by the queue's callback once the
/// submit is done, or on any path that never submits it.
pub(crate) struct PromptTicket(Arc<AtomicBool>);

impl Drop for PromptTicket {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Errors reported outside any error scope, on a device the engine owns.
#[derive(Default)]
struct Faults {
    /// The device was lost: every later call fails.
    lost: Option<String>,
    /// An uncaptured error, reported once by the next check and then
    /// cleared: one failed call does not fail unrelated later ones.
    uncaptured: Option<String>,
}

impl Gpu {
    /// Lists every adapter wgpu can see (all backends), best first.
    pub fn adapters() -> Vec<wgpu::Adapter> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        // GL is left out: no subgroups, slow storage buffers, and EGL noise on headless Linux.
        desc.backends = wgpu::Backends::PRIMARY;
        let instance = wgpu::Instance::new(desc);
        let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::PRIMARY));
        adapters.sort_by_key(|a| adapter_rank(&a.get_info()));
        adapters
    }

    /// Picks the best adapter the policy accepts and creates a device on it
    /// with the adapter's own limits (the defaults are far too small),
    /// without cooperative matrices ([`Self::new_with`]).
    pub fn new(policy: AdapterPolicy) -> Result<Self> {
        Self::new_with(policy, false, false)
    }

    /// [`Self::new`], asking for cooperative matrices only when `coop`
    /// (or, `emulate`, for f16 alone where the adapter has no cooperative
    /// matrices: [`Self::coop_emulated`]).
    pub fn new_with(policy: AdapterPolicy, coop: bool, emulate: bool) -> Result<Self> {
        let adapters = Self::adapters();
        let Some(adapter) = adapters.into_iter().next() else {
            return Err(Error::NoGpuAdapter {
                reason: "wgpu found no adapter on any backend (on Linux, install a Vulkan driver such as mesa-vulkan-drivers)".into(),
            });
        };
        let info = adapter.get_info();
        policy.check(&info)?;
        let emulate =
            emulate && !coop_supported(&adapter) && adapter.features().contains(wgpu::Features::SHADER_F16);
        let coop = coop && coop_supported(&adapter);
        let (features, experimental) = if emulate {
            (engine_features(&adapter) | wgpu::Features::SHADER_F16, wgpu::ExperimentalFeatures::disabled())
        } else if coop {
            // SAFETY: wgpu marks cooperative matrices experimental (its
            // implementation may still have bugs). The engine only builds
            // `int8_matmul_coop` on such a device, checks it against the
            // CPU reference at start-up and falls back to the f32 program
            // when the build or the check fails.
            let features = engine_features(&adapter) | COOP_FEATURES;
            (features, unsafe { wgpu::ExperimentalFeatures::enabled() })
        } else {
            (engine_features(&adapter), wgpu::ExperimentalFeatures::disabled())
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("qwen3-wgpu"),
            required_features: features,
            required_limits: adapter.limits(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| Error::GpuDeviceFailed { reason: format!("request_device on {}: {e}", info.name) })?;
        let mut gpu = Self::wrap(device, queue, info);
        gpu.coop = (coop || emulate) && gpu.subgroups;
        gpu.coop_emulated = emulate && gpu.subgroups;
        gpu.watch_faults();
        Ok(gpu)
    }

    /// Adopts a device the host application already owns (e.g. its
    /// renderer's). No second device is created; the policy still applies.
    /// The host's uncaptured-error handler and device-lost callback stay
    /// as the host set them: the engine catches its own errors with error
    /// scopes. Prompt batches run without cooperative matrices there (the
    /// device does not say which ones its adapter offers).
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue, policy: AdapterPolicy) -> Result<Self> {
        let info = device.adapter_info();
        policy.check(&info)?;
        Ok(Self::wrap(device, queue, info))
    }

    fn wrap(device: wgpu::Device, queue: wgpu::Queue, info: wgpu::AdapterInfo) -> Self {
        let subgroups = device.features().contains(wgpu::Features::SUBGROUP);
        Gpu {
            device,
            queue,
            info,
            subgroups,
            coop: false,
            coop_emulated: false,
            faults: Default::default(),
            prompt_gate: Default::default(),
        }
    }

    /// On a device the engine created: records errors no scope caught and
    /// the device's loss, for [`Self::check_fault`].
    fn watch_faults(&self) {
        let sink = self.faults.clone();
        self.device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut f) = sink.lock() {
                f.uncaptured.get_or_insert_with(|| e.to_string());
            }
        }));
        let sink = self.faults.clone();
        self.device.set_device_lost_callback(move |reason, msg| {
            if let Ok(mut f) = sink.lock() {
                f.lost.get_or_insert_with(|| format!("device lost ({reason:?}): {msg}"));
            }
        });
    }

    /// One tiny upload and readback: proves the device and queue work (an
    /// adopted device may already be lost or destroyed).
    pub fn probe(&self) -> Result<()> {
        const MAGIC: u32 = 0x51E3_0F00;
        let buf = self.storage_init("probe", &MAGIC.to_le_bytes())?;
        let back = self.download(&buf, 4)?;
        if back != MAGIC.to_le_bytes() {
            return Err(Error::GpuDeviceFailed { reason: format!("probe read back {back:?}") });
        }
        Ok(())
    }

    /// Polls the device once without waiting (mapping what has finished)
    /// and reports a fault as [`Self::check_fault`] does.
    pub(crate) fn poll_once(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Poll)
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
        self.check_fault()
    }

    /// Fails with `gpu_device_failed` if the device was lost (every call
    /// after) or reported an error outside any scope since the last check
    /// (that call only).
    pub fn check_fault(&self) -> Result<()> {
        let Ok(mut f) = self.faults.lock() else { return Ok(()) };
        match f.lost.clone().or_else(|| f.uncaptured.take()) {
            Some(reason) => Err(Error::GpuDeviceFailed { reason }),
            None => Ok(()),
        }
    }

    /// Runs `f` inside error scopes for every class wgpu reports
    /// (validation, out of memory, and internal: a backend compiler
    /// rejecting a shader, a pipeline that fails to link) and turns a
    /// captured error into `make_err(message)`.
    pub fn scoped<T>(
        &self,
        f: impl FnOnce() -> Result<T>,
        make_err: impl FnOnce(String) -> Error,
    ) -> Result<T> {
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        let i = pollster::block_on(internal.pop());
        if let Some(e) = v.or(o).or(i) {
            return Err(make_err(error_text(&e)));
        }
        self.check_fault()?;
        out
    }

    /// A storage buffer initialised from `data` (padded to 4 bytes).
    pub fn storage_init(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let size = data.len().div_ceil(4).max(1) * 4;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        fill_mapped(&buf, data)?;
        Ok(buf)
    }

    /// A bind group on `layout` of `resources` (whole buffers or ranges),
    /// in binding order.
    pub(crate) fn bind_group<'a>(
        &self,
        label: &str,
        layout: &wgpu::BindGroupLayout,
        resources: impl IntoIterator<Item = wgpu::BindingResource<'a>>,
    ) -> wgpu::BindGroup {
        let entries: Vec<_> = resources
            .into_iter()
            .enumerate()
            .map(|(i, resource)| wgpu::BindGroupEntry { binding: i as u32, resource })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout,
            entries: &entries,
        })
    }

    /// A zero-filled storage buffer of `bytes` bytes.
    pub fn storage(&self, label: &str, bytes: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (bytes.div_ceil(4).max(1) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// A uniform buffer holding `data` (writable later with `queue.write_buffer`).
    pub fn uniform(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let size = data.len().div_ceil(16).max(1) * 16;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: true,
        });
        fill_mapped(&buf, data)?;
        Ok(buf)
    }

    /// A buffer the CPU can map for reading, `bytes` long.
    pub fn readback(&self, label: &str, bytes: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (bytes.div_ceil(4).max(1) * 4) as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// The ticket for one polled prompt submit ([`PromptTicket`]), or
    /// `None` while another is in flight.
    pub(crate) fn try_prompt_ticket(&self) -> Option<PromptTicket> {
        self.prompt_gate
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| PromptTicket(self.prompt_gate.clone()))
    }

    /// Maps a readback buffer, waits for the GPU, and copies its bytes out.
    pub fn read(&self, buf: &wgpu::Buffer) -> Result<Vec<u8>> {
        let slice = buf.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
        self.check_fault()?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Error::GpuDeviceFailed { reason: format!("map_async: {e}") }),
            Err(_) => return Err(Error::GpuDeviceFailed { reason: "map_async callback never ran".into() }),
        }
        let bytes = slice
            .get_mapped_range()
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("reading back: {e}") })?
            .to_vec();
        buf.unmap();
        Ok(bytes)
    }

    /// Copies a storage buffer's first `bytes` bytes back to the CPU (tests,
    /// diagnostics; the decode loop reads only the 4-byte token).
    pub fn download(&self, src: &wgpu::Buffer, bytes: usize) -> Result<Vec<u8>> {
        let staging = self.readback("download", bytes);
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, 0, &staging, 0, staging.size());
        self.queue.submit([enc.finish()]);
        let mut out = self.read(&staging)?;
        out.truncate(bytes);
        Ok(out)
    }
}

/// Bytes of one [`UniformPages`] buffer.
pub const UNIFORM_PAGE_BYTES: u64 = 16 * 1024;

/// Small uniform blocks (each launch's parameters) packed into shared
/// buffers of [`UNIFORM_PAGE_BYTES`] at the device's offset alignment: a
/// session's ~300 launches take a handful of buffers, not one allocation
/// each.
pub struct UniformPages {
    pages: Vec<wgpu::Buffer>,
    /// Bytes used in the last page.
    used: u64,
    /// The device's uniform offset alignment.
    align: u64,
}

impl UniformPages {
    /// No pages yet: the first [`Self::push`] creates one.
    pub fn new(gpu: &Gpu) -> Self {
        let align = gpu.device.limits().min_uniform_buffer_offset_alignment as u64;
        UniformPages { pages: Vec::new(), used: UNIFORM_PAGE_BYTES, align }
    }

    /// Copies `data` (a multiple of 4 bytes) into a page; returns the page
    /// and the offset and size to bind (the size rounded up to 16 bytes, a
    /// uniform struct's granularity).
    pub fn push(&mut self, gpu: &Gpu, data: &[u8]) -> (wgpu::Buffer, u64, u64) {
        let size = (data.len() as u64).div_ceil(16).max(1) * 16;
        let offset = self.used.next_multiple_of(self.align);
        let (page, offset) = match self.pages.last() {
            Some(page) if offset + size <= UNIFORM_PAGE_BYTES => (page.clone(), offset),
            _ => {
                let page = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("launch parameters"),
                    size: UNIFORM_PAGE_BYTES.max(size),
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                self.pages.push(page.clone());
                (page, 0)
            }
        };
        gpu.queue.write_buffer(&page, offset, data);
        self.used = offset + size;
        (page, offset, size)
    }

    /// Bytes of every page.
    pub fn bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.size()).sum()
    }
}

/// `count` GPU timestamp queries with the buffers that resolve them and
/// bring them back (the diagnostics' timing: see `Session::timed_step`).
pub struct Timestamps {
    /// The queries, written by `write_timestamp` or a pass's timestamp writes.
    pub set: wgpu::QuerySet,
    count: u32,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
}

impl Timestamps {
    /// `count` queries named `label`.
    pub fn new(gpu: &Gpu, label: &str, count: u32) -> Self {
        let bytes = 8 * count as u64;
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some(label),
            ty: wgpu::QueryType::Timestamp,
            count,
        });
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.div_ceil(256) * 256,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Timestamps { set, count, resolve, readback: gpu.readback(label, bytes as usize) }
    }

    /// The pass's start and end as timestamps 0 and 1.
    pub fn pass_writes(&self) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.set,
            beginning_of_pass_write_index: Some(0),
            end_of_pass_write_index: Some(1),
        }
    }

    /// Records the resolve and the copy back (after the timed passes).
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        enc.resolve_query_set(&self.set, 0..self.count, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, 8 * self.count as u64);
    }

    /// Waits for the submitted commands and returns the time between
    /// consecutive timestamps, in microseconds.
    pub fn intervals_us(&self, gpu: &Gpu) -> Result<Vec<f64>> {
        let t: Vec<u64> = bytemuck::pod_collect_to_vec(&gpu.read(&self.readback)?);
        let period = gpu.queue.get_timestamp_period() as f64;
        Ok(t.windows(2).map(|w| w[1].saturating_sub(w[0]) as f64 * period / 1e3).collect())
    }
}

/// A wgpu error's text with its sources (wgpu's `Display` is the first
/// line only for some errors).
fn error_text(e: &wgpu::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let line = s.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = s.source();
    }
    text
}

/// Features used when the adapter has them.
pub fn wanted_features() -> wgpu::Features {
    wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
}

/// The subgroup size `int8_matmul_coop` is written for (its 32 x 32 blocks
/// are one subgroup's).
pub const COOP_SUBGROUP_SIZE: u32 = 32;

/// The device features `int8_matmul_coop` needs.
const COOP_FEATURES: wgpu::Features =
    wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16);

/// Whether `adapter` offers what `int8_matmul_coop` is written for:
/// cooperative matrices with 16x16x16 f16 operands and f32 sums, f16, and
/// subgroups of exactly 32 lanes (its blocks of 32 x 32 are one subgroup's;
/// NVIDIA through Vulkan). Apple GPUs through wgpu offer 8x8 f32 ones only:
/// there the MSL twin of `int8_matmul` runs on SIMD-group matrices.
pub fn coop_supported(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    let f16_16 = adapter.cooperative_matrix_properties().iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    adapter.features().contains(COOP_FEATURES | wgpu::Features::SUBGROUP)
        && f16_16
        && info.subgroup_min_size == COOP_SUBGROUP_SIZE
        && info.subgroup_max_size == COOP_SUBGROUP_SIZE
}

/// The features of [`wanted_features`] `adapter` offers, plus passthrough
/// shaders on Metal (for the MSL twins, src/kernels/msl.rs; elsewhere it would
/// mean SPIR-V).
pub(crate) fn engine_features(adapter: &wgpu::Adapter) -> wgpu::Features {
    let mut wanted = wanted_features();
    if adapter.get_info().backend == wgpu::Backend::Metal {
        wanted |= wgpu::Features::PASSTHROUGH_SHADERS;
    }
    adapter.features() & wanted
}

/// wgpu's default limits, raised to `adapter`'s where the engine uses more.
pub(crate) fn engine_limits(adapter: &wgpu::Adapter) -> wgpu::Limits {
    let a = adapter.limits();
    wgpu::Limits {
        max_buffer_size: a.max_buffer_size,
        max_storage_buffer_binding_size: a.max_storage_buffer_binding_size,
        max_compute_workgroup_storage_size: a.max_compute_workgroup_storage_size,
        max_compute_invocations_per_workgroup: a.max_compute_invocations_per_workgroup,
        max_compute_workgroup_size_x: a.max_compute_workgroup_size_x,
        max_compute_workgroups_per_dimension: a.max_compute_workgroups_per_dimension,
        ..wgpu::Limits::default()
    }
}

/// Writes `data` into a buffer created `mapped_at_creation`, then unmaps it.
fn fill_mapped(buf: &wgpu::Buffer, data: &[u8]) -> Result<()> {
    {
        let mut view = buf
            .slice(..)
            .get_mapped_range_mut()
            .map_err(|e| Error::GpuDeviceFailed { reason: format!("mapping a new buffer: {e}") })?;
        view.slice(..data.len()).copy_from_slice(data);
    }
    buf.unmap();
    Ok(())
}
