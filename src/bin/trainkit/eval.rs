//! `trainkit eval`.

use std::path::{Path, PathBuf};
use trainkit::config::DataConfig;
use trainkit::data::{DataLoader, TokenizerKind, TOKENIZER_FILE};
use trainkit::model::read_model_dir;
use trainkit::{Error, Result};

/// Mean cross-entropy of a saved model over token data: every position once (the last
/// batch padded, its padding left out), or the first `--batches` batches of that pass.
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct EvalArgs {
    /// A model directory (config.json and model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// A PEFT LoRA adapter directory to apply to --model (its base); the model then
    /// computes in f32 as without it.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Store --model's projections in NF4 (QLoRA's base, quantized as bitsandbytes does)
    /// and dequantize them on the fly: without --adapter, what quantization alone costs.
    #[arg(long)]
    qlora: bool,
    /// An llm.c token file, or a text file tokenized with --tokenizer.
    #[arg(long)]
    data: PathBuf,
    /// Tokenizer for text data: gpt2, bytes, or a Hugging Face tokenizer.json (default: the
    /// model directory's tokenizer.json if it has one, else gpt2 for models with GPT-2's
    /// vocabulary, else bytes).
    #[arg(long)]
    tokenizer: Option<TokenizerKind>,
    /// Mask documents as `train --document-mask` does: each ends at the tokenizer's
    /// end-of-text token (or --separator-id), attends only within itself, and the position
    /// holding the separator is left out of the loss.
    #[arg(long)]
    document_mask: bool,
    /// The token that ends a document (implies --document-mask).
    #[arg(long, value_name = "ID")]
    separator_id: Option<u32>,
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
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Print one JSON line `{"loss": ..., "tokens": ...}` instead of text.
    #[arg(long)]
    json: bool,
}

/// The Hugging Face tokenizer in the model directory `dir`, if it holds a
/// `tokenizer.json`.
pub fn model_dir_tokenizer(dir: &Path) -> Option<TokenizerKind> {
    let file = dir.join(TOKENIZER_FILE);
    file.is_file().then_some(TokenizerKind::HuggingFace(file))
}

/// The tokenizer a model most likely reads, when nothing says otherwise.
pub fn default_tokenizer(vocab_size: usize) -> TokenizerKind {
    if vocab_size >= trainkit::data::Gpt2Tokenizer::VOCAB_SIZE {
        TokenizerKind::Gpt2
    } else {
        TokenizerKind::Bytes
    }
}

pub fn run(mut args: EvalArgs) -> Result<()> {
    // A Hugging Face model id (`org/name`) names its snapshot in the local cache.
    args.model = trainkit::save::hub::resolve_model(&args.model)?;
    if args.batches == Some(0) || args.batch_size == 0 || args.seq_len == 0 {
        return Err(Error::config(
            "--batches/--batch-size/--seq-len",
            "must each be at least 1",
        ));
    }
    let dir = read_model_dir(&args.model)?;
    let tokenizer = args
        .tokenizer
        .clone()
        .or_else(|| model_dir_tokenizer(&args.model))
        .unwrap_or_else(|| default_tokenizer(dir.config.vocab_size()));
    let mut source = DataConfig::from_path(&args.data, Some(tokenizer));
    if args.document_mask || args.separator_id.is_some() {
        source.set_document_mask(true, args.separator_id)?;
    }
    let tokens = source.train_dataset()?;
    tokens.check_ids(dir.config.vocab_size())?;
    let data =
        DataLoader::new(tokens, args.batch_size, args.seq_len)?.separated_by(source.separator()?);
    let mut trainer = crate::trainer_for(
        &dir,
        args.adapter.as_deref(),
        args.qlora,
        &args.device,
        data.clone(),
    )?;
    let eval = trainer.evaluate_once(&data, args.batches)?;
    let loss = eval.loss;
    if !loss.is_finite() {
        return Err(Error::data(
            args.adapter
                .as_deref()
                .unwrap_or(&args.model)
                .display()
                .to_string(),
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
