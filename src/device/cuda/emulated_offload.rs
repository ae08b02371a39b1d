//! Offloading on the CUDA emulator: "page-locked" host buffers (plain host allocations,
//! counted apart from the emulated device's memory), copies to them at once, and copies
//! back that are deferred until compute waits for them (or the device synchronizes), as
//! an asynchronous copy on a GPU's copy stream lands only later; a host buffer returned
//! while a copy from it waits is freed after that copy. A kernel that read a fetched buffer without
//! waiting for its ticket would read the poison of a fresh allocation, so the emulator
//! checks that the backend waits where it must.
//!
//! "Registered" host memory (the caller's, as `cuMemHostRegister` locks it) is copied
//! both ways late: a copy to or from it runs when compute waits for its ticket, when the
//! host settles the memory, or when the device synchronizes. A host that read a gradient
//! before settling would read the last step's bytes, and one that wrote weights while
//! their copy was queued would send the new bytes: the emulator checks both waits.

use super::gpu::{DevicePtr, HostPtr, Ticket};
use crate::error::{Error, Result};
use std::alloc::Layout;
use std::collections::HashMap;
use std::sync::Mutex;

const ALIGN: usize = 256;

/// A copy that has not run yet (to the device, or from it to registered memory).
#[derive(Clone, Copy, Debug)]
struct Pending {
    dst: u64,
    src: u64,
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
    /// Registered host memory by address, with its size.
    registered: HashMap<HostPtr, usize>,
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

    /// Registers `bytes` of the caller's host memory at `ptr`; false when it is known
    /// already.
    pub(crate) fn register(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.state().registered.insert(ptr, bytes).is_none()
    }

    /// Whether `bytes` at `ptr` are registered.
    pub(crate) fn registered(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.state()
            .registered
            .get(&ptr)
            .is_some_and(|&b| b >= bytes)
    }

    /// Runs the queued copies from or to the registered memory at `ptr`.
    pub(crate) fn settle(&self, ptr: HostPtr) {
        let mut s = self.state();
        let mut tickets: Vec<Ticket> = s
            .pending
            .iter()
            .filter(|(_, p)| p.src == ptr || p.dst == ptr)
            .map(|(&t, _)| t)
            .collect();
        tickets.sort_unstable();
        for t in tickets {
            s.run(t);
        }
    }

    /// Runs the queued copies on the registered memory at `ptr` and forgets it.
    pub(crate) fn unregister(&self, ptr: HostPtr) {
        self.settle(ptr);
        if self.state().registered.remove(&ptr).is_none() {
            log::error!(
                "the CUDA emulator was asked to unregister host memory at {ptr:#x}, which \
                 is not registered"
            );
        }
    }

    /// Queues a copy from the device to registered memory; it runs when its ticket is
    /// waited for or the memory is settled.
    pub(crate) fn download(&self, dst: HostPtr, src: DevicePtr, bytes: usize) -> Ticket {
        let mut s = self.state();
        let t = s.next;
        s.next += 1;
        s.pending.insert(t, Pending { dst, src, bytes });
        t
    }

    /// Runs every queued copy.
    pub(crate) fn flush(&self) {
        let mut s = self.state();
        let mut tickets: Vec<Ticket> = s.pending.keys().copied().collect();
        tickets.sort_unstable();
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

/// Copies `p.bytes` from `p.src` to `p.dst`.
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

    #[test]
    fn copies_with_registered_memory_land_when_settled_or_waited_for() {
        let o = EmulatedOffload::default();
        let mut host = [0u8; 8];
        let at = host.as_mut_ptr() as HostPtr;
        assert!(o.register(at, 8));
        assert!(!o.register(at, 8), "once");
        assert!(o.registered(at, 8) && !o.registered(at, 9));
        // A gradient's copy to the host: not there before the host settles.
        let device = [5u8; 8];
        o.download(at, device.as_ptr() as DevicePtr, 8);
        // SAFETY: reading the array through its address, as the copy writes it.
        let read = || unsafe { std::ptr::read_volatile(at as *const [u8; 8]) };
        assert_eq!(read(), [0; 8]);
        o.settle(at);
        assert_eq!(read(), [5; 8]);
        // Weights' copy to the device: lands when compute waits for it, or when the
        // host settles the memory before writing it again.
        let mut dst = [0u8; 8];
        let t = o.fetch(dst.as_mut_ptr() as DevicePtr, at, 8);
        o.settle(at);
        assert_eq!(dst, [5; 8]);
        o.wait(t);
        let mut again = [0u8; 8];
        o.fetch(again.as_mut_ptr() as DevicePtr, at, 8);
        o.unregister(at);
        assert_eq!(again, [5; 8], "unregistering runs the copies first");
        assert!(!o.registered(at, 8));
    }
}
