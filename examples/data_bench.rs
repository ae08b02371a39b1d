//! The data path's share of a training step on token shards: how long the loader takes to
//! hand out a batch (mapped shards, shuffled), against a whole optimizer step of a small
//! GPT-2 on the CPU. Figures in docs/benchmarks.md.
//!
//! ```sh
//! cargo run --release --example data_bench -- 'data/fineweb_train_*.bin' [batch] [seq] [steps]
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use trainkit::data::{DataLoader, TokenDataset};
use trainkit::{CpuBackend, Gpt2, Gpt2Config, Trainer, TrainerOptions};

fn main() -> trainkit::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(spec) = args.first() else {
        eprintln!("usage: data_bench SHARDS [batch 8] [seq 128] [steps 10]");
        std::process::exit(2);
    };
    let num =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (batch, seq, steps) = (num(1, 8), num(2, 128), num(3, 10));

    let start = Instant::now();
    let data = TokenDataset::open(Path::new(spec))?;
    let opened = start.elapsed().as_secs_f64();
    let start = Instant::now();
    data.check_ids(50257)?;
    let checked = start.elapsed().as_secs_f64();
    println!(
        "{}: {} tokens; opened in {:.3} s, ids checked in {:.3} s ({:.0} MB/s)",
        data.describe(),
        data.len_tokens(),
        opened,
        checked,
        data.len_tokens() as f64 * 2.0 / 1e6 / checked
    );

    let mut loader = DataLoader::new(data.clone(), batch, seq)?.shuffled(Some(1));
    let n = 2000;
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(loader.next_batch());
    }
    let per_batch = start.elapsed().as_secs_f64() / n as f64;
    println!(
        "next_batch ({batch} × {seq}, shuffled): {:.1} µs per batch",
        per_batch * 1e6
    );

    let config = Gpt2Config {
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
        n_positions: seq,
        vocab_size: 50257,
        layer_norm_epsilon: 1e-5,
    };
    let loader = DataLoader::new(data, batch, seq)?.shuffled(Some(1));
    let mut trainer = Trainer::builder(Gpt2::new(config)?, Arc::new(CpuBackend::new()), loader)
        .options(TrainerOptions {
            total_steps: steps as u64 + 1,
            ..TrainerOptions::default()
        })
        .build()?;
    trainer.step()?; // the first step also creates the optimizer state
    let mut seconds = 0.0;
    for _ in 0..steps {
        seconds += trainer.step()?.seconds;
    }
    let per_step = seconds / steps as f64;
    println!(
        "training step (GPT-2 4 × 128, vocab 50257, CPU): {:.1} ms; the data path's share: {:.4}%",
        per_step * 1e3,
        100.0 * per_batch / per_step
    );
    Ok(())
}
