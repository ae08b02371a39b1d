//! The shape of either model family trainkit builds, as one value: what a model
//! directory's `config.json` and a run config's `[model]` table describe.

use super::{Architecture, Gpt2, Gpt2Config, Llama, LlamaConfig, Model};
use crate::error::Result;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A GPT-2 or a Llama config.
///
/// In a run config's `[model]` table the family is `arch = "gpt2"` (the default when
/// absent) or `arch = "llama"`, beside the family's own fields (Hugging Face's names).
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// The Llama family.
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// The family's name: `gpt2` or `llama` (Hugging Face's `model_type`).
    pub fn arch(&self) -> &'static str {
        match self {
            ModelConfig::Gpt2(_) => "gpt2",
            ModelConfig::Llama(_) => "llama",
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }

    /// Longest sequence the model takes.
    pub fn context(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_positions,
            ModelConfig::Llama(c) => c.max_position_embeddings,
        }
    }

    /// Sets the longest sequence the model takes (GPT-2's `n_positions`, Llama's
    /// `max_position_embeddings`).
    pub fn set_context(&mut self, context: usize) {
        match self {
            ModelConfig::Gpt2(c) => c.n_positions = context,
            ModelConfig::Llama(c) => c.max_position_embeddings = context,
        }
    }

    /// The architecture it describes.
    pub fn architecture(&self) -> Architecture {
        match self {
            ModelConfig::Gpt2(c) => c.architecture(),
            ModelConfig::Llama(c) => c.architecture(),
        }
    }

    /// Checks that the shape is buildable; errors name the field.
    pub fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Gpt2(c) => c.validate(),
            ModelConfig::Llama(c) => Llama::new(c.clone()).map(|_| ()),
        }
    }

    /// The model, with freshly declared parameters.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        Ok(match self {
            ModelConfig::Gpt2(c) => Box::new(Gpt2::new(c.clone())?),
            ModelConfig::Llama(c) => Box::new(Llama::new(c.clone())?),
        })
    }
}

impl From<Gpt2Config> for ModelConfig {
    fn from(c: Gpt2Config) -> Self {
        ModelConfig::Gpt2(c)
    }
}

impl From<LlamaConfig> for ModelConfig {
    fn from(c: LlamaConfig) -> Self {
        ModelConfig::Llama(c)
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig::Gpt2(Gpt2Config::small_bytes())
    }
}

impl Serialize for ModelConfig {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut v = match self {
            ModelConfig::Gpt2(c) => serde_json::to_value(c),
            ModelConfig::Llama(c) => serde_json::to_value(c),
        }
        .map_err(S::Error::custom)?;
        if let (ModelConfig::Llama(_), Some(map)) = (self, v.as_object_mut()) {
            map.insert("arch".into(), "llama".into());
        }
        v.serialize(s)
    }
}

impl<'de> Deserialize<'de> for ModelConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut v = serde_json::Value::deserialize(d)?;
        let arch = match v.as_object_mut().and_then(|m| m.remove("arch")) {
            None => "gpt2".to_string(),
            Some(serde_json::Value::String(s)) => s,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "model.arch: {other} is not a name; use \"gpt2\" or \"llama\""
                )))
            }
        };
        match arch.as_str() {
            "gpt2" => serde_json::from_value(v)
                .map(ModelConfig::Gpt2)
                .map_err(D::Error::custom),
            "llama" => serde_json::from_value(v)
                .map(ModelConfig::Llama)
                .map_err(D::Error::custom),
            other => Err(D::Error::custom(format!(
                "model.arch: `{other}` is not a model family trainkit builds; use \"gpt2\" or \
                 \"llama\""
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Rope, RopeScaling};

    #[test]
    fn either_family_round_trips_through_toml() {
        let llama = ModelConfig::Llama(LlamaConfig {
            hidden_size: 64,
            intermediate_size: 160,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            vocab_size: 256,
            max_position_embeddings: 128,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            initializer_range: 0.02,
            rope: Rope {
                theta: 10_000.0,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 64.0,
                },
            },
        });
        for c in [llama, ModelConfig::default()] {
            let text = toml::to_string(&c).unwrap();
            let back: ModelConfig = toml::from_str(&text).unwrap();
            assert_eq!(back, c, "{text}");
        }
        let gpt2 = "n_layer = 1\nn_head = 2\nn_embd = 8\nn_positions = 16\nvocab_size = 32\n";
        assert!(matches!(
            toml::from_str::<ModelConfig>(gpt2).unwrap(),
            ModelConfig::Gpt2(_)
        ));
        let e = toml::from_str::<ModelConfig>(&format!("arch = \"mamba\"\n{gpt2}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt2") && e.contains("llama"), "{e}");
    }
}
