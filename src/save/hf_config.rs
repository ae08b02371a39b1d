//! Hugging Face's `config.json` for GPT-2 and Llama.

use super::write_atomically;
use crate::error::{Error, Result};
use crate::model::{Gpt2Config, LlamaConfig, RopeScaling};
use serde_json::{json, Value};
use std::path::Path;

/// GPT-2's `<|endoftext|>` id.
const EOT: u32 = 50256;

/// Every `model_type` trainkit reads from a `config.json`, with the models it covers:
/// [`super::read_model_config`] reads `llama` as a Llama and anything else as GPT-2,
/// which [`parse_hf_config`] accepts only as `gpt2` (or with no `model_type`). A new
/// family belongs here and in that dispatch.
const MODEL_TYPES: &[(&str, &str)] = &[("gpt2", "GPT-2"), ("llama", "Llama, SmolLM2, TinyLlama")];

/// The error text for a `config.json` whose `model_type` is `t`, naming every entry of
/// [`MODEL_TYPES`].
fn model_type_error(t: &str) -> String {
    let names: Vec<String> = MODEL_TYPES
        .iter()
        .map(|(ty, models)| format!("`{ty}` ({models})"))
        .collect();
    let list = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    };
    if MODEL_TYPES.iter().any(|(ty, _)| *ty == t) {
        // An accepted type other than `gpt2` reached the GPT-2 reader directly.
        format!(
            "`model_type` is `{t}`, not GPT-2 (`gpt2`); read it with \
             `read_model_config` (trainkit reads the model types {list})"
        )
    } else {
        format!("`model_type` is `{t}`; trainkit reads the model types {list}")
    }
}

/// Writes `config` as a transformers `GPT2Config` (`GPT2LMHeadModel`, tied head, tanh
/// GELU, no dropout).
pub fn write_hf_config(path: &Path, config: &Gpt2Config) -> Result<()> {
    let mut v = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "vocab_size": config.vocab_size,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    // GPT-2's <|endoftext|> when the vocabulary has it; otherwise none (transformers
    // would default to 50256).
    let eot = (config.vocab_size > EOT as usize).then_some(EOT);
    v["bos_token_id"] = json!(eot);
    v["eos_token_id"] = json!(eot);
    let text = serde_json::to_string_pretty(&v).map_err(|e| Error::Serde(e.to_string()))?;
    write_atomically(path, text.as_bytes())
}

/// Writes `config` as a transformers `LlamaConfig` (`LlamaForCausalLM`): the rope
/// parameters in both transformers 5's `rope_parameters` and 4.x's `rope_theta` and
/// `rope_scaling`, so either version loads it.
pub fn write_llama_config(path: &Path, config: &LlamaConfig) -> Result<()> {
    let mut rope = match config.rope.scaling {
        RopeScaling::Default => json!({"rope_type": "default"}),
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings as u64,
        }),
    };
    let scaling = (config.rope.scaling != RopeScaling::Default).then(|| rope.clone());
    rope["rope_theta"] = json!(config.rope.theta);
    let v = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "attention_dropout": 0.0,
        "rope_parameters": rope,
        "rope_theta": config.rope.theta,
        "rope_scaling": scaling,
        "torch_dtype": "float32",
    });
    let text = serde_json::to_string_pretty(&v).map_err(|e| Error::Serde(e.to_string()))?;
    write_atomically(path, text.as_bytes())
}

/// Reads a transformers GPT-2 `config.json`; fields trainkit does not use are ignored,
/// settings it cannot honour (another architecture, another activation, an untied head)
/// are errors.
pub fn read_hf_config(path: &Path) -> Result<Gpt2Config> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_hf_config(path, &text)
}

/// Parses the text of a `config.json` (what [`read_hf_config`] does after reading it);
/// `path` only names the file in errors.
pub fn parse_hf_config(path: &Path, text: &str) -> Result<Gpt2Config> {
    let what = path.display().to_string();
    let v: Value = serde_json::from_str(text)
        .map_err(|e| Error::data(&what, format!("is not valid JSON: {e}")))?;
    let field = |name: &str| -> Result<usize> {
        v.get(name)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| {
                Error::data(
                    &what,
                    format!("needs `{name}` as a positive integer (a GPT2Config field)"),
                )
            })
    };
    if let Some(t) = v.get("model_type").and_then(Value::as_str) {
        if t != "gpt2" {
            return Err(Error::data(&what, model_type_error(t)));
        }
    }
    if let Some(act) = v.get("activation_function").and_then(Value::as_str) {
        if act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(Error::data(
                &what,
                format!(
                    "`activation_function` is `{act}`; trainkit's GPT-2 uses the tanh GELU \
                     (`gelu_new`)"
                ),
            ));
        }
    }
    if v.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
        return Err(Error::data(
            &what,
            "`tie_word_embeddings` is false; trainkit's GPT-2 ties the head to `wte`",
        ));
    }
    let n_positions = match field("n_positions") {
        Ok(n) => n,
        Err(e) => field("n_ctx").map_err(|_| e)?,
    };
    let config = Gpt2Config {
        n_layer: field("n_layer")?,
        n_head: field("n_head")?,
        n_embd: field("n_embd")?,
        n_positions,
        vocab_size: field("vocab_size")?,
        layer_norm_epsilon: v
            .get("layer_norm_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5) as f32,
    };
    config
        .validate()
        .map_err(|e| Error::data(&what, format!("describes an impossible model: {e}")))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_model_type_names_every_accepted_type() {
        for t in ["bert", "mistral", "llama"] {
            let text = format!(r#"{{"model_type": "{t}", "n_layer": 1}}"#);
            let err = parse_hf_config(Path::new("config.json"), &text)
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("`model_type` is `{t}`")), "{err}");
            for (ty, _) in MODEL_TYPES {
                assert!(err.contains(&format!("`{ty}`")), "{err} lacks {ty}");
            }
        }
        let msg = model_type_error("bert");
        for ty in ["gpt2", "llama"] {
            assert!(msg.contains(&format!("`{ty}`")), "{msg} lacks {ty}");
        }
        assert!(
            msg.contains("SmolLM2") && msg.contains("TinyLlama"),
            "{msg}"
        );
    }
}
