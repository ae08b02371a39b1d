//! A caching allocator for host buffers: freed tensors' storage is kept by length and
//! handed to the next allocation of the same length, as PyTorch's caching allocator does
//! on the GPU. It saves the page faults and zero-filling of fresh memory on every step.
//!
//! The ledger counts live tensors only; the bytes cached here are the allocator's
//! reserve, bounded by the ledger's peak (never more than was once live at the same time):
//! its device total's, or for host memory held for a device its host peak.

use crate::memory::Ledger;
use crate::tensor::{Storage, StorageSink};
use half::{bf16, f16};
use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

/// Page-locking of the host buffers a device copies to and from (CUDA's
/// `cuMemHostRegister`), so that those copies run asynchronously on the device's copy
/// engine: a pool of host memory held for a device ([`super::CpuBackend::host_for_pinned`])
/// locks the weights and gradients it makes and unlocks them before they are freed.
pub(crate) trait HostPin: Debug + Send + Sync {
    /// Locks `bytes` of host memory at `ptr`; false when they stay pageable (copies from
    /// and to them then wait).
    fn pin(&self, ptr: usize, bytes: usize) -> bool;
    /// Waits until the copies queued on the locked buffer at `ptr` have run (before the
    /// host writes it again).
    fn settle(&self, ptr: usize);
    /// Waits for those copies, then unlocks the buffer (before it is freed).
    fn unpin(&self, ptr: usize);
}

#[derive(Debug, Default)]
struct Cached {
    f32: HashMap<usize, Vec<Vec<f32>>>,
    bf16: HashMap<usize, Vec<Vec<bf16>>>,
    f16: HashMap<usize, Vec<Vec<f16>>>,
    bytes: u64,
    /// The addresses of the buffers this pool has locked, live or cached.
    pinned: HashSet<usize>,
}

/// Freed host buffers, by element count.
#[derive(Debug)]
pub(crate) struct BufferPool {
    cached: Mutex<Cached>,
    ledger: Ledger,
    /// Host memory held for a device: bounded by the ledger's host peak, not its device
    /// total's.
    host: bool,
    pin: Option<Arc<dyn HostPin>>,
}

/// The address of a host storage's first element, with its size in bytes (`None` for
/// storage that is not in host memory).
fn address(storage: &Storage) -> Option<(usize, usize)> {
    super::host_bytes(storage).map(|b| (b.as_ptr() as usize, b.len()))
}

impl BufferPool {
    /// An empty pool bounded by `ledger`'s peak.
    pub(crate) fn new(ledger: Ledger) -> Self {
        BufferPool {
            cached: Mutex::new(Cached::default()),
            ledger,
            host: false,
            pin: None,
        }
    }

    /// An empty pool of host memory held for a device, bounded by `ledger`'s peak of it
    /// ([`crate::memory::MemoryCategory::Offloaded`]); with `pin`, [`BufferPool::pin`]
    /// locks buffers.
    pub(crate) fn for_host(ledger: Ledger, pin: Option<Arc<dyn HostPin>>) -> Self {
        BufferPool {
            cached: Mutex::new(Cached::default()),
            ledger,
            host: true,
            pin,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cached> {
        self.cached.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks a fresh buffer's memory, when this pool locks buffers; it is unlocked before
    /// it is freed.
    pub(crate) fn pin(&self, storage: &Storage) {
        let (Some(pin), Some((ptr, bytes))) = (&self.pin, address(storage)) else {
            return;
        };
        if bytes > 0 && pin.pin(ptr, bytes) {
            self.lock().pinned.insert(ptr);
        }
    }

    /// How many buffers are locked now.
    pub(crate) fn pinned_buffers(&self) -> usize {
        self.lock().pinned.len()
    }

    /// A cached buffer about to be reused: the copies queued on it finish first.
    fn settled<T>(&self, v: Vec<T>) -> Vec<T> {
        let ptr = v.as_ptr() as usize;
        if let Some(pin) = &self.pin {
            if self.lock().pinned.contains(&ptr) {
                pin.settle(ptr);
            }
        }
        v
    }

    /// A cached f32 buffer of `n` elements (stale contents), if one is free.
    pub(crate) fn take_f32(&self, n: usize) -> Option<Vec<f32>> {
        let v = {
            let mut c = self.lock();
            let v = c.f32.get_mut(&n)?.pop()?;
            c.bytes -= (n * 4) as u64;
            v
        };
        Some(self.settled(v))
    }

    /// A cached bf16 buffer of `n` elements (stale contents), if one is free.
    pub(crate) fn take_bf16(&self, n: usize) -> Option<Vec<bf16>> {
        let v = {
            let mut c = self.lock();
            let v = c.bf16.get_mut(&n)?.pop()?;
            c.bytes -= (n * 2) as u64;
            v
        };
        Some(self.settled(v))
    }

    /// A cached f16 buffer of `n` elements (stale contents), if one is free.
    pub(crate) fn take_f16(&self, n: usize) -> Option<Vec<f16>> {
        let v = {
            let mut c = self.lock();
            let v = c.f16.get_mut(&n)?.pop()?;
            c.bytes -= (n * 2) as u64;
            v
        };
        Some(self.settled(v))
    }

    /// Unlocks a buffer about to be freed, if this pool locked it.
    fn unpin(&self, storage: &Storage) {
        let (Some(pin), Some((ptr, _))) = (&self.pin, address(storage)) else {
            return;
        };
        if self.lock().pinned.remove(&ptr) {
            pin.unpin(ptr);
        }
    }

    /// Keeps a freed tensor's storage for reuse, unless that would cache more bytes than
    /// the ledger's peak.
    fn keep(&self, storage: Storage) {
        let bytes = match &storage {
            Storage::F32(v) => v.len() * 4,
            Storage::Bf16(v) => v.len() * 2,
            Storage::F16(v) => v.len() * 2,
            // Codes are few and long-lived (optimizer state, NF4 weights): not worth
            // caching, but unlocked when locked.
            Storage::U8(_) | Storage::Nf4 { .. } => {
                self.unpin(&storage);
                return;
            }
            Storage::Device(_) | Storage::Meta { .. } => return,
        } as u64;
        if bytes == 0 {
            return;
        }
        let snapshot = self.ledger.snapshot();
        let cap = if self.host {
            snapshot.peak.host()
        } else {
            snapshot.peak_total
        };
        let mut c = self.lock();
        if c.bytes + bytes > cap {
            drop(c);
            self.unpin(&storage);
            return;
        }
        c.bytes += bytes;
        match storage {
            Storage::F32(v) => c.f32.entry(v.len()).or_default().push(v),
            Storage::Bf16(v) => c.bf16.entry(v.len()).or_default().push(v),
            Storage::F16(v) => c.f16.entry(v.len()).or_default().push(v),
            Storage::U8(_) | Storage::Nf4 { .. } | Storage::Device(_) | Storage::Meta { .. } => {}
        }
    }

    /// Bytes held for reuse.
    pub(crate) fn cached_bytes(&self) -> u64 {
        self.lock().bytes
    }
}

impl StorageSink for BufferPool {
    fn put(&self, storage: Storage) {
        self.keep(storage)
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        // Every tensor holds the pool, so what is left is cached: unlocked before freed.
        let Some(pin) = self.pin.take() else {
            return;
        };
        let c = std::mem::take(&mut *self.lock());
        for ptr in c.pinned {
            pin.unpin(ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Backend, CpuBackend};
    use crate::memory::MemoryCategory;
    use crate::tensor::{DType, Tensor};

    /// Records what the pool asks of the page-locking.
    #[derive(Debug, Default)]
    struct Recorder(Mutex<Vec<(&'static str, usize)>>);

    impl Recorder {
        fn push(&self, what: &'static str, ptr: usize) {
            self.0.lock().unwrap().push((what, ptr));
        }
        fn log(&self) -> Vec<(&'static str, usize)> {
            self.0.lock().unwrap().clone()
        }
    }

    impl HostPin for Recorder {
        fn pin(&self, ptr: usize, _bytes: usize) -> bool {
            self.push("pin", ptr);
            true
        }
        fn settle(&self, ptr: usize) {
            self.push("settle", ptr);
        }
        fn unpin(&self, ptr: usize) {
            self.push("unpin", ptr);
        }
    }

    fn at(t: &Tensor) -> usize {
        address(t.storage()).unwrap().0
    }

    #[test]
    fn locked_buffers_settle_before_reuse_and_unlock_before_they_are_freed() {
        let ledger = Ledger::new();
        let pin = Arc::new(Recorder::default());
        let host = CpuBackend::host_for_pinned(&ledger, pin.clone());
        let grad = |n: usize| {
            host.empty(&[n], DType::Bf16, MemoryCategory::Gradients, "g")
                .unwrap()
        };
        // Weights and gradients cross to the device and are locked; state is not.
        let g = grad(1000);
        let state = host
            .empty(&[1000], DType::F32, MemoryCategory::OptimizerState, "m")
            .unwrap();
        assert_eq!(host.pinned_buffers(), 1);
        let first = at(&g);
        drop(g);
        // Reused from the cache: its copies settle first, and it is not locked twice.
        let g = grad(1000);
        assert_eq!(at(&g), first);
        drop((g, state));
        // Buffers the cache does not keep (beyond the host peak, here 6000 bytes, all
        // cached) are unlocked, then freed.
        let (a, b) = (grad(600), grad(600));
        let (second, third) = (at(&a), at(&b));
        drop((a, b));
        assert_eq!(host.pinned_buffers(), 1);
        let log = pin.log();
        assert_eq!(
            log,
            [
                ("pin", first),
                ("settle", first),
                ("pin", second),
                ("pin", third),
                ("unpin", second),
                ("unpin", third),
            ]
        );
        // The pool's end unlocks what it caches.
        drop(host);
        assert_eq!(pin.log().last(), Some(&("unpin", first)));
    }
}
