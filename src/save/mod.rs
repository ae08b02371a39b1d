//! Saving and loading files, whatever model they hold: safetensors (one file, or shards
//! listed in `model.safetensors.index.json`), the file names of a model directory, and the
//! trainer state that makes a resume exact. Reading a model directory (its `config.json`
//! by family, its weights checked against it) is the model's: [`crate::model::read_model_dir`].
//!
//! Every file is written to a temporary name, flushed to disk and renamed over its target,
//! and a whole directory is assembled beside its target and swapped in at the end, so a
//! crash mid-save leaves the previous checkpoint intact.

pub mod atomic;
pub mod files;
pub mod hub;
pub mod stored;
pub mod tensors;

pub use atomic::{
    check_writable_dir, recover_directory, write_atomically, write_atomically_with, DirectoryWriter,
};
pub use files::{
    copy_files, CONFIG_FILE, GENERATION_CONFIG_FILE, MODEL_SIDE_FILES, RUN_CONFIG_FILE, STATE_FILE,
    STATE_TENSORS_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE,
};
pub use stored::{open_safetensors, StoredTensor};
pub use tensors::{parse_safetensors, read_safetensors, write_safetensors, NamedTensor};
pub(crate) use tensors::{read_typed, write_stored};

use crate::error::{Error, Result};
use std::path::Path;

/// Every tensor of a directory's weights, mapped and read when asked ([`StoredTensor`]):
/// `model.safetensors`, or else each shard named in `model.safetensors.index.json`'s
/// `weight_map`.
pub fn open_weights(dir: &Path) -> Result<Vec<StoredTensor<'static>>> {
    let single = dir.join(WEIGHTS_FILE);
    let index = dir.join(WEIGHTS_INDEX_FILE);
    if single.exists() || !index.exists() {
        return open_safetensors(&single);
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
        let shard = open_safetensors(&dir.join(file))?;
        out.extend(shard.into_iter().filter(|t| map.contains_key(&t.name)));
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The step a checkpoint directory was saved at (its `trainer_state.json`'s `step`); 0
/// when it cannot tell (resuming from it then says what is wrong with the directory).
pub fn saved_step(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(STATE_FILE))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
        .unwrap_or(0)
}
