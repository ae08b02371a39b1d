//! Checks shared by the adapter tests (LoRA over a float base, QLoRA over an NF4 one).

use super::{check_central_difference_in_step, gradient_probe, per_param};
use trainkit::{CheckpointPolicy, Full, Model, NoRecompute, Precision, Trainer};

/// The gradients of every parameter that trains (the `B`s made non-zero first) against
/// central differences of the loss, two elements each: through every layer's updates, so
/// the input gradients of the adapter nodes are checked too. At least `min_checks` pass.
pub fn gradients_match_finite_differences(what: &str, model: Box<dyn Model>, min_checks: usize) {
    let (b, t) = (2, 12);
    let batch = super::corpus_loader(4_000, 7, b, t).next_batch();
    let mut trainer = gradient_probe(model, b, t);
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
    let mut checked = 0;
    for (i, gi) in g.iter().enumerate() {
        if !trainer.params()[i].trains() {
            continue;
        }
        let n = gi.len();
        for at in [(i * 7 + 3) % n, (i * 13 + 1) % n] {
            let (analytic, spot) = (gi[at] as f64, (i, at));
            check_central_difference_in_step(what, &mut trainer, &batch, spot, analytic, 1);
            checked += 1;
        }
    }
    assert!(checked >= min_checks, "{what}: {checked} checks");
}

/// The meta backend's prediction of `model()` equals the ledger, category by category and in
/// total, over two steps, with no recomputation and with full (bf16, batch 2 × 16).
pub fn prediction_equals_ledger(what: &str, model: &dyn Fn() -> Box<dyn Model>) {
    let policies = [
        Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
        Box::new(Full),
    ];
    super::prediction_equals_ledger(what, model, &policies);
}

/// Two steps of `model` on `corpus_loader(20_000, 1, 2, 16)` under `precision` and
/// `policy`: the weights after them and the two losses.
pub fn two_steps(
    model: Box<dyn Model>,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
) -> (Vec<Vec<f32>>, Vec<f64>) {
    let mut t = Trainer::builder(model, super::cpu(), super::corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(policy)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (super::values(&t), losses)
}
