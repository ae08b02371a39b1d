//! Saving and loading: Hugging Face model directories of every registered family (`config.json` and
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`) and the trainer state that makes a resume exact.
//!
//! Every file is written to a temporary name, flushed to disk and renamed over its target,
//! and a whole directory is assembled beside its target and swapped in at the end, so a
//! crash mid-save leaves the previous checkpoint intact.

pub mod atomic;
pub mod files;
pub mod hub;
pub mod tensors;

pub use crate::model::{parse_hf_config, read_hf_config};
pub use atomic::{recover_directory, write_atomically, DirectoryWriter};
pub use files::{
    CONFIG_FILE, GENERATION_CONFIG_FILE, MODEL_SIDE_FILES, RUN_CONFIG_FILE, STATE_FILE,
    STATE_TENSORS_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE,
};
pub use tensors::{parse_safetensors, read_safetensors, write_safetensors, NamedTensor};
pub(crate) use tensors::{read_typed, write_typed};

use crate::error::{Error, Result};
use crate::model::ModelConfig;
use std::collections::BTreeMap;
use std::path::Path;

/// A model read from a directory: its config and its tensors by (Hugging Face) name.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The model's family and shape.
    pub config: ModelConfig,
    /// Every weight by its name in the files, as the family reads them (GPT-2's under
    /// `transformer.`, without mask buffers).
    pub tensors: BTreeMap<String, NamedTensor>,
}

/// Reads a model directory written by trainkit or by transformers' `save_pretrained`: its
/// `config.json` (any registered `model_type`) and its weights, from `model.safetensors`
/// or from the shards `model.safetensors.index.json` lists. The tensors are checked
/// against the config: a missing or misshapen one is an error naming it.
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
    let tensors = family.file_tensors(read_weights(dir)?);
    // The family's own mapping checks every tensor it needs (no model is built).
    let mapped = family.import_tensors(tensors.clone())?;
    check_shapes(dir, &family.param_shapes(), &mapped)?;
    Ok(ModelDir { config, tensors })
}

/// The model family and shape of a model directory's `config.json` (by its
/// `model_type`, see [`crate::model::families`]), without reading its weights.
pub fn read_model_config(dir: &Path) -> Result<ModelConfig> {
    recover_directory(dir)?;
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    crate::model::families::read_config(&path, &text)
}

/// Fails unless `tensors` holds every parameter of `shapes` with its shape.
fn check_shapes(
    dir: &Path,
    shapes: &[(String, Vec<usize>)],
    tensors: &BTreeMap<String, NamedTensor>,
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
            Some(t) if &t.shape != shape => {
                return Err(Error::data(
                    &weights,
                    format!(
                        "`{name}` has shape {:?}, config.json implies {shape:?}; the weights \
                         and config.json do not belong together",
                        t.shape
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Every tensor of a directory's weights: `model.safetensors`, or else each shard named
/// in `model.safetensors.index.json`'s `weight_map` (each file read once).
pub fn read_weights(dir: &Path) -> Result<Vec<NamedTensor>> {
    let single = dir.join(WEIGHTS_FILE);
    let index = dir.join(WEIGHTS_INDEX_FILE);
    if single.exists() || !index.exists() {
        return read_safetensors(&single);
    }
    let what = index.display().to_string();
    let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::data(&what, format!("is not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| Error::data(&what, "has no `weight_map` table of tensor → file"))?;
    let mut files: Vec<&str> = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::data(&what, format!("maps `{name}` to {file}, not a file name"))
        })?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(Error::data(
                &what,
                format!("names the shard `{file}`; shards must lie beside the index"),
            ));
        }
        if !files.contains(&file) {
            files.push(file);
        }
    }
    files.sort_unstable();
    let mut out = Vec::new();
    for file in files {
        let shard: Vec<NamedTensor> = read_safetensors(&dir.join(file))?;
        out.extend(shard.into_iter().filter(|t| map.contains_key(&t.name)));
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}
