//! `trainkit sample`.

use crate::eval::{default_tokenizer, model_dir_tokenizer};
use std::path::PathBuf;
use trainkit::config::RunConfig;
use trainkit::data::{DataLoader, TokenizerKind};
use trainkit::save::{read_model_dir, RUN_CONFIG_FILE};
use trainkit::{Error, Result, Rng, SamplingOptions};

/// Generate text from a saved model.
#[derive(clap::Args)]
pub struct SampleArgs {
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
    /// Text to continue.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 100)]
    max_new_tokens: usize,
    /// Softmax temperature (0 = always the most likely token).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Sample among the K most likely tokens only (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// gpt2, bytes, or a Hugging Face tokenizer.json (or a directory that holds one)
    /// (default: the model directory's tokenizer.json if it has one, else what the run
    /// that saved the model used).
    #[arg(long)]
    tokenizer: Option<TokenizerKind>,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
}

pub fn run(args: SampleArgs) -> Result<()> {
    let dir = read_model_dir(&args.model)?;
    let saved = args.model.join(RUN_CONFIG_FILE);
    let tokenizer = match (args.tokenizer, model_dir_tokenizer(&args.model)) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) if saved.is_file() => RunConfig::from_file(&saved)?.data.tokenizer(),
        (None, None) => default_tokenizer(dir.config.vocab_size()),
    };
    let tok = tokenizer.build()?;
    if tok.vocab_size() > dir.config.vocab_size() {
        return Err(Error::config(
            "--tokenizer",
            format!(
                "the {tokenizer} tokenizer has {} ids, more than the model's vocabulary of \
                 {}; sample with the tokenizer the model was trained with (--tokenizer)",
                tok.vocab_size(),
                dir.config.vocab_size()
            ),
        ));
    }
    let prompt = tok.try_encode(&args.prompt)?;
    let placeholder = DataLoader::new(vec![0; 2], 1, 1)?;
    let mut trainer = crate::trainer_for(
        &dir,
        args.adapter.as_deref(),
        args.qlora,
        &args.device,
        placeholder,
    )?;
    let mut rng = Rng::new(args.seed);
    let new = trainer.generate(
        &prompt,
        args.max_new_tokens,
        SamplingOptions {
            temperature: args.temperature,
            top_k: args.top_k,
        },
        &mut rng,
    )?;
    println!("{}{}", args.prompt, tok.decode(&new));
    Ok(())
}
