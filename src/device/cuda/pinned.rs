//! Page-locked host memory for offloaded tensors (allocated here) and for the host
//! tensors of an offloaded optimizer (the caller's memory, locked here), and the events
//! that order the copies between the compute stream and the copy stream.
//!
//! An offload waits on the device for the compute work queued so far (an event recorded
//! on the compute stream), then copies to the host on the copy stream; the device memory
//! is freed on the copy stream, after the copy. A fetch copies back on the copy stream
//! and records a ticket event; compute waits for it (on the device) only where the tensor
//! is first used, so a copy issued early overlaps with compute and costs time only when
//! it is late. Host buffers are kept after their tensor is dropped and reused by size
//! once the event after their last copy has passed: page-locked allocation and freeing
//! are slow and synchronize the device.

use super::driver_error::driver_error;
use super::gpu::{HostPtr, Ticket};
use crate::error::Result;
use cudarc::driver::{result as drv, sys as drv_sys};
use std::collections::HashMap;
use std::ffi::c_void;

/// A page-locked buffer and the event recorded after the last copy that touched it.
struct Block {
    bytes: usize,
    event: drv_sys::CUevent,
    recorded: bool,
    /// Memory the caller owns, locked by [`Pinned::register`] (unlocked, never freed or
    /// reused, here).
    registered: bool,
}

/// The smallest host buffer worth locking: below it the lock costs more than the faster
/// copy saves, and small buffers share pages with others.
const MIN_REGISTERED: usize = 1 << 20;

/// The page-locked buffers of offloaded tensors, the ordering event and the tickets.
pub(crate) struct Pinned {
    blocks: HashMap<HostPtr, Block>,
    /// Buffers no tensor holds, to be reused.
    idle: Vec<HostPtr>,
    /// Recorded on the compute stream; the copy stream waits for it.
    order: drv_sys::CUevent,
    /// One event per ticket; `free_tickets` are not awaited by anyone.
    tickets: Vec<drv_sys::CUevent>,
    free_tickets: Vec<Ticket>,
}

// SAFETY: the buffers and events are only touched under the owner's lock, with the
// context bound.
unsafe impl Send for Pinned {}

fn event() -> Result<drv_sys::CUevent> {
    drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| driver_error("creating an event for offloading", e))
}

impl Pinned {
    /// An empty pool (the context must be current).
    pub(crate) fn new() -> Result<Pinned> {
        Ok(Pinned {
            blocks: HashMap::new(),
            idle: Vec::new(),
            order: event()?,
            tickets: Vec::new(),
            free_tickets: Vec::new(),
        })
    }

    /// A page-locked buffer of `bytes`: an idle one of that size whose copies are done,
    /// or a new one.
    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<HostPtr> {
        let reusable = self.idle.iter().position(|p| {
            let b = &self.blocks[p];
            // SAFETY: the event was created here.
            !b.registered
                && b.bytes == bytes
                && (!b.recorded || unsafe { drv::event::query(b.event) }.is_ok())
        });
        if let Some(i) = reusable {
            return Ok(self.idle.swap_remove(i));
        }
        // SAFETY: a plain page-locked allocation, freed in Drop.
        let ptr = unsafe { drv::malloc_host(bytes, 0) }
            .map_err(|e| driver_error("allocating page-locked memory for offloading", e))?
            as HostPtr;
        let block = Block {
            bytes,
            event: event()?,
            recorded: false,
            registered: false,
        };
        self.blocks.insert(ptr, block);
        Ok(ptr)
    }

    /// Marks `ptr` idle: reused once its last copy has run.
    pub(crate) fn release(&mut self, ptr: HostPtr) {
        if self.blocks.get(&ptr).is_some_and(|b| !b.registered) {
            self.idle.push(ptr);
        }
    }

    /// Page-locks `bytes` of the caller's host memory at `ptr`; false when they stay
    /// pageable (under [`MIN_REGISTERED`], already known here, or refused by the driver).
    pub(crate) fn register(&mut self, ptr: HostPtr, bytes: usize) -> bool {
        if bytes < MIN_REGISTERED || self.blocks.contains_key(&ptr) {
            return false;
        }
        let Ok(event) = event() else {
            return false;
        };
        // SAFETY: the caller owns `bytes` at `ptr` and unregisters them before freeing.
        let locked = unsafe { drv_sys::cuMemHostRegister_v2(ptr as *mut c_void, bytes, 0) };
        if let Err(e) = locked.result() {
            log::debug!("page-locking {bytes} bytes of host memory at {ptr:#x} failed: {e}");
            // SAFETY: created just above, never recorded.
            let _ = unsafe { drv::event::destroy(event) };
            return false;
        }
        let block = Block {
            bytes,
            event,
            recorded: false,
            registered: true,
        };
        self.blocks.insert(ptr, block);
        true
    }

    /// Whether `bytes` at `ptr` are memory [`Pinned::register`] locked.
    pub(crate) fn registered(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.blocks
            .get(&ptr)
            .is_some_and(|b| b.registered && b.bytes >= bytes)
    }

    /// The event after the last copy queued on the buffer at `ptr`, if one was queued.
    pub(crate) fn last_copy(&self, ptr: HostPtr) -> Option<drv_sys::CUevent> {
        self.blocks
            .get(&ptr)
            .filter(|b| b.recorded)
            .map(|b| b.event)
    }

    /// Waits for the copies queued on the registered memory at `ptr`, then unlocks it.
    pub(crate) fn unregister(&mut self, ptr: HostPtr) {
        if !self.blocks.get(&ptr).is_some_and(|b| b.registered) {
            return;
        }
        if let Err(e) = self.settle(ptr) {
            log::error!("{e}");
        }
        if let Some(b) = self.blocks.remove(&ptr) {
            // SAFETY: locked by `register` and not unlocked since; the event was created
            // there.
            unsafe {
                if let Err(e) = drv_sys::cuMemHostUnregister(ptr as *mut c_void).result() {
                    log::error!("unlocking host memory at {ptr:#x} failed: {e}");
                }
                let _ = drv::event::destroy(b.event);
            }
        }
    }

    /// Queues the copy of `bytes` from the device at `src` to the registered host memory
    /// at `dst` on `copy`, after the work queued so far on `compute`; returns the ticket
    /// compute waits for before it touches `src` again.
    ///
    /// # Safety
    /// `src` must address `bytes` of device memory and `dst` registered memory of as many;
    /// the streams belong to the current context.
    pub(crate) unsafe fn download(
        &mut self,
        dst: HostPtr,
        src: drv_sys::CUdeviceptr,
        bytes: usize,
        compute: drv_sys::CUstream,
        copy: drv_sys::CUstream,
    ) -> Result<Ticket> {
        // SAFETY: as the caller promises; `dst` is registered here, so `offload` marks it.
        unsafe { self.offload(dst, src, bytes, compute, copy) }?;
        self.ticket(copy)
    }

    /// Queues the copy of `bytes` from the device at `src` to the host at `dst` on `copy`,
    /// after the work queued so far on `compute`.
    ///
    /// # Safety
    /// `src` must address `bytes` of device memory and `dst` a buffer of this pool (or
    /// registered here); the streams belong to the current context.
    pub(crate) unsafe fn offload(
        &mut self,
        dst: HostPtr,
        src: drv_sys::CUdeviceptr,
        bytes: usize,
        compute: drv_sys::CUstream,
        copy: drv_sys::CUstream,
    ) -> Result<()> {
        unsafe {
            self.after(compute, copy)?;
            drv_sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, copy)
                .result()
                .map_err(|e| driver_error("copying to host memory", e))?;
        }
        self.mark(dst, copy)
    }

    /// Queues the copy of `bytes` from the host at `src` to the device at `dst` on `copy`
    /// (after the work queued so far on `compute`, which allocated `dst`); returns the
    /// ticket compute waits for before it reads `dst`.
    ///
    /// # Safety
    /// As [`Pinned::offload`], the other way.
    pub(crate) unsafe fn fetch(
        &mut self,
        dst: drv_sys::CUdeviceptr,
        src: HostPtr,
        bytes: usize,
        compute: drv_sys::CUstream,
        copy: drv_sys::CUstream,
    ) -> Result<Ticket> {
        unsafe {
            self.after(compute, copy)?;
            drv_sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, copy)
                .result()
                .map_err(|e| driver_error("copying an activation back to the GPU", e))?;
        }
        self.mark(src, copy)?;
        self.ticket(copy)
    }

    /// A ticket recorded after the copy just queued on `copy`.
    fn ticket(&mut self, copy: drv_sys::CUstream) -> Result<Ticket> {
        let ticket = match self.free_tickets.pop() {
            Some(t) => t,
            None => {
                self.tickets.push(event()?);
                (self.tickets.len() - 1) as Ticket
            }
        };
        // SAFETY: the event was created here; the stream is the caller's.
        unsafe { drv::event::record(self.tickets[ticket as usize], copy) }
            .map_err(|e| driver_error("recording a copy's event", e))?;
        Ok(ticket)
    }

    /// Makes `compute` wait (on the device) for the copy of `ticket`; the ticket is free
    /// again afterwards.
    ///
    /// # Safety
    /// `compute` belongs to the current context.
    pub(crate) unsafe fn wait(&mut self, ticket: Ticket, compute: drv_sys::CUstream) -> Result<()> {
        let Some(&e) = self.tickets.get(ticket as usize) else {
            return Ok(());
        };
        unsafe {
            drv::stream::wait_event(
                compute,
                e,
                drv_sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_error("waiting for a copy back to the GPU", e))?;
        self.free_tickets.push(ticket);
        Ok(())
    }

    /// Waits on the host until the last copy touching `ptr` has run.
    pub(crate) fn settle(&self, ptr: HostPtr) -> Result<()> {
        match self.blocks.get(&ptr) {
            // SAFETY: the event was created here.
            Some(b) if b.recorded => unsafe { drv::event::synchronize(b.event) }
                .map_err(|e| driver_error("waiting for a copy to host memory", e)),
            _ => Ok(()),
        }
    }

    /// Makes `copy` wait for the work queued so far on `compute`.
    unsafe fn after(&mut self, compute: drv_sys::CUstream, copy: drv_sys::CUstream) -> Result<()> {
        unsafe {
            drv::event::record(self.order, compute)
                .map_err(|e| driver_error("recording the compute stream's event", e))?;
            drv::stream::wait_event(
                copy,
                self.order,
                drv_sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| driver_error("ordering the copy stream after compute", e))
        }
    }

    /// Records the event of the buffer at `ptr` after the copy just queued on `copy`.
    fn mark(&mut self, ptr: HostPtr, copy: drv_sys::CUstream) -> Result<()> {
        if let Some(b) = self.blocks.get_mut(&ptr) {
            // SAFETY: the event was created here; the stream is the caller's.
            unsafe { drv::event::record(b.event, copy) }
                .map_err(|e| driver_error("recording a copy's event", e))?;
            b.recorded = true;
        }
        Ok(())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // The owner synchronizes both streams before dropping this.
        // SAFETY: created here, not used after this.
        unsafe {
            for (ptr, b) in self.blocks.drain() {
                let _ = drv::event::destroy(b.event);
                if b.registered {
                    let _ = drv_sys::cuMemHostUnregister(ptr as *mut c_void);
                } else {
                    let _ = drv::free_host(ptr as *mut c_void);
                }
            }
            for &e in &self.tickets {
                let _ = drv::event::destroy(e);
            }
            let _ = drv::event::destroy(self.order);
        }
    }
}
