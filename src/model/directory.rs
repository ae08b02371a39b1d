//! A model directory (`config.json` and its weights, as trainkit's `--out` or
//! transformers' `save_pretrained` writes it), read by the family its `model_type` names.

use crate::adapter::peft::ADAPTER_CONFIG;
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::save::{open_weights, recover_directory, StoredTensor, CONFIG_FILE};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A model read from a directory: its config and its tensors by (Hugging Face) name.
/// The tensors' values stay in their files, mapped into memory, until a parameter takes
/// them ([`StoredTensor::values`]): opening a 70B model reads its headers, not 282 GB of
/// f32 values. Cloning it copies no values.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The directory it was read from.
    pub path: PathBuf,
    /// The model's family and shape.
    pub config: ModelConfig,
    /// Every weight by its name in the files, as the family reads them (GPT-2's under
    /// `transformer.`, without mask buffers).
    pub tensors: BTreeMap<String, StoredTensor<'static>>,
}

impl ModelDir {
    /// Every tensor's name, shape and values, read now (the whole model in memory as
    /// f32).
    pub fn read_tensors(&self) -> crate::Result<BTreeMap<String, crate::save::NamedTensor>> {
        self.tensors
            .iter()
            .map(|(name, t)| Ok((name.clone(), t.read()?)))
            .collect()
    }
}

/// Reads a model directory written by trainkit or by transformers' `save_pretrained`: its
/// `config.json` (any registered `model_type`) and its weights, from `model.safetensors`
/// or from the shards `model.safetensors.index.json` lists. The tensors are checked
/// against the config: a missing or misshapen one is an error naming it. Only the files'
/// headers are read here; each tensor's values are read when its parameter takes them.
pub fn read_model_dir(dir: &Path) -> Result<ModelDir> {
    recover_directory(dir)?;
    if !dir.is_dir() {
        return Err(Error::data(
            dir.display().to_string(),
            "is not a directory; pass a model directory holding config.json and \
             model.safetensors (one written by `trainkit train --out DIR` or by \
             transformers' save_pretrained)",
        ));
    }
    let config = read_model_config(dir)?;
    let family = config.family();
    let tensors = family.file_tensors(open_weights(dir)?);
    // The family's own mapping checks every tensor it needs (no model is built).
    let mapped = family.import_tensors(tensors.clone())?;
    check_shapes(dir, &family.param_shapes(), &mapped)?;
    Ok(ModelDir {
        path: dir.to_path_buf(),
        config,
        tensors,
    })
}

/// The model family and shape of a model directory's `config.json` (by its
/// `model_type`, see [`crate::model::families`]), without reading its weights.
pub fn read_model_config(dir: &Path) -> Result<ModelConfig> {
    recover_directory(dir)?;
    let path = dir.join(CONFIG_FILE);
    if !path.exists() && dir.join(ADAPTER_CONFIG).is_file() {
        return Err(Error::data(
            dir.display().to_string(),
            format!(
                "holds a LoRA adapter ({ADAPTER_CONFIG}), not a model ({CONFIG_FILE}): \
                 give it as --adapter, with its base model's directory as --model \
                 (train: --init-from)"
            ),
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    crate::model::families::read_config(&path, &text)
}

/// Fails unless `tensors` holds every parameter of `shapes` with its shape.
fn check_shapes(
    dir: &Path,
    shapes: &[(String, Vec<usize>)],
    tensors: &BTreeMap<String, StoredTensor<'static>>,
) -> Result<()> {
    let weights = dir.display().to_string();
    for (name, shape) in shapes {
        match tensors.get(name) {
            None => {
                return Err(Error::data(
                    &weights,
                    format!(
                        "has no `{name}`, which the model of config.json needs; the \
                         weights and config.json do not belong together"
                    ),
                ))
            }
            Some(t) if t.shape() != shape => {
                return Err(Error::data(
                    &weights,
                    format!(
                        "`{name}` has shape {:?}, config.json implies {shape:?}; the weights \
                         and config.json do not belong together",
                        t.shape()
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}
