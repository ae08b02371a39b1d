//! Weights streamed from host memory ([`trainkit::placement`]): the frozen base of LoRA
//! and QLoRA lives in host memory (the ledger's `streamed`) and comes to the device a
//! section ahead of its readers; training is bitwise the resident run under every
//! precision and recompute policy (a layer rerun out of turn included), offloaded
//! activations, evaluation and sampling; the device holds two layers' base instead of the
//! model's; the exact prediction equals the ledger; and a weight that trains is refused.

use crate::common;

use common::{corpus_loader, cpu, tiny_config, values, EveryOtherInput};
use std::sync::Arc;
use trainkit::estimate::{predict_with, MicroBatch};
use trainkit::placement::Resident;
use trainkit::placement::{Placement, WeightSite};
use trainkit::trainer::SamplingOptions;
use trainkit::{
    AdamW, Adapter, CheckpointPolicy, Fp32, Full, Gpt2, Llama, Lora, MemoryCategory, MixedBf16,
    Model, NoRecompute, Precision, Rng, Selective, StreamFrozen, Trainer, TrainerOptions,
    WeightPlacement,
};

const ALL: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Llama with LoRA on every projection, QLoRA (an NF4 base) likewise, and GPT-2 (tied
/// embeddings: the head reads the embedding's table) with LoRA on its projections.
const MODELS: [&str; 3] = ["llama-lora", "llama-qlora", "gpt2-lora"];

fn model(what: &str) -> Box<dyn Model> {
    let lora = |targets: &[&str]| Lora::new(4, 8.0, targets).unwrap();
    let (base, adapter): (Box<dyn Model>, Lora) = match what {
        "llama-lora" => (
            Box::new(Llama::new(common::tiny_llama_config()).unwrap()),
            lora(&ALL),
        ),
        "llama-qlora" => (
            Box::new(Llama::new(common::tiny_llama_config()).unwrap()),
            lora(&ALL).with_nf4_base(),
        ),
        _ => (
            Box::new(Gpt2::new(tiny_config()).unwrap()),
            lora(&["c_attn", "c_proj", "c_fc"]),
        ),
    };
    base.with_adapter(Arc::new(adapter) as Arc<dyn Adapter>)
        .unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Losses, weights after two steps, the evaluation loss and the bytes streamed per step.
type Outcome = (Vec<f64>, Vec<Vec<f32>>, f64, u64);

fn train(
    what: &str,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
    placement: Box<dyn WeightPlacement>,
    offload: bool,
) -> Outcome {
    let options = TrainerOptions {
        offload_activations: offload,
        placement,
        ..TrainerOptions::default()
    };
    let mut t = Trainer::builder(model(what), cpu(), corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(policy)
        .options(options)
        .build()
        .unwrap();
    let mut losses = Vec::new();
    let mut streamed = 0;
    for _ in 0..2 {
        let s = t.step().unwrap();
        losses.push(s.loss);
        streamed = s.streamed_bytes;
    }
    let batch = corpus_loader(20_000, 5, 2, 16).next_batch();
    let eval = t.loss_on(&batch).unwrap();
    (losses, values(&t), eval, streamed)
}

#[test]
fn streamed_training_is_bitwise_the_resident_one() {
    let policies = || {
        [
            Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
            Box::new(Full),
            Box::new(Selective),
            Box::new(EveryOtherInput),
        ]
    };
    for what in MODELS {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: true }),
        ] {
            for policy in policies() {
                let label = format!("{what} {precision:?} {policy:?}");
                let resident = train(
                    what,
                    precision.clone(),
                    policy.clone(),
                    Box::new(Resident),
                    false,
                );
                assert_eq!(resident.3, 0, "{label}: nothing streams when resident");
                for ahead in [0, 1, 2] {
                    let streamed = train(
                        what,
                        precision.clone(),
                        policy.clone(),
                        Box::new(StreamFrozen {
                            ahead,
                            min_bytes: 0,
                        }),
                        false,
                    );
                    let label = format!("{label} ahead {ahead}");
                    assert_eq!(streamed.0, resident.0, "{label}: losses");
                    assert!(bits(&streamed.1) == bits(&resident.1), "{label}: weights");
                    assert_eq!(streamed.2.to_bits(), resident.2.to_bits(), "{label}: eval");
                    assert!(streamed.3 > 0, "{label}: the base streams");
                }
            }
        }
        // Offloaded activations (full recomputation's layer inputs) stream beside it.
        let resident = train(
            what,
            Box::new(Fp32),
            Box::new(Full),
            Box::new(Resident),
            true,
        );
        let streamed = train(
            what,
            Box::new(Fp32),
            Box::new(Full),
            Box::new(StreamFrozen {
                ahead: 1,
                min_bytes: 0,
            }),
            true,
        );
        assert_eq!(streamed.0, resident.0, "{what} offloaded: losses");
        assert!(bits(&streamed.1) == bits(&resident.1), "{what} offloaded");
    }
}

/// The section a parameter is read in, by its name: the embedding, layer `i`, the head.
fn section(name: &str) -> String {
    let mut parts = name.split('.');
    while let Some(p) = parts.next() {
        if p == "layers" || p == "h" {
            return format!("layer {}", parts.next().unwrap_or(""));
        }
    }
    if name.contains("embed_tokens") || name.contains("wte") || name.contains("wpe") {
        "embedding".into()
    } else {
        "head".into()
    }
}

/// The base lives in host memory, counted as streamed; the device holds the adapters and
/// at most two sections' base at a time (one section ahead), far less than the whole
/// base; the step's copies move the base twice (forward and backward).
#[test]
fn the_device_holds_two_sections_of_the_base() {
    for what in ["llama-lora", "llama-qlora"] {
        let mut t = Trainer::builder(model(what), cpu(), corpus_loader(20_000, 1, 2, 16))
            .precision(MixedBf16 { fp32_grads: true })
            .checkpoint(Full)
            .placement(StreamFrozen {
                ahead: 1,
                min_bytes: 0,
            })
            .build()
            .unwrap();
        let s = t.step().unwrap();
        let frozen: u64 = t
            .params()
            .iter()
            .filter(|p| !p.trains())
            .map(|p| p.weight().bytes())
            .sum();
        let trained: u64 = t
            .params()
            .iter()
            .filter(|p| p.trains())
            .map(|p| p.weight().bytes())
            .sum();
        assert!(t.params().iter().all(|p| p.streamed() != p.trains()));
        assert!(
            t.params().iter().all(|p| !p.staged()),
            "{what}: freed after"
        );
        let mut by_section = std::collections::BTreeMap::<String, u64>::new();
        for p in t.params().iter().filter(|p| !p.trains()) {
            *by_section.entry(section(p.name())).or_default() += p.weight().bytes();
        }
        let mut largest: Vec<u64> = by_section.values().copied().collect();
        largest.sort_unstable();
        let two = largest.iter().rev().take(2).sum::<u64>();
        let peak = &s.memory.peak;
        assert_eq!(peak.get(MemoryCategory::Streamed), frozen, "{what}");
        assert_eq!(peak.get(MemoryCategory::Offloaded), 0, "{what}");
        let device_weights = peak.get(MemoryCategory::Weights);
        assert!(
            device_weights <= trained + two && device_weights < trained + frozen,
            "{what}: {device_weights} on the device, adapters {trained}, two sections {two}, \
             base {frozen}"
        );
        // Forward and backward read every section: the base crosses twice, but for the
        // head, whose backward follows its forward at once.
        assert_eq!(s.streamed_bytes, 2 * frozen - by_section["head"], "{what}");
    }
}

/// The meta run predicts the streamed run's ledger exactly: every category's peak
/// (streamed host bytes and the staged copies on the device) and the total.
#[test]
fn the_exact_prediction_knows_streaming() {
    for what in MODELS {
        for policy in [
            Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
            Box::new(Full),
            Box::new(EveryOtherInput),
        ] {
            let precision = MixedBf16 { fp32_grads: false };
            let options = TrainerOptions {
                placement: Box::new(StreamFrozen {
                    ahead: 1,
                    min_bytes: 0,
                }),
                ..TrainerOptions::default()
            };
            let micro = MicroBatch {
                batch_size: 2,
                seq_len: 16,
            };
            let predicted = predict_with(
                model(what),
                micro,
                &precision,
                policy.as_ref(),
                &AdamW::default(),
                &options,
            )
            .unwrap();
            assert!(predicted.peak.get(MemoryCategory::Streamed) > 0, "{what}");
            let mut t = Trainer::builder(model(what), cpu(), corpus_loader(8_000, 3, 2, 16))
                .precision(precision)
                .checkpoint(policy.clone())
                .options(options)
                .build()
                .unwrap();
            for step in 1..=2 {
                let s = t.step().unwrap();
                common::step_matches_prediction(
                    &s,
                    &predicted,
                    step,
                    1,
                    &format!("{what} {policy:?} streamed"),
                );
            }
        }
    }
}

/// Generation (with and without the key/value cache) draws the same tokens from a
/// streamed base as from a resident one.
#[test]
fn sampling_reads_the_streamed_base() {
    for use_cache in [true, false] {
        let draw = |placement: Box<dyn WeightPlacement>| {
            let options = TrainerOptions {
                placement,
                ..TrainerOptions::default()
            };
            let mut t =
                Trainer::builder(model("llama-qlora"), cpu(), corpus_loader(20_000, 1, 2, 16))
                    .options(options)
                    .build()
                    .unwrap();
            t.step().unwrap();
            let sampling = SamplingOptions {
                use_cache,
                ..SamplingOptions::default()
            };
            let out = t
                .generate(&[1, 2, 3], 6, sampling, &mut Rng::new(7))
                .unwrap();
            assert!(t.params().iter().all(|p| !p.staged()));
            out
        };
        assert_eq!(
            draw(Box::new(StreamFrozen {
                ahead: 1,
                min_bytes: 0
            })),
            draw(Box::new(Resident)),
            "use_cache {use_cache}"
        );
    }
}

/// A placement written outside trainkit that streams every weight.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct StreamEverything;

#[typetag::serde(name = "stream_everything")]
impl WeightPlacement for StreamEverything {
    fn place(&self, _site: &WeightSite<'_>) -> Placement {
        Placement::Streamed
    }
}

/// Streaming a weight that trains is not built: refused by name, before any step.
#[test]
fn streaming_a_weight_that_trains_is_refused() {
    let err = Trainer::builder(model("gpt2-lora"), cpu(), corpus_loader(20_000, 1, 2, 16))
        .placement(StreamEverything)
        .build()
        .err()
        .expect("refused");
    let text = err.to_string();
    assert!(
        text.contains("placement") && text.contains("lora_A") && text.contains("resident"),
        "{text}"
    );
}

/// `--stream-weights` on `trainkit train`: a QLoRA run over a saved base logs the losses
/// of the resident run and the bytes each step streamed; the config round-trips
/// `[placement]`, and the flag's setup line says so.
#[test]
fn the_cli_streams_the_base_and_the_config_says_so() {
    let dir = common::scratch("streaming-cli");
    let path = |p: &str| dir.join(p).display().to_string();
    let small = common::SMALL_RUN;
    common::trainkit_ok(
        &[
            &[
                "train",
                "--arch",
                "llama",
                "--steps",
                "0",
                "--out",
                &path("base"),
            ],
            &small[..],
        ]
        .concat(),
    );
    let run = |extra: &[&str], log: &str| -> (String, Vec<serde_json::Value>) {
        let base = path("base");
        let log = path(log);
        let args = [
            &[
                "train",
                "--init-from",
                base.as_str(),
                "--lora-rank",
                "4",
                "--lora-targets",
                "all-linear",
                "--qlora",
                "--recompute",
                "full",
                "--steps",
                "2",
                "--log-json",
                log.as_str(),
            ][..],
            extra,
            &small[..],
        ]
        .concat();
        let out = common::trainkit_ok(&args);
        let lines = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|v: &serde_json::Value| v.get("loss").is_some())
            .collect();
        (out, lines)
    };
    // A config with the placement alone sets the run's other settings to their config
    // defaults: the resident run has one too.
    let kept_home = path("resident.toml");
    std::fs::write(&kept_home, "[placement]\nkind = \"resident\"\n").unwrap();
    let (_, resident) = run(&["--config", kept_home.as_str()], "resident.jsonl");
    // The flag's policy keeps weights under 1 MiB (all of this model's) on the device,
    // and says so; a config streams them all.
    let (out, kept) = run(&["--stream-weights"], "kept.jsonl");
    assert!(
        out.contains("warning: the placement streams no weight of this model"),
        "{out}"
    );
    assert!(kept.iter().all(|s| s["streamed_bytes"] == 0), "{kept:?}");
    let every = path("every.toml");
    std::fs::write(
        &every,
        "[placement]\nkind = \"stream_frozen\"\nmin_bytes = 0\n",
    )
    .unwrap();
    let (out, streamed) = run(&["--config", every.as_str()], "streamed.jsonl");
    assert!(
        out.contains("frozen weights streamed from host memory, 1 section ahead"),
        "{out}"
    );
    assert!(!out.contains("streams no weight"), "{out}");
    assert_eq!(resident.len(), 2);
    for (r, s) in resident.iter().zip(&streamed) {
        assert_eq!(r["loss"], s["loss"], "{r} {s}");
        assert_eq!(r["streamed_bytes"], 0);
        assert!(s["streamed_bytes"].as_u64().unwrap() > 0, "{s}");
    }
    // The config file's `[placement]`, and the flags over it.
    use trainkit::config::{PolicyFlags, RunConfig};
    let text = "[placement]\nkind = \"stream_frozen\"\nahead = 2\n";
    let c = RunConfig::from_toml(text).unwrap();
    assert_eq!(c.placement.ahead(), 2);
    let back = RunConfig::from_toml(&c.to_toml().unwrap()).unwrap();
    assert_eq!(back.placement.typetag_name(), "stream_frozen");
    assert_eq!(back.placement.ahead(), 2);
    assert!(!RunConfig::default()
        .to_toml()
        .unwrap()
        .contains("placement"));
    let mut c2 = c.clone();
    let flags = PolicyFlags {
        stream_weights: Some("none".into()),
        ..PolicyFlags::default()
    };
    flags.apply(&mut c2).unwrap();
    assert_eq!(c2.placement.typetag_name(), "resident");
    let err = RunConfig::from_toml("[placement]\nkind = \"streaming\"\n").unwrap_err();
    assert!(err.to_string().contains("streaming"), "{err}");
}

/// A streamed QLoRA run saved and resumed takes the steps the straight run took, which
/// are the resident run's.
#[test]
fn a_streamed_run_resumes_bitwise() {
    let trainer = |placement: Box<dyn WeightPlacement>| {
        Trainer::builder(model("llama-qlora"), cpu(), corpus_loader(20_000, 1, 2, 16))
            .precision(MixedBf16 { fp32_grads: true })
            .checkpoint(Full)
            .options(TrainerOptions {
                placement,
                ..TrainerOptions::default()
            })
            .build()
            .unwrap()
    };
    let losses = |t: &mut Trainer<_, _, _, _, _>, n: usize| -> Vec<u64> {
        (0..n).map(|_| t.step().unwrap().loss.to_bits()).collect()
    };
    let mut resident = trainer(Box::new(Resident));
    let want = losses(&mut resident, 4);
    let dir = common::scratch("streaming-resume").join("ckpt");
    let mut first = trainer(Box::new(StreamFrozen {
        ahead: 1,
        min_bytes: 0,
    }));
    assert_eq!(losses(&mut first, 2), want[..2]);
    first.save(&dir, None).unwrap();
    drop(first);
    let mut resumed = trainer(Box::new(StreamFrozen {
        ahead: 1,
        min_bytes: 0,
    }));
    resumed.resume_from(&dir).unwrap();
    assert_eq!(losses(&mut resumed, 2), want[2..]);
    assert!(bits(&values(&resumed)) == bits(&values(&resident)));
}

/// Two steps of a full fine-tune with the optimizer on the host, placed by `placement`:
/// losses, every value after them, the last step's ledger peaks.
fn full_fine_tune(
    what: &str,
    precision: Box<dyn Precision>,
    in_backward: bool,
    placement: Box<dyn WeightPlacement>,
) -> (Vec<f64>, Vec<Vec<f32>>, trainkit::memory::CategoryBytes) {
    let base: Box<dyn Model> = match what {
        "llama" => Box::new(Llama::new(common::tiny_llama_config()).unwrap()),
        _ => Box::new(Gpt2::new(tiny_config()).unwrap()),
    };
    let options = TrainerOptions {
        optimizer_offload: true,
        optimizer_in_backward: in_backward,
        grad_clip: if in_backward { 0.0 } else { 1.0 },
        placement,
        ..TrainerOptions::default()
    };
    let mut t = Trainer::builder(base, cpu(), corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(Full)
        .options(options)
        .build()
        .unwrap();
    let mut losses = Vec::new();
    let mut peak = Default::default();
    for _ in 0..2 {
        let s = t.step().unwrap();
        losses.push(s.loss);
        peak = s.memory.peak;
    }
    assert!(t.params().iter().all(|p| !p.staged()));
    (losses, values(&t), peak)
}

/// Every weight streamed (`StreamAll`), those that train updated on the host in place:
/// bitwise the resident run with the optimizer on the host, after backward and inside it,
/// in fp32, mixed bf16 and pure bf16 (Kahan); the weights leave the device but for the
/// sections in flight.
#[test]
fn a_full_fine_tune_streams_every_weight_bitwise() {
    use trainkit::ops::update_rounding::UpdateRounding;
    for what in ["gpt2", "llama"] {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: false }),
            Box::new(trainkit::PureBf16 {
                rounding: UpdateRounding::Kahan,
            }),
        ] {
            for in_backward in [false, true] {
                let label = format!("{what} {precision:?} in backward {in_backward}");
                let resident =
                    full_fine_tune(what, precision.clone(), in_backward, Box::new(Resident));
                let streamed = full_fine_tune(
                    what,
                    precision.clone(),
                    in_backward,
                    Box::new(trainkit::StreamAll {
                        ahead: 1,
                        min_bytes: 0,
                    }),
                );
                assert_eq!(streamed.0, resident.0, "{label}: losses");
                assert!(bits(&streamed.1) == bits(&resident.1), "{label}: weights");
                let (r, s) = (&resident.2, &streamed.2);
                assert_eq!(r.get(MemoryCategory::Streamed), 0, "{label}");
                assert!(s.get(MemoryCategory::Streamed) > 0, "{label}");
                assert!(
                    s.get(MemoryCategory::Weights) < r.get(MemoryCategory::Weights),
                    "{label}: {} on the device streamed, {} resident",
                    s.get(MemoryCategory::Weights),
                    r.get(MemoryCategory::Weights)
                );
            }
        }
    }
}

/// `StreamAll` without the optimizer on the host is refused by name; its prediction
/// equals the ledger.
#[test]
fn streaming_every_weight_needs_the_optimizer_on_the_host_and_is_predicted() {
    let err = Trainer::builder(
        Box::new(Gpt2::new(tiny_config()).unwrap()) as Box<dyn Model>,
        cpu(),
        corpus_loader(20_000, 1, 2, 16),
    )
    .placement(trainkit::StreamAll {
        ahead: 1,
        min_bytes: 0,
    })
    .build()
    .err()
    .expect("refused");
    let text = err.to_string();
    assert!(
        text.contains("--optimizer-offload") && text.contains("--stream-weights frozen"),
        "{text}"
    );
    for in_backward in [false, true] {
        let options = || TrainerOptions {
            optimizer_offload: true,
            optimizer_in_backward: in_backward,
            grad_clip: if in_backward { 0.0 } else { 1.0 },
            placement: Box::new(trainkit::StreamAll {
                ahead: 1,
                min_bytes: 0,
            }),
            ..TrainerOptions::default()
        };
        let precision = MixedBf16 { fp32_grads: false };
        let predicted = predict_with(
            Box::new(Llama::new(common::tiny_llama_config()).unwrap()),
            MicroBatch {
                batch_size: 2,
                seq_len: 16,
            },
            &precision,
            &Full,
            &AdamW::default(),
            &options(),
        )
        .unwrap();
        let mut t = Trainer::builder(
            Box::new(Llama::new(common::tiny_llama_config()).unwrap()) as Box<dyn Model>,
            cpu(),
            corpus_loader(8_000, 3, 2, 16),
        )
        .precision(precision)
        .checkpoint(Full)
        .options(options())
        .build()
        .unwrap();
        let what = format!("stream all, in backward {in_backward}");
        // The first step creates the optimizer state parameter by parameter, so its host
        // peak is below a later step's (which the prediction gives); its device
        // categories, its total and the streamed weights are predicted.
        let first = t.step().unwrap();
        for c in MemoryCategory::ALL
            .into_iter()
            .filter(|c| *c != MemoryCategory::Offloaded)
        {
            assert_eq!(
                first.memory.peak.get(c),
                predicted.peak.get(c),
                "{what}: {c}"
            );
        }
        assert_eq!(
            first.memory.peak_total,
            predicted.first_step_peak_total(1),
            "{what}"
        );
        assert!(first.memory.peak.host() <= predicted.host_bytes(), "{what}");
        let later = t.step().unwrap();
        common::step_matches_prediction(&later, &predicted, 2, 1, &what);
        assert_eq!(later.streamed_bytes, predicted.streamed_bytes_per_step);
    }
}
