//! fp16 mixed precision: f16 compute with f32 master weights and gradients, and a dynamic
//! loss scale that answers overflows by skipping the step and shrinking.

use crate::common;

use common::{corpus_loader, cpu, per_param, scratch, tiny_config};
use trainkit::config::RunConfig;
use trainkit::{
    AdamW, Constant, DType, Error, Fp32, Gpt2, LossScale, MemoryCategory, MixedFp16, NoRecompute,
    PeakTracker, Precision, Trainer, TrainerOptions,
};

type Fp16Trainer = Trainer<MixedFp16, NoRecompute, AdamW, Constant, PeakTracker>;

fn trainer(scale: LossScale, options: TrainerOptions) -> Fp16Trainer {
    Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(20_000, 3, 2, 16),
    )
    .precision(MixedFp16::new(scale))
    .options(options)
    .build()
    .unwrap()
}

#[test]
fn fp16_keeps_f16_weights_and_activations_beside_f32_master_weights_and_gradients() {
    let cfg = tiny_config();
    let n = cfg.num_params() as u64;
    let mut t = trainer(LossScale::default(), TrainerOptions::default());
    assert!(t.params().iter().all(|p| p.weight().dtype() == DType::F16));
    let s = t.step().unwrap();
    assert!(!s.skipped && s.loss.is_finite());
    assert_eq!(s.loss_scale, 65536.0);
    let live = t.backend().ledger().snapshot().live;
    assert_eq!(live.get(MemoryCategory::Weights), 2 * n);
    assert_eq!(live.get(MemoryCategory::MasterWeights), 4 * n);
    assert_eq!(live.get(MemoryCategory::Gradients), 4 * n);
    assert_eq!(live.get(MemoryCategory::OptimizerState), 8 * n);
}

/// A scale far too large overflows the f16 gradients: each such step is skipped (weights
/// and moments untouched) and halves the scale, and more of them in a row than
/// `max_bad_steps` is not divergence. Once the scale fits, training goes on.
#[test]
fn overflows_skip_the_step_and_halve_the_scale_until_it_fits() {
    let init = 2f32.powi(40);
    let mut t = trainer(
        LossScale {
            init_scale: init,
            ..LossScale::default()
        },
        TrainerOptions {
            max_bad_steps: 3,
            ..TrainerOptions::default()
        },
    );
    let weights = per_param(&t, |p| p.value());
    let mut scales = Vec::new();
    let mut skipped = 0;
    let first_good = loop {
        let s = t.step().unwrap();
        scales.push(s.loss_scale);
        assert!(
            s.loss.is_finite(),
            "the loss itself is not scaled: {}",
            s.loss
        );
        if !s.skipped {
            break s;
        }
        skipped += 1;
        assert_eq!(
            per_param(&t, |p| p.value()),
            weights,
            "a skipped step wrote"
        );
        assert!(scales.len() < 40, "the scale never came down: {scales:?}");
    };
    eprintln!("{skipped} overflows: scales {scales:?}");
    assert!(skipped > 3, "only {skipped} overflows at 2^40: {scales:?}");
    for (i, s) in scales.iter().enumerate() {
        assert_eq!(*s, init / 2f32.powi(i as i32), "{scales:?}");
    }
    assert_eq!(t.skipped_steps(), skipped);
    assert_eq!(t.bad_streak(), 0);
    assert!(first_good.grad_norm.is_finite() && first_good.grad_norm < 100.0);
    assert_ne!(per_param(&t, |p| p.value()), weights, "training goes on");
    assert_eq!(t.precision().loss_scale(), *scales.last().unwrap());
}

#[test]
fn the_scale_grows_after_growth_interval_finite_steps() {
    let mut t = trainer(
        LossScale {
            init_scale: 256.0,
            growth_interval: 2,
            ..LossScale::default()
        },
        TrainerOptions::default(),
    );
    let scales: Vec<f32> = (0..5).map(|_| t.step().unwrap().loss_scale).collect();
    assert_eq!(scales, [256.0, 256.0, 512.0, 512.0, 1024.0]);
}

/// A NaN weight makes the loss itself NaN: no scale explains that, so the run stops after
/// `max_bad_steps` as under any precision.
#[test]
fn a_non_finite_loss_is_still_divergence() {
    let mut t = trainer(
        LossScale::default(),
        TrainerOptions {
            max_bad_steps: 2,
            ..TrainerOptions::default()
        },
    );
    let be = t.backend().clone();
    let p = &mut t.params_mut()[0];
    let nan = vec![f32::NAN; p.numel()];
    p.set_value(be.as_ref(), &nan).unwrap();
    assert!(t.step().unwrap().skipped);
    let err = t.step().unwrap_err();
    assert!(matches!(err, Error::Diverged { .. }), "{err}");
}

/// Saving in the middle of a growth interval and resuming continues the scale's count: the
/// losses, the scales and the weights equal those of the run that never stopped.
#[test]
fn resume_restores_the_loss_scale_exactly() {
    let scale = LossScale {
        init_scale: 1024.0,
        growth_interval: 3,
        ..LossScale::default()
    };
    let n = 4;
    let mut straight = trainer(scale.clone(), TrainerOptions::default());
    let want: Vec<(f64, f32)> = (0..2 * n)
        .map(|_| {
            let s = straight.step().unwrap();
            (s.loss, s.loss_scale)
        })
        .collect();
    let dir = scratch("fp16-resume").join("ckpt");
    let mut first = trainer(scale.clone(), TrainerOptions::default());
    for _ in 0..n {
        first.step().unwrap();
    }
    first.save(&dir, None).unwrap();
    drop(first);
    let mut resumed = trainer(scale, TrainerOptions::default());
    resumed.resume_from(&dir).unwrap();
    let got: Vec<(f64, f32)> = (0..n)
        .map(|_| {
            let s = resumed.step().unwrap();
            (s.loss, s.loss_scale)
        })
        .collect();
    assert_eq!(got, want[n..]);
    assert_eq!(
        want.iter().map(|w| w.1).collect::<Vec<_>>(),
        [1024.0, 1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]
    );
    assert_eq!(
        per_param(&straight, |p| p.value()),
        per_param(&resumed, |p| p.value())
    );
}

/// fp16 learns as f32 does on the tiny model (final loss within 2%).
#[test]
fn mixed_fp16_tracks_fp32() {
    fn last_loss<P: Precision>(precision: P) -> (f64, f64) {
        let mut t = Trainer::builder(
            Gpt2::new(tiny_config()).unwrap(),
            cpu(),
            corpus_loader(100_000, 5, 4, 32),
        )
        .precision(precision)
        .optimizer(AdamW {
            lr: 2e-3,
            ..Default::default()
        })
        .build()
        .unwrap();
        let losses: Vec<f64> = (0..40).map(|_| t.step().unwrap().loss).collect();
        (losses[0], losses[35..].iter().sum::<f64>() / 5.0)
    }
    let (first, last32) = last_loss(Fp32);
    assert!(last32 < first - 1.0, "fp32 learns: {first} -> {last32}");
    let (_, last16) = last_loss(MixedFp16::default());
    let rel = (last16 - last32).abs() / last32;
    eprintln!("fp32 {last32:.4}, mixed_fp16 {last16:.4}");
    assert!(rel < 0.02, "fp16 {last16} vs fp32 {last32}");
}

#[test]
fn configs_name_the_loss_scale_settings_and_refuse_what_cannot_work() {
    let text = |precision: &str| format!("[precision]\n{precision}\n");
    let c = RunConfig::from_toml(&text(
        "kind = \"mixed_fp16\"\nhysteresis = 2\nmin_scale = 1.0\ngrowth_interval = 1000",
    ))
    .unwrap();
    let json = serde_json::to_value(&c.precision).unwrap();
    assert_eq!(json["kind"], "mixed_fp16");
    assert_eq!(json["hysteresis"], 2);
    assert_eq!(json["init_scale"], 65536.0);
    assert_eq!(c.precision.loss_scale(), 65536.0);
    assert_eq!(c.precision.compute_dtype(), DType::F16);

    // bf16's option does not apply: fp16 gradients are always f32.
    let e = RunConfig::from_toml(&text("kind = \"mixed_fp16\"\nfp32_grads = false"))
        .unwrap_err()
        .to_string();
    eprintln!("{e}");
    assert!(e.contains("fp32_grads") && e.contains("init_scale"), "{e}");

    // Settings out of range fail when the trainer is built, naming the setting.
    let c = RunConfig::from_toml(&text("kind = \"mixed_fp16\"\ngrowth_factor = 0.5")).unwrap();
    let e = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(4_000, 1, 2, 16),
    )
    .precision(c.precision)
    .build()
    .err()
    .expect("a shrinking growth factor is refused")
    .to_string();
    assert!(e.contains("growth_factor") && e.contains(">= 1"), "{e}");
}
