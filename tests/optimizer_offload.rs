//! Optimizer offload: master weights and optimizer state in host memory, the update on
//! the host, bitwise the update without offload.

use crate::common;

use common::{corpus_loader, cpu, scratch, tiny_config};
use std::sync::Arc;
use trainkit::ops::update_rounding::UpdateRounding;
use trainkit::{
    AdamW, AdamW8bit, Backend, Constant, CpuBackend, DType, Gpt2, MemoryCategory, MixedBf16,
    MixedFp16, Optimizer, Precision, PureBf16, Sgd, Trainer, TrainerOptions,
};

type Boxed = Trainer<
    Box<dyn Precision>,
    trainkit::NoRecompute,
    Box<dyn Optimizer>,
    Constant,
    trainkit::PeakTracker,
>;

/// A trainer of the tiny GPT-2 on `backend`.
fn trainer_on(
    backend: Arc<dyn Backend>,
    precision: Box<dyn Precision>,
    optimizer: Box<dyn Optimizer>,
    options: TrainerOptions,
    accumulation: usize,
) -> trainkit::Result<Boxed> {
    Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        backend,
        corpus_loader(20_000, 3, 2, 16),
    )
    .precision(precision)
    .optimizer(optimizer)
    .accumulation(Constant::new(accumulation))
    .options(options)
    .build()
}

/// Every parameter's weights, values, and optimizer state, as bits.
fn bits(t: &Boxed) -> Vec<(String, Vec<u32>)> {
    let be = t.backend();
    let mut out = Vec::new();
    for p in t.params() {
        let mut push = |what: &str, x: &trainkit::Tensor| {
            let v = be.to_f32(x).unwrap();
            out.push((
                format!("{} {what}", p.name()),
                v.iter().map(|x| x.to_bits()).collect(),
            ));
        };
        push("weight", p.weight());
        push("value", p.value());
        for (i, s) in p.state().iter().enumerate() {
            push(&format!("state {i}"), s);
        }
        if let Some(c) = p.compensation() {
            push("kahan", c);
        }
    }
    out
}

fn precisions() -> Vec<(&'static str, Box<dyn Precision>)> {
    vec![
        ("fp32", Box::new(trainkit::Fp32)),
        ("bf16", Box::new(MixedBf16::default())),
        ("bf16 bf16-grads", Box::new(MixedBf16 { fp32_grads: false })),
        ("fp16", Box::new(MixedFp16::default())),
        (
            "pure bf16 stochastic",
            Box::new(PureBf16 {
                rounding: UpdateRounding::Stochastic,
            }),
        ),
        (
            "pure bf16 kahan",
            Box::new(PureBf16 {
                rounding: UpdateRounding::Kahan,
            }),
        ),
    ]
}

/// Three steps with and without offload end in the same bits: weights, master weights,
/// optimizer state and compensation, and the same losses and norms. In every precision,
/// with clipping and two micro-batches, and with the update inside backward.
#[test]
fn the_offloaded_update_is_bitwise_the_update_on_the_device() {
    for (name, precision) in precisions() {
        for in_backward in [false, true] {
            let options = TrainerOptions {
                optimizer_in_backward: in_backward,
                grad_clip: if in_backward { 0.0 } else { 0.5 },
                ..TrainerOptions::default()
            };
            let k = if in_backward { 1 } else { 2 };
            let optimizer: Box<dyn Optimizer> = Box::new(AdamW {
                lr: 3e-3,
                ..AdamW::default()
            });
            let run = |offload: bool| {
                let mut t = trainer_on(
                    cpu(),
                    precision.clone(),
                    optimizer.clone(),
                    TrainerOptions {
                        optimizer_offload: offload,
                        ..options.clone()
                    },
                    k,
                )
                .unwrap();
                let stats: Vec<(u64, u64)> = (0..3)
                    .map(|_| {
                        let s = t.step().unwrap();
                        (s.loss.to_bits(), s.grad_norm.to_bits())
                    })
                    .collect();
                (bits(&t), stats, t)
            };
            let (on_device, device_stats, _) = run(false);
            let (offloaded, host_stats, t) = run(true);
            let what = format!("{name}, in backward {in_backward}");
            assert_eq!(device_stats, host_stats, "losses and norms, {what}");
            assert_eq!(on_device.len(), offloaded.len(), "{what}");
            for (a, b) in on_device.iter().zip(&offloaded) {
                assert!(a == b, "{} differs, {what}", a.0);
            }
            // The optimizer's side is in host memory, the weights on the device.
            let p = &t.params()[0];
            assert!(p.offloaded(), "{what}");
            for s in p.state() {
                assert_eq!(s.category(), MemoryCategory::Offloaded, "{what}");
            }
            assert_eq!(p.weight().category(), MemoryCategory::Weights, "{what}");
        }
    }
}

/// 8-bit AdamW and SGD with momentum run on the host too, bitwise.
#[test]
fn every_shipped_optimizer_runs_offloaded_bitwise() {
    let optimizers: Vec<Box<dyn Optimizer>> = vec![
        Box::new(AdamW8bit {
            lr: 3e-3,
            ..AdamW8bit::default()
        }),
        Box::new(Sgd {
            lr: 0.05,
            momentum: 0.9,
            ..Sgd::default()
        }),
    ];
    for optimizer in optimizers {
        let run = |offload: bool| {
            let mut t = trainer_on(
                cpu(),
                Box::new(MixedBf16::default()),
                optimizer.clone(),
                TrainerOptions {
                    optimizer_offload: offload,
                    ..TrainerOptions::default()
                },
                1,
            )
            .unwrap();
            for _ in 0..3 {
                t.step().unwrap();
            }
            bits(&t)
        };
        assert!(run(false) == run(true), "{optimizer:?}");
    }
}

/// The ledger moves the master weights and optimizer state from the device's categories
/// to host memory (`offloaded`): the device total drops by exactly their bytes.
#[test]
fn the_ledger_counts_master_weights_and_state_in_host_memory() {
    let run = |offload: bool| {
        let mut t = trainer_on(
            cpu(),
            Box::new(MixedBf16::default()),
            Box::new(AdamW::default()),
            TrainerOptions {
                optimizer_offload: offload,
                ..TrainerOptions::default()
            },
            1,
        )
        .unwrap();
        t.step().unwrap();
        let s = t.step().unwrap();
        let n: u64 = t.params().iter().map(|p| p.numel() as u64).sum();
        (s.memory, n, t.backend().ledger().snapshot())
    };
    let (device, n, _) = run(false);
    let (host, _, live) = run(true);
    // f32 master copy and two f32 moments: 12 bytes per parameter.
    assert_eq!(device.peak.get(MemoryCategory::MasterWeights), 4 * n);
    assert_eq!(device.peak.get(MemoryCategory::OptimizerState), 8 * n);
    assert_eq!(host.peak.get(MemoryCategory::MasterWeights), 0);
    assert_eq!(host.peak.get(MemoryCategory::OptimizerState), 0);
    assert_eq!(live.live.get(MemoryCategory::Offloaded), 12 * n);
    // The host also holds one parameter's gradient and compute weights while it updates.
    assert!(host.peak.host() > 12 * n);
    assert_eq!(
        host.peak.get(MemoryCategory::Weights),
        device.peak.get(MemoryCategory::Weights)
    );
    assert!(host.peak_total < device.peak_total - 12 * n + n);
}

/// A run saved with offload resumes bitwise, offloaded or not, and the reverse.
#[test]
fn offloaded_runs_save_and_resume_bitwise() {
    for precision in [
        Box::new(MixedBf16::default()) as Box<dyn Precision>,
        Box::new(PureBf16 {
            rounding: UpdateRounding::Kahan,
        }),
    ] {
        let make = |offload: bool| {
            trainer_on(
                cpu(),
                precision.clone(),
                Box::new(AdamW::default()),
                TrainerOptions {
                    optimizer_offload: offload,
                    ..TrainerOptions::default()
                },
                1,
            )
            .unwrap()
        };
        let mut straight = make(true);
        for _ in 0..4 {
            straight.step().unwrap();
        }
        for (saved_offloaded, resumed_offloaded) in [(true, true), (true, false), (false, true)] {
            let dir = scratch(&format!(
                "offload-resume-{}-{saved_offloaded}-{resumed_offloaded}",
                precision.compute_dtype()
            ))
            .join("ckpt");
            let mut first = make(saved_offloaded);
            for _ in 0..2 {
                first.step().unwrap();
            }
            first.save(&dir, None).unwrap();
            let mut resumed = make(resumed_offloaded);
            resumed.resume_from(&dir).unwrap();
            for _ in 0..2 {
                resumed.step().unwrap();
            }
            assert!(
                bits(&straight) == bits(&resumed),
                "{precision:?} saved offloaded {saved_offloaded}, resumed offloaded \
                 {resumed_offloaded}"
            );
        }
    }
}

/// A backend written outside trainkit that names no host memory.
#[derive(Debug, Default)]
struct NoHost(CpuBackend);

impl Backend for NoHost {
    fn name(&self) -> &'static str {
        "no-host"
    }
    fn device(&self) -> trainkit::Device {
        self.0.device()
    }
    fn ledger(&self) -> &trainkit::memory::Ledger {
        self.0.ledger()
    }
    fn dispatch(&self, call: &mut dyn trainkit::device::OpKernel) -> trainkit::Result<()> {
        self.0.dispatch(call)
    }
    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> trainkit::Result<trainkit::Tensor> {
        self.0.zeros(shape, dtype, category, label)
    }
    fn upload_kernel(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> trainkit::Result<trainkit::Tensor> {
        self.0.upload_kernel(data, shape, dtype, category, label)
    }
    fn to_f32_kernel(&self, t: &trainkit::Tensor) -> trainkit::Result<Vec<f32>> {
        self.0.to_f32_kernel(t)
    }
    fn copy_kernel(
        &self,
        t: &trainkit::Tensor,
        category: MemoryCategory,
        label: &str,
    ) -> trainkit::Result<trainkit::Tensor> {
        self.0.copy_kernel(t, category, label)
    }
    fn matmul_kernel(
        &self,
        out: &mut trainkit::Tensor,
        a: &trainkit::Tensor,
        b: &trainkit::Tensor,
        bias: Option<&trainkit::Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> trainkit::Result<()> {
        self.0
            .matmul_kernel(out, a, b, bias, trans_a, trans_b, accumulate)
    }
}

/// Offloading to a backend without host memory is an error naming the backend and the
/// flag; a transfer such a backend is asked for says it has none.
#[test]
fn a_backend_without_host_memory_is_refused_with_a_clear_error() {
    let be: Arc<dyn Backend> = Arc::new(NoHost::default());
    let e = trainer_on(
        Arc::clone(&be),
        Box::new(MixedBf16::default()),
        Box::new(AdamW::default()),
        TrainerOptions {
            optimizer_offload: true,
            ..TrainerOptions::default()
        },
        1,
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("no-host") && e.contains("--optimizer-offload") && e.contains("host memory"),
        "{e}"
    );
    // Without offload it trains.
    let mut t = trainer_on(
        be,
        Box::new(MixedBf16::default()),
        Box::new(AdamW::default()),
        TrainerOptions::default(),
        1,
    )
    .unwrap();
    t.step().unwrap();
    // A transfer of mismatched tensors is refused before any copy.
    let cpu = cpu();
    let host = cpu.host().unwrap();
    let mut a = host
        .zeros(&[4], DType::F32, MemoryCategory::Workspace, "a")
        .unwrap();
    let b = cpu
        .zeros(&[4], DType::Bf16, MemoryCategory::Workspace, "b")
        .unwrap();
    let e = cpu.transfer(&mut a, &b).unwrap_err().to_string();
    assert!(e.contains("dtype"), "{e}");
    assert_eq!(a.category(), MemoryCategory::Offloaded);
}

/// The meta backend predicts the offloaded run's ledger exactly: every category, the host
/// bytes (`offloaded`) among them, and the device totals of the first and later steps.
#[test]
fn the_prediction_equals_the_ledger_host_bytes_included() {
    for (name, precision) in precisions() {
        for in_backward in [false, true] {
            let options = TrainerOptions {
                optimizer_offload: true,
                optimizer_in_backward: in_backward,
                grad_clip: if in_backward { 0.0 } else { 1.0 },
                ..TrainerOptions::default()
            };
            let optimizer: Box<dyn Optimizer> = Box::new(AdamW::default());
            let predicted = trainkit::estimate::predict_with(
                Box::new(Gpt2::new(tiny_config()).unwrap()),
                trainkit::estimate::MicroBatch {
                    batch_size: 2,
                    seq_len: 16,
                },
                precision.as_ref(),
                &trainkit::NoRecompute,
                optimizer.as_ref(),
                &options,
            )
            .unwrap();
            let mut t = trainer_on(cpu(), precision.clone(), optimizer, options, 1).unwrap();
            let what = format!("{name}, in backward {in_backward}");
            // The first step creates the optimizer state parameter by parameter, so its
            // host peak (beside the last transient copies) is below a later step's, which
            // the prediction gives; its device categories and total are predicted.
            let first = t.step().unwrap();
            for c in MemoryCategory::ALL.into_iter().filter(|c| c.on_device()) {
                assert_eq!(
                    first.memory.peak.get(c),
                    predicted.peak.get(c),
                    "step 1 {c}, {what}"
                );
            }
            assert_eq!(
                first.memory.peak_total,
                predicted.first_step_peak_total(1),
                "step 1 total, {what}"
            );
            assert!(first.memory.peak.host() <= predicted.host_bytes(), "{what}");
            let later = t.step().unwrap();
            common::step_matches_prediction(&later, &predicted, 2, 1, &what);
            assert!(predicted.host_bytes() > 0, "{what}");
            assert_eq!(
                predicted.peak.get(MemoryCategory::MasterWeights),
                0,
                "{what}"
            );
            assert_eq!(
                predicted.peak.get(MemoryCategory::OptimizerState),
                0,
                "{what}"
            );
        }
    }
}

/// `[optimizer] offload = true` sits beside the optimizer's own settings, survives a
/// round trip, and anything but a boolean is refused naming the key.
#[test]
fn the_config_reads_and_writes_optimizer_offload() {
    use trainkit::config::RunConfig;
    let cfg =
        RunConfig::from_toml("[optimizer]\nkind = \"adamw\"\nlr = 1e-3\noffload = true\n").unwrap();
    assert!(cfg.optimizer_offload);
    assert_eq!(cfg.optimizer.learning_rate(), 1e-3);
    let text = cfg.to_toml().unwrap();
    assert!(text.contains("offload = true"), "{text}");
    assert!(RunConfig::from_toml(&text).unwrap().optimizer_offload);
    let plain = RunConfig::from_toml("[optimizer]\nkind = \"sgd\"\n").unwrap();
    assert!(!plain.optimizer_offload);
    assert!(!plain.to_toml().unwrap().contains("offload = true"));
    let e = RunConfig::from_toml("[optimizer]\nkind = \"adamw\"\noffload = \"yes\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("optimizer.offload") && e.contains("true or false"),
        "{e}"
    );
}

/// Through the CLI: an offloaded run ends in the same weights as one on the device, says
/// where its optimizer runs, and resumes bitwise from its checkpoint, which records the
/// offload.
#[test]
fn the_cli_trains_offloaded_bitwise_and_resumes() {
    let dir = scratch("offload-cli");
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = common::TINY_TRAIN.to_vec();
        args.extend_from_slice(&["--batch-size", "4", "--precision", "bf16"]);
        args.extend_from_slice(&["--lr-schedule", "constant", "--lr", "1e-3"]);
        args.extend_from_slice(extra);
        let (ok, out, err) = common::trainkit(&args);
        assert!(ok, "{args:?}: {err}");
        out
    };
    let (device, straight, first) = (dir.join("d"), dir.join("a"), dir.join("b"));
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    run(&["--steps", "4", "--out", &path(&device)]);
    let out = run(&[
        "--steps",
        "4",
        "--optimizer-offload",
        "--out",
        &path(&straight),
    ]);
    assert!(out.contains("on the host"), "{out}");
    run(&[
        "--steps",
        "2",
        "--optimizer-offload",
        "--out",
        &path(&first),
    ]);
    let config = std::fs::read_to_string(first.join("trainkit.toml")).unwrap();
    assert!(config.contains("offload = true"), "{config}");
    let (ok, out, err) = common::trainkit(&[
        "train",
        "--resume",
        &path(&first),
        "--steps",
        "4",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("at step 2") && out.contains("on the host"),
        "{out}"
    );
    let file = |d: &std::path::Path, f: &str| std::fs::read(d.join(f)).unwrap();
    for f in ["model.safetensors", "trainer_state.safetensors"] {
        assert!(
            file(&straight, f) == file(&first, f),
            "{f} after the resume"
        );
        assert!(file(&straight, f) == file(&device, f), "{f} on the device");
    }
}

/// A LoRA run offloads only what trains: the adapter's master weights and state go to the
/// host, the frozen base stays on the device alone, and the update is bitwise.
#[test]
fn a_lora_run_offloads_the_adapter_alone_bitwise() {
    use trainkit::Model;
    let run = |offload: bool| {
        let model: Box<dyn Model> = Box::new(Gpt2::new(tiny_config()).unwrap());
        let adapter: Arc<dyn trainkit::Adapter> =
            Arc::new(trainkit::Lora::new(4, 8.0, &["c_attn", "c_fc"]).unwrap());
        let model = model.with_adapter(adapter).unwrap();
        let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 3, 2, 16))
            .precision(Box::new(MixedBf16::default()) as Box<dyn Precision>)
            .optimizer(Box::new(AdamW {
                lr: 3e-3,
                ..AdamW::default()
            }) as Box<dyn Optimizer>)
            .options(TrainerOptions {
                optimizer_offload: offload,
                ..TrainerOptions::default()
            })
            .build()
            .unwrap();
        for _ in 0..3 {
            t.step().unwrap();
        }
        let trained: Vec<bool> = t.params().iter().map(|p| p.offloaded()).collect();
        let frozen_state = t
            .params()
            .iter()
            .filter(|p| !p.trains())
            .all(|p| p.state().is_empty() && !p.offloaded());
        let bits = common::update_bits(&t);
        (
            bits,
            trained,
            frozen_state,
            t.params().iter().map(|p| p.trains()).collect::<Vec<_>>(),
        )
    };
    let (device, _, _, trains) = run(false);
    let (host, offloaded, frozen_alone, _) = run(true);
    assert!(
        device == host,
        "LoRA offloaded differs from LoRA on the device"
    );
    assert_eq!(
        offloaded, trains,
        "exactly the parameters that train are offloaded"
    );
    assert!(trains.iter().any(|t| !t) && trains.iter().any(|t| *t));
    assert!(frozen_alone);
}
