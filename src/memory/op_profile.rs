//! `OpProfile`: an observer that sums the time, flops and calls of each backend op.

use super::{MemoryEvent, MemoryObserver};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

/// The totals of one op name in an [`OpProfile`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpTotals {
    /// Microseconds inside the op's spans.
    pub micros: u64,
    /// Floating-point operations the op executed.
    pub flops: u64,
    /// How many times it ran.
    pub calls: u64,
}

/// Where the time of training goes, op by op: the time, flops and calls of every backend op
/// ([`MemoryEvent::Op`]), summed per op name (`matmul`, `flash_attention_backward`, ...).
///
/// On the CPU an op's span is its run time. A GPU backend queues work without waiting, so
/// its spans time the launch unless it waits at both ends of each span (the CUDA
/// backend's `CudaOptions::sync_ops`); then they time the device's work.
///
/// ```
/// # use trainkit::memory::{MemoryEvent, MemoryObserver, OpProfile};
/// let mut p = OpProfile::default();
/// let op = |us| MemoryEvent::Op {
///     name: "matmul".into(),
///     label: "h.0.qkv".into(),
///     flops: 2_000_000,
///     time_us: 0,
///     duration_us: us,
/// };
/// p.on_event(&op(10));
/// p.on_event(&op(30));
/// let m = p.get("matmul").unwrap();
/// assert_eq!((m.micros, m.flops, m.calls), (40, 4_000_000, 2));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpProfile {
    #[serde(default)]
    by_op: BTreeMap<String, OpTotals>,
}

#[typetag::serde(name = "op_profile")]
impl MemoryObserver for OpProfile {
    fn on_event(&mut self, event: &MemoryEvent) {
        if let MemoryEvent::Op {
            name,
            flops,
            duration_us,
            ..
        } = event
        {
            let e = self.by_op.entry(name.to_string()).or_default();
            e.micros += duration_us;
            e.flops += flops;
            e.calls += 1;
        }
    }
}

impl OpProfile {
    /// The totals of the op named `name`, if it ran.
    pub fn get(&self, name: &str) -> Option<OpTotals> {
        self.by_op.get(name).copied()
    }

    /// Every op that ran, most time first.
    pub fn by_time(&self) -> Vec<(&str, OpTotals)> {
        let mut rows: Vec<_> = self.by_op.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1.micros));
        rows
    }

    /// Microseconds inside all op spans.
    pub fn total_micros(&self) -> u64 {
        self.by_op.values().map(|t| t.micros).sum()
    }

    /// What was added since `earlier`, a clone of this profile taken before (e.g. to leave
    /// warm-up steps out).
    pub fn since(&self, earlier: &OpProfile) -> OpProfile {
        let mut by_op = self.by_op.clone();
        for (name, before) in &earlier.by_op {
            if let Some(e) = by_op.get_mut(name) {
                e.micros = e.micros.saturating_sub(before.micros);
                e.flops = e.flops.saturating_sub(before.flops);
                e.calls = e.calls.saturating_sub(before.calls);
            }
        }
        by_op.retain(|_, t| t.calls > 0);
        OpProfile { by_op }
    }

    /// A table, one op per line, most time first: its share of `wall_secs` (the wall time
    /// the profile covers), milliseconds, calls and GFLOP/s.
    pub fn table(&self, wall_secs: f64) -> String {
        let mut out = String::new();
        let share = |micros: u64| {
            if wall_secs > 0.0 {
                100.0 * micros as f64 * 1e-6 / wall_secs
            } else {
                0.0
            }
        };
        let _ = writeln!(
            out,
            "  ops: {:.0}% of the wall time inside op spans",
            share(self.total_micros())
        );
        for (name, t) in self.by_time() {
            let secs = t.micros as f64 * 1e-6;
            let gflops = if secs > 0.0 {
                t.flops as f64 / secs * 1e-9
            } else {
                0.0
            };
            let _ = writeln!(
                out,
                "    {name:<28} {:>5.1}% {:>8.1} ms {:>6} calls {:>9.1} GFLOP/s",
                share(t.micros),
                secs * 1e3,
                t.calls,
                gflops
            );
        }
        out
    }
}

/// An [`OpProfile`] that a trainer's observer feeds while its owner reads it: clones
/// share one profile (give the trainer a clone, keep one to read with
/// [`SharedOpProfile::snapshot`]). It serializes as nothing: a run's profile is not part
/// of its config.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SharedOpProfile {
    #[serde(skip)]
    profile: Arc<Mutex<OpProfile>>,
}

impl SharedOpProfile {
    /// The profile so far.
    pub fn snapshot(&self) -> OpProfile {
        self.profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[typetag::serialize(name = "shared_op_profile")]
impl MemoryObserver for SharedOpProfile {
    fn on_event(&mut self, event: &MemoryEvent) {
        self.profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .on_event(event);
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &'static str, us: u64, flops: u64) -> MemoryEvent {
        MemoryEvent::Op {
            name: name.into(),
            label: "x".into(),
            flops,
            time_us: 0,
            duration_us: us,
        }
    }

    #[test]
    fn sums_per_op_and_subtracts_an_earlier_profile() {
        let mut p = OpProfile::default();
        p.on_event(&op("gelu", 5, 100));
        let warm = p.clone();
        p.on_event(&op("matmul", 40, 8_000_000));
        p.on_event(&op("gelu", 15, 300));
        p.on_event(&MemoryEvent::PhaseBegin {
            phase: crate::memory::Phase::MicroBatch(0),
            time_us: 0,
        });
        let timed = p.since(&warm);
        assert_eq!(
            timed.by_time(),
            vec![
                (
                    "matmul",
                    OpTotals {
                        micros: 40,
                        flops: 8_000_000,
                        calls: 1
                    }
                ),
                (
                    "gelu",
                    OpTotals {
                        micros: 15,
                        flops: 300,
                        calls: 1
                    }
                ),
            ]
        );
        assert_eq!(timed.total_micros(), 55);
        let table = timed.table(110e-6);
        assert!(table.contains("50% of the wall time"), "{table}");
        let matmul = table.lines().nth(1).unwrap();
        assert!(
            matmul.contains("matmul") && matmul.contains("200.0 GFLOP/s"),
            "{matmul}"
        );
    }

    #[test]
    fn is_configurable_by_kind() {
        let o: Box<dyn MemoryObserver> = toml::from_str("kind = \"op_profile\"").unwrap();
        assert_eq!(o.typetag_name(), "op_profile");
    }
}
