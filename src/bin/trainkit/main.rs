//! The `trainkit` command line: train, eval, sample, prepare, memory, merge.

mod eval;
mod fit;
mod memory;
mod merge;
mod observe;
mod prepare;
mod progress;
mod sample;
mod saved_model;
mod train;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use trainkit::{Device, Error, Result};

#[derive(Parser)]
#[command(
    name = "trainkit",
    version,
    about = "Train transformer language models on one GPU (or the CPU)",
    long_about = "Train GPT-2 style language models with mixed precision, activation \
                  recomputation and gradient accumulation as pluggable policies. With no \
                  subcommand, `trainkit` trains the default small model on the built-in \
                  corpus."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no flags: the default small model on the built-in corpus).
    Train(Box<train::TrainArgs>),
    /// Mean cross-entropy of a saved model on token data.
    Eval(eval::EvalArgs),
    /// Generate text from a saved model.
    Sample(sample::SampleArgs),
    /// Tokenize a text file into llm.c token files (train and val).
    Prepare(prepare::PrepareArgs),
    /// Memory of training a model with AdamW, by the Ultra-Scale Playbook's formulas.
    Memory(Box<memory::MemoryArgs>),
    /// Merge a LoRA adapter into its base model: a full Hugging Face model directory.
    Merge(merge::MergeArgs),
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or_else(default_command) {
        Command::Train(args) => train::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Sample(args) => sample::run(args),
        Command::Prepare(args) => prepare::run(args),
        Command::Memory(args) => memory::run(*args),
        Command::Merge(args) => merge::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What a bare `trainkit` runs: `trainkit train` with every default, as clap fills them.
fn default_command() -> Command {
    Cli::parse_from(["trainkit", "train"])
        .command
        .expect("`train` parses to a command")
}

/// The command-line flag of a library field (`kv_heads` → `--kv-heads`).
fn flag_of(field: &str) -> String {
    format!("--{}", field.replace('_', "-"))
}

/// Library errors name fields (`kv_heads`); on the command line they are flags.
fn as_flag(e: Error) -> Error {
    match e {
        Error::Config { field, message } => Error::config(flag_of(&field), message),
        e => e,
    }
}

/// The device a `--device` flag names (`auto` reports what it chose, on stderr).
fn device(name: &str) -> Result<Device> {
    match name {
        "auto" => {
            let (d, why) = Device::best();
            eprintln!("{why}");
            Ok(d)
        }
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => Err(Error::config(
            "--device",
            format!("`{other}` is not a device; use auto, cpu or cuda"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_invocation_is_train_with_its_defaults() {
        match default_command() {
            Command::Train(args) => assert_eq!(args.device(), "auto"),
            _ => panic!("a bare `trainkit` must train"),
        }
    }
}
