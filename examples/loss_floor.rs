//! Activations against the sequence length, and the loss floor: for GPT-2 124M and Llama
//! 3.2 1B (bf16, batch 1) at sequence lengths up to 8192 and each recompute policy, the
//! step's activation peak with the fused and with the materialized attention; then the
//! activation peak of the loss phase and of the whole step with the fused linear
//! cross-entropy and with the materialized logits. Exact figures from the meta backend
//! (the trainer run with no data), as `trainkit memory`.
//!
//! `cargo run --release --example loss_floor`

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use trainkit::data::DataLoader;
use trainkit::memory::{format_bytes, MemoryEvent, Phase};
use trainkit::ops::{AttentionPath, LossPath};
use trainkit::prelude::*;
use trainkit::MetaBackend;

/// The most activation bytes live during the loss phase, and over everything with the
/// phase it was reached in.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct LossPeak {
    live: u64,
    phases: Vec<Phase>,
    loss_peak: u64,
    peak: u64,
    peak_phase: Option<Phase>,
}

#[typetag::serde(name = "loss_peak")]
impl MemoryObserver for LossPeak {
    fn on_event(&mut self, event: &MemoryEvent) {
        match event {
            MemoryEvent::Alloc {
                category: MemoryCategory::Activations,
                bytes,
                ..
            } => {
                self.live += bytes;
                if self.phases.last() == Some(&Phase::Loss) {
                    self.loss_peak = self.loss_peak.max(self.live);
                }
                if self.live > self.peak {
                    self.peak = self.live;
                    self.peak_phase = self.phases.last().copied();
                }
            }
            MemoryEvent::Free {
                category: MemoryCategory::Activations,
                bytes,
                ..
            } => self.live -= bytes,
            MemoryEvent::PhaseBegin { phase, .. } => {
                self.phases.push(*phase);
                if *phase == Phase::Loss {
                    self.loss_peak = self.loss_peak.max(self.live);
                }
            }
            MemoryEvent::PhaseEnd { .. } => {
                self.phases.pop();
            }
            _ => {}
        }
    }
}

/// One step's loss-phase and whole-step activation peaks (bf16, batch 1, the second step).
fn measure(
    family: &str,
    t: usize,
    policy: &dyn CheckpointPolicy,
    attention: AttentionPath,
    loss: LossPath,
) -> Result<LossPeak> {
    let model: Box<dyn Model> = if family == "gpt2-124m" {
        let config = Gpt2Config {
            n_positions: t,
            ..Gpt2Config::gpt2_124m()
        };
        Box::new(
            Gpt2::new(config)?
                .with_attention(attention)
                .with_loss(loss, None)?,
        )
    } else {
        let llama = trainkit::estimate::preset("llama-3.2-1b")?.shape;
        let config: trainkit::LlamaConfig =
            trainkit::model::FamilyConfig::from_shape(&llama.for_length(t))?;
        Box::new(
            trainkit::Llama::new(config)?
                .with_attention(attention)
                .with_loss(loss, None)?,
        )
    };
    let data = DataLoader::new(vec![0u32; t + 1], 1, t)?;
    let backend: Arc<dyn Backend> = Arc::new(MetaBackend::new());
    let mut trainer = Trainer::builder(model, backend, data)
        .precision(MixedBf16 { fp32_grads: false })
        .checkpoint(dyn_clone::clone_box(policy))
        .observer(LossPeak::default())
        .build()?;
    trainer.step()?;
    let s = trainer.step()?;
    let o = trainer.observer().clone();
    assert_eq!(o.peak, s.memory.peak.get(MemoryCategory::Activations));
    Ok(o)
}

fn main() -> Result<()> {
    let policies: [(&str, Box<dyn CheckpointPolicy>); 3] = [
        ("none", Box::new(NoRecompute)),
        ("selective", Box::new(Selective)),
        ("full", Box::new(Full)),
    ];
    let runs: Vec<(&str, usize)> = [1024, 2048, 4096, 8192]
        .map(|t| ("gpt2-124m", t))
        .into_iter()
        .chain([1024, 2048, 4096, 8192].map(|t| ("llama-3.2-1b", t)))
        .collect();
    let bytes = |b: u64| format!("{} ({b})", format_bytes(b));

    println!("Step activation peak, fused loss, by attention path:\n");
    println!("| model | T | recompute | materialized attention | fused attention |");
    println!("| --- | --- | --- | --- | --- |");
    for &(family, t) in &runs {
        for (name, policy) in &policies {
            let peak = |a| measure(family, t, policy.as_ref(), a, LossPath::Fused);
            let (m, f) = (
                peak(AttentionPath::Materialized)?,
                peak(AttentionPath::Fused)?,
            );
            println!(
                "| {family} | {t} | {name} | {} | {} |",
                bytes(m.peak),
                bytes(f.peak)
            );
        }
    }

    println!("\nThe loss floor, fused attention, by loss path:\n");
    println!(
        "| model | T | recompute | loss | loss-phase peak | step activation peak | peak phase |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &(family, t) in &runs {
        for (name, policy) in &policies {
            for path in [LossPath::Materialized, LossPath::Fused] {
                let o = measure(family, t, policy.as_ref(), AttentionPath::Fused, path)?;
                let phase = o.peak_phase.map_or("-".to_string(), |p| p.to_string());
                println!(
                    "| {family} | {t} | {name} | {path} | {} | {} | {phase} |",
                    bytes(o.loss_peak),
                    bytes(o.peak),
                );
            }
        }
    }
    Ok(())
}
