//! DoRA (PEFT's `use_dora`) on the shared decoder: an untrained DoRA adapter is the base
//! model, every gradient equals central differences of the loss once the norm's own
//! derivative (detached, as PEFT detaches it) is added back, recomputation changes
//! nothing, the exact prediction equals the ledger, the CLI trains, saves (PEFT's files),
//! resumes and merges a DoRA adapter, and what DoRA cannot do is refused by name.

use crate::common;

use common::{corpus_loader, cpu, gradient_probe, per_param, tiny_config, values};
use std::sync::Arc;
use trainkit::{
    Adapter, CheckpointPolicy, Fp32, Full, Gpt2, Llama, Lora, MixedBf16, Model, NoRecompute,
    Precision, Selective, Trainer,
};

/// The models DoRA is tested on: Llama with blocks of both fused projections (q and v of
/// q/k/v, the gate of gate/up) and plain ones, and GPT-2 (`Conv1D` weights stored
/// `[in, out]`, biases, the GELU and residual projections).
const MODELS: [&str; 2] = ["llama", "gpt2"];

fn dora(targets: &[&str]) -> Lora {
    Lora {
        dora: true,
        ..Lora::new(4, 8.0, targets).unwrap()
    }
}

fn base(what: &str) -> Box<dyn Model> {
    match what {
        "llama" => Box::new(Llama::new(common::tiny_llama_config()).unwrap()),
        _ => Box::new(Gpt2::new(tiny_config()).unwrap()),
    }
}

fn adapter(what: &str) -> Arc<dyn Adapter> {
    Arc::new(match what {
        "llama" => dora(&["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
        _ => dora(&["c_attn", "c_proj", "c_fc"]),
    })
}

fn model(what: &str) -> Box<dyn Model> {
    base(what).with_adapter(adapter(what)).unwrap()
}

/// `what`'s DoRA adapter (or LoRA's, without `dora`) with dropout `p`.
fn dropout_model(what: &str, p: f64, dora: bool) -> Box<dyn Model> {
    let lora = adapter(what).as_lora().unwrap().clone();
    let lora = Lora {
        dropout: p,
        dora,
        ..lora
    };
    base(what).with_adapter(Arc::new(lora)).unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// The magnitudes start at the norms of the base rows: the adapted model is the base
/// model (bitwise for Llama; GPT-2's bias is taken out and added back around the scaling).
#[test]
fn an_untrained_dora_adapter_is_the_base_model() {
    for what in MODELS {
        let batch = corpus_loader(4_000, 7, 2, 12).next_batch();
        let loader = || corpus_loader(4_000, 7, 2, 12);
        let mut plain = Trainer::builder(base(what), cpu(), loader())
            .build()
            .unwrap();
        let mut adapted = Trainer::builder(model(what), cpu(), loader())
            .build()
            .unwrap();
        let (a, b) = (
            plain.loss_on(&batch).unwrap(),
            adapted.loss_on(&batch).unwrap(),
        );
        if what == "llama" {
            assert_eq!(a.to_bits(), b.to_bits(), "{what}");
        } else {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{what}: {a} against {b}");
        }
        // Every magnitude is its row's norm, and none is zero.
        let m = adapted.model().magnitudes();
        assert!(!m.is_empty(), "{what}");
        for m in m {
            let v = adapted
                .backend()
                .to_f32(adapted.params()[m.param].value())
                .unwrap();
            assert_eq!(v.len(), m.block.width, "{what}");
            assert!(v.iter().all(|x| *x > 0.0), "{what}");
        }
    }
}

/// Host copies of one DoRA update's tensors: the base block's rows `V = W + s·B·A` and
/// their norms.
struct Update {
    a: Vec<f32>,
    b: Vec<f32>,
    m: Vec<f32>,
    rank: usize,
    in_features: usize,
    scale: f64,
    /// `V`, `[width, in]`, in f64.
    v: Vec<f64>,
    /// `‖V_c‖`.
    n: Vec<f64>,
}

fn update(values: &[Vec<f32>], m: &trainkit::model::Magnitude) -> Update {
    let (w, a, b) = (&values[m.weight], &values[m.a], &values[m.b]);
    let blk = m.block;
    let (width, inf) = (blk.width, blk.in_features);
    let rank = a.len() / inf;
    let scale = f64::from(m.scale);
    let out = w.len() / inf;
    let mut v = vec![0f64; width * inf];
    for c in 0..width {
        for i in 0..inf {
            let wi = if blk.transposed {
                (blk.offset + c) * inf + i
            } else {
                i * out + blk.offset + c
            };
            let ba: f64 = (0..rank)
                .map(|k| f64::from(b[c * rank + k]) * f64::from(a[k * inf + i]))
                .sum();
            v[c * inf + i] = f64::from(w[wi]) + scale * ba;
        }
    }
    let n = (0..width)
        .map(|c| {
            v[c * inf..(c + 1) * inf]
                .iter()
                .map(|x| x * x)
                .sum::<f64>()
                .sqrt()
        })
        .collect();
    Update {
        a: a.clone(),
        b: b.clone(),
        m: values[m.param].clone(),
        rank,
        in_features: inf,
        scale,
        v,
        n,
    }
}

/// Every trained parameter's gradient (the `B`s and the magnitudes moved off their
/// starting values first) against central differences of the loss. The differences see
/// the norm move with `A` and `B`, the gradient does not (PEFT detaches it), so the
/// norm's own share is added to the analytic value: with `∂L/∂n_c = −(m_c/n_c)·∂L/∂m_c`,
/// `B[c, k]` gains `∂L/∂n_c · s·(V_c · A_k)/n_c` and `A[k, i]` gains
/// `Σ_c ∂L/∂n_c · s·B[c, k]·V[c, i]/n_c`.
///
/// With dropout (PEFT's DoRA then runs the base on the dropped input too), the
/// differences are those of the training step's loss, with its masks.
#[test]
fn gradients_match_finite_differences_with_the_norm_detached() {
    for (what, p) in [("llama", 0.0), ("gpt2", 0.0), ("llama", 0.2), ("gpt2", 0.2)] {
        let (bsz, t) = (2, 12);
        let batch = corpus_loader(4_000, 7, bsz, t).next_batch();
        let mut trainer = gradient_probe(dropout_model(what, p, true), bsz, t);
        let be = trainer.backend().clone();
        let mut rng = trainkit::Rng::new(3);
        for p in trainer.params_mut() {
            let v = be.to_f32(p.value()).unwrap();
            let moved: Option<Vec<f32>> = if p.name().contains(".lora_B") {
                Some(v.iter().map(|_| (rng.normal() * 0.2) as f32).collect())
            } else if p.name().ends_with(".lora_magnitude_vector") {
                Some(
                    v.iter()
                        .map(|x| x * (1.0 + 0.3 * rng.normal() as f32))
                        .collect(),
                )
            } else {
                None
            };
            if let Some(v) = moved {
                p.set_value(be.as_ref(), &v).unwrap();
            }
        }
        trainer.step().unwrap();
        let g = per_param(&trainer, |p| p.grad().unwrap_or(p.value()));
        let vals = values(&trainer);
        let mut checks = Vec::new();
        for m in trainer.model().magnitudes() {
            let u = update(&vals, &m);
            let dn: Vec<f64> = (0..m.block.width)
                .map(|c| -f64::from(u.m[c]) / u.n[c] * f64::from(g[m.param][c]))
                .collect();
            let c = (m.param * 5 + 1) % m.block.width;
            checks.push(((m.param, c), f64::from(g[m.param][c])));
            // B[c, k]
            let (c, k) = ((m.b * 3 + 2) % m.block.width, m.b % u.rank);
            let dot: f64 = (0..u.in_features)
                .map(|i| u.v[c * u.in_features + i] * f64::from(u.a[k * u.in_features + i]))
                .sum();
            let at = c * u.rank + k;
            let analytic = f64::from(g[m.b][at]) + dn[c] * u.scale * dot / u.n[c];
            checks.push(((m.b, at), analytic));
            // A[k, i]
            let (k, i) = (m.a % u.rank, (m.a * 7 + 3) % u.in_features);
            let share: f64 = (0..m.block.width)
                .map(|c| {
                    dn[c] * u.scale * f64::from(u.b[c * u.rank + k]) * u.v[c * u.in_features + i]
                        / u.n[c]
                })
                .sum();
            let at = k * u.in_features + i;
            checks.push(((m.a, at), f64::from(g[m.a][at]) + share));
        }
        assert!(checks.len() >= 9, "{what}: {} checks", checks.len());
        let what = format!("{what} dropout {p}");
        for (spot, analytic) in checks {
            if p > 0.0 {
                common::check_central_difference_in_step(
                    &what,
                    &mut trainer,
                    &batch,
                    spot,
                    analytic,
                    1,
                );
            } else {
                common::check_central_difference(&what, &mut trainer, &batch, spot, analytic);
            }
        }
    }
}

fn run(
    what: &str,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
) -> (Vec<Vec<f32>>, Vec<f64>) {
    common::adapters::two_steps(model(what), precision, policy)
}

/// Recomputation changes memory, never results, and training moves the loss.
#[test]
fn every_policy_is_bitwise_equal_in_both_precisions() {
    for what in MODELS {
        for precision in [
            Box::new(Fp32) as Box<dyn Precision>,
            Box::new(MixedBf16 { fp32_grads: true }),
        ] {
            let (v0, l0) = run(what, precision.clone(), Box::new(NoRecompute));
            for policy in [
                Box::new(Full) as Box<dyn CheckpointPolicy>,
                Box::new(Selective),
            ] {
                let label = format!("{what} {precision:?} {policy:?}");
                let (v, l) = run(what, precision.clone(), policy);
                assert_eq!(l, l0, "{label}: losses");
                assert!(bits(&v) == bits(&v0), "{label}: updated weights");
            }
        }
    }
}

#[test]
fn the_exact_prediction_equals_the_ledger() {
    for what in MODELS {
        common::adapters::prediction_equals_ledger(what, &|| model(what));
    }
}

/// Dropout: at magnitudes equal to the norms (`g = 1`) the training step's loss is plain LoRA's
/// with the same masks (the base on the dropped input enters as `(g − 1)·z`), evaluation
/// takes no dropout, and the transient buffers are predicted.
#[test]
fn dropout_where_the_magnitudes_equal_the_norms_is_loras() {
    for what in MODELS {
        let batch = corpus_loader(4_000, 7, 2, 12).next_batch();
        let trainer = |dora| {
            let mut t = gradient_probe(dropout_model(what, 0.2, dora), 2, 12);
            // B non-zero, so that the dropped update is more than zeros.
            let be = t.backend().clone();
            let mut rng = trainkit::Rng::new(5);
            for p in t.params_mut() {
                if p.name().contains(".lora_B") {
                    let v: Vec<f32> = (0..p.numel())
                        .map(|_| (rng.normal() * 0.2) as f32)
                        .collect();
                    p.set_value(be.as_ref(), &v).unwrap();
                }
            }
            // The magnitudes at the norms of the rows with those B: g = 1 to f32 rounding.
            let vals = values(&t);
            for m in t.model().magnitudes() {
                let n: Vec<f32> = update(&vals, &m).n.iter().map(|x| *x as f32).collect();
                t.params_mut()[m.param].set_value(be.as_ref(), &n).unwrap();
            }
            t
        };
        let (mut lora, mut dora) = (trainer(false), trainer(true));
        let (a, b) = (
            lora.training_loss_on(&batch, 1, 0).unwrap(),
            dora.training_loss_on(&batch, 1, 0).unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-6 * a.abs(),
            "{what}: LoRA {a}, DoRA {b}"
        );
        let (c, d) = (
            dora.loss_on(&batch).unwrap(),
            dora.training_loss_on(&batch, 1, 0).unwrap(),
        );
        assert_ne!(c, d, "{what}: the dropout acted");
        common::adapters::prediction_equals_ledger(&format!("{what} dropout"), &|| {
            dropout_model(what, 0.2, true)
        });
    }
}

#[test]
fn what_dora_needs_is_asked_for_by_name() {
    let (ok, _, err) = common::trainkit(&["memory", "--model", "gpt2", "--use-dora"]);
    assert!(!ok && err.contains("--lora-rank"), "{err}");
}

/// `train --use-dora` writes PEFT's DoRA files (`use_dora`, a `lora_magnitude_vector` per
/// adapted module), `eval --adapter` reads them back, a resumed run continues them, and
/// `merge` bakes the magnitudes in: the merged model's loss is the adapter's, for
/// Llama's `[out, in]` weights and GPT-2's `[in, out]` ones.
#[test]
fn the_cli_trains_resumes_and_merges_a_dora_adapter() {
    let dir = common::scratch("dora-cli");
    let path = |p: &str| dir.join(p).display().to_string();
    let run = common::trainkit_ok;
    let small = common::SMALL_RUN;
    let text = common::small_text(&dir);
    let eval = |model: &str, adapter: Option<&str>| common::eval_in(&dir, &text, model, adapter);
    for (arch, targets) in [
        ("llama", "q_proj,v_proj,down_proj"),
        ("gpt2", "c_attn,c_fc"),
    ] {
        let (base, adapter) = (path(&format!("{arch}-base")), path(&format!("{arch}-dora")));
        let mut a = vec!["train", "--arch", arch, "--steps", "3", "--out", &base];
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
        let lora = [
            "train",
            "--init-from",
            &base,
            "--lora-rank",
            "4",
            "--lora-targets",
            targets,
            "--use-dora",
            "--lr",
            "1e-2",
            "--lr-schedule",
            "constant",
        ];
        run(&[&lora[..], &["--steps", "3", "--out", &adapter], &small[..]].concat());
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{arch}-dora/adapter_config.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(config["use_dora"], true, "{arch}");
        let names =
            common::safetensors_names(&dir.join(format!("{arch}-dora/adapter_model.safetensors")));
        let magnitudes = names
            .iter()
            .filter(|n| n.ends_with(".lora_magnitude_vector"))
            .count();
        let modules = names
            .iter()
            .filter(|n| n.ends_with(".lora_A.weight"))
            .count();
        assert!(magnitudes > 0 && magnitudes == modules, "{arch}: {names:?}");
        // Three more steps resumed equal six straight.
        run(&["train", "--resume", &adapter, "--steps", "6"]);
        let straight = path(&format!("{arch}-straight"));
        run(&[&lora[..], &["--steps", "6", "--out", &straight], &small[..]].concat());
        let resumed = eval(&format!("{arch}-base"), Some(&format!("{arch}-dora")));
        let whole = eval(&format!("{arch}-base"), Some(&format!("{arch}-straight")));
        assert_eq!(
            resumed.to_bits(),
            whole.to_bits(),
            "{arch}: {resumed} against {whole}"
        );
        // The adapter moved the model, and the merged model is the adapted one.
        let plain = eval(&format!("{arch}-base"), None);
        assert!(
            (plain - resumed).abs() > 1e-4,
            "{arch}: {plain} against {resumed}"
        );
        let merged = path(&format!("{arch}-merged"));
        run(&[
            "merge",
            "--model",
            &base,
            "--adapter",
            &adapter,
            "--out",
            &merged,
        ]);
        let m = eval(&format!("{arch}-merged"), None);
        assert!(
            (m - resumed).abs() < 1e-5,
            "{arch}: merged {m} against adapted {resumed}"
        );
        // Trained with dropout, saved with it.
        let dropped = path(&format!("{arch}-dropped"));
        let with = ["--lora-dropout", "0.1", "--steps", "2", "--out", &dropped];
        run(&[&lora[..], &with[..], &small[..]].concat());
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{arch}-dropped/adapter_config.json")))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(config["use_dora"], true, "{arch}");
        assert_eq!(config["lora_dropout"], 0.1, "{arch}");
    }
}
