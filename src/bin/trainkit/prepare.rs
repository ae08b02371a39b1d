//! `trainkit prepare`: text to llm.c token files.

use std::path::PathBuf;
use trainkit::data::{prepare, TokenizerKind};
use trainkit::Result;

/// Tokenize a text file into llm.c token files: the train file at --out and, with a
/// nonzero --val-fraction, a `_val` file beside it.
#[derive(clap::Args)]
pub struct PrepareArgs {
    /// The UTF-8 text to tokenize.
    #[arg(long)]
    text: PathBuf,
    /// The train token file to write (e.g. data/shakespeare.bin; the val file becomes
    /// data/shakespeare_val.bin).
    #[arg(long)]
    out: PathBuf,
    /// gpt2 (BPE, vocabulary 50257) or bytes (vocabulary 256).
    #[arg(long, default_value = "gpt2")]
    tokenizer: TokenizerKind,
    /// Fraction of the tokens, from the end of the text, written to the val file.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    let r = prepare(&args.text, &args.out, args.tokenizer, args.val_fraction)?;
    println!(
        "wrote {} train tokens to {}",
        r.train_tokens,
        r.train_path.display()
    );
    if let Some(val) = &r.val_path {
        println!("wrote {} val tokens to {}", r.val_tokens, val.display());
    }
    println!(
        "train on them with: trainkit train --data {} --tokenizer {}{}",
        r.train_path.display(),
        args.tokenizer,
        if args.tokenizer == TokenizerKind::Gpt2 {
            " --vocab-size 50257"
        } else {
            ""
        }
    );
    Ok(())
}
