//! The memory event stream: every buffer tagged, phases in order, observers agreeing with
//! the ledger.

mod common;

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
