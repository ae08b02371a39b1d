//! The exact memory model predicts what the ledger measures, byte for byte: every shipped
//! checkpoint policy and two written here, both precisions, several shapes, first and
//! later steps.

use crate::common;

use common::{corpus_loader, cpu, EveryOtherInput};
use serde::{Deserialize, Serialize};
use trainkit::estimate::{predict, predict_gpt2, MemoryPrediction, MicroBatch};
use trainkit::ops::LossPath;
use trainkit::{
    ActivationSite, AdamW, AdamW8bit, CheckpointPolicy, Fp32, Full, Gpt2, Gpt2Config,
    MemoryCategory, MixedBf16, MixedFp16, NoRecompute, Optimizer, Precision, Retention, Selective,
    Sgd, Tags, Trainer,
};

/// Drops the MLP's wide activations of the last layer only.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct LastMlp;

#[typetag::serde(name = "last_mlp")]
impl CheckpointPolicy for LastMlp {
    fn retain(&self, site: &ActivationSite) -> Retention {
        let wide = site.is(Tags::MLP | Tags::WIDE);
        if wide && site.layer + 1 == site.n_layer {
            Retention::Recompute
        } else {
            Retention::Keep
        }
    }
}

fn policies() -> Vec<Box<dyn CheckpointPolicy>> {
    vec![
        Box::new(NoRecompute),
        Box::new(Selective),
        Box::new(Full),
        Box::new(EveryOtherInput),
        Box::new(LastMlp),
        Box::new(trainkit::Budget::new(50_000)),
    ]
}

fn precisions() -> Vec<Box<dyn Precision>> {
    vec![
        Box::new(Fp32),
        Box::new(MixedBf16 { fp32_grads: true }),
        Box::new(MixedBf16 { fp32_grads: false }),
        Box::new(MixedFp16::default()),
    ]
}

fn config(n_layer: usize, n_head: usize, n_embd: usize, vocab_size: usize) -> Gpt2Config {
    Gpt2Config {
        n_layer,
        n_head,
        n_embd,
        n_positions: 32,
        vocab_size,
        layer_norm_epsilon: 1e-5,
    }
}

/// Runs two steps and compares each with the prediction.
fn check(
    config: &Gpt2Config,
    batch: usize,
    seq: usize,
    micro_batches: usize,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
    optimizer: Box<dyn Optimizer>,
) {
    check_model(
        Gpt2::new(config.clone()).unwrap(),
        batch,
        seq,
        micro_batches,
        precision,
        policy,
        optimizer,
    )
}

/// Runs two steps of `model` and compares each with the prediction.
fn check_model(
    model: Gpt2,
    batch: usize,
    seq: usize,
    micro_batches: usize,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
    optimizer: Box<dyn Optimizer>,
) {
    let what = format!(
        "{:?} {:?} B={batch} T={seq} k={micro_batches} {precision:?} {policy:?} {optimizer:?}",
        model.config(),
        model.loss_path()
    );
    let predicted: MemoryPrediction = predict(
        Box::new(model.clone()),
        MicroBatch {
            batch_size: batch,
            seq_len: seq,
        },
        precision.as_ref(),
        policy.as_ref(),
        optimizer.as_ref(),
    )
    .unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(8_000, 3, batch, seq))
        .precision(precision)
        .checkpoint(policy)
        .optimizer(optimizer)
        .accumulation(trainkit::Constant::new(micro_batches))
        .build()
        .unwrap();
    for step in 1..=2 {
        let s = t.step().unwrap();
        common::step_matches_prediction(&s, &predicted, step, micro_batches, &what);
        let k = micro_batches as u64;
        let a = predicted.activations;
        assert_eq!(s.stash.kept_bytes, k * a.kept_bytes, "kept, {what}");
        assert_eq!(
            s.stash.dropped_bytes,
            k * a.dropped_bytes,
            "dropped, {what}"
        );
        assert_eq!(
            s.stash.recomputed_bytes,
            k * a.recomputed_bytes,
            "recomputed, {what}"
        );
    }
}

#[test]
fn every_policy_and_precision_is_predicted_exactly() {
    let c = config(3, 2, 32, 256);
    for precision in precisions() {
        for policy in policies() {
            check(
                &c,
                2,
                16,
                1,
                precision.clone(),
                policy,
                Box::new(AdamW::default()),
            );
        }
    }
}

#[test]
fn other_shapes_optimizers_and_accumulation_are_predicted_exactly() {
    // A classifier-dominated model (the loss peaks), a long-context one (attention
    // peaks), odd sizes, accumulation over micro-batches, SGD with and without momentum.
    let cases: [(Gpt2Config, usize, usize, usize); 4] = [
        (config(2, 2, 16, 2048), 1, 8, 1),
        (config(4, 4, 32, 256), 1, 32, 2),
        (config(1, 3, 24, 301), 3, 7, 1),
        (config(5, 1, 8, 256), 2, 32, 3),
    ];
    for (c, b, t, k) in cases {
        for policy in policies() {
            check(
                &c,
                b,
                t,
                k,
                Box::new(MixedBf16 { fp32_grads: true }),
                policy.clone(),
                Box::new(Sgd {
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: 0.0,
                }),
            );
            check(
                &c,
                b,
                t,
                k,
                Box::new(Fp32),
                policy,
                Box::new(Sgd {
                    lr: 0.1,
                    momentum: 0.0,
                    weight_decay: 0.1,
                }),
            );
        }
    }
}

/// 8-bit AdamW: u8 codes (one byte each), f32 block maxima and the f32 moments of the
/// small tensors, predicted byte for byte, in both precisions and with recompute.
#[test]
fn adamw8bit_is_predicted_exactly() {
    let cases: [(Gpt2Config, usize, usize, usize); 2] = [
        (config(2, 2, 32, 256), 2, 16, 1),
        (config(1, 3, 24, 301), 1, 7, 2),
    ];
    for (c, b, t, k) in cases {
        for precision in precisions() {
            for policy in policies() {
                check(
                    &c,
                    b,
                    t,
                    k,
                    precision.clone(),
                    policy,
                    Box::new(AdamW8bit::default()),
                );
            }
        }
    }
    // The state is the codes, the maxima and the small tensors' f32 moments.
    let c = config(2, 2, 32, 256);
    let numels: Vec<usize> = c
        .param_shapes()
        .iter()
        .map(|(_, shape)| shape.iter().product())
        .collect();
    let opt = AdamW8bit::default();
    let want: u64 = numels.iter().map(|n| opt.state_bytes(*n)).sum();
    let p = predict_gpt2(
        &c,
        MicroBatch {
            batch_size: 2,
            seq_len: 16,
        },
        &Fp32,
        &NoRecompute,
        &opt,
    )
    .unwrap();
    assert_eq!(p.peak.get(MemoryCategory::OptimizerState), want);
    let adamw = 8 * numels.iter().sum::<usize>() as u64;
    assert!(
        want * 2 < adamw,
        "{want} bytes of 8-bit state against {adamw}"
    );
}

#[test]
fn the_prediction_refuses_impossible_shapes() {
    let c = config(2, 2, 16, 64);
    let p = |b, t| {
        predict_gpt2(
            &c,
            MicroBatch {
                batch_size: b,
                seq_len: t,
            },
            &Fp32,
            &NoRecompute,
            &AdamW::default(),
        )
    };
    assert!(p(0, 8).is_err());
    assert!(p(1, 0).is_err());
    let e = p(1, 33).unwrap_err().to_string();
    assert!(e.contains("32"), "{e}");
    assert!(p(1, 32).is_ok());
}

#[test]
fn each_loss_path_is_predicted_exactly() {
    // The fused loss in one chunk and in uneven ones, and the materialized logits, on a
    // classifier-dominated model where the loss sets the peak.
    for (path, chunk) in [
        (LossPath::Fused, None),
        (LossPath::Fused, Some(3)),
        (LossPath::Materialized, None),
    ] {
        for policy in policies() {
            for precision in precisions() {
                let model = Gpt2::new(config(2, 2, 16, 2048))
                    .unwrap()
                    .with_loss(path, chunk)
                    .unwrap();
                check_model(
                    model,
                    2,
                    8,
                    2,
                    precision,
                    policy.clone(),
                    Box::new(AdamW::default()),
                );
            }
        }
    }
}
