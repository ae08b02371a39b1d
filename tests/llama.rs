//! The Llama family: the whole model's gradients against finite differences (grouped-query
//! attention, rotary embeddings with scaling, SwiGLU, RMSNorm, tied and untied heads),
//! every recompute policy bitwise equal in both precisions, the exact memory prediction
//! equal to the ledger, and Hugging Face directories (separate q/k/v and gate/up tensors,
//! single files and shards) that reload bitwise.

use crate::common;

use common::{corpus_loader, cpu, grads, scratch, values};
use std::collections::BTreeMap;
use trainkit::estimate::{predict, MicroBatch};
use trainkit::model::read_model_dir;
use trainkit::model::{Rope, RopeScaling};
use trainkit::save::{write_safetensors, NamedTensor, StoredTensor};
use trainkit::{
    AdamW, CheckpointPolicy, Constant, Full, Llama, LlamaConfig, MixedBf16, Model, NoRecompute,
    Precision, Selective, Trainer,
};

/// A small Llama: 2 layers, 32 wide, 4 query heads of 8 sharing `kv` key/value heads, an
/// MLP of 48, bytes, llama3 rope scaling.
fn tiny(kv: usize, tied: bool) -> LlamaConfig {
    LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: kv,
        head_dim: 8,
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        initializer_range: 0.1,
        rope: Rope {
            theta: 500.0,
            scaling: RopeScaling::Llama3 {
                factor: 4.0,
                low_freq_factor: 1.0,
                high_freq_factor: 2.0,
                original_max_position_embeddings: 16.0,
            },
        },
    }
}

/// The gradient of one step against central differences of the mean loss on the same
/// batch, at coordinates of every kind of parameter.
#[test]
fn gradients_match_finite_differences() {
    for (kv, tied) in [(2, false), (1, true), (4, true)] {
        let config = tiny(kv, tied);
        let (b, t) = (2, 12);
        let batch = corpus_loader(4_000, 7, b, t).next_batch();
        let mut trainer = common::gradient_probe(Llama::new(config.clone()).unwrap(), b, t);
        trainer.step().unwrap();
        let g = grads(&trainer);
        let names: Vec<String> = trainer.params().iter().map(|p| p.name().into()).collect();
        let heads = config.heads();
        let c = config.hidden_size;
        // (parameter, row): the q, k and v rows of the fused projection, gate and up rows.
        let mut probes = vec![
            ("model.embed_tokens.weight", batch.inputs[3] as usize),
            ("model.layers.0.input_layernorm.weight", 0),
            ("model.layers.0.self_attn.qkv_proj.weight", 1),
            (
                "model.layers.0.self_attn.qkv_proj.weight",
                heads.q_width() + 2,
            ),
            (
                "model.layers.1.self_attn.qkv_proj.weight",
                heads.q_width() + heads.kv_width() + 3,
            ),
            ("model.layers.1.self_attn.o_proj.weight", 5),
            ("model.layers.1.post_attention_layernorm.weight", 0),
            ("model.layers.0.mlp.gate_up_proj.weight", 4),
            ("model.layers.0.mlp.gate_up_proj.weight", 48 + 4),
            ("model.layers.1.mlp.down_proj.weight", 7),
            ("model.norm.weight", 0),
        ];
        if !tied {
            probes.push(("lm_head.weight", batch.targets[0] as usize));
        }
        for (name, row) in probes {
            let i = names.iter().position(|n| n == name).unwrap();
            let cols = trainer.params()[i].shape().last().copied().unwrap();
            let at = if cols == c && trainer.params()[i].shape().len() == 2 {
                row * cols + 3
            } else {
                row * cols + row % cols.max(1)
            };
            let what = format!("kv {kv} tied {tied}");
            let analytic = g[i][at] as f64;
            common::check_central_difference(&what, &mut trainer, &batch, (i, at), analytic);
        }
    }
}

type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f64>);

fn run(
    config: &LlamaConfig,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
    micro_batches: usize,
) -> Run {
    let mut t = Trainer::builder(
        Llama::new(config.clone()).unwrap(),
        cpu(),
        corpus_loader(20_000, 1, 2, 16),
    )
    .precision(precision)
    .checkpoint(policy)
    .accumulation(Constant::new(micro_batches))
    .build()
    .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (grads(&t), values(&t), losses)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Recomputation changes memory, never results, in f32 and bf16 alike, with one, two and
/// all key/value heads and with accumulation.
#[test]
fn every_policy_is_bitwise_equal_in_both_precisions() {
    let precisions: [Box<dyn Precision>; 2] = [
        Box::new(trainkit::Fp32),
        Box::new(MixedBf16 { fp32_grads: true }),
    ];
    for kv in [1, 2, 4] {
        let config = tiny(kv, kv != 2);
        for precision in &precisions {
            for micro_batches in [1, 2] {
                let (g0, v0, l0) = run(
                    &config,
                    precision.clone(),
                    Box::new(NoRecompute),
                    micro_batches,
                );
                assert!(l0.iter().all(|l| l.is_finite() && *l > 0.0));
                for policy in [
                    Box::new(Full) as Box<dyn CheckpointPolicy>,
                    Box::new(Selective),
                ] {
                    let what = format!("kv {kv} {precision:?} {policy:?} k={micro_batches}");
                    let (g, v, l) = run(&config, precision.clone(), policy, micro_batches);
                    assert_eq!(l, l0, "{what}: losses");
                    assert!(bits(&g) == bits(&g0), "{what}: gradients");
                    assert!(bits(&v) == bits(&v0), "{what}: updated weights");
                }
            }
        }
    }
}

/// The meta backend's prediction equals the ledger, category by category.
#[test]
fn the_exact_prediction_equals_the_ledger() {
    let policies: [Box<dyn CheckpointPolicy>; 3] =
        [Box::new(NoRecompute), Box::new(Selective), Box::new(Full)];
    for (kv, tied) in [(2, false), (1, true)] {
        let config = tiny(kv, tied);
        for precision in [
            Box::new(trainkit::Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: false }),
        ] {
            for policy in &policies {
                let what = format!("kv {kv} {precision:?} {policy:?}");
                let predicted = predict(
                    Box::new(Llama::new(config.clone()).unwrap()),
                    MicroBatch {
                        batch_size: 2,
                        seq_len: 16,
                    },
                    precision.as_ref(),
                    policy.as_ref(),
                    &AdamW::default(),
                )
                .unwrap();
                let mut t = Trainer::builder(
                    Llama::new(config.clone()).unwrap(),
                    cpu(),
                    corpus_loader(8_000, 3, 2, 16),
                )
                .precision(precision.clone())
                .checkpoint(policy.clone())
                .build()
                .unwrap();
                for step in 1..=2 {
                    let s = t.step().unwrap();
                    common::step_matches_prediction(&s, &predicted, step, 1, &what);
                }
            }
        }
    }
}

/// A trained model saved as a Hugging Face directory: separate projections under their
/// Hugging Face names, a Llama config.json, and weights that reload bitwise, from one file
/// or from shards; a missing projection is refused by name.
#[test]
fn hugging_face_directories_round_trip() {
    for tied in [true, false] {
        let config = tiny(2, tied);
        let mut t = Trainer::builder(
            Llama::new(config.clone()).unwrap(),
            cpu(),
            corpus_loader(8_000, 3, 2, 16),
        )
        .build()
        .unwrap();
        t.step().unwrap();
        let dir = scratch(&format!("llama-dir-{tied}"));
        t.save(&dir, None).unwrap();
        let loaded = read_model_dir(&dir).unwrap();
        assert_eq!(loaded.config, trainkit::ModelConfig::new(config.clone()));
        let names: Vec<&String> = loaded.tensors.keys().collect();
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.1.mlp.gate_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
        ] {
            assert!(loaded.tensors.contains_key(name), "{name} in {names:?}");
        }
        assert_eq!(
            loaded.tensors["model.layers.0.self_attn.k_proj.weight"].shape(),
            [16, 32]
        );
        assert_eq!(loaded.tensors.contains_key("lm_head.weight"), !tied);
        let config_json = std::fs::read_to_string(dir.join("config.json")).unwrap();
        assert_eq!(LlamaConfig::from_json(&config_json).unwrap(), config);

        let fresh = || {
            Trainer::builder(
                Llama::new(config.clone()).unwrap(),
                cpu(),
                corpus_loader(8_000, 9, 2, 16),
            )
            .build()
            .unwrap()
        };
        let mut back = fresh();
        back.load_weights(&loaded).unwrap();
        assert!(
            bits(&values(&back)) == bits(&values(&t)),
            "reloaded weights"
        );

        // The same tensors in two shards with an index, as transformers writes them.
        let sharded = scratch(&format!("llama-sharded-{tied}"));
        std::fs::create_dir_all(&sharded).unwrap();
        std::fs::copy(dir.join("config.json"), sharded.join("config.json")).unwrap();
        let all: Vec<NamedTensor> = loaded
            .tensors
            .values()
            .map(StoredTensor::read)
            .collect::<Result<_, _>>()
            .unwrap();
        let (a, b) = all.split_at(all.len() / 2);
        let mut map = BTreeMap::new();
        for (file, part) in [
            ("model-00001-of-00002.safetensors", a),
            ("model-00002-of-00002.safetensors", b),
        ] {
            write_safetensors(&sharded.join(file), part, None).unwrap();
            for t in part {
                map.insert(t.name.clone(), file);
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(
            sharded.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let mut from_shards = fresh();
        from_shards
            .load_weights(&read_model_dir(&sharded).unwrap())
            .unwrap();
        assert!(bits(&values(&from_shards)) == bits(&values(&t)), "shards");

        // Trained on from the shards in bf16 with selective recomputation, saved, and
        // reloaded bitwise.
        let mut tuned = Trainer::builder(
            Llama::new(config.clone()).unwrap(),
            cpu(),
            corpus_loader(8_000, 4, 2, 16),
        )
        .precision(MixedBf16 { fp32_grads: false })
        .checkpoint(Selective)
        .build()
        .unwrap();
        tuned
            .load_weights(&read_model_dir(&sharded).unwrap())
            .unwrap();
        tuned.step().unwrap();
        let tuned_dir = scratch(&format!("llama-tuned-{tied}"));
        tuned.save(&tuned_dir, None).unwrap();
        let mut again = fresh();
        again
            .load_weights(&read_model_dir(&tuned_dir).unwrap())
            .unwrap();
        assert!(
            bits(&values(&again)) == bits(&values(&tuned)),
            "bf16 fine-tune reloaded"
        );
        let _ = std::fs::remove_dir_all(&tuned_dir);

        // A missing projection is named.
        std::fs::remove_file(sharded.join("model-00002-of-00002.safetensors")).unwrap();
        write_safetensors(
            &sharded.join("model-00002-of-00002.safetensors"),
            &b.iter()
                .filter(|t| !t.name.ends_with("up_proj.weight"))
                .cloned()
                .collect::<Vec<_>>(),
            None,
        )
        .unwrap();
        let e = read_model_dir(&sharded).unwrap_err().to_string();
        assert!(e.contains("up_proj"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&sharded);
    }
}

/// A small Llama learns the built-in corpus.
#[test]
fn training_lowers_the_loss() {
    let model = Llama::new(tiny(2, true)).unwrap();
    assert!(model.describe().contains("llama"));
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 5, 4, 32))
        .optimizer(AdamW {
            lr: 3e-3,
            ..AdamW::default()
        })
        .build()
        .unwrap();
    let first = t.step().unwrap().loss;
    let mut last = first;
    for _ in 0..40 {
        last = t.step().unwrap().loss;
    }
    assert!(last < 0.7 * first, "loss {first} → {last}");
}

/// The fused linear cross-entropy against the materialized logits on Llama's head, tied and
/// untied: loss and every gradient within f32 1e-5 relative, in one chunk and in several.
#[test]
fn the_fused_loss_matches_the_materialized_head() {
    use trainkit::ops::LossPath;
    let run = |tied: bool, path: LossPath, chunk: Option<usize>| {
        let model = Llama::new(tiny(2, tied))
            .unwrap()
            .with_loss(path, chunk)
            .unwrap();
        let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 3, 2, 16))
            .build()
            .unwrap();
        let loss = t.step().unwrap().loss;
        (loss, grads(&t))
    };
    for tied in [true, false] {
        let (l0, g0) = run(tied, LossPath::Materialized, None);
        for chunk in [None, Some(5)] {
            let (l, g) = run(tied, LossPath::Fused, chunk);
            assert!(((l - l0) / l0).abs() < 1e-5, "tied {tied} {chunk:?}: loss");
            for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
                assert!(
                    err < 1e-5,
                    "tied {tied} {chunk:?}: gradient {i} off by {err}"
                );
            }
        }
    }
}

/// A vocabulary of 200 is held padded to 256 rows (a multiple of 64), tied or not, for
/// either loss path: the padding rows start at zero; whatever they hold changes neither
/// the loss nor any other gradient bit, nor the logits (200 wide); they get no gradient;
/// files keep 200 rows and reload padded with zeros; a token of the padding is refused.
#[test]
fn the_padded_vocabulary_stays_out_of_loss_logits_and_files() {
    use trainkit::ops::LossPath;
    let (v, vp, c) = (200, 256, 32);
    let tokens: Vec<u32> = (0..4_000u32).map(|i| (i * 37 + i / 7) % 200).collect();
    for tied in [true, false] {
        for path in [LossPath::Fused, LossPath::Materialized] {
            let config = LlamaConfig {
                vocab_size: v,
                ..tiny(2, tied)
            };
            let make = || {
                let model = Llama::new(config.clone())
                    .unwrap()
                    .with_loss(path, None)
                    .unwrap();
                let data = trainkit::data::DataLoader::new(tokens.clone(), 2, 16).unwrap();
                Trainer::builder(model, cpu(), data)
                    .optimizer(trainkit::Sgd {
                        lr: 0.1,
                        momentum: 0.0,
                        weight_decay: 0.0,
                    })
                    .build()
                    .unwrap()
            };
            let (mut plain, mut filled) = (make(), make());
            let padded: Vec<usize> = (0..plain.params().len())
                .filter(|&i| plain.params()[i].shape()[0] == vp)
                .collect();
            assert_eq!(padded.len(), if tied { 1 } else { 2 });
            let be = cpu();
            let initial = values(&plain);
            for &i in &padded {
                let w = &initial[i];
                assert_eq!(plain.params()[i].shape(), [vp, c]);
                assert!(w[v * c..].iter().all(|&x| x == 0.0), "padding starts at 0");
                let mut garbage = w.clone();
                for (j, x) in garbage[v * c..].iter_mut().enumerate() {
                    *x = 1e3 * ((j % 7) as f32 - 3.0);
                }
                filled.params_mut()[i]
                    .set_value(be.as_ref(), &garbage)
                    .unwrap();
            }
            let (a, b) = (plain.step().unwrap(), filled.step().unwrap());
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "tied {tied}, {path:?}");
            let (ga, gb) = (grads(&plain), grads(&filled));
            for (i, (ga, gb)) in ga.iter().zip(&gb).enumerate() {
                if padded.contains(&i) {
                    assert_eq!(ga[..v * c], gb[..v * c], "tied {tied}, {path:?}");
                    assert!(ga[v * c..].iter().chain(&gb[v * c..]).all(|&g| g == 0.0));
                } else {
                    assert_eq!(ga, gb, "tied {tied}, {path:?}, parameter {i}");
                }
            }
            let row = &tokens[..16];
            let logits = plain.logits(row).unwrap();
            assert_eq!(logits.len(), 16 * v);
            let other = filled.logits(row).unwrap();
            assert_eq!(logits, other, "tied {tied}, {path:?}");
            let e = plain.logits(&[3, 230]).unwrap_err().to_string();
            assert!(e.contains("token id 230") && e.contains("200"), "{e}");

            let dir = scratch(&format!("llama-padded-{tied}-{path:?}"));
            filled.save(&dir, None).unwrap();
            let files = trainkit::save::read_safetensors(&dir.join("model.safetensors")).unwrap();
            let rows: Vec<usize> = files
                .iter()
                .filter(|t| t.name.contains("embed_tokens") || t.name.contains("lm_head"))
                .map(|t| t.shape[0])
                .collect();
            assert_eq!(rows, vec![v; padded.len()]);
            let mut again = make();
            again.load_weights(&read_model_dir(&dir).unwrap()).unwrap();
            let (saved, loaded) = (values(&filled), values(&again));
            for &i in &padded {
                assert_eq!(saved[i][..v * c], loaded[i][..v * c]);
                assert!(loaded[i][v * c..].iter().all(|&x| x == 0.0));
            }
        }
    }
}
