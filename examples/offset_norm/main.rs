//! Trains a small Llama whose RMS norms are replaced by a fused op written outside trainkit
//! (examples/offset_norm/offset_norm.rs: Gemma's `1 + w` norm, with its CPU twin and its
//! own CUDA kernels), beside the same model with trainkit's norm. Runs on the GPU when one
//! is usable, else on the CPU; `--emulator` runs it on the CUDA emulator instead.
//!
//! ```sh
//! cargo run --release --example offset_norm
//! ```

mod offset_norm;

use offset_norm::OffsetNorms;
use std::sync::Arc;
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::device::CudaBackend;
use trainkit::model::{Rope, RopeScaling};
use trainkit::{Backend, Device, Llama, LlamaConfig, Trainer};

fn main() -> trainkit::Result<()> {
    let backend: Arc<dyn Backend> = if std::env::args().any(|a| a == "--emulator") {
        println!("using the CUDA emulator");
        Arc::new(CudaBackend::emulated()?)
    } else {
        let (device, why) = Device::best();
        println!("{why}");
        device.backend()?
    };
    let config = LlamaConfig {
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        vocab_size: 256,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        initializer_range: 0.02,
        rope: Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
    };
    let text = SyntheticCorpus::builtin().generate(200_000, 0);
    for (name, model) in [
        ("trainkit's RMS norm", Llama::new(config.clone())?),
        (
            "the offset norm (this example's kernels)",
            Llama::new(config.clone())?.with_override(OffsetNorms),
        ),
    ] {
        let loader = DataLoader::new(ByteTokenizer.encode(&text), 8, 64)?;
        let mut trainer = Trainer::builder(model, Arc::clone(&backend), loader).build()?;
        println!("{name}:");
        for step in 1..=20 {
            let stats = trainer.step()?;
            if step % 5 == 0 {
                println!("  step {step:>3}  loss {:.4}", stats.loss);
            }
        }
    }
    Ok(())
}
