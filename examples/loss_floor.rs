//! The loss floor: for GPT-2 124M and Llama 3.2 1B (bf16, batch 1) at sequence lengths
//! up to 8192, the
//! activation peak of the loss phase and of the whole step, with the fused linear
//! cross-entropy and with the materialized logits, for each recompute policy. Exact
//! figures from the meta backend (the trainer run with no data), as `trainkit memory`.
//!
//! `cargo run --release --example loss_floor`

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use trainkit::data::DataLoader;
use trainkit::memory::{format_bytes, MemoryEvent, Phase};
use trainkit::ops::LossPath;
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

fn main() -> Result<()> {
    let policies: [(&str, Box<dyn CheckpointPolicy>); 3] = [
        ("none", Box::new(NoRecompute)),
        ("selective", Box::new(Selective)),
        ("full", Box::new(Full)),
    ];
    println!(
        "| model | T | recompute | loss | loss-phase peak | step activation peak | peak phase |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let llama = trainkit::estimate::preset("llama-3.2-1b")?.architecture;
    for (family, t) in [1024, 2048, 4096, 8192]
        .map(|t| ("gpt2-124m", t))
        .into_iter()
        .chain([1024, 2048, 4096, 8192].map(|t| ("llama-3.2-1b", t)))
    {
        for (name, policy) in &policies {
            for path in [LossPath::Materialized, LossPath::Fused] {
                let model: Box<dyn Model> = if family == "gpt2-124m" {
                    let config = Gpt2Config {
                        n_positions: t,
                        ..Gpt2Config::gpt2_124m()
                    };
                    Box::new(Gpt2::new(config)?.with_loss(path, None)?)
                } else {
                    let config = trainkit::LlamaConfig::from_architecture(&llama, t)?;
                    Box::new(trainkit::Llama::new(config)?.with_loss(path, None)?)
                };
                let data = DataLoader::new(vec![0u32; t + 1], 1, t)?;
                let backend: Arc<dyn Backend> = Arc::new(MetaBackend::new());
                let mut trainer = Trainer::builder(model, backend, data)
                    .precision(MixedBf16 { fp32_grads: false })
                    .checkpoint(policy.clone())
                    .observer(LossPeak::default())
                    .build()?;
                trainer.step()?;
                let s = trainer.step()?;
                let o = trainer.observer();
                assert_eq!(o.peak, s.memory.peak.get(MemoryCategory::Activations));
                let phase = o.peak_phase.map_or("-".to_string(), |p| p.to_string());
                println!(
                    "| {family} | {t} | {name} | {path} | {} ({}) | {} ({}) | {phase} |",
                    format_bytes(o.loss_peak),
                    o.loss_peak,
                    format_bytes(o.peak),
                    o.peak,
                );
            }
        }
    }
    Ok(())
}
