//! Gradient accumulation: k micro-batches of b rows make the same update as one batch of
//! k·b rows, through the real trainer; the shipped schedules choose the documented counts.

use crate::common;

use common::{corpus_loader, cpu, tiny_config, values};
use trainkit::accumulate::AccumulationContext;
use trainkit::{AccumulationSchedule, Constant, Gpt2, Ramp, TokensPerStep, Trainer};

#[test]
fn micro_batches_equal_one_big_batch() {
    let train = |batch: usize, k: usize| {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, cpu(), corpus_loader(50_000, 3, batch, 16))
            .accumulation(Constant::new(k))
            .build()
            .unwrap();
        let losses: Vec<f64> = (0..3).map(|_| t.step().unwrap().loss).collect();
        (values(&t), losses)
    };
    let (big, big_losses) = train(8, 1);
    let (acc, acc_losses) = train(2, 4);
    for (a, b) in big_losses.iter().zip(&acc_losses) {
        assert!((a - b).abs() < 1e-5 * a.abs(), "losses {a} vs {b}");
    }
    let mut worst = 0f32;
    for (pa, pb) in big.iter().zip(&acc) {
        for (a, b) in pa.iter().zip(pb) {
            worst = worst.max((a - b).abs() / (1e-3 + a.abs()));
        }
    }
    assert!(worst < 1e-3, "parameters differ by {worst} (relative)");
    // And the updates are not trivially equal: training moved the weights.
    let (start, _) = {
        let model = Gpt2::new(tiny_config()).unwrap();
        let t = Trainer::builder(model, cpu(), corpus_loader(50_000, 3, 8, 16))
            .build()
            .unwrap();
        (values(&t), ())
    };
    assert_ne!(start, big);
}

#[test]
fn schedules_choose_the_documented_counts() {
    let ctx = |tokens_seen: u64| AccumulationContext {
        step: 0,
        tokens_seen,
        tokens_per_micro_batch: 1024,
    };
    assert_eq!(Constant::new(3).micro_batches(&ctx(0)).unwrap(), 3);
    assert!(Constant::new(0).micro_batches(&ctx(0)).is_err());
    let per_step = TokensPerStep { tokens: 8192 };
    assert_eq!(per_step.micro_batches(&ctx(0)).unwrap(), 8);
    let err = TokensPerStep { tokens: 1000 }
        .micro_batches(&ctx(0))
        .unwrap_err();
    assert!(err.to_string().contains("multiple of the 1024"), "{err}");
    let ramp = Ramp {
        start_tokens: 2048,
        end_tokens: 10240,
        ramp_tokens: 100_000,
    };
    assert_eq!(ramp.micro_batches(&ctx(0)).unwrap(), 2);
    assert_eq!(ramp.micro_batches(&ctx(50_000)).unwrap(), 6);
    assert_eq!(ramp.micro_batches(&ctx(100_000)).unwrap(), 10);
    assert_eq!(ramp.micro_batches(&ctx(1_000_000)).unwrap(), 10);
}

#[test]
fn the_trainer_follows_a_ramp() {
    let model = Gpt2::new(tiny_config()).unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(50_000, 3, 2, 16))
        .accumulation(Ramp {
            start_tokens: 32,
            end_tokens: 128,
            ramp_tokens: 192,
        })
        .build()
        .unwrap();
    let counts: Vec<usize> = (0..4).map(|_| t.step().unwrap().micro_batches).collect();
    // Before each step 0, 32, 64, 128 tokens were seen: global batches of 32, 48, 64
    // and 96 tokens, i.e. 1, 1 (48 rounds down), 2 and 3 micro-batches of 32 tokens.
    assert_eq!(counts, vec![1, 1, 2, 3]);
}

/// With a loss mask that trains some rows fully and others at one position in seven, the
/// step's loss and gradients are the sum over trained positions divided by their number
/// over the whole step: 4 micro-batches of 2 rows make the update of one batch of 8 (a
/// mean of micro-batch means would weigh the sparse rows' positions more), and the step's
/// loss is the batch's summed loss over its trained positions.
#[test]
fn masked_micro_batches_equal_one_big_batch() {
    use trainkit::data::token_flags::TRAINED;
    use trainkit::data::Tokenizer;
    use trainkit::data::{ByteTokenizer, DataLoader, Shard, SyntheticCorpus, TokenDataset};
    let tokens = ByteTokenizer.encode(&SyntheticCorpus::builtin().generate(50_000, 3));
    let flags: Vec<u8> = (0..tokens.len())
        .map(|i| {
            let dense = (i / 16) % 3 == 0;
            if dense || i % 7 == 0 {
                TRAINED
            } else {
                0
            }
        })
        .collect();
    let loader = |batch: usize| {
        let shard = Shard::from_tokens_and_flags(tokens.clone(), flags.clone()).unwrap();
        DataLoader::new(TokenDataset::from_shards(vec![shard]), batch, 16).unwrap()
    };
    let train = |batch: usize, k: usize| {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, cpu(), loader(batch))
            .accumulation(Constant::new(k))
            .build()
            .unwrap();
        let stats: Vec<_> = (0..3).map(|_| t.step().unwrap()).collect();
        (values(&t), stats)
    };
    let (big, big_stats) = train(8, 1);
    let (acc, acc_stats) = train(2, 4);
    for (a, b) in big_stats.iter().zip(&acc_stats) {
        assert!(a.trained_tokens < a.tokens && a.trained_tokens == b.trained_tokens);
        assert!(
            (a.loss - b.loss).abs() < 1e-5 * a.loss.abs(),
            "{} vs {}",
            a.loss,
            b.loss
        );
    }
    let mut worst = 0f32;
    for (pa, pb) in big.iter().zip(&acc) {
        for (a, b) in pa.iter().zip(pb) {
            worst = worst.max((a - b).abs() / (1e-3 + a.abs()));
        }
    }
    assert!(worst < 1e-3, "parameters differ by {worst} (relative)");
    // The first step's loss is the first batch's summed loss over its trained positions.
    let mut fresh = Trainer::builder(Gpt2::new(tiny_config()).unwrap(), cpu(), loader(8))
        .build()
        .unwrap();
    let batch = loader(8).next_batch();
    let mean = fresh.loss_on(&batch).unwrap() / batch.counted() as f64;
    let first = big_stats[0].loss;
    assert!((first - mean).abs() < 1e-6 * mean, "{first} vs {mean}");
    // Evaluation weighs every trained position alike, over all its batches.
    let mut two = loader(8);
    let (b1, b2) = (two.next_batch(), two.next_batch());
    let want = (fresh.loss_on(&b1).unwrap() + fresh.loss_on(&b2).unwrap())
        / (b1.counted() + b2.counted()) as f64;
    let got = fresh.evaluate(&mut loader(8), 2).unwrap();
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    assert_ne!(b1.counted(), b2.counted());
}

/// Separate accumulation (`TrainerOptions::separate_accumulation`): each micro-batch's
/// gradients computed apart and added to the running sum once complete. The same step
/// as accumulating in place to float32 rounding (and the first micro-batch's loss
/// bitwise), in fp32 and mixed bf16 with bf16 gradients; its memory, the running sum
/// beside each gradient computed apart, predicted exactly for 2 and 3 micro-batches.
#[test]
fn separate_accumulation_is_the_same_step_and_predicted() {
    use trainkit::estimate::{predict_with, MicroBatch};
    use trainkit::{Fp32, MixedBf16, NoRecompute, Precision, TrainerOptions};
    let precisions: [Box<dyn Precision>; 2] =
        [Box::new(Fp32), Box::new(MixedBf16 { fp32_grads: false })];
    for precision in precisions {
        for k in [2, 3] {
            let what = format!("{precision:?}, {k} micro-batches");
            let options = |separate: bool| TrainerOptions {
                separate_accumulation: separate,
                ..TrainerOptions::default()
            };
            let train = |separate: bool| {
                let model = Gpt2::new(tiny_config()).unwrap();
                let mut t = Trainer::builder(model, cpu(), corpus_loader(50_000, 3, 2, 16))
                    .precision(precision.clone())
                    .accumulation(Constant::new(k))
                    .options(options(separate))
                    .build()
                    .unwrap();
                let stats: Vec<_> = (0..3).map(|_| t.step().unwrap()).collect();
                (values(&t), stats)
            };
            let (in_place, a) = train(false);
            let (apart, b) = train(true);
            assert_eq!(a[0].loss, b[0].loss, "{what}: the first step's loss");
            // bf16 gradients round the running sum once more apart (the product rounded
            // to bf16 before the addition) than in place, and AdamW moves a weight by
            // about ±lr wherever a gradient is near zero, whatever its rounding.
            let (tol, weight_tol) = if format!("{precision:?}").contains("Bf16") {
                (1e-3, 1e-2)
            } else {
                (1e-5, 1e-3)
            };
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x.loss - y.loss).abs() < tol * x.loss.abs(),
                    "{what}: {} {}",
                    x.loss,
                    y.loss
                );
            }
            let mut worst = 0f32;
            for (pa, pb) in in_place.iter().zip(&apart) {
                for (x, y) in pa.iter().zip(pb) {
                    worst = worst.max((x - y).abs());
                }
            }
            assert!(
                worst > 0.0 && worst < weight_tol,
                "{what}: weights differ by {worst}"
            );
            let predicted = predict_with(
                Box::new(Gpt2::new(tiny_config()).unwrap()),
                MicroBatch {
                    batch_size: 2,
                    seq_len: 16,
                },
                precision.as_ref(),
                &NoRecompute,
                &trainkit::AdamW::default(),
                &options(true),
            )
            .unwrap();
            for (step, s) in b.iter().enumerate() {
                common::step_matches_prediction(s, &predicted, step as u64 + 1, k, &what);
            }
            // The running sum beside the gradient computed apart: more than in place.
            let gradients = trainkit::memory::MemoryCategory::Gradients;
            assert!(
                b[1].memory.peak.get(gradients) > a[1].memory.peak.get(gradients),
                "{what}"
            );
        }
    }
}
