//! MFU and HFU: model FLOPs by llm.c's count, hardware FLOPs as the backend executed them,
//! recomputation included.

use crate::common;

use common::{corpus_loader, cpu, tiny_config};
use trainkit::ops::AttentionPath;
use trainkit::{
    CheckpointPolicy, Full, Gpt2, Model, NoRecompute, Selective, StepStats, Trainer, TrainerOptions,
};

fn step(policy: Box<dyn CheckpointPolicy>, peak_flops: Option<f64>) -> StepStats {
    step_with(policy, peak_flops, AttentionPath::Fused)
}

fn step_with(
    policy: Box<dyn CheckpointPolicy>,
    peak_flops: Option<f64>,
    attention: AttentionPath,
) -> StepStats {
    let mut t = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap().with_attention(attention),
        cpu(),
        corpus_loader(20_000, 2, 2, 32),
    )
    .checkpoint(policy)
    .options(TrainerOptions {
        peak_flops,
        ..TrainerOptions::default()
    })
    .build()
    .unwrap();
    t.step().unwrap();
    t.step().unwrap()
}

#[test]
fn mfu_and_hfu_divide_flops_by_time_and_peak() {
    let peak = 1e11;
    let s = step(Box::new(NoRecompute), Some(peak));
    let c = tiny_config();
    let model = Gpt2::new(c.clone()).unwrap();
    assert_eq!(s.model_flops, model.flops_per_token(32) * s.tokens as f64);
    let per_token = 6.0 * c.num_params() as f64 + 6.0 * (c.n_layer * c.n_embd * 32) as f64;
    assert_eq!(s.model_flops, per_token * 64.0);
    let mfu = s.mfu.unwrap();
    let hfu = s.hfu.unwrap();
    assert!((mfu - s.model_flops / s.seconds / peak).abs() <= 1e-12 * mfu.max(1.0));
    assert!((hfu - s.hardware_flops as f64 / s.seconds / peak).abs() <= 1e-12 * hfu.max(1.0));
    // Without recompute the executed work is the model's, give or take the ops llm.c's
    // count leaves out (norms, softmax, GELU, the optimizer).
    let ratio = s.hardware_flops as f64 / s.model_flops;
    assert!((0.9..1.2).contains(&ratio), "hardware / model = {ratio}");
    let unknown = step(Box::new(NoRecompute), None);
    assert_eq!((unknown.mfu, unknown.hfu), (None, None));
    assert_eq!(
        unknown.hardware_flops, s.hardware_flops,
        "counts are deterministic"
    );
}

#[test]
fn hfu_counts_the_recomputed_forward_work() {
    let materialized = AttentionPath::Materialized;
    let none = step_with(Box::new(NoRecompute), None, materialized);
    let sel = step_with(Box::new(Selective), None, materialized);
    let full = step_with(Box::new(Full), None, materialized);
    assert_eq!(
        none.model_flops, full.model_flops,
        "MFU ignores recomputation"
    );
    let c = tiny_config();
    let (bt, ch, l) = (64u64, c.n_embd as u64, c.n_layer as u64);
    // Full recomputation reruns each layer's QKV, attention projection and MLP input
    // projection (2·BT·C·(3C + C + 4C) flops) before its backward, plus attention.
    let full_extra = full.hardware_flops - none.hardware_flops;
    assert!(full_extra >= l * 16 * bt * ch * ch, "{full_extra}");
    // Selective reruns only QKᵀ and the softmax: some work, less than full.
    let sel_extra = sel.hardware_flops - none.hardware_flops;
    assert!(
        sel_extra > 0 && sel_extra < full_extra,
        "{sel_extra} vs {full_extra}"
    );
    // With the fused attention there is nothing quadratic to drop: selective reruns
    // nothing, full still reruns each layer.
    let none = step(Box::new(NoRecompute), None);
    let sel = step(Box::new(Selective), None);
    let full = step(Box::new(Full), None);
    assert_eq!(sel.hardware_flops, none.hardware_flops);
    assert!(full.hardware_flops - none.hardware_flops >= l * 16 * bt * ch * ch);
}
