//! Pure bf16: bf16 weights and gradients without an f32 master copy, each update rounded
//! back into the weights to nearest, stochastically or Kahan-compensated.

use crate::common;

use common::{corpus_loader, cpu, per_param, tiny_config};
use trainkit::config::{Overrides, PolicyFlags, RunConfig};
use trainkit::ops::update_rounding::UpdateRounding;
use trainkit::{
    AdamW, Constant, DType, Gpt2, MemoryCategory, MixedBf16, Model, Precision, PureBf16, Trainer,
    TrainerOptions,
};

const ROUNDINGS: [UpdateRounding; 3] = [
    UpdateRounding::Nearest,
    UpdateRounding::Stochastic,
    UpdateRounding::Kahan,
];

fn pure(rounding: UpdateRounding) -> PureBf16 {
    PureBf16 { rounding }
}

fn trainer<P: Precision>(
    precision: P,
    lr: f32,
    in_backward: bool,
) -> Trainer<P, trainkit::NoRecompute, AdamW, Constant, trainkit::PeakTracker> {
    let adamw = AdamW {
        lr,
        weight_decay: 0.0,
        ..AdamW::default()
    };
    trainer_with(precision, adamw, in_backward)
}

/// [`trainer`] with its own AdamW.
fn trainer_with<P: Precision>(
    precision: P,
    adamw: AdamW,
    in_backward: bool,
) -> Trainer<P, trainkit::NoRecompute, AdamW, Constant, trainkit::PeakTracker> {
    Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(20_000, 3, 2, 16),
    )
    .precision(precision)
    .optimizer(adamw)
    .options(TrainerOptions {
        optimizer_in_backward: in_backward,
        grad_clip: 0.0,
        ..TrainerOptions::default()
    })
    .build()
    .unwrap()
}

/// The flags and the config choose pure bf16; what cannot work is an error naming the
/// flag and what would.
#[test]
fn flags_and_configs_choose_pure_bf16_and_refuse_what_cannot_work() {
    let apply = |precision: Option<&str>, master: Option<&str>, rounding: Option<&str>| {
        let mut cfg = RunConfig::default();
        Overrides {
            policy: PolicyFlags {
                precision: precision.map(str::to_string),
                master_weights: master.map(str::to_string),
                update_rounding: rounding.map(str::to_string),
                ..PolicyFlags::default()
            },
            ..Overrides::default()
        }
        .apply(&mut cfg)
        .map(|()| cfg.precision)
    };
    let p = apply(Some("bf16"), Some("none"), None).unwrap();
    assert_eq!(p.update_rounding(), Some(UpdateRounding::Nearest));
    assert!(!p.master_weights());
    assert_eq!(p.grad_dtype(), DType::Bf16);
    for r in ROUNDINGS {
        let p = apply(Some("bf16"), Some("none"), Some(r.name())).unwrap();
        assert_eq!(p.update_rounding(), Some(r));
        assert!(trainkit::precision::describe(p.as_ref()).contains(r.name()));
    }
    let p = apply(Some("bf16"), Some("f32"), None).unwrap();
    assert!(p.master_weights() && p.update_rounding().is_none());

    for (precision, master, rounding, flag, says) in [
        (
            Some("fp32"),
            None,
            Some("kahan"),
            "--update-rounding",
            "fp32",
        ),
        (
            Some("bf16"),
            None,
            Some("kahan"),
            "--update-rounding",
            "--master-weights none",
        ),
        (
            Some("bf16"),
            Some("f32"),
            Some("stochastic"),
            "--update-rounding",
            "none",
        ),
        (
            Some("fp32"),
            Some("none"),
            None,
            "--master-weights",
            "--precision bf16",
        ),
        (
            Some("fp16"),
            Some("none"),
            None,
            "--master-weights",
            "--precision bf16",
        ),
        (
            Some("bf16"),
            Some("half"),
            None,
            "--master-weights",
            "f32 or none",
        ),
        (
            Some("bf16"),
            Some("none"),
            Some("up"),
            "--update-rounding",
            "kahan",
        ),
    ] {
        let e = apply(precision, master, rounding).unwrap_err().to_string();
        assert!(
            e.contains(flag) && e.contains(says),
            "{precision:?} {master:?} {rounding:?}: {e}"
        );
    }

    // A config names it as a precision of its own, and round-trips.
    let cfg = RunConfig::from_toml("precision = { kind = \"pure_bf16\", rounding = \"kahan\" }\n")
        .unwrap();
    assert_eq!(cfg.precision.update_rounding(), Some(UpdateRounding::Kahan));
    let back = RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    assert_eq!(
        back.precision.update_rounding(),
        Some(UpdateRounding::Kahan)
    );
    // --update-rounding alone changes a pure-bf16 config's rounding.
    let mut cfg = cfg;
    Overrides {
        policy: PolicyFlags {
            update_rounding: Some("stochastic".into()),
            ..PolicyFlags::default()
        },
        ..Overrides::default()
    }
    .apply(&mut cfg)
    .unwrap();
    assert_eq!(
        cfg.precision.update_rounding(),
        Some(UpdateRounding::Stochastic)
    );
}

/// Weights, gradients and AdamW's moments are bf16 and nothing f32 of the weights' size
/// outlives a step: between steps the master-weight category holds the Kahan compensation
/// (2 bytes per parameter) or nothing; during the update, one parameter's f32 copy at a
/// time.
#[test]
fn bytes_are_laid_out_as_documented() {
    let n = tiny_config().num_params() as u64;
    let largest = Gpt2::new(tiny_config())
        .unwrap()
        .init_params()
        .iter()
        .map(|p| p.numel() as u64)
        .max()
        .unwrap();
    for r in ROUNDINGS {
        let mut t = trainer(pure(r), 1e-3, false);
        let s = t.step().unwrap();
        let live = t.backend().ledger().snapshot().live;
        let comp = if r == UpdateRounding::Kahan { 2 * n } else { 0 };
        assert_eq!(live.get(MemoryCategory::Weights), 2 * n, "{r}");
        assert_eq!(live.get(MemoryCategory::MasterWeights), comp, "{r}");
        assert_eq!(live.get(MemoryCategory::Gradients), 2 * n, "{r}");
        assert_eq!(live.get(MemoryCategory::OptimizerState), 4 * n, "{r}");
        assert_eq!(
            s.memory.peak.get(MemoryCategory::MasterWeights),
            comp + 4 * largest,
            "{r}: the compensation and one parameter's f32 copy"
        );
        for p in t.params() {
            assert_eq!(p.weight().dtype(), DType::Bf16);
            assert_eq!(p.value().dtype(), DType::Bf16, "{}", p.name());
            assert_eq!(p.update_rounding(), Some(r));
            assert_eq!(p.compensation().is_some(), r == UpdateRounding::Kahan);
        }
    }
}

/// The mean size of the change of every weight from `before` to `after`.
fn mean_change(before: &[Vec<f32>], after: &[Vec<f32>]) -> f64 {
    let (mut sum, mut n) = (0f64, 0usize);
    for (b, a) in before.iter().zip(after) {
        for (x, y) in b.iter().zip(a) {
            sum += (y - x).abs() as f64;
            n += 1;
        }
    }
    sum / n as f64
}

/// With updates below half a bf16 step (lr 1e-5 against weights of about 0.02, whose bf16
/// step is 1.2e-4), rounding to nearest loses most of them, while stochastic rounding and
/// Kahan's compensation move the weights as far as the f32 master copy of mixed precision
/// does.
#[test]
fn stochastic_and_kahan_keep_the_updates_nearest_rounding_loses() {
    let steps = 20;
    let mut mixed = trainer(MixedBf16 { fp32_grads: false }, 1e-5, false);
    let (before, master) = (
        per_param(&mixed, |p| p.weight()),
        per_param(&mixed, |p| p.value()),
    );
    for _ in 0..steps {
        mixed.step().unwrap();
    }
    let want = mean_change(&master, &per_param(&mixed, |p| p.value()));
    let mut moved = Vec::new();
    for r in ROUNDINGS {
        let mut t = trainer(pure(r), 1e-5, false);
        assert_eq!(
            per_param(&t, |p| p.weight()),
            before,
            "the same initial weights"
        );
        for _ in 0..steps {
            t.step().unwrap();
        }
        let got = mean_change(&before, &per_param(&t, |p| p.weight()));
        eprintln!("{r}: mean change {got:.3e}, f32 master {want:.3e}");
        moved.push(got / want);
    }
    assert!(
        moved[0] < 0.5,
        "nearest keeps {:.2} of the change",
        moved[0]
    );
    for (r, m) in ROUNDINGS.iter().zip(&moved).skip(1) {
        assert!(
            (0.8..1.25).contains(m),
            "{r} keeps {m:.2} of the f32 master's change"
        );
    }
}

/// Pure bf16 learns as mixed bf16 does at an ordinary learning rate, in every rounding.
#[test]
fn pure_bf16_learns_as_mixed_bf16_does() {
    let last = |losses: &[f64]| losses[losses.len() - 5..].iter().sum::<f64>() / 5.0;
    let mut mixed = trainer(MixedBf16 { fp32_grads: false }, 3e-3, false);
    let want: Vec<f64> = (0..40).map(|_| mixed.step().unwrap().loss).collect();
    for r in ROUNDINGS {
        let mut t = trainer(pure(r), 3e-3, false);
        let got: Vec<f64> = (0..40).map(|_| t.step().unwrap().loss).collect();
        eprintln!(
            "{r}: {:.4} -> {:.4}, mixed {:.4}",
            got[0],
            last(&got),
            last(&want)
        );
        assert!(last(&got) < got[0] - 1.0, "{r} learns");
        assert!(
            (last(&got) - last(&want)).abs() / last(&want) < 0.03,
            "{r}: {} against mixed bf16's {}",
            last(&got),
            last(&want)
        );
    }
}

/// The optimizer inside backward updates each parameter as the step after backward does,
/// bit for bit (the stochastic stream is keyed by the parameter's name and the step, not
/// by when the update runs).
#[test]
fn the_optimizer_in_backward_gives_the_same_weights() {
    for r in ROUNDINGS {
        let mut after = trainer(pure(r), 1e-3, false);
        let mut inside = trainer(pure(r), 1e-3, true);
        for _ in 0..3 {
            let (a, b) = (after.step().unwrap(), inside.step().unwrap());
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{r}");
        }
        assert_eq!(
            per_param(&after, |p| p.weight()),
            per_param(&inside, |p| p.weight()),
            "{r}"
        );
        if r == UpdateRounding::Kahan {
            assert_eq!(
                per_param(&after, |p| p.compensation().unwrap()),
                per_param(&inside, |p| p.compensation().unwrap())
            );
        }
    }
}

/// The meta backend predicts pure bf16's bytes as the ledger counts them, the
/// compensation and the transient f32 copy of the update included.
#[test]
fn the_prediction_equals_the_ledger() {
    use trainkit::estimate::{predict, MicroBatch};
    for r in ROUNDINGS {
        let predicted = predict(
            Box::new(Gpt2::new(tiny_config()).unwrap()),
            MicroBatch {
                batch_size: 2,
                seq_len: 16,
            },
            &pure(r),
            &trainkit::NoRecompute,
            &AdamW::default(),
        )
        .unwrap();
        let mut t = trainer(pure(r), 1e-3, false);
        for step in 1..=2 {
            let s = t.step().unwrap();
            common::step_matches_prediction(&s, &predicted, step, 1, &format!("pure bf16 {r}"));
        }
    }
}

/// AdamW's moments follow the weights by default, as `torch.optim.AdamW` keeps the state
/// of bf16 parameters: bf16 under pure bf16 (4 bytes of state per parameter, predicted
/// exactly, by the formula too), the loss going down, resume bitwise (the moments saved as
/// bf16); f32 beside a master copy or when `state_dtype` says so; a dtype it has no kernel
/// for refused.
#[test]
fn adamw_moments_follow_pure_bf16_weights_halve_the_state_and_resume_bitwise() {
    let adamw = AdamW {
        lr: 3e-3,
        weight_decay: 0.0,
        ..AdamW::default()
    };
    assert_eq!(adamw.state_dtype, None);
    let make = || trainer_with(pure(UpdateRounding::Stochastic), adamw, false);
    let predicted = trainkit::estimate::predict_with(
        Box::new(Gpt2::new(tiny_config()).unwrap()),
        trainkit::estimate::MicroBatch {
            batch_size: 2,
            seq_len: 16,
        },
        &pure(UpdateRounding::Stochastic),
        &trainkit::NoRecompute,
        &adamw,
        &TrainerOptions {
            grad_clip: 0.0,
            ..TrainerOptions::default()
        },
    )
    .unwrap();
    let mut t = make();
    let first = t.step().unwrap().loss;
    let mut last = first;
    for step in 2..=6 {
        let s = t.step().unwrap();
        if step == 2 {
            common::step_matches_prediction(&s, &predicted, 2, 1, "bf16 moments");
        }
        last = s.loss;
    }
    assert!(last < first, "{first} -> {last}");
    let n: u64 = t.params().iter().map(|p| p.numel() as u64).sum();
    assert_eq!(predicted.peak.get(MemoryCategory::OptimizerState), 4 * n);
    for p in t.params() {
        assert!(p.state().iter().all(|s| s.dtype() == DType::Bf16));
    }
    // Resume: three steps, saved, three more, against six straight.
    let dir = common::scratch("bf16-moments").join("ckpt");
    let mut a = make();
    for _ in 0..3 {
        a.step().unwrap();
    }
    a.save(&dir, None).unwrap();
    let mut b = make();
    b.resume_from(&dir).unwrap();
    for _ in 0..3 {
        b.step().unwrap();
    }
    let dtypes: Vec<DType> = b.params().iter().map(|p| p.state()[0].dtype()).collect();
    assert!(dtypes.iter().all(|d| *d == DType::Bf16), "{dtypes:?}");
    let state = |t: &Trainer<PureBf16, _, _, _, _>| per_param(t, |p| &p.state()[1]);
    assert_eq!(per_param(&t, |p| p.weight()), per_param(&b, |p| p.weight()));
    assert_eq!(state(&t), state(&b));
    // The playbook's formula counts the same 4 bytes under pure bf16, 8 beside a master copy.
    let pure_bytes = trainkit::estimate::bytes_per_param(&pure(UpdateRounding::Stochastic), &adamw);
    assert_eq!(pure_bytes.get(MemoryCategory::OptimizerState), 4);
    let mixed_bytes = trainkit::estimate::bytes_per_param(&MixedBf16::default(), &adamw);
    assert_eq!(mixed_bytes.get(MemoryCategory::OptimizerState), 8);
    // f32 moments when asked for, under pure bf16 too: 8 bytes, as predicted.
    let f32_moments = AdamW {
        state_dtype: Some(DType::F32),
        ..adamw
    };
    let mut f = trainer_with(pure(UpdateRounding::Stochastic), f32_moments, false);
    f.step().unwrap();
    assert!(f
        .params()
        .iter()
        .all(|p| p.state()[0].dtype() == DType::F32));
    let f32_bytes =
        trainkit::estimate::bytes_per_param(&pure(UpdateRounding::Stochastic), &f32_moments);
    assert_eq!(f32_bytes.get(MemoryCategory::OptimizerState), 8);
    // Mixed bf16 keeps f32 moments beside its f32 master copy.
    let mut m = trainer_with(MixedBf16::default(), adamw, false);
    m.step().unwrap();
    assert!(m
        .params()
        .iter()
        .all(|p| p.state()[0].dtype() == DType::F32));
    // The config takes either; a dtype without a kernel is refused by name.
    let cfg =
        RunConfig::from_toml("[optimizer]\nkind = \"adamw\"\nstate_dtype = \"bf16\"\n").unwrap();
    assert_eq!(cfg.optimizer.state_bytes_per_param(), 4);
    let cfg =
        RunConfig::from_toml("[optimizer]\nkind = \"adamw\"\nstate_dtype = \"f32\"\n").unwrap();
    assert_eq!(cfg.optimizer.state_bytes_for(DType::Bf16), 8);
    let cfg = RunConfig::from_toml("[optimizer]\nkind = \"adamw\"\n").unwrap();
    assert_eq!(cfg.optimizer.state_bytes_for(DType::Bf16), 4);
    assert_eq!(cfg.optimizer.state_bytes_for(DType::F32), 8);
    let e = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(20_000, 3, 2, 16),
    )
    .optimizer(AdamW {
        state_dtype: Some(DType::F16),
        ..AdamW::default()
    })
    .build()
    .unwrap()
    .step()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("state_dtype") && e.contains("f32 or bf16"),
        "{e}"
    );
}
