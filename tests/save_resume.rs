//! Saving, loading and exact resume.

use crate::common;

use common::{corpus_loader, cpu, per_param, scratch, tiny_config};
use trainkit::model::read_model_dir;
use trainkit::save::{write_safetensors, NamedTensor};
use trainkit::{
    AdamW, AdamW8bit, Constant, DType, Gpt2, MixedBf16, Optimizer, Precision, PureBf16, Trainer,
    TrainerOptions,
};

fn trainer<P: Precision>(
    precision: P,
) -> Trainer<P, trainkit::NoRecompute, AdamW, Constant, trainkit::PeakTracker> {
    trainer_with(precision, AdamW::default())
}

fn trainer_with<P: Precision, O: Optimizer>(
    precision: P,
    optimizer: O,
) -> Trainer<P, trainkit::NoRecompute, O, Constant, trainkit::PeakTracker> {
    Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        cpu(),
        corpus_loader(4000, 7, 2, 16),
    )
    .precision(precision)
    .optimizer(optimizer)
    .accumulation(Constant { micro_batches: 2 })
    .options(TrainerOptions {
        total_steps: 8,
        ..TrainerOptions::default()
    })
    .build()
    .unwrap()
}

/// Training 2n steps equals training n, saving, resuming in a new trainer and training n:
/// bitwise, in losses and in every weight.
fn resume_is_exact<P: Precision + Clone>(precision: P, name: &str) {
    resume_is_exact_with(precision, AdamW::default(), name);
}

fn resume_is_exact_with<P: Precision + Clone, O: Optimizer + Clone>(
    precision: P,
    optimizer: O,
    name: &str,
) {
    let n = 4;
    let trainer = |p: P| trainer_with(p, optimizer.clone());
    let mut straight = trainer(precision.clone());
    let losses: Vec<f64> = (0..2 * n).map(|_| straight.step().unwrap().loss).collect();

    let dir = scratch(name).join("ckpt");
    let mut first = trainer(precision.clone());
    for _ in 0..n {
        first.step().unwrap();
    }
    first.save(&dir, Some("# run config\n")).unwrap();
    drop(first);

    let mut resumed = trainer(precision);
    resumed.resume_from(&dir).unwrap();
    assert_eq!(resumed.steps_done(), n as u64);
    let rest: Vec<f64> = (0..n).map(|_| resumed.step().unwrap().loss).collect();
    for (i, (a, b)) in losses[n..].iter().zip(&rest).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "step {}: {a} vs {b}", n + i + 1);
    }
    assert_eq!(
        per_param(&straight, |p| p.value()),
        per_param(&resumed, |p| p.value())
    );
    assert_eq!(
        per_param(&straight, |p| p.weight()),
        per_param(&resumed, |p| p.weight())
    );
    // The optimizer state too, slot by slot, in its own dtype.
    for (a, b) in straight.params().iter().zip(resumed.params()) {
        let dtypes = |p: &trainkit::Param| p.state().iter().map(|t| t.dtype()).collect::<Vec<_>>();
        assert_eq!(dtypes(a), dtypes(b), "{}", a.name());
        for (x, y) in a.state().iter().zip(b.state()) {
            let be = cpu();
            assert_eq!(
                be.to_f32(x).unwrap(),
                be.to_f32(y).unwrap(),
                "{}",
                x.label()
            );
        }
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("trainkit.toml")).unwrap(),
        "# run config\n"
    );
}

#[test]
fn resume_is_bitwise_exact_in_fp32() {
    resume_is_exact(trainkit::Fp32, "fp32");
}

/// 8-bit moments (u8 codes and f32 block maxima, saved as they are) and the f32 moments
/// of the small tensors resume bit for bit.
#[test]
fn resume_is_bitwise_exact_with_adamw8bit() {
    resume_is_exact_with(trainkit::Fp32, AdamW8bit::default(), "adamw8bit");
    resume_is_exact_with(
        MixedBf16 { fp32_grads: false },
        AdamW8bit::default(),
        "adamw8bit-bf16",
    );
    let mut t = trainer_with(trainkit::Fp32, AdamW8bit::default());
    t.step().unwrap();
    let wte = t.params().iter().find(|p| p.numel() >= 4096).unwrap();
    let kinds: Vec<DType> = wte.state().iter().map(|s| s.dtype()).collect();
    assert_eq!(kinds, [DType::U8, DType::F32, DType::U8, DType::F32]);
}

#[test]
fn resume_is_bitwise_exact_in_mixed_precision() {
    resume_is_exact(MixedBf16 { fp32_grads: false }, "bf16");
}

/// A trainer built from the checkpoint's own weights (`init_from`, what `trainkit train
/// --resume` does for a full run: nothing drawn first) resumes bitwise as one built drawn;
/// it does not read the weights a second time (the file can be gone by then), but does
/// when a step or `params_mut` has touched a parameter since it was built.
#[test]
fn resume_from_a_trainer_built_from_the_checkpoint_is_exact_and_reads_once() {
    let precision = MixedBf16 { fp32_grads: false };
    let dir = scratch("resume-built-from").join("ckpt");
    let mut first = trainer(precision);
    for _ in 0..3 {
        first.step().unwrap();
    }
    first.save(&dir, None).unwrap();
    drop(first);
    let built_from = |dir: &std::path::Path| {
        Trainer::builder(
            Gpt2::new(tiny_config()).unwrap(),
            cpu(),
            corpus_loader(4000, 7, 2, 16),
        )
        .precision(precision)
        .accumulation(Constant { micro_batches: 2 })
        .options(TrainerOptions {
            total_steps: 8,
            ..TrainerOptions::default()
        })
        .init_from(read_model_dir(dir).unwrap())
        .build()
        .unwrap()
    };
    let mut drawn = trainer(precision);
    drawn.resume_from(&dir).unwrap();
    let expect: Vec<f64> = (0..3).map(|_| drawn.step().unwrap().loss).collect();
    let check = |mut t: Trainer<_, _, _, _, _>, what: &str| {
        assert_eq!(t.steps_done(), 3, "{what}");
        let losses: Vec<f64> = (0..3).map(|_| t.step().unwrap().loss).collect();
        assert_eq!(losses, expect, "{what}");
        assert_eq!(
            per_param(&drawn, |p| p.value()),
            per_param(&t, |p| p.value()),
            "{what}"
        );
    };

    // Stepped after it was built: its weights moved, the checkpoint's are read again.
    let mut stepped = built_from(&dir);
    stepped.step().unwrap();
    stepped.resume_from(&dir).unwrap();
    check(stepped, "stepped, then resumed");
    // Changed through params_mut: the same.
    let mut changed = built_from(&dir);
    let be = cpu();
    let p = &mut changed.params_mut()[0];
    let zeros = vec![0.0; p.shape().iter().product()];
    p.set_value(be.as_ref(), &zeros).unwrap();
    changed.resume_from(&dir).unwrap();
    check(changed, "changed, then resumed");

    // Untouched: resumed without reading model.safetensors again (gone by then; the
    // trainer read it while building).
    let mut untouched = built_from(&dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    untouched.resume_from(&dir).unwrap();
    check(untouched, "built from the checkpoint, resumed");
    // Another trainer must read them, and says the file is missing.
    let e = trainer(precision)
        .resume_from(&dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}

/// Pure bf16 in every update rounding: the stochastic stream goes on where it stopped
/// (keyed by seed, step and parameter), and the Kahan compensation is saved and restored.
#[test]
fn resume_is_bitwise_exact_in_pure_bf16() {
    use trainkit::ops::update_rounding::UpdateRounding;
    for rounding in [
        UpdateRounding::Nearest,
        UpdateRounding::Stochastic,
        UpdateRounding::Kahan,
    ] {
        resume_is_exact(PureBf16 { rounding }, &format!("pure-{rounding}"));
    }
    // The compensation itself, after a resume.
    let dir = scratch("pure-kahan-state").join("ckpt");
    let kahan = PureBf16 {
        rounding: UpdateRounding::Kahan,
    };
    let mut first = trainer(kahan);
    for _ in 0..3 {
        first.step().unwrap();
    }
    first.save(&dir, None).unwrap();
    let mut resumed = trainer(kahan);
    resumed.resume_from(&dir).unwrap();
    let comp = |t: &Trainer<PureBf16, _, _, _, _>| per_param(t, |p| p.compensation().unwrap());
    assert_eq!(comp(&first), comp(&resumed));
    assert!(
        comp(&first).iter().flatten().any(|&c| c != 0.0),
        "the compensation holds rounding errors"
    );
    // A run that keeps no compensation cannot continue one that did, nor the reverse.
    let e = trainer(PureBf16::default())
        .resume_from(&dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--update-rounding kahan"), "{e}");
    let plain = scratch("pure-nearest-state").join("ckpt");
    let mut t = trainer(PureBf16::default());
    t.step().unwrap();
    t.save(&plain, None).unwrap();
    let e = trainer(kahan).resume_from(&plain).unwrap_err().to_string();
    assert!(e.contains(".kahan") && e.contains("update rounding"), "{e}");
}

#[test]
fn a_saved_model_reads_back_with_hugging_face_names_and_layouts() {
    let mut t = trainer(trainkit::Fp32);
    t.step().unwrap();
    let dir = scratch("names").join("model");
    t.save(&dir, None).unwrap();
    let m = read_model_dir(&dir).unwrap();
    assert_eq!(m.config, trainkit::ModelConfig::new(tiny_config()));
    let c = tiny_config();
    let e = c.n_embd;
    let expect = [
        ("transformer.wte.weight", vec![c.vocab_size, e]),
        ("transformer.wpe.weight", vec![c.n_positions, e]),
        ("transformer.h.0.attn.c_attn.weight", vec![e, 3 * e]),
        ("transformer.h.0.attn.c_attn.bias", vec![3 * e]),
        ("transformer.h.2.mlp.c_fc.weight", vec![e, 4 * e]),
        ("transformer.h.2.mlp.c_proj.weight", vec![4 * e, e]),
        ("transformer.ln_f.bias", vec![e]),
    ];
    for (name, shape) in expect {
        assert_eq!(m.tensors[name].shape(), shape, "{name}");
    }
    assert_eq!(
        m.tensors.len(),
        2 + 12 * c.n_layer + 2,
        "no lm_head: it is tied"
    );
    for p in t.params() {
        assert_eq!(
            m.tensors[p.name()].values().unwrap(),
            t.backend().to_f32(p.value()).unwrap()
        );
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "gpt2");
    assert_eq!(cfg["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(cfg["n_embd"], 32);
    assert_eq!(cfg["activation_function"], "gelu_new");

    // Weights alone start another trainer at the same point.
    let mut other = trainer(trainkit::Fp32);
    other.load_weights(&m).unwrap();
    assert_eq!(
        per_param(&t, |p| p.value()),
        per_param(&other, |p| p.value())
    );
    assert_eq!(other.steps_done(), 0);
}

#[test]
fn transformers_style_files_load() {
    // What save_pretrained writes for GPT2LMHeadModel: names with or without the
    // `transformer.` prefix, extra config fields, mask buffers, a tied lm_head.
    let dir = scratch("hf");
    let t = trainer(trainkit::Fp32);
    let mut tensors: Vec<NamedTensor> = t
        .model_tensors()
        .unwrap()
        .into_iter()
        .map(|mut nt| {
            nt.name = nt.name.trim_start_matches("transformer.").to_string();
            nt
        })
        .collect();
    tensors.push(NamedTensor {
        name: "h.0.attn.bias".into(),
        shape: vec![1, 1, 32, 32],
        data: vec![1.0; 1024],
    });
    tensors.push(NamedTensor {
        name: "lm_head.weight".into(),
        shape: vec![256, 32],
        data: vec![0.0; 256 * 32],
    });
    write_safetensors(&dir.join("model.safetensors"), &tensors, None).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 32, "n_ctx": 32,
            "n_positions": 32, "vocab_size": 256, "summary_type": "cls_index",
            "transformers_version": "4.57.0", "activation_function": "gelu_new"}"#,
    )
    .unwrap();
    let m = read_model_dir(&dir).unwrap();
    assert_eq!(m.tensors.len(), 2 + 12 * 3 + 2);
    let mut other = trainer(trainkit::Fp32);
    other.load_weights(&m).unwrap();
    assert_eq!(
        per_param(&t, |p| p.value()),
        per_param(&other, |p| p.value())
    );
}

#[test]
fn bad_model_directories_are_clear_errors() {
    let dir = scratch("bad");
    let err = |d: &std::path::Path| read_model_dir(d).unwrap_err().to_string();
    assert!(err(&dir.join("nope")).contains("not a directory"));
    assert!(err(&dir).contains("config.json"));

    let write_cfg = |text: &str| std::fs::write(dir.join("config.json"), text).unwrap();
    write_cfg(r#"{"model_type": "bert", "n_layer": 1}"#);
    assert!(err(&dir).contains("`model_type` is `bert`"));
    write_cfg(
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 8, "vocab_size": 10, "activation_function": "relu"}"#,
    );
    assert!(err(&dir).contains("activation_function"));
    write_cfg(r#"{"n_layer": 1, "n_head": 3, "n_embd": 32, "n_positions": 8, "vocab_size": 10}"#);
    assert!(err(&dir).contains("impossible model"));
    write_cfg(r#"{"n_layer": 1, "n_embd": 32, "n_positions": 8, "vocab_size": 10}"#);
    assert!(err(&dir).contains("`n_head`"));

    write_cfg(r#"{"n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 256}"#);
    std::fs::write(dir.join("model.safetensors"), b"garbage").unwrap();
    assert!(err(&dir).contains("safetensors"));

    // Missing and misshapen tensors name the tensor.
    let t = trainer(trainkit::Fp32);
    let mut tensors = t.model_tensors().unwrap();
    tensors.retain(|nt| nt.name != "transformer.h.1.ln_2.bias");
    write_safetensors(&dir.join("model.safetensors"), &tensors, None).unwrap();
    let e = read_model_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("transformer.h.1.ln_2.bias") && e.contains("do not belong together"),
        "{e}"
    );
    let mut tensors = t.model_tensors().unwrap();
    tensors[0].shape = vec![128, 64];
    write_safetensors(&dir.join("model.safetensors"), &tensors, None).unwrap();
    let e = read_model_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("[128, 64]"), "{e}");
    // A directory of another model's shape: load_weights names the tensor.
    let mut small = t.model_tensors().unwrap();
    small.retain(|nt| !nt.name.contains(".h.2."));
    write_safetensors(&dir.join("model.safetensors"), &small, None).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 256}"#,
    )
    .unwrap();
    let mut other = trainer(trainkit::Fp32);
    let e = other
        .load_weights(&read_model_dir(&dir).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("transformer.h.2.") && e.contains("missing"),
        "{e}"
    );

    // Resuming needs the trainer state.
    let e = other.resume_from(&dir).unwrap_err().to_string();
    assert!(
        e.contains("trainer_state.json") && e.contains("--init-from"),
        "{e}"
    );
}

#[test]
fn saving_over_a_checkpoint_replaces_it_whole() {
    let dir = scratch("over").join("ckpt");
    let mut t = trainer(trainkit::Fp32);
    t.step().unwrap();
    t.save(&dir, None).unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    t.step().unwrap();
    t.save(&dir, None).unwrap();
    let state = std::fs::read_to_string(dir.join("trainer_state.json")).unwrap();
    assert!(state.contains("\"step\": 2"), "{state}");
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "mine"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(leftovers, vec!["ckpt".to_string()]);
}
