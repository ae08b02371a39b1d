//! `trainkit eval`.

use crate::saved_model::{default_tokenizer, SavedModelArgs};
use std::path::PathBuf;
use trainkit::config::{DataConfig, DocumentFlags};
use trainkit::data::{DataLoader, TokenizerKind};
use trainkit::{Error, Result};

/// Mean cross-entropy of a saved model over token data: every position once (the last
/// batch padded, its padding left out), or the first `--batches` batches of that pass.
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct EvalArgs {
    /// The model, its adapter and the device.
    #[command(flatten)]
    saved: SavedModelArgs,
    /// An llm.c token file, or a text file tokenized with --tokenizer.
    #[arg(long)]
    data: PathBuf,
    /// Tokenizer for text data: gpt2, bytes, or a Hugging Face tokenizer.json (default: the
    /// model directory's tokenizer.json if it has one, else gpt2 for models with GPT-2's
    /// vocabulary, else bytes).
    #[arg(long)]
    tokenizer: Option<TokenizerKind>,
    /// `--document-mask` and `--separator-id`, as `trainkit train` takes them.
    #[command(flatten)]
    documents: DocumentFlags,
    /// Rows per batch.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// At most this many batches, in order from the start of the data (default: the
    /// whole data once; never wrapping around it).
    #[arg(long)]
    batches: Option<usize>,
    /// Print one JSON line `{"loss": ..., "tokens": ...}` instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(mut args: EvalArgs) -> Result<()> {
    if args.batches == Some(0) || args.batch_size == 0 || args.seq_len == 0 {
        return Err(Error::config(
            "--batches/--batch-size/--seq-len",
            "must each be at least 1",
        ));
    }
    let dir = args.saved.open()?;
    let tokenizer = args
        .tokenizer
        .clone()
        .or_else(|| args.saved.dir_tokenizer())
        .unwrap_or_else(|| default_tokenizer(dir.config.vocab_size()));
    let mut source = DataConfig::from_path(&args.data, Some(tokenizer));
    args.documents.apply(&mut source)?;
    let tokens = source.train_dataset()?;
    tokens.check_ids(dir.config.vocab_size())?;
    let data =
        DataLoader::new(tokens, args.batch_size, args.seq_len)?.separated_by(source.separator()?);
    let mut trainer = args.saved.trainer(dir, data.clone())?;
    let eval = trainer.evaluate_once(&data, args.batches)?;
    let loss = eval.loss;
    if !loss.is_finite() {
        return Err(Error::data(
            args.saved.subject().display().to_string(),
            format!(
                "gives a loss of {loss} on {} ({} positions counted): its weights (or the \
                 data's ids, or a loss mask that leaves every position out) do not make a \
                 finite loss",
                args.data.display(),
                eval.counted
            ),
        ));
    }
    let of = data.batches_once();
    let positions = data.positions_once(args.batches);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "loss": loss,
                "tokens": positions,
                "trained_tokens": eval.counted,
                "batches": eval.batches,
                "whole_data": eval.batches == of,
            })
        );
    } else {
        let over = if eval.batches == of {
            "the whole data once".to_string()
        } else {
            format!("the first {} of its {of} batches", eval.batches)
        };
        let counted = if eval.counted < positions {
            format!("the {} trained of {positions} positions", eval.counted)
        } else {
            format!("{positions} positions")
        };
        println!(
            "loss {loss:.6} nats/token over {counted}, {over} (perplexity {:.3})",
            loss.exp()
        );
    }
    Ok(())
}
