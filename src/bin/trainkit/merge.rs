//! `trainkit merge`: a LoRA adapter merged into its base, written as a full Hugging Face
//! model directory (what PEFT's `merge_and_unload` and `save_pretrained` give).

use std::path::PathBuf;
use trainkit::{Error, Result};

/// Merge a PEFT LoRA adapter into its base model: `W + (α/r)·B·A` for every projection it
/// adapts, written as a model directory transformers loads.
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct MergeArgs {
    /// The base model directory (config.json and model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// The adapter directory (adapter_config.json and adapter_model.safetensors).
    #[arg(long, value_name = "DIR")]
    adapter: PathBuf,
    /// Where to write the merged model (replaced whole; not the base's directory).
    #[arg(long)]
    out: PathBuf,
    /// The merged weights' dtype: f32, bf16 or f16 (default: the base's).
    #[arg(long)]
    dtype: Option<String>,
}

pub fn run(mut args: MergeArgs) -> Result<()> {
    // A Hugging Face model id (`org/name`) names its snapshot in the local cache.
    args.model = trainkit::save::hub::resolve_model(&args.model)?;
    let base = trainkit::model::read_model_dir(&args.model)?;
    let (lora, updates) = trainkit::adapter::peft::read(&args.adapter)?;
    let dtype = match args.dtype.as_deref() {
        None => trainkit::adapter::merge::weights_dtype(&args.model)?,
        Some("f32") => trainkit::DType::F32,
        Some("bf16") => trainkit::DType::Bf16,
        Some("f16") => trainkit::DType::F16,
        Some(other) => {
            return Err(Error::config(
                "--dtype",
                format!("`{other}` is not a dtype to write: use f32, bf16 or f16"),
            ))
        }
    };
    let model = base.config.build()?;
    let what = args.adapter.display().to_string();
    model
        .with_adapter(std::sync::Arc::new(lora.clone()))
        .map_err(|e| Error::data(&what, format!("does not fit {}: {e}", args.model.display())))?;
    let merged =
        trainkit::adapter::merge::merge(&base, &lora, &updates, model.weights_in_out(), &what)?;
    trainkit::adapter::merge::write_merged(&args.out, &args.model, &merged, dtype)?;
    println!(
        "merged {} (LoRA rank {}, α {} on {}) into {}: {} in {dtype}",
        args.adapter.display(),
        lora.rank,
        lora.alpha,
        lora.targets.join(", "),
        args.model.display(),
        args.out.display()
    );
    Ok(())
}
