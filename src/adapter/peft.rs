//! LoRA adapters in the files PEFT writes and reads: `adapter_config.json` and
//! `adapter_model.safetensors`, whose tensors are named
//! `base_model.model.{module}.lora_A.weight` (`[r, in]`) and `….lora_B.weight` (`[out, r]`)
//! after the Hugging Face module they adapt.

use super::Lora;
use crate::error::{Error, Result};
use crate::save::{read_safetensors, write_atomically, write_safetensors, NamedTensor};
use serde_json::{json, Value};
use std::path::Path;

/// The adapter's settings, as PEFT names the file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's tensors.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The prefix PEFT gives the module names of a causal language model's adapter tensors.
pub const PREFIX: &str = "base_model.model.";

/// What else `adapter_config.json` records about the base model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BaseInfo {
    /// The base model's name or directory (`base_model_name_or_path`).
    pub name_or_path: Option<String>,
    /// Whether the base stores its projections `[in, out]` (GPT-2's `Conv1D`: PEFT's
    /// `fan_in_fan_out`).
    pub fan_in_fan_out: bool,
    /// When the base ties its head to the token embedding and the adapter trains that
    /// embedding whole (`modules_to_save`): the head's name and the embedding's. PEFT's
    /// `ensure_weight_tying`: the embedding is written again under the head's name, as
    /// PEFT writes it.
    pub tied_head: Option<(String, String)>,
}

/// The `adapter_config.json` PEFT writes for `lora`. Targets of [`super::ALL_LINEAR`] are
/// written as PEFT's string form `"all-linear"` (a list holding it is not one PEFT reads);
/// [`write()`] writes the module names it expanded to instead, as PEFT does when it saves.
pub fn adapter_config(lora: &Lora, base: &BaseInfo) -> Value {
    let targets = if lora.targets.iter().any(|t| t == super::ALL_LINEAR) {
        json!(super::ALL_LINEAR)
    } else {
        json!(lora.targets)
    };
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": targets,
        "lora_dropout": lora.dropout,
        "bias": "none",
        "use_rslora": lora.rslora,
        "fan_in_fan_out": base.fan_in_fan_out,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": if lora.modules_to_save.is_empty() {
            Value::Null
        } else {
            json!(lora.modules_to_save)
        },
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": lora.dora,
        "ensure_weight_tying": base.tied_head.is_some(),
        "revision": null,
    })
}

/// The projections `tensors` (named by trainkit, `{module}.lora_A.weight`) adapt, by the
/// last part of their module names, sorted: what `all-linear` expanded to on this model.
fn adapted_projections(tensors: &[NamedTensor]) -> Vec<String> {
    let mut names: Vec<String> = tensors
        .iter()
        .filter_map(|t| {
            let module = t
                .name
                .strip_suffix(".lora_A.weight")
                .or_else(|| t.name.strip_suffix(".lora_B.weight"))?;
            Some(module.rsplit('.').next().unwrap_or(module).to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Writes the adapter into `dir` (created if missing): its config, and `tensors` (named
/// by trainkit, `{module}.lora_A.weight`) under PEFT's names. An `all-linear` adapter's
/// config lists the projections it adapts, as PEFT writes it.
pub fn write(dir: &Path, lora: &Lora, base: &BaseInfo, tensors: &[NamedTensor]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let expanded = adapted_projections(tensors);
    let lora = &match lora.targets.iter().any(|t| t == super::ALL_LINEAR) {
        true if !expanded.is_empty() => Lora {
            targets: expanded,
            ..lora.clone()
        },
        _ => lora.clone(),
    };
    let text = serde_json::to_string_pretty(&adapter_config(lora, base))
        .map_err(|e| Error::Serde(e.to_string()))?;
    write_atomically(&dir.join(ADAPTER_CONFIG), text.as_bytes())?;
    let named: Vec<NamedTensor> = tensors
        .iter()
        .map(|t| NamedTensor {
            name: format!("{PREFIX}{}", t.name),
            shape: t.shape.clone(),
            data: t.data.clone(),
        })
        .chain(tied_copy(tensors, base))
        .collect();
    write_safetensors(&dir.join(ADAPTER_WEIGHTS), &named, None)
}

/// The tied head's copy of the trained embedding (see [`BaseInfo::tied_head`]).
fn tied_copy(tensors: &[NamedTensor], base: &BaseInfo) -> Option<NamedTensor> {
    let (head, embedding) = base.tied_head.as_ref()?;
    let embedding = tensors.iter().find(|t| t.name == *embedding)?;
    Some(NamedTensor {
        name: format!("{PREFIX}{head}"),
        ..embedding.clone()
    })
}

/// Whether `dir` holds a PEFT adapter (its `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// Reads a PEFT LoRA adapter from `dir`: its settings and its tensors, named by trainkit
/// (`{module}.lora_A.weight`). Errors name the file and the field: an adapter that is not
/// LoRA, target modules given as a pattern, or biases trainkit does not train. Its
/// `lora_dropout` (which acts in training only) and `modules_to_save` are read with the
/// settings; the saved modules' tensors come by their own names.
pub fn read(dir: &Path) -> Result<(Lora, Vec<NamedTensor>)> {
    let path = dir.join(ADAPTER_CONFIG);
    let model_config = dir.join(crate::save::CONFIG_FILE);
    if !path.exists() && model_config.is_file() {
        return Err(Error::data(
            dir.display().to_string(),
            format!(
                "holds a model ({}), not a LoRA adapter ({ADAPTER_CONFIG}): give it as \
                 --model (train: --init-from), and the adapter's directory as --adapter",
                crate::save::CONFIG_FILE
            ),
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::data(path.display().to_string(), format!("is not JSON: {e}")))?;
    let lora = parse_config(&v).map_err(|msg| Error::data(path.display().to_string(), msg))?;
    lora.validate()?;
    let weights = dir.join(ADAPTER_WEIGHTS);
    if !weights.is_file() {
        return Err(Error::data(
            dir.display().to_string(),
            format!("holds {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}"),
        ));
    }
    let tensors = read_safetensors(&weights)?
        .into_iter()
        .map(|t| {
            if let Some(bad) = t.data.iter().find(|v| !v.is_finite()) {
                return Err(Error::data(
                    weights.display().to_string(),
                    format!(
                        "`{}` holds {bad}: the adapter is damaged (a run that diverged?); \
                         use an earlier checkpoint of it",
                        t.name
                    ),
                ));
            }
            let name = t
                .name
                .strip_prefix(PREFIX)
                .map(str::to_string)
                .ok_or_else(|| {
                    Error::data(
                        weights.display().to_string(),
                        format!("`{}` is not named `{PREFIX}…` as PEFT names them", t.name),
                    )
                })?;
            // PEFT versions before 0.7 kept the adapter's name in the tensor's.
            let name = name
                .replace(".lora_A.default.", ".lora_A.")
                .replace(".lora_B.default.", ".lora_B.")
                .replace(
                    ".lora_magnitude_vector.default.weight",
                    ".lora_magnitude_vector",
                )
                .replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector");
            Ok(NamedTensor { name, ..t })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((lora, tensors))
}

/// The LoRA settings of an `adapter_config.json`, or what is wrong with them.
fn parse_config(v: &Value) -> std::result::Result<Lora, String> {
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        Some(other) => {
            return Err(format!(
                "holds a `{other}` adapter; trainkit reads LoRA adapters (`peft_type: \"LORA\"`)"
            ))
        }
        None => return Err("has no `peft_type`: is it a PEFT adapter config?".into()),
    }
    let rank = field("r")
        .and_then(Value::as_u64)
        .ok_or("has no integer `r` (the LoRA rank)")? as usize;
    let alpha = field("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or("has no number `lora_alpha`")?;
    let targets = match field("target_modules") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or("lists a target that is not a string")
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        Some(Value::String(s)) if s == super::ALL_LINEAR => vec![s.clone()],
        Some(Value::String(s)) => {
            return Err(format!(
                "gives `target_modules` as the pattern `{s}`; trainkit reads a list of module \
                 names (q_proj, v_proj, ...) or `all-linear`"
            ))
        }
        _ => return Err("has no `target_modules`".into()),
    };
    // `lora_dropout` acts in training only: the adapter evaluates, samples and merges as
    // PEFT's does in eval mode, and `train --adapter` continues it with its dropout.
    let dropout = match field("lora_dropout") {
        None | Some(Value::Null) => 0.0,
        Some(p) => match p.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => p,
            _ => {
                return Err(format!(
                    "sets `lora_dropout` to {p}, not a number in [0, 1)"
                ))
            }
        },
    };
    if let Some(b) = field("bias").and_then(Value::as_str) {
        if b != "none" {
            return Err(format!(
                "trains biases (`bias: \"{b}\"`); trainkit's LoRA trains none (`\"none\"`)"
            ));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if field(k)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(format!(
                "sets `{k}` (ranks or scales per module); trainkit uses one rank and one α"
            ));
        }
    }
    let modules_to_save = match field("modules_to_save") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|m| {
                m.as_str()
                    .map(str::to_string)
                    .ok_or("lists a module to save that is not a string")
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        Some(other) => {
            return Err(format!(
                "gives `modules_to_save` as {other}; PEFT writes a list of module names"
            ))
        }
    };
    Ok(Lora {
        rank,
        alpha,
        targets,
        rslora: field("use_rslora")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        base: super::BaseWeights::Compute,
        dropout,
        dora: field("use_dora").and_then(Value::as_bool).unwrap_or(false),
        modules_to_save,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_adapter_reads_back() {
        let dir = std::env::temp_dir().join(format!("trainkit-peft-{}", std::process::id()));
        let lora = Lora::new(4, 8.0, &["q_proj", "v_proj"]).unwrap();
        let t = NamedTensor {
            name: "model.layers.0.self_attn.q_proj.lora_A.weight".into(),
            shape: vec![4, 2],
            data: (0..8).map(|i| i as f32).collect(),
        };
        write(&dir, &lora, &BaseInfo::default(), std::slice::from_ref(&t)).unwrap();
        let (back, tensors) = read(&dir).unwrap();
        assert_eq!(back, lora);
        assert_eq!(tensors, vec![t]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `all-linear` is written as PEFT writes it: the projections it adapted, or PEFT's
    /// string form where there are no tensors to tell; both read back.
    #[test]
    fn all_linear_is_written_in_a_form_peft_reads() {
        let dir = std::env::temp_dir().join(format!("trainkit-peft-all-{}", std::process::id()));
        let lora = Lora::new(4, 8.0, &[crate::adapter::ALL_LINEAR]).unwrap();
        let config = adapter_config(&lora, &BaseInfo::default());
        assert_eq!(config["target_modules"], json!("all-linear"));
        assert_eq!(parse_config(&config).unwrap(), lora);
        let tensor = |name: &str| NamedTensor {
            name: name.into(),
            shape: vec![1, 1],
            data: vec![0.0],
        };
        let tensors: Vec<NamedTensor> = [
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "model.layers.0.self_attn.q_proj.lora_B.weight",
            "model.layers.1.mlp.down_proj.lora_A.weight",
            "model.layers.1.mlp.down_proj.lora_B.weight",
            "model.layers.0.self_attn.o_proj.lora_A.weight",
        ]
        .iter()
        .map(|n| tensor(n))
        .collect();
        write(&dir, &lora, &BaseInfo::default(), &tensors).unwrap();
        let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap();
        let written: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            written["target_modules"],
            json!(["down_proj", "o_proj", "q_proj"])
        );
        let (back, _) = read(&dir).unwrap();
        assert_eq!(back.targets, ["down_proj", "o_proj", "q_proj"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An adapter holding a NaN or an infinity is refused when read, naming the tensor.
    #[test]
    fn a_non_finite_adapter_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("trainkit-peft-nan-{}", std::process::id()));
        let lora = Lora::new(1, 2.0, &["q_proj"]).unwrap();
        for bad in [f32::NAN, f32::INFINITY] {
            let t = NamedTensor {
                name: "model.layers.0.self_attn.q_proj.lora_B.weight".into(),
                shape: vec![2, 1],
                data: vec![0.5, bad],
            };
            write(&dir, &lora, &BaseInfo::default(), &[t]).unwrap();
            let e = read(&dir).unwrap_err().to_string();
            assert!(
                e.contains("q_proj.lora_B.weight") && e.contains("damaged"),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// PEFT's recipes train with `lora_dropout` 0.05: it is written and read back with
    /// the adapter (dropout is off at inference, in PEFT as here).
    #[test]
    fn an_adapter_trained_with_dropout_reads() {
        let dir = std::env::temp_dir().join(format!("trainkit-peft-drop-{}", std::process::id()));
        let lora = Lora::new(2, 4.0, &["q_proj"]).unwrap();
        let t = NamedTensor {
            name: "model.layers.0.self_attn.q_proj.lora_A.weight".into(),
            shape: vec![2, 3],
            data: vec![0.5; 6],
        };
        write(&dir, &lora, &BaseInfo::default(), std::slice::from_ref(&t)).unwrap();
        assert_eq!(read(&dir).unwrap().0.dropout, 0.0);
        let path = dir.join(ADAPTER_CONFIG);
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["lora_dropout"] = json!(0.05);
        std::fs::write(&path, config.to_string()).unwrap();
        let dropped = Lora {
            dropout: 0.05,
            ..lora.clone()
        };
        assert_eq!(read(&dir).unwrap(), (dropped.clone(), vec![t.clone()]));
        // What trainkit writes, it reads back.
        write(
            &dir,
            &dropped,
            &BaseInfo::default(),
            std::slice::from_ref(&t),
        )
        .unwrap();
        assert_eq!(read(&dir).unwrap().0, dropped);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn configs_trainkit_does_not_train_are_refused_by_name() {
        let base =
            json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]});
        assert!(parse_config(&base).is_ok());
        for (k, v, says) in [
            ("peft_type", json!("IA3"), "IA3"),
            ("lora_dropout", json!(1.5), "lora_dropout"),
            ("bias", json!("all"), "bias"),
            ("target_modules", json!(".*proj"), "pattern"),
            ("rank_pattern", json!({"q_proj": 4}), "rank_pattern"),
        ] {
            let mut c = base.clone();
            c[k] = v;
            let err = parse_config(&c).unwrap_err();
            assert!(err.contains(says), "{k}: {err}");
        }
        // DoRA is read, with its dropout.
        let mut c = base.clone();
        c["use_dora"] = json!(true);
        c["lora_dropout"] = json!(0.05);
        let lora = parse_config(&c).unwrap();
        assert!(lora.dora && lora.dropout == 0.05);
        lora.validate().unwrap();
    }
}
