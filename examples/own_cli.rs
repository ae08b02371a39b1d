//! A training command of your own on trainkit's flags: a downstream binary flattens
//! `RunFlags` (`--config`, `--resume`, `--adapter` and every flag of `trainkit train`'s
//! run settings), resolves them into a run config as `trainkit train` does, adds a flag
//! of its own and trains.
//!
//! `cargo run --release --example own_cli -- --steps 20 --arch llama --n-layer 2 --every 5`

use clap::Parser;
use std::sync::Arc;
use trainkit::config::{Resolved, RunFlags};
use trainkit::{Device, PeakTracker};

/// Trains a model from trainkit's run settings, printing every `--every` steps.
#[derive(Parser)]
struct Cli {
    /// trainkit's run settings: `--config`, `--resume`, `--data`, `--steps`,
    /// `--precision`, `--lora-rank`, ...
    #[command(flatten)]
    run: RunFlags,
    /// Print the loss every N steps.
    #[arg(long, default_value_t = 10)]
    every: u64,
}

fn main() -> trainkit::Result<()> {
    let cli = Cli::parse();
    let Resolved { config, defaults } = cli.run.resolve()?;
    if let Some(line) = defaults {
        println!("{line}");
    }
    println!("{}", config.setup_line()?);
    let (device, why) = Device::best();
    println!("{why}");
    let data = config.loaders()?;
    let mut trainer = config.trainer(
        config.build_model()?,
        Arc::clone(&device.backend()?),
        data.train,
        Box::new(PeakTracker::new()),
        None,
    )?;
    // Weights as `trainkit train` starts them: a model directory's (and an adapter's on
    // it), then a resumed run's state.
    if let Some(dir) = &config.training.init_from {
        trainer.load_weights(&trainkit::model::read_model_dir(dir)?)?;
    }
    if let Some(dir) = &cli.run.adapter {
        trainer.load_adapter(dir)?;
    }
    if let Some(dir) = &cli.run.resume {
        trainer.resume_from(dir)?;
    }
    while trainer.steps_done() < config.training.steps {
        let s = trainer.step()?;
        if s.step % cli.every.max(1) == 0 || s.step == config.training.steps {
            println!("step {:>5} | loss {:.4}", s.step, s.loss);
        }
    }
    let v = trainer.evaluate_once(&data.val, None)?;
    println!("val loss {:.4} over {} positions", v.loss, v.counted);
    if let Some(dir) = &config.output.out {
        trainer.save(dir, Some(&config.to_toml()?))?;
        println!("saved to {}", dir.display());
    }
    Ok(())
}
