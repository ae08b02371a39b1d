//! Mixed precision tracks f32 training; the precision decides where every byte lives.

use crate::common;

use common::{corpus_loader, cpu};
use trainkit::{
    DType, Fp32, Gpt2, Gpt2Config, MemoryCategory, MixedBf16, Precision, Trainer, TrainerOptions,
};

fn final_loss<P: Precision>(precision: P) -> (f64, f64) {
    let cfg = Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        n_positions: 64,
        vocab_size: 256,
        layer_norm_epsilon: 1e-5,
    };
    let model = Gpt2::new(cfg).unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(200_000, 5, 8, 64))
        .precision(precision)
        .optimizer(trainkit::AdamW {
            lr: 1e-3,
            ..Default::default()
        })
        .options(TrainerOptions::default())
        .build()
        .unwrap();
    let steps: Vec<f64> = (0..60).map(|_| t.step().unwrap().loss).collect();
    let last: f64 = steps[55..].iter().sum::<f64>() / 5.0;
    (steps[0], last)
}

#[test]
fn mixed_bf16_tracks_fp32() {
    let (first32, last32) = final_loss(Fp32);
    assert!(last32 < first32 - 1.5, "fp32 learns: {first32} -> {last32}");
    for fp32_grads in [true, false] {
        let (_, last16) = final_loss(MixedBf16 { fp32_grads });
        let rel = (last16 - last32).abs() / last32;
        eprintln!("fp32 {last32:.4}, mixed_bf16 (fp32_grads={fp32_grads}) {last16:.4}");
        assert!(
            rel < 0.02,
            "fp32_grads={fp32_grads}: bf16 final loss {last16} vs fp32 {last32} ({:.2}%)",
            rel * 100.0
        );
    }
}

#[test]
fn mixed_precision_lays_out_bytes_as_documented() {
    let cfg = common::tiny_config();
    let n = cfg.num_params() as u64;
    for (precision, weights, master, grads) in [
        (Box::new(Fp32) as Box<dyn Precision>, 4 * n, 0, 4 * n),
        (
            Box::new(MixedBf16 { fp32_grads: true }),
            2 * n,
            4 * n,
            4 * n,
        ),
        (
            Box::new(MixedBf16 { fp32_grads: false }),
            2 * n,
            4 * n,
            2 * n,
        ),
    ] {
        let model = Gpt2::new(cfg.clone()).unwrap();
        let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 2, 16))
            .precision(precision)
            .build()
            .unwrap();
        let s = t.step().unwrap();
        let live = t.backend().ledger().snapshot().live;
        assert_eq!(live.get(MemoryCategory::Weights), weights);
        assert_eq!(live.get(MemoryCategory::MasterWeights), master);
        assert_eq!(live.get(MemoryCategory::Gradients), grads);
        assert_eq!(
            live.get(MemoryCategory::OptimizerState),
            8 * n,
            "AdamW: two f32 moments"
        );
        assert_eq!(
            live.get(MemoryCategory::Activations),
            0,
            "activations all freed"
        );
        assert_eq!(s.memory.peak.get(MemoryCategory::OptimizerState), 8 * n);
        let dtype = t.params()[0].weight().dtype();
        let want = t.precision().compute_dtype();
        assert_eq!(dtype, want);
        assert_eq!(t.params()[0].value().dtype(), DType::F32);
    }
}
