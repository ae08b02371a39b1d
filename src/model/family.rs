//! A model family: what distinguishes GPT-2 from Llama from Qwen beyond the shared
//! pre-norm decoder. A family is its config (Hugging Face's field names) and an
//! implementation of [`Family`]: the [`Shape`] the config describes, how its parameters are
//! named, and its `config.json`. The defaults name parameters as `LlamaForCausalLM`
//! does, so a Llama-like family implements four methods.

use super::{Model, Shape, ShapeFlags};
use crate::error::Result;
use crate::ops::{AttentionPath, LossPath};
use crate::save::StoredTensor;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::Path;

/// One parameter of a decoder, by what it is rather than by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The token embedding `[vocab, hidden]`.
    Embed,
    /// The learned position embedding `[context, hidden]`.
    Positions,
    /// A parameter of layer `l`.
    Layer(usize, LayerSlot),
    /// The final norm's gain.
    FinalNorm,
    /// The final norm's bias (LayerNorm).
    FinalNormBias,
    /// The untied output head `[vocab, hidden]`.
    Head,
}

/// One parameter of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerSlot {
    /// The attention block's norm gain.
    Norm1,
    /// Its bias (LayerNorm).
    Norm1Bias,
    /// The fused query, key and value projection (query rows first).
    Qkv,
    /// Its bias.
    QkvBias,
    /// The per-head query norm gain `[head_dim]`.
    QNorm,
    /// The per-head key norm gain `[head_dim]`.
    KNorm,
    /// The attention output projection.
    O,
    /// Its bias.
    OBias,
    /// The MLP block's norm gain.
    Norm2,
    /// Its bias (LayerNorm).
    Norm2Bias,
    /// The MLP's first product (gate rows, then up rows, when gated).
    Up,
    /// Its bias.
    UpBias,
    /// The MLP's down projection.
    Down,
    /// Its bias.
    DownBias,
}

/// A model family: a config that describes a [`Shape`], with the family's names.
///
/// The provided methods follow `LlamaForCausalLM`'s layout: weights stored `[out, in]`,
/// parameters named `model.layers.{l}.self_attn.qkv_proj.weight` (the fused projections,
/// which files keep apart as `q_proj`, `k_proj`, `v_proj`, and `gate_proj`, `up_proj`),
/// `model.norm.weight`, `lm_head.weight`.
pub trait Family: Clone + Debug + PartialEq + Send + Sync + 'static {
    /// Hugging Face's `model_type` (`llama`), also the family's name in a run config's
    /// `[model] arch`.
    const MODEL_TYPE: &'static str;

    /// The config field holding the longest sequence, named in errors
    /// (`max_position_embeddings`, GPT-2's `n_positions`).
    const CONTEXT_FIELD: &'static str = "max_position_embeddings";

    /// The shape this config describes.
    fn shape(&self) -> Shape;

    /// Checks that the config is buildable; errors name the field and what would be
    /// valid.
    fn validate(&self) -> Result<()>;

    /// Lays `trainkit train`'s shape flags (`--n-layer`, `--n-head`, ...) over the
    /// family's fields; a flag the family has no use for is an error naming the flag and
    /// the family that has it. By default a family takes none: any given is an error
    /// naming it.
    fn reshape(&mut self, flags: &ShapeFlags) -> Result<()> {
        match flags.first_given() {
            Some(flag) => Err(crate::error::Error::config(
                flag,
                format!(
                    "the `{}` family takes no shape flags; set its config's fields",
                    Self::MODEL_TYPE
                ),
            )),
            None => Ok(()),
        }
    }

    /// The `config.json` Hugging Face reads for this model.
    fn hf_config(&self) -> serde_json::Value;

    /// The parameter's name in trainkit (and, unless the family fuses it, in files).
    fn param_name(&self, slot: Slot) -> String {
        llama_name(slot)
    }

    /// Whether weights are stored `[out, in]` (PyTorch's `nn.Linear`); GPT-2's `Conv1D`
    /// stores `[in, out]`.
    fn out_in(&self) -> bool {
        true
    }

    /// The label scope of the final norm's values (`norm`, GPT-2's `ln_f`).
    fn final_norm_label(&self) -> &'static str {
        "norm"
    }

    /// The parameters as the family's files name and shape them (see
    /// [`Model::export_tensors`]): the fused projections split into Hugging Face's.
    fn export_tensors<'t>(&self, tensors: Vec<StoredTensor<'t>>) -> Result<Vec<StoredTensor<'t>>> {
        super::decoder::split_fused(self, tensors)
    }

    /// A file's tensors by parameter name (see [`Model::import_tensors`]): Hugging Face's
    /// separate projections stacked into the fused ones.
    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>> {
        super::decoder::stack_fused(self, tensors)
    }

    /// The tensors of a model directory's files by the names the family reads them
    /// under (GPT-2's files may lack the `transformer.` prefix and hold mask buffers).
    fn file_tensors(
        &self,
        tensors: Vec<StoredTensor<'static>>,
    ) -> BTreeMap<String, StoredTensor<'static>> {
        tensors.into_iter().map(|t| (t.name.clone(), t)).collect()
    }

    /// The model, with its attention computed by `attention` and its loss by `loss` in
    /// chunks of `chunk` positions.
    fn build_with(
        &self,
        attention: AttentionPath,
        loss: LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>> {
        Ok(Box::new(
            super::Decoder::new(self.clone())?
                .with_attention(attention)
                .with_loss(loss, chunk)?,
        ))
    }
}

/// A family the registry lists ([`super::families::FAMILIES`]): a [`Family`] whose config
/// a run config's `[model]` table holds (serde, with Hugging Face's field names), read from
/// a `config.json`, made from a [`Shape`] (presets, autofit) and sized for the default run.
/// A new family is its file (the config, `impl Family`, `impl FamilyConfig`) and one line
/// of the registry; [`super::ModelConfig`] holds any of them.
pub trait FamilyConfig: Family + Serialize + DeserializeOwned {
    /// The models the family covers, for messages (`Llama, SmolLM2, TinyLlama`).
    const MODELS: &'static str;

    /// Reads the family's `config.json` from its text; `path` names the file in errors.
    fn read_config(path: &Path, text: &str) -> Result<Self>;

    /// The family's config of `shape` (its context, rotary embedding, epsilon and
    /// initialisation carried over), or an error naming what the family lacks.
    fn from_shape(shape: &Shape) -> Result<Self>;

    /// A small model of the family: the default run's size, what `--arch` starts from.
    fn small() -> Self;

    /// Sets the longest sequence the model takes (the field [`Family::CONTEXT_FIELD`]
    /// names).
    fn set_context(&mut self, context: usize);
}

/// `LlamaForCausalLM`'s name of a slot (with trainkit's fused projections).
pub fn llama_name(slot: Slot) -> String {
    let layer = |l: usize, s: &str| format!("model.layers.{l}.{s}");
    match slot {
        Slot::Embed => "model.embed_tokens.weight".into(),
        Slot::Positions => "model.embed_positions.weight".into(),
        Slot::FinalNorm => "model.norm.weight".into(),
        Slot::FinalNormBias => "model.norm.bias".into(),
        Slot::Head => "lm_head.weight".into(),
        Slot::Layer(l, s) => layer(
            l,
            match s {
                LayerSlot::Norm1 => "input_layernorm.weight",
                LayerSlot::Norm1Bias => "input_layernorm.bias",
                LayerSlot::Qkv => "self_attn.qkv_proj.weight",
                LayerSlot::QkvBias => "self_attn.qkv_proj.bias",
                LayerSlot::QNorm => "self_attn.q_norm.weight",
                LayerSlot::KNorm => "self_attn.k_norm.weight",
                LayerSlot::O => "self_attn.o_proj.weight",
                LayerSlot::OBias => "self_attn.o_proj.bias",
                LayerSlot::Norm2 => "post_attention_layernorm.weight",
                LayerSlot::Norm2Bias => "post_attention_layernorm.bias",
                LayerSlot::Up => "mlp.gate_up_proj.weight",
                LayerSlot::UpBias => "mlp.gate_up_proj.bias",
                LayerSlot::Down => "mlp.down_proj.weight",
                LayerSlot::DownBias => "mlp.down_proj.bias",
            },
        ),
    }
}

/// A [`Family`] behind a reference: what [`super::ModelConfig`] hands out for whichever
/// family it holds.
pub trait AnyFamily: Debug + Send + Sync {
    /// Hugging Face's `model_type`.
    fn model_type(&self) -> &'static str;
    /// The shape.
    fn shape(&self) -> Shape;
    /// Checks that the model is buildable.
    fn validate(&self) -> Result<()>;
    /// Lays the shape flags over the config (see [`Family::reshape`]).
    fn reshape(&mut self, flags: &ShapeFlags) -> Result<()>;
    /// The `config.json` to write.
    fn hf_config(&self) -> serde_json::Value;
    /// Every parameter's name and shape in model order.
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)>;
    /// A model directory's tensors by the names the family reads them under.
    fn file_tensors(
        &self,
        tensors: Vec<StoredTensor<'static>>,
    ) -> BTreeMap<String, StoredTensor<'static>>;
    /// The tensors by parameter name (see [`Family::import_tensors`]), the embedding and
    /// head padded to [`Shape::padded_vocab`] rows.
    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>>;
    /// The model (see [`Family::build_with`]).
    fn build_with(
        &self,
        attention: AttentionPath,
        loss: LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>>;
    /// Every linear projection's Hugging Face module name, in model order (`q_proj` and
    /// the other blocks of a fused projection apart): what an adapter targets.
    fn projection_modules(&self) -> Vec<String>;
}

impl<F: Family> AnyFamily for F {
    fn model_type(&self) -> &'static str {
        F::MODEL_TYPE
    }

    fn shape(&self) -> Shape {
        Family::shape(self)
    }

    fn validate(&self) -> Result<()> {
        Family::validate(self)?;
        super::decoder::check(&Family::shape(self))
    }

    fn reshape(&mut self, flags: &ShapeFlags) -> Result<()> {
        Family::reshape(self, flags)
    }

    fn hf_config(&self) -> serde_json::Value {
        Family::hf_config(self)
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        super::decoder::param_shapes(self)
    }

    fn file_tensors(
        &self,
        tensors: Vec<StoredTensor<'static>>,
    ) -> BTreeMap<String, StoredTensor<'static>> {
        Family::file_tensors(self, tensors)
    }

    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>> {
        super::decoder::import_tensors(self, tensors)
    }

    fn build_with(
        &self,
        attention: AttentionPath,
        loss: LossPath,
        chunk: Option<usize>,
    ) -> Result<Box<dyn Model>> {
        Family::build_with(self, attention, loss, chunk)
    }

    fn projection_modules(&self) -> Vec<String> {
        super::decoder::projection_modules(self)
    }
}

/// A [`FamilyConfig`] behind a box: what [`super::ModelConfig`] holds.
pub(crate) trait AnyConfig: AnyFamily {
    /// A copy in a new box.
    fn clone_box(&self) -> Box<dyn AnyConfig>;
    /// Whether `other` is the same family with the same fields.
    fn same_as(&self, other: &dyn AnyConfig) -> bool;
    /// The config, to downcast.
    fn as_any(&self) -> &dyn Any;
    /// The config, to downcast and change.
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// The config's fields as a run config's `[model]` table holds them.
    fn to_value(&self) -> serde_json::Result<serde_json::Value>;
    /// Sets the longest sequence (see [`FamilyConfig::set_context`]).
    fn set_context(&mut self, context: usize);
}

impl<F: FamilyConfig> AnyConfig for F {
    fn clone_box(&self) -> Box<dyn AnyConfig> {
        Box::new(self.clone())
    }

    fn same_as(&self, other: &dyn AnyConfig) -> bool {
        other.as_any().downcast_ref::<F>() == Some(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn to_value(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::to_value(self)
    }

    fn set_context(&mut self, context: usize) {
        FamilyConfig::set_context(self, context)
    }
}
