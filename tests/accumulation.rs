//! Gradient accumulation: k micro-batches of b rows make the same update as one batch of
//! k·b rows, through the real trainer; the shipped schedules choose the documented counts.

mod common;

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
