//! The Qwen families on the shared decoder: Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
//! RMS norm, heads wider than hidden / heads). The whole model's gradients against finite
//! differences, every recompute policy bitwise equal in f32 and bf16, the exact memory
//! prediction equal to the ledger, the q/k norm's kernels bit for bit on the CUDA emulator
//! and the models' losses there, and Hugging Face directories (their names, their
//! config.json) that reload bitwise.

use crate::common;

use common::{corpus_loader, cpu, grads, randn, scratch, values};
use std::sync::Arc;
use trainkit::device::cuda::CudaBackend;
use trainkit::model::read_model_dir;
use trainkit::model::{Family, Rope, RopeScaling};
use trainkit::ops::qk_norm;
use trainkit::ops::Heads;
use trainkit::{
    AdamW, Backend, CheckpointPolicy, CpuBackend, DType, Fp32, Full, LlamaConfig, MemoryCategory,
    MixedBf16, Model, ModelConfig, NoRecompute, Precision, Qwen2, Qwen2Config, Qwen3, Qwen3Config,
    Rng, Selective, Tensor, Trainer,
};

/// A small Llama-like base: 2 layers, 32 wide, 4 query heads of `head_dim` sharing 2
/// key/value heads, an MLP of 48, bytes.
fn base(head_dim: usize, tied: bool) -> LlamaConfig {
    LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim,
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tied,
        initializer_range: 0.1,
        rope: Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
    }
}

fn qwen2(tied: bool) -> Qwen2Config {
    Qwen2Config {
        base: base(8, tied),
    }
}

/// Heads of 16, twice hidden / heads, as Qwen3's 128 against 64.
fn qwen3(tied: bool) -> Qwen3Config {
    Qwen3Config {
        base: base(16, tied),
        attention_bias: false,
    }
}

/// Both families, boxed, with a name.
fn models() -> Vec<(&'static str, ModelConfig)> {
    vec![
        ("qwen2 tied", qwen2(true).into()),
        ("qwen2 untied", qwen2(false).into()),
        ("qwen3 tied", qwen3(true).into()),
        ("qwen3 untied", qwen3(false).into()),
    ]
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Every parameter's gradient (a few elements of each, the biases and the q/k norm gains
/// included) against central differences of the loss.
#[test]
fn gradients_match_finite_differences() {
    for (what, config) in models() {
        let (b, t) = (2, 12);
        let batch = corpus_loader(4_000, 7, b, t).next_batch();
        let mut trainer = common::gradient_probe(config.build().unwrap(), b, t);
        trainer.step().unwrap();
        let g = grads(&trainer);
        let names: Vec<String> = trainer.params().iter().map(|p| p.name().into()).collect();
        for name in [
            "self_attn.qkv_proj.bias",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ] {
            let has = names.iter().any(|n| n.ends_with(name));
            let want = match name {
                "self_attn.qkv_proj.bias" => what.starts_with("qwen2"),
                _ => what.starts_with("qwen3"),
            };
            assert_eq!(has, want, "{what}: {name} in {names:?}");
        }
        for i in 0..names.len() {
            let n = g[i].len();
            let at = if names[i] == "model.embed_tokens.weight" {
                batch.inputs[3] as usize * 32 + 5
            } else {
                (i * 7 + 3) % n
            };
            let analytic = g[i][at] as f64;
            common::check_central_difference(what, &mut trainer, &batch, (i, at), analytic);
        }
    }
}

type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f64>);

fn run(
    config: &ModelConfig,
    be: Arc<dyn Backend>,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
) -> Run {
    let mut t = Trainer::builder(config.build().unwrap(), be, corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(policy)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (grads(&t), values(&t), losses)
}

/// Recomputation changes memory, never results, in f32 and bf16 alike.
#[test]
fn every_policy_is_bitwise_equal_in_both_precisions() {
    for (what, config) in models() {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: true }),
        ] {
            let (g0, v0, l0) = run(&config, cpu(), precision.clone(), Box::new(NoRecompute));
            assert!(l0.iter().all(|l| l.is_finite() && *l > 0.0));
            for policy in [
                Box::new(Full) as Box<dyn CheckpointPolicy>,
                Box::new(Selective),
            ] {
                let what = format!("{what} {precision:?} {policy:?}");
                let (g, v, l) = run(&config, cpu(), precision.clone(), policy);
                assert_eq!(l, l0, "{what}: losses");
                assert!(bits(&g) == bits(&g0), "{what}: gradients");
                assert!(bits(&v) == bits(&v0), "{what}: updated weights");
            }
        }
    }
}

/// The meta backend's prediction equals the ledger, category by category.
#[test]
fn the_exact_prediction_equals_the_ledger() {
    let policies = [
        Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
        Box::new(Selective),
        Box::new(Full),
    ];
    for (what, config) in models() {
        common::prediction_equals_ledger(what, &|| config.build().unwrap(), &policies);
    }
}

fn emulated() -> Option<CudaBackend> {
    match CudaBackend::emulated() {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}");
            }
            eprintln!("qwen: CUDA emulator check SKIPPED: {e}");
            None
        }
    }
}

/// The q/k norm forward and backward on `be`: out, rstd, dx, dwq, dwk.
fn qk_norm_on(be: &dyn Backend, heads: Heads, tokens: usize, dt: DType) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(5);
    let width = heads.qkv_width();
    let d = heads.head_dim;
    let up = |v: &[f32], shape: &[usize], dt: DType| -> Tensor {
        be.upload(v, shape, dt, MemoryCategory::Workspace, "t")
            .unwrap()
    };
    let x = up(&randn(&mut rng, tokens * width, 1.0), &[tokens, width], dt);
    let wq = up(&randn(&mut rng, d, 0.5), &[d], dt);
    let wk = up(&randn(&mut rng, d, 0.5), &[d], dt);
    let dy = up(&randn(&mut rng, tokens * width, 1.0), &[tokens, width], dt);
    let qk = heads.n_head + heads.n_kv_head;
    let mut out = up(&vec![0.0; tokens * width], &[tokens, width], dt);
    let mut rstd = up(&vec![0.0; tokens * qk], &[tokens, qk], DType::F32);
    qk_norm::forward(be, &mut out, &mut rstd, &x, &wq, &wk, heads, 1e-6).unwrap();
    let mut dx = up(&randn(&mut rng, tokens * width, 1.0), &[tokens, width], dt);
    let mut dwq = up(&vec![0.25; d], &[d], DType::F32);
    let mut dwk = up(&vec![-0.5; d], &[d], DType::F32);
    qk_norm::backward(
        be, &mut dx, &mut dwq, &mut dwk, &dy, &x, &wq, &wk, &rstd, heads,
    )
    .unwrap();
    [&out, &rstd, &dx, &dwq, &dwk]
        .iter()
        .map(|t| be.to_f32(t).unwrap())
        .collect()
}

/// The q/k norm's CUDA kernels on the emulator give the CPU twin's results bit for bit,
/// in f32, bf16 and f16, with grouped-query heads and more rows than a block of the
/// gain gradient.
#[test]
fn the_qk_norm_kernels_match_the_cpu_bit_for_bit_on_the_emulator() {
    let Some(emu) = emulated() else { return };
    let cpu = CpuBackend::new();
    for (heads, tokens) in [
        (
            Heads {
                n_head: 4,
                n_kv_head: 2,
                head_dim: 16,
            },
            70,
        ),
        (
            Heads {
                n_head: 2,
                n_kv_head: 1,
                head_dim: 40,
            },
            9,
        ),
    ] {
        for dt in [DType::F32, DType::Bf16, DType::F16] {
            let want = qk_norm_on(&cpu, heads, tokens, dt);
            let got = qk_norm_on(&emu, heads, tokens, dt);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{heads:?} {dt:?}: output {i} differs"
                );
            }
        }
    }
}

/// The value heads pass through the q/k norm, and each query and key head comes out with
/// unit mean square times its gain.
#[test]
fn the_qk_norm_normalises_query_and_key_heads_only() {
    let cpu = CpuBackend::new();
    let heads = Heads {
        n_head: 2,
        n_kv_head: 1,
        head_dim: 8,
    };
    let tokens = 3;
    let mut rng = Rng::new(9);
    let width = heads.qkv_width();
    let xs = randn(&mut rng, tokens * width, 2.0);
    let up = |v: &[f32], shape: &[usize]| -> Tensor {
        cpu.upload(v, shape, DType::F32, MemoryCategory::Workspace, "t")
            .unwrap()
    };
    let x = up(&xs, &[tokens, width]);
    let (wq, wk) = (up(&[2.0; 8], &[8]), up(&[3.0; 8], &[8]));
    let mut out = up(&vec![0.0; tokens * width], &[tokens, width]);
    let mut rstd = up(&vec![0.0; tokens * 3], &[tokens, 3]);
    qk_norm::forward(&cpu, &mut out, &mut rstd, &x, &wq, &wk, heads, 1e-6).unwrap();
    let out = cpu.to_f32(&out).unwrap();
    for t in 0..tokens {
        for j in 0..4 {
            let at = t * width + j * 8;
            let row = &out[at..at + 8];
            if j == 3 {
                assert_eq!(row, &xs[at..at + 8], "value head of token {t}");
                continue;
            }
            let gain = if j < 2 { 2.0 } else { 3.0 };
            let ms: f64 = row.iter().map(|v| (*v as f64 / gain).powi(2)).sum::<f64>() / 8.0;
            assert!((ms - 1.0).abs() < 1e-4, "token {t} head {j}: {ms}");
        }
    }
    // A projection whose width is not (H + 2·KV)·D is an error naming the op.
    let bad = up(&[0.0; 10], &[1, 10]);
    let mut o = up(&[0.0; 10], &[1, 10]);
    let e = qk_norm::forward(&cpu, &mut o, &mut rstd, &bad, &wq, &wk, heads, 1e-6)
        .unwrap_err()
        .to_string();
    assert!(e.contains("qk_norm"), "{e}");
}

/// On the emulator, both families give the CPU's losses, in f32 and in bf16.
#[test]
fn both_families_on_the_emulator_track_the_cpu() {
    if emulated().is_none() {
        return;
    }
    let emu = || Arc::new(emulated().unwrap()) as Arc<dyn Backend>;
    for (what, config) in [
        ("qwen2", qwen2(false).into()),
        ("qwen3", qwen3(true).into()),
    ] {
        let config: ModelConfig = config;
        for (precision, tol) in [
            (Box::new(Fp32) as Box<dyn Precision>, 1e-5),
            (Box::new(MixedBf16::default()), 1e-3),
        ] {
            let (_, _, want) = run(&config, cpu(), precision.clone(), Box::new(NoRecompute));
            let (_, _, got) = run(&config, emu(), precision.clone(), Box::new(NoRecompute));
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    ((g - w) / w).abs() < tol,
                    "{what} {precision:?}: loss {g} vs {w}"
                );
            }
        }
    }
}

/// A trained model saved as a Hugging Face directory: Hugging Face's names (separate q, k,
/// v projections with their biases, the q/k norm gains), the family's config.json, and
/// weights that reload bitwise.
#[test]
fn hugging_face_directories_round_trip() {
    for (what, config) in models() {
        let mut t = Trainer::builder(config.build().unwrap(), cpu(), {
            corpus_loader(8_000, 3, 2, 16)
        })
        .build()
        .unwrap();
        t.step().unwrap();
        let dir = scratch(&format!("qwen-dir-{}", what.replace(' ', "-")));
        t.save(&dir, None).unwrap();
        let loaded = read_model_dir(&dir).unwrap();
        assert_eq!(loaded.config, config, "{what}");
        let config_json = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let (names, architecture) = match (config.get::<Qwen2Config>(), config.get::<Qwen3Config>())
        {
            (Some(c), _) => {
                assert_eq!(&Qwen2Config::from_json(&config_json).unwrap(), c);
                let b = "model.layers.1.self_attn";
                (
                    vec![
                        format!("{b}.q_proj.bias"),
                        format!("{b}.k_proj.bias"),
                        format!("{b}.v_proj.bias"),
                        format!("{b}.v_proj.weight"),
                    ],
                    "Qwen2ForCausalLM",
                )
            }
            (_, Some(c)) => {
                assert_eq!(&Qwen3Config::from_json(&config_json).unwrap(), c);
                let b = "model.layers.0.self_attn";
                (
                    vec![
                        format!("{b}.q_norm.weight"),
                        format!("{b}.k_norm.weight"),
                        format!("{b}.q_proj.weight"),
                    ],
                    "Qwen3ForCausalLM",
                )
            }
            _ => panic!("{config:?}"),
        };
        assert!(config_json.contains(architecture), "{config_json}");
        for name in &names {
            assert!(loaded.tensors.contains_key(name), "{what}: {name}");
        }
        let shape = config.family().shape();
        let kv_width = shape.kv_heads * shape.head_dim;
        assert_eq!(
            loaded.tensors["model.layers.0.self_attn.k_proj.weight"].shape(),
            vec![kv_width, 32]
        );
        assert_eq!(
            loaded.tensors["model.layers.0.self_attn.o_proj.weight"].shape(),
            vec![32, shape.heads * shape.head_dim]
        );
        let mut back = Trainer::builder(config.build().unwrap(), cpu(), {
            corpus_loader(8_000, 9, 2, 16)
        })
        .build()
        .unwrap();
        back.load_weights(&loaded).unwrap();
        assert!(
            bits(&values(&back)) == bits(&values(&t)),
            "{what}: reloaded"
        );
    }
}

/// Published configs parse: Qwen2.5 0.5B and Qwen3 0.6B as their config.json files say
/// (Qwen3's head_dim defaulting to 128), equal to the presets; what trainkit cannot build
/// is refused by name.
#[test]
fn published_configs_parse_and_match_the_presets() {
    let qwen2_5 = r#"{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936}"#;
    let c = Qwen2Config::from_json(qwen2_5).unwrap();
    assert_eq!(
        ModelConfig::new(c),
        ModelConfig::preset("qwen2.5-0.5b").unwrap()
    );
    let qwen3_06 = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936}"#;
    let c = Qwen3Config::from_json(qwen3_06).unwrap();
    assert_eq!(c.base.head_dim, 128);
    assert_eq!(
        ModelConfig::new(c.clone()),
        ModelConfig::preset("qwen3-0.6b").unwrap()
    );
    let no_head_dim = qwen3_06.replace("\"head_dim\": 128,", "");
    assert_eq!(Qwen3Config::from_json(&no_head_dim).unwrap(), c);
    // transformers 5's rope_parameters.
    let v5 = qwen3_06.replace(
        "\"rope_theta\": 1000000,",
        "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0},",
    );
    assert_eq!(Qwen3Config::from_json(&v5).unwrap(), c);
    for (text, needle) in [
        (
            qwen2_5.replace(
                "\"use_sliding_window\": false",
                "\"use_sliding_window\": true",
            ),
            "use_sliding_window",
        ),
        (qwen2_5.replace("\"silu\"", "\"gelu\""), "hidden_act"),
        (qwen2_5.replace("\"qwen2\"", "\"qwen3\""), "qwen2"),
    ] {
        let e = Qwen2Config::from_json(&text).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
    // The registry reads each family by its model_type.
    let dir = scratch("qwen-config-only");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), qwen3_06).unwrap();
    assert_eq!(
        trainkit::model::read_model_config(&dir).unwrap().arch(),
        "qwen3"
    );
    // The shape the family describes.
    let shape = Family::shape(&c);
    assert!(shape.qk_norm && !shape.bias.any());
    assert_eq!((shape.heads, shape.head_dim, shape.hidden), (16, 128, 1024));
}

/// The models train: a few steps lower the loss, and the described model names its
/// family.
#[test]
fn training_lowers_the_loss() {
    for model in [
        Box::new(Qwen2::new(qwen2(true)).unwrap()) as Box<dyn Model>,
        Box::new(Qwen3::new(qwen3(false)).unwrap()),
    ] {
        let name = model.describe();
        assert!(name.starts_with("qwen"), "{name}");
        let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 2, 4, 16))
            .optimizer(AdamW {
                lr: 3e-3,
                ..AdamW::default()
            })
            .build()
            .unwrap();
        let losses: Vec<f64> = (0..8).map(|_| t.step().unwrap().loss).collect();
        assert!(losses[7] < losses[0] - 0.3, "{name}: {losses:?}");
    }
}
