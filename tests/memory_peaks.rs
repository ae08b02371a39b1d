//! The ledger measures what each checkpoint policy saves, exactly.

use crate::common;

use common::{corpus_loader, cpu};
use trainkit::ops::AttentionPath;
use trainkit::{
    CheckpointPolicy, Full, Gpt2, Gpt2Config, MemoryCategory, NoRecompute, Selective, Trainer,
};

// A model whose classifier dominates activation memory (as in GPT-2, where the logits are
// B·T·V; the fused loss's automatic chunk covers these 32 positions at once), so every
// policy peaks during the loss, with all kept activations live.
fn config() -> Gpt2Config {
    Gpt2Config {
        n_layer: 3,
        n_head: 2,
        n_embd: 32,
        n_positions: 16,
        vocab_size: 4096,
        layer_norm_epsilon: 1e-5,
    }
}

fn activation_peak(policy: Box<dyn CheckpointPolicy>, attention: AttentionPath) -> (u64, u64, u64) {
    let model = Gpt2::new(config()).unwrap().with_attention(attention);
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 2, 16))
        .checkpoint(policy)
        .build()
        .unwrap();
    let s = t.step().unwrap();
    (
        s.memory.peak.get(MemoryCategory::Activations),
        s.memory.peak_total,
        s.stash.dropped_bytes,
    )
}

#[test]
fn recompute_lowers_the_activation_peak_by_the_dropped_bytes() {
    let (b, t, h) = (2u64, 16u64, 2u64);
    let f = 4; // f32
               // The materialized attention keeps its probabilities; selective drops them.
    dropped_bytes_are_saved(AttentionPath::Materialized, b * h * t * t * f);
    // The fused attention keeps one f32 log-sum-exp per row; selective keeps it.
    dropped_bytes_are_saved(AttentionPath::Fused, b * h * t * 4);
}

/// Each policy lowers the activation peak by exactly the bytes it drops; `stats` is the
/// attention's per-layer statistics (probabilities or log-sum-exp).
fn dropped_bytes_are_saved(attention: AttentionPath, stats: u64) {
    let (b, t, c, l) = (2u64, 16u64, 32u64, 3u64);
    let f = 4; // f32
    let materialized = attention == AttentionPath::Materialized;
    let probs = if materialized { stats } else { 0 };
    // Full drops everything but each layer's input.
    let per_layer = 2 * (b * t * 2 * f) // ln1 and ln2 statistics
        + 5 * (b * t * c * f) // ln1_out, attn_out, residual, ln2_out, plus qkv below
        - (b * t * c * f)
        + b * t * 3 * c * f // qkv
        + stats
        + 2 * (b * t * 4 * c * f); // fc_out, gelu_out
    let (none, none_total, none_dropped) = activation_peak(Box::new(NoRecompute), attention);
    let (sel, sel_total, sel_dropped) = activation_peak(Box::new(Selective), attention);
    let (full, full_total, full_dropped) = activation_peak(Box::new(Full), attention);
    assert_eq!(none_dropped, 0);
    assert_eq!(sel_dropped, l * probs);
    assert_eq!(full_dropped, l * per_layer);
    assert_eq!(
        none - sel,
        sel_dropped,
        "selective saves exactly the probabilities"
    );
    assert_eq!(
        none - full,
        full_dropped,
        "full saves everything but layer inputs"
    );
    // The total peak of this small model is the optimizer step (model state), the same
    // for every policy.
    assert_eq!(none_total, sel_total);
    assert_eq!(none_total, full_total);
    assert!(full < sel && sel <= none);
    assert_eq!(sel < none, materialized);
}
