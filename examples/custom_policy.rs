//! A checkpoint policy and an accumulation schedule written outside trainkit, used in
//! training, saved to a TOML config and read back from it.
//!
//! `cargo run --release --example custom_policy`
//!
//! `EveryNth` keeps the input of every n-th layer and nothing else (Megatron's "uniform"
//! recomputation): backward reruns each chunk of n layers from its checkpoint. Because the
//! impl is registered with `#[typetag::serde]`, a config file can name it with
//! `[checkpoint] kind = "every_nth"` as soon as this code is linked into the binary.

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use trainkit::checkpoint::{ActivationSite, Retention, Tags};
use trainkit::config::RunConfig;
use trainkit::prelude::*;
use trainkit::CpuBackend;

/// Keeps only the input of every `n`-th layer.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct EveryNth {
    n: usize,
}

#[typetag::serde(name = "every_nth")]
impl CheckpointPolicy for EveryNth {
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.is(Tags::LAYER_INPUT) && site.layer % self.n.max(1) == 0 {
            Retention::Keep
        } else {
            Retention::Recompute
        }
    }
}

/// Doubles the micro-batches every `every` steps, from 1 up to `max` (a batch-size
/// warmup in steps rather than tokens).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Doubling {
    every: u64,
    max: usize,
}

#[typetag::serde(name = "doubling")]
impl AccumulationSchedule for Doubling {
    fn micro_batches(
        &self,
        ctx: &trainkit::accumulate::AccumulationContext,
    ) -> trainkit::Result<usize> {
        let doublings = (ctx.step / self.every.max(1)).min(16) as u32;
        Ok((1usize << doublings).min(self.max.max(1)))
    }
}

fn main() -> trainkit::Result<()> {
    let cfg = RunConfig::from_toml(
        r#"
[model]
n_layer = 4
n_head = 4
n_embd = 128
n_positions = 128
vocab_size = 256

[checkpoint]
kind = "every_nth"
n = 2

[accumulation]
kind = "doubling"
every = 2
max = 4
"#,
    )?;
    // Saved and read back: the user's kinds survive the round trip.
    let saved = cfg.to_toml()?;
    let cfg = RunConfig::from_toml(&saved)?;
    println!(
        "from the config: checkpoint {:?}, accumulation {:?}",
        cfg.checkpoint, cfg.accumulation
    );
    let corpus = SyntheticCorpus::builtin();
    let tokens = ByteTokenizer.encode(&corpus.generate(1 << 18, 1));
    for (name, policy) in [
        ("none", Box::new(NoRecompute) as Box<dyn CheckpointPolicy>),
        ("every_nth", cfg.checkpoint.clone()),
    ] {
        let data = DataLoader::new(tokens.clone(), 8, 128)?;
        let model = cfg.model.build()?;
        let mut trainer = Trainer::builder(model, Arc::new(CpuBackend::new()), data)
            .checkpoint(policy)
            .accumulation(cfg.accumulation.clone())
            .build()?;
        let mut last = None;
        for _ in 0..5 {
            last = Some(trainer.step()?);
        }
        let s = last.expect("ran steps");
        println!(
            "{name:>10}: loss {:.4} after {} micro-batches in step 5, activation peak {}, \
             recomputed {} per step",
            s.loss,
            s.micro_batches,
            trainkit::memory::format_bytes(s.memory.peak.get(MemoryCategory::Activations)),
            trainkit::memory::format_bytes(s.stash.recomputed_bytes)
        );
    }
    Ok(())
}
