//! The ledger: exact live and peak bytes per category and per label, the running count of
//! executed floating-point operations, and the event stream behind them.

use super::{CategoryBytes, MemoryCategory, MemoryEvent, Phase};
use crate::error::{Error, Result};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Floating-point operations the backend's ops executed since the last reset.
    pub flops: u64,
}

/// Live and peak bytes of the buffers sharing one label (e.g. every `h.3.qkv`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelBytes {
    /// The label, e.g. `h.3.qkv` or `h.3.attn.c_attn.weight`.
    pub label: String,
    /// The category the label's buffers are counted under.
    pub category: MemoryCategory,
    /// Bytes of the label's buffers live now.
    pub live: u64,
    /// The maximum of `live` since the last [`Ledger::reset_peaks`].
    pub peak: u64,
}

/// Live and peak bytes of one (label, category) pair.
#[derive(Clone, Copy, Debug)]
struct LabelCount {
    category: MemoryCategory,
    live: u64,
    peak: u64,
}

#[derive(Debug)]
struct LedgerState {
    snapshot: LedgerSnapshot,
    /// Per label; a label almost always has one category, so the list holds one entry.
    labels: HashMap<String, Vec<LabelCount>>,
    next_id: u64,
    events: Vec<MemoryEvent>,
    limit: Option<u64>,
}

/// A wait for the device's queued work, run at both ends of every recorded op span while
/// set (see [`Ledger::set_op_fence`]).
pub type OpFence = Arc<dyn Fn() -> Result<()> + Send + Sync>;

#[derive(Debug)]
struct Shared {
    state: Mutex<LedgerState>,
    /// Read without the lock by every op, so it lives beside it.
    recording: AtomicBool,
    /// Executed floating-point operations since the last reset; ops add without the lock.
    flops: AtomicU64,
    /// Whether `fence` holds a fence (read without its lock by every op).
    fenced: AtomicBool,
    fence: Mutex<Option<Fence>>,
}

/// An op fence with a `Debug` of its own (a closure has none).
#[derive(Clone)]
struct Fence(OpFence);

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fence")
    }
}

/// Exact accounting of every buffer a backend allocates. Cheap to clone (shared state).
///
/// Every [`crate::Tensor`] reports its allocation and its drop here, so live and peak bytes
/// per [`MemoryCategory`] and per label are exact on every backend, and every op adds the
/// floating-point operations it executed. While recording, the ledger also keeps the
/// ordered event stream (allocations, frees, phase markers, op spans) for observers to
/// drain.
#[derive(Clone, Debug)]
pub struct Ledger {
    shared: Arc<Shared>,
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
            shared: Arc::new(Shared {
                state: Mutex::new(LedgerState {
                    snapshot: LedgerSnapshot::default(),
                    labels: HashMap::new(),
                    next_id: 0,
                    events: Vec::new(),
                    limit: None,
                }),
                recording: AtomicBool::new(false),
                flops: AtomicU64::new(0),
                fenced: AtomicBool::new(false),
                fence: Mutex::new(None),
            }),
            start: Instant::now(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LedgerState> {
        // A poisoned ledger still holds consistent numbers: every update is a few additions.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn recording(&self) -> bool {
        self.shared.recording.load(Ordering::Relaxed)
    }

    /// Sets (or, with `None`, removes) the op fence: a wait for the device that every op
    /// span runs when it opens and when it closes while the ledger records, so that
    /// [`MemoryEvent::Op`]'s duration is the device's time for the op, not the host's time
    /// to queue it. A GPU backend passes its stream's synchronize (see
    /// `CudaOptions::sync_ops`). For profiling only: it stops the host from running ahead
    /// of the device, so whole steps run slower.
    pub fn set_op_fence(&self, fence: Option<OpFence>) {
        let mut f = self.shared.fence.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.fenced.store(fence.is_some(), Ordering::Relaxed);
        *f = fence.map(Fence);
    }

    /// The op fence, when one is set and the ledger records.
    fn fence(&self) -> Option<Fence> {
        if !self.shared.fenced.load(Ordering::Relaxed) || !self.recording() {
            return None;
        }
        let f = self.shared.fence.lock().unwrap_or_else(|e| e.into_inner());
        f.clone()
    }

    /// Starts or stops keeping the event stream (accounting itself never stops).
    pub fn set_recording(&self, on: bool) {
        let mut s = self.lock();
        self.shared.recording.store(on, Ordering::Relaxed);
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
        update_label(&mut s.labels, label, category, |c| {
            c.live += bytes;
            c.peak = c.peak.max(c.live);
        });
        if self.recording() {
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
        if let Some(c) = s
            .labels
            .get_mut(label)
            .and_then(|counts| counts.iter_mut().find(|c| c.category == category))
        {
            c.live = c.live.saturating_sub(bytes);
        }
        if self.recording() {
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
        if self.recording() {
            s.events.push(MemoryEvent::PhaseBegin { phase, time_us });
        }
    }

    /// Marks the end of a phase in the event stream.
    pub fn phase_end(&self, phase: Phase) {
        let time_us = self.now_us();
        let mut s = self.lock();
        if self.recording() {
            s.events.push(MemoryEvent::PhaseEnd { phase, time_us });
        }
    }

    /// Appends a step-end event.
    pub fn step_end(&self, step: u64, device: Option<super::DeviceMemory>) {
        let time_us = self.now_us();
        let mut s = self.lock();
        if self.recording() {
            s.events.push(MemoryEvent::StepEnd {
                step,
                device,
                time_us,
            });
        }
    }

    /// Opens the span of one backend op that executes `flops` floating-point operations
    /// and writes the tensor labelled `label`.
    ///
    /// When the span ends (dropped, or [`OpSpan::finish`] with `Ok`) its flops are added to
    /// [`Ledger::flops`], and, while recording, a [`MemoryEvent::Op`] with its start and
    /// duration joins the event stream. When not recording an op costs two atomic
    /// operations and allocates nothing.
    ///
    /// With an op fence set ([`Ledger::set_op_fence`]) the span waits for the device when
    /// it opens and when it closes, so its duration is the device's time for the op.
    pub fn op(&self, name: &'static str, flops: u64, label: &str) -> OpSpan<'_> {
        let recorded = self.recording().then(|| {
            let fence = self.fence();
            if let Some(f) = &fence {
                // A failed wait reports the device's error again at the next op or read;
                // the span only times.
                let _ = (f.0)();
            }
            Recorded {
                label: label.to_string(),
                start: Instant::now(),
                time_us: self.now_us(),
                fence,
            }
        });
        OpSpan {
            ledger: self,
            name,
            flops,
            recorded,
        }
    }

    /// Floating-point operations executed by the backend's ops since the last
    /// [`Ledger::reset_peaks`] (counted whether or not the ledger records events).
    pub fn flops(&self) -> u64 {
        self.shared.flops.load(Ordering::Relaxed)
    }

    /// Takes the events recorded since the last drain, in order.
    pub fn drain_events(&self) -> Vec<MemoryEvent> {
        std::mem::take(&mut self.lock().events)
    }

    /// Live and peak bytes and executed flops now.
    pub fn snapshot(&self) -> LedgerSnapshot {
        let mut snap = self.lock().snapshot;
        snap.flops = self.flops();
        snap
    }

    /// Live and peak bytes of every label allocated since the last [`Ledger::reset_peaks`]
    /// or live now: by category in [`MemoryCategory::ALL`] order, then by peak (largest
    /// first), then by label.
    pub fn labels(&self) -> Vec<LabelBytes> {
        let s = self.lock();
        let mut out: Vec<LabelBytes> = s
            .labels
            .iter()
            .flat_map(|(label, counts)| {
                counts.iter().map(|c| LabelBytes {
                    label: label.clone(),
                    category: c.category,
                    live: c.live,
                    peak: c.peak,
                })
            })
            .collect();
        out.sort_by(|a, b| {
            a.category
                .cmp(&b.category)
                .then(b.peak.cmp(&a.peak))
                .then_with(|| a.label.cmp(&b.label))
        });
        out
    }

    /// Starts a new window: peaks (per category and per label) become the bytes live now,
    /// labels with nothing live are forgotten, and the flops count returns to zero.
    pub fn reset_peaks(&self) {
        let mut s = self.lock();
        let live = s.snapshot.live;
        s.snapshot.peak = live;
        s.snapshot.peak_total = live.total();
        s.snapshot.at_peak = live;
        s.labels.retain(|_, counts| {
            counts.retain(|c| c.live > 0);
            for c in counts.iter_mut() {
                c.peak = c.live;
            }
            !counts.is_empty()
        });
        self.shared.flops.store(0, Ordering::Relaxed);
    }
}

/// Applies `f` to the counts of `label` under `category`, created at zero if missing.
fn update_label(
    labels: &mut HashMap<String, Vec<LabelCount>>,
    label: &str,
    category: MemoryCategory,
    f: impl FnOnce(&mut LabelCount),
) {
    let fresh = || LabelCount {
        category,
        live: 0,
        peak: 0,
    };
    match labels.get_mut(label) {
        Some(counts) => match counts.iter_mut().find(|c| c.category == category) {
            Some(c) => f(c),
            None => {
                let mut c = fresh();
                f(&mut c);
                counts.push(c);
            }
        },
        None => {
            let mut c = fresh();
            f(&mut c);
            labels.insert(label.to_string(), vec![c]);
        }
    }
}

#[derive(Debug)]
struct Recorded {
    label: String,
    start: Instant,
    time_us: u64,
    /// The op fence to run before the span's end is read.
    fence: Option<Fence>,
}

/// The span of one backend op, from [`Ledger::op`]; it ends when dropped.
#[derive(Debug)]
#[must_use = "an op span measures until it is dropped; bind it (`let _op = ...`)"]
pub struct OpSpan<'a> {
    ledger: &'a Ledger,
    name: &'static str,
    flops: u64,
    recorded: Option<Recorded>,
}

impl OpSpan<'_> {
    /// Ends the span with the op's result: an op that failed executed nothing, so on `Err`
    /// neither its flops nor its event are recorded. Returns `result`.
    ///
    /// With an op fence, the span waits for the device before it ends, and a failed wait
    /// is returned as the op's error.
    pub fn finish<R>(mut self, result: Result<R>) -> Result<R> {
        if result.is_err() {
            self.flops = 0;
            self.recorded = None;
            return result;
        }
        let fence = self.recorded.as_mut().and_then(|r| r.fence.take());
        if let Some(f) = fence {
            if let Err(e) = (f.0)() {
                self.flops = 0;
                self.recorded = None;
                return Err(e);
            }
        }
        result
    }

    /// Ends the span with a fused kernel's answer (`Ok(Some(r))`: it ran; `Ok(None)`: it
    /// declined, having written nothing): `Some` with the op's result when it ran or
    /// failed, `None` with the span [cancelled](Self::cancel) when it declined, and the
    /// caller runs the op's parts as ops of their own.
    pub fn finish_fused<R>(self, ran: Result<Option<R>>) -> Option<Result<R>> {
        match ran {
            Ok(Some(r)) => Some(self.finish(Ok(r))),
            Ok(None) => {
                self.cancel();
                None
            }
            Err(e) => Some(self.finish(Err(e))),
        }
    }

    /// Ends the span without recording it (neither flops nor an event): the op ran
    /// nothing under this span, as when a fused form is declined and its parts run as
    /// ops of their own.
    pub fn cancel(mut self) {
        self.flops = 0;
        self.recorded = None;
    }
}

impl Drop for OpSpan<'_> {
    fn drop(&mut self) {
        if self.flops > 0 {
            self.ledger
                .shared
                .flops
                .fetch_add(self.flops, Ordering::Relaxed);
        }
        if let Some(mut r) = self.recorded.take() {
            if let Some(f) = r.fence.take() {
                // Reported again by the next op or read; a drop cannot return it.
                let _ = (f.0)();
            }
            let duration_us = r.start.elapsed().as_micros() as u64;
            let mut s = self.ledger.lock();
            if self.ledger.recording() {
                s.events.push(MemoryEvent::Op {
                    name: Cow::Borrowed(self.name),
                    label: r.label,
                    flops: self.flops,
                    time_us: r.time_us,
                    duration_us,
                });
            }
        }
    }
}

fn refusal(s: &LedgerState, category: MemoryCategory, bytes: u64, label: &str) -> Option<Error> {
    let limit = s.limit?;
    if !category.on_device() {
        return None;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use MemoryCategory::{Activations, Gradients, Weights};

    fn row(ledger: &Ledger, label: &str, category: MemoryCategory) -> (u64, u64) {
        ledger
            .labels()
            .iter()
            .find(|b| b.label == label && b.category == category)
            .map(|b| (b.live, b.peak))
            .unwrap_or_default()
    }

    #[test]
    fn labels_have_exact_live_and_peak_bytes() {
        let l = Ledger::new();
        let a = l.alloc(Activations, 100, "h.0.qkv").unwrap();
        let b = l.alloc(Activations, 50, "h.0.qkv").unwrap();
        l.free(a, Activations, 100, "h.0.qkv");
        let w = l.alloc(Weights, 10, "wte").unwrap();
        assert_eq!(row(&l, "h.0.qkv", Activations), (50, 150));
        assert_eq!(row(&l, "wte", Weights), (10, 10));
        // A label reused under another category is counted apart.
        let g = l.alloc(Gradients, 7, "wte").unwrap();
        assert_eq!(row(&l, "wte", Gradients), (7, 7));
        assert_eq!(row(&l, "wte", Weights), (10, 10));
        let order: Vec<(String, MemoryCategory)> = l
            .labels()
            .into_iter()
            .map(|b| (b.label, b.category))
            .collect();
        assert_eq!(
            order,
            [
                ("wte".to_string(), Weights),
                ("wte".to_string(), Gradients),
                ("h.0.qkv".to_string(), Activations)
            ]
        );
        l.free(b, Activations, 50, "h.0.qkv");
        l.free(g, Gradients, 7, "wte");
        l.reset_peaks();
        let left: Vec<LabelBytes> = l.labels();
        assert_eq!(
            left,
            [LabelBytes {
                label: "wte".into(),
                category: Weights,
                live: 10,
                peak: 10
            }]
        );
        l.free(w, Weights, 10, "wte");
        assert_eq!(row(&l, "wte", Weights), (0, 10));
    }

    #[test]
    fn op_spans_count_flops_always_and_record_only_while_recording() {
        let l = Ledger::new();
        drop(l.op("matmul", 10, "out"));
        assert_eq!(l.flops(), 10);
        assert!(l.drain_events().is_empty());
        l.set_recording(true);
        {
            let _op = l.op("gelu", 5, "h.0.gelu_out");
        }
        let failed: Result<()> = Err(Error::shape("add", "mismatch"));
        assert!(l.op("add", 3, "x").finish(failed).is_err());
        assert_eq!(l.flops(), 15);
        let events = l.drain_events();
        assert_eq!(events.len(), 1);
        let MemoryEvent::Op {
            name, label, flops, ..
        } = &events[0]
        else {
            panic!("not an op: {:?}", events[0]);
        };
        assert_eq!(
            (name.as_ref(), label.as_str(), *flops),
            ("gelu", "h.0.gelu_out", 5)
        );
        assert_eq!(l.snapshot().flops, 15);
        l.reset_peaks();
        assert_eq!(l.snapshot().flops, 0);
    }

    /// A fused kernel that ran ends its span with its result; one that declined cancels
    /// the span (its parts record their own), and one that failed records nothing.
    #[test]
    fn finish_fused_records_only_a_fused_kernel_that_ran() {
        let l = Ledger::new();
        l.set_recording(true);
        let ran = l.op("fused", 7, "a").finish_fused(Ok(Some(2.5)));
        assert!(matches!(ran, Some(Ok(r)) if r == 2.5));
        assert!(l
            .op("fused", 11, "b")
            .finish_fused::<()>(Ok(None))
            .is_none());
        let failed = l
            .op("fused", 13, "c")
            .finish_fused::<()>(Err(Error::shape("fused", "mismatch")));
        assert!(matches!(failed, Some(Err(_))));
        assert_eq!(l.flops(), 7);
        let events = l.drain_events();
        assert_eq!(events.len(), 1);
        assert!(matches!(&events[0], MemoryEvent::Op { label, .. } if label == "a"));
    }

    /// The op fence runs when a recorded span opens and when it closes, never while the
    /// ledger does not record, and a failed wait becomes the op's error.
    #[test]
    fn the_op_fence_waits_at_both_ends_of_a_recorded_span() {
        let l = Ledger::new();
        let waits = Arc::new(AtomicU64::new(0));
        let fail = Arc::new(AtomicBool::new(false));
        let (w, f) = (Arc::clone(&waits), Arc::clone(&fail));
        l.set_op_fence(Some(Arc::new(move || {
            w.fetch_add(1, Ordering::Relaxed);
            if f.load(Ordering::Relaxed) {
                Err(Error::shape("wait", "device fault"))
            } else {
                Ok(())
            }
        })));
        l.op("gelu", 5, "a").finish(Ok(())).unwrap();
        assert_eq!(waits.load(Ordering::Relaxed), 0, "not recording: no waits");
        l.set_recording(true);
        l.op("gelu", 5, "a").finish(Ok(())).unwrap();
        assert_eq!(waits.load(Ordering::Relaxed), 2);
        drop(l.op("gelu", 5, "b"));
        assert_eq!(waits.load(Ordering::Relaxed), 4, "a dropped span waits too");
        l.op("gelu", 5, "c").cancel();
        assert_eq!(
            waits.load(Ordering::Relaxed),
            5,
            "a cancelled span ran nothing"
        );
        fail.store(true, Ordering::Relaxed);
        assert!(l.op("gelu", 5, "d").finish(Ok(())).is_err());
        assert_eq!(
            l.drain_events().len(),
            2,
            "the failed and cancelled spans are not events"
        );
        l.set_op_fence(None);
        l.op("gelu", 5, "e").finish(Ok(())).unwrap();
        assert_eq!(waits.load(Ordering::Relaxed), 7);
    }
}
