//! The Chrome trace (Trace Event Format, read by Perfetto and `chrome://tracing`): steps,
//! phases and ops as complete events on three tracks, and memory per category as counters.

use super::{time_us, Walk};
use crate::memory::{MemoryCategory, MemoryEvent};
use serde_json::{json, Map, Value};

const PID: u64 = 1;
const STEPS: u64 = 1;
const PHASES: u64 = 2;
const OPS: u64 = 3;

/// The trace of `events`.
pub(super) fn render(events: &[MemoryEvent]) -> Value {
    let mut out =
        vec![json!({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "trainkit"}})];
    for (tid, name) in [(STEPS, "steps"), (PHASES, "phases"), (OPS, "ops")] {
        out.push(json!({
            "name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}
        }));
        out.push(json!({
            "name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
            "args": {"sort_index": tid}
        }));
    }
    let mut walk = Walk::default();
    // Open phases: (phase, begin time).
    let mut open = Vec::new();
    // When the current step's first phase began.
    let mut step_start = None;
    for e in events {
        let step = walk.steps_done + 1;
        match e {
            MemoryEvent::Alloc { .. } | MemoryEvent::Free { .. } => {}
            MemoryEvent::PhaseBegin { phase, time_us } => {
                step_start.get_or_insert(*time_us);
                open.push((*phase, *time_us));
            }
            MemoryEvent::PhaseEnd { phase, time_us } => {
                if let Some(i) = open.iter().rposition(|(p, _)| p == phase) {
                    let (_, begin) = open.remove(i);
                    out.push(json!({
                        "name": phase.to_string(), "cat": "phase", "ph": "X",
                        "pid": PID, "tid": PHASES,
                        "ts": begin, "dur": time_us.saturating_sub(begin),
                        "args": {"step": step},
                    }));
                }
            }
            MemoryEvent::Op {
                name,
                label,
                flops,
                time_us,
                duration_us,
            } => out.push(json!({
                "name": name, "cat": "op", "ph": "X", "pid": PID, "tid": OPS,
                "ts": time_us, "dur": duration_us,
                "args": {"flops": flops, "label": label, "step": step},
            })),
            MemoryEvent::StepEnd {
                step: n, time_us, ..
            } => {
                let begin = step_start.take().unwrap_or(*time_us);
                out.push(json!({
                    "name": format!("step {n}"), "cat": "step", "ph": "X",
                    "pid": PID, "tid": STEPS,
                    "ts": begin, "dur": time_us.saturating_sub(begin),
                    "args": {"step": n},
                }));
                out.push(json!({
                    "name": format!("step {n} end"), "cat": "step", "ph": "i", "s": "g",
                    "pid": PID, "tid": STEPS, "ts": time_us,
                }));
                open.clear();
            }
        }
        walk.apply(e);
        if matches!(e, MemoryEvent::Alloc { .. } | MemoryEvent::Free { .. }) {
            let args: Map<String, Value> = MemoryCategory::ALL
                .iter()
                .map(|c| (c.name().to_string(), json!(walk.live.get(*c))))
                .collect();
            out.push(json!({
                "name": "memory (bytes)", "ph": "C", "pid": PID, "ts": time_us(e),
                "args": args,
            }));
        }
    }
    json!({"traceEvents": out, "displayTimeUnit": "ms"})
}
