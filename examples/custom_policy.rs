//! A checkpoint policy written outside trainkit, used in code and from a TOML config.
//!
//! `cargo run --release --example custom_policy`
//!
//! `EveryNth` keeps the input of every n-th layer and nothing else (Megatron's "uniform"
//! recomputation): backward reruns each chunk of n layers from its checkpoint. Because the
//! impl is registered with `#[typetag::serde]`, a config file can name it with
//! `[checkpoint] kind = "every_nth"` as soon as this code is linked into the binary.

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use trainkit::checkpoint::{ActivationKind, ActivationSite, Retention};
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
        if site.kind == ActivationKind::LayerInput && site.layer % self.n.max(1) == 0 {
            Retention::Keep
        } else {
            Retention::Recompute
        }
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
"#,
    )?;
    println!("checkpoint policy from the config: {:?}", cfg.checkpoint);
    let corpus = SyntheticCorpus::builtin();
    let tokens = ByteTokenizer.encode(&corpus.generate(1 << 18, 1));
    for (name, policy) in [
        ("none", Box::new(NoRecompute) as Box<dyn CheckpointPolicy>),
        ("every_nth", cfg.checkpoint.clone()),
    ] {
        let data = DataLoader::new(tokens.clone(), 8, 128)?;
        let model = Gpt2::new(cfg.model.clone())?;
        let mut trainer = Trainer::builder(model, Arc::new(CpuBackend::new()), data)
            .checkpoint(policy)
            .build()?;
        let mut last = None;
        for _ in 0..5 {
            last = Some(trainer.step()?);
        }
        let s = last.expect("ran steps");
        println!(
            "{name:>10}: loss {:.4}, activation peak {}, recomputed {} per step",
            s.loss,
            trainkit::memory::format_bytes(s.memory.peak.get(MemoryCategory::Activations)),
            trainkit::memory::format_bytes(s.stash.recomputed_bytes)
        );
    }
    Ok(())
}
