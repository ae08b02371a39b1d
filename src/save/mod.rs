//! Saving and loading: Hugging Face GPT-2 model directories (`config.json` and
//! `model.safetensors`) and the trainer state that makes a resume exact.
//!
//! Every file is written to a temporary name, flushed to disk and renamed over its target,
//! and a whole directory is assembled beside its target and swapped in at the end, so a
//! crash mid-save leaves the previous checkpoint intact.

mod atomic;
mod hf_config;
mod tensors;

pub use atomic::{recover_directory, write_atomically, DirectoryWriter};
pub use hf_config::{parse_hf_config, read_hf_config, write_hf_config};
pub use tensors::{parse_safetensors, read_safetensors, write_safetensors, NamedTensor};
pub(crate) use tensors::{read_typed, write_typed};

use crate::error::{Error, Result};
use crate::model::Gpt2Config;
use std::collections::BTreeMap;
use std::path::Path;

/// The model's config file in a model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The model's weights in a model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Optimizer moments and other per-parameter trainer tensors.
pub const STATE_TENSORS_FILE: &str = "trainer_state.safetensors";
/// Step, data position, RNG and the policies, as JSON.
pub const STATE_FILE: &str = "trainer_state.json";
/// The resolved run config, as TOML.
pub const RUN_CONFIG_FILE: &str = "trainkit.toml";

/// A model read from a directory: its config and its tensors by (Hugging Face) name.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The model's shape.
    pub config: Gpt2Config,
    /// Every weight by its name under `transformer.` (`transformer.wte.weight`, ...).
    pub tensors: BTreeMap<String, NamedTensor>,
}

/// Reads a GPT-2 model directory written by trainkit or by transformers'
/// `save_pretrained` (names with or without the `transformer.` prefix; `lm_head.weight`
/// and attention-mask buffers are ignored, the head being tied to `wte`).
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
    let config = read_hf_config(&dir.join(CONFIG_FILE))?;
    let weights = dir.join(WEIGHTS_FILE);
    let mut tensors = BTreeMap::new();
    for t in read_safetensors(&weights)? {
        let name = if t.name.starts_with("transformer.") {
            t.name.clone()
        } else {
            format!("transformer.{}", t.name)
        };
        let ignored = name == "transformer.lm_head.weight"
            || name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias");
        if !ignored {
            tensors.insert(name.clone(), NamedTensor { name, ..t });
        }
    }
    for (name, shape) in config.param_shapes() {
        match tensors.get(&name) {
            None => {
                return Err(Error::data(
                    weights.display().to_string(),
                    format!(
                        "has no `{name}`, which the model of config.json needs; the \
                         weights and config.json do not belong together"
                    ),
                ))
            }
            Some(t) if t.shape != shape => {
                return Err(Error::data(
                    weights.display().to_string(),
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
    Ok(ModelDir { config, tensors })
}
