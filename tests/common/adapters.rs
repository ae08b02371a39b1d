//! Checks shared by the adapter tests (LoRA over a float base, QLoRA over an NF4 one).

use super::{corpus_loader, cpu, per_param, values};
use trainkit::{
    AdamW, CheckpointPolicy, Fp32, Full, MemoryCategory, MixedBf16, Model, NoRecompute, Trainer,
    TrainerOptions,
};

/// The gradients of every parameter that trains (the `B`s made non-zero first) against
/// central differences of the loss, two elements each: through every layer's updates, so
/// the input gradients of the adapter nodes are checked too. At least `min_checks` pass.
pub fn gradients_match_finite_differences(what: &str, model: Box<dyn Model>, min_checks: usize) {
    let (b, t) = (2, 12);
    let batch = corpus_loader(4_000, 7, b, t).next_batch();
    let mut trainer = Trainer::builder(model, cpu(), corpus_loader(4_000, 7, b, t))
        .precision(Fp32)
        .optimizer(AdamW {
            lr: 0.0,
            ..AdamW::default()
        })
        .options(TrainerOptions {
            grad_clip: 0.0,
            ..TrainerOptions::default()
        })
        .build()
        .unwrap();
    let be = trainer.backend().clone();
    let mut rng = trainkit::Rng::new(3);
    for p in trainer.params_mut() {
        if p.name().contains(".lora_B") {
            let v: Vec<f32> = (0..p.numel())
                .map(|_| (rng.normal() * 0.2) as f32)
                .collect();
            p.set_value(be.as_ref(), &v).unwrap();
        }
    }
    trainer.step().unwrap();
    let g = per_param(&trainer, |p| p.grad().unwrap_or(p.value()));
    let tokens = (b * t) as f64;
    let names: Vec<String> = trainer.params().iter().map(|p| p.name().into()).collect();
    let mut checked = 0;
    for i in 0..names.len() {
        if !trainer.params()[i].trains() {
            continue;
        }
        let n = g[i].len();
        let original = values(&trainer)[i].clone();
        for at in [(i * 7 + 3) % n, (i * 13 + 1) % n] {
            let h = 1e-2f32;
            let mut loss_at = |delta: f32| {
                let mut v = original.clone();
                v[at] += delta;
                trainer.params_mut()[i].set_value(be.as_ref(), &v).unwrap();
                trainer.loss_on(&batch).unwrap() / tokens
            };
            let numeric = (loss_at(h) - loss_at(-h)) / (2.0 * h as f64);
            loss_at(0.0);
            let analytic = g[i][at] as f64;
            let err = (numeric - analytic).abs() / (1e-3 + numeric.abs().max(analytic.abs()));
            assert!(
                err < 2e-2,
                "{what}: {}[{at}]: numeric {numeric:.6}, analytic {analytic:.6}",
                names[i]
            );
            checked += 1;
        }
    }
    assert!(checked >= min_checks, "{what}: {checked} checks");
}

/// The meta backend's prediction of `model()` equals the ledger, category by category,
/// over two steps, with no recomputation and with full (bf16, batch 2 × 16).
pub fn prediction_equals_ledger(what: &str, model: &dyn Fn() -> Box<dyn Model>) {
    for policy in [
        Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
        Box::new(Full),
    ] {
        let precision = MixedBf16 { fp32_grads: false };
        let predicted = trainkit::estimate::predict(
            model(),
            trainkit::estimate::MicroBatch {
                batch_size: 2,
                seq_len: 16,
            },
            &precision,
            policy.as_ref(),
            &AdamW::default(),
        )
        .unwrap();
        let mut t = Trainer::builder(model(), cpu(), corpus_loader(8_000, 3, 2, 16))
            .precision(precision)
            .checkpoint(policy.clone())
            .build()
            .unwrap();
        for step in 1..=2 {
            let s = t.step().unwrap();
            for c in MemoryCategory::ALL {
                assert_eq!(
                    s.memory.peak.get(c),
                    predicted.peak.get(c),
                    "step {step} {c} of {what} {policy:?}"
                );
            }
        }
    }
}
