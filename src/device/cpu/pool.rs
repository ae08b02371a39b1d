//! A caching allocator for host buffers: freed tensors' storage is kept by length and
//! handed to the next allocation of the same length, as PyTorch's caching allocator does
//! on the GPU. It saves the page faults and zero-filling of fresh memory on every step.
//!
//! The ledger counts live tensors only; the bytes cached here are the allocator's
//! reserve, bounded by the ledger's peak (never more than was once live at the same time).

use crate::memory::Ledger;
use crate::tensor::Storage;
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Debug, Default)]
struct Cached {
    f32: HashMap<usize, Vec<Vec<f32>>>,
    bf16: HashMap<usize, Vec<Vec<bf16>>>,
    f16: HashMap<usize, Vec<Vec<f16>>>,
    bytes: u64,
}

/// Freed host buffers, by element count.
#[derive(Debug)]
pub(crate) struct BufferPool {
    cached: Mutex<Cached>,
    ledger: Ledger,
}

impl BufferPool {
    /// An empty pool bounded by `ledger`'s peak.
    pub(crate) fn new(ledger: Ledger) -> Self {
        BufferPool {
            cached: Mutex::new(Cached::default()),
            ledger,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cached> {
        self.cached.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cached f32 buffer of `n` elements (stale contents), if one is free.
    pub(crate) fn take_f32(&self, n: usize) -> Option<Vec<f32>> {
        let mut c = self.lock();
        let v = c.f32.get_mut(&n)?.pop()?;
        c.bytes -= (n * 4) as u64;
        Some(v)
    }

    /// A cached bf16 buffer of `n` elements (stale contents), if one is free.
    pub(crate) fn take_bf16(&self, n: usize) -> Option<Vec<bf16>> {
        let mut c = self.lock();
        let v = c.bf16.get_mut(&n)?.pop()?;
        c.bytes -= (n * 2) as u64;
        Some(v)
    }

    /// A cached f16 buffer of `n` elements (stale contents), if one is free.
    pub(crate) fn take_f16(&self, n: usize) -> Option<Vec<f16>> {
        let mut c = self.lock();
        let v = c.f16.get_mut(&n)?.pop()?;
        c.bytes -= (n * 2) as u64;
        Some(v)
    }

    /// Keeps a freed tensor's storage for reuse, unless that would cache more bytes than
    /// the ledger's peak.
    pub(crate) fn put(&self, storage: Storage) {
        let bytes = match &storage {
            Storage::F32(v) => v.len() * 4,
            Storage::Bf16(v) => v.len() * 2,
            Storage::F16(v) => v.len() * 2,
            // Codes are few and long-lived (optimizer state): not worth caching.
            Storage::U8(_) | Storage::Nf4 { .. } | Storage::Device(_) | Storage::Meta { .. } => {
                return
            }
        } as u64;
        if bytes == 0 {
            return;
        }
        let cap = self.ledger.snapshot().peak_total;
        let mut c = self.lock();
        if c.bytes + bytes > cap {
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
