//! The optimizer step inside backward: each parameter updated as soon as its gradient is
//! complete and the gradient freed. Updates are bitwise those of the step after backward
//! (without clipping), gradient memory drops to about a layer's, the exact prediction
//! still equals the ledger, and the combinations that cannot work are refused by name.

use crate::common;

use common::mirrored::Mirrored;
use common::{categories_match_prediction, corpus_loader, cpu, tiny_config, trainkit, update_bits};
use std::sync::Arc;
use trainkit::collective::Rehearsal;
use trainkit::estimate::{predict_rank, predict_with, MicroBatch};
use trainkit::ops::LossPath;
use trainkit::{
    AdamW, AdamW8bit, CheckpointPolicy, Constant, Error, Fp32, Full, Gpt2, MemoryCategory,
    MixedBf16, NoRecompute, Precision, Trainer, TrainerOptions,
};

fn options(in_backward: bool) -> TrainerOptions {
    TrainerOptions {
        grad_clip: 0.0,
        optimizer_in_backward: in_backward,
        ..TrainerOptions::default()
    }
}

type Tk =
    Trainer<Box<dyn Precision>, Box<dyn CheckpointPolicy>, AdamW, Constant, trainkit::PeakTracker>;

fn trainer(
    in_backward: bool,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
) -> Tk {
    trainer_with(in_backward, precision, policy, (LossPath::Fused, None))
}

/// As [`trainer`], with the loss computed by `loss` (path and chunk).
fn trainer_with(
    in_backward: bool,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
    loss: (LossPath, Option<usize>),
) -> Tk {
    Trainer::builder(
        Gpt2::new(tiny_config())
            .unwrap()
            .with_loss(loss.0, loss.1)
            .unwrap(),
        cpu(),
        corpus_loader(20_000, 11, 2, 32),
    )
    .precision(precision)
    .checkpoint(policy)
    .options(options(in_backward))
    .build()
    .unwrap()
}

#[test]
fn updates_are_bitwise_those_of_the_step_after_backward() {
    let fused = (LossPath::Fused, None);
    for (precision, policy, loss) in [
        (
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
            fused,
        ),
        (Box::new(Fp32), Box::new(Full), fused),
        (
            Box::new(MixedBf16 { fp32_grads: true }),
            Box::new(Full),
            fused,
        ),
        (Box::new(Fp32), Box::new(Full), (LossPath::Fused, Some(7))),
        (
            Box::new(Fp32),
            Box::new(Full),
            (LossPath::Materialized, None),
        ),
    ] {
        let mut after = trainer_with(false, precision.clone(), policy.clone(), loss);
        let mut inside = trainer_with(true, precision, policy, loss);
        for step in 1..=4 {
            let (a, b) = (after.step().unwrap(), inside.step().unwrap());
            assert_eq!(a.loss, b.loss, "step {step}");
            assert!(!b.skipped);
            assert!(
                ((a.grad_norm - b.grad_norm) / a.grad_norm).abs() < 1e-5,
                "step {step}: norm {} vs {}",
                a.grad_norm,
                b.grad_norm
            );
            // Gradients live one layer at a time: far less than the model's.
            let whole = a.memory.peak.get(MemoryCategory::Gradients);
            let held = b.memory.peak.get(MemoryCategory::Gradients);
            assert!(held * 2 < whole, "step {step}: {held} of {whole} bytes");
        }
        for (p, q) in after.params().iter().zip(inside.params()) {
            let be = after.backend();
            assert_eq!(
                be.to_f32(p.value()).unwrap(),
                be.to_f32(q.value()).unwrap(),
                "{}",
                p.name()
            );
            assert!(q.grad().is_none(), "{} keeps a gradient", q.name());
        }
    }
}

#[test]
fn the_prediction_equals_the_ledger() {
    for policy in [
        Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
        Box::new(Full),
    ] {
        let p = predict_with(
            Box::new(Gpt2::new(tiny_config()).unwrap()),
            MicroBatch {
                batch_size: 2,
                seq_len: 32,
            },
            &Fp32,
            policy.as_ref(),
            &AdamW::default(),
            &options(true),
        )
        .unwrap();
        let mut t = trainer(true, Box::new(Fp32), policy);
        t.step().unwrap();
        let s = t.step().unwrap();
        for c in MemoryCategory::ALL {
            assert_eq!(s.memory.peak.get(c), p.peak.get(c), "{c}");
        }
        assert_eq!(s.memory.peak_total, p.peak_total);
    }
}

/// 8-bit AdamW inside backward: the same bits as after backward, and the prediction
/// equals the ledger.
#[test]
fn adamw8bit_inside_backward_is_bitwise_and_predicted() {
    let build = |in_backward: bool| {
        Trainer::builder(
            Gpt2::new(tiny_config()).unwrap(),
            cpu(),
            corpus_loader(20_000, 11, 2, 32),
        )
        .optimizer(AdamW8bit::default())
        .options(options(in_backward))
        .build()
        .unwrap()
    };
    let (mut after, mut inside) = (build(false), build(true));
    let mut last = None;
    for step in 1..=3 {
        let (a, b) = (after.step().unwrap(), inside.step().unwrap());
        assert_eq!(a.loss, b.loss, "step {step}");
        last = Some(b);
    }
    for (p, q) in after.params().iter().zip(inside.params()) {
        let be = after.backend();
        assert_eq!(
            be.to_f32(p.value()).unwrap(),
            be.to_f32(q.value()).unwrap(),
            "{}",
            p.name()
        );
    }
    let p = predict_with(
        Box::new(Gpt2::new(tiny_config()).unwrap()),
        MicroBatch {
            batch_size: 2,
            seq_len: 32,
        },
        &Fp32,
        &NoRecompute,
        &AdamW8bit::default(),
        &options(true),
    )
    .unwrap();
    let s = last.unwrap();
    for c in MemoryCategory::ALL {
        assert_eq!(s.memory.peak.get(c), p.peak.get(c), "{c}");
    }
}

#[test]
fn what_cannot_work_is_refused_by_name() {
    let clipped = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(20_000, 11, 2, 32),
    )
    .options(TrainerOptions {
        optimizer_in_backward: true,
        ..TrainerOptions::default()
    })
    .build();
    let Err(Error::Config { message, .. }) = clipped else {
        panic!("clipping with the optimizer inside backward should be refused");
    };
    assert!(message.contains("--grad-clip 0"), "{message}");
    // Accumulation is refused when the trainer is built, before the first step.
    let accumulating = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(20_000, 11, 2, 32),
    )
    .accumulation(Constant::new(2))
    .options(options(true))
    .build();
    let Err(e) = accumulating.map(|_| ()) else {
        panic!("accumulating with the optimizer inside backward should be refused");
    };
    let e = e.to_string();
    assert!(
        e.contains("--grad-accum 1") && e.contains("--optimizer-in-backward"),
        "{e}"
    );
    let (ok, out, err) = trainkit(&[
        "train",
        "--optimizer-in-backward",
        "--grad-clip",
        "0",
        "--grad-accum",
        "2",
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(!ok);
    assert!(err.contains("--grad-accum 1"), "{err}");
    assert!(!out.contains("step "), "{out}");

    let (ok, _, err) = trainkit(&["train", "--optimizer-in-backward", "--steps", "1"]);
    assert!(!ok);
    assert!(err.contains("--grad-clip 0"), "{err}");
    let (ok, out, err) = trainkit(&[
        "train",
        "--optimizer-in-backward",
        "--grad-clip",
        "0",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("step     2/2"), "{out}");
}

#[test]
fn trainkit_memory_shows_what_it_saves() {
    let grads = |extra: &[&str]| -> u64 {
        let mut args = vec!["memory", "--model", "gpt2", "--recompute", "full", "--json"];
        args.extend_from_slice(extra);
        let (ok, out, err) = trainkit(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["trainkit_exact"]["bytes"]["gradients"].as_u64().unwrap()
    };
    let (after, inside) = (grads(&[]), grads(&["--optimizer-in-backward"]));
    // GPT-2 small in bf16: 2 bytes per parameter after backward (the embedding's
    // vocabulary padded to 50304 rows); inside it, the tied embedding's gradient (live
    // from the head to the embedding) and about a layer's.
    assert_eq!(after, 2 * (124_439_808 + 47 * 768));
    assert!(inside < after / 3, "{inside} of {after}");
}

/// One rank of two (the other mirroring it) updating inside backward, as DDP, ZeRO-1 and
/// ZeRO-2, with buckets of a few gradients and with none (each gradient summed alone):
/// the losses, weights, master weights and optimizer state are bit for bit those of the
/// same rank updating after backward; gradient memory is a fraction of the model's; the
/// rank's ledger equals the meta backend's rehearsal of that rank.
#[test]
fn on_two_ranks_updates_inside_backward_are_those_after_it() {
    for zero in [0u8, 1, 2] {
        for bucket_bytes in [8 << 10, 0] {
            let options = |in_backward: bool| TrainerOptions {
                zero_stage: zero,
                // ZeRO-2 sums in buckets, always.
                bucket_bytes: if zero == 2 {
                    bucket_bytes.max(1)
                } else {
                    bucket_bytes
                },
                ..self::options(in_backward)
            };
            let run = |in_backward: bool| {
                let mut t = Trainer::builder(
                    Gpt2::new(tiny_config()).unwrap(),
                    cpu(),
                    corpus_loader(20_000, 11, 2, 32),
                )
                .precision(MixedBf16 { fp32_grads: false })
                .options(options(in_backward))
                .collective(Arc::new(Mirrored))
                .build()
                .unwrap();
                let stats: Vec<_> = (0..3).map(|_| t.step().unwrap()).collect();
                (stats, update_bits(&t))
            };
            let what = format!("zero {zero}, buckets of {bucket_bytes} bytes");
            let ((after, a), (inside, b)) = (run(false), run(true));
            for (step, (x, y)) in after.iter().zip(&inside).enumerate() {
                assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{what}: step {step}");
                assert!(!y.skipped, "{what}: step {step}");
                // Under ZeRO each owner's squares are summed across the ranks, and the
                // mirror stands for rank 1 by doubling rank 0's: the norm is the step's
                // only where every rank holds every gradient (tests/data_parallel.rs
                // checks it on real ranks).
                assert!(
                    zero > 0 || ((x.grad_norm - y.grad_norm) / x.grad_norm).abs() < 1e-5,
                    "{what}: step {step}: norm {} vs {}",
                    x.grad_norm,
                    y.grad_norm
                );
                let whole = x.memory.peak.get(MemoryCategory::Gradients);
                let held = y.memory.peak.get(MemoryCategory::Gradients);
                // ZeRO-2 after backward keeps only this rank's share already.
                let fraction = if zero == 2 { 1 } else { 2 };
                assert!(
                    held * fraction < whole,
                    "{what}: step {step}: {held} of {whole} bytes"
                );
            }
            assert!(
                a == b,
                "{what}: weights, master weights and optimizer state"
            );
            let predicted = predict_rank(
                Box::new(Gpt2::new(tiny_config()).unwrap()),
                MicroBatch {
                    batch_size: 2,
                    seq_len: 32,
                },
                &MixedBf16 { fp32_grads: false },
                &NoRecompute,
                &AdamW::default(),
                &options(true),
                Rehearsal::new(0, 2).unwrap(),
            )
            .unwrap();
            for (step, s) in inside.iter().enumerate().skip(1) {
                categories_match_prediction(s, &predicted, step as u64 + 1, &what);
                assert_eq!(
                    s.memory.peak_total, predicted.peak_total,
                    "{what}: step {step}"
                );
            }
        }
    }
}
