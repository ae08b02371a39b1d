//! The one place model families are registered: every `model_type` trainkit reads from a
//! `config.json` or a run config's `[model] arch`, and the config it becomes. A new family
//! is its file (its config, `impl` [`super::Family`] and [`FamilyConfig`]) and one line
//! here.

use super::{FamilyConfig, Gpt2Config, LlamaConfig, ModelConfig, Qwen2Config, Qwen3Config, Shape};
use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// A registered family: its `model_type`, the models it covers, and its config's makers.
pub struct Registered {
    /// Hugging Face's `model_type` (and a run config's `arch`).
    pub model_type: &'static str,
    /// The models it covers, for messages.
    pub models: &'static str,
    /// Reads a `config.json` of this family (`path` names the file in errors).
    read: fn(&Path, &str) -> Result<ModelConfig>,
    /// Reads a run config's `[model]` table (without `arch`).
    from_table: fn(Value) -> std::result::Result<ModelConfig, String>,
    /// The family's config of a shape, or what differs.
    from_shape: fn(&Shape) -> Result<ModelConfig>,
    /// A small model of the family, the default run's size (what `--arch` starts from).
    pub small: fn() -> ModelConfig,
}

impl Registered {
    /// The registry's entry of family `F`.
    pub const fn of<F: FamilyConfig>() -> Registered {
        Registered {
            model_type: F::MODEL_TYPE,
            models: F::MODELS,
            read: read::<F>,
            from_table: table::<F>,
            from_shape: shaped::<F>,
            small: small::<F>,
        }
    }
}

/// Every family trainkit builds.
pub const FAMILIES: &[Registered] = &[
    Registered::of::<Gpt2Config>(),
    Registered::of::<LlamaConfig>(),
    Registered::of::<Qwen2Config>(),
    Registered::of::<Qwen3Config>(),
];

fn read<F: FamilyConfig>(path: &Path, text: &str) -> Result<ModelConfig> {
    F::read_config(path, text).map(ModelConfig::new)
}

fn table<F: FamilyConfig>(v: Value) -> std::result::Result<ModelConfig, String> {
    serde_json::from_value::<F>(v)
        .map(ModelConfig::new)
        .map_err(|e| e.to_string())
}

fn shaped<F: FamilyConfig>(shape: &Shape) -> Result<ModelConfig> {
    F::from_shape(shape).map(ModelConfig::new)
}

fn small<F: FamilyConfig>() -> ModelConfig {
    ModelConfig::new(F::small())
}

/// The registered family of `model_type`.
pub fn family(model_type: &str) -> Option<&'static Registered> {
    FAMILIES.iter().find(|f| f.model_type == model_type)
}

/// Every family, as a message lists them: "`gpt2` (GPT-2), ... and `llama` (...)".
pub fn list() -> String {
    let names: Vec<String> = FAMILIES
        .iter()
        .map(|f| format!("`{}` ({})", f.model_type, f.models))
        .collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

/// Every family's `model_type`, joined by `sep` (`gpt2 or llama or ...`).
pub fn names(sep: &str) -> String {
    FAMILIES
        .iter()
        .map(|f| f.model_type)
        .collect::<Vec<_>>()
        .join(sep)
}

/// The error text for a `config.json` whose `model_type` is `t`, naming every family.
pub(crate) fn model_type_error(t: &str) -> String {
    if family(t).is_some() {
        // An accepted type reached another family's reader directly.
        format!(
            "`model_type` is `{t}`, not GPT-2 (`gpt2`); read it with \
             `read_model_config` (trainkit reads the model types {})",
            list()
        )
    } else {
        format!(
            "`model_type` is `{t}`; trainkit reads the model types {}",
            list()
        )
    }
}

/// Reads a transformers GPT-2 `config.json`; fields trainkit does not use are ignored,
/// settings it cannot honour (another architecture, another activation, an untied head)
/// are errors.
pub fn read_hf_config(path: &Path) -> Result<Gpt2Config> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_hf_config(path, &text)
}

/// Parses the text of a GPT-2 `config.json` (what [`read_hf_config`] does after reading
/// it); `path` only names the file in errors. Another `model_type` is an error naming
/// every family trainkit reads.
pub fn parse_hf_config(path: &Path, text: &str) -> Result<Gpt2Config> {
    let t = serde_json::from_str::<Value>(text).ok().and_then(|v| {
        v.get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    match t {
        Some(t) if t != "gpt2" => Err(Error::data(
            path.display().to_string(),
            model_type_error(&t),
        )),
        _ => super::gpt2::parse_config(path, text),
    }
}

/// The model config of a `config.json`'s text, by its `model_type` (GPT-2 when absent, as
/// old GPT-2 files have none), checked buildable; `path` names the file in errors.
pub fn read_config(path: &Path, text: &str) -> Result<ModelConfig> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        Error::data(
            path.display().to_string(),
            format!("is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(map) = value else {
        return Err(Error::data(
            path.display().to_string(),
            "must hold a JSON object",
        ));
    };
    let model_type = map
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("gpt2");
    let Some(f) = family(model_type) else {
        return Err(Error::data(
            path.display().to_string(),
            model_type_error(model_type),
        ));
    };
    let config = (f.read)(path, text).and_then(|c| c.validate().map(|()| c));
    config.map_err(|e| match e {
        Error::Data { .. } => e,
        other => Error::data(path.display().to_string(), other.to_string()),
    })
}

/// The config of the first family whose shape `shape` is; otherwise an error naming what
/// each family lacks.
pub fn from_shape(shape: &Shape) -> Result<ModelConfig> {
    shape.validate()?;
    let mut refusals = Vec::new();
    for f in FAMILIES {
        match (f.from_shape)(shape) {
            Ok(config) => return Ok(config),
            Err(e) => refusals.push(format!("{}: {e}", f.model_type)),
        }
    }
    Err(Error::config(
        "model",
        format!("no model family builds this shape; {}", refusals.join("; ")),
    ))
}

/// A run config's `[model]` table of family `arch`.
pub(crate) fn from_table(arch: &str, v: Value) -> std::result::Result<ModelConfig, String> {
    match family(arch) {
        Some(f) => (f.from_table)(v),
        None => Err(format!(
            "model.arch: `{arch}` is not a model family trainkit builds; use {}",
            names(" or ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_model_type_names_every_family() {
        for t in ["bert", "mistral"] {
            let text = format!(r#"{{"model_type": "{t}", "n_layer": 1}}"#);
            let err = read_config(Path::new("config.json"), &text)
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("`model_type` is `{t}`")), "{err}");
            for f in FAMILIES {
                assert!(err.contains(&format!("`{}`", f.model_type)), "{err}");
            }
        }
        let err = parse_hf_config(
            Path::new("config.json"),
            r#"{"model_type": "llama", "n_layer": 1}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("read_model_config") && err.contains("SmolLM2"),
            "{err}"
        );
    }
}
