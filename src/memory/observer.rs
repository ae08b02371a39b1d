//! `MemoryObserver`: the policy that watches the memory event stream, and the shipped ones.

use super::{format_bytes, CategoryBytes, MemoryEvent};
use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// Receives every [`MemoryEvent`] of training, in order.
///
/// Implement it to log, plot or police memory. Observers are configurable by `kind` in a
/// config file (`[observer] kind = "peak_tracker"`); a user's own observer becomes
/// configurable as soon as its crate is linked into the binary.
#[typetag::serde(tag = "kind")]
pub trait MemoryObserver: DynClone + Debug + Send + Sync {
    /// Called once per event, in the order the events happened.
    fn on_event(&mut self, event: &MemoryEvent);
}

dyn_clone::clone_trait_object!(MemoryObserver);

impl MemoryObserver for Box<dyn MemoryObserver> {
    fn on_event(&mut self, event: &MemoryEvent) {
        (**self).on_event(event)
    }
    #[doc(hidden)]
    fn typetag_name(&self) -> &'static str {
        (**self).typetag_name()
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// Combines two observers in code: both see every event.
#[typetag::serialize(name = "pair")]
impl<A, B> MemoryObserver for (A, B)
where
    A: MemoryObserver + Clone + Serialize,
    B: MemoryObserver + Clone + Serialize,
{
    fn on_event(&mut self, event: &MemoryEvent) {
        self.0.on_event(event);
        self.1.on_event(event);
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// Any number of observers; the configurable way to combine them
/// (`[observer] kind = "observers"` with `observers = [{ kind = "..." }, ...]`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Observers {
    /// The observers, each seeing every event in order.
    pub observers: Vec<Box<dyn MemoryObserver>>,
}

#[typetag::serde(name = "observers")]
impl MemoryObserver for Observers {
    fn on_event(&mut self, event: &MemoryEvent) {
        for o in &mut self.observers {
            o.on_event(event);
        }
    }
}

/// Tracks live and peak bytes per category from the event stream, overall and per step.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTracker {
    #[serde(skip)]
    live: CategoryBytes,
    #[serde(skip)]
    peak: CategoryBytes,
    #[serde(skip)]
    peak_total: u64,
    #[serde(skip)]
    step_peak: CategoryBytes,
    #[serde(skip)]
    step_peak_total: u64,
    #[serde(skip)]
    last_step_peak: CategoryBytes,
    #[serde(skip)]
    last_step_peak_total: u64,
}

impl PeakTracker {
    /// A tracker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes live now, per category.
    pub fn live(&self) -> CategoryBytes {
        self.live
    }

    /// Each category's maximum over everything seen.
    pub fn peak(&self) -> CategoryBytes {
        self.peak
    }

    /// The maximum total over everything seen.
    pub fn peak_total(&self) -> u64 {
        self.peak_total
    }

    /// Each category's maximum during the last completed step.
    pub fn last_step_peak(&self) -> CategoryBytes {
        self.last_step_peak
    }

    /// The maximum total during the last completed step.
    pub fn last_step_peak_total(&self) -> u64 {
        self.last_step_peak_total
    }
}

#[typetag::serde(name = "peak_tracker")]
impl MemoryObserver for PeakTracker {
    fn on_event(&mut self, event: &MemoryEvent) {
        match event {
            MemoryEvent::Alloc {
                category, bytes, ..
            } => {
                *self.live.get_mut(*category) += bytes;
                self.peak.max_with(&self.live);
                self.step_peak.max_with(&self.live);
                self.peak_total = self.peak_total.max(self.live.total());
                self.step_peak_total = self.step_peak_total.max(self.live.total());
            }
            MemoryEvent::Free {
                category, bytes, ..
            } => {
                let live = self.live.get_mut(*category);
                *live = live.saturating_sub(*bytes);
            }
            MemoryEvent::StepEnd { .. } => {
                self.last_step_peak = self.step_peak;
                self.last_step_peak_total = self.step_peak_total;
                self.step_peak = self.live;
                self.step_peak_total = self.live.total();
            }
            MemoryEvent::PhaseBegin { .. }
            | MemoryEvent::PhaseEnd { .. }
            | MemoryEvent::Op { .. } => {}
        }
    }
}

/// Logs the event stream through the `log` crate: allocations and frees at trace level,
/// phases at debug level, and a per-category summary of live bytes at each step end (info).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogObserver {
    #[serde(skip)]
    live: CategoryBytes,
}

#[typetag::serde(name = "log")]
impl MemoryObserver for LogObserver {
    fn on_event(&mut self, event: &MemoryEvent) {
        match event {
            MemoryEvent::Alloc {
                category,
                bytes,
                label,
                ..
            } => {
                *self.live.get_mut(*category) += bytes;
                log::trace!("alloc {label} ({category}) {}", format_bytes(*bytes));
            }
            MemoryEvent::Free {
                category,
                bytes,
                label,
                ..
            } => {
                let live = self.live.get_mut(*category);
                *live = live.saturating_sub(*bytes);
                log::trace!("free {label} ({category}) {}", format_bytes(*bytes));
            }
            MemoryEvent::PhaseBegin { phase, .. } => log::debug!("begin {phase}"),
            MemoryEvent::PhaseEnd { phase, .. } => log::debug!("end {phase}"),
            MemoryEvent::Op {
                name,
                label,
                flops,
                duration_us,
                ..
            } => log::trace!("op {name} -> {label}: {flops} flops in {duration_us} us"),
            MemoryEvent::StepEnd { step, device, .. } => {
                let parts: Vec<String> = self
                    .live
                    .iter()
                    .filter(|(_, b)| *b > 0)
                    .map(|(c, b)| format!("{c} {}", format_bytes(b)))
                    .collect();
                log::info!(
                    "step {step} live memory: {} (total {})",
                    parts.join(", "),
                    format_bytes(self.live.total())
                );
                if let Some(d) = device {
                    log::info!(
                        "step {step} device: reserved {}, free {} of {}",
                        format_bytes(d.reserved),
                        format_bytes(d.free),
                        format_bytes(d.total)
                    );
                }
            }
        }
    }
}
