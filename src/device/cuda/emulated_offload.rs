//! Offloading on the CUDA emulator: "page-locked" host buffers (plain host allocations,
//! counted apart from the emulated device's memory), copies to them at once, and copies
//! back that are deferred until compute waits for them (or the device synchronizes), as
//! an asynchronous copy on a GPU's copy stream lands only later; a host buffer returned
//! while a copy from it waits is freed after that copy. A kernel that read a fetched buffer without
//! waiting for its ticket would read the poison of a fresh allocation, so the emulator
//! checks that the backend waits where it must.

use super::gpu::{DevicePtr, HostPtr, Ticket};
use crate::error::{Error, Result};
use std::alloc::Layout;
use std::collections::HashMap;
use std::sync::Mutex;

const ALIGN: usize = 256;

/// A copy to the device that has not run yet.
#[derive(Clone, Copy, Debug)]
struct Pending {
    dst: DevicePtr,
    src: HostPtr,
    bytes: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Host buffers by address, with their sizes.
    live: HashMap<HostPtr, usize>,
    pending: HashMap<Ticket, Pending>,
    next: Ticket,
    /// Host buffers returned while a copy from them was still queued: freed after it.
    returned: Vec<HostPtr>,
}

impl State {
    /// Runs the copy of `ticket`, then frees its source if it was returned and no other
    /// queued copy reads it.
    fn run(&mut self, ticket: Ticket) {
        let Some(p) = self.pending.remove(&ticket) else {
            return;
        };
        run(p);
        let still_read = self.pending.values().any(|q| q.src == p.src);
        if !still_read {
            if let Some(i) = self.returned.iter().position(|&r| r == p.src) {
                self.returned.swap_remove(i);
                self.dealloc(p.src);
            }
        }
    }

    fn dealloc(&mut self, ptr: HostPtr) {
        let Some(bytes) = self.live.remove(&ptr) else {
            log::error!(
                "the CUDA emulator was asked to free host memory at {ptr:#x}, which it never \
                 allocated"
            );
            return;
        };
        // SAFETY: allocated in `alloc` with this layout, freed once (removed from `live`).
        unsafe {
            std::alloc::dealloc(
                ptr as *mut u8,
                Layout::from_size_align_unchecked(bytes, ALIGN),
            )
        };
    }
}

/// The emulator's host buffers and its deferred copies to the device.
#[derive(Debug, Default)]
pub(crate) struct EmulatedOffload {
    state: Mutex<State>,
}

impl EmulatedOffload {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A host buffer of `bytes`.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<HostPtr> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).map_err(|e| Error::Backend {
            backend: "cuda",
            message: format!("a host buffer of {bytes} bytes: {e}"),
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::Backend {
                backend: "cuda",
                message: format!("no host memory for a buffer of {bytes} bytes"),
            });
        }
        self.state().live.insert(ptr as HostPtr, layout.size());
        Ok(ptr as HostPtr)
    }

    /// Returns a host buffer: freed now, or after the queued copies that read it (as a
    /// GPU's page-locked buffer is reused only after its copies ran).
    pub(crate) fn free(&self, ptr: HostPtr) {
        let mut s = self.state();
        if s.pending.values().any(|p| p.src == ptr) {
            s.returned.push(ptr);
        } else {
            s.dealloc(ptr);
        }
    }

    /// Queues a copy to the device; it runs when its ticket is waited for.
    pub(crate) fn fetch(&self, dst: DevicePtr, src: HostPtr, bytes: usize) -> Ticket {
        let mut s = self.state();
        let t = s.next;
        s.next += 1;
        s.pending.insert(t, Pending { dst, src, bytes });
        t
    }

    /// Runs the copy of `ticket`, if it has not run.
    pub(crate) fn wait(&self, ticket: Ticket) {
        self.state().run(ticket);
    }

    /// Runs every queued copy.
    pub(crate) fn flush(&self) {
        let mut s = self.state();
        let tickets: Vec<Ticket> = s.pending.keys().copied().collect();
        for t in tickets {
            s.run(t);
        }
    }

    /// Host buffers live now.
    #[cfg(test)]
    fn live(&self) -> usize {
        self.state().live.len()
    }
}

impl Drop for EmulatedOffload {
    fn drop(&mut self) {
        let s = std::mem::take(&mut *self.state());
        for (ptr, bytes) in s.live {
            // SAFETY: allocated in `alloc` with this layout and not freed since.
            unsafe {
                std::alloc::dealloc(
                    ptr as *mut u8,
                    Layout::from_size_align_unchecked(bytes, ALIGN),
                )
            };
        }
    }
}

/// Copies `p.bytes` from the host to the device.
fn run(p: Pending) {
    // SAFETY: `fetch`'s caller guarantees both buffers hold `bytes`; the source is freed
    // only after its pending copies ran (`free`), the destination only after its ticket
    // was waited for (the buffer's drop).
    unsafe { std::ptr::copy_nonoverlapping(p.src as *const u8, p.dst as *mut u8, p.bytes) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_back_land_when_waited_for_or_when_their_source_is_freed() {
        let o = EmulatedOffload::default();
        let host = o.alloc(8).unwrap();
        // SAFETY: 8 bytes were just allocated at `host`.
        unsafe { std::ptr::copy_nonoverlapping([7u8; 8].as_ptr(), host as *mut u8, 8) };
        let mut dst = [0u8; 8];
        let t = o.fetch(dst.as_mut_ptr() as DevicePtr, host, 8);
        assert_eq!(dst, [0; 8], "not before compute waits for it");
        o.wait(t);
        assert_eq!(dst, [7; 8]);
        let mut late = [0u8; 8];
        let t = o.fetch(late.as_mut_ptr() as DevicePtr, host, 8);
        o.free(host);
        assert_eq!(o.live(), 1, "a source is freed only after its copies");
        assert_eq!(late, [0; 8]);
        o.wait(t);
        assert_eq!(late, [7; 8]);
        assert_eq!(o.live(), 0);
    }
}
