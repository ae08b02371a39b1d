//! The config of any model family trainkit builds, as one value: what a model
//! directory's `config.json` and a run config's `[model]` table describe.

use super::ShapeFlags;
use super::{AnyFamily, Architecture, Gpt2Config, LlamaConfig, Model, Norm, Rope, RopeScaling};
use super::{Qwen2Config, Qwen3Config};
use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A model family's config.
///
/// In a run config's `[model]` table the family is `arch = "gpt2"` (the default when
/// absent), `arch = "llama"`, ... (every `model_type` of [`super::families::FAMILIES`]),
/// beside the family's own fields (Hugging Face's names).
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// The Llama family.
    Llama(LlamaConfig),
    /// Qwen2 and Qwen2.5.
    Qwen2(Qwen2Config),
    /// Qwen3 (dense).
    Qwen3(Qwen3Config),
}

impl ModelConfig {
    /// The family's config behind one interface.
    pub fn family(&self) -> &dyn AnyFamily {
        match self {
            ModelConfig::Gpt2(c) => c,
            ModelConfig::Llama(c) => c,
            ModelConfig::Qwen2(c) => c,
            ModelConfig::Qwen3(c) => c,
        }
    }

    /// The family's config behind one interface, to change.
    pub fn family_mut(&mut self) -> &mut dyn AnyFamily {
        match self {
            ModelConfig::Gpt2(c) => c,
            ModelConfig::Llama(c) => c,
            ModelConfig::Qwen2(c) => c,
            ModelConfig::Qwen3(c) => c,
        }
    }

    /// Lays `trainkit train`'s shape flags over the config: `--model` starts from a
    /// preset, `--arch` switches the family (to a small model of it,
    /// [`super::families::Registered::small`]), the other flags set the family's fields
    /// ([`super::Family::reshape`]); a flag the family has no use for is an error naming
    /// the family that has it.
    pub fn reshape(&mut self, flags: &ShapeFlags) -> Result<()> {
        let model = self;
        if let Some(name) = &flags.model {
            *model = ModelConfig::preset(name).map_err(|e| e.for_field("--model"))?;
            if let Some(arch) = flags.arch.as_deref().filter(|a| *a != model.arch()) {
                return Err(Error::config(
                    "--arch",
                    format!(
                        "`{arch}` contradicts --model {name}, a {} model",
                        model.arch()
                    ),
                ));
            }
        }
        match flags.arch.as_deref() {
            None => {}
            Some(a) if a == model.arch() => {}
            Some(other) => {
                *model = match super::families::family(other) {
                    Some(f) => (f.small)(),
                    None => {
                        return Err(Error::config(
                            "--arch",
                            format!(
                                "`{other}` is not a model family trainkit builds; use {} ({})",
                                super::families::names(" or "),
                                super::families::list()
                            ),
                        ))
                    }
                }
            }
        }
        model.family_mut().reshape(flags)
    }

    /// The family's name: Hugging Face's `model_type` (`gpt2`, `llama`, ...).
    pub fn arch(&self) -> &'static str {
        self.family().model_type()
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.family().shape().vocab
    }

    /// Longest sequence the model takes.
    pub fn context(&self) -> usize {
        self.family().shape().context
    }

    /// Sets the longest sequence the model takes (GPT-2's `n_positions`, Llama's
    /// `max_position_embeddings`).
    pub fn set_context(&mut self, context: usize) {
        match self {
            ModelConfig::Gpt2(c) => c.n_positions = context,
            ModelConfig::Llama(c) => c.max_position_embeddings = context,
            ModelConfig::Qwen2(c) => c.base.max_position_embeddings = context,
            ModelConfig::Qwen3(c) => c.base.max_position_embeddings = context,
        }
    }

    /// The architecture it describes.
    pub fn architecture(&self) -> Architecture {
        self.family().shape().architecture()
    }

    /// Checks that the shape is buildable; errors name the field.
    pub fn validate(&self) -> Result<()> {
        self.family().validate()
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
        let mut c = match super::families::from_architecture(&p.architecture, context)? {
            ModelConfig::Llama(c) => c,
            other => return Ok(other),
        };
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
        self.build_with(
            crate::ops::AttentionPath::Fused,
            crate::ops::LossPath::Fused,
            None,
        )
    }

    /// The model with its loss computed by `path` in chunks of `chunk` positions (see
    /// [`crate::Gpt2::with_loss`]), and the fused attention.
    pub fn build_with_loss(
        &self,
        path: crate::ops::LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>> {
        self.build_with(crate::ops::AttentionPath::Fused, path, chunk)
    }

    /// The model with its attention computed by `attention` (see
    /// [`crate::Gpt2::with_attention`]) and its loss by `loss` in chunks of `chunk`
    /// positions (see [`crate::Gpt2::with_loss`]).
    pub fn build_with(
        &self,
        attention: crate::ops::AttentionPath,
        loss: crate::ops::LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>> {
        self.family().build_with(attention, loss, chunk)
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

impl From<Qwen2Config> for ModelConfig {
    fn from(c: Qwen2Config) -> Self {
        ModelConfig::Qwen2(c)
    }
}

impl From<Qwen3Config> for ModelConfig {
    fn from(c: Qwen3Config) -> Self {
        ModelConfig::Qwen3(c)
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
            ModelConfig::Qwen2(c) => serde_json::to_value(c),
            ModelConfig::Qwen3(c) => serde_json::to_value(c),
        }
        .map_err(S::Error::custom)?;
        if let (false, Some(map)) = (matches!(self, ModelConfig::Gpt2(_)), v.as_object_mut()) {
            map.insert("arch".into(), self.arch().into());
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
        super::families::from_table(&arch, v).map_err(D::Error::custom)
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
