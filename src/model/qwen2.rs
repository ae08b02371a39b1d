//! The Qwen2 family (Qwen2, Qwen2.5) with Hugging Face `Qwen2ForCausalLM` semantics: a
//! Llama whose query, key and value projections carry biases. Its config holds Llama's
//! fields (Hugging Face's names are the same); a sliding window is refused.

use super::llama_config::field;
use super::RopeScaling;
use super::{Biases, Decoder, Family, FamilyConfig, LlamaConfig, Rope, Shape, ShapeFlags};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::Path;

/// A Qwen2-family model.
pub type Qwen2 = Decoder<Qwen2Config>;

/// A Qwen2 or Qwen2.5 config: Llama's fields, with q/k/v biases implied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Qwen2Config {
    /// The fields Qwen2 shares with Llama (Hugging Face's names).
    pub base: LlamaConfig,
}

impl Family for Qwen2Config {
    const MODEL_TYPE: &'static str = "qwen2";

    fn shape(&self) -> Shape {
        Shape {
            bias: Biases::QKV,
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
        v["architectures"] = json!(["Qwen2ForCausalLM"]);
        v["model_type"] = json!("qwen2");
        v["use_sliding_window"] = json!(false);
        if let Some(map) = v.as_object_mut() {
            map.remove("attention_bias");
            map.remove("mlp_bias");
        }
        v
    }
}

impl FamilyConfig for Qwen2Config {
    const MODELS: &'static str = "Qwen2, Qwen2.5";

    fn read_config(_: &Path, text: &str) -> Result<Self> {
        Qwen2Config::from_json(text)
    }

    /// The Qwen2 config of `shape`, if it is Qwen2 shaped: a Llama shape (see
    /// [`LlamaConfig::from_shape`]) with biases on the q/k/v projections only.
    fn from_shape(shape: &Shape) -> Result<Self> {
        if shape.bias != Biases::QKV {
            return Err(Error::config(
                "model",
                "a Qwen2 model has biases on its q, k and v projections only",
            ));
        }
        let base = LlamaConfig::from_shape(&Shape {
            bias: Biases::NONE,
            ..*shape
        })
        .map_err(|e| Error::config("model", format!("as Qwen2: {e}")))?;
        Ok(Qwen2Config { base })
    }

    fn small() -> Self {
        Qwen2Config {
            base: LlamaConfig::small(),
        }
    }

    fn set_context(&mut self, context: usize) {
        self.base.max_position_embeddings = context;
    }
}

impl Qwen2Config {
    /// Parses a `config.json` of `Qwen2ForCausalLM` (transformers 5 or 4.x).
    pub fn from_json(text: &str) -> Result<Self> {
        let map = object(text, "qwen2")?;
        if field(&map, "use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(Error::config(
                "use_sliding_window",
                "is true; trainkit's attention is causal over the whole sequence (every \
                 published Qwen2.5 config sets it false)",
            ));
        }
        Ok(Qwen2Config {
            base: LlamaConfig::from_map(&map)?,
        })
    }

    /// Qwen2.5 0.5B as its published `config.json` describes it.
    pub fn qwen2_5_0_5b() -> Self {
        Qwen2Config {
            base: rotary_base([24, 896, 14, 2, 4864], 64, true, 32_768),
        }
    }
}

/// The JSON object of a `config.json` whose `model_type` must be `model_type`, with the
/// checks every Qwen family shares (SiLU MLP).
pub(crate) fn object(text: &str, model_type: &str) -> Result<Map<String, Value>> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| Error::Serde(format!("config.json: {e}")))?;
    let Value::Object(map) = value else {
        return Err(Error::config("config.json", "must hold a JSON object"));
    };
    let t = field(&map, "model_type").and_then(Value::as_str);
    if t != Some(model_type) {
        return Err(Error::config(
            "model_type",
            format!(
                "{} is not a `{model_type}` config; trainkit reads the model types {}",
                t.map_or("a missing model_type".to_string(), |t| format!("`{t}`")),
                super::families::list()
            ),
        ));
    }
    if let Some(act) = field(&map, "hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(Error::config(
                "hidden_act",
                format!("`{act}` is not supported; {model_type}'s MLP uses silu"),
            ));
        }
    }
    Ok(map)
}

/// A Qwen-style base: `[layers, hidden, heads, kv_heads, ffn]`, heads `head_dim` wide,
/// tying and context, with Qwen's published settings: θ = 1 000 000 without scaling, RMS
/// norm eps 1e-6, initializer range 0.02.
pub(crate) fn rotary_base(
    [layers, hidden, heads, kv_heads, ffn]: [usize; 5],
    head_dim: usize,
    tied: bool,
    context: usize,
) -> LlamaConfig {
    LlamaConfig {
        hidden_size: hidden,
        intermediate_size: ffn,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        vocab_size: 151_936,
        max_position_embeddings: context,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tied,
        initializer_range: 0.02,
        rope: Rope {
            theta: 1_000_000.0,
            scaling: RopeScaling::Default,
        },
    }
}
