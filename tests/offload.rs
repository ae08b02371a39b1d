//! Activation offloading moves memory, never results: with every shipped policy (and one
//! written here), in f32 and bf16 on the CPU, gradients, updates and losses are bitwise
//! equal to the same run without offloading; what the policy keeps leaves the device for
//! host memory (the ledger's `offloaded` category), and the exact prediction still equals
//! the ledger byte for byte.

use crate::common;

use common::{corpus_loader, cpu, grads, tiny_config, values, EveryOtherInput};
use serde::{Deserialize, Serialize};
use trainkit::estimate::{predict_with, MicroBatch};
use trainkit::{
    ActivationSite, Budget, CheckpointPolicy, Fp32, Full, Gpt2, MemoryCategory, MixedBf16,
    NoRecompute, Precision, Retention, Selective, StepStats, Trainer, TrainerOptions,
};

/// Recomputes everything, layer inputs included: nothing to offload.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DropAll;

#[typetag::serde(name = "offload_test_drop_all")]
impl CheckpointPolicy for DropAll {
    fn retain(&self, _site: &ActivationSite) -> Retention {
        Retention::Recompute
    }
}

/// Offloads the MLP's wide activations itself and keeps the rest: a policy may answer
/// `Offload` on its own.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct OffloadWide;

#[typetag::serde(name = "offload_wide")]
impl CheckpointPolicy for OffloadWide {
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.is(trainkit::Tags::WIDE) {
            Retention::Offload
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
        Box::new(Budget::new(40_000)),
        Box::new(EveryOtherInput),
    ]
}

fn precisions() -> Vec<Box<dyn Precision>> {
    vec![Box::new(Fp32), Box::new(MixedBf16 { fp32_grads: true })]
}

fn options(offload: bool) -> TrainerOptions {
    TrainerOptions {
        offload_activations: offload,
        ..TrainerOptions::default()
    }
}

type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<StepStats>);

fn run(precision: Box<dyn Precision>, policy: Box<dyn CheckpointPolicy>, offload: bool) -> Run {
    run_model(
        Box::new(Gpt2::new(tiny_config()).unwrap()),
        precision,
        policy,
        offload,
    )
}

fn run_model(
    model: Box<dyn trainkit::Model>,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
    offload: bool,
) -> Run {
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(policy)
        .options(options(offload))
        .build()
        .unwrap();
    let stats = (0..2).map(|_| t.step().unwrap()).collect();
    (grads(&t), values(&t), stats)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

#[test]
fn offloading_is_bitwise_equal_to_keeping_for_every_policy_and_precision() {
    for precision in precisions() {
        for policy in policies() {
            let what = format!("{policy:?} {precision:?}");
            let (g0, v0, s0) = run(precision.clone(), policy.clone(), false);
            let (g1, v1, s1) = run(precision.clone(), policy, true);
            assert!(bits(&g1) == bits(&g0), "{what}: gradients differ");
            assert!(bits(&v1) == bits(&v0), "{what}: updated weights differ");
            for (a, b) in s0.iter().zip(&s1) {
                assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}: loss");
                // What the policy kept is what was offloaded; nothing stays kept.
                assert!(a.stash.kept_bytes > 0, "{what}");
                assert_eq!(b.stash.offloaded_bytes, a.stash.kept_bytes, "{what}");
                assert_eq!(b.stash.kept_bytes, 0, "{what}");
                assert_eq!(b.stash.dropped_bytes, a.stash.dropped_bytes, "{what}");
                assert_eq!(a.memory.peak.get(MemoryCategory::Offloaded), 0, "{what}");
                // Host memory held every offloaded activation at once, after forward.
                assert_eq!(
                    b.memory.peak.get(MemoryCategory::Offloaded),
                    b.stash.offloaded_bytes,
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn offloading_a_llama_is_bitwise_equal_to_keeping() {
    let llama = || {
        let config = trainkit::model::LlamaConfig::small();
        Box::new(trainkit::Llama::new(config).unwrap()) as Box<dyn trainkit::Model>
    };
    for precision in precisions() {
        for policy in policies() {
            let what = format!("llama {policy:?} {precision:?}");
            let (g0, v0, s0) = run_model(llama(), precision.clone(), policy.clone(), false);
            let (g1, v1, s1) = run_model(llama(), precision.clone(), policy, true);
            assert!(bits(&g1) == bits(&g0), "{what}: gradients differ");
            assert!(bits(&v1) == bits(&v0), "{what}: updated weights differ");
            assert_eq!(
                s1[1].stash.offloaded_bytes, s0[1].stash.kept_bytes,
                "{what}"
            );
            assert!(s1[1].memory.peak_total < s0[1].memory.peak_total, "{what}");
        }
    }
}

/// The memory_viz snapshot is the device's: host memory held for it has no address there;
/// the event stream and the plot still show it.
#[test]
fn offloaded_bytes_stay_out_of_the_device_snapshot() {
    let mut t = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(8_000, 1, 2, 16),
    )
    .checkpoint(NoRecompute)
    .observer(trainkit::Timeline::new(2).unwrap())
    .options(options(true))
    .build()
    .unwrap();
    for _ in 0..2 {
        t.step().unwrap();
    }
    let dir = common::scratch("offload-timeline");
    let timeline = t.observer();
    timeline.write_memory_viz(dir.join("viz.pickle")).unwrap();
    timeline.write_json_lines(dir.join("events.jsonl")).unwrap();
    timeline.write_svg(dir.join("memory.svg")).unwrap();
    let has = |bytes: &[u8], s: &str| bytes.windows(s.len()).any(|w| w == s.as_bytes());
    let viz = std::fs::read(dir.join("viz.pickle")).unwrap();
    assert!(
        has(&viz, "(activations)"),
        "the snapshot names device buffers"
    );
    assert!(
        !has(&viz, "(offloaded)"),
        "host buffers in the device snapshot"
    );
    let events = std::fs::read(dir.join("events.jsonl")).unwrap();
    assert!(
        has(&events, "\"offloaded\""),
        "the event stream shows host buffers"
    );
    let svg = std::fs::read(dir.join("memory.svg")).unwrap();
    assert!(
        has(&svg, ">offloaded<") || has(&svg, "offloaded"),
        "the plot's legend"
    );
}

#[test]
fn a_policy_may_offload_on_its_own() {
    let (g0, v0, s0) = run(Box::new(Fp32), Box::new(NoRecompute), false);
    let (g1, v1, s1) = run(Box::new(Fp32), Box::new(OffloadWide), false);
    assert!(bits(&g1) == bits(&g0) && bits(&v1) == bits(&v0));
    let (a, b) = (&s0[1], &s1[1]);
    assert!(b.stash.offloaded_bytes > 0);
    assert_eq!(
        b.stash.offloaded_bytes + b.stash.kept_bytes,
        a.stash.kept_bytes
    );
}

#[test]
fn offloading_lowers_the_device_peak_and_the_host_holds_the_rest() {
    for policy in [
        Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
        Box::new(Full),
    ] {
        let (_, _, kept) = run(Box::new(Fp32), policy.clone(), false);
        let (_, _, off) = run(Box::new(Fp32), policy.clone(), true);
        let (k, o) = (&kept[1].memory, &off[1].memory);
        let what = format!("{policy:?}");
        assert!(
            o.peak.get(MemoryCategory::Activations) < k.peak.get(MemoryCategory::Activations),
            "{what}: activations {} with offloading, {} without",
            o.peak.get(MemoryCategory::Activations),
            k.peak.get(MemoryCategory::Activations)
        );
        assert!(o.peak_total < k.peak_total, "{what}: device peak");
        // The device total leaves host memory out.
        assert_eq!(o.peak.total(), {
            let p = o.peak;
            MemoryCategory::ALL
                .iter()
                .filter(|c| **c != MemoryCategory::Offloaded)
                .map(|c| p.get(*c))
                .sum::<u64>()
        });
        assert_eq!(o.peak.host(), o.peak.get(MemoryCategory::Offloaded));
    }
}

#[test]
fn the_exact_prediction_equals_the_ledger_with_offloading() {
    for precision in precisions() {
        for policy in policies() {
            let what = format!("{policy:?} {precision:?}");
            let model = Gpt2::new(tiny_config()).unwrap();
            let (b, t) = (2, 16);
            let predicted = predict_with(
                Box::new(model.clone()),
                MicroBatch {
                    batch_size: b,
                    seq_len: t,
                },
                precision.as_ref(),
                policy.as_ref(),
                &trainkit::AdamW::default(),
                &options(true),
            )
            .unwrap();
            let mut tr = Trainer::builder(model, cpu(), corpus_loader(8_000, 3, b, t))
                .precision(precision.clone())
                .checkpoint(policy.clone())
                .options(options(true))
                .build()
                .unwrap();
            for step in 1..=2 {
                let s = tr.step().unwrap();
                common::step_matches_prediction(&s, &predicted, step, 1, &what);
                assert_eq!(
                    s.stash.offloaded_bytes, predicted.activations.offloaded_bytes,
                    "{what}"
                );
            }
            assert!(predicted.peak.get(MemoryCategory::Offloaded) > 0, "{what}");
        }
    }
}

#[test]
fn offloading_with_a_policy_that_keeps_nothing_fails_before_the_first_step() {
    let err = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(8_000, 1, 2, 16),
    )
    .checkpoint(DropAll)
    .options(options(true))
    .build()
    .map(|_| ())
    .unwrap_err()
    .to_string();
    for part in [
        "--offload-activations",
        "training.offload_activations",
        "offload_test_drop_all",
        "--recompute full",
    ] {
        assert!(err.contains(part), "`{part}` missing from: {err}");
    }
}

#[test]
fn the_config_key_and_the_flag_turn_offloading_on() {
    use trainkit::config::{Overrides, PolicyFlags, RunConfig};
    let cfg = RunConfig::from_toml(
        "[training]\noffload_activations = true\n[checkpoint]\nkind = \"full\"\n",
    )
    .unwrap();
    assert!(cfg.training.offload_activations);
    let back = RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    assert!(back.training.offload_activations);
    let mut cfg = RunConfig::default();
    Overrides {
        policy: PolicyFlags {
            offload_activations: Some(true),
            ..PolicyFlags::default()
        },
        ..Overrides::default()
    }
    .apply(&mut cfg)
    .unwrap();
    assert!(cfg.training.offload_activations);
}
