//! QLoRA: LoRA over a base whose projections are stored in NF4. The dequantizing product
//! against the product with the dequantized weight, the adapters' gradients against
//! finite differences through NF4 layers, recompute policies bitwise equal, the exact
//! prediction equal to the ledger with the packed bytes, and the command line.

use crate::common;

use common::{corpus_loader, cpu, tiny_config};
use std::sync::Arc;
use trainkit::model::{Rope, RopeScaling};
use trainkit::ops::nf4;
use trainkit::{
    Adapter, Backend, CheckpointPolicy, CpuBackend, DType, Full, Gpt2, Llama, LlamaConfig, Lora,
    MemoryCategory, MixedBf16, Model, NoRecompute, Precision, Qwen2Config, Selective, Trainer,
};

fn llama_config() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        initializer_range: 0.1,
        rope: Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
    }
}

fn qlora(targets: &[&str]) -> Arc<dyn Adapter> {
    Arc::new(Lora::new(4, 8.0, targets).unwrap().with_nf4_base())
}

/// Llama with every projection adapted, Qwen2 (q/k/v biases) with q and v, GPT-2
/// (`Conv1D`, the GELU MLP) with `c_attn` alone: its other projections NF4 without update.
const MODELS: [&str; 3] = ["llama", "qwen2", "gpt2"];

fn model(what: &str) -> Box<dyn Model> {
    let all = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    match what {
        "llama" => Box::new(
            Llama::new(llama_config())
                .unwrap()
                .with_adapter(qlora(&all))
                .unwrap(),
        ),
        "qwen2" => trainkit::ModelConfig::from(Qwen2Config {
            base: llama_config(),
        })
        .build()
        .unwrap()
        .with_adapter(qlora(&["q_proj", "v_proj"]))
        .unwrap(),
        _ => Box::new(
            Gpt2::new(tiny_config())
                .unwrap()
                .with_adapter(qlora(&["c_attn"]))
                .unwrap(),
        ),
    }
}

fn random(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    let mut rng = trainkit::Rng::new(seed);
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

/// The dequantizing product, in one block and in blocks of 3 rows, against `matmul` with
/// the weight dequantized by the reference: both orientations, a bias, accumulation.
#[test]
fn the_nf4_product_is_the_product_with_the_dequantized_weight() {
    let be = CpuBackend::new();
    let (m, rows, cols) = (5, 20, 72);
    let wv = random(rows * cols, 1, 0.05);
    let w = be
        .upload(&wv, &[rows, cols], DType::NF4, MemoryCategory::Weights, "w")
        .unwrap();
    assert_eq!(w.bytes(), nf4::Layout::of(rows * cols).bytes as u64);
    let dq = nf4::dequantize_host(&nf4::quantize(&wv), rows * cols);
    assert_eq!(be.to_f32(&w).unwrap(), dq);
    let wd = be
        .upload(
            &dq,
            &[rows, cols],
            DType::F32,
            MemoryCategory::Weights,
            "wd",
        )
        .unwrap();
    for transposed in [true, false] {
        let (k, n) = if transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        let a = be
            .upload(
                &random(m * k, 2, 1.0),
                &[m, k],
                DType::F32,
                MemoryCategory::Activations,
                "a",
            )
            .unwrap();
        let bias = be
            .upload(
                &random(n, 3, 1.0),
                &[n],
                DType::F32,
                MemoryCategory::Weights,
                "b",
            )
            .unwrap();
        let start = random(m * n, 4, 1.0);
        for (with_bias, accumulate) in [(false, false), (true, false), (false, true)] {
            let b = with_bias.then_some(&bias);
            let mut want = be
                .upload(
                    &start,
                    &[m, n],
                    DType::F32,
                    MemoryCategory::Activations,
                    "want",
                )
                .unwrap();
            be.matmul(&mut want, &a, &wd, b, false, transposed, accumulate)
                .unwrap();
            let want = be.to_f32(&want).unwrap();
            for max in [nf4::CHUNK_ELEMENTS, 3 * cols] {
                let mut got = be
                    .upload(
                        &start,
                        &[m, n],
                        DType::F32,
                        MemoryCategory::Activations,
                        "got",
                    )
                    .unwrap();
                nf4::matmul_in_blocks(&be, &mut got, &a, &w, b, transposed, accumulate, max)
                    .unwrap();
                let got = be.to_f32(&got).unwrap();
                let what =
                    format!("transposed {transposed} bias {with_bias} acc {accumulate} max {max}");
                if max == nf4::CHUNK_ELEMENTS {
                    assert_eq!(got, want, "{what}");
                } else {
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{what}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
    // The arithmetic ops refuse NF4 by name.
    let mut out = be
        .zeros(&[m, rows], DType::F32, MemoryCategory::Activations, "out")
        .unwrap();
    let a = be
        .zeros(&[m, cols], DType::F32, MemoryCategory::Activations, "a")
        .unwrap();
    let err = be
        .matmul(&mut out, &a, &w, None, false, true, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nf4"), "{err}");
}

/// The base projections are NF4 (the embeddings, norms, biases and head are not), frozen,
/// a fused weight quantized in one part per Hugging Face module (q/k/v, gate/up) as
/// bitsandbytes quantizes each module, and counted in the ledger at their packed size.
#[test]
fn the_base_projections_are_stored_in_nf4() {
    for what in MODELS {
        let t = Trainer::builder(model(what), cpu(), corpus_loader(4_000, 7, 2, 8))
            .precision(MixedBf16 { fp32_grads: false })
            .build()
            .unwrap();
        let mut nf4_params = 0;
        for p in t.params() {
            let projection = p.name().ends_with("proj.weight")
                || p.name().ends_with("c_attn.weight")
                || p.name().ends_with("c_fc.weight");
            if projection && !p.name().contains("lora") {
                assert!(p.weight().dtype().is_nf4(), "{what}: {}", p.name());
                assert!(!p.trains());
                // One part per Hugging Face module, each at its packed size.
                let DType::Nf4(parts) = p.weight().dtype() else {
                    unreachable!()
                };
                let spans = parts.of(p.numel());
                let modules = if p.name().contains("qkv_proj") {
                    3
                } else if p.name().contains("gate_up_proj") {
                    2
                } else {
                    1
                };
                assert_eq!(spans.len(), modules, "{what}: {}", p.name());
                let packed: usize = spans.iter().map(|s| nf4::Layout::of(s.1).bytes).sum();
                assert_eq!(p.weight().bytes(), packed as u64, "{what}: {}", p.name());
                nf4_params += 1;
            } else {
                assert!(!p.weight().dtype().is_nf4(), "{what}: {}", p.name());
            }
        }
        assert!(nf4_params >= 6, "{what}: {nf4_params}");
    }
}

/// The adapters' gradients against central differences of the loss, through two NF4
/// layers (so the input gradients of the dequantizing product are checked too).
#[test]
fn gradients_match_finite_differences() {
    for what in MODELS {
        common::adapters::gradients_match_finite_differences(what, model(what), 4);
    }
}

fn run(
    what: &str,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
) -> (Vec<Vec<f32>>, Vec<f64>) {
    common::adapters::two_steps(model(what), precision, policy)
}

/// Recomputation changes memory, never results, over an NF4 base too.
#[test]
fn every_policy_is_bitwise_equal() {
    for what in MODELS {
        let precision = Box::new(MixedBf16 { fp32_grads: true }) as Box<dyn Precision>;
        let (v0, l0) = run(what, precision.clone(), Box::new(NoRecompute));
        for policy in [
            Box::new(Full) as Box<dyn CheckpointPolicy>,
            Box::new(Selective),
        ] {
            let (v, l) = run(what, precision.clone(), policy.clone());
            assert_eq!(l, l0, "{what} {policy:?}: losses");
            let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
                v.iter()
                    .map(|x| x.iter().map(|f| f.to_bits()).collect())
                    .collect()
            };
            assert!(bits(&v) == bits(&v0), "{what} {policy:?}: weights");
        }
    }
}

/// The meta backend's prediction equals the ledger, category by category, with the NF4
/// weights at their packed size and the dequantized blocks as workspace.
#[test]
fn the_exact_prediction_equals_the_ledger() {
    for what in MODELS {
        common::adapters::prediction_equals_ledger(what, &|| model(what));
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `trainkit train --qlora` on a saved base: PEFT's files in --out, a resume bitwise the
/// straight run, `eval --qlora` (the quantization alone, then with the adapter), and
/// `--qlora` without a LoRA refused by name.
#[test]
fn the_cli_trains_resumes_and_evaluates_over_an_nf4_base() {
    let dir = common::scratch("qlora-cli");
    let path = |p: &str| dir.join(p).display().to_string();
    let run = |args: &[String]| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        common::trainkit_ok(&a)
    };
    let small = strings(&common::SMALL_RUN);
    let mut base = strings(&[
        "train",
        "--arch",
        "llama",
        "--steps",
        "0",
        "--out",
        &path("base"),
    ]);
    base.extend(small.clone());
    run(&base);
    let qlora = |steps: &str, out: &str| -> Vec<String> {
        let mut a = strings(&[
            "train",
            "--init-from",
            &path("base"),
            "--lora-rank",
            "4",
            "--lora-targets",
            "all-linear",
            "--qlora",
            // Resumed to more steps equals the longer run under a constant rate.
            "--lr-schedule",
            "constant",
            "--steps",
            steps,
            "--out",
            &path(out),
        ]);
        a.extend(small.clone());
        a
    };
    let out = run(&qlora("3", "a"));
    assert!(out.contains("adapter: QLoRA (NF4 base) rank 4"), "{out}");
    assert!(dir.join("a/adapter_model.safetensors").is_file());
    assert!(!dir.join("a/model.safetensors").exists());
    run(&strings(&["train", "--resume", &path("a"), "--steps", "6"]));
    run(&qlora("6", "straight"));
    let bytes = |p: &str| std::fs::read(dir.join(p).join("adapter_model.safetensors")).unwrap();
    assert!(
        bytes("a") == bytes("straight"),
        "a resumed QLoRA adapter differs from the straight run"
    );
    let text = common::small_text(&dir);
    let eval = |extra: &[&str]| common::eval_loss(&dir.join("base"), &text, extra);
    let (full, quantized) = (eval(&[]), eval(&["--qlora"]));
    assert_ne!(full, quantized, "NF4 changes the model");
    assert!(
        (full - quantized).abs() < 0.05 * full,
        "{full} vs {quantized}"
    );
    let adapted = eval(&["--qlora", "--adapter", &path("a")]);
    assert_ne!(adapted, quantized, "the adapter changes the model");
    let (ok, _, err) = common::trainkit(&[
        "train", "--arch", "llama", "--qlora", "--steps", "1", "--device", "cpu",
    ]);
    assert!(!ok && err.contains("--lora-rank"), "{err}");
}
