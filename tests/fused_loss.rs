//! The fused linear cross-entropy against its composed reference (the materialized logits
//! and the cross-entropy over them): the op on random inputs, and whole training steps of
//! GPT-2, within f32 1e-5 relative and bf16 1e-2, on the loss and every gradient; for
//! every chunk size, evaluation and logits included. Chunks never hold more than their
//! rows of logits, and bad settings are refused by name.

use crate::common;

use common::{corpus_loader, cpu, grads, randn, tensor, tiny_config};
use trainkit::config::RunConfig;
use trainkit::ops::{cross_entropy, FusedLoss, GradIn, LinearCrossEntropy, LossCx, LossPath};
use trainkit::{
    Backend, Constant, DType, Fp32, Gpt2, MemoryCategory, MixedBf16, NoRecompute, Param, Precision,
    Rng, Sgd, Trainer,
};

/// Largest difference over the largest magnitude of the reference.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

fn model(path: LossPath, chunk: Option<usize>) -> Gpt2 {
    Gpt2::new(tiny_config())
        .unwrap()
        .with_loss(path, chunk)
        .unwrap()
}

/// A trainer of [`model`] on `data`: SGD at 0.1, two micro-batches a step.
fn sgd_trainer(
    path: LossPath,
    chunk: Option<usize>,
    precision: Box<dyn Precision>,
    data: trainkit::data::DataLoader,
) -> Trainer<Box<dyn Precision>, NoRecompute, Sgd, Constant, trainkit::PeakTracker> {
    Trainer::builder(model(path, chunk), cpu(), data)
        .precision(precision)
        .checkpoint(NoRecompute)
        .optimizer(Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        })
        .accumulation(Constant::new(2))
        .build()
        .unwrap()
}

/// Loss and every gradient after one step (SGD, no clipping), and the eval loss after it.
fn step(
    path: LossPath,
    chunk: Option<usize>,
    precision: Box<dyn Precision>,
) -> (f64, Vec<Vec<f32>>, f64) {
    let mut t = sgd_trainer(path, chunk, precision, corpus_loader(20_000, 5, 2, 16));
    let s = t.step().unwrap();
    let mut val = corpus_loader(4_000, 9, 2, 16);
    let eval = t.evaluate(&mut val, 2).unwrap();
    (s.loss, grads(&t), eval)
}

#[test]
fn training_steps_match_the_materialized_loss() {
    let cases: [(Box<dyn Precision>, f32); 3] = [
        (Box::new(Fp32), 1e-5),
        (Box::new(MixedBf16 { fp32_grads: true }), 1e-2),
        (Box::new(MixedBf16 { fp32_grads: false }), 1e-2),
    ];
    for (precision, tol) in cases {
        let (l0, g0, e0) = step(LossPath::Materialized, None, precision.clone());
        // 32 positions per micro-batch: one chunk, uneven chunks, single rows, one chunk
        // larger than the batch.
        for chunk in [None, Some(5), Some(1), Some(16), Some(1000)] {
            let what = format!("{precision:?} chunk {chunk:?}");
            // bf16 gradients take one rounding per chunk (as per micro-batch): chunks of
            // a single position round the classifier's gradient 32 times a micro-batch.
            if chunk == Some(1) && format!("{precision:?}").contains("fp32_grads: false") {
                continue;
            }
            let (l, g, e) = step(LossPath::Fused, chunk, precision.clone());
            assert!(
                ((l - l0) / l0).abs() < tol as f64,
                "{what}: loss {l} vs {l0}"
            );
            assert!(
                ((e - e0) / e0).abs() < tol as f64,
                "{what}: eval {e} vs {e0}"
            );
            for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                let err = rel_err(a, b);
                assert!(err < tol, "{what}: gradient {i} off by {err}");
            }
        }
    }
}

#[test]
fn one_chunk_is_bitwise_the_materialized_loss_in_f32() {
    // A chunk covering every position runs the same products as the materialized path.
    let (l0, g0, e0) = step(LossPath::Materialized, None, Box::new(Fp32));
    let (l, g, e) = step(LossPath::Fused, None, Box::new(Fp32));
    assert_eq!((l, e), (l0, e0));
    assert!(g == g0, "gradients differ");
}

#[test]
fn logits_are_those_of_the_materialized_head() {
    let logits = |path| {
        let mut t = Trainer::builder(model(path, Some(3)), cpu(), corpus_loader(4_000, 1, 1, 8))
            .build()
            .unwrap();
        t.logits(&[1, 2, 3, 4, 5, 6, 7]).unwrap()
    };
    let (a, b) = (logits(LossPath::Fused), logits(LossPath::Materialized));
    assert_eq!(a.len(), 7 * 256);
    assert_eq!(a, b);
}

/// The op alone on random inputs against the composed reference, with a padded
/// vocabulary, an input gradient that already holds a value (added to) and a weight
/// gradient that already holds one (accumulated).
#[test]
fn the_op_matches_its_composed_reference() {
    let be = cpu();
    let be: &dyn Backend = be.as_ref();
    let (rows, width, vp, vocab) = (37, 24, 70, 61);
    let mut rng = Rng::new(7);
    let xs = randn(&mut rng, rows * width, 1.0);
    let ws = randn(&mut rng, vp * width, 0.3);
    let targets: Vec<u32> = (0..rows).map(|i| ((i * 13 + 5) % vocab) as u32).collect();
    let prior_dx = randn(&mut rng, rows * width, 0.01);
    let prior_dw = randn(&mut rng, vp * width, 0.01);
    let scale = 1.0 / rows as f32;
    for dtype in [DType::F32, DType::Bf16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let cast = |data: &[f32], shape: &[usize]| {
            let t = tensor(be, data, shape);
            let mut out = be
                .empty(shape, dtype, MemoryCategory::Activations, "x")
                .unwrap();
            be.cast(&mut out, &t).unwrap();
            out
        };
        let x = cast(&xs, &[rows, width]);
        let w = cast(&ws, &[vp, width]);

        // The reference: the logits of every row, the cross-entropy over them, then the
        // two products of the classifier's backward.
        let mut logits = be
            .empty(&[rows, vp], dtype, MemoryCategory::Activations, "logits")
            .unwrap();
        be.matmul(&mut logits, &x, &w, None, false, true, false)
            .unwrap();
        let mut want_losses = be
            .zeros(&[rows], DType::F32, MemoryCategory::Workspace, "l")
            .unwrap();
        cross_entropy::forward(
            be,
            &mut logits,
            &targets,
            vocab,
            Some(scale),
            &mut want_losses,
        )
        .unwrap();
        let mut want_dx = cast(&prior_dx, &[rows, width]);
        be.matmul(&mut want_dx, &logits, &w, None, false, false, true)
            .unwrap();
        let mut want_dw = tensor(be, &prior_dw, &[vp, width]);
        be.matmul(&mut want_dw, &logits, &x, None, true, false, true)
            .unwrap();
        let (want_losses, want_dx, want_dw) = (
            be.to_f32(&want_losses).unwrap(),
            be.to_f32(&want_dx).unwrap(),
            be.to_f32(&want_dw).unwrap(),
        );

        for chunk in [None, Some(1), Some(8), Some(36), Some(37), Some(64)] {
            let what = format!("{dtype} chunk {chunk:?}");
            let op = LinearCrossEntropy::new("chunk", chunk).unwrap();
            let precision: Box<dyn Precision> = if dtype == DType::Bf16 {
                Box::new(MixedBf16 { fp32_grads: true })
            } else {
                Box::new(Fp32)
            };
            let mut param = Param::new(be, "w", &[vp, width], &ws, precision.as_ref()).unwrap();
            *param.grad_mut(be).unwrap() = tensor(be, &prior_dw, &[vp, width]);
            let mut losses = be
                .zeros(&[rows], DType::F32, MemoryCategory::Workspace, "l")
                .unwrap();
            let mut cx = LossCx {
                backend: be,
                inputs: vec![&x],
                params: vec![param.for_backward()],
                targets: &targets,
                vocab,
                grad_scale: Some(scale),
                losses: &mut losses,
                grads_in: vec![GradIn {
                    tensor: Some(cast(&prior_dx, &[rows, width])),
                    shape: vec![rows, width],
                    dtype,
                    label: "dx".into(),
                }],
            };
            op.loss(&mut cx).unwrap();
            let dx = cx.grads_in[0].tensor.take().unwrap();
            assert_eq!(
                losses.shape(),
                &[rows],
                "{what}: the losses keep their shape"
            );
            let got_losses = be.to_f32(&losses).unwrap();
            assert!(rel_err(&got_losses, &want_losses) < tol, "{what}: losses");
            let err = rel_err(&be.to_f32(&dx).unwrap(), &want_dx);
            assert!(err < tol, "{what}: dx off by {err}");
            let err = rel_err(&be.to_f32(param.grad().unwrap()).unwrap(), &want_dw);
            assert!(err < tol, "{what}: dW off by {err}");
        }
    }
}

#[test]
fn only_a_chunk_of_logits_exists() {
    // 2 × 16 positions over 256 ids, chunks of 5: no logits buffer beyond 5 rows.
    let mut t = Trainer::builder(
        model(LossPath::Fused, Some(5)),
        cpu(),
        corpus_loader(20_000, 5, 2, 16),
    )
    .build()
    .unwrap();
    t.step().unwrap();
    fn peak(be: &dyn Backend, label: &str) -> Option<u64> {
        be.ledger()
            .labels()
            .iter()
            .find(|l| l.label == label)
            .map(|l| l.peak)
    }
    assert_eq!(peak(t.backend().as_ref(), "logits"), Some(5 * 256 * 4));
    let mut m = Trainer::builder(
        model(LossPath::Materialized, None),
        cpu(),
        corpus_loader(20_000, 5, 2, 16),
    )
    .build()
    .unwrap();
    let (fused, materialized) = (t.step().unwrap(), m.step().unwrap());
    m.step().unwrap();
    assert_eq!(peak(m.backend().as_ref(), "logits"), Some(32 * 256 * 4));
    let act = MemoryCategory::Activations;
    assert!(
        fused.memory.peak.get(act) < materialized.memory.peak.get(act),
        "the fused loss peaks lower"
    );
}

#[test]
fn bad_settings_are_refused_by_name() {
    let err = Gpt2::new(tiny_config())
        .unwrap()
        .with_loss(LossPath::Fused, Some(0))
        .unwrap_err()
        .to_string();
    assert!(err.contains("training.loss_chunk"), "{err}");
    let err = RunConfig::from_toml("[training]\nloss_chunk = 0\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("training.loss_chunk"), "{err}");
    let err = RunConfig::from_toml("[training]\nloss = \"chunked\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fused") && err.contains("materialized"),
        "{err}"
    );
    let cfg =
        RunConfig::from_toml("[training]\nloss = \"materialized\"\nloss_chunk = 64\n").unwrap();
    assert_eq!(cfg.training.loss, LossPath::Materialized);
    assert_eq!(cfg.training.loss_chunk, Some(64));
    assert!(cfg.build_model().is_ok());
    assert_eq!(RunConfig::default().training.loss, LossPath::Fused);
}

#[test]
fn automatic_chunks_follow_the_vocabulary() {
    let auto = LinearCrossEntropy::default();
    // GPT-2's 50257 ids in bf16: 32 MiB of logits is 333 rows, so 256, which a batch of
    // 1 × 1024 keeps (4 chunks); 8 × 1024 positions would take 32 such chunks, so 8 of
    // 1024; a million positions 410 of 2560 (256 MiB's 2670 rows, rounded down to 256,
    // then even); in f32, 8 of 1024 and 820 of 1280.
    assert_eq!(auto.chunk_rows(1024, 50257, DType::Bf16), 256);
    assert_eq!(auto.chunk_rows(8192, 50257, DType::Bf16), 1024);
    assert_eq!(auto.chunk_rows(1 << 20, 50257, DType::Bf16), 2560);
    assert_eq!(auto.chunk_rows(8192, 50257, DType::F32), 1024);
    assert_eq!(auto.chunk_rows(1 << 20, 50257, DType::F32), 1280);
    // Even chunks: 3000 positions in 6 of 512 (an eighth, 375, rounded up).
    assert_eq!(auto.chunk_rows(3000, 50257, DType::Bf16), 512);
    // A 32000-id vocabulary in bf16: up to 4096 rows; Llama 3's 128256 ids: up to 1024
    // (Llama 3.2 1B at 8 × 1024 positions: 8 chunks, at 8 × 2048: 16); at least 256
    // whatever the vocabulary.
    assert_eq!(auto.chunk_rows(1 << 20, 32000, DType::Bf16), 4096);
    assert_eq!(auto.chunk_rows(8192, 128256, DType::Bf16), 1024);
    assert_eq!(auto.chunk_rows(16384, 128256, DType::Bf16), 1024);
    assert_eq!(auto.chunk_rows(1 << 20, 4 << 20, DType::F32), 256);
    // A byte vocabulary: the whole batch at once.
    assert_eq!(auto.chunk_rows(4096, 256, DType::F32), 4096);
    assert_eq!(
        LinearCrossEntropy { chunk: Some(7) }.chunk_rows(5, 256, DType::F32),
        5
    );
}

#[test]
fn the_command_line_chooses_the_loss() {
    let (ok, _, err) = common::trainkit(&["train", "--steps", "1", "--loss-chunk", "0"]);
    assert!(!ok && err.contains("--loss-chunk"), "{err}");
    let (ok, _, err) = common::trainkit(&["train", "--steps", "1", "--loss", "chunked"]);
    assert!(
        !ok && err.contains("--loss") && err.contains("materialized"),
        "{err}"
    );
    let (ok, out, err) = common::trainkit(&[
        "train",
        "--loss",
        "materialized",
        "--loss-chunk",
        "7",
        "--print-config",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("loss = \"materialized\""), "{out}");
    assert!(out.contains("loss_chunk = 7"), "{out}");
}

/// With a loss mask, the fused loss runs its chunks over the runs of trained positions
/// only: the loss and every gradient still match the materialized path (which computes
/// every position and leaves the masked ones out), for any chunk, and the step executes
/// fewer FLOPs than the same step on the same tokens without a mask.
#[test]
fn masked_positions_cost_no_work_and_change_nothing() {
    use trainkit::data::token_flags::TRAINED;
    use trainkit::data::Tokenizer;
    use trainkit::data::{ByteTokenizer, DataLoader, Shard, SyntheticCorpus, TokenDataset};
    let tokens = ByteTokenizer.encode(&SyntheticCorpus::builtin().generate(20_000, 5));
    // Rows of 16: the first 10 positions of each untrained (a prompt), the rest trained,
    // and every 13th token untrained too.
    let flags: Vec<u8> = (0..tokens.len())
        .map(|i| {
            if i % 16 >= 10 && i % 13 != 0 {
                TRAINED
            } else {
                0
            }
        })
        .collect();
    let run = |path: LossPath, chunk: Option<usize>, masked: bool| {
        let shard = if masked {
            Shard::from_tokens_and_flags(tokens.clone(), flags.clone()).unwrap()
        } else {
            Shard::from_tokens(tokens.clone())
        };
        let data = DataLoader::new(TokenDataset::from_shards(vec![shard]), 2, 16).unwrap();
        let mut t = sgd_trainer(path, chunk, Box::new(Fp32), data);
        let s = t.step().unwrap();
        (s.loss, grads(&t), s.hardware_flops, s.trained_tokens)
    };
    let (l0, g0, _, counted) = run(LossPath::Materialized, None, true);
    assert!(counted > 0 && counted < 64, "{counted}");
    for chunk in [None, Some(3), Some(16)] {
        let (l, g, flops, _) = run(LossPath::Fused, chunk, true);
        assert!(
            ((l - l0) / l0).abs() < 1e-5,
            "chunk {chunk:?}: loss {l} vs {l0}"
        );
        for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
            let err = rel_err(a, b);
            assert!(err < 1e-5, "chunk {chunk:?}: gradient {i} off by {err}");
        }
        let (_, _, all, _) = run(LossPath::Fused, chunk, false);
        assert!(
            flops < all,
            "chunk {chunk:?}: {flops} FLOPs masked, {all} unmasked"
        );
    }
}
