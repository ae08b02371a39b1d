//! The config of any model family trainkit builds, as one value: what a model
//! directory's `config.json` and a run config's `[model]` table describe.

use super::family::AnyConfig;
use super::{AnyFamily, FamilyConfig, Gpt2Config, Model, Shape, ShapeFlags};
use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt::Debug;

/// A model family's config: any registered family ([`super::families::FAMILIES`]) behind
/// one value.
///
/// In a run config's `[model]` table the family is `arch = "gpt2"` (the default when
/// absent), `arch = "llama"`, ... (every `model_type` of [`super::families::FAMILIES`]),
/// beside the family's own fields (Hugging Face's names). Make one of a family's config
/// with [`ModelConfig::new`] (or `.into()`), and look at the family's own fields with
/// [`ModelConfig::get`].
pub struct ModelConfig(Box<dyn AnyConfig>);

impl ModelConfig {
    /// The config of a family.
    pub fn new<F: FamilyConfig>(config: F) -> Self {
        ModelConfig(Box::new(config))
    }

    /// The family's own config, if it is of family `F`.
    pub fn get<F: FamilyConfig>(&self) -> Option<&F> {
        self.0.as_any().downcast_ref()
    }

    /// The family's own config, to change, if it is of family `F`.
    pub fn get_mut<F: FamilyConfig>(&mut self) -> Option<&mut F> {
        self.0.as_any_mut().downcast_mut()
    }

    /// The family's config behind one interface.
    pub fn family(&self) -> &dyn AnyFamily {
        &*self.0
    }

    /// The family's config behind one interface, to change.
    pub fn family_mut(&mut self) -> &mut dyn AnyFamily {
        &mut *self.0
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
        self.0.set_context(context)
    }

    /// The shape it describes.
    pub fn shape(&self) -> Shape {
        self.family().shape()
    }

    /// Checks that the shape is buildable; errors name the field.
    pub fn validate(&self) -> Result<()> {
        self.family().validate()
    }

    /// The config of a preset (`trainkit memory --model` names them): its published
    /// shape ([`crate::estimate::Preset::shape`]) in the family that builds it.
    pub fn preset(name: &str) -> Result<ModelConfig> {
        super::families::from_shape(&crate::estimate::preset(name)?.shape)
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

impl<F: FamilyConfig> From<F> for ModelConfig {
    fn from(c: F) -> Self {
        ModelConfig::new(c)
    }
}

impl Clone for ModelConfig {
    fn clone(&self) -> Self {
        ModelConfig(self.0.clone_box())
    }
}

impl PartialEq for ModelConfig {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_as(&*other.0)
    }
}

impl Debug for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig::new(Gpt2Config::small_bytes())
    }
}

impl Serialize for ModelConfig {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut v = self.0.to_value().map_err(S::Error::custom)?;
        // GPT-2, the default family, is written without `arch` (as older files are).
        if let (true, Some(map)) = (self.arch() != "gpt2", v.as_object_mut()) {
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
                    "model.arch: {other} is not a name; use {}",
                    super::families::names(" or ")
                )))
            }
        };
        super::families::from_table(&arch, v).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LlamaConfig, Rope, RopeScaling};

    #[test]
    fn presets_build_with_their_published_shapes() {
        let c = ModelConfig::preset("llama-3.2-1b").unwrap();
        let l = c.get::<LlamaConfig>().unwrap();
        assert_eq!((l.head_dim, l.num_key_value_heads), (64, 8));
        assert!(matches!(l.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
        let g = ModelConfig::preset("gpt2").unwrap();
        assert_eq!(g.get::<Gpt2Config>(), Some(&Gpt2Config::gpt2_124m()));
        assert_eq!(g.get::<LlamaConfig>(), None);
        assert!(ModelConfig::preset("nope").is_err());
    }

    #[test]
    fn either_family_round_trips_through_toml() {
        let llama = ModelConfig::new(LlamaConfig {
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
        assert_eq!(toml::from_str::<ModelConfig>(gpt2).unwrap().arch(), "gpt2");
        let e = toml::from_str::<ModelConfig>(&format!("arch = \"mamba\"\n{gpt2}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt2") && e.contains("llama"), "{e}");
    }
}
