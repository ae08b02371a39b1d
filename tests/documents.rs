//! Rows that hold several documents (packed examples, a stream cut at its separators):
//! attention stays within each document and positions restart at 0, so a packed row gives
//! each document exactly what it gets alone. Checked on whole models (GPT-2's learned
//! positions, Llama's rotary ones; fused and materialized attention; rows longer than the
//! CPU's 256-key tiles, so whole tiles are skipped): the loss of a packed step is the
//! token-weighted mean of the documents' solo losses and its gradient the token-weighted
//! mean of their solo gradients, to f32 rounding; recomputation stays bitwise.

use crate::common;

use common::{cpu, grads, tiny_config};
use trainkit::data::token_flags::{DOCUMENT_START, TRAINED};
use trainkit::data::{DataLoader, Shard, TokenDataset};
use trainkit::model::{Rope, RopeScaling};
use trainkit::ops::AttentionPath;
use trainkit::{
    AdamW, CheckpointPolicy, Fp32, Full, Gpt2, Gpt2Config, Llama, LlamaConfig, Model, NoRecompute,
    Rng, Trainer, TrainerOptions,
};

/// Tokens per row.
const T: usize = 320;

fn gpt2() -> Gpt2Config {
    Gpt2Config {
        n_positions: T,
        ..tiny_config()
    }
}

fn llama() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        vocab_size: 256,
        max_position_embeddings: T,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        initializer_range: 0.1,
        rope: Rope {
            theta: 500.0,
            scaling: RopeScaling::Default,
        },
    }
}

/// Documents as their tokens with flags: the first token starts the document, the rest
/// are trained targets.
fn documents(lengths: &[usize], rng: &mut Rng) -> Vec<(Vec<u32>, Vec<u8>)> {
    lengths
        .iter()
        .map(|&n| {
            let tokens = (0..n).map(|_| rng.below(256) as u32).collect();
            let mut flags = vec![TRAINED; n];
            flags[0] = DOCUMENT_START;
            (tokens, flags)
        })
        .collect()
}

/// `rows` rows of `t` tokens from the documents laid end to end, and one more token (a
/// document start, so the last position predicts nothing).
fn loader(docs: &[&(Vec<u32>, Vec<u8>)], rows: usize, t: usize) -> DataLoader {
    let mut tokens: Vec<u32> = docs.iter().flat_map(|d| d.0.clone()).collect();
    let mut flags: Vec<u8> = docs.iter().flat_map(|d| d.1.clone()).collect();
    assert_eq!(tokens.len(), rows * t);
    tokens.push(0);
    flags.push(DOCUMENT_START);
    let shard = Shard::from_tokens_and_flags(tokens, flags).unwrap();
    DataLoader::new(TokenDataset::from_shards(vec![shard]), rows, t).unwrap()
}

/// The loss and gradients of one step on `data` (learning rate 0: nothing changes).
fn step(
    model: Box<dyn Model>,
    data: DataLoader,
    policy: Box<dyn CheckpointPolicy>,
) -> (f64, Vec<Vec<f32>>) {
    let mut t = Trainer::builder(model, cpu(), data)
        .precision(Fp32)
        .checkpoint(policy)
        .optimizer(AdamW {
            lr: 0.0,
            ..AdamW::default()
        })
        .options(TrainerOptions {
            grad_clip: 0.0,
            ..TrainerOptions::default()
        })
        .build()
        .unwrap();
    let stats = t.step().unwrap();
    (stats.loss, grads(&t))
}

/// A model with the given attention.
type MakeModel = fn(AttentionPath) -> Box<dyn Model>;

fn worst_relative(got: &[Vec<f32>], want: &[Vec<f64>]) -> f64 {
    let scale = want
        .iter()
        .flatten()
        .fold(0f64, |m, v| m.max(v.abs()))
        .max(1e-12);
    got.iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0f64, f64::max)
        / scale
}

#[test]
fn a_packed_row_gives_each_document_its_solo_loss_and_gradients() {
    let mut rng = Rng::new(5);
    // Row 0: documents of 3, 253 and 64 tokens (the last starts at key tile 256, so the
    // fused attention skips tile 0 for it); row 1: 100 and 220.
    let lengths = [3usize, 253, 64, 100, 220];
    let docs = documents(&lengths, &mut rng);
    let models: [(&str, MakeModel); 2] = [
        ("gpt2", |p| {
            Box::new(Gpt2::new(gpt2()).unwrap().with_attention(p))
        }),
        ("llama", |p| {
            Box::new(Llama::new(llama()).unwrap().with_attention(p))
        }),
    ];
    for (name, model) in models {
        for path in [AttentionPath::Fused, AttentionPath::Materialized] {
            let all: Vec<_> = docs.iter().collect();
            let (loss, packed) = step(model(path), loader(&all, 2, T), Box::new(NoRecompute));
            // Each document alone, weighted by its trained positions (its length less one).
            let counted: usize = lengths.iter().map(|n| n - 1).sum();
            let mut want_loss = 0f64;
            let mut want: Vec<Vec<f64>> = packed.iter().map(|g| vec![0.0; g.len()]).collect();
            for d in &docs {
                let n = d.0.len();
                let (l, g) = step(model(path), loader(&[d], 1, n), Box::new(NoRecompute));
                let weight = (n - 1) as f64 / counted as f64;
                want_loss += weight * l;
                for (w, g) in want.iter_mut().zip(&g) {
                    for (w, g) in w.iter_mut().zip(g) {
                        *w += weight * *g as f64;
                    }
                }
            }
            assert!(
                (loss - want_loss).abs() < 1e-5 * want_loss,
                "{name} {path}: packed loss {loss} against the documents' {want_loss}"
            );
            let e = worst_relative(&packed, &want);
            assert!(e < 1e-4, "{name} {path}: gradients differ by {e:.2e}");

            // Recomputation changes nothing, bit for bit.
            let (full_loss, full) = step(model(path), loader(&all, 2, T), Box::new(Full));
            assert_eq!(full_loss.to_bits(), loss.to_bits(), "{name} {path}");
            assert!(full == packed, "{name} {path}: Full recompute differs");
        }
    }
}

/// Document masking needs a separator: the bytes tokenizer has none, so it must be named;
/// the built-in corpus is one document.
#[test]
fn document_masking_without_a_separator_is_a_clear_error() {
    let dir = common::scratch("documents-cli");
    let text = dir.join("t.txt");
    std::fs::write(&text, "to be or not to be\n".repeat(200)).unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--steps",
            "1",
            "--n-layer",
            "1",
            "--n-head",
            "1",
            "--n-embd",
            "8",
            "--seq-len",
            "16",
            "--batch-size",
            "1",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        common::trainkit(&args)
    };
    let t = text.to_str().unwrap();
    let (ok, _, err) = train(&["--data", t, "--tokenizer", "bytes", "--document-mask"]);
    assert!(!ok && err.contains("--separator-id"), "{err}");
    let (ok, _, err) = train(&["--document-mask"]);
    assert!(!ok && err.contains("--document-mask"), "{err}");
    // With the newline as the separator it trains.
    let (ok, out, err) = train(&["--data", t, "--tokenizer", "bytes", "--separator-id", "10"]);
    assert!(ok, "{out}\n{err}");
}
