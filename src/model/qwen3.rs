//! The Qwen3 family (dense) with Hugging Face `Qwen3ForCausalLM` semantics: a Llama with
//! each query and key head RMS-normalised before the rotary embedding (`q_norm`,
//! `k_norm`, one gain of `head_dim` each), heads 128 wide independent of
//! `hidden / heads`, and biases on every attention projection when `attention_bias`.

use super::llama_config::{count, field};
use super::qwen2::object;
use super::{Biases, Decoder, Family, FamilyConfig, LlamaConfig, Shape, ShapeFlags};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::Path;

/// A Qwen3-family model.
pub type Qwen3 = Decoder<Qwen3Config>;

/// A Qwen3 config: Llama's fields, the q/k norm implied, and `attention_bias`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Qwen3Config {
    /// The fields Qwen3 shares with Llama (Hugging Face's names).
    #[serde(flatten)]
    pub base: LlamaConfig,
    /// Whether the q, k, v and o projections carry biases (false in every published
    /// Qwen3).
    #[serde(default)]
    pub attention_bias: bool,
}

impl Family for Qwen3Config {
    const MODEL_TYPE: &'static str = "qwen3";

    fn shape(&self) -> Shape {
        let bias = if self.attention_bias {
            Biases {
                qkv: true,
                o: true,
                mlp: false,
            }
        } else {
            Biases::NONE
        };
        Shape {
            bias,
            qk_norm: true,
            ..self.base.shape()
        }
    }

    fn reshape(&mut self, flags: &ShapeFlags) -> Result<()> {
        self.base.reshape(flags)
    }

    fn validate(&self) -> Result<()> {
        Family::validate(&self.base)
    }

    fn hf_config(&self) -> Value {
        let mut v = self.base.hf_config();
        v["architectures"] = json!(["Qwen3ForCausalLM"]);
        v["model_type"] = json!("qwen3");
        v["attention_bias"] = json!(self.attention_bias);
        v["use_sliding_window"] = json!(false);
        if let Some(map) = v.as_object_mut() {
            map.remove("mlp_bias");
        }
        v
    }
}

impl FamilyConfig for Qwen3Config {
    const MODELS: &'static str = "Qwen3";

    fn read_config(_: &Path, text: &str) -> Result<Self> {
        Qwen3Config::from_json(text)
    }

    /// The Qwen3 config of `shape`, if it is Qwen3 shaped: a Llama shape (see
    /// [`LlamaConfig::from_shape`]) with the per-head q/k norm and no biases (or biases on
    /// the attention projections only).
    fn from_shape(shape: &Shape) -> Result<Self> {
        let attention_bias = shape.bias
            == Biases {
                qkv: true,
                o: true,
                mlp: false,
            };
        if !shape.qk_norm || !(attention_bias || shape.bias == Biases::NONE) {
            return Err(Error::config(
                "model",
                "a Qwen3 model has the per-head q/k norm and no biases (or biases on its \
                 attention projections only)",
            ));
        }
        let base = LlamaConfig::from_shape(&Shape {
            bias: Biases::NONE,
            qk_norm: false,
            ..*shape
        })
        .map_err(|e| Error::config("model", format!("as Qwen3: {e}")))?;
        Ok(Qwen3Config {
            base,
            attention_bias,
        })
    }

    fn small() -> Self {
        Qwen3Config {
            base: LlamaConfig::small(),
            attention_bias: false,
        }
    }

    fn set_context(&mut self, context: usize) {
        self.base.max_position_embeddings = context;
    }
}

impl Qwen3Config {
    /// Parses a `config.json` of `Qwen3ForCausalLM` (transformers 5 or 4.x); `head_dim`
    /// defaults to 128 as transformers' `Qwen3Config` does.
    pub fn from_json(text: &str) -> Result<Self> {
        let mut map = object(text, "qwen3")?;
        if field(&map, "use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(Error::config(
                "use_sliding_window",
                "is true; trainkit's attention is causal over the whole sequence (every \
                 published Qwen3 config sets it false)",
            ));
        }
        if count(&map, "head_dim")?.is_none() {
            map.insert("head_dim".into(), json!(128));
        }
        Ok(Qwen3Config {
            base: LlamaConfig::from_map(&map)?,
            attention_bias: field(&map, "attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }
}
