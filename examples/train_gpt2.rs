//! A trainer assembled in code, the policies chosen as types: bf16 compute with f32
//! master weights, selective recomputation, AdamW, a fixed number of tokens per step,
//! and a peak tracker. Trains a small GPT-2 on the built-in corpus (or on the llm.c token
//! file given as the first argument, with GPT-2's vocabulary), samples from it and saves
//! it where transformers' `GPT2LMHeadModel.from_pretrained` can load it.
//!
//! `cargo run --release --example train_gpt2 [-- data/corpus.bin]`

use std::sync::Arc;
use trainkit::data::{read_token_file, ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::memory::format_bytes;
use trainkit::{
    AdamW, CpuBackend, Gpt2, Gpt2Config, LrSchedule, MixedBf16, PeakTracker, Rng, SamplingOptions,
    Selective, TokensPerStep, Trainer, TrainerOptions,
};

fn main() -> trainkit::Result<()> {
    let (tokens, vocab_size) = match std::env::args().nth(1) {
        Some(path) => (read_token_file(path.as_ref())?, 50257),
        None => {
            let text = SyntheticCorpus::builtin().generate(1 << 20, 1);
            (ByteTokenizer.encode(&text), 256)
        }
    };
    let config = Gpt2Config {
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
        n_positions: 128,
        vocab_size,
        layer_norm_epsilon: 1e-5,
    };
    let steps = 200;
    let data = DataLoader::new(tokens, 8, 128)?;
    let mut trainer: Trainer<MixedBf16, Selective, AdamW, TokensPerStep, PeakTracker> =
        Trainer::builder(Gpt2::new(config)?, Arc::new(CpuBackend::new()), data)
            .precision(MixedBf16 { fp32_grads: false })
            .checkpoint(Selective)
            .optimizer(AdamW {
                lr: 2e-3,
                ..AdamW::default()
            })
            .accumulation(TokensPerStep {
                tokens: 4 * 8 * 128,
            })
            .observer(PeakTracker::new())
            .options(TrainerOptions {
                grad_clip: 1.0,
                lr_schedule: LrSchedule::Cosine {
                    warmup_steps: 20,
                    decay_steps: 0,
                    min_lr_ratio: 0.1,
                },
                total_steps: steps,
                seed: 1337,
                ..TrainerOptions::default()
            })
            .build()?;
    for _ in 0..steps {
        let s = trainer.step()?;
        if s.step % 20 == 0 {
            println!(
                "step {:>4} | loss {:.4} | {} micro-batches | {:.0} tok/s | peak {}",
                s.step,
                s.loss,
                s.micro_batches,
                s.tokens_per_s,
                format_bytes(s.memory.peak_total)
            );
        }
    }
    if vocab_size == 256 {
        let prompt = ByteTokenizer.encode("the ");
        let options = SamplingOptions {
            temperature: 0.8,
            top_k: 20,
            ..SamplingOptions::default()
        };
        let new = trainer.generate(&prompt, 80, options, &mut Rng::new(7))?;
        println!("sample: the {}", ByteTokenizer.decode(&new));
    }
    let out = std::env::temp_dir().join("trainkit-train-gpt2");
    trainer.save(&out, None)?;
    println!("saved to {}", out.display());
    Ok(())
}
