//! Recomputation changes memory, never results: every policy gives gradients and updates
//! bitwise equal to keeping everything, in f32 on the CPU, on each attention path (fused
//! and materialized) and each loss path (the fused linear cross-entropy in one chunk and
//! in several, and the materialized logits).

use crate::common;

use common::{corpus_loader, cpu, grads, tiny_config, values, EveryOtherInput};
use serde::{Deserialize, Serialize};
use trainkit::checkpoint::{ActivationSite, Retention};
use trainkit::ops::{AttentionPath, LossPath};
use trainkit::{Budget, CheckpointPolicy, Full, Gpt2, NoRecompute, Selective, Trainer};

/// Drops everything, layer inputs included: backward reruns from the embedding.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DropAll;

#[typetag::serde(name = "drop_all")]
impl CheckpointPolicy for DropAll {
    fn retain(&self, _site: &ActivationSite) -> Retention {
        Retention::Recompute
    }
}

/// Gradients, updated values, losses and recomputed bytes of a short run.
type RunResult = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f64>, u64);

fn run<C: CheckpointPolicy>(
    policy: C,
    attention: AttentionPath,
    loss: (LossPath, Option<usize>),
) -> RunResult {
    let model = Gpt2::new(tiny_config())
        .unwrap()
        .with_attention(attention)
        .with_loss(loss.0, loss.1)
        .unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 2, 16))
        .checkpoint(policy)
        .build()
        .unwrap();
    let mut losses = vec![];
    let mut recomputed = 0;
    for _ in 0..2 {
        let s = t.step().unwrap();
        losses.push(s.loss);
        recomputed += s.stash.recomputed_bytes;
    }
    (grads(&t), values(&t), losses, recomputed)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

#[test]
fn every_policy_is_bitwise_equal_to_no_recompute() {
    for attention in [AttentionPath::Fused, AttentionPath::Materialized] {
        for loss in [
            (LossPath::Fused, None),
            (LossPath::Fused, Some(5)),
            (LossPath::Materialized, None),
        ] {
            policies_agree(attention, loss);
        }
    }
}

fn policies_agree(attention: AttentionPath, loss: (LossPath, Option<usize>)) {
    let (g0, v0, l0, r0) = run(NoRecompute, attention, loss);
    assert_eq!(r0, 0, "keeping everything recomputes nothing");
    let others: Vec<(&str, Box<dyn CheckpointPolicy>)> = vec![
        ("full", Box::new(Full)),
        ("selective", Box::new(Selective)),
        ("every_other_input", Box::new(EveryOtherInput)),
        ("drop_all", Box::new(DropAll)),
        ("budget_0", Box::new(Budget::new(0))),
        ("budget_40k", Box::new(Budget::new(40_000))),
    ];
    for (name, policy) in others {
        // Selective drops only what grows with T², which the fused attention never makes.
        let drops = !(name == "selective" && attention == AttentionPath::Fused);
        let (g, v, l, r) = run(policy, attention, loss);
        let name = format!("{name} ({attention} attention, {loss:?})");
        assert_eq!(r > 0, drops, "{name} recomputed {r} bytes");
        assert_eq!(l, l0, "{name}: losses");
        assert!(
            bits(&g) == bits(&g0),
            "{name}: gradients differ from NoRecompute"
        );
        assert!(
            bits(&v) == bits(&v0),
            "{name}: updated weights differ from NoRecompute"
        );
    }
}
