//! The flags of `eval` and `sample` that name a saved model, its adapter and the device it
//! runs on, and the f32 trainer both run it with.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use trainkit::data::{DataLoader, TokenizerKind, TOKENIZER_FILE};
use trainkit::model::{read_model_dir, ModelDir};
use trainkit::{AdamW, Constant, Fp32, NoRecompute, PeakTracker, Result, Trainer};

/// A saved model to run: `--model`, `--adapter`, `--qlora` and `--device`.
#[derive(clap::Args)]
pub struct SavedModelArgs {
    /// A model directory (config.json and model.safetensors), or a Hugging Face model id
    /// (org/name) in the local Hugging Face cache.
    #[arg(long)]
    pub model: PathBuf,
    /// A PEFT LoRA adapter directory to apply to --model (its base); the model then
    /// computes in f32 as without it.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Store --model's projections in NF4 (QLoRA's base, quantized as bitsandbytes does)
    /// and dequantize them on the fly: without --adapter, what quantization alone costs.
    #[arg(long)]
    pub qlora: bool,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub device: String,
}

/// The trainer `eval` and `sample` run a saved model with: f32, no recompute.
pub type SavedTrainer = Trainer<Fp32, NoRecompute, AdamW, Constant, PeakTracker>;

impl SavedModelArgs {
    /// Reads the model directory (a Hugging Face model id first resolved to its snapshot
    /// in the local cache, which `--model` then names).
    pub fn open(&mut self) -> Result<ModelDir> {
        self.model = trainkit::save::hub::resolve_model(&self.model)?;
        read_model_dir(&self.model)
    }

    /// The Hugging Face tokenizer in the model directory, if it holds a `tokenizer.json`.
    pub fn dir_tokenizer(&self) -> Option<TokenizerKind> {
        let file = self.model.join(TOKENIZER_FILE);
        file.is_file().then_some(TokenizerKind::HuggingFace(file))
    }

    /// An f32 trainer on the `--device` device holding `dir`'s weights (and the adapter's,
    /// over an NF4 base with `--qlora`), reading `data`.
    pub fn trainer(&self, dir: &ModelDir, data: DataLoader) -> Result<SavedTrainer> {
        let backend = crate::device(&self.device)?.backend()?;
        let mut model = dir.config.build()?;
        let adapter = self.adapter.as_deref();
        if let Some(a) = adapter {
            let (lora, _) = trainkit::adapter::peft::read(a)?;
            let lora = if self.qlora {
                lora.with_nf4_base()
            } else {
                lora
            };
            model = model.with_adapter(Arc::new(lora))?;
        } else if self.qlora {
            let frozen = trainkit::adapter::Frozen {
                base: trainkit::adapter::BaseWeights::Nf4,
            };
            model = model.with_adapter(Arc::new(frozen))?;
        }
        let mut trainer = Trainer::builder(model, backend, data).build()?;
        trainer.load_weights(dir)?;
        if let Some(a) = adapter {
            trainer.load_adapter(a)?;
        }
        Ok(trainer)
    }

    /// What a loss or an error is about: the adapter when there is one, else the model.
    pub fn subject(&self) -> &Path {
        self.adapter.as_deref().unwrap_or(&self.model)
    }
}

/// The tokenizer a model most likely reads, when nothing says otherwise.
pub fn default_tokenizer(vocab_size: usize) -> TokenizerKind {
    if vocab_size >= trainkit::data::Gpt2Tokenizer::VOCAB_SIZE {
        TokenizerKind::Gpt2
    } else {
        TokenizerKind::Bytes
    }
}
