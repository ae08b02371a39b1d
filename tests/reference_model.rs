//! GPT-2's forward pass against an independent, naive f64 implementation.

use crate::common;

use common::{corpus_loader, cpu};
use trainkit::model::Batch;
use trainkit::{AdamW, Gpt2, Gpt2Config, Trainer};

/// Mean cross-entropy of GPT-2 on `batch`, straight from the definition, in f64.
/// `p(name)` gives a parameter's values (Hugging Face names, Conv1D layout).
fn reference_loss(cfg: &Gpt2Config, p: &dyn Fn(&str) -> Vec<f64>, batch: &Batch) -> f64 {
    let (c, h, t, v) = (cfg.n_embd, cfg.n_head, batch.seq_len, cfg.vocab_size);
    let hs = c / h;
    let eps = cfg.layer_norm_epsilon as f64;
    let layernorm = |x: &[f64], w: &[f64], b: &[f64]| -> Vec<f64> {
        let mean = x.iter().sum::<f64>() / c as f64;
        let var = x.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / c as f64;
        let r = 1.0 / (var + eps).sqrt();
        (0..c).map(|i| (x[i] - mean) * r * w[i] + b[i]).collect()
    };
    let linear = |x: &[f64], w: &[f64], b: &[f64], n_out: usize| -> Vec<f64> {
        let n_in = x.len();
        (0..n_out)
            .map(|o| b[o] + (0..n_in).map(|i| x[i] * w[i * n_out + o]).sum::<f64>())
            .collect()
    };
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    let wte = p("transformer.wte.weight");
    let wpe = p("transformer.wpe.weight");
    let mut total = 0.0;
    for row in 0..batch.batch_size {
        let toks = &batch.inputs[row * t..(row + 1) * t];
        let mut xs: Vec<Vec<f64>> = (0..t)
            .map(|pos| {
                let tok = toks[pos] as usize;
                (0..c)
                    .map(|i| wte[tok * c + i] + wpe[pos * c + i])
                    .collect()
            })
            .collect();
        for l in 0..cfg.n_layer {
            let q = |s: &str| p(&format!("transformer.h.{l}.{s}"));
            let (ln1w, ln1b, aw, ab, pw, pb) = (
                q("ln_1.weight"),
                q("ln_1.bias"),
                q("attn.c_attn.weight"),
                q("attn.c_attn.bias"),
                q("attn.c_proj.weight"),
                q("attn.c_proj.bias"),
            );
            let (ln2w, ln2b, fw, fb, mw, mb) = (
                q("ln_2.weight"),
                q("ln_2.bias"),
                q("mlp.c_fc.weight"),
                q("mlp.c_fc.bias"),
                q("mlp.c_proj.weight"),
                q("mlp.c_proj.bias"),
            );
            let qkv: Vec<Vec<f64>> = xs
                .iter()
                .map(|x| linear(&layernorm(x, &ln1w, &ln1b), &aw, &ab, 3 * c))
                .collect();
            let mut att = vec![vec![0.0; c]; t];
            for head in 0..h {
                for i in 0..t {
                    let qi = &qkv[i][head * hs..(head + 1) * hs];
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kj = &qkv[j][c + head * hs..c + (head + 1) * hs];
                            qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (hs as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hs {
                        att[i][head * hs + d] = (0..=i)
                            .map(|j| e[j] / z * qkv[j][2 * c + head * hs + d])
                            .sum();
                    }
                }
            }
            for i in 0..t {
                let proj = linear(&att[i], &pw, &pb, c);
                let res: Vec<f64> = xs[i].iter().zip(&proj).map(|(a, b)| a + b).collect();
                let fc: Vec<f64> = linear(&layernorm(&res, &ln2w, &ln2b), &fw, &fb, 4 * c)
                    .into_iter()
                    .map(gelu)
                    .collect();
                let out = linear(&fc, &mw, &mb, c);
                xs[i] = res.iter().zip(&out).map(|(a, b)| a + b).collect();
            }
        }
        let (lfw, lfb) = (p("transformer.ln_f.weight"), p("transformer.ln_f.bias"));
        for i in 0..t {
            let x = layernorm(&xs[i], &lfw, &lfb);
            let logits: Vec<f64> = (0..v)
                .map(|tok| (0..c).map(|d| x[d] * wte[tok * c + d]).sum())
                .collect();
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            total += lse - logits[batch.targets[row * t + i] as usize];
        }
    }
    total / (batch.batch_size * t) as f64
}

#[test]
fn forward_matches_a_naive_reference_during_training() {
    let cfg = Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        n_positions: 64,
        vocab_size: 256,
        layer_norm_epsilon: 1e-5,
    };
    let model = Gpt2::new(cfg.clone()).unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(200_000, 5, 8, 64))
        .optimizer(AdamW {
            lr: 3e-3,
            ..Default::default()
        })
        .build()
        .unwrap();
    for step in 0..40 {
        let mut next = t.data().clone();
        let batch = next.next_batch();
        if step % 13 == 0 || step >= 36 {
            let ours = t.loss_on(&batch).unwrap() / batch.tokens() as f64;
            let params = |name: &str| -> Vec<f64> {
                t.param_values(name)
                    .unwrap()
                    .unwrap()
                    .iter()
                    .map(|v| *v as f64)
                    .collect()
            };
            let want = reference_loss(&cfg, &params, &batch);
            assert!(
                (ours - want).abs() < 1e-4 * want.abs(),
                "step {step}: trainkit {ours}, reference {want}"
            );
        }
        t.step().unwrap();
    }
}

#[test]
fn model_gradients_match_finite_differences_of_the_reference() {
    let cfg = Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        n_positions: 8,
        vocab_size: 64,
        layer_norm_epsilon: 1e-5,
    };
    let model = Gpt2::new(cfg.clone()).unwrap();
    let tokens: Vec<u32> = (0..200u32).map(|i| (i * 7 + i / 3) % 64).collect();
    let data = trainkit::data::DataLoader::new(tokens, 2, 8).unwrap();
    let batch = data.clone().next_batch();
    let mut t = Trainer::builder(model, cpu(), data).build().unwrap();
    let init: Vec<(String, Vec<f64>)> = t
        .params()
        .iter()
        .map(|p| {
            let v = t.backend().to_f32(p.value()).unwrap();
            (p.name().to_string(), v.iter().map(|x| *x as f64).collect())
        })
        .collect();
    t.step().unwrap();
    let loss_with = |name: &str, i: usize, delta: f64| {
        let get = |n: &str| {
            let mut v = init.iter().find(|(m, _)| m == n).unwrap().1.clone();
            if n == name {
                v[i] += delta;
            }
            v
        };
        reference_loss(&cfg, &get, &batch)
    };
    let mut checked = 0;
    for p in t.params() {
        let g = t.backend().to_f32(p.grad().unwrap()).unwrap();
        let stride = (g.len() / 6).max(1);
        for i in (0..g.len()).step_by(stride) {
            let h = 1e-5;
            let numeric = (loss_with(p.name(), i, h) - loss_with(p.name(), i, -h)) / (2.0 * h);
            let a = g[i] as f64;
            assert!(
                (numeric - a).abs() < 1e-3 * numeric.abs().max(a.abs()) + 1e-6,
                "{}[{i}]: finite differences {numeric:.8}, trainkit {a:.8}",
                p.name()
            );
            checked += 1;
        }
    }
    assert!(checked > 100);
}
