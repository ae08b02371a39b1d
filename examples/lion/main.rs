//! Trains the tiny GPT-2 on the built-in corpus with Lion, an optimizer written outside
//! trainkit (examples/lion/lion.rs): its update is a user kernel with CUDA C source and a
//! CPU twin. Runs on the GPU when one is usable, else on the CPU.
//!
//! ```sh
//! cargo run --release --example lion
//! ```

mod lion;

use lion::Lion;
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::{Device, Gpt2, Gpt2Config, Trainer};

fn main() -> trainkit::Result<()> {
    let (device, why) = Device::best();
    println!("{why}");
    let model = Gpt2::new(Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        n_positions: 64,
        vocab_size: 256,
        layer_norm_epsilon: 1e-5,
    })?;
    let text = SyntheticCorpus::builtin().generate(200_000, 0);
    let loader = DataLoader::new(ByteTokenizer.encode(&text), 8, 64)?;
    let mut trainer = Trainer::builder(model, device.backend()?, loader)
        .optimizer(Lion {
            lr: 2e-3,
            weight_decay: 0.1,
            ..Lion::default()
        })
        .build()?;
    for step in 1..=30 {
        let stats = trainer.step()?;
        if step % 5 == 0 {
            println!("step {step:>3}  loss {:.4}", stats.loss);
        }
    }
    // The optimizer in a config file: `[optimizer] kind = "lion"`.
    let opt: Box<dyn trainkit::Optimizer> = Box::new(Lion::default());
    println!(
        "[optimizer]\n{}",
        toml::to_string(&opt).expect("Lion serializes")
    );
    Ok(())
}
