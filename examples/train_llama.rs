//! A SmolLM2-shaped Llama, scaled down to train on two CPU cores: the same proportions
//! (grouped-query attention with 3 query heads per key/value head, a SwiGLU MLP of
//! 8/3 × the width, RMSNorm, rotary embeddings with θ = 100000, a tied head), 6 layers of
//! 192 instead of 30 of 576, byte tokens. Trains on Tiny Shakespeare (the path given as the
//! first argument, `../shared/data/tinyshakespeare.txt` by default) in bf16 with selective
//! recomputation, samples from it and saves it where transformers'
//! `LlamaForCausalLM.from_pretrained` can load it.
//!
//! `cargo run --release --example train_llama [-- path/to/text.txt]`

use std::sync::Arc;
use trainkit::data::{ByteTokenizer, DataLoader, Tokenizer};
use trainkit::memory::format_bytes;
use trainkit::model::{Rope, RopeScaling};
use trainkit::{
    AdamW, Constant, CpuBackend, Error, Llama, LlamaConfig, LrSchedule, MixedBf16, Model,
    PeakTracker, Rng, SamplingOptions, Selective, Trainer, TrainerOptions,
};

fn main() -> trainkit::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "../shared/data/tinyshakespeare.txt".to_string());
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let tokens = ByteTokenizer.encode(&text);
    // SmolLM2-135M is 30 layers of 576 (9 heads of 64, 3 key/value heads, MLP 1536).
    let config = LlamaConfig {
        hidden_size: 192,
        intermediate_size: 512,
        num_hidden_layers: 6,
        num_attention_heads: 3,
        num_key_value_heads: 1,
        head_dim: 64,
        vocab_size: 256,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        initializer_range: 0.041_666_666_666_666_664,
        rope: Rope {
            theta: 100_000.0,
            scaling: RopeScaling::Default,
        },
    };
    let model = Llama::new(config)?;
    println!("{}", model.describe());
    let steps = 300;
    let data = DataLoader::new(tokens, 8, 128)?;
    let mut trainer = Trainer::builder(model, Arc::new(CpuBackend::new()), data)
        .precision(MixedBf16 { fp32_grads: false })
        .checkpoint(Selective)
        .optimizer(AdamW {
            lr: 3e-3,
            ..AdamW::default()
        })
        .accumulation(Constant::new(1))
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
        if s.step % 25 == 0 {
            println!(
                "step {:>4} | loss {:.4} | {:.0} tok/s | peak {}",
                s.step,
                s.loss,
                s.tokens_per_s,
                format_bytes(s.memory.peak_total)
            );
        }
    }
    let prompt = ByteTokenizer.encode("ROMEO:\n");
    let options = SamplingOptions {
        temperature: 0.8,
        top_k: 20,
        ..SamplingOptions::default()
    };
    let new = trainer.generate(&prompt, 200, options, &mut Rng::new(7))?;
    println!("sample:\nROMEO:\n{}", ByteTokenizer.decode(&new));
    let out = std::env::temp_dir().join("trainkit-train-llama");
    trainer.save(&out, None)?;
    println!("saved to {}", out.display());
    Ok(())
}
