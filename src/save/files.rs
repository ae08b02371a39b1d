//! The names of the files in a model directory and a checkpoint.

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
