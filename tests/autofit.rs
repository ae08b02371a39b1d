//! Autofit chooses the least recomputation, then the fewest micro-batches, that fit a
//! budget; a run with its choice stays within the budget; when nothing fits it says what
//! would.

mod common;

use common::{corpus_loader, cpu};
use trainkit::checkpoint::{by_cost, named};
use trainkit::estimate::{autofit, parse_bytes, predict, FitRequest, MicroBatch};
use trainkit::ops::{AttentionPath, LossPath};
use trainkit::{AdamW, Constant, Error, Fp32, Gpt2, Gpt2Config, MixedBf16, Precision, Trainer};

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

fn request<'a>(
    config: &'a Gpt2Config,
    precision: &'a dyn Precision,
    optimizer: &'a AdamW,
    budget: u64,
) -> FitRequest<'a> {
    FitRequest {
        model: config.architecture(),
        seq_len: 64,
        global_batch: 8,
        budget,
        precision,
        optimizer,
        attention: AttentionPath::Fused,
        loss: LossPath::Fused,
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
    let model = trainkit::model::build_with(&req.model, req.seq_len, req.attention, req.loss);
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
}
