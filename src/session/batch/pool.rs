//! The batch's KV pool and the slot leases its sessions hold.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::buffers::KvRegion;

/// The KV buffers of a batch and which of their regions are free.
pub(super) struct KvPool {
    pub(super) k: Vec<wgpu::Buffer>,
    pub(super) v: Vec<wgpu::Buffer>,
    /// Bytes of one slot's region (a multiple of 256: a binding offset).
    pub(super) region_bytes: u64,
    pub(super) free: Mutex<Vec<usize>>,
    /// Leases handed out so far (each lease's number: a session's identity
    /// in the batch, never reused, unlike its slot).
    pub(super) leases: AtomicU64,
    /// Steps handed to the batch's thread and not submitted yet: what its
    /// sessions queue must follow them ([`KvPool::settle_submits`]).
    pub(super) submits_away: AtomicUsize,
}

impl KvPool {
    /// Counts a step handed to the batch's thread until the returned
    /// guard is dropped (after its submit; also should the task panic or
    /// never run, so no member waits for it forever).
    pub(super) fn hand_off(self: &Arc<Self>) -> HandedOff {
        self.submits_away.fetch_add(1, Ordering::AcqRel);
        HandedOff(self.clone())
    }

    /// Waits until every step handed to the batch's thread is submitted
    /// (at most that thread's work queued before the last: a step's
    /// recording and its submit).
    pub(super) fn settle_submits(&self) {
        while self.submits_away.load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
    }
}

/// A step handed to the batch's thread, counted in
/// [`KvPool::submits_away`] while this lives.
pub(super) struct HandedOff(Arc<KvPool>);

impl Drop for HandedOff {
    fn drop(&mut self) {
        self.0.submits_away.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A session's hold on one slot of a batch's KV pool, given back when the
/// session is dropped.
pub(crate) struct SlotLease {
    pub(super) pool: Arc<KvPool>,
    pub(super) slot: usize,
    /// This lease's number in its pool.
    pub(super) number: u64,
}

impl SlotLease {
    /// Waits until the steps of the lease's batch handed to its thread are
    /// submitted: a session calls it before queuing anything of its own,
    /// which must come after them.
    pub(crate) fn settle_batch_submits(&self) {
        self.pool.settle_submits();
    }

    /// Where the slot's cache lies.
    pub(crate) fn region(&self) -> KvRegion {
        let p = &self.pool;
        KvRegion {
            k: p.k.clone(),
            v: p.v.clone(),
            offset: self.slot as u64 * p.region_bytes,
            bytes: p.region_bytes,
        }
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.slot);
    }
}
