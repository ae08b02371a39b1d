//! Every op's backward against central finite differences of its forward, on random
//! inputs, through the public `Backend` API.

use crate::common;

use common::{cpu, randn, tensor};
use trainkit::ops::Heads;
use trainkit::ops::{attention, cross_entropy, embedding, gelu, layernorm, linear};
use trainkit::{Backend, DType, MemoryCategory, Rng, Tensor};

/// Central finite differences of `loss` at `x` along a sample of coordinates, compared
/// with `analytic`.
fn check_gradient(name: &str, x: &[f32], analytic: &[f32], loss: &dyn Fn(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let h = 1e-2f32;
    let step = (x.len() / 40).max(1);
    let mut worst = 0f64;
    for i in (0..x.len()).step_by(step) {
        let mut xp = x.to_vec();
        xp[i] += h;
        let mut xm = x.to_vec();
        xm[i] -= h;
        let numeric = (loss(&xp) - loss(&xm)) / (2.0 * h as f64);
        let a = analytic[i] as f64;
        let err = (numeric - a).abs() / (1e-2 + numeric.abs().max(a.abs()));
        worst = worst.max(err);
        assert!(
            err < 2e-2,
            "{name}: coordinate {i}: numeric {numeric:.6}, analytic {a:.6}"
        );
    }
    assert!(worst.is_finite(), "{name}");
}

/// `Σ w · out`, the scalar each test differentiates.
fn weighted(be: &dyn Backend, out: &Tensor, w: &[f32]) -> f64 {
    be.to_f32(out)
        .unwrap()
        .iter()
        .zip(w)
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum()
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(1);
    let (m, k, n) = (5, 7, 6);
    let a = randn(&mut rng, m * k, 1.0);
    let b = randn(&mut rng, k * n, 1.0);
    let bias = randn(&mut rng, n, 1.0);
    let w = randn(&mut rng, m * n, 1.0);
    let forward = |a: &[f32], b: &[f32], bias: &[f32]| {
        let mut out = tensor(be, &vec![0.0; m * n], &[m, n]);
        be.matmul(
            &mut out,
            &tensor(be, a, &[m, k]),
            &tensor(be, b, &[k, n]),
            Some(&tensor(be, bias, &[n])),
            false,
            false,
            false,
        )
        .unwrap();
        weighted(be, &out, &w)
    };
    let dy = tensor(be, &w, &[m, n]);
    // dA = dY · Bᵀ, dB = Aᵀ · dY, dbias = Σ dY: the products the model's backward uses.
    let mut da = tensor(be, &vec![0.0; m * k], &[m, k]);
    be.matmul(
        &mut da,
        &dy,
        &tensor(be, &b, &[k, n]),
        None,
        false,
        true,
        false,
    )
    .unwrap();
    let mut db = tensor(be, &vec![0.0; k * n], &[k, n]);
    be.matmul(
        &mut db,
        &tensor(be, &a, &[m, k]),
        &dy,
        None,
        true,
        false,
        false,
    )
    .unwrap();
    let mut dbias = tensor(be, &vec![0.0; n], &[n]);
    be.bias_backward(&mut dbias, &dy).unwrap();
    check_gradient("matmul dA", &a, &be.to_f32(&da).unwrap(), &|x| {
        forward(x, &b, &bias)
    });
    check_gradient("matmul dB", &b, &be.to_f32(&db).unwrap(), &|x| {
        forward(&a, x, &bias)
    });
    check_gradient("matmul dbias", &bias, &be.to_f32(&dbias).unwrap(), &|x| {
        forward(&a, &b, x)
    });
}

#[test]
fn matmul_transposes_and_accumulation_match_a_naive_product() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(2);
    // Small products run serially; the larger ones are split into parallel tiles: in
    // both dimensions, in long row strips, and (with `aᵀ`) in row strips only.
    let shapes = [
        (33, 17, 29),
        (600, 40, 530),
        (2100, 24, 40),
        (40, 1100, 300),
    ];
    let cases = [(false, false), (true, false), (false, true), (true, true)];
    for ((m, k, n), (ta, tb)) in shapes
        .into_iter()
        .flat_map(|s| cases.into_iter().map(move |c| (s, c)))
    {
        let a = randn(&mut rng, m * k, 1.0);
        let b = randn(&mut rng, k * n, 1.0);
        let init = randn(&mut rng, m * n, 1.0);
        let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
        let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
        let a_shape = if ta { [k, m] } else { [m, k] };
        let b_shape = if tb { [n, k] } else { [k, n] };
        let mut out = tensor(be, &init, &[m, n]);
        be.matmul(
            &mut out,
            &tensor(be, &a, &a_shape),
            &tensor(be, &b, &b_shape),
            None,
            ta,
            tb,
            true,
        )
        .unwrap();
        let got = be.to_f32(&out).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = init[i * n + j] as f64
                    + (0..k)
                        .map(|p| at(i, p) as f64 * bt(p, j) as f64)
                        .sum::<f64>();
                assert!(
                    (got[i * n + j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "[{m}, {k}] x [{k}, {n}] ta={ta} tb={tb} ({i},{j}): {} vs {want}",
                    got[i * n + j]
                );
            }
        }
    }
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(3);
    let (rows, c) = (6, 16);
    let x = randn(&mut rng, rows * c, 1.0);
    let g = randn(&mut rng, c, 1.0);
    let bb = randn(&mut rng, c, 1.0);
    let w = randn(&mut rng, rows * c, 1.0);
    let forward = |x: &[f32], g: &[f32], bb: &[f32]| {
        let mut out = tensor(be, &vec![0.0; rows * c], &[rows, c]);
        let mut st = tensor(be, &vec![0.0; rows * 2], &[rows, 2]);
        layernorm::forward(
            be,
            &mut out,
            &mut st,
            &tensor(be, x, &[rows, c]),
            &tensor(be, g, &[c]),
            &tensor(be, bb, &[c]),
            1e-5,
        )
        .unwrap();
        (weighted(be, &out, &w), st)
    };
    let (_, st) = forward(&x, &g, &bb);
    let mut dx = tensor(be, &vec![0.0; rows * c], &[rows, c]);
    let mut dg = tensor(be, &vec![0.0; c], &[c]);
    let mut db = tensor(be, &vec![0.0; c], &[c]);
    layernorm::backward(
        be,
        &mut dx,
        &mut dg,
        &mut db,
        &tensor(be, &w, &[rows, c]),
        &tensor(be, &x, &[rows, c]),
        &tensor(be, &g, &[c]),
        &st,
    )
    .unwrap();
    check_gradient("layernorm dx", &x, &be.to_f32(&dx).unwrap(), &|v| {
        forward(v, &g, &bb).0
    });
    check_gradient("layernorm dweight", &g, &be.to_f32(&dg).unwrap(), &|v| {
        forward(&x, v, &bb).0
    });
    check_gradient("layernorm dbias", &bb, &be.to_f32(&db).unwrap(), &|v| {
        forward(&x, &g, v).0
    });
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(4);
    let n = 200;
    let x = randn(&mut rng, n, 2.0);
    let w = randn(&mut rng, n, 1.0);
    let forward = |x: &[f32]| {
        let mut out = tensor(be, &vec![0.0; n], &[n]);
        gelu::forward(be, &mut out, &tensor(be, x, &[n])).unwrap();
        weighted(be, &out, &w)
    };
    let mut dx = tensor(be, &vec![0.0; n], &[n]);
    gelu::backward(be, &mut dx, &tensor(be, &x, &[n]), &tensor(be, &w, &[n])).unwrap();
    check_gradient("gelu", &x, &be.to_f32(&dx).unwrap(), &forward);
}

/// The input gradient carried through a GELU in one op (`matmul_dgelu`, a linear
/// layer's input gradient at a GELU's input) is, on the CPU, the product then the GELU's
/// backward bit for bit, for both weight layouts and in bf16, and matches finite
/// differences of `Σ dy ⊙ (gelu(pre) · op(W))`.
#[test]
fn the_gradient_through_a_gelu_and_a_product_is_the_two_ops_and_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(6);
    let (rows, din, dout) = (6, 8, 5);
    let pre = randn(&mut rng, rows * din, 1.5);
    let dy = randn(&mut rng, rows * dout, 1.0);
    let w = randn(&mut rng, din * dout, 0.5);
    for dtype in [DType::F32, DType::Bf16] {
        let up = |v: &[f32], s: &[usize]| {
            be.upload(v, s, dtype, MemoryCategory::Activations, "t")
                .unwrap()
        };
        // The layer's weight stored [in, out] (the product reads op(W) = Wᵀ) or [out, in].
        for stored_in_out in [true, false] {
            let w_shape = if stored_in_out {
                [din, dout]
            } else {
                [dout, din]
            };
            let (wt, dyt, pret) = (
                up(&w, &w_shape),
                up(&dy, &[rows, dout]),
                up(&pre, &[rows, din]),
            );
            let mut fused = up(&vec![0.0; rows * din], &[rows, din]);
            linear::matmul_dgelu(be, &mut fused, &dyt, &wt, &pret, stored_in_out).unwrap();
            let mut dact = up(&vec![0.0; rows * din], &[rows, din]);
            be.matmul(&mut dact, &dyt, &wt, None, false, stored_in_out, false)
                .unwrap();
            let mut composed = up(&vec![0.0; rows * din], &[rows, din]);
            gelu::backward(be, &mut composed, &pret, &dact).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                be.to_f32(t).unwrap().iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(
                bits(&fused),
                bits(&composed),
                "{dtype} [in, out] {stored_in_out}"
            );
            if dtype != DType::F32 {
                continue;
            }
            let forward = |p: &[f32]| {
                let mut act = tensor(be, &vec![0.0; rows * din], &[rows, din]);
                gelu::forward(be, &mut act, &tensor(be, p, &[rows, din])).unwrap();
                let mut y = tensor(be, &vec![0.0; rows * dout], &[rows, dout]);
                be.matmul(&mut y, &act, &wt, None, false, !stored_in_out, false)
                    .unwrap();
                weighted(be, &y, &dy)
            };
            let name = format!("matmul_dgelu, [in, out] {stored_in_out}");
            check_gradient(&name, &pre, &be.to_f32(&fused).unwrap(), &forward);
        }
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(5);
    let (b, t, c, h) = (2, 5, 8, 2);
    let qkv = randn(&mut rng, b * t * 3 * c, 1.0);
    let w_scores = randn(&mut rng, b * h * t * t, 1.0);
    let w_out = randn(&mut rng, b * t * c, 1.0);
    let qkv_t = |v: &[f32]| tensor(be, v, &[b, t, 3 * c]);
    let sq = [b, h, t, t];
    let zeros = |shape: &[usize]| tensor(be, &vec![0.0; shape.iter().product()], shape);

    // Scores alone.
    let scores_of = |v: &[f32]| {
        let mut s = zeros(&sq);
        attention::scores(be, &mut s, &qkv_t(v), Heads::mha(h, c)).unwrap();
        s
    };
    let mut dqkv = zeros(&[b, t, 3 * c]);
    attention::scores_backward(
        be,
        &mut dqkv,
        &tensor(be, &w_scores, &sq),
        &qkv_t(&qkv),
        Heads::mha(h, c),
    )
    .unwrap();
    // The v block is not written by the scores backward: compare q and k only.
    let mut analytic = be.to_f32(&dqkv).unwrap();
    for row in analytic.chunks_mut(3 * c) {
        row[2 * c..].fill(0.0);
    }
    check_gradient("attention_scores", &qkv, &analytic, &|v| {
        weighted(be, &scores_of(v), &w_scores)
    });

    // Softmax alone.
    let scores = randn(&mut rng, b * h * t * t, 1.0);
    let softmax_of = |s: &[f32]| {
        let mut p = zeros(&sq);
        attention::softmax(be, &mut p, &tensor(be, s, &sq)).unwrap();
        p
    };
    let probs = softmax_of(&scores);
    let mut ds = zeros(&sq);
    attention::softmax_backward(be, &mut ds, &tensor(be, &w_scores, &sq), &probs).unwrap();
    check_gradient("softmax_causal", &scores, &be.to_f32(&ds).unwrap(), &|s| {
        weighted(be, &softmax_of(s), &w_scores)
    });

    // Values: gradient with respect to the probabilities and to v.
    let p_data = be.to_f32(&probs).unwrap();
    let values_of = |p: &[f32], v: &[f32]| {
        let mut out = zeros(&[b, t, c]);
        attention::values(
            be,
            &mut out,
            &tensor(be, p, &sq),
            &qkv_t(v),
            Heads::mha(h, c),
        )
        .unwrap();
        weighted(be, &out, &w_out)
    };
    let mut dp = zeros(&sq);
    let mut dqkv = zeros(&[b, t, 3 * c]);
    attention::values_backward(
        be,
        &mut dp,
        &mut dqkv,
        &tensor(be, &w_out, &[b, t, c]),
        &probs,
        &qkv_t(&qkv),
        Heads::mha(h, c),
    )
    .unwrap();
    // dprobs is defined on the causal part only.
    let dp_v = be.to_f32(&dp).unwrap();
    let mut p_causal = p_data.clone();
    for (g, p) in dp_v.chunks(t * t).zip(p_causal.chunks_mut(t * t)) {
        for i in 0..t {
            for j in i + 1..t {
                assert_eq!(g[i * t + j], 0.0, "dprobs above the diagonal");
                p[i * t + j] = 0.0;
            }
        }
    }
    let masked = |p: &[f32]| {
        let mut p = p.to_vec();
        for m in p.chunks_mut(t * t) {
            for i in 0..t {
                m[i * t + i + 1..(i + 1) * t].fill(0.0);
            }
        }
        p
    };
    check_gradient("attention_values dprobs", &p_causal, &dp_v, &|p| {
        values_of(&masked(p), &qkv)
    });
    let mut dv = be.to_f32(&dqkv).unwrap();
    for row in dv.chunks_mut(3 * c) {
        row[..2 * c].fill(0.0);
    }
    check_gradient("attention_values dv", &qkv, &dv, &|v| values_of(&p_data, v));
}

/// `cross_entropy` into fresh zero losses, summed in f64.
fn ce(
    be: &dyn Backend,
    logits: &mut Tensor,
    targets: &[u32],
    vocab: usize,
    grad: Option<f32>,
) -> f64 {
    let mut losses = tensor(be, &vec![0.0; targets.len()], &[targets.len()]);
    cross_entropy::forward(be, logits, targets, vocab, grad, &mut losses).unwrap();
    be.to_f32(&losses).unwrap().iter().map(|&l| l as f64).sum()
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(6);
    let (rows, vp, vocab) = (5, 12, 10);
    let logits = randn(&mut rng, rows * vp, 2.0);
    // The last position is left out: no loss, a zero gradient row.
    let targets = vec![0u32, 9, 3, 3, cross_entropy::IGNORE];
    let loss = |l: &[f32]| {
        let mut t = tensor(be, l, &[rows, vp]);
        ce(be, &mut t, &targets, vocab, None)
    };
    let scale = 0.5;
    let mut g = tensor(be, &logits, &[rows, vp]);
    let total = ce(be, &mut g, &targets, vocab, Some(scale));
    assert!(
        (total - loss(&logits)).abs() < 1e-5,
        "fused loss equals the forward loss"
    );
    let analytic: Vec<f32> = be.to_f32(&g).unwrap().iter().map(|v| v / scale).collect();
    for r in 0..rows {
        assert!(
            analytic[r * vp + vocab..(r + 1) * vp]
                .iter()
                .all(|v| *v == 0.0),
            "padding gets no gradient"
        );
    }
    assert!(analytic[4 * vp..].iter().all(|v| *v == 0.0));
    check_gradient("cross_entropy", &logits, &analytic, &loss);
    let mut ignored = tensor(be, &logits[4 * vp..], &[1, vp]);
    assert_eq!(
        ce(be, &mut ignored, &[cross_entropy::IGNORE], vocab, None),
        0.0
    );
    // Reference value: -log softmax at the target.
    let row = &logits[..vocab];
    let lse = row.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln();
    let mut one = tensor(be, &logits[..vp], &[1, vp]);
    let l0 = ce(be, &mut one, &targets[..1], vocab, None);
    assert!((l0 - (lse - row[0] as f64)).abs() < 1e-5);
}

#[test]
fn embedding_backward_matches_finite_differences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(7);
    let (b, t, c, v, p) = (2, 4, 6, 5, 7);
    let wte = randn(&mut rng, v * c, 1.0);
    let wpe = randn(&mut rng, p * c, 1.0);
    let tokens = vec![0u32, 4, 4, 2, 1, 0, 3, 4];
    let w = randn(&mut rng, b * t * c, 1.0);
    let forward = |wte: &[f32], wpe: &[f32]| {
        let mut out = tensor(be, &vec![0.0; b * t * c], &[b, t, c]);
        embedding::forward(
            be,
            &mut out,
            &tokens,
            &tensor(be, wte, &[v, c]),
            Some(&tensor(be, wpe, &[p, c])),
        )
        .unwrap();
        weighted(be, &out, &w)
    };
    let mut dwte = tensor(be, &vec![0.0; v * c], &[v, c]);
    let mut dwpe = tensor(be, &vec![0.0; p * c], &[p, c]);
    embedding::backward(
        be,
        &mut dwte,
        Some(&mut dwpe),
        &tensor(be, &w, &[b, t, c]),
        &tokens,
    )
    .unwrap();
    check_gradient("embedding wte", &wte, &be.to_f32(&dwte).unwrap(), &|x| {
        forward(x, &wpe)
    });
    check_gradient("embedding wpe", &wpe, &be.to_f32(&dwpe).unwrap(), &|x| {
        forward(&wte, x)
    });
}

#[test]
fn shape_mismatches_are_errors_not_panics() {
    let be = cpu();
    let be = be.as_ref();
    let a = tensor(be, &[0.0; 6], &[2, 3]);
    let b = tensor(be, &[0.0; 8], &[4, 2]);
    let mut out = tensor(be, &[0.0; 4], &[2, 2]);
    let err = be
        .matmul(&mut out, &a, &b, None, false, false, false)
        .unwrap_err();
    assert!(err.to_string().contains("inner dimensions"), "{err}");
    let mut l = tensor(be, &[0.0; 6], &[2, 3]);
    let mut losses = tensor(be, &[0.0; 2], &[2]);
    let err = cross_entropy::forward(be, &mut l, &[0, 7], 3, None, &mut losses).unwrap_err();
    assert!(err.to_string().contains("beyond the vocabulary"), "{err}");
    // Only u32::MAX means "left out"; the ids just beyond it are errors.
    let ignore = cross_entropy::IGNORE;
    cross_entropy::forward(be, &mut l, &[0, ignore], 3, None, &mut losses).unwrap();
    let err =
        cross_entropy::forward(be, &mut l, &[ignore - 1, 0], 3, None, &mut losses).unwrap_err();
    assert!(err.to_string().contains("beyond the vocabulary"), "{err}");
    // Forward over rows beyond the targets is an error naming both.
    let err =
        cross_entropy::forward_rows(be, &mut l, &[0, 1, 2], 2, 3, None, &mut losses).unwrap_err();
    assert!(err.to_string().contains("beyond the 3 targets"), "{err}");
    let mut short = tensor(be, &[0.0; 1], &[1]);
    let err = cross_entropy::forward(be, &mut l, &[0, 1], 3, None, &mut short).unwrap_err();
    assert!(err.to_string().contains("at least 2 elements"), "{err}");
}

/// The attention ops against naive loops on a sequence spanning several row blocks.
#[test]
fn attention_matches_naive_loops_on_long_sequences() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(8);
    let (b, t, c, h) = (2, 150, 16, 2);
    let hs = c / h;
    let qkv = randn(&mut rng, b * t * 3 * c, 1.0);
    let dout = randn(&mut rng, b * t * c, 1.0);
    let dsc = randn(&mut rng, b * h * t * t, 1.0);
    let sq = [b, h, t, t];
    let zeros = |shape: &[usize]| tensor(be, &vec![0.0; shape.iter().product()], shape);
    let q_t = tensor(be, &qkv, &[b, t, 3 * c]);
    let mut s = zeros(&sq);
    attention::scores(be, &mut s, &q_t, Heads::mha(h, c)).unwrap();
    let mut p = zeros(&sq);
    attention::softmax(be, &mut p, &s).unwrap();
    let mut out = zeros(&[b, t, c]);
    attention::values(be, &mut out, &p, &q_t, Heads::mha(h, c)).unwrap();
    let mut dp = zeros(&sq);
    let mut dqkv = zeros(&[b, t, 3 * c]);
    attention::values_backward(
        be,
        &mut dp,
        &mut dqkv,
        &tensor(be, &dout, &[b, t, c]),
        &p,
        &q_t,
        Heads::mha(h, c),
    )
    .unwrap();
    attention::scores_backward(
        be,
        &mut dqkv,
        &tensor(be, &dsc, &sq),
        &q_t,
        Heads::mha(h, c),
    )
    .unwrap();
    let (s, p, out, dp, dqkv) = (
        be.to_f32(&s).unwrap(),
        be.to_f32(&p).unwrap(),
        be.to_f32(&out).unwrap(),
        be.to_f32(&dp).unwrap(),
        be.to_f32(&dqkv).unwrap(),
    );
    let x = |bi: usize, i: usize, col: usize| qkv[(bi * t + i) * 3 * c + col] as f64;
    let scale = 1.0 / (hs as f64).sqrt();
    let close = |got: f32, want: f64, what: &str| {
        assert!(
            (got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
            "{what}: {got} vs {want}"
        );
    };
    for bi in 0..b {
        for hi in 0..h {
            let m = |i: usize, j: usize| ((bi * h + hi) * t + i) * t + j;
            for i in 0..t {
                for j in 0..t {
                    let want = if j <= i {
                        scale
                            * (0..hs)
                                .map(|d| x(bi, i, hi * hs + d) * x(bi, j, c + hi * hs + d))
                                .sum::<f64>()
                    } else {
                        0.0
                    };
                    close(s[m(i, j)], want, "scores");
                    let want_dp = if j <= i {
                        (0..hs)
                            .map(|d| {
                                dout[(bi * t + i) * c + hi * hs + d] as f64
                                    * x(bi, j, 2 * c + hi * hs + d)
                            })
                            .sum::<f64>()
                    } else {
                        0.0
                    };
                    close(dp[m(i, j)], want_dp, "dprobs");
                }
                for d in 0..hs {
                    let col = hi * hs + d;
                    let want: f64 = (0..=i)
                        .map(|j| p[m(i, j)] as f64 * x(bi, j, 2 * c + col))
                        .sum();
                    close(out[(bi * t + i) * c + col], want, "values");
                    let dq: f64 = (0..=i)
                        .map(|j| dsc[m(i, j)] as f64 * x(bi, j, c + col))
                        .sum::<f64>()
                        * scale;
                    let dk: f64 = (i..t)
                        .map(|r| dsc[m(r, i)] as f64 * x(bi, r, col))
                        .sum::<f64>()
                        * scale;
                    let dv: f64 = (i..t)
                        .map(|r| p[m(r, i)] as f64 * dout[(bi * t + r) * c + col] as f64)
                        .sum();
                    close(dqkv[(bi * t + i) * 3 * c + col], dq, "dq");
                    close(dqkv[(bi * t + i) * 3 * c + c + col], dk, "dk");
                    close(dqkv[(bi * t + i) * 3 * c + 2 * c + col], dv, "dv");
                }
            }
        }
    }
}

/// Grouped-query attention is multi-head attention with each key and value head repeated
/// for the query heads sharing it (Hugging Face's `repeat_kv`): the same outputs and query
/// gradients, and key and value gradients summed over each group.
#[test]
fn grouped_query_attention_is_multi_head_with_shared_heads() {
    let be = cpu();
    let be = be.as_ref();
    let mut rng = Rng::new(9);
    let (b, t, d) = (2, 70, 3);
    for (h, kv) in [(4, 2), (4, 1), (3, 3)] {
        let g = Heads {
            n_head: h,
            n_kv_head: kv,
            head_dim: d,
        };
        let m = Heads::mha(h, h * d);
        let (wg, wm, c) = (g.qkv_width(), m.qkv_width(), g.q_width());
        let qkv_g = randn(&mut rng, b * t * wg, 1.0);
        let dout = randn(&mut rng, b * t * c, 1.0);
        // The repeated layout: q as it is, head h's k and v from its group's head.
        let mut qkv_m = vec![0f32; b * t * wm];
        for row in 0..b * t {
            let (src, dst) = (&qkv_g[row * wg..], &mut qkv_m[row * wm..]);
            dst[..c].copy_from_slice(&src[..c]);
            for hi in 0..h {
                for e in 0..d {
                    dst[m.k_col(hi) + e] = src[g.k_col(hi) + e];
                    dst[m.v_col(hi) + e] = src[g.v_col(hi) + e];
                }
            }
        }
        let run = |qkv: &[f32], w: usize, heads: Heads| -> (Vec<f32>, Vec<f32>) {
            let zeros = |shape: &[usize]| tensor(be, &vec![0.0; shape.iter().product()], shape);
            let sq = [b, h, t, t];
            let qkv = tensor(be, qkv, &[b, t, w]);
            let mut s = zeros(&sq);
            attention::scores(be, &mut s, &qkv, heads).unwrap();
            let mut p = zeros(&sq);
            attention::softmax(be, &mut p, &s).unwrap();
            let mut out = zeros(&[b, t, c]);
            attention::values(be, &mut out, &p, &qkv, heads).unwrap();
            let (mut dp, mut ds) = (zeros(&sq), zeros(&sq));
            let mut dqkv = zeros(&[b, t, w]);
            let dout = tensor(be, &dout, &[b, t, c]);
            attention::values_backward(be, &mut dp, &mut dqkv, &dout, &p, &qkv, heads).unwrap();
            attention::softmax_backward(be, &mut ds, &dp, &p).unwrap();
            attention::scores_backward(be, &mut dqkv, &ds, &qkv, heads).unwrap();
            (be.to_f32(&out).unwrap(), be.to_f32(&dqkv).unwrap())
        };
        let (out_g, d_g) = run(&qkv_g, wg, g);
        let (out_m, d_m) = run(&qkv_m, wm, m);
        let close = |got: f32, want: f32, what: &str| {
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{h}/{kv} heads, {what}: {got} vs {want}"
            );
        };
        for (o, w) in out_g.iter().zip(&out_m) {
            close(*o, *w, "output");
        }
        for row in 0..b * t {
            let (dg, dm) = (&d_g[row * wg..], &d_m[row * wm..]);
            for i in 0..c {
                close(dg[i], dm[i], "dq");
            }
            for kh in 0..kv {
                for e in 0..d {
                    let heads = kh * (h / kv)..(kh + 1) * (h / kv);
                    let dk: f32 = heads.clone().map(|hi| dm[m.k_col(hi) + e]).sum();
                    let dv: f32 = heads.map(|hi| dm[m.v_col(hi) + e]).sum();
                    close(dg[g.k_col(kh * (h / kv)) + e], dk, "dk");
                    close(dg[g.v_col(kh * (h / kv)) + e], dv, "dv");
                }
            }
        }
    }
}
