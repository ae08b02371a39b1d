//! The names of the files in a model directory and a checkpoint, and copying files into
//! one.

use std::path::{Path, PathBuf};

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

/// The index of a sharded checkpoint (`weight_map`: each tensor's file).
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// transformers' generation settings beside a model's weights (`generate()` reads them).
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The files of a Hugging Face model directory besides its weights: the config, the
/// generation settings and the tokenizer's files. A merged model keeps its base's; a model
/// fetched by its id downloads them.
pub const MODEL_SIDE_FILES: [&str; 6] = [
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Copies each file `from` that exists into `dir` as `name` (a file onto itself is left
/// alone). Returns a warning for each copy that failed: the caller saved what matters
/// (the model) and says so.
pub fn copy_files(dir: &Path, files: &[(PathBuf, &str)]) -> Vec<String> {
    let mut warnings = Vec::new();
    for (from, name) in files {
        let to = dir.join(name);
        let same = matches!(
            (std::fs::canonicalize(from), std::fs::canonicalize(&to)),
            (Ok(a), Ok(b)) if a == b
        );
        if from.is_file() && !same {
            if let Err(e) = std::fs::copy(from, &to) {
                warnings.push(format!(
                    "{} was not copied to {}: {e}",
                    from.display(),
                    to.display()
                ));
            }
        }
    }
    warnings
}
