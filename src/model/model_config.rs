//! The shape of either model family trainkit builds, as one value: what a model
//! directory's `config.json` and a run config's `[model]` table describe.

use super::{Architecture, Gpt2, Gpt2Config, Llama, LlamaConfig, Model, Norm, Rope, RopeScaling};
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

    /// The config of a preset (`trainkit memory --model` names them): GPT-2 presets with
    /// their context as positions; Llama-family presets with the rotary embedding, RMSNorm
    /// eps and initialisation of each model's published config (Llama 3's `llama3` rope
    /// scaling included).
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let p = crate::estimate::preset(name)?;
        let context = usize::try_from(p.context).unwrap_or(usize::MAX);
        if p.architecture.norm == Norm::LayerNorm {
            let arch = Architecture {
                positions: p.context,
                ..p.architecture
            };
            return Ok(ModelConfig::Gpt2(Gpt2Config::from_architecture(&arch)?));
        }
        let mut c = LlamaConfig::from_architecture(&p.architecture, context)?;
        let llama3 = |factor| Rope {
            theta: 500_000.0,
            scaling: RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
        };
        let plain = |theta| Rope {
            theta,
            scaling: RopeScaling::Default,
        };
        (c.rope, c.initializer_range) = match p.name {
            "smollm2-135m" => (plain(100_000.0), 0.041_666_666_666_666_664),
            "smollm2-360m" => (plain(100_000.0), 0.02),
            "smollm2-1.7b" => (plain(130_000.0), 0.02),
            "llama-3.1-8b" | "llama-8b" | "llama-70b" | "llama-405b" => (llama3(8.0), 0.02),
            _ => (llama3(32.0), 0.02),
        };
        Ok(ModelConfig::Llama(c))
    }

    /// The model, with freshly declared parameters (and the fused loss).
    pub fn build(&self) -> Result<Box<dyn Model>> {
        Ok(match self {
            ModelConfig::Gpt2(c) => Box::new(Gpt2::new(c.clone())?),
            ModelConfig::Llama(c) => Box::new(Llama::new(c.clone())?),
        })
    }

    /// The model with its loss computed by `path` in chunks of `chunk` positions (see
    /// [`Gpt2::with_loss`]), and the fused attention.
    pub fn build_with_loss(
        &self,
        path: crate::ops::LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>> {
        self.build_with(crate::ops::AttentionPath::Fused, path, chunk)
    }

    /// The model with its attention computed by `attention` (see
    /// [`Gpt2::with_attention`]) and its loss by `loss` in chunks of `chunk` positions
    /// (see [`Gpt2::with_loss`]).
    pub fn build_with(
        &self,
        attention: crate::ops::AttentionPath,
        loss: crate::ops::LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>> {
        Ok(match self {
            ModelConfig::Gpt2(c) => Box::new(
                Gpt2::new(c.clone())?
                    .with_attention(attention)
                    .with_loss(loss, chunk)?,
            ),
            ModelConfig::Llama(c) => Box::new(
                Llama::new(c.clone())?
                    .with_attention(attention)
                    .with_loss(loss, chunk)?,
            ),
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

    #[test]
    fn presets_build_with_their_published_shapes() {
        let c = ModelConfig::preset("llama-3.2-1b").unwrap();
        let ModelConfig::Llama(l) = &c else {
            panic!("{c:?}")
        };
        assert_eq!((l.head_dim, l.num_key_value_heads), (64, 8));
        assert!(matches!(l.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
        let ModelConfig::Gpt2(g) = ModelConfig::preset("gpt2").unwrap() else {
            panic!("gpt2")
        };
        assert_eq!(g, Gpt2Config::gpt2_124m());
        assert!(ModelConfig::preset("nope").is_err());
    }

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
