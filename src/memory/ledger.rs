//! The ledger: exact live and peak bytes per category, and the event stream behind them.

use super::{CategoryBytes, MemoryCategory, MemoryEvent, Phase};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Live and peak bytes as the ledger sees them at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerSnapshot {
    /// Bytes live now, per category.
    pub live: CategoryBytes,
    /// Each category's own maximum since the last [`Ledger::reset_peaks`].
    pub peak: CategoryBytes,
    /// The maximum of the total since the last reset.
    pub peak_total: u64,
    /// The per-category breakdown at the moment the total peaked.
    pub at_peak: CategoryBytes,
}

#[derive(Debug)]
struct LedgerState {
    snapshot: LedgerSnapshot,
    next_id: u64,
    recording: bool,
    events: Vec<MemoryEvent>,
    limit: Option<u64>,
}

/// Exact accounting of every buffer a backend allocates. Cheap to clone (shared state).
///
/// Every [`crate::Tensor`] reports its allocation and its drop here, so live and peak bytes
/// per [`MemoryCategory`] are exact on every backend. While recording, the ledger also keeps
/// the ordered event stream (allocations, frees, phase markers) for observers to drain.
#[derive(Clone, Debug)]
pub struct Ledger {
    state: Arc<Mutex<LedgerState>>,
    start: Instant,
}

impl Default for Ledger {
    fn default() -> Self {
        Self::new()
    }
}

impl Ledger {
    /// An empty ledger, not recording events, with no memory limit.
    pub fn new() -> Self {
        Ledger {
            state: Arc::new(Mutex::new(LedgerState {
                snapshot: LedgerSnapshot::default(),
                next_id: 0,
                recording: false,
                events: Vec::new(),
                limit: None,
            })),
            start: Instant::now(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LedgerState> {
        // A poisoned ledger still holds consistent numbers: every update is a few additions.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Starts or stops keeping the event stream (accounting itself never stops).
    pub fn set_recording(&self, on: bool) {
        let mut s = self.lock();
        s.recording = on;
        if !on {
            s.events.clear();
        }
    }

    /// Caps the total live bytes; an allocation beyond it fails with [`Error::OutOfMemory`].
    pub fn set_limit(&self, limit: Option<u64>) {
        self.lock().limit = limit;
    }

    /// Records an allocation and returns its id, or fails if it would exceed the limit.
    pub fn alloc(&self, category: MemoryCategory, bytes: u64, label: &str) -> Result<u64> {
        let time_us = self.now_us();
        let mut s = self.lock();
        if let Some(err) = refusal(&s, category, bytes, label) {
            return Err(err);
        }
        let id = s.next_id;
        s.next_id += 1;
        let snap = &mut s.snapshot;
        *snap.live.get_mut(category) += bytes;
        let live = snap.live.get(category);
        let peak = snap.peak.get_mut(category);
        *peak = (*peak).max(live);
        let total = snap.live.total();
        if total > snap.peak_total {
            snap.peak_total = total;
            snap.at_peak = snap.live;
        }
        if s.recording {
            s.events.push(MemoryEvent::Alloc {
                id,
                category,
                bytes,
                label: label.to_string(),
                time_us,
            });
        }
        Ok(id)
    }

    /// The error an allocation of `bytes` would meet under the limit, if any.
    pub fn would_refuse(&self, category: MemoryCategory, bytes: u64, label: &str) -> Option<Error> {
        refusal(&self.lock(), category, bytes, label)
    }

    /// Records the free of buffer `id`.
    pub fn free(&self, id: u64, category: MemoryCategory, bytes: u64, label: &str) {
        let time_us = self.now_us();
        let mut s = self.lock();
        let live = s.snapshot.live.get_mut(category);
        *live = live.saturating_sub(bytes);
        if s.recording {
            s.events.push(MemoryEvent::Free {
                id,
                category,
                bytes,
                label: label.to_string(),
                time_us,
            });
        }
    }

    /// Marks the beginning of a phase in the event stream.
    pub fn phase_begin(&self, phase: Phase) {
        let time_us = self.now_us();
        let mut s = self.lock();
        if s.recording {
            s.events.push(MemoryEvent::PhaseBegin { phase, time_us });
        }
    }

    /// Marks the end of a phase in the event stream.
    pub fn phase_end(&self, phase: Phase) {
        let time_us = self.now_us();
        let mut s = self.lock();
        if s.recording {
            s.events.push(MemoryEvent::PhaseEnd { phase, time_us });
        }
    }

    /// Appends a step-end event.
    pub fn step_end(&self, step: u64, device: Option<super::DeviceMemory>) {
        let time_us = self.now_us();
        let mut s = self.lock();
        if s.recording {
            s.events.push(MemoryEvent::StepEnd {
                step,
                device,
                time_us,
            });
        }
    }

    /// Takes the events recorded since the last drain, in order.
    pub fn drain_events(&self) -> Vec<MemoryEvent> {
        std::mem::take(&mut self.lock().events)
    }

    /// Live and peak bytes now.
    pub fn snapshot(&self) -> LedgerSnapshot {
        self.lock().snapshot
    }

    /// Starts a new peak window: peaks become the bytes live now.
    pub fn reset_peaks(&self) {
        let mut s = self.lock();
        let live = s.snapshot.live;
        s.snapshot.peak = live;
        s.snapshot.peak_total = live.total();
        s.snapshot.at_peak = live;
    }
}

fn refusal(s: &LedgerState, category: MemoryCategory, bytes: u64, label: &str) -> Option<Error> {
    let limit = s.limit?;
    let total = s.snapshot.live.total();
    if total + bytes <= limit {
        return None;
    }
    let live: Vec<String> = s
        .snapshot
        .live
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(c, b)| format!("{c} {}", super::format_bytes(b)))
        .collect();
    Some(Error::OutOfMemory {
        message: format!(
            "allocating {} for `{label}` ({category}) would exceed the limit of {} \
             (live: {}); use a smaller batch, a recompute policy or mixed precision",
            super::format_bytes(bytes),
            super::format_bytes(limit),
            if live.is_empty() {
                "nothing".to_string()
            } else {
                live.join(", ")
            }
        ),
    })
}
