//! The `trainkit` command line.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::sync::Arc;
use trainkit::config::{DataConfig, RunConfig};
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::memory::format_bytes;
use trainkit::{Device, Gpt2, Trainer, TrainerOptions};

#[derive(Parser)]
#[command(
    name = "trainkit",
    version,
    about = "Train transformer language models on one GPU (or the CPU)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no flags: the default small model on the built-in corpus).
    Train(TrainArgs),
}

#[derive(clap::Args, Default)]
struct TrainArgs {
    /// A TOML run config; flags override it.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<u64>,
    /// A UTF-8 text file to train on (tokenized byte by byte) instead of the built-in corpus.
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Print the resolved config as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Train(TrainArgs::default())) {
        Command::Train(args) => train(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn train(args: TrainArgs) -> trainkit::Result<()> {
    let mut cfg = match &args.config {
        Some(path) => RunConfig::from_file(path)?,
        None => RunConfig::default(),
    };
    if let Some(steps) = args.steps {
        cfg.training.steps = steps;
    }
    if let Some(path) = args.data {
        cfg.data = DataConfig::Text { path };
    }
    cfg.validate()?;
    if args.print_config {
        print!("{}", cfg.to_toml()?);
        return Ok(());
    }
    let device = match args.device.as_str() {
        "auto" => {
            let (d, why) = Device::best();
            println!("{why}");
            d
        }
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => {
            return Err(trainkit::Error::config(
                "--device",
                format!("`{other}` is not a device; use auto, cpu or cuda"),
            ))
        }
    };
    let backend = device.backend()?;
    let t = &cfg.training;
    let tokenizer = ByteTokenizer;
    let (train_tokens, val_tokens, floor) = match &cfg.data {
        DataConfig::Builtin { bytes } => {
            let corpus = SyntheticCorpus::builtin();
            let train = tokenizer.encode(&corpus.generate(*bytes, 1));
            let val = tokenizer
                .encode(&corpus.generate((*bytes / 10).max(t.batch_size * t.seq_len + 1), 2));
            (train, val, Some(corpus.entropy_per_byte()))
        }
        DataConfig::Text { path } => {
            let text = std::fs::read_to_string(path).map_err(|e| trainkit::Error::io(path, e))?;
            let tokens = tokenizer.encode(&text);
            let split = tokens.len() - tokens.len() / 10;
            (tokens[..split].to_vec(), tokens[split..].to_vec(), None)
        }
    };
    if cfg.model.vocab_size < tokenizer.vocab_size() {
        return Err(trainkit::Error::config(
            "model.vocab_size",
            format!(
                "{} is smaller than the byte tokenizer's {}; use at least {}",
                cfg.model.vocab_size,
                tokenizer.vocab_size(),
                tokenizer.vocab_size()
            ),
        ));
    }
    let data = DataLoader::new(train_tokens, t.batch_size, t.seq_len)?;
    let mut val = DataLoader::new(val_tokens, t.batch_size, t.seq_len)?;
    let model = Gpt2::new(cfg.model.clone())?;
    println!("model: {}", trainkit::Model::describe(&model));
    println!(
        "device: {device}; precision {:?}; checkpoint {:?}; batch {} × {} tokens",
        cfg.precision, cfg.checkpoint, t.batch_size, t.seq_len
    );
    if let Some(floor) = floor {
        println!(
            "data: built-in corpus, entropy floor {floor:.4} nats/byte (no model can beat it); \
             uniform guessing is {:.4}",
            (cfg.model.vocab_size as f64).ln()
        );
    }
    let mut trainer = Trainer::new(
        Box::new(model),
        Arc::clone(&backend),
        data,
        cfg.precision.clone(),
        cfg.checkpoint.clone(),
        cfg.optimizer.clone(),
        cfg.accumulation.clone(),
        cfg.observer.clone(),
        TrainerOptions {
            grad_clip: t.grad_clip,
            lr_schedule: t.lr_schedule,
            total_steps: t.steps,
            seed: t.seed,
        },
    )?;
    let mut first_loss = None;
    let mut last_loss = f64::NAN;
    for _ in 0..t.steps {
        let s = trainer.step()?;
        first_loss.get_or_insert(s.loss);
        last_loss = s.loss;
        println!(
            "step {:>5}/{} | loss {:.4} | lr {:.2e} | grad norm {:.3} | {:.0} tok/s | {:.0} ms | peak {}",
            s.step,
            t.steps,
            s.loss,
            s.lr,
            s.grad_norm,
            s.tokens_per_s,
            s.seconds * 1e3,
            format_bytes(s.memory.peak_total)
        );
        if t.eval_every > 0 && s.step % t.eval_every == 0 && s.step < t.steps {
            let v = trainer.evaluate(&mut val, t.eval_batches)?;
            println!("step {:>5} | val loss {v:.4}", s.step);
        }
    }
    let v = trainer.evaluate(&mut val, t.eval_batches)?;
    println!("final val loss {v:.4}");
    if let (Some(first), Some(floor)) = (first_loss, floor) {
        println!(
            "train loss {first:.4} -> {last_loss:.4}; the floor is {floor:.4} ({:.1}% of the gap closed)",
            100.0 * (first - last_loss) / (first - floor)
        );
    }
    Ok(())
}
