//! Autofit chooses the cheapest setup that fits a budget: with micro-batch, accumulation
//! and recompute alone, the least recomputation, then the fewest micro-batches; with every
//! technique, a technique only when no combination of cheaper ones fits. A run with its
//! choice stays within the budget, and its exact prediction equals the ledger; when
//! nothing fits it says what would.

use crate::common;

use common::{corpus_loader, cpu};
use trainkit::checkpoint::{by_cost, named};
use trainkit::estimate::{
    autofit, parse_bytes, predict, predict_with, technique_savings, FitCandidate, FitRequest,
    MicroBatch, Technique, Techniques,
};
use trainkit::model::Family;
use trainkit::ops::{AttentionPath, LossPath};
use trainkit::{
    AdamW, CheckpointPolicy, Constant, Error, Fp32, Gpt2, Gpt2Config, MixedBf16, NoRecompute,
    Optimizer, PeakTracker, Precision, Trainer, TrainerOptions,
};

fn config() -> Gpt2Config {
    Gpt2Config {
        n_layer: 4,
        n_head: 2,
        n_embd: 32,
        n_positions: 64,
        vocab_size: 256,
        layer_norm_epsilon: 1e-5,
    }
}

/// A model wide enough that its projections reach the streamed policies' 1 MiB
/// `min_bytes` (smaller weights stay on the device).
fn wide_config() -> Gpt2Config {
    Gpt2Config {
        n_layer: 2,
        n_embd: 512,
        vocab_size: 512,
        ..config()
    }
}

/// A request for micro-batch, accumulation and the recompute policies alone: autofit's
/// choices before it knew the other techniques.
fn request<'a>(
    config: &'a Gpt2Config,
    precision: &'a (dyn Precision + 'static),
    optimizer: &'a AdamW,
    budget: u64,
) -> FitRequest<'a> {
    FitRequest {
        techniques: Techniques::BATCH_AND_RECOMPUTE,
        ..FitRequest::new(config.shape(), 64, 8, budget, precision, optimizer)
    }
}

/// Where a shipped recompute policy (by its `kind`) stands in autofit's cost order.
fn rank(kind: &str) -> usize {
    by_cost()
        .iter()
        .position(|p| p.typetag_name() == kind)
        .unwrap()
}

/// The peak of a setup over every step, as autofit counts it.
fn peak(req: &FitRequest<'_>, micro: usize, recompute: &str) -> u64 {
    let model = trainkit::model::build_with(
        &req.model.for_length(req.seq_len),
        req.attention,
        req.loss,
        req.loss_chunk,
    );
    let p = predict(
        model.unwrap(),
        MicroBatch {
            batch_size: micro,
            seq_len: req.seq_len,
        },
        req.precision,
        named(recompute).unwrap().as_ref(),
        req.optimizer,
    )
    .unwrap();
    p.peak_total
        .max(p.first_step_peak_total(req.global_batch / micro))
}

#[test]
fn the_choice_is_the_least_recompute_then_the_fewest_micro_batches() {
    let (c, opt) = (config(), AdamW::default());
    let full_batch = peak(&request(&c, &Fp32, &opt, 0), 8, "none");
    let tightest = peak(&request(&c, &Fp32, &opt, 0), 1, "full");
    // Budgets from roomy to the tightest that fits: check the rule against brute force.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..=40u64 {
        let budget = tightest + (full_batch - tightest) * (40 - i) / 40;
        let req = request(&c, &Fp32, &opt, budget);
        let plan = autofit(&req).unwrap();
        let ch = plan.choice.clone();
        let kind = ch.recompute.typetag_name();
        assert!(ch.peak <= budget);
        assert_eq!(ch.micro_batch * ch.micro_batches, 8);
        assert_eq!(ch.peak, peak(&req, ch.micro_batch, kind));
        for r in by_cost().iter().map(|r| r.typetag_name()) {
            if rank(r) < rank(kind) {
                assert!(peak(&req, 1, r) > budget, "{r} would fit at {budget}");
            }
        }
        for m in [8, 4, 2].into_iter().filter(|m| *m > ch.micro_batch) {
            assert!(peak(&req, m, kind) > budget);
        }
        seen.insert((kind, ch.micro_batch));
        assert!(plan.explain()[0].contains(&format!("recompute {kind}")));
    }
    assert!(seen.contains(&("none", 8)));
    assert!(
        seen.len() >= 3,
        "the budgets should exercise several choices: {seen:?}"
    );
}

#[test]
fn a_run_with_the_choice_stays_within_the_budget() {
    let (c, opt) = (config(), AdamW::default());
    let precision = MixedBf16 { fp32_grads: true };
    let roomy = peak(&request(&c, &precision, &opt, 0), 8, "none");
    let budget = roomy * 3 / 4;
    let plan = autofit(&request(&c, &precision, &opt, budget)).unwrap();
    let ch = plan.choice;
    assert!(ch.micro_batch < 8 || ch.recompute.typetag_name() != "none");
    let be = cpu();
    be.ledger().set_limit(Some(budget));
    let mut t = Trainer::builder(
        Gpt2::new(c).unwrap(),
        be,
        corpus_loader(20_000, 5, ch.micro_batch, 64),
    )
    .precision(precision)
    .checkpoint(ch.recompute)
    .optimizer(opt)
    .accumulation(Constant::new(ch.micro_batches))
    .build()
    .unwrap();
    for _ in 0..2 {
        let s = t.step().unwrap();
        assert!(s.memory.peak_total <= budget);
    }
}

#[test]
fn when_nothing_fits_the_error_says_what_would() {
    let (c, opt) = (config(), AdamW::default());
    let tightest = peak(&request(&c, &Fp32, &opt, 0), 1, "full");
    let req = request(&c, &Fp32, &opt, tightest - 1);
    let Err(Error::OutOfMemory { message }) = autofit(&req) else {
        panic!("expected an out-of-memory error");
    };
    assert!(message.contains("what would fit"), "{message}");
    assert!(message.contains("--precision bf16"), "{message}");
    // The suggested sequence length does fit.
    let seq: usize = message
        .split("--seq-len ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no --seq-len in {message}"));
    assert!(seq < 64);
    let shorter = FitRequest {
        seq_len: seq,
        ..req
    };
    assert!(autofit(&shorter).is_ok());
    let longer = FitRequest {
        seq_len: seq + 1,
        ..req
    };
    assert!(autofit(&longer).is_err());
    // A budget below the model state alone says so.
    let tiny = request(&c, &Fp32, &opt, parse_bytes("1KiB").unwrap());
    let e = autofit(&tiny).unwrap_err().to_string();
    assert!(e.contains("model state alone"), "{e}");
}

/// Autofit plans the model the run trains: with the materialized attention and logits
/// its choice's memory is that model's exact prediction, larger than the fused one's.
#[test]
fn autofit_plans_on_the_runs_attention_and_loss_paths() {
    let c = config();
    let adamw = AdamW::default();
    let fused = request(&c, &Fp32, &adamw, 1 << 40);
    let materialized = FitRequest {
        attention: AttentionPath::Materialized,
        loss: LossPath::Materialized,
        ..fused
    };
    let (f, m) = (autofit(&fused).unwrap(), autofit(&materialized).unwrap());
    // An unbounded budget: one micro-batch of all rows, no recompute, on both paths.
    assert_eq!(f.choice.micro_batch, m.choice.micro_batch);
    assert_eq!(
        m.choice.peak,
        peak(&materialized, m.choice.micro_batch, "none")
    );
    assert_eq!(f.choice.peak, peak(&fused, f.choice.micro_batch, "none"));
    assert!(m.choice.peak > f.choice.peak);
    // The run's loss chunk: 8 positions hold fewer logits than the automatic chunk (every
    // position of this small vocabulary at once).
    let chunked = FitRequest {
        loss_chunk: Some(8),
        ..fused
    };
    let ch = autofit(&chunked).unwrap();
    assert_eq!(
        ch.choice.peak,
        peak(&chunked, ch.choice.micro_batch, "none")
    );
    assert!(
        ch.choice.peak < f.choice.peak,
        "{} vs {}",
        ch.choice.peak,
        f.choice.peak
    );
}

/// A request with every technique on the small model, a global batch of `global` rows and
/// no clipping, so that the optimizer may run inside backward.
fn every_technique<'a>(
    config: &'a Gpt2Config,
    precision: &'a (dyn Precision + 'static),
    optimizer: &'a AdamW,
    global: usize,
    budget: u64,
) -> FitRequest<'a> {
    FitRequest {
        grad_clip: 0.0,
        ..FitRequest::new(config.shape(), 64, global, budget, precision, optimizer)
    }
}

/// The peak over any step of a setup, predicted on its own.
#[allow(clippy::too_many_arguments)]
fn setup_peak(
    req: &FitRequest<'_>,
    micro: usize,
    precision: &dyn Precision,
    recompute: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
    in_backward: bool,
    offload: bool,
    optimizer_offload: bool,
) -> u64 {
    let model = trainkit::model::build_with(
        &req.model.for_length(req.seq_len),
        req.attention,
        req.loss,
        req.loss_chunk,
    );
    let options = TrainerOptions {
        grad_clip: 0.0,
        optimizer_in_backward: in_backward,
        offload_activations: offload,
        optimizer_offload,
        ..TrainerOptions::default()
    };
    let p = predict_with(
        model.unwrap(),
        MicroBatch {
            batch_size: micro,
            seq_len: req.seq_len,
        },
        precision,
        recompute,
        optimizer,
        &options,
    )
    .unwrap();
    p.peak_total
        .max(p.first_step_peak_total(req.global_batch / micro))
}

/// The least peak of `c` without the technique `t`: at micro-batches of one row (the whole
/// batch inside backward), the rest of its setup unchanged.
fn least_without(req: &FitRequest<'_>, c: &FitCandidate, t: Technique) -> u64 {
    let precision = match t {
        Technique::Bf16 => dyn_clone::clone_box(req.precision),
        _ => c.precision.clone(),
    };
    let optimizer = match t {
        Technique::Adamw8bit => dyn_clone::clone_box(req.optimizer),
        _ => c.optimizer.clone(),
    };
    let recompute: Box<dyn CheckpointPolicy> = if t.is_recompute() {
        Box::new(NoRecompute)
    } else {
        c.recompute.clone()
    };
    let in_backward = c.optimizer_in_backward && t != Technique::OptimizerInBackward;
    let offload = c.offload_activations && t != Technique::Offload;
    let optimizer_offload = c.optimizer_offload && t != Technique::OptimizerOffload;
    let micro = if in_backward { req.global_batch } else { 1 };
    setup_peak(
        req,
        micro,
        precision.as_ref(),
        recompute.as_ref(),
        optimizer.as_ref(),
        in_backward,
        offload,
        optimizer_offload,
    )
}

/// From roomy to the tightest budget, every technique autofit adds is needed: its choice
/// fits, its peak is its setup's exact peak, and without any one of its techniques (where
/// what is left is a combination autofit may take) even the most micro-batches do not
/// fit. Over the sweep it takes each technique beyond batch and recompute.
#[test]
fn every_technique_is_taken_only_when_the_cheaper_ones_do_not_fit() {
    let (c, opt) = (config(), AdamW::default());
    let mut seen = Techniques::NONE;
    for (precision, global) in [
        (&Fp32 as &(dyn Precision + 'static), 4),
        (&Fp32, 2),
        (&Fp32, 1),
        (&MixedBf16 { fp32_grads: true }, 2),
    ] {
        // Streaming (its own tests below) changes where weights live, which `setup_peak`
        // does not set.
        let roomy = FitRequest {
            techniques: Techniques::ALL.without(Technique::StreamWeights),
            ..every_technique(&c, precision, &opt, global, u64::MAX)
        };
        let tightest = technique_savings(&roomy).unwrap().all.peak;
        let most = autofit(&roomy).unwrap().unconstrained.peak;
        for i in 0..=24u64 {
            let budget = tightest + (most - tightest) * (24 - i) / 24;
            let req = FitRequest { budget, ..roomy };
            let plan = autofit(&req).unwrap();
            let ch = &plan.choice;
            assert!(ch.peak <= budget);
            assert_eq!(ch.micro_batch * ch.micro_batches, global);
            assert_eq!(
                ch.peak,
                setup_peak(
                    &req,
                    ch.micro_batch,
                    ch.precision.as_ref(),
                    ch.recompute.as_ref(),
                    ch.optimizer.as_ref(),
                    ch.optimizer_in_backward,
                    ch.offload_activations,
                    ch.optimizer_offload,
                )
            );
            for t in ch.techniques.iter() {
                // Offloading joins full recomputation only; accumulation is sized within.
                let offloads_full = t == Technique::Full && ch.offload_activations;
                if t == Technique::Accumulation || offloads_full {
                    continue;
                }
                let without = least_without(&req, ch, t);
                assert!(
                    without > budget,
                    "{} fits {budget} without {t}: {without}",
                    ch.describe()
                );
            }
            // Every combination tried before the choice was cheaper and did not fit.
            let (last, before) = plan.tried.split_last().unwrap();
            assert_eq!(
                last.techniques,
                ch.techniques.without(Technique::Accumulation)
            );
            for a in before {
                assert!(a.fit.is_none() && a.least.peak > budget);
                assert!(a.techniques.cost() < last.techniques.cost());
            }
            seen = Techniques::from_iter(seen.iter().chain(ch.techniques.iter()));
            let text = plan.explain().join("\n");
            assert!(text.contains(&ch.describe()), "{text}");
        }
    }
    for t in [
        Technique::Accumulation,
        Technique::Adamw8bit,
        Technique::OptimizerInBackward,
        Technique::Budget,
        Technique::Full,
        Technique::Offload,
        Technique::OptimizerOffload,
        Technique::Bf16,
    ] {
        assert!(seen.contains(t), "{t} never chosen; seen {seen}");
    }
}

/// A plan with the new techniques runs as planned: the trainer set up with the choice's
/// precision, policy, optimizer and settings records, step after step, the exact
/// prediction byte for byte in every category (offloaded host bytes included), and never
/// more than the budget.
#[test]
fn the_prediction_of_a_plan_with_every_technique_equals_the_ledger() {
    let (c, opt) = (config(), AdamW::default());
    let mut checked = Techniques::NONE;
    for (precision, global) in [
        (&Fp32 as &(dyn Precision + 'static), 1),
        (&Fp32, 2),
        (&MixedBf16 { fp32_grads: false }, 2),
    ] {
        let roomy = every_technique(&c, precision, &opt, global, u64::MAX);
        let tightest = technique_savings(&roomy).unwrap().all.peak;
        let most = autofit(&roomy).unwrap().unconstrained.peak;
        // The least that fits with the optimizer's state on the device.
        let on_device = technique_savings(&FitRequest {
            techniques: Techniques::ALL.without(Technique::OptimizerOffload),
            ..roomy
        })
        .unwrap()
        .all
        .peak;
        for budget in [tightest, on_device, tightest + (most - tightest) / 8] {
            let plan = autofit(&FitRequest { budget, ..roomy }).unwrap();
            let ch = plan.choice;
            checked = Techniques::from_iter(checked.iter().chain(ch.techniques.iter()));
            let be = cpu();
            be.ledger().set_limit(Some(budget));
            let highest = train_choice(&c, &ch, be);
            assert_eq!(highest, ch.peak, "{}", ch.describe());
            assert!(highest <= budget);
        }
    }
    for t in [
        Technique::Adamw8bit,
        Technique::OptimizerInBackward,
        Technique::Full,
        Technique::Offload,
        Technique::OptimizerOffload,
        Technique::Bf16,
    ] {
        assert!(checked.contains(t), "no plan used {t}: {checked}");
    }
}

/// What the request fixes stays: a precision that is bf16 already, an optimizer without
/// 8-bit state, clipping (no optimizer inside backward), a recompute policy when autofit
/// may choose none; each left-out technique is explained.
#[test]
fn autofit_keeps_what_the_request_fixes_and_says_why() {
    let c = config();
    let sgd = trainkit::Sgd::default();
    let bf16 = MixedBf16 { fp32_grads: false };
    let clipped = FitRequest {
        techniques: Techniques::ALL
            .without(Technique::Selective)
            .without(Technique::Budget)
            .without(Technique::Full),
        recompute: &trainkit::Full,
        ..FitRequest::new(c.shape(), 64, 4, 0, &bf16, &sgd)
    };
    let roomy = autofit(&FitRequest {
        budget: u64::MAX,
        ..clipped
    })
    .unwrap();
    assert_eq!(roomy.choice.recompute.typetag_name(), "full");
    let tightest = technique_savings(&clipped).unwrap().all.peak;
    let plan = autofit(&FitRequest {
        budget: tightest,
        ..clipped
    })
    .unwrap();
    let ch = &plan.choice;
    assert_eq!(ch.recompute.typetag_name(), "full");
    assert_eq!(ch.optimizer.typetag_name(), "sgd");
    assert_eq!(ch.precision.typetag_name(), "mixed_bf16");
    assert!(!ch.optimizer_in_backward);
    let why = |t: Technique| {
        plan.left_out
            .iter()
            .find(|(l, _)| *l == t)
            .map(|(_, w)| w.clone())
            .unwrap_or_else(|| panic!("{t} not left out"))
    };
    assert!(why(Technique::Adamw8bit).contains("sgd"));
    assert!(why(Technique::OptimizerInBackward).contains("--grad-clip 0"));
    assert!(why(Technique::Bf16).contains("bf16"));
    assert!(why(Technique::Full).contains("--autofit-techniques"));
    let text = plan.explain().join("\n");
    assert!(text.contains("not considered"), "{text}");
}

/// Three steps of GPT-2 `c` trained as `ch` says (its adapter too) on `be`: each step
/// after the first records the choice's prediction in every category. Returns the highest
/// peak of the three.
fn train_choice(
    c: &Gpt2Config,
    ch: &FitCandidate,
    be: std::sync::Arc<dyn trainkit::Backend>,
) -> u64 {
    let mut model: Box<dyn trainkit::Model> = Box::new(Gpt2::new(c.clone()).unwrap());
    if let Some(a) = &ch.adapter {
        model = model.with_adapter(a.clone()).unwrap();
    }
    let mut t = Trainer::new(
        model,
        be,
        corpus_loader(20_000, 3, ch.micro_batch, 64),
        ch.precision.clone(),
        ch.recompute.clone(),
        ch.optimizer.clone(),
        Constant::new(ch.micro_batches),
        PeakTracker::new(),
        TrainerOptions {
            grad_clip: 0.0,
            optimizer_in_backward: ch.optimizer_in_backward,
            offload_activations: ch.offload_activations,
            optimizer_offload: ch.optimizer_offload,
            placement: if ch.stream_weights {
                trainkit::placement::streaming(ch.adapter.is_some())
            } else {
                trainkit::placement::resident()
            },
            ..TrainerOptions::default()
        },
    )
    .unwrap();
    let mut highest = 0;
    for step in 1..=3 {
        let s = t.step().unwrap();
        highest = highest.max(s.memory.peak_total);
        if step > 1 {
            assert_eq!(s.memory.peak, ch.prediction.peak, "{}", ch.describe());
            assert_eq!(s.memory.peak_total, ch.prediction.peak_total);
        }
    }
    highest
}

/// LoRA and QLoRA change what is trained: autofit uses them only when named, and then
/// only when nothing cheaper fits; a plan that takes one trains as predicted (the ledger
/// equals the choice's prediction), and a request that does not name them hears that
/// they would fit.
#[test]
fn adapters_are_chosen_only_when_named_and_nothing_cheaper_fits() {
    let (c, opt) = (config(), AdamW::default());
    // With the optimizer on the host the device holds the compute weights and (inside
    // backward) one gradient at a time, trained by an adapter or not: leave it out.
    let roomy = FitRequest {
        techniques: Techniques::ALL.without(Technique::OptimizerOffload),
        ..every_technique(&c, &Fp32, &opt, 2, u64::MAX)
    };
    let tightest = technique_savings(&roomy).unwrap().all.peak;
    let named = FitRequest {
        techniques: roomy
            .techniques
            .with(Technique::Lora)
            .with(Technique::Qlora),
        budget: tightest - 1,
        ..roomy
    };
    // Without the adapters nothing fits, and the error says LoRA would.
    let e = autofit(&FitRequest {
        budget: tightest - 1,
        ..roomy
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("--autofit-techniques all,lora"), "{e}");
    let ch = autofit(&named).unwrap().choice;
    assert!(ch.techniques.contains(Technique::Lora), "{}", ch.describe());
    assert!(ch.flags().contains("--lora-rank 8"), "{}", ch.flags());
    assert!(ch.adapter.is_some(), "{}", ch.describe());
    let highest = train_choice(&c, &ch, cpu());
    assert_eq!(highest, ch.peak, "{}", ch.describe());
    // QLoRA alone, on a budget below what LoRA needs at its least.
    let qlora_only = FitRequest {
        techniques: roomy.techniques.with(Technique::Qlora),
        ..named
    };
    let lora_least = technique_savings(&FitRequest {
        budget: u64::MAX,
        ..named
    })
    .unwrap();
    let lora_row = lora_least
        .rows
        .iter()
        .find(|r| r.technique == Technique::Lora)
        .unwrap();
    assert!(lora_row.outcome.is_ok());
    let ch = autofit(&qlora_only).unwrap().choice;
    assert!(
        ch.techniques.contains(Technique::Qlora) && ch.techniques.contains(Technique::Lora),
        "{}",
        ch.describe()
    );
    assert!(ch.flags().ends_with("--qlora"), "{}", ch.flags());
    assert!(!Techniques::ALL.contains(Technique::Lora));
}

/// Pure bf16 changes how each update is rounded: autofit uses it only when named, and
/// then only when nothing cheaper fits; the plan trains as predicted, and a request that
/// does not name it hears that it would fit.
#[test]
fn pure_bf16_is_chosen_only_when_named_and_nothing_cheaper_fits() {
    let (c, opt) = (config(), AdamW::default());
    // With the optimizer on the host the device holds bf16 weights and gradients with a
    // master copy or without: leave it out.
    let roomy = FitRequest {
        techniques: Techniques::ALL.without(Technique::OptimizerOffload),
        ..every_technique(&c, &Fp32, &opt, 2, u64::MAX)
    };
    let tightest = technique_savings(&roomy).unwrap().all.peak;
    let named = FitRequest {
        techniques: roomy.techniques.with(Technique::PureBf16),
        budget: tightest - 1,
        ..roomy
    };
    let e = autofit(&FitRequest {
        budget: tightest - 1,
        ..roomy
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("--autofit-techniques all,pure-bf16"), "{e}");
    let ch = autofit(&named).unwrap().choice;
    assert!(
        ch.techniques.contains(Technique::PureBf16),
        "{}",
        ch.describe()
    );
    assert!(
        !ch.techniques.contains(Technique::Bf16),
        "{}",
        ch.describe()
    );
    assert!(
        ch.flags()
            .contains("--master-weights none --update-rounding stochastic"),
        "{}",
        ch.flags()
    );
    assert_eq!(
        ch.precision.update_rounding(),
        Some(trainkit::ops::update_rounding::UpdateRounding::Stochastic)
    );
    let highest = train_choice(&c, &ch, cpu());
    assert_eq!(highest, ch.peak, "{}", ch.describe());
    assert!(!Techniques::ALL.contains(Technique::PureBf16));
    assert_eq!(
        Techniques::parse("all,pure-bf16").unwrap(),
        Techniques::ALL.with(Technique::PureBf16)
    );
}

/// An fp32 run whose optimizer state does not fit the device with every cheaper technique:
/// autofit keeps the master weights and state on the host (the run stays fp32, no bf16),
/// its prediction fits the budget and counts the host bytes, and the plan says so. With a
/// budget the cheaper techniques fit, it does not offload.
#[test]
fn optimizer_offload_is_taken_when_nothing_cheaper_fits() {
    let (c, opt) = (config(), AdamW::default());
    let roomy = every_technique(&c, &Fp32, &opt, 2, u64::MAX);
    let cheaper = technique_savings(&FitRequest {
        techniques: Techniques::ALL
            .without(Technique::OptimizerOffload)
            .without(Technique::Bf16),
        ..roomy
    })
    .unwrap()
    .all
    .peak;
    // Everything cheaper fits at its least: no offload.
    let plan = autofit(&FitRequest {
        budget: cheaper,
        ..roomy
    })
    .unwrap();
    assert!(!plan.choice.optimizer_offload, "{}", plan.choice.describe());
    assert!(!plan.choice.techniques.contains(Technique::OptimizerOffload));
    // A byte less: the optimizer goes to the host, in fp32.
    let req = FitRequest {
        budget: cheaper - 1,
        ..roomy
    };
    let plan = autofit(&req).unwrap();
    let ch = &plan.choice;
    assert!(ch.optimizer_offload, "{}", ch.describe());
    assert!(ch.techniques.contains(Technique::OptimizerOffload));
    assert!(
        !ch.techniques.contains(Technique::Bf16),
        "{}",
        ch.describe()
    );
    assert_eq!(ch.precision.typetag_name(), "fp32");
    assert!(ch.peak <= req.budget);
    assert_eq!(
        ch.peak,
        setup_peak(
            &req,
            ch.micro_batch,
            ch.precision.as_ref(),
            ch.recompute.as_ref(),
            ch.optimizer.as_ref(),
            ch.optimizer_in_backward,
            ch.offload_activations,
            true,
        )
    );
    // The host holds an f32 copy of every weight and AdamW's two f32 moments at least.
    let params = c.shape().exact_params().unwrap();
    assert!(ch.host_bytes() >= 12 * params, "{}", ch.host_bytes());
    assert_eq!(ch.host_bytes(), ch.prediction.host_bytes());
    assert!(
        ch.describe().contains("optimizer-offload"),
        "{}",
        ch.describe()
    );
    assert!(
        ch.flags().contains(" --optimizer-offload"),
        "{}",
        ch.flags()
    );
    let text = plan.explain().join("\n");
    assert!(
        text.contains("host memory: ") && text.contains("master weights and optimizer state"),
        "{text}"
    );
    assert!(
        text.contains("offload < optimizer-offload < stream-weights < bf16"),
        "{text}"
    );
    // Trained as planned, the ledger records the prediction, host bytes included.
    let highest = train_choice(&c, ch, cpu());
    assert_eq!(highest, ch.peak, "{}", ch.describe());
    // A host without room for the state rules it out: what fits then keeps the state on
    // the device, or nothing does and the error says the host is short.
    let no_host = FitRequest {
        host_budget: Some(ch.host_bytes() / 2),
        ..req
    };
    match autofit(&no_host) {
        Ok(plan) => assert!(
            plan.choice.host_bytes() <= ch.host_bytes() / 2,
            "{}",
            plan.choice.describe()
        ),
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("of host memory") && e.contains("a host with at least"),
                "{e}"
            );
        }
    }
}

/// A run that keeps its optimizer on the host already stays so: autofit does not add it
/// (no flag), says why it leaves it out, and counts its host bytes in every setup.
#[test]
fn a_run_offloading_its_optimizer_keeps_it() {
    let (c, opt) = (config(), AdamW::default());
    let req = FitRequest {
        optimizer_offload: true,
        ..every_technique(&c, &Fp32, &opt, 2, u64::MAX)
    };
    let plan = autofit(&req).unwrap();
    let ch = &plan.choice;
    assert!(ch.optimizer_offload && plan.unconstrained.optimizer_offload);
    assert!(!ch.techniques.contains(Technique::OptimizerOffload));
    assert!(
        !ch.flags().contains("--optimizer-offload"),
        "{}",
        ch.flags()
    );
    assert!(ch.host_bytes() > 0);
    let why = plan
        .left_out
        .iter()
        .find(|(t, _)| *t == Technique::OptimizerOffload)
        .map(|(_, w)| w.as_str());
    assert_eq!(why, Some("on already (the run's own setting)"));
    let text = plan.explain().join("\n");
    assert!(
        text.contains("optimizer-offload      not considered: on already"),
        "{text}"
    );
    // At the tightest budget every plan keeps it.
    let tightest = technique_savings(&req).unwrap().all.peak;
    let ch = autofit(&FitRequest {
        budget: tightest,
        ..req
    })
    .unwrap()
    .choice;
    assert!(ch.optimizer_offload, "{}", ch.describe());
    assert!(ch.peak <= tightest);
}

/// Llama 3.1 8B, batch 2 × 2048, on 24 GiB: nothing that keeps the optimizer on the
/// device fits; with the f32 master weights and AdamW's f32 moments on the host (bf16
/// compute, the update inside backward) it does, and with streaming allowed, every f32
/// weight streamed beside the optimizer on the host fits in f32.
#[test]
fn an_8b_full_fine_tune_fits_24gib_with_the_optimizer_on_the_host() {
    let arch = trainkit::estimate::preset("llama-3.1-8b").unwrap().shape;
    let opt = AdamW::default();
    let req = FitRequest {
        grad_clip: 0.0,
        ..FitRequest::new(arch, 2048, 2, 24 << 30, &Fp32, &opt)
    };
    let e = autofit(&FitRequest {
        techniques: Techniques::ALL.without(Technique::OptimizerOffload),
        ..req
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("nothing fits"), "{e}");
    // With every technique, streaming every weight beside the optimizer on the host comes
    // before bf16 in the cost order: the run stays in f32.
    let streamed = autofit(&req).unwrap().choice;
    assert!(
        streamed.stream_weights && streamed.optimizer_offload,
        "{}",
        streamed.describe()
    );
    assert_eq!(streamed.precision.typetag_name(), "fp32");
    assert!(streamed.peak <= 24 << 30);
    let req = FitRequest {
        techniques: Techniques::ALL.without(Technique::StreamWeights),
        ..req
    };
    let plan = autofit(&req).unwrap();
    for line in plan.explain() {
        println!("{line}");
    }
    let ch = &plan.choice;
    assert!(ch.peak <= 24 << 30);
    assert!(
        ch.optimizer_offload && ch.optimizer_in_backward,
        "{}",
        ch.describe()
    );
    assert_eq!(ch.optimizer.typetag_name(), "adamw");
    assert_eq!(ch.precision.typetag_name(), "mixed_bf16");
    assert!(ch.host_bytes() >= 12 * arch.exact_params().unwrap());
}

/// Streaming the frozen base is a technique for a run with one (LoRA, QLoRA): left out,
/// with the reason, where every weight trains; taken when nothing cheaper fits, with its
/// flag, its host memory and the bytes each step copies beside its FLOPs; trained as
/// planned, the ledger equals the prediction.
#[test]
fn streaming_the_frozen_base_is_taken_when_nothing_cheaper_fits() {
    let (c, opt) = (wide_config(), AdamW::default());
    let on_device = FitRequest {
        techniques: Techniques::ALL.without(Technique::OptimizerOffload),
        ..every_technique(&c, &Fp32, &opt, 2, u64::MAX)
    };
    let full = autofit(&on_device).unwrap();
    let (_, why) = full
        .left_out
        .iter()
        .find(|(t, _)| *t == Technique::StreamWeights)
        .expect("left out");
    assert!(why.contains("every weight trains"), "{why}");
    let lora = trainkit::Lora::new(4, 8.0, &["c_attn"]).unwrap();
    // One row a step: no accumulation, so the row of everything that combines is the
    // least any setup without streaming needs.
    let roomy = FitRequest {
        adapter: Some(&lora),
        techniques: Techniques::ALL.without(Technique::Bf16),
        ..every_technique(&c, &Fp32, &opt, 1, u64::MAX)
    };
    let cheaper = technique_savings(&FitRequest {
        techniques: roomy.techniques.without(Technique::StreamWeights),
        ..roomy
    })
    .unwrap()
    .all
    .peak;
    let plan = autofit(&FitRequest {
        budget: cheaper,
        ..roomy
    })
    .unwrap();
    assert!(!plan.choice.stream_weights, "{}", plan.choice.describe());
    let req = FitRequest {
        budget: cheaper - 1,
        ..roomy
    };
    let plan = autofit(&req).unwrap();
    let ch = &plan.choice;
    assert!(
        ch.stream_weights && ch.techniques.contains(Technique::StreamWeights),
        "{}",
        ch.describe()
    );
    assert!(ch.peak <= req.budget);
    assert!(ch.flags().contains(" --stream-weights"), "{}", ch.flags());
    assert!(ch.host_contents().contains("streamed weights"));
    assert_eq!(ch.host_bytes(), ch.prediction.host_bytes());
    assert!(ch.prediction.streamed_bytes_per_step > 0 && ch.prediction.flops_per_step > 0);
    let text = plan.explain().join("\n");
    assert!(
        text.contains("streamed weights: ") && text.contains("TFLOP of compute"),
        "{text}"
    );
    let highest = train_choice(&c, ch, cpu());
    assert_eq!(highest, ch.peak, "{}", ch.describe());
}

/// A full fine-tune streams every weight once the optimizer is on the host: autofit takes
/// both when nothing cheaper fits, and the run trains as predicted.
#[test]
fn a_full_fine_tune_streams_every_weight_when_nothing_cheaper_fits() {
    let (c, opt) = (wide_config(), AdamW::default());
    let roomy = FitRequest {
        techniques: Techniques::ALL.without(Technique::Bf16),
        ..every_technique(&c, &Fp32, &opt, 1, u64::MAX)
    };
    let cheaper = technique_savings(&FitRequest {
        techniques: roomy.techniques.without(Technique::StreamWeights),
        ..roomy
    })
    .unwrap()
    .all
    .peak;
    let req = FitRequest {
        budget: cheaper - 1,
        ..roomy
    };
    let ch = autofit(&req).unwrap().choice;
    assert!(
        ch.stream_weights && ch.optimizer_offload && ch.adapter.is_none(),
        "{}",
        ch.describe()
    );
    assert!(
        ch.flags().contains(" --optimizer-offload") && ch.flags().contains(" --stream-weights all"),
        "{}",
        ch.flags()
    );
    assert!(ch.peak <= req.budget);
    let highest = train_choice(&c, &ch, cpu());
    assert_eq!(highest, ch.peak, "{}", ch.describe());
}

/// In a data-parallel job autofit plans one rank (the heaviest's exact figures): under DDP the
/// one process's, under ZeRO-1 less (its share of the optimizer side), under ZeRO-2 less
/// again (its share of the gradients); streaming weights that train, which
/// data-parallel training refuses, is left out with the reason, and the update inside
/// backward is not.
#[test]
fn autofit_plans_one_rank_of_a_data_parallel_job() {
    let (c, opt) = (config(), AdamW::default());
    let one = FitRequest {
        techniques: Techniques::ALL.without(Technique::Bf16),
        ..every_technique(&c, &Fp32, &opt, 2, u64::MAX)
    };
    let peak = |world: usize, zero_stage: u8| {
        let plan = autofit(&FitRequest {
            world,
            zero_stage,
            ..one
        })
        .unwrap();
        if world > 1 {
            let why = |t: Technique| plan.left_out.iter().find(|(l, _)| *l == t);
            let (_, streaming) = why(Technique::StreamWeights).expect("streaming left out");
            assert!(streaming.contains("ranks"), "{streaming}");
            // The ranks sum each gradient as it is complete, for the update inside it.
            assert!(
                why(Technique::OptimizerInBackward).is_none(),
                "{:?}",
                plan.left_out
            );
        }
        technique_savings(&FitRequest {
            world,
            zero_stage,
            ..one
        })
        .unwrap();
        plan.unconstrained.peak
    };
    let alone = peak(1, 0);
    assert_eq!(peak(4, 0), alone, "DDP keeps it all");
    let (zero1, zero2) = (peak(4, 1), peak(4, 2));
    assert!(
        zero2 < zero1 && zero1 < alone,
        "{zero2} < {zero1} < {alone}"
    );
    // The stages are autofit's cheapest techniques after accumulation: a DDP run that
    // does not fit takes ZeRO-1, then ZeRO-2, before any recomputation.
    let ddp = FitRequest {
        world: 4,
        global_batch: 1,
        ..one
    };
    let (d1, d2) = (
        autofit(&ddp).unwrap().unconstrained.peak,
        autofit(&FitRequest {
            zero_stage: 1,
            ..ddp
        })
        .unwrap()
        .unconstrained
        .peak,
    );
    let ch = autofit(&FitRequest { budget: d2, ..ddp }).unwrap().choice;
    assert!(d2 < d1, "{d2} < {d1}");
    assert_eq!(ch.zero_stage, 1, "{}", ch.describe());
    assert!(
        ch.techniques.contains(Technique::Zero1),
        "{}",
        ch.describe()
    );
    assert!(ch.flags().contains(" --zero 1"), "{}", ch.flags());
    let ch = autofit(&FitRequest {
        budget: d2 - 1,
        ..ddp
    })
    .unwrap()
    .choice;
    assert_eq!(ch.zero_stage, 2, "{}", ch.describe());
    assert!(ch.flags().contains(" --zero 2"), "{}", ch.flags());
    // One process has no ranks to shard across.
    let plan = autofit(&one).unwrap();
    assert!(plan
        .left_out
        .iter()
        .any(|(t, why)| *t == Technique::Zero1 && why.contains("one process")));
    // Without buckets (--bucket-size 0) ZeRO-2 cannot free as it goes: left out, so a
    // budget only ZeRO-2 meets is not met by a setup the run would refuse.
    let unbucketed = FitRequest {
        bucket_bytes: 0,
        ..ddp
    };
    let plan = autofit(&unbucketed).unwrap();
    assert!(plan
        .left_out
        .iter()
        .any(|(t, why)| *t == Technique::Zero2 && why.contains("--bucket-size 0")));
    let plan = autofit(&FitRequest {
        budget: d2 - 1,
        ..unbucketed
    })
    .unwrap();
    assert_ne!(plan.choice.zero_stage, 2, "{}", plan.choice.describe());
}
