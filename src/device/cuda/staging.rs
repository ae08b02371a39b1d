//! Page-locked staging for uploads. A copy from pageable host memory may make the driver
//! wait for the stream before it stages the bytes, an implicit round trip; copies from
//! page-locked memory are queued like kernels. Small uploads (a micro-batch's token ids,
//! the embedding backward's buckets) therefore go through a ring of page-locked slots,
//! each reused once the copy queued from it has run.

use super::driver::driver_error;
use crate::error::Result;
use cudarc::driver::{result as drv, sys as drv_sys};
use std::ffi::c_void;

/// Slots in the ring: a step with many micro-batches queues several uploads per
/// micro-batch before the host waits for its loss.
const SLOTS: usize = 64;
/// Bytes per slot: the token ids of 64k positions, or a 50k vocabulary's offsets.
pub(crate) const SLOT_BYTES: usize = 256 << 10;

/// A ring of page-locked slots, each with the event recorded after its last copy.
pub(crate) struct Staging {
    host: *mut u8,
    events: Vec<drv_sys::CUevent>,
    recorded: Vec<bool>,
    next: usize,
}

// SAFETY: the host buffer and events are only touched under the owner's lock, with the
// context bound.
unsafe impl Send for Staging {}

impl Staging {
    /// Allocates the ring (the context must be current).
    pub(crate) fn new() -> Result<Staging> {
        // SAFETY: a plain page-locked allocation; freed in Drop.
        let host = unsafe { drv::malloc_host(SLOTS * SLOT_BYTES, 0) }
            .map_err(|e| driver_error("allocating page-locked staging memory", e))?
            as *mut u8;
        let mut s = Staging {
            host,
            events: Vec::with_capacity(SLOTS),
            recorded: vec![false; SLOTS],
            next: 0,
        };
        for _ in 0..SLOTS {
            let e = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| driver_error("creating a staging event", e))?;
            s.events.push(e);
        }
        Ok(s)
    }

    /// Queues the copy of `src` to `dst` on `stream` through the next slot. Returns
    /// `Ok(None)` when `src` is larger than a slot (the caller copies it another way),
    /// else whether the host had to wait for the slot's previous copy.
    ///
    /// # Safety
    /// `dst` must address at least `src.len()` bytes of device memory, and the context
    /// that owns `stream` must be current.
    pub(crate) unsafe fn upload(
        &mut self,
        dst: drv_sys::CUdeviceptr,
        src: &[u8],
        stream: drv_sys::CUstream,
    ) -> Result<Option<bool>> {
        if src.len() > SLOT_BYTES {
            return Ok(None);
        }
        let slot = self.next;
        self.next = (self.next + 1) % SLOTS;
        let event = self.events[slot];
        let mut waited = false;
        if self.recorded[slot] {
            // SAFETY: the event was created and recorded here.
            if unsafe { drv::event::query(event) }.is_err() {
                waited = true;
                unsafe { drv::event::synchronize(event) }
                    .map_err(|e| driver_error("waiting for a staging slot", e))?;
            }
        }
        // SAFETY: the slot is `SLOT_BYTES` long and no queued copy reads it any more.
        let host =
            unsafe { std::slice::from_raw_parts_mut(self.host.add(slot * SLOT_BYTES), src.len()) };
        host.copy_from_slice(src);
        // SAFETY: the caller's contract; the slot stays untouched until the event passes.
        unsafe {
            drv_sys::cuMemcpyHtoDAsync_v2(dst, host.as_ptr() as *const c_void, src.len(), stream)
                .result()
                .map_err(|e| driver_error("copying to the GPU", e))?;
            drv::event::record(event, stream)
                .map_err(|e| driver_error("recording a staging event", e))?;
        }
        self.recorded[slot] = true;
        Ok(Some(waited))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The owner synchronizes its stream before dropping this.
        // SAFETY: created in `new`, not used after this.
        unsafe {
            for &e in &self.events {
                let _ = drv::event::destroy(e);
            }
            let _ = drv::free_host(self.host as *mut c_void);
        }
    }
}
