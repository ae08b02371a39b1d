//! LoRA on the shared decoder: PEFT's parameter names and shapes on Llama's fused and
//! GPT-2's projections, a frozen base that never moves and keeps no gradient, state or
//! master copy, an untrained adapter that is the base model exactly, the adapters'
//! gradients against finite differences, every recompute policy bitwise equal, the exact
//! prediction equal to the ledger, and bad adapters refused by name.

use crate::common;

use common::{corpus_loader, cpu, tiny_config, values};
use std::sync::Arc;
use trainkit::{
    AdamW, Adapter, CheckpointPolicy, DType, Fp32, Full, Gpt2, Llama, LlamaConfig, Lora,
    MemoryCategory, MixedBf16, Model, NoRecompute, PeakTracker, Precision, Qwen2Config, Selective,
    Trainer,
};

/// A small Llama-like config: 2 layers, 32 wide, 4 query heads of 8 sharing 2 key/value
/// heads, an MLP of 48, bytes.
fn llama_config() -> LlamaConfig {
    common::tiny_llama_config()
}

const ALL: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

fn lora(targets: &[&str]) -> Arc<dyn Adapter> {
    Arc::new(Lora::new(4, 8.0, targets).unwrap())
}

/// The models LoRA is tested on: Llama with every projection adapted, Qwen2 (q/k/v
/// biases, frozen) with the attention's queries and values, GPT-2 (`Conv1D`, the GELU MLP)
/// with all its projections, and GPT-2 with `c_attn` alone (its other projections frozen
/// without updates).
const MODELS: [&str; 4] = ["llama", "qwen2", "gpt2", "gpt2-attn"];

/// The base model `what` names.
fn base(what: &str) -> Box<dyn Model> {
    match what {
        "llama" => Box::new(Llama::new(llama_config()).unwrap()),
        "qwen2" => trainkit::ModelConfig::from(Qwen2Config {
            base: llama_config(),
        })
        .build()
        .unwrap(),
        _ => Box::new(Gpt2::new(tiny_config()).unwrap()),
    }
}

/// The projections model `what` adapts.
fn targets(what: &str) -> &'static [&'static str] {
    match what {
        "llama" => &ALL,
        "qwen2" => &["q_proj", "v_proj"],
        "gpt2" => &["c_attn", "c_proj", "c_fc"],
        _ => &["c_attn"],
    }
}

/// The LoRA adapter `what` is tested with.
fn adapter(what: &str) -> Arc<dyn Adapter> {
    lora(targets(what))
}

/// The model `what` names, with its adapter trained with dropout `p` (PEFT's
/// `lora_dropout`).
fn dropout_model(what: &str, p: f64) -> Box<dyn Model> {
    let lora = Lora {
        dropout: p,
        ..Lora::new(4, 8.0, targets(what)).unwrap()
    };
    base(what).with_adapter(Arc::new(lora)).unwrap()
}

/// The model `what` names, with its adapter.
fn model(what: &str) -> Box<dyn Model> {
    base(what).with_adapter(adapter(what)).unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// The gradients of the parameters that train, in model order.
fn trained_grads<P, C, O, A, M>(t: &Trainer<P, C, O, A, M>) -> Vec<Vec<f32>>
where
    P: Precision,
    C: CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    t.params()
        .iter()
        .filter(|p| p.trains())
        .map(|p| t.backend().to_f32(p.grad().expect("gradient")).unwrap())
        .collect()
}

#[test]
fn adapters_take_pefts_names_and_shapes() {
    let model = Llama::new(llama_config()).unwrap();
    assert_eq!(model.projection_modules().len(), 2 * 7);
    let model = model.with_adapter(lora(&ALL)).unwrap();
    let params = model.init_params();
    let (frozen, trained): (Vec<_>, Vec<_>) = params.iter().partition(|p| !p.trains);
    assert_eq!(
        frozen.len(),
        Llama::new(llama_config()).unwrap().init_params().len()
    );
    assert_eq!(trained.len(), 2 * 7 * 2);
    let shape = |name: &str| {
        params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .shape
            .clone()
    };
    let l0 = "model.layers.0";
    // q: 4 heads of 8; k, v: 2 heads of 8; gate, up: 48; o, down: 32.
    for (module, in_f, out_f) in [
        ("self_attn.q_proj", 32, 32),
        ("self_attn.k_proj", 32, 16),
        ("self_attn.v_proj", 32, 16),
        ("self_attn.o_proj", 32, 32),
        ("mlp.gate_proj", 32, 48),
        ("mlp.up_proj", 32, 48),
        ("mlp.down_proj", 48, 32),
    ] {
        assert_eq!(shape(&format!("{l0}.{module}.lora_A.weight")), [4, in_f]);
        assert_eq!(shape(&format!("{l0}.{module}.lora_B.weight")), [out_f, 4]);
    }
    let gpt2 = Gpt2::new(tiny_config())
        .unwrap()
        .with_adapter(lora(&["c_attn", "c_proj", "c_fc"]))
        .unwrap();
    let names: Vec<String> = gpt2
        .init_params()
        .into_iter()
        .filter(|p| p.trains)
        .map(|p| p.name)
        .collect();
    let c = tiny_config().n_embd;
    for module in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
        assert!(
            names.contains(&format!("transformer.h.0.{module}.lora_A.weight")),
            "{module} in {names:?}"
        );
    }
    let c_attn_b = gpt2
        .init_params()
        .into_iter()
        .find(|p| p.name == "transformer.h.0.attn.c_attn.lora_B.weight")
        .unwrap();
    assert_eq!(c_attn_b.shape, [3 * c, 4]);
}

#[test]
fn an_untrained_adapter_is_the_base_model() {
    for what in MODELS {
        let batch = corpus_loader(4_000, 7, 2, 12).next_batch();
        let loader = || corpus_loader(4_000, 7, 2, 12);
        let mut plain = Trainer::builder(base(what), cpu(), loader())
            .build()
            .unwrap();
        let mut adapted = Trainer::builder(model(what), cpu(), loader())
            .build()
            .unwrap();
        assert_eq!(
            plain.loss_on(&batch).unwrap().to_bits(),
            adapted.loss_on(&batch).unwrap().to_bits(),
            "{what}"
        );
    }
}

#[test]
fn training_moves_the_adapters_alone() {
    for what in MODELS {
        let mut t = Trainer::builder(model(what), cpu(), corpus_loader(20_000, 1, 2, 16))
            .precision(MixedBf16 { fp32_grads: true })
            .optimizer(AdamW {
                lr: 1e-2,
                ..AdamW::default()
            })
            .build()
            .unwrap();
        let before = values(&t);
        let first = t.step().unwrap();
        for _ in 0..5 {
            t.step().unwrap();
        }
        let last = t.step().unwrap();
        assert!(
            last.loss < first.loss,
            "{what}: {} → {}",
            first.loss,
            last.loss
        );
        let after = values(&t);
        let mut adapter_bytes = 0u64;
        for (i, p) in t.params().iter().enumerate() {
            if p.trains() {
                assert!(p.name().contains(".lora_"), "{what}: {} trains", p.name());
                assert_ne!(before[i], after[i], "{what}: {} did not move", p.name());
                assert_eq!(p.state().len(), 2, "{what}: {}", p.name());
                adapter_bytes += 4 * p.numel() as u64;
            } else {
                assert_eq!(
                    bits(&[before[i].clone()]),
                    bits(&[after[i].clone()]),
                    "{what}: {}",
                    p.name()
                );
                assert!(p.grad().is_none(), "{what}: {} kept a gradient", p.name());
                assert!(p.state().is_empty(), "{what}: {} has state", p.name());
                assert_eq!(p.value().dtype(), DType::Bf16, "{what}: {}", p.name());
            }
        }
        // f32 master weights for the adapters alone.
        assert_eq!(
            last.memory.peak.get(MemoryCategory::MasterWeights),
            adapter_bytes,
            "{what}"
        );
    }
}

/// The adapters' gradients (every `A` and `B`, B made non-zero first) against central
/// differences of the loss: through layer 1's updates to layer 0's, so the input
/// gradients of both LoRA nodes are checked too.
#[test]
fn gradients_match_finite_differences() {
    for what in MODELS {
        common::adapters::gradients_match_finite_differences(what, model(what), 8);
    }
}

type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f64>);

fn run(what: &str, precision: Box<dyn Precision>, policy: Box<dyn CheckpointPolicy>) -> Run {
    let mut t = Trainer::builder(model(what), cpu(), corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(policy)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (trained_grads(&t), values(&t), losses)
}

/// Recomputation changes memory, never results: the low-rank intermediates are
/// recomputed like every other activation.
#[test]
fn every_policy_is_bitwise_equal_in_both_precisions() {
    for what in MODELS {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: true }),
        ] {
            let (g0, v0, l0) = run(what, precision.clone(), Box::new(NoRecompute));
            for policy in [
                Box::new(Full) as Box<dyn CheckpointPolicy>,
                Box::new(Selective),
            ] {
                let label = format!("{what} {precision:?} {policy:?}");
                let (g, v, l) = run(what, precision.clone(), policy);
                let what = label;
                assert_eq!(l, l0, "{what}: losses");
                assert!(bits(&g) == bits(&g0), "{what}: gradients");
                assert!(bits(&v) == bits(&v0), "{what}: updated weights");
            }
        }
    }
}

/// LoRA dropout: the gradients of a training step are those of the loss with the
/// step's masks (central differences of [`Trainer::training_loss_on`]), so backward draws
/// the masks forward drew, through every adapted projection.
#[test]
fn dropout_gradients_match_finite_differences() {
    for what in MODELS {
        common::adapters::gradients_match_finite_differences(what, dropout_model(what, 0.3), 8);
    }
}

type Trained = Trainer<Fp32, NoRecompute, AdamW, trainkit::Constant, PeakTracker>;

fn dropout_trainer(what: &str, p: f64) -> Trained {
    Trainer::builder(
        dropout_model(what, p),
        cpu(),
        corpus_loader(20_000, 1, 2, 16),
    )
    .build()
    .unwrap()
}

/// Dropout acts in training only: it changes the adapters' gradients and so the
/// training, each step and micro-batch drawing its own masks, while evaluation of the
/// same weights equals the model without dropout, bit for bit.
#[test]
fn dropout_acts_in_training_and_never_in_evaluation() {
    let mut plain = dropout_trainer("llama", 0.0);
    let mut dropped = dropout_trainer("llama", 0.3);
    // B starts at zero, so the first loss is the base model's either way.
    assert_eq!(plain.step().unwrap().loss, dropped.step().unwrap().loss);
    assert!(bits(&trained_grads(&plain)) != bits(&trained_grads(&dropped)));
    let (lp, ld) = (plain.step().unwrap().loss, dropped.step().unwrap().loss);
    assert_ne!(lp, ld, "dropout changes training");
    let batch = corpus_loader(4_000, 9, 2, 16).next_batch();
    let be = plain.backend().clone();
    for (p, v) in plain.params_mut().iter_mut().zip(values(&dropped)) {
        p.set_value(be.as_ref(), &v).unwrap();
    }
    let eval = plain.loss_on(&batch).unwrap();
    assert_eq!(dropped.loss_on(&batch).unwrap().to_bits(), eval.to_bits());
    // In training the same batch loses another amount, and another again at another
    // step or micro-batch; the same step and micro-batch draw the same masks.
    let at = |t: &mut Trained, step, micro| t.training_loss_on(&batch, step, micro).unwrap();
    let step3 = at(&mut dropped, 3, 0);
    assert_ne!(step3, eval);
    assert_ne!(step3, at(&mut dropped, 4, 0));
    assert_ne!(step3, at(&mut dropped, 3, 1));
    assert_eq!(step3.to_bits(), at(&mut dropped, 3, 0).to_bits());
    assert_eq!(at(&mut plain, 3, 0).to_bits(), eval.to_bits());
}

/// Recomputation draws the masks forward drew: every policy trains bit for bit alike
/// with dropout, in both precisions.
#[test]
fn dropout_is_bitwise_equal_under_every_policy() {
    for what in ["llama", "gpt2"] {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: true }),
        ] {
            let run = |policy: Box<dyn CheckpointPolicy>| {
                let mut t = Trainer::builder(
                    dropout_model(what, 0.2),
                    cpu(),
                    corpus_loader(20_000, 1, 2, 16),
                )
                .precision(precision.clone())
                .checkpoint(policy)
                .build()
                .unwrap();
                let losses: Vec<f64> = (0..3).map(|_| t.step().unwrap().loss).collect();
                (bits(&trained_grads(&t)), bits(&values(&t)), losses)
            };
            let want = run(Box::new(NoRecompute));
            for policy in [
                Box::new(Full) as Box<dyn CheckpointPolicy>,
                Box::new(Selective),
            ] {
                let label = format!("{what} {precision:?} {policy:?}");
                assert!(run(policy) == want, "{label}");
            }
        }
    }
}

/// PEFT's `modules_to_save`: the untied head and every norm train whole beside the
/// adapter (their gradients against finite differences), the embedding stays frozen, the
/// adapter's tensors hold them under their own names, and the prediction equals the
/// ledger.
#[test]
fn modules_to_save_train_whole_beside_the_adapter() {
    let saving = || -> Box<dyn Model> {
        let lora = Lora {
            modules_to_save: vec!["lm_head".into(), "norm".into()],
            ..Lora::new(4, 8.0, &["q_proj", "v_proj"]).unwrap()
        };
        base("llama").with_adapter(Arc::new(lora)).unwrap()
    };
    common::adapters::gradients_match_finite_differences("llama saving", saving(), 8);
    common::adapters::prediction_equals_ledger("llama saving", &saving);
    let mut t = Trainer::builder(saving(), cpu(), corpus_loader(20_000, 1, 2, 16))
        .build()
        .unwrap();
    let before = values(&t);
    t.step().unwrap();
    let after = values(&t);
    for (i, p) in t.params().iter().enumerate() {
        let name = p.name();
        let whole = name == "lm_head.weight" || name.ends_with("norm.weight");
        assert_eq!(p.trains(), whole || name.contains(".lora_"), "{name}");
        if whole {
            assert_ne!(before[i], after[i], "{name} trains");
        } else if !name.contains(".lora_") {
            assert_eq!(before[i], after[i], "{name} is frozen");
        }
    }
    let saved: Vec<String> = t
        .adapter_tensors()
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .filter(|n| !n.contains(".lora_"))
        .collect();
    assert_eq!(saved.len(), 1 + 2 * 2 + 1, "{saved:?}");
    assert!(saved.contains(&"lm_head.weight".to_string()), "{saved:?}");
}

/// The meta backend's prediction equals the ledger, category by category: frozen
/// weights without master copies or gradients, the adapters' state, the intermediates.
#[test]
fn the_exact_prediction_equals_the_ledger() {
    for what in MODELS {
        common::adapters::prediction_equals_ledger(what, &|| model(what));
    }
    // Dropout's transient buffers are predicted too.
    common::adapters::prediction_equals_ledger("llama dropout", &|| dropout_model("llama", 0.1));
}

#[test]
fn bad_adapters_are_refused_by_name() {
    let err = Lora::new(0, 8.0, &["q_proj"]).unwrap_err().to_string();
    assert!(err.contains("adapter.rank"), "{err}");
    let err = Lora::new(4, 8.0, &["q_prj"]).unwrap_err().to_string();
    assert!(err.contains("q_prj") && err.contains("q_proj"), "{err}");
    let err = Lora::new(4, -1.0, &["q_proj"]).unwrap_err().to_string();
    assert!(err.contains("adapter.alpha"), "{err}");
    let err = Lora::new(4, 8.0, &[]).unwrap_err().to_string();
    assert!(err.contains("adapter.targets"), "{err}");
    // A projection the family does not have.
    let err = Llama::new(llama_config())
        .unwrap()
        .with_adapter(lora(&["c_attn"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("c_attn") && err.contains("q_proj"), "{err}");
    let err = Gpt2::new(tiny_config())
        .unwrap()
        .with_adapter(lora(&["q_proj"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("q_proj") && err.contains("c_attn"), "{err}");
}

/// The arguments as `&str`s.
fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `trainkit train --lora-rank` on a saved base: PEFT's files in --out (no copy of the
/// base), a resume that is bitwise the straight run, `--adapter` continuing from them,
/// `eval --adapter`, and bad flags refused by name.
#[test]
fn the_cli_trains_saves_and_resumes_an_adapter() {
    let dir = common::scratch("lora-cli");
    let path = |p: &str| dir.join(p).display().to_string();
    let run = common::trainkit_ok;
    let small = common::SMALL_RUN;
    run(&[
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
    .concat());
    let lora = |steps: &str, out: &str| -> Vec<String> {
        [
            "train",
            "--init-from",
            &path("base"),
            "--lora-rank",
            "4",
            "--lora-targets",
            "q_proj,v_proj,down_proj",
            // A run resumed to more steps equals the longer run under a constant rate (a
            // cosine decays over whichever total the run had when it took each step).
            "--lr-schedule",
            "constant",
            // PEFT's recipes' dropout: its masks are drawn from the seed, the step and the
            // micro-batch, so the resumed run draws what the straight run drew.
            "--lora-dropout",
            "0.1",
            // The norms trained whole beside the adapter (PEFT's modules_to_save), their
            // optimizer state resumed with the adapter's.
            "--modules-to-save",
            "norm",
            "--steps",
            steps,
            "--out",
            &path(out),
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(small.iter().map(|s| s.to_string()))
        .collect()
    };
    let out = run(&args(&lora("3", "a")));
    assert!(out.contains("adapter: LoRA rank 4, α 8"), "{out}");
    assert!(out.contains("down_proj, dropout 0.1:"), "{out}");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "trainer_state.json",
    ] {
        assert!(dir.join("a").join(f).is_file(), "{f}");
    }
    assert!(!dir.join("a").join("model.safetensors").exists());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("a/adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );
    assert_eq!(config["base_model_name_or_path"], path("base"));
    assert_eq!(config["lora_dropout"], 0.1);
    // Resumed to 6 steps: bitwise the straight 6-step run.
    run(&["train", "--resume", &path("a"), "--steps", "6"]);
    run(&args(&lora("6", "straight")));
    let bytes = |p: &str| std::fs::read(dir.join(p).join("adapter_model.safetensors")).unwrap();
    assert!(
        bytes("a") == bytes("straight"),
        "a resumed adapter differs from the straight run"
    );
    // Flags that would change the resumed run's base or adapter are refused by name, and
    // nothing is written.
    for (flag, value) in [
        ("--qlora", None),
        ("--lora-rank", Some("8")),
        ("--lora-targets", Some("q_proj")),
        ("--lora-dropout", Some("0.2")),
        ("--modules-to-save", Some("model.norm")),
        ("--init-from", Some("elsewhere")),
    ] {
        let resumed = path("a");
        let mut a = vec!["train", "--resume", &resumed, "--steps", "7", flag];
        a.extend(value);
        let (ok, _, err) = common::trainkit(&a);
        assert!(
            !ok && err.contains(flag) && err.contains("LoRA rank 4"),
            "{flag}: {err}"
        );
    }
    assert!(
        bytes("a") == bytes("straight"),
        "a refused resume wrote nothing"
    );
    // Continued from the adapter's files.
    let out = run(&[
        &[
            "train",
            "--init-from",
            &path("base"),
            "--adapter",
            &path("a"),
            "--steps",
            "1",
        ],
        &["--out", &path("c")][..],
        &small[..],
    ]
    .concat());
    assert!(out.contains("adapter from"), "{out}");
    // Evaluated over its base.
    let text = common::small_text(&dir);
    let eval = |adapter: Option<&str>| {
        let adapter = adapter.map(&path);
        let extra: Vec<&str> = adapter.iter().flat_map(|a| ["--adapter", a]).collect();
        common::eval_loss(&dir.join("base"), &text, &extra)
    };
    assert_ne!(eval(None), eval(Some("a")), "the adapter changes the model");
    // An adapter trained with PEFT's dropout (its recipes' 0.05) evaluates as it is, the
    // dropout off as in PEFT's eval mode, and trains on with its dropout (or the one
    // --lora-dropout gives).
    let dropped = dir.join("dropped");
    std::fs::create_dir_all(&dropped).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(dir.join("a").join(f), dropped.join(f)).unwrap();
    }
    let config = dropped.join("adapter_config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["lora_dropout"] = serde_json::json!(0.05);
    std::fs::write(&config, c.to_string()).unwrap();
    assert_eq!(eval(Some("dropped")), eval(Some("a")));
    let go_on = |more: &[&str]| {
        common::trainkit(
            &[
                &[
                    "train",
                    "--init-from",
                    &path("base"),
                    "--adapter",
                    &path("dropped"),
                ][..],
                &["--steps", "1"][..],
                more,
                &small[..],
            ]
            .concat(),
        )
    };
    let (ok, out, err) = go_on(&[]);
    assert!(ok && out.contains("dropout 0.05:"), "{out}\n{err}");
    let (ok, out, err) = go_on(&["--lora-dropout", "0.2"]);
    assert!(ok && out.contains("dropout 0.2:"), "{out}\n{err}");
    let (ok, _, err) = go_on(&["--lora-dropout", "1"]);
    assert!(
        !ok && err.contains("--lora-dropout") && err.contains("[0, 1)"),
        "{err}"
    );
    // Bad input, each named.
    for (bad, says) in [
        (
            vec!["train", "--adapter", &path("a") as &str, "--steps", "1"],
            "--init-from",
        ),
        (
            vec![
                "train",
                "--arch",
                "llama",
                "--lora-rank",
                "0",
                "--steps",
                "1",
            ],
            "--lora-rank",
        ),
        (
            vec![
                "train",
                "--arch",
                "llama",
                "--lora-alpha",
                "4",
                "--steps",
                "1",
            ],
            "--lora-rank",
        ),
        (
            vec![
                "train",
                "--arch",
                "llama",
                "--lora-rank",
                "4",
                "--lora-targets",
                "qproj",
            ],
            "qproj",
        ),
        (
            vec![
                "train",
                "--arch",
                "gpt2",
                "--lora-rank",
                "4",
                "--lora-targets",
                "q_proj",
            ],
            "c_attn",
        ),
    ] {
        let (ok, out, err) = common::trainkit(&bad);
        assert!(!ok, "{bad:?} succeeded: {out}");
        assert!(err.contains(says), "{bad:?}: {err}");
        assert!(!err.contains("panicked"), "{bad:?}: {err}");
    }
    let (ok, _, err) = common::trainkit(&[
        "train",
        "--init-from",
        &path("base"),
        "--adapter",
        &path("a"),
        "--lora-rank",
        "8",
        "--steps",
        "1",
    ]);
    assert!(!ok && err.contains("rank 4"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `trainkit merge`: the merged directory evaluates as the base with its adapter (Llama's
/// `[out, in]` projections and GPT-2's `Conv1D`), keeps the base's config, and bad
/// requests are refused by name without touching the base.
#[test]
fn merge_writes_the_adapted_model() {
    let dir = common::scratch("lora-merge");
    let path = |p: &str| dir.join(p).display().to_string();
    let run = common::trainkit_ok;
    let small = common::SMALL_RUN;
    let text = common::small_text(&dir);
    let eval = |model: &str, adapter: Option<&str>| common::eval_in(&dir, &text, model, adapter);
    // Each with base modules trained whole beside the adapter (PEFT's modules_to_save):
    // Llama's RMS norms (every module whose name ends with `norm`), GPT-2's final norm.
    for (arch, targets, saved) in [
        ("llama", "q_proj,v_proj,down_proj", "norm"),
        ("gpt2", "c_attn,c_fc", "ln_f"),
    ] {
        let base = format!("{arch}-base");
        let adapter = format!("{arch}-adapter");
        let merged = format!("{arch}-merged");
        let mut a = vec!["train", "--arch", arch, "--steps", "0", "--out"];
        let base_path = path(&base);
        a.push(&base_path);
        if arch == "gpt2" {
            a.extend([
                "--vocab-size",
                "256",
                "--n-layer",
                "2",
                "--n-embd",
                "32",
                "--n-head",
                "2",
            ]);
        }
        run(&[&a[..], &small[..]].concat());
        let adapter_path = path(&adapter);
        run(&[
            &[
                "train",
                "--init-from",
                &base_path,
                "--lora-rank",
                "4",
                "--lora-targets",
                targets,
                "--modules-to-save",
                saved,
                "--steps",
                "3",
                "--lr",
                "1e-2",
                "--out",
                &adapter_path,
            ][..],
            &small[..],
        ]
        .concat());
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(&adapter).join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["modules_to_save"], serde_json::json!([saved]));
        let names =
            common::safetensors_names(&dir.join(&adapter).join("adapter_model.safetensors"));
        let norm = if arch == "llama" {
            "base_model.model.model.norm.weight"
        } else {
            "base_model.model.transformer.ln_f.weight"
        };
        assert!(names.iter().any(|n| n == norm), "{arch}: {names:?}");
        let merged_path = path(&merged);
        let out = run(&[
            "merge",
            "--model",
            &base_path,
            "--adapter",
            &adapter_path,
            "--out",
            &merged_path,
        ]);
        assert!(out.contains("merged"), "{out}");
        assert_eq!(
            std::fs::read(dir.join(&base).join("config.json")).unwrap(),
            std::fs::read(dir.join(&merged).join("config.json")).unwrap()
        );
        let (adapted, merged_loss, plain) = (
            eval(&base, Some(&adapter)),
            eval(&merged, None),
            eval(&base, None),
        );
        assert_ne!(adapted, plain, "{arch}: the adapter changes the model");
        assert!(
            (adapted - merged_loss).abs() < 1e-5 * adapted.abs(),
            "{arch}: merged {merged_loss} vs base + adapter {adapted}"
        );
    }
    // A tied embedding saved whole: one tensor trained for the embedding and the head,
    // written twice as PEFT's ensure_weight_tying writes it, merged back into the tied base.
    let tied = path("llama-tied");
    run(&[
        &[
            "train",
            "--init-from",
            &path("llama-base"),
            "--lora-rank",
            "4",
            "--modules-to-save",
            "embed_tokens",
            "--lr",
            "1e-2",
            "--steps",
            "2",
            "--out",
            &tied,
        ][..],
        &small[..],
    ]
    .concat());
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("llama-tied/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["ensure_weight_tying"], true);
    let names = common::safetensors_names(&dir.join("llama-tied/adapter_model.safetensors"));
    for n in ["model.embed_tokens.weight", "lm_head.weight"] {
        assert!(
            names.contains(&format!("base_model.model.{n}")),
            "{names:?}"
        );
    }
    run(&["train", "--resume", &tied, "--steps", "3"]);
    run(&[
        "merge",
        "--model",
        &path("llama-base"),
        "--adapter",
        &tied,
        "--out",
        &path("llama-tied-merged"),
    ]);
    let (adapted, merged_loss) = (
        eval("llama-base", Some("llama-tied")),
        eval("llama-tied-merged", None),
    );
    assert!(
        (adapted - merged_loss).abs() < 1e-5 * adapted.abs(),
        "tied: merged {merged_loss} vs base + adapter {adapted}"
    );
    // Modules to save that the model cannot: a projection, nothing.
    for (saved, says) in [
        ("q_proj", "names a projection"),
        ("nothing", "matches no module"),
    ] {
        let (ok, _, err) = common::trainkit(
            &[
                &[
                    "train",
                    "--init-from",
                    &path("llama-base"),
                    "--lora-rank",
                    "4",
                    "--modules-to-save",
                    saved,
                    "--steps",
                    "1",
                ][..],
                &small[..],
            ]
            .concat(),
        );
        assert!(
            !ok && err.contains("modules_to_save") && err.contains(says),
            "{err}"
        );
    }
    // An adapter of another family, the base as --out, a dtype that is not one.
    let (ok, _, err) = common::trainkit(&[
        "merge",
        "--model",
        &path("llama-base"),
        "--adapter",
        &path("gpt2-adapter"),
        "--out",
        &path("x"),
    ]);
    assert!(
        !ok && err.contains("gpt2-adapter") && err.contains("c_attn"),
        "{err}"
    );
    let (ok, _, err) = common::trainkit(&[
        "merge",
        "--model",
        &path("llama-base"),
        "--adapter",
        &path("llama-adapter"),
        "--out",
        &path("llama-base"),
    ]);
    assert!(!ok && err.contains("--out"), "{err}");
    assert!(
        dir.join("llama-base/model.safetensors").is_file(),
        "the base is untouched"
    );
    let (ok, _, err) = common::trainkit(&[
        "merge",
        "--model",
        &path("llama-base"),
        "--adapter",
        &path("llama-adapter"),
        "--out",
        &path("y"),
        "--dtype",
        "u8",
    ]);
    assert!(!ok && err.contains("--dtype"), "{err}");
    // Merged into the adapter's own directory, transformers would apply the adapter a
    // second time on top of the merged weights: refused, the adapter untouched.
    let adapter_bytes = std::fs::read(dir.join("llama-adapter/adapter_model.safetensors")).unwrap();
    let (ok, _, err) = common::trainkit(&[
        "merge",
        "--model",
        &path("llama-base"),
        "--adapter",
        &path("llama-adapter"),
        "--out",
        &path("llama-adapter"),
    ]);
    assert!(
        !ok && err.contains("--out") && err.contains("adapter_config.json"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.join("llama-adapter/adapter_model.safetensors")).unwrap(),
        adapter_bytes
    );
    // A full fine-tune saved where an adapter was replaces it: no stale adapter_config.json
    // for transformers to apply on top of the model; other files are kept.
    std::fs::write(dir.join("llama-adapter/notes.txt"), "mine").unwrap();
    run(&[
        &[
            "train",
            "--init-from",
            &path("llama-base"),
            "--steps",
            "1",
            "--out",
            &path("llama-adapter"),
        ][..],
        &small[..],
    ]
    .concat());
    let out_dir = dir.join("llama-adapter");
    assert!(out_dir.join("model.safetensors").is_file());
    assert!(!out_dir.join("adapter_config.json").exists());
    assert!(!out_dir.join("adapter_model.safetensors").exists());
    assert_eq!(
        std::fs::read_to_string(out_dir.join("notes.txt")).unwrap(),
        "mine"
    );
}
