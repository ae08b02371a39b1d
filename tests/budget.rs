//! The byte-budget checkpoint policy: a budget of 0 is full recomputation, a budget of
//! every activation is no recomputation, budgets between keep more as they grow (never
//! more than asked once the layer inputs are in), results stay bitwise equal, the exact
//! prediction equals the ledger, and the plan hook it uses serves a user's policy too.

use crate::common;

use common::{corpus_loader, cpu, grads, tiny_config, trainkit as run_cli, TINY_TRAIN};
use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use trainkit::config::RunConfig;
use trainkit::estimate::{predict, MicroBatch};
use trainkit::{
    ActivationSite, AdamW, Budget, CheckpointPolicy, Fp32, Full, Gpt2, MemoryCategory, MixedBf16,
    NoRecompute, Precision, Retention, SiteCost, StepStats, Tags, Trainer,
};

fn step(policy: Box<dyn CheckpointPolicy>, precision: Box<dyn Precision>) -> (StepStats, Vec<u32>) {
    let mut t = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(20_000, 1, 2, 16),
    )
    .precision(precision)
    .checkpoint(policy)
    .build()
    .unwrap();
    t.step().unwrap();
    let s = t.step().unwrap();
    let g = grads(&t).concat().iter().map(|f| f.to_bits()).collect();
    (s, g)
}

fn same_memory(a: &StepStats, b: &StepStats, what: &str) {
    for c in MemoryCategory::ALL {
        assert_eq!(a.memory.peak.get(c), b.memory.peak.get(c), "{what}: {c}");
    }
    assert_eq!(a.memory.peak_total, b.memory.peak_total, "{what}: total");
    assert_eq!(a.stash, b.stash, "{what}: stash");
}

#[test]
fn a_budget_of_zero_is_full_and_a_huge_budget_is_no_recompute() {
    for precision in [
        Box::new(Fp32) as Box<dyn Precision>,
        Box::new(MixedBf16 { fp32_grads: true }),
    ] {
        let (full, g_full) = step(Box::new(Full), precision.clone());
        let (zero, g_zero) = step(Box::new(Budget::new(0)), precision.clone());
        same_memory(&zero, &full, "budget 0 vs full");
        assert_eq!(g_zero, g_full);
        let (none, g_none) = step(Box::new(NoRecompute), precision.clone());
        let (huge, g_huge) = step(Box::new(Budget::new(u64::MAX)), precision.clone());
        same_memory(&huge, &none, "huge budget vs none");
        assert_eq!(huge.stash.recomputed_bytes, 0);
        assert_eq!(g_huge, g_none);
        // Exactly every activation's bytes is enough to keep them all.
        let (exact, _) = step(Box::new(Budget::new(none.stash.kept_bytes)), precision);
        same_memory(&exact, &none, "budget of every activation vs none");
    }
}

#[test]
fn more_budget_keeps_more_never_more_than_asked_and_results_stay_bitwise_equal() {
    let (full, _) = step(Box::new(Full), Box::new(Fp32));
    let (none, g_none) = step(Box::new(NoRecompute), Box::new(Fp32));
    let (lo, hi) = (full.stash.kept_bytes, none.stash.kept_bytes);
    assert!(lo < hi);
    let mut last = (0u64, u64::MAX);
    for i in 0..=8 {
        let budget = lo + (hi - lo) * i / 8;
        let (s, g) = step(Box::new(Budget::new(budget)), Box::new(Fp32));
        let what = format!("budget {budget} (full keeps {lo}, none {hi})");
        assert!(
            s.stash.kept_bytes <= budget,
            "{what}: kept {}",
            s.stash.kept_bytes
        );
        assert!(
            s.stash.kept_bytes >= last.0,
            "{what}: kept less than a smaller budget"
        );
        assert!(
            s.stash.recomputed_bytes <= last.1,
            "{what}: recomputed more than a smaller budget"
        );
        assert_eq!(s.loss.to_bits(), none.loss.to_bits(), "{what}: loss");
        assert_eq!(g, g_none, "{what}: gradients differ from NoRecompute");
        last = (s.stash.kept_bytes, s.stash.recomputed_bytes);
    }
    // Between the ends the budget does keep something full recomputation drops.
    let (mid, _) = step(Box::new(Budget::new((lo + hi) / 2)), Box::new(Fp32));
    assert!(mid.stash.kept_bytes > lo && mid.stash.kept_bytes < hi);
}

#[test]
fn the_exact_prediction_equals_the_ledger_under_a_budget() {
    for budget in [0, 30_000, 60_000, u64::MAX] {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: true }),
        ] {
            let what = format!("budget {budget} {precision:?}");
            let p = predict(
                Box::new(Gpt2::new(tiny_config()).unwrap()),
                MicroBatch {
                    batch_size: 2,
                    seq_len: 16,
                },
                precision.as_ref(),
                &Budget::new(budget),
                &AdamW::default(),
            )
            .unwrap();
            let (s, _) = step(Box::new(Budget::new(budget)), precision);
            for c in MemoryCategory::ALL {
                assert_eq!(s.memory.peak.get(c), p.peak.get(c), "{what}: {c}");
            }
            assert_eq!(s.memory.peak_total, p.peak_total, "{what}");
            assert_eq!(s.stash.kept_bytes, p.activations.kept_bytes, "{what}");
            assert_eq!(
                s.stash.recomputed_bytes, p.activations.recomputed_bytes,
                "{what}"
            );
        }
    }
}

/// The sites the last plan saw.
static SEEN: Mutex<Vec<SiteCost>> = Mutex::new(Vec::new());

/// A user's planning policy: keeps the single most valuable activation per byte in each
/// layer besides the layer inputs, and records what it was shown.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct BestPerLayer;

#[typetag::serde(name = "best_per_layer")]
impl CheckpointPolicy for BestPerLayer {
    fn retain(&self, _site: &ActivationSite) -> Retention {
        Retention::Keep
    }

    fn plan(&self, sites: &[SiteCost]) -> Option<Vec<Retention>> {
        *SEEN.lock().unwrap() = sites.to_vec();
        let mut plan = vec![Retention::Recompute; sites.len()];
        let n_layer = sites.first().map_or(0, |s| s.site.n_layer);
        for layer in 0..n_layer {
            let in_layer = || (0..sites.len()).filter(|&i| sites[i].site.layer == layer);
            for i in in_layer() {
                if sites[i].site.is(Tags::LAYER_INPUT) {
                    plan[i] = Retention::Keep;
                }
            }
            let best = in_layer()
                .filter(|&i| !sites[i].site.is(Tags::LAYER_INPUT))
                .max_by(|&a, &b| {
                    sites[a]
                        .flops_per_byte()
                        .total_cmp(&sites[b].flops_per_byte())
                });
            if let Some(i) = best {
                plan[i] = Retention::Keep;
            }
        }
        Some(plan)
    }
}

#[test]
fn a_user_policy_plans_with_every_site_and_its_recompute_cost() {
    let (none, _) = step(Box::new(NoRecompute), Box::new(Fp32));
    let (planned, _) = step(Box::new(BestPerLayer), Box::new(Fp32));
    let sites = SEEN.lock().unwrap().clone();
    let cfg = tiny_config();
    // Every activation backward reads, layer by layer, with its exact bytes.
    assert_eq!(
        sites.iter().map(|s| s.site.bytes).sum::<u64>(),
        none.stash.kept_bytes
    );
    assert!(sites.windows(2).all(|w| w[0].site.layer <= w[1].site.layer));
    assert_eq!(
        sites
            .iter()
            .filter(|s| s.site.is(Tags::LAYER_INPUT))
            .count(),
        cfg.n_layer
    );
    // The cost of `qkv` is its product: 2·rows·C·3C, plus the bias (rows·3C).
    let (rows, c) = (2 * 16, cfg.n_embd as u64);
    let qkv = sites
        .iter()
        .find(|s| s.site.name == "qkv")
        .expect("a qkv site");
    assert!(
        qkv.recompute_flops >= 2 * rows * c * 3 * c,
        "qkv costs {} FLOPs",
        qkv.recompute_flops
    );
    // A layer's input costs the whole layer before it.
    let input1 = sites
        .iter()
        .find(|s| s.site.layer == 1 && s.site.is(Tags::LAYER_INPUT))
        .unwrap();
    assert!(input1.recompute_flops > qkv.recompute_flops);
    // The plan was followed: the inputs plus one activation per layer.
    assert!(planned.stash.kept_bytes > 0 && planned.stash.kept_bytes < none.stash.kept_bytes);
    assert!(planned.stash.dropped_bytes > 0);
}

/// Returns a plan one entry short.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ShortPlan;

#[typetag::serde(name = "short_plan")]
impl CheckpointPolicy for ShortPlan {
    fn retain(&self, _site: &ActivationSite) -> Retention {
        Retention::Keep
    }

    fn plan(&self, sites: &[SiteCost]) -> Option<Vec<Retention>> {
        Some(vec![Retention::Keep; sites.len().saturating_sub(1)])
    }
}

#[test]
fn a_plan_of_the_wrong_length_is_an_error_naming_the_policy() {
    let mut t = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(8_000, 1, 2, 16),
    )
    .checkpoint(ShortPlan)
    .build()
    .unwrap();
    let err = t.step().unwrap_err().to_string();
    assert!(err.contains("short_plan") && err.contains("one"), "{err}");
}

#[test]
fn budgets_round_trip_through_config_and_parse_from_the_flag() {
    let cfg = RunConfig::from_toml("[checkpoint]\nkind = \"budget\"\nbytes = \"1MiB\"\n").unwrap();
    let toml = cfg.to_toml().unwrap();
    assert!(
        toml.contains("kind = \"budget\"") && toml.contains("bytes = 1048576"),
        "{toml}"
    );
    let back = RunConfig::from_toml(&toml).unwrap();
    assert_eq!(
        format!("{:?}", back.checkpoint),
        format!("{:?}", Budget::new(1 << 20))
    );
    let p = trainkit::checkpoint::named("budget:2GiB").unwrap();
    assert_eq!(format!("{p:?}"), format!("{:?}", Budget::new(2 << 30)));
    let p = trainkit::checkpoint::named("budget:0").unwrap();
    assert_eq!(format!("{p:?}"), format!("{:?}", Budget::new(0)));
    for bad in ["budget", "budget:", "budget:lots"] {
        let e = trainkit::checkpoint::named(bad).unwrap_err().to_string();
        assert!(
            e.contains("budget:2GiB") || e.contains("2GiB"),
            "{bad}: {e}"
        );
    }
    let e = RunConfig::from_toml("[checkpoint]\nkind = \"budget\"\nbytes = \"x\"\n")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bytes") || e.contains("24GiB"), "{e}");
}

#[test]
fn the_cli_trains_with_a_budget_and_memory_shows_offloading() {
    let mut args = TINY_TRAIN.to_vec();
    args.extend([
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--recompute",
        "budget:40KB",
        "--offload-activations",
    ]);
    let (ok, out, err) = run_cli(&args);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("budget"), "{out}");
    let mut bad = TINY_TRAIN.to_vec();
    bad.extend(["--steps", "1", "--recompute", "budget:lots"]);
    let (ok, _, err) = run_cli(&bad);
    assert!(
        !ok && err.contains("--recompute") && err.contains("2GiB"),
        "{err}"
    );
    let (ok, out, err) = run_cli(&[
        "memory",
        "--model",
        "gpt2",
        "--seq-len",
        "256",
        "--recompute",
        "budget:100MiB",
        "--offload-activations",
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("offloading saves"), "{out}");
}
