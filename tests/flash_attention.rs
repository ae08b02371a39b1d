//! The fused attention against its composed reference, the materialized attention (in
//! f32 on the same inputs): the op's output, log-sum-exp and gradients in f32 (1e-5 of
//! the largest value) and bf16 (1e-2), for multi-head, grouped-query and multi-query heads, head widths up to 128
//! and sequences that do not fill the tiles; whole models trained either way; and the
//! memory it saves, from the exact prediction.

use crate::common;

use common::{corpus_loader, cpu, randn, tiny_config};
use trainkit::estimate::{predict, MicroBatch};
use trainkit::model::{Rope, RopeScaling};
use trainkit::ops::Heads;
use trainkit::ops::{attention, flash_attention, AttentionPath, LossPath};
use trainkit::{
    AdamW, Backend, CheckpointPolicy, Constant, DType, Fp32, Full, Gpt2, Gpt2Config, Llama,
    LlamaConfig, MemoryCategory, MixedBf16, Model, NoRecompute, Precision, Rng, Selective, Tensor,
    Trainer,
};

fn upload(be: &dyn Backend, data: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    be.upload(data, shape, dtype, MemoryCategory::Activations, "test")
        .unwrap()
}

fn zeros(be: &dyn Backend, shape: &[usize], dtype: DType) -> Tensor {
    be.zeros(shape, dtype, MemoryCategory::Activations, "test")
        .unwrap()
}

/// The output, log-sum-exp and `dqkv` of the materialized attention; the log-sum-exp
/// from the scores in f64.
fn materialized(
    be: &dyn Backend,
    qkv: &Tensor,
    dout: &Tensor,
    heads: Heads,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let [b, t, _] = *qkv.shape() else {
        unreachable!()
    };
    let dt = qkv.dtype();
    let sq = [b, heads.n_head, t, t];
    let mut s = zeros(be, &sq, dt);
    attention::scores(be, &mut s, qkv, heads).unwrap();
    let mut p = zeros(be, &sq, dt);
    attention::softmax(be, &mut p, &s).unwrap();
    let mut out = zeros(be, &[b, t, heads.q_width()], dt);
    attention::values(be, &mut out, &p, qkv, heads).unwrap();
    let (mut dp, mut ds) = (zeros(be, &sq, dt), zeros(be, &sq, dt));
    let mut dqkv = zeros(be, qkv.shape(), dt);
    attention::values_backward(be, &mut dp, &mut dqkv, dout, &p, qkv, heads).unwrap();
    attention::softmax_backward(be, &mut ds, &dp, &p).unwrap();
    attention::scores_backward(be, &mut dqkv, &ds, qkv, heads).unwrap();
    // The log-sum-exp of the f32 scores, from the inputs (the materialized scores of a
    // bf16 run are rounded).
    let q = be.to_f32(qkv).unwrap();
    let w = heads.qkv_width();
    let scale = 1.0 / (heads.head_dim as f64).sqrt();
    let mut lse = vec![0f32; b * heads.n_head * t];
    for bi in 0..b {
        for h in 0..heads.n_head {
            for i in 0..t {
                let dot = |j: usize| -> f64 {
                    (0..heads.head_dim)
                        .map(|e| {
                            q[(bi * t + i) * w + heads.q_col(h) + e] as f64
                                * q[(bi * t + j) * w + heads.k_col(h) + e] as f64
                        })
                        .sum::<f64>()
                        * scale
                };
                let scores: Vec<f64> = (0..=i).map(dot).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                lse[(bi * heads.n_head + h) * t + i] = (max + sum.ln()) as f32;
            }
        }
    }
    (be.to_f32(&out).unwrap(), lse, be.to_f32(&dqkv).unwrap())
}

/// The fused attention's output, log-sum-exp and `dqkv`.
fn fused(
    be: &dyn Backend,
    qkv: &Tensor,
    dout: &Tensor,
    heads: Heads,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let [b, t, _] = *qkv.shape() else {
        unreachable!()
    };
    let dt = qkv.dtype();
    let mut out = zeros(be, &[b, t, heads.q_width()], dt);
    let mut lse = zeros(be, &[b, heads.n_head, t], DType::F32);
    flash_attention::forward(be, &mut out, &mut lse, qkv, heads).unwrap();
    // Poisoned, to show every element is written.
    let mut dqkv = upload(be, &vec![f32::NAN; qkv.numel()], qkv.shape(), dt);
    flash_attention::backward(be, &mut dqkv, dout, &out, &lse, qkv, heads).unwrap();
    (
        be.to_f32(&out).unwrap(),
        be.to_f32(&lse).unwrap(),
        be.to_f32(&dqkv).unwrap(),
    )
}

/// Fails unless `got` is within `tol` times the largest magnitude of `want`.
fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let (i, err) = got
        .iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_finite() {
                (g - w).abs()
            } else {
                f32::INFINITY
            }
        })
        .enumerate()
        .fold((0, 0f32), |a, (i, e)| if e > a.1 { (i, e) } else { a });
    assert!(
        err <= tol * scale,
        "{what}: largest error {err:e} at {i} ({} vs {}), {:e} of the largest value {scale}",
        got[i],
        want[i],
        err / scale
    );
}

/// Shapes `(B, T, H, KV, D)`: multi-head, grouped-query and multi-query; T of one row,
/// within one tile, and across query blocks and key tiles with partial ones; D 16 to 128.
const SHAPES: [(usize, usize, usize, usize, usize); 7] = [
    (2, 1, 2, 2, 8),
    (2, 70, 2, 2, 16),
    (1, 200, 4, 2, 64),
    (1, 130, 4, 1, 128),
    (2, 64, 3, 3, 32),
    (1, 300, 2, 1, 64),
    (1, 600, 2, 2, 32),
];

#[test]
fn fused_attention_matches_the_materialized_one_in_f32_and_bf16() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(21);
    for (b, t, h, kv, d) in SHAPES {
        let heads = Heads {
            n_head: h,
            n_kv_head: kv,
            head_dim: d,
        };
        // Scores of a few units, as trained models have, so the softmax is not flat.
        let qkv = randn(&mut rng, b * t * heads.qkv_width(), 1.5);
        let dout = randn(&mut rng, b * t * heads.q_width(), 1.0);
        for (dt, tol) in [(DType::F32, 1e-5), (DType::Bf16, 1e-2)] {
            let qkv = upload(be, &qkv, &[b, t, heads.qkv_width()], dt);
            let dout = upload(be, &dout, &[b, t, heads.q_width()], dt);
            // The reference runs in f32 on the same (rounded) inputs: the materialized
            // bf16 path rounds its scores and probabilities to bf16, the fused one keeps
            // them in f32, so the f32 path is the one both approximate.
            let f32_of = |t: &Tensor| upload(be, &be.to_f32(t).unwrap(), t.shape(), DType::F32);
            let (out_m, lse_m, d_m) = materialized(be, &f32_of(&qkv), &f32_of(&dout), heads);
            let (out_f, lse_f, d_f) = fused(be, &qkv, &dout, heads);
            let case = format!("B {b} T {t} H {h} KV {kv} D {d} {dt}");
            assert_close(&out_f, &out_m, tol, &format!("{case}: output"));
            // The log-sum-exp against f64, from the same (rounded) inputs.
            assert_close(&lse_f, &lse_m, 1e-5, &format!("{case}: lse"));
            assert_close(&d_f, &d_m, tol, &format!("{case}: dqkv"));
        }
    }
}

#[test]
fn fused_attention_is_deterministic_and_refuses_bad_operands() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(5);
    let heads = Heads {
        n_head: 4,
        n_kv_head: 2,
        head_dim: 16,
    };
    let (b, t) = (2, 150);
    let qkv = upload(
        be,
        &randn(&mut rng, b * t * heads.qkv_width(), 1.0),
        &[b, t, heads.qkv_width()],
        DType::F32,
    );
    let dout = upload(
        be,
        &randn(&mut rng, b * t * heads.q_width(), 1.0),
        &[b, t, heads.q_width()],
        DType::F32,
    );
    let first = fused(be, &qkv, &dout, heads);
    assert_eq!(first, fused(be, &qkv, &dout, heads));

    // An lse that is not f32, or shaped for another T; heads that do not fit.
    let mut out = zeros(be, &[b, t, heads.q_width()], DType::F32);
    let mut lse = zeros(be, &[b, 4, t], DType::Bf16);
    let e = flash_attention::forward(be, &mut out, &mut lse, &qkv, heads).unwrap_err();
    assert!(e.to_string().contains("must be f32"), "{e}");
    let mut lse = zeros(be, &[b, 4, t - 1], DType::F32);
    let e = flash_attention::forward(be, &mut out, &mut lse, &qkv, heads).unwrap_err();
    assert!(e.to_string().contains("expected [2, 4, 150]"), "{e}");
    let bad = Heads {
        n_head: 3,
        n_kv_head: 2,
        head_dim: 16,
    };
    let e = flash_attention::forward(be, &mut out, &mut lse, &qkv, bad).unwrap_err();
    assert!(e.to_string().contains("flash_attention"), "{e}");
}

type Tk =
    Trainer<Box<dyn Precision>, Box<dyn CheckpointPolicy>, AdamW, Constant, trainkit::PeakTracker>;

fn trainer(
    model: Box<dyn Model>,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
) -> Tk {
    Trainer::builder(model, cpu(), corpus_loader(20_000, 3, 2, 32))
        .precision(precision)
        .checkpoint(policy)
        .build()
        .unwrap()
}

fn small_llama() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        initializer_range: 0.1,
        rope: Rope {
            theta: 500.0,
            scaling: RopeScaling::Default,
        },
    }
}

/// GPT-2 and a grouped-query Llama with the attention computed by `path`.
fn model(llama: bool, path: AttentionPath) -> Box<dyn Model> {
    if llama {
        Box::new(Llama::new(small_llama()).unwrap().with_attention(path))
    } else {
        Box::new(Gpt2::new(tiny_config()).unwrap().with_attention(path))
    }
}

/// Whole models, GPT-2 and a grouped-query Llama, in f32 and bf16: the fused attention's
/// loss and gradients agree with the materialized attention's to the op's tolerance, and
/// within the fused path every recompute policy gives the same gradients bit for bit.
#[test]
fn models_train_alike_with_either_attention_and_policies_agree_bitwise() {
    type MakePrecision = fn() -> Box<dyn Precision>;
    let precisions: [(MakePrecision, f32); 2] = [
        (|| Box::new(Fp32), 2e-5),
        (|| Box::new(MixedBf16::default()), 3e-2),
    ];
    for (precision, tol) in precisions {
        for llama in [false, true] {
            let fused = || model(llama, AttentionPath::Fused);
            let name = fused().describe();
            let mut f = trainer(fused(), precision(), Box::new(NoRecompute));
            let reference = model(llama, AttentionPath::Materialized);
            let mut m = trainer(reference, precision(), Box::new(NoRecompute));
            let (lf, lm) = (f.step().unwrap().loss, m.step().unwrap().loss);
            assert!(
                (lf - lm).abs() <= tol as f64 * lm.abs(),
                "{name}: loss {lf} vs {lm}"
            );
            for (i, (gf, gm)) in common::grads(&f).iter().zip(common::grads(&m)).enumerate() {
                assert_close(gf, &gm, tol * 10.0, &format!("{name}: gradient {i}"));
            }
            let reference = common::grads(&f);
            for policy in [
                Box::new(Full) as Box<dyn CheckpointPolicy>,
                Box::new(Selective),
            ] {
                let mut t = trainer(fused(), precision(), policy.clone());
                t.step().unwrap();
                assert!(
                    common::grads(&t) == reference,
                    "{name}: {policy:?} changes the gradients"
                );
            }
        }
    }
}

/// The fused attention keeps no `[B, H, T, T]` tensor: on the small byte-level GPT-2 (4
/// layers of 128, 4 heads) with a context of 1024 (recompute none, f32, batch 4), the
/// activation peak grows at most 4.5 times from T = 256 to 1024, where the materialized
/// attention's grows with T².
#[test]
fn activation_peak_grows_linearly_with_the_fused_attention() {
    let config = Gpt2Config {
        n_positions: 1024,
        ..Gpt2Config::small_bytes()
    };
    let peak = |path: AttentionPath, t: usize| {
        let model = Gpt2::new(config.clone()).unwrap().with_attention(path);
        let micro = MicroBatch {
            batch_size: 4,
            seq_len: t,
        };
        predict(
            Box::new(model),
            micro,
            &Fp32,
            &NoRecompute,
            &AdamW::default(),
        )
        .unwrap()
        .peak
        .get(MemoryCategory::Activations)
    };
    let fused = peak(AttentionPath::Fused, 1024) as f64 / peak(AttentionPath::Fused, 256) as f64;
    let materialized = peak(AttentionPath::Materialized, 1024) as f64
        / peak(AttentionPath::Materialized, 256) as f64;
    println!(
        "activation peak from T 256 to 1024: fused ×{fused:.2}, materialized ×{materialized:.2}"
    );
    assert!(fused <= 4.5, "fused: ×{fused:.2} from T 256 to 1024");
    assert!(materialized > 8.0, "materialized: ×{materialized:.2}");
}

/// GPT-2 124M in bf16 with full recomputation, B = 1, T = 1024: with the fused attention
/// and the fused loss the exact activation peak is under 64 MB (the materialized
/// attention and logits peak at 126.6 MB).
#[test]
fn gpt2_124m_full_recompute_peaks_under_64_mb() {
    let micro = MicroBatch {
        batch_size: 1,
        seq_len: 1024,
    };
    let peak = |attention, loss| {
        let model = Gpt2::new(Gpt2Config::gpt2_124m())
            .unwrap()
            .with_attention(attention)
            .with_loss(loss, None)
            .unwrap();
        let bf16 = MixedBf16 { fp32_grads: false };
        predict(Box::new(model), micro, &bf16, &Full, &AdamW::default())
            .unwrap()
            .peak
            .get(MemoryCategory::Activations)
    };
    let fused = peak(AttentionPath::Fused, LossPath::Fused);
    assert!(fused < 64_000_000, "{fused} bytes");
    let materialized = peak(AttentionPath::Materialized, LossPath::Materialized);
    // [1024, 50304] bf16 logits (the vocabulary padded to a multiple of 64) and the
    // attention's probabilities.
    assert_eq!(materialized, 126_623_744);
}
