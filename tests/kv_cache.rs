//! Incremental decoding with a key/value cache: the logits of tokens run a few at a time
//! against the cache equal those rows of the whole sequence run at once, for every family
//! (GPT-2's learned positions, Llama's rotary embeddings and grouped-query heads, Qwen2's
//! biases, Qwen3's q/k norms), both attention paths and a LoRA adapter; a full cache is
//! refused by name; and generation through the cache draws what rerunning the whole
//! context draws.

use crate::common;

use common::{corpus_loader, cpu, tiny_config};
use std::sync::Arc;
use trainkit::ops::AttentionPath;
use trainkit::{Gpt2, KvCache, Llama, LlamaConfig, Lora, Model, Rng, SamplingOptions, Trainer};

fn llama_config() -> LlamaConfig {
    common::tiny_llama_config()
}

/// The models decoding is checked on, by name.
fn models() -> Vec<(&'static str, Box<dyn Model>)> {
    let llama = || Llama::new(llama_config()).unwrap();
    let lora = Lora {
        dropout: 0.1,
        ..Lora::new(4, 8.0, &["q_proj", "v_proj", "down_proj"]).unwrap()
    };
    let qwen3 = trainkit::Qwen3Config {
        base: LlamaConfig {
            head_dim: 16,
            tie_word_embeddings: true,
            ..llama_config()
        },
        attention_bias: false,
    };
    vec![
        ("gpt2 fused", Box::new(Gpt2::new(tiny_config()).unwrap())),
        (
            "gpt2 materialized",
            Box::new(
                Gpt2::new(tiny_config())
                    .unwrap()
                    .with_attention(AttentionPath::Materialized),
            ),
        ),
        ("llama fused", Box::new(llama())),
        (
            "llama materialized",
            Box::new(llama().with_attention(AttentionPath::Materialized)),
        ),
        (
            "llama lora",
            Box::new(llama().with_adapter(Arc::new(lora)).unwrap()),
        ),
        (
            "qwen2",
            trainkit::ModelConfig::from(trainkit::Qwen2Config {
                base: llama_config(),
            })
            .build()
            .unwrap(),
        ),
        ("qwen3", trainkit::ModelConfig::from(qwen3).build().unwrap()),
    ]
}

type Sampler = Trainer<
    trainkit::Fp32,
    trainkit::NoRecompute,
    trainkit::AdamW,
    trainkit::Constant,
    trainkit::PeakTracker,
>;

/// A trainer of `model` on the CPU, its LoRA `B`s drawn at random (so the adapters act).
fn sampler(model: Box<dyn Model>) -> Sampler {
    let mut t = Trainer::builder(model, cpu(), corpus_loader(4_000, 1, 1, 8))
        .build()
        .unwrap();
    let be = t.backend().clone();
    let mut rng = Rng::new(9);
    for p in t.params_mut() {
        if p.name().contains(".lora_B") {
            let v: Vec<f32> = (0..p.numel())
                .map(|_| (rng.normal() * 0.2) as f32)
                .collect();
            p.set_value(be.as_ref(), &v).unwrap();
        }
    }
    t
}

fn sequence(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 5) % 251).collect()
}

#[test]
fn cached_logits_equal_the_whole_sequences() {
    let tokens = sequence(24);
    for (name, model) in models() {
        let mut t = sampler(model);
        let whole = t.logits(&tokens).unwrap();
        let mut cache = KvCache::new(tokens.len());
        let mut got = Vec::new();
        for (a, b) in [(0, 7), (7, 8), (8, 9), (9, 16), (16, 24)] {
            got.extend(t.logits_cached(&tokens[a..b], &mut cache).unwrap());
        }
        assert_eq!(cache.len(), tokens.len());
        assert_eq!(got.len(), whole.len(), "{name}");
        let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = got
            .iter()
            .zip(&whole)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "{name}: max |diff| {worst} of {scale}"
        );
        // A full cache is refused, naming what would fix it; a cleared one starts over.
        let e = t.logits_cached(&[1], &mut cache).unwrap_err().to_string();
        assert!(e.contains("holds 24 of 24 positions"), "{name}: {e}");
        cache.clear();
        let again = t.logits_cached(&tokens[..5], &mut cache).unwrap();
        assert_eq!(again, got[..again.len()], "{name}");
    }
}

/// The next token's logits, with the head on the last position alone, are the last row
/// of the whole logits: for the whole context, and through the cache (a prompt of several
/// tokens, then one at a time), for every family and both attention paths. A model that
/// does not override it (the trait's default) gives the same.
#[test]
fn last_logits_are_the_last_row_of_the_whole_logits() {
    let tokens = sequence(20);
    for (name, model) in models() {
        let mut t = sampler(model);
        let whole = t.logits(&tokens).unwrap();
        let vocab = whole.len() / tokens.len();
        let close = |got: &[f32], want: &[f32], what: &str| {
            assert_eq!(got.len(), vocab, "{name} {what}");
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-5 * scale,
                "{name} {what}: max |diff| {worst} of {scale}"
            );
        };
        for n in [1, 9, 20] {
            let got = t.last_logits(&tokens[..n], None).unwrap();
            let want = t.logits(&tokens[..n]).unwrap();
            close(&got, &want[(n - 1) * vocab..], &format!("context of {n}"));
        }
        let mut cache = KvCache::new(tokens.len());
        let mut at = 0;
        for b in [9, 10, 11, 20] {
            let got = t.last_logits(&tokens[at..b], Some(&mut cache)).unwrap();
            close(
                &got,
                &whole[(b - 1) * vocab..b * vocab],
                &format!("cached to {b}"),
            );
            at = b;
        }
        assert_eq!(cache.len(), tokens.len());
        let e = t.last_logits(&[], None).unwrap_err().to_string();
        assert!(e.contains("empty"), "{name}: {e}");
    }
}

#[test]
fn bad_decoding_input_is_refused_by_name() {
    let mut t = sampler(Box::new(Gpt2::new(tiny_config()).unwrap()));
    let mut cache = KvCache::new(8);
    let e = t.logits_cached(&[300], &mut cache).unwrap_err().to_string();
    assert!(e.contains("token id 300"), "{e}");
    let e = t.logits_cached(&[], &mut cache).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    let mut big = KvCache::new(33);
    let e = t.logits_cached(&[1], &mut big).unwrap_err().to_string();
    assert!(e.contains("more than the model's n_positions = 32"), "{e}");
    assert!(cache.is_empty() && big.is_empty());
}

/// Greedy generation through the cache draws, token for token, what picking the most
/// likely next token of the whole context each time draws; past the context (a prompt and
/// reply longer than the model's 32 positions) it goes on as without a cache.
#[test]
fn generation_through_the_cache_draws_what_reruns_draw() {
    let greedy = SamplingOptions {
        temperature: 0.0,
        ..SamplingOptions::default()
    };
    for (name, model) in models() {
        let mut t = sampler(model);
        for (prompt, new) in [(5, 12), (20, 20)] {
            let prompt = sequence(prompt);
            let mut streamed = Vec::new();
            let got = t
                .generate_streaming(&prompt, new, greedy, &[], &mut Rng::new(1), &mut |x| {
                    streamed.push(x);
                    Ok(())
                })
                .unwrap();
            assert_eq!(got, streamed, "{name}");
            let mut want = prompt.clone();
            for _ in 0..new {
                let ctx = &want[want.len().saturating_sub(32)..];
                let logits = t.logits(ctx).unwrap();
                let last = &logits[(ctx.len() - 1) * 256..];
                let next = (0..256)
                    .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
                    .unwrap();
                want.push(next as u32);
            }
            assert_eq!(
                got,
                want[prompt.len()..],
                "{name}: {} + {new}",
                prompt.len()
            );
            let uncached = SamplingOptions {
                use_cache: false,
                ..greedy
            };
            let plain = t
                .generate(&prompt, new, uncached, &mut Rng::new(1))
                .unwrap();
            assert_eq!(plain, got, "{name}: without the cache");
        }
    }
}
