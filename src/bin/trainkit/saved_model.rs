//! The flags of `eval` and `sample` that name a saved model, its adapter and the device it
//! runs on, and the f32 trainer both run it with.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use trainkit::data::{DataLoader, TokenizerKind, TOKENIZER_FILE};
use trainkit::model::{read_model_dir, ModelDir};
use trainkit::precision::Precision;
use trainkit::{AdamW, Constant, NoRecompute, PeakTracker, Result, Trainer};

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
    /// fp32 (f32 throughout, the default), bf16 or fp16: the dtype the model's weights
    /// are kept and multiplied in (transformers' torch_dtype). Nothing but an adapter
    /// trains here, so bf16 keeps 2 bytes a weight where fp32 keeps 4.
    #[arg(long, default_value = "fp32")]
    pub precision: String,
}

/// The trainer `eval` and `sample` run a saved model with: `--precision`, no recompute.
pub type SavedTrainer = Trainer<Box<dyn Precision>, NoRecompute, AdamW, Constant, PeakTracker>;

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
    pub fn trainer(&self, dir: ModelDir, data: DataLoader) -> Result<SavedTrainer> {
        let precision = trainkit::precision::named(&self.precision, false)
            .map_err(|e| e.for_field("--precision"))?;
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
        } else if self.precision != "fp32" {
            // Frozen, the weights keep no f32 master copy beside the compute dtype's.
            model = model.with_adapter(Arc::new(trainkit::adapter::Frozen::default()))?;
        }
        let mut trainer = Trainer::builder(model, backend, data)
            .precision(precision)
            .init_from(dir)
            .build()?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use trainkit::memory::MemoryCategory;
    use trainkit::{CpuBackend, Gpt2, Gpt2Config};

    /// `--precision bf16` keeps a saved model's weights in bf16 alone (2 bytes a weight, no
    /// f32 master copy beside them); fp32 keeps them in f32.
    #[test]
    fn a_saved_model_is_kept_in_the_precision_asked_for() {
        let dir = std::env::temp_dir().join(format!("trainkit-saved-{}", std::process::id()));
        let config = Gpt2Config {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            n_positions: 16,
            vocab_size: 64,
            layer_norm_epsilon: 1e-5,
        };
        let data = || DataLoader::new(vec![1; 64], 1, 8).unwrap();
        let backend = Arc::new(CpuBackend::new());
        let t = Trainer::builder(Gpt2::new(config).unwrap(), backend, data())
            .build()
            .unwrap();
        let params: u64 = t.params().iter().map(|p| p.numel() as u64).sum();
        t.save(&dir, None).unwrap();
        let saved = read_model_dir(&dir).unwrap();
        for (precision, bytes) in [("fp32", 4), ("bf16", 2)] {
            let args = SavedModelArgs {
                model: dir.clone(),
                adapter: None,
                qlora: false,
                device: "cpu".into(),
                precision: precision.into(),
            };
            let t = args.trainer(saved.clone(), data()).unwrap();
            let live = t.backend().ledger().snapshot().live;
            assert_eq!(
                live.get(MemoryCategory::Weights),
                bytes * params,
                "{precision}"
            );
            assert_eq!(live.get(MemoryCategory::MasterWeights), 0, "{precision}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
