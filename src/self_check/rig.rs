//! The rig the checks record into: launches of the engine's pipelines in one
//! encoder, readbacks of their outputs, and the byte helpers the checks share.

use bytemuck::bytes_of;
use half::f16;

use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::{Kernel, Kernels, Step};

/// Records launches of the engine's pipelines into one encoder and the
/// copies of their outputs into readback buffers.
pub(super) struct Rig<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) kernels: &'a Kernels,
    pub(super) enc: wgpu::CommandEncoder,
    /// Readback buffers and the bytes each holds.
    readbacks: Vec<(wgpu::Buffer, usize)>,
    /// The pipelines launched: each kernel's decode pipeline, and its
    /// prompt-batch one (`true`: the tiled product, `attention_prefill`),
    /// over weights in each format.
    pub(super) ran: Vec<(Kernel, bool, WeightFormat)>,
}

impl<'a> Rig<'a> {
    pub(super) fn new(gpu: &'a Gpu, kernels: &'a Kernels) -> Self {
        let enc =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("self-check") });
        Rig { gpu, kernels, enc, readbacks: Vec::new(), ran: Vec::new() }
    }

    pub(super) fn storage(&self, data: &[u8]) -> Result<wgpu::Buffer> {
        self.gpu.storage_init("self-check", data)
    }

    pub(super) fn uniform(&self, data: &[u8]) -> Result<wgpu::Buffer> {
        self.gpu.uniform("self-check", data)
    }

    /// One launch of `kernel`'s engine pipeline with `buffers` in binding order.
    pub(super) fn dispatch(&mut self, kernel: Kernel, workgroups: [u32; 3], buffers: &[&wgpu::Buffer]) {
        self.dispatch_in(kernel, WeightFormat::Int8, workgroups, buffers);
    }

    /// [`Self::dispatch`] of `kernel`'s pipeline over weights in `format`.
    pub(super) fn dispatch_in(
        &mut self,
        kernel: Kernel,
        format: WeightFormat,
        workgroups: [u32; 3],
        buffers: &[&wgpu::Buffer],
    ) {
        let pipeline = self.kernels.get_for(kernel, format).pipeline;
        self.dispatch_pipeline(kernel, false, format, &pipeline, workgroups, buffers);
    }

    /// One launch of `pipeline`, one of `kernel`'s (`tiled`: its tiled
    /// prompt-batch one) over weights in `format`, with `buffers` in
    /// binding order.
    pub(super) fn dispatch_pipeline(
        &mut self,
        kernel: Kernel,
        tiled: bool,
        format: WeightFormat,
        pipeline: &wgpu::ComputePipeline,
        workgroups: [u32; 3],
        buffers: &[&wgpu::Buffer],
    ) {
        record_launch(self.gpu, &mut self.enc, self.kernels.layout(kernel), pipeline, workgroups, buffers);
        self.note_ran(kernel, tiled, format);
    }

    /// Notes that `kernel`'s decode (or, `tiled`, prompt-batch) pipeline
    /// over weights in `format` ran.
    pub(super) fn note_ran(&mut self, kernel: Kernel, tiled: bool, format: WeightFormat) {
        if !self.ran.contains(&(kernel, tiled, format)) {
            self.ran.push((kernel, tiled, format));
        }
    }

    /// Copies `buf`'s first `bytes` back after the launches; returns the
    /// index of its contents in [`Self::finish`]'s result.
    pub(super) fn read(&mut self, buf: &wgpu::Buffer, bytes: usize) -> usize {
        let staging = self.gpu.readback("self-check", bytes);
        self.enc.copy_buffer_to_buffer(buf, 0, &staging, 0, staging.size());
        self.readbacks.push((staging, bytes));
        self.readbacks.len() - 1
    }

    /// Submits everything, waits once, and returns every read buffer.
    pub(super) fn finish(&mut self) -> Result<Vec<Vec<u8>>> {
        let enc = std::mem::replace(
            &mut self.enc,
            self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
        );
        self.gpu.scoped(
            || {
                self.gpu.queue.submit([enc.finish()]);
                Ok(())
            },
            |reason| Error::GpuDeviceFailed { reason: format!("self-check submit: {reason}") },
        )?;
        self.readbacks
            .iter()
            .map(|(b, bytes)| {
                let mut out = self.gpu.read(b)?;
                out.truncate(*bytes);
                Ok(out)
            })
            .collect()
    }
}

/// Records one launch of `pipeline` into `enc`, with `buffers` bound in
/// binding order on `layout`.
pub(super) fn record_launch(
    gpu: &Gpu,
    enc: &mut wgpu::CommandEncoder,
    layout: &wgpu::BindGroupLayout,
    pipeline: &wgpu::ComputePipeline,
    workgroups: [u32; 3],
    buffers: &[&wgpu::Buffer],
) {
    let bind_group = bind_group(gpu, layout, buffers);
    let mut pass = enc.begin_compute_pass(&Default::default());
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(workgroups[0], workgroups[1], workgroups[2]);
}

/// A bind group of `buffers` (whole, in binding order) on `layout`.
pub(super) fn bind_group(
    gpu: &Gpu,
    layout: &wgpu::BindGroupLayout,
    buffers: &[&wgpu::Buffer],
) -> wgpu::BindGroup {
    gpu.bind_group("self-check", layout, buffers.iter().map(|b| b.as_entire_binding()))
}

pub(super) fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub(super) fn u32s(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub(super) fn to_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}

pub(super) fn to_u32(b: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(b)
}

pub(super) fn f16s(v: &[f32]) -> Vec<f16> {
    v.iter().map(|x| f16::from_f32(*x)).collect()
}

/// The GPU decode state.
pub(super) fn step(pos: usize, fill_end: usize) -> Vec<u8> {
    bytes_of(&Step { pos: pos as u32, fill_end: fill_end as u32 }).to_vec()
}

pub(super) fn fail(kernel: Kernel, how: impl Into<String>) -> Vec<(String, String)> {
    vec![(format!("{kernel:?}"), how.into())]
}
