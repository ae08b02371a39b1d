//! Page-locked staging for uploads. A copy from pageable host memory may make the driver
//! wait for the stream before it stages the bytes, an implicit round trip; copies from
//! page-locked memory are queued like kernels. Every upload (a micro-batch's token ids and
//! targets, the embedding backward's buckets, a run's constants) therefore goes through a
//! ring of page-locked bytes: each upload takes the next free bytes, and its bytes are
//! free again once the copy queued from them has run.
//!
//! The ring is sized from what a step needs: where the next bytes are still being copied,
//! the host does not wait for them; the ring grows instead (a new buffer twice as large;
//! the old one is freed once its copies have run). Copies on one stream run in order, so
//! the bytes in flight are one stretch of the ring, oldest first ([`RingPlan`]). A step
//! waits for the device once, to read its loss; every copy queued before has run by then,
//! so after the first steps the ring holds a step's uploads and never grows again. Only
//! an upload larger than [`MAX_UPLOAD`] (weights, once, at load) is copied from pageable
//! memory, and counted as a wait.

use super::driver_error::driver_error;
use crate::error::Result;
use cudarc::driver::{result as drv, sys as drv_sys};
use std::collections::VecDeque;
use std::ffi::c_void;

/// The ring's first size.
pub(crate) const FIRST_BYTES: usize = 4 << 20;
/// The largest the ring grows to.
pub(crate) const MAX_BYTES: usize = 64 << 20;
/// The largest upload that goes through the ring: a step's uploads are far smaller (a
/// micro-batch's ids and targets, a vocabulary's bucket offsets); larger ones are weights,
/// uploaded once at load, which are copied from pageable memory rather than growing the
/// ring for good.
pub(crate) const MAX_UPLOAD: usize = 16 << 20;
/// Every upload starts at a multiple of this.
const ALIGN: usize = 256;

/// Where an upload goes in a ring of bytes, and which bytes are still being copied: the
/// bookkeeping of [`Staging`], shared with the emulated GPU, which has no copies to wait
/// for but counts the same uploads and sizes.
#[derive(Debug)]
pub(crate) struct RingPlan {
    capacity: usize,
    /// Where the next upload starts looking.
    head: usize,
    /// The uploads in flight, oldest first: `(start, end, tag)`.
    in_flight: VecDeque<(usize, usize, u64)>,
}

/// What [`RingPlan::place`] found for an upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// These bytes are free: the upload goes at this offset.
    At(usize),
    /// The oldest upload in flight (its tag) holds bytes the upload needs: it must have
    /// run first, or the ring must grow.
    Busy(u64),
    /// The upload is larger than the ring.
    TooLarge,
}

impl RingPlan {
    /// An empty ring of `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> Self {
        RingPlan {
            capacity,
            head: 0,
            in_flight: VecDeque::new(),
        }
    }

    /// The ring's size in bytes.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Where `len` bytes would go: right after the newest upload, or at the ring's start
    /// when they do not fit before its end, provided no upload in flight holds them.
    pub(crate) fn place(&self, len: usize) -> Place {
        let len = len.max(1).next_multiple_of(ALIGN);
        if len > self.capacity {
            return Place::TooLarge;
        }
        let start = if self.head + len <= self.capacity {
            self.head
        } else {
            0
        };
        let end = start + len;
        // The bytes in flight run from the oldest upload's start to the head, wrapping
        // at most once; an overlap can only be with the oldest ones.
        for &(s, e, tag) in &self.in_flight {
            if s < end && start < e {
                return Place::Busy(tag);
            }
        }
        Place::At(start)
    }

    /// Records an upload of `len` bytes at `start` (from [`RingPlan::place`]), in flight
    /// until retired.
    pub(crate) fn push(&mut self, start: usize, len: usize, tag: u64) {
        let end = start + len.max(1).next_multiple_of(ALIGN);
        self.head = end;
        self.in_flight.push_back((start, end, tag));
    }

    /// The oldest upload in flight, if any.
    pub(crate) fn oldest(&self) -> Option<u64> {
        self.in_flight.front().map(|&(_, _, tag)| tag)
    }

    /// Forgets the oldest upload in flight: its copy has run.
    pub(crate) fn retire_oldest(&mut self) {
        self.in_flight.pop_front();
    }

    /// Forgets every upload in flight: the device has caught up.
    pub(crate) fn retire_all(&mut self) {
        self.in_flight.clear();
    }

    /// What an upload of `len` bytes needs next ([`Next`]): its place, or else a larger
    /// ring, or else (at the largest size) the oldest upload's copy to have run. The one
    /// policy of the GPU's staging and of the emulator's plan of it.
    pub(crate) fn next(&self, len: usize) -> Next {
        match self.place(len) {
            Place::At(start) => Next::At(start),
            Place::TooLarge | Place::Busy(_) => match (self.grown(len), self.oldest()) {
                (Some(bigger), _) => Next::Grow(bigger),
                (None, Some(tag)) => Next::WaitFor(tag),
                (None, None) => Next::TooLarge,
            },
        }
    }

    /// The plan of the ring that replaces this one when `len` bytes find no room: twice
    /// the size, or enough for `len` with room to spare, up to [`MAX_BYTES`]; `None` when
    /// the ring is that large already.
    pub(crate) fn grown(&self, len: usize) -> Option<RingPlan> {
        if self.capacity >= MAX_BYTES {
            return None;
        }
        let want = (2 * self.capacity).max((2 * len).next_power_of_two());
        Some(RingPlan::new(want.min(MAX_BYTES)))
    }
}

/// See [`RingPlan::next`].
#[derive(Debug)]
pub(crate) enum Next {
    /// The upload goes at this offset.
    At(usize),
    /// The ring is replaced by this larger one, then asked again.
    Grow(RingPlan),
    /// The copy of this upload (the oldest in flight) must have run; then ask again.
    WaitFor(u64),
    /// No ring takes it: copied another way.
    TooLarge,
}

/// A page-locked buffer of the ring and its plan.
struct Buffer {
    host: *mut u8,
    plan: RingPlan,
}

/// The ring of page-locked bytes uploads are copied through, with one event per copy in
/// flight.
pub(crate) struct Staging {
    current: Buffer,
    /// Buffers the ring outgrew, each freed once the event after its last copy passed.
    retired: Vec<(*mut u8, drv_sys::CUevent)>,
    /// The event of each upload in flight, by tag.
    events: VecDeque<(u64, drv_sys::CUevent)>,
    /// Events no upload uses.
    free_events: Vec<drv_sys::CUevent>,
    next_tag: u64,
}

// SAFETY: the host buffers and events are only touched under the owner's lock, with the
// context bound.
unsafe impl Send for Staging {}

fn host_buffer(bytes: usize) -> Result<*mut u8> {
    // SAFETY: a plain page-locked allocation; freed in Drop or once retired.
    unsafe { drv::malloc_host(bytes, 0) }
        .map(|p| p as *mut u8)
        .map_err(|e| driver_error("allocating page-locked staging memory", e))
}

/// What [`Staging::upload`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Staged {
    /// Queued from the ring without waiting.
    Queued,
    /// Queued from the ring after the host waited for an earlier copy (the ring is at
    /// its largest).
    Waited,
    /// Too large for the ring: the caller copies it from pageable memory.
    TooLarge,
}

impl Staging {
    /// Allocates the ring at its first size (the context must be current).
    pub(crate) fn new() -> Result<Staging> {
        Ok(Staging {
            current: Buffer {
                host: host_buffer(FIRST_BYTES)?,
                plan: RingPlan::new(FIRST_BYTES),
            },
            retired: Vec::new(),
            events: VecDeque::new(),
            free_events: Vec::new(),
            next_tag: 0,
        })
    }

    /// The ring's size in bytes.
    pub(crate) fn capacity(&self) -> usize {
        self.current.plan.capacity()
    }

    /// Forgets the copies that have run, oldest first, and frees outgrown buffers whose
    /// copies have all run.
    fn retire_done(&mut self) {
        while let Some(&(tag, event)) = self.events.front() {
            // SAFETY: the event was created and recorded here.
            if unsafe { drv::event::query(event) }.is_err() {
                break;
            }
            self.events.pop_front();
            self.free_events.push(event);
            if self.current.plan.oldest() == Some(tag) {
                self.current.plan.retire_oldest();
            }
        }
        for (host, event) in std::mem::take(&mut self.retired) {
            // SAFETY: as above; the buffer is freed once, when its last copy has run.
            if unsafe { drv::event::query(event) }.is_ok() {
                let _ = unsafe { drv::free_host(host as *mut c_void) };
                self.free_events.push(event);
            } else {
                self.retired.push((host, event));
            }
        }
    }

    /// Queues the copy of `src` to `dst` on `stream` through the ring.
    ///
    /// # Safety
    /// `dst` must address at least `src.len()` bytes of device memory, and the context
    /// that owns `stream` must be current.
    pub(crate) unsafe fn upload(
        &mut self,
        dst: drv_sys::CUdeviceptr,
        src: &[u8],
        stream: drv_sys::CUstream,
    ) -> Result<Staged> {
        if src.len() > MAX_UPLOAD {
            return Ok(Staged::TooLarge);
        }
        self.retire_done();
        let mut waited = false;
        let start = loop {
            match self.current.plan.next(src.len()) {
                Next::At(start) => break start,
                Next::Grow(plan) => self.grow(plan, stream)?,
                Next::WaitFor(tag) => {
                    self.wait_for(tag)?;
                    waited = true;
                }
                Next::TooLarge => return Ok(Staged::TooLarge),
            }
        };
        // SAFETY: the bytes `start..start + len` of the ring are inside it and no queued
        // copy reads them any more.
        let host =
            unsafe { std::slice::from_raw_parts_mut(self.current.host.add(start), src.len()) };
        host.copy_from_slice(src);
        let event = self.event()?;
        // SAFETY: the caller's contract; the bytes stay untouched until the event passes.
        unsafe {
            drv_sys::cuMemcpyHtoDAsync_v2(dst, host.as_ptr() as *const c_void, src.len(), stream)
                .result()
                .map_err(|e| driver_error("copying to the GPU", e))?;
            drv::event::record(event, stream)
                .map_err(|e| driver_error("recording a staging event", e))?;
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        self.current.plan.push(start, src.len(), tag);
        self.events.push_back((tag, event));
        Ok(if waited {
            Staged::Waited
        } else {
            Staged::Queued
        })
    }

    /// Replaces the ring by a larger one; the old buffer is freed once the copies queued
    /// from it have run (an event recorded after them).
    fn grow(&mut self, plan: RingPlan, stream: drv_sys::CUstream) -> Result<()> {
        let host = host_buffer(plan.capacity())?;
        let old = std::mem::replace(&mut self.current, Buffer { host, plan });
        if self.events.is_empty() {
            // SAFETY: no queued copy reads it.
            let _ = unsafe { drv::free_host(old.host as *mut c_void) };
            return Ok(());
        }
        let after = self.event()?;
        // SAFETY: recorded after every copy queued so far, the old buffer's included.
        unsafe { drv::event::record(after, stream) }
            .map_err(|e| driver_error("recording a staging event", e))?;
        self.retired.push((old.host, after));
        Ok(())
    }

    /// Waits for the copy of upload `tag` of the current ring; it and every copy queued
    /// before it (copies run in order) are then done and forgotten.
    fn wait_for(&mut self, tag: u64) -> Result<()> {
        let Some(&(_, event)) = self.events.iter().find(|(t, _)| *t == tag) else {
            return Ok(());
        };
        // SAFETY: the event was created and recorded here.
        unsafe { drv::event::synchronize(event) }
            .map_err(|e| driver_error("waiting for a staging copy", e))?;
        while let Some((t, e)) = self.events.pop_front() {
            self.free_events.push(e);
            if self.current.plan.oldest() == Some(t) {
                self.current.plan.retire_oldest();
            }
            if t == tag {
                break;
            }
        }
        Ok(())
    }

    fn event(&mut self) -> Result<drv_sys::CUevent> {
        match self.free_events.pop() {
            Some(e) => Ok(e),
            None => drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| driver_error("creating a staging event", e)),
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The owner synchronizes its stream before dropping this.
        // SAFETY: created here, not used after this.
        unsafe {
            for (_, e) in self.events.drain(..) {
                let _ = drv::event::destroy(e);
            }
            for e in self.free_events.drain(..) {
                let _ = drv::event::destroy(e);
            }
            for (host, e) in self.retired.drain(..) {
                let _ = drv::event::destroy(e);
                let _ = drv::free_host(host as *mut c_void);
            }
            let _ = drv::free_host(self.current.host as *mut c_void);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_take_the_next_free_bytes_and_wrap() {
        let mut r = RingPlan::new(4 * ALIGN);
        assert_eq!(r.place(10), Place::At(0));
        r.push(0, 10, 0);
        assert_eq!(r.place(ALIGN + 1), Place::At(ALIGN));
        r.push(ALIGN, ALIGN + 1, 1);
        // Three aligned blocks used; one left before the end.
        assert_eq!(r.place(ALIGN), Place::At(3 * ALIGN));
        r.push(3 * ALIGN, ALIGN, 2);
        // Wrapping to the start finds the oldest still in flight.
        assert_eq!(r.place(1), Place::Busy(0));
        r.retire_oldest();
        assert_eq!(r.place(ALIGN), Place::At(0));
        assert_eq!(r.place(2 * ALIGN), Place::Busy(1));
        r.retire_all();
        assert_eq!(r.place(4 * ALIGN), Place::At(0));
        assert_eq!(r.place(4 * ALIGN + 1), Place::TooLarge);
    }

    #[test]
    fn the_ring_grows_to_what_is_asked_up_to_its_largest() {
        let r = RingPlan::new(FIRST_BYTES);
        assert_eq!(r.grown(10).unwrap().capacity(), 2 * FIRST_BYTES);
        // A large upload: twice its size, rounded to a power of two.
        assert_eq!(r.grown(5 << 20).unwrap().capacity(), 16 << 20);
        assert_eq!(
            r.grown(MAX_UPLOAD).unwrap().capacity(),
            MAX_BYTES.min(2 * MAX_UPLOAD)
        );
        assert_eq!(
            RingPlan::new(48 << 20).grown(1).unwrap().capacity(),
            MAX_BYTES
        );
        assert!(RingPlan::new(MAX_BYTES).grown(1).is_none());
    }

    #[test]
    fn the_next_step_is_a_place_a_larger_ring_or_a_wait() {
        let mut r = RingPlan::new(FIRST_BYTES);
        assert!(matches!(r.next(10), Next::At(0)));
        r.push(0, FIRST_BYTES, 7);
        assert!(matches!(r.next(10), Next::Grow(p) if p.capacity() == 2 * FIRST_BYTES));
        let mut full = RingPlan::new(MAX_BYTES);
        full.push(0, MAX_BYTES, 9);
        assert!(matches!(full.next(10), Next::WaitFor(9)));
        full.retire_all();
        assert!(matches!(full.next(MAX_BYTES + 1), Next::TooLarge));
    }
}
