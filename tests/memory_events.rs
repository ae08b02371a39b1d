//! The memory event stream: every buffer tagged, phases in order, observers agreeing with
//! the ledger.

use crate::common;

use common::{corpus_loader, cpu, tiny_config};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use trainkit::{Gpt2, MemoryCategory, MemoryEvent, MemoryObserver, PeakTracker, Phase, Trainer};

/// Records every event.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Recorder {
    #[serde(skip)]
    events: Vec<MemoryEvent>,
}

#[typetag::serde(name = "recorder")]
impl MemoryObserver for Recorder {
    fn on_event(&mut self, event: &MemoryEvent) {
        self.events.push(event.clone());
    }
}

#[test]
fn the_stream_tags_every_buffer_and_marks_every_phase() {
    let model = Gpt2::new(tiny_config()).unwrap();
    let n_layer = tiny_config().n_layer;
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 2, 16))
        .observer((Recorder::default(), PeakTracker::new()))
        .build()
        .unwrap();
    let s1 = t.step().unwrap();
    let s2 = t.step().unwrap();
    let (rec, peaks) = t.observer();

    // The tracker saw what the ledger counted.
    assert_eq!(peaks.last_step_peak(), s2.memory.peak);
    assert_eq!(peaks.last_step_peak_total(), s2.memory.peak_total);
    assert_eq!(peaks.live(), t.backend().ledger().snapshot().live);

    // Phases of one micro-batch, in order.
    let phases: Vec<(bool, Phase)> = rec
        .events
        .iter()
        .filter_map(|e| match e {
            MemoryEvent::PhaseBegin { phase, .. } => Some((true, *phase)),
            MemoryEvent::PhaseEnd { phase, .. } => Some((false, *phase)),
            _ => None,
        })
        .collect();
    let mut want = vec![
        (true, Phase::MicroBatch(0)),
        (true, Phase::Embedding),
        (false, Phase::Embedding),
    ];
    for l in 0..n_layer {
        want.extend([(true, Phase::Forward(l)), (false, Phase::Forward(l))]);
    }
    want.extend([(true, Phase::Loss), (false, Phase::Loss)]);
    for l in (0..n_layer).rev() {
        want.extend([(true, Phase::Backward(l)), (false, Phase::Backward(l))]);
    }
    want.extend([
        (true, Phase::EmbeddingBackward),
        (false, Phase::EmbeddingBackward),
        (false, Phase::MicroBatch(0)),
        (true, Phase::Optimizer),
        (false, Phase::Optimizer),
    ]);
    assert_eq!(phases.len(), 2 * want.len());
    assert_eq!(phases[..want.len()], want[..]);
    assert_eq!(phases[want.len()..], want[..]);

    // Every allocation is labelled; every activation is freed within its step; optimizer
    // state appears once, during the first optimizer phase.
    let mut live: HashMap<u64, (MemoryCategory, String)> = HashMap::new();
    let mut phase = None;
    let mut steps = 0;
    let mut state_allocs = 0;
    for e in &rec.events {
        match e {
            MemoryEvent::Alloc {
                id,
                category,
                label,
                ..
            } => {
                assert!(!label.is_empty(), "unlabelled {category} buffer");
                if *category == MemoryCategory::OptimizerState {
                    assert_eq!(
                        phase,
                        Some(Phase::Optimizer),
                        "optimizer state outside the optimizer"
                    );
                    assert_eq!(steps, 0, "optimizer state allocated after step 1");
                    state_allocs += 1;
                }
                live.insert(*id, (*category, label.clone()));
            }
            MemoryEvent::Free { id, .. } => {
                assert!(live.remove(id).is_some(), "free of an unknown buffer");
            }
            MemoryEvent::PhaseBegin { phase: p, .. } => phase = Some(*p),
            MemoryEvent::StepEnd { .. } => {
                steps += 1;
                let leaked: Vec<_> = live
                    .values()
                    .filter(|(c, _)| *c == MemoryCategory::Activations)
                    .collect();
                assert!(
                    leaked.is_empty(),
                    "activations live across a step end: {leaked:?}"
                );
            }
            MemoryEvent::PhaseEnd { .. } | MemoryEvent::Op { .. } => {}
        }
    }
    assert_eq!(steps, 2);
    assert_eq!(
        state_allocs,
        2 * t.params().len(),
        "two Adam moments per parameter"
    );
    // Step 1 created gradients and optimizer state; step 2 reused them.
    assert!(s1.memory.peak.get(MemoryCategory::OptimizerState) > 0);
    assert_eq!(
        s1.memory.peak.get(MemoryCategory::OptimizerState),
        s2.memory.peak.get(MemoryCategory::OptimizerState)
    );
}

/// The ops of a training step, with their labels and FLOP counts, on `backend`.
fn step_ops(backend: std::sync::Arc<dyn trainkit::Backend>) -> (Vec<(String, String, u64)>, u64) {
    let model = Gpt2::new(tiny_config()).unwrap();
    let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
        .observer(Recorder::default())
        .build()
        .unwrap();
    t.step().unwrap();
    t.step().unwrap();
    let flops = t.backend().ledger().flops();
    let events = &t.observer().events;
    let first_step_end = events
        .iter()
        .position(|e| matches!(e, MemoryEvent::StepEnd { .. }))
        .unwrap();
    let ops = events[first_step_end..]
        .iter()
        .filter_map(|e| match e {
            MemoryEvent::Op {
                name, label, flops, ..
            } => Some((name.to_string(), label.clone(), *flops)),
            _ => None,
        })
        .collect();
    (ops, flops)
}

/// The operand checks and op spans are the `Backend` trait's: the meta backend, whose
/// kernels compute nothing, records the CPU's ops with the CPU's FLOP counts.
#[test]
fn the_meta_backend_records_the_cpus_ops_and_flops() {
    let (cpu_ops, cpu_flops) = step_ops(cpu());
    let (meta_ops, meta_flops) = step_ops(std::sync::Arc::new(trainkit::MetaBackend::new()));
    assert!(cpu_ops
        .iter()
        .any(|(name, _, f)| name == "matmul" && *f > 0));
    assert_eq!(meta_ops, cpu_ops);
    assert_eq!(meta_flops, cpu_flops);
}
