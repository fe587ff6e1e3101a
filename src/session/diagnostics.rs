//! Diagnostics of a session (the `profile` and `bench` tools): one step
//! timed (encode, GPU, wall), each launch timed by GPU timestamps or by a
//! wait after it, steps back to back, a subset of a step's launches. Each
//! runs with nothing queued ahead and leaves the GPU's position where the
//! session's count says.

use super::{check_prompt, Session};
use crate::error::{Error, Result};
use crate::gpu::Timestamps;
use crate::kernels::{Launch, LaunchKind};

/// Where one decode step's time went (see [`Session::timed_step`]).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct StepTiming {
    /// CPU time to record the step's commands, microseconds.
    pub encode_us: f64,
    /// GPU time of the forward pass, microseconds (None without timestamp queries).
    pub gpu_us: Option<f64>,
    /// Wall time of the whole step, readback included, microseconds.
    pub wall_us: f64,
}

/// Each launch of a step with its GPU times in microseconds (one per run;
/// see [`Session::profile_gpu`]).
pub type LaunchTimes = Vec<(LaunchKind, Vec<f64>)>;

impl Session {
    /// Like [`next_token`](Self::next_token), and reports where the time
    /// went: CPU encoding, GPU time of the pass (from timestamp queries,
    /// when the device has them), and the whole step's wall time. Runs the
    /// step alone (nothing queued ahead), so the figures are one step's.
    pub fn timed_step(&mut self) -> Result<StepTiming> {
        self.settle_batch();
        self.check_can_step(1)?;
        self.discard_queued()?;
        let gpu = self.model.gpu.clone();
        let timestamps = gpu
            .device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
            .then(|| Timestamps::new(&gpu, "step timestamps", 2));
        let t0 = std::time::Instant::now();
        let mut enc = self.encoder();
        self.record(&mut enc, self.len..self.len + 1, timestamps.as_ref());
        let encode_us = t0.elapsed().as_secs_f64() * 1e6;
        if let Some(t) = &timestamps {
            t.resolve(&mut enc);
        }
        let slot = self.queue_readback(&mut enc, self.len + 1)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos += 1;
        self.take_queued(false)?;
        let wall_us = t0.elapsed().as_secs_f64() * 1e6;
        let gpu_us = match &timestamps {
            Some(t) => t.intervals_us(&gpu)?.first().copied(),
            None => None,
        };
        Ok(StepTiming { encode_us, gpu_us, wall_us })
    }

    /// Runs one decode step with a GPU timestamp after every launch (needs
    /// `TIMESTAMP_QUERY_INSIDE_PASSES`) and returns each launch's GPU time
    /// (kernel, microseconds per run). `None` when the device cannot time
    /// inside a pass. With `repeats > 1` every launch runs that many times
    /// back to back (its later runs find their inputs in cache): a
    /// diagnostic whose step results are not the model's (residual adds run
    /// repeatedly), so use a throwaway session for it. Advances the session
    /// by one position like [`next_token`](Self::next_token).
    #[doc(hidden)]
    pub fn profile_gpu(&mut self, repeats: u32) -> Result<Option<LaunchTimes>> {
        self.settle_batch();
        let gpu = self.model.gpu.clone();
        self.check_can_step(1)?;
        let repeats = repeats.max(1);
        let launches: Vec<Launch> = self.forward.step_at(self.len).cloned().collect();
        // One timestamp per launch run, plus the first: a query set holds at most 4096.
        let n = u32::try_from(launches.len())
            .ok()
            .and_then(|l| l.checked_mul(repeats)?.checked_add(1))
            .filter(|&n| n <= wgpu::QUERY_SET_MAX_QUERIES)
            .ok_or_else(|| {
                let most = (wgpu::QUERY_SET_MAX_QUERIES - 1) as usize / launches.len().max(1);
                Error::invalid_argument(
                    "repeats",
                    format!("{repeats} runs of {} launches need more timestamps than a query set holds; at most {most}", launches.len()),
                )
            })?;
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        self.discard_queued()?;
        let ts = Timestamps::new(&gpu, "launch timestamps", n);
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&ts.set, 0);
            let mut q = 1;
            for l in &launches {
                for _ in 0..repeats {
                    l.record(&mut pass, &self.model.kernels);
                    pass.write_timestamp(&ts.set, q);
                    q += 1;
                }
            }
        }
        ts.resolve(&mut enc);
        let slot = self.queue_readback(&mut enc, self.len + 1)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos += 1;
        self.take_queued(false)?;
        if repeats > 1 {
            // argmax_final advanced the GPU's position once per run.
            self.reset_gpu_position();
        }
        let us = ts.intervals_us(&gpu)?;
        Ok(Some(
            launches
                .iter()
                .zip(us.chunks(repeats as usize))
                .map(|(l, runs)| (l.kind(), runs.to_vec()))
                .collect(),
        ))
    }

    /// Runs one prompt batch of `ids` (at most the batch size) through the
    /// layers with a GPU timestamp after every launch and returns each
    /// launch's GPU time (kernel, microseconds). `None` when the device
    /// cannot time inside a pass. A diagnostic: appends the tokens to the
    /// context like [`feed`](Self::feed) minus its last step (no pending
    /// prediction is made).
    #[doc(hidden)]
    pub fn profile_prefill(&mut self, ids: &[u32]) -> Result<Option<LaunchTimes>> {
        self.settle_batch();
        let gpu = self.model.gpu.clone();
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
            return Ok(None);
        }
        check_prompt(ids, self.model.config.vocab_size)?;
        self.check_room(ids.len())?;
        let n = ids.len().min(self.bufs.batch);
        self.discard_queued()?;
        gpu.queue.write_buffer(&self.bufs.tokens, 4 * self.len as u64, bytemuck::cast_slice(&ids[..n]));
        self.write_step_at(self.len, self.len + n);
        let launches = &self.forward.prefill;
        let ts = Timestamps::new(&gpu, "prefill timestamps", launches.len() as u32 + 1);
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&ts.set, 0);
            for (i, l) in launches.iter().enumerate() {
                l.record_batch(&mut pass, &self.model.kernels, n as u32);
                pass.write_timestamp(&ts.set, i as u32 + 1);
            }
        }
        ts.resolve(&mut enc);
        gpu.queue.submit([enc.finish()]);
        let us = ts.intervals_us(&gpu)?;
        self.len += n;
        self.gpu_pos = self.len;
        self.pending = None;
        Ok(Some(launches.iter().zip(us).map(|(l, t)| (l.kind(), vec![t])).collect()))
    }

    /// GPU time per step (microseconds) of `n` decode steps recorded back to
    /// back in one pass, as decode records a submit's steps, with no
    /// readbacks (timestamps at the pass's start and end): the GPU's own
    /// rate, to set beside the rate a caller sees. Leaves the session as it
    /// was (the steps' tokens and KV entries lie past its length). `None`
    /// without timestamps.
    #[doc(hidden)]
    pub fn gpu_time_of_steps(&mut self, n: usize) -> Result<Option<f64>> {
        self.settle_batch();
        let gpu = self.model.gpu.clone();
        if n == 0 {
            return Ok(None);
        }
        // The count is checked on every device, with timestamps or without.
        self.check_can_step(n)?;
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Ok(None);
        }
        self.discard_queued()?;
        let ts = Timestamps::new(&gpu, "steps timestamps", 2);
        let mut enc = self.encoder();
        self.record(&mut enc, self.len..self.len + n, Some(&ts));
        ts.resolve(&mut enc);
        gpu.queue.submit([enc.finish()]);
        let us = ts.intervals_us(&gpu)?;
        // argmax_final advanced the GPU's position n times: put it back.
        self.reset_gpu_position();
        Ok(us.first().map(|t| t / n as f64))
    }

    /// GPU time (microseconds, from timestamps at the start and end of one
    /// pass) of the step's launches for which `keep` is true, run in order
    /// without the others: how much a kind of launch costs in sequence,
    /// with no timestamps between launches. A diagnostic: the launches run
    /// on whatever their inputs hold, so the session's results after it are
    /// not the model's (use a throwaway session). `None` without timestamps.
    #[doc(hidden)]
    pub fn gpu_time_of(&mut self, keep: impl Fn(LaunchKind) -> bool) -> Result<Option<f64>> {
        self.settle_batch();
        let gpu = self.model.gpu.clone();
        if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Ok(None);
        }
        self.discard_queued()?;
        let ts = Timestamps::new(&gpu, "subset timestamps", 2);
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("subset"),
                timestamp_writes: Some(ts.pass_writes()),
            });
            for l in self.forward.step_at(self.len).filter(|l| keep(l.kind())) {
                l.record(&mut pass, &self.model.kernels);
            }
        }
        ts.resolve(&mut enc);
        gpu.queue.submit([enc.finish()]);
        let us = ts.intervals_us(&gpu)?;
        // Whatever the subset did to the position, put it back.
        self.reset_gpu_position();
        Ok(us.first().copied())
    }

    /// Runs one decode step with a wait after every launch and returns the
    /// wall time of each (kind, microseconds): a coarse per-kernel profile
    /// for adapters without timestamp queries inside passes. Advances the
    /// session by one position like [`next_token`](Self::next_token).
    #[doc(hidden)]
    pub fn profile_step(&mut self) -> Result<Vec<(LaunchKind, f64)>> {
        self.settle_batch();
        self.check_can_step(1)?;
        self.discard_queued()?;
        let gpu = self.model.gpu.clone();
        let mut out = Vec::new();
        for l in self.forward.step_at(self.len) {
            let t = std::time::Instant::now();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                l.record(&mut pass, &self.model.kernels);
            }
            gpu.queue.submit([enc.finish()]);
            gpu.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| Error::GpuDeviceFailed { reason: format!("poll: {e}") })?;
            out.push((l.kind(), t.elapsed().as_secs_f64() * 1e6));
        }
        let mut enc = self.encoder();
        let slot = self.queue_readback(&mut enc, self.len + 1)?;
        self.submit_with_readback(enc, slot);
        self.gpu_pos += 1;
        self.take_queued(false)?;
        Ok(out)
    }

    /// Copies a session buffer back (tests and diagnostics).
    #[doc(hidden)]
    pub fn debug_logits(&self) -> Result<Vec<f32>> {
        let n = self.model.config.vocab_size;
        let bytes = self.model.gpu.download(&self.bufs.logits, 4 * n)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}
