//! The one decoder-only model: a [`Family`]'s config, the [`Shape`] it describes, its
//! parameters (named by the family) and the graph of the shared pre-norm block builder
//! ([`block`]), run by the executor ([`super::exec`]). GPT-2, Llama and Qwen are this
//! type with their family's config ([`crate::Gpt2`], [`crate::Llama`], ...).

mod adapters;
mod block;
mod fused;
mod vocab;

pub(crate) use fused::{split_fused, stack_fused};

use super::exec;
use super::graph::{overridden, Graph, OpOverride};
use super::shape::{Positions, Shape};
use super::{
    Batch, Family, Init, KvCache, LayerSlot, Mlp, Model, Norm, ParamInit, Pass, PassStats, Slot,
};
use crate::adapter::{Adapter, FullFineTune, LowRank};
use crate::error::{Error, Result};
use crate::ops::{AttentionPath, LinearCrossEntropy, LossPath};
use crate::save::StoredTensor;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A decoder-only transformer of family `F`, trainable on any backend with any
/// checkpoint policy and precision.
#[derive(Debug)]
pub struct Decoder<F: Family> {
    config: F,
    shape: Shape,
    loss: LossPath,
    loss_chunk: Option<usize>,
    attention: AttentionPath,
    overrides: Vec<Arc<dyn OpOverride>>,
    adapter: Arc<dyn Adapter>,
    graph: Graph,
}

impl<F: Family> Clone for Decoder<F> {
    fn clone(&self) -> Self {
        Decoder {
            config: self.config.clone(),
            shape: self.shape,
            loss: self.loss,
            loss_chunk: self.loss_chunk,
            attention: self.attention,
            overrides: self.overrides.clone(),
            adapter: Arc::clone(&self.adapter),
            graph: self.build_graph(),
        }
    }
}

impl<F: Family> PartialEq for Decoder<F> {
    fn eq(&self, other: &Self) -> bool {
        self.config == other.config
            && self.loss == other.loss
            && self.loss_chunk == other.loss_chunk
            && self.attention == other.attention
            && self.overrides.len() == other.overrides.len()
            && self
                .overrides
                .iter()
                .zip(&other.overrides)
                .all(|(a, b)| Arc::ptr_eq(a, b))
            && (Arc::ptr_eq(&self.adapter, &other.adapter)
                || serde_json::to_string(&*self.adapter).ok()
                    == serde_json::to_string(&*other.adapter).ok())
    }
}

impl<F: Family> Decoder<F> {
    /// The model of `config` (validated), with the fused attention
    /// ([`crate::ops::FlashAttention`]) and the fused loss ([`LinearCrossEntropy`], chunks
    /// chosen from the vocabulary).
    pub fn new(config: F) -> Result<Self> {
        config.validate()?;
        let shape = config.shape();
        check(&shape)?;
        let mut model = Decoder {
            config,
            shape,
            loss: LossPath::Fused,
            loss_chunk: None,
            attention: AttentionPath::Fused,
            overrides: Vec::new(),
            adapter: Arc::new(FullFineTune),
            graph: Graph::default(),
        };
        model.graph = model.build_graph();
        Ok(model)
    }

    /// The same model with its attention computed by `path`: fused (the default) or the
    /// materialized `[B, H, T, T]` probabilities.
    pub fn with_attention(mut self, path: AttentionPath) -> Self {
        self.attention = path;
        self.graph = self.build_graph();
        self
    }

    /// How attention is computed.
    pub fn attention_path(&self) -> AttentionPath {
        self.attention
    }

    /// The same model with some of its op nodes replaced by `o` (see [`OpOverride`]): a
    /// fused op or a variant of your own, run in place of trainkit's. The model keeps the
    /// override and applies it whenever it rebuilds its graph.
    pub fn with_override(mut self, o: impl OpOverride + 'static) -> Self {
        self.overrides.push(Arc::new(o));
        self.graph = self.build_graph();
        self
    }

    /// The same model trained through `adapter`: which base parameters train, and the
    /// low-rank updates it adds (LoRA, [`crate::adapter::Lora`]). Fails when the adapter
    /// does not fit the model (a target it has no projection for), naming it.
    pub fn with_adapter(mut self, adapter: Arc<dyn Adapter>) -> Result<Self> {
        let modules: Vec<String> = adapters::projections(&self.config, &self.shape)
            .into_iter()
            .map(|p| p.module)
            .collect();
        adapter.check(&modules)?;
        let params = self.params();
        let outside: Vec<String> = params
            .iter()
            .filter(|(slot, ..)| !in_projection(*slot))
            .map(|(_, name, _)| name.clone())
            .collect();
        adapter.check_params(&outside)?;
        self.adapter = adapter;
        self.graph = self.build_graph();
        Ok(self)
    }

    /// The adapter the model trains through ([`FullFineTune`] unless one was set).
    pub fn adapter(&self) -> &Arc<dyn Adapter> {
        &self.adapter
    }

    /// Every linear projection's Hugging Face module name (`q_proj` and the other blocks
    /// of the fused projections apart), in model order: what an adapter targets.
    pub fn projection_modules(&self) -> Vec<String> {
        projection_modules(&self.config)
    }

    /// The low-rank updates the adapter adds, by module name, in model order.
    fn updates(&self) -> Vec<(adapters::Projection, LowRank)> {
        adapters::updates(&self.config, &self.shape, self.adapter.as_ref())
    }

    /// The same model with its loss computed by `path`: the fused linear cross-entropy
    /// in chunks of `chunk` positions (`None`: chosen from the vocabulary), or the
    /// materialized logits (where `chunk` is ignored). A chunk of 0 is an error naming
    /// `training.loss_chunk`.
    pub fn with_loss(mut self, path: LossPath, chunk: Option<usize>) -> Result<Self> {
        LinearCrossEntropy::new("training.loss_chunk", chunk)?;
        self.loss = path;
        self.loss_chunk = chunk;
        self.graph = self.build_graph();
        Ok(self)
    }

    /// How the loss is computed, and the fused loss's configured chunk.
    pub fn loss_path(&self) -> (LossPath, Option<usize>) {
        (self.loss, self.loss_chunk)
    }

    /// The family's config.
    pub fn config(&self) -> &F {
        &self.config
    }

    /// The shape the config describes.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The graph of op nodes the executor runs.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Every parameter's slot, name and shape, in model order.
    pub fn params(&self) -> Vec<(Slot, String, Vec<usize>)> {
        params(&self.config, &self.shape)
    }

    /// Every parameter's name and shape, in model order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.params()
            .into_iter()
            .map(|(_, name, shape)| (name, shape))
            .collect()
    }

    /// The number of parameters (a tied head counted once), as Hugging Face counts them:
    /// without the rows that pad the vocabulary ([`Shape::padded_vocab`]).
    pub fn num_params(&self) -> usize {
        num_params(&self.shape)
    }

    /// The Hugging Face modules an NF4 projection weight holds, each quantized on its own
    /// as bitsandbytes quantizes each module: `q_proj`, `k_proj` and `v_proj` in a fused
    /// `qkv_proj`; `gate_proj` and `up_proj` in a fused `gate_up_proj`; one part otherwise
    /// (GPT-2's `c_attn` is one module in its files too).
    fn nf4_parts(&self, slot: LayerSlot, name: &str) -> crate::tensor::nf4::Parts {
        let heads = self.shape.heads();
        let c = self.shape.hidden as u64;
        let (q, kv, f) = (
            heads.q_width() as u64,
            heads.kv_width() as u64,
            self.shape.ffn as u64,
        );
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let fused = |n: &str| module.rsplit('.').next() == Some(n);
        match slot {
            LayerSlot::Qkv if fused("qkv_proj") => crate::tensor::nf4::Parts([q * c, kv * c]),
            LayerSlot::Up if fused("gate_up_proj") => crate::tensor::nf4::Parts([f * c, 0]),
            _ => crate::tensor::nf4::Parts::WHOLE,
        }
    }

    /// The graph of this model's shape, attention and loss paths, with its overrides.
    fn build_graph(&self) -> Graph {
        let names: Vec<String> = self.params().into_iter().map(|(_, n, _)| n).collect();
        let index: HashMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, name)| (name.as_str(), i))
            .collect();
        let p = |slot: Slot| index[self.config.param_name(slot).as_str()];
        let fused_loss = (self.loss == LossPath::Fused).then_some(LinearCrossEntropy {
            chunk: self.loss_chunk,
        });
        let labels = block::Labels {
            final_norm: self.config.final_norm_label(),
        };
        let trains: Vec<bool> = names.iter().map(|n| self.adapter.trains(n)).collect();
        let refs = adapters::update_refs(&self.updates(), names.len());
        let updates = |l: usize, slot: LayerSlot| -> Vec<adapters::UpdateRef> {
            refs.iter()
                .filter(|(rl, rs, _)| *rl == l && *rs == slot)
                .map(|(_, _, r)| r.clone())
                .collect()
        };
        let graph = block::graph(
            &self.shape,
            &p,
            &block::Adapters {
                updates: &updates,
                trains: &|i| trains.get(i).copied().unwrap_or(true),
            },
            self.config.out_in(),
            &labels,
            fused_loss,
            self.attention,
        );
        overridden(graph, &self.overrides)
    }

    /// Fails unless `batch` fits the context and its inputs are tokens of the vocabulary
    /// (the embedding's padding rows are no tokens).
    fn check_batch(&self, batch: &Batch) -> Result<()> {
        batch.check(self.shape.context, F::CONTEXT_FIELD)?;
        let vocab = self.shape.vocab;
        match batch.inputs.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(Error::data(
                "tokens",
                format!(
                    "token id {bad} is beyond the vocabulary of {vocab}; use a tokenizer that \
                     matches the model's vocab_size"
                ),
            )),
            None => Ok(()),
        }
    }
}

/// Every parameter's slot, name (by `family`) and shape (`[in, out]` where the family
/// stores weights so) for `shape`, in model order.
fn params<F: Family>(family: &F, shape: &Shape) -> Vec<(Slot, String, Vec<usize>)> {
    let out_in = family.out_in();
    param_slots(shape)
        .into_iter()
        .map(|(slot, mut dims)| {
            if !out_in && is_projection(slot) {
                dims.reverse();
            }
            (slot, family.param_name(slot), dims)
        })
        .collect()
}

/// The number of parameters of `shape` (a tied head counted once) without the
/// vocabulary's padding rows.
pub(crate) fn num_params(shape: &Shape) -> usize {
    let stored: usize = param_slots(shape)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    stored - vocab::padding_params(shape)
}

/// A file's tensors by `family`'s parameter names ([`Family::import_tensors`]), the
/// embedding and head padded to [`Shape::padded_vocab`] rows.
pub(crate) fn import_tensors<F: Family>(
    family: &F,
    tensors: BTreeMap<String, StoredTensor<'static>>,
) -> Result<BTreeMap<String, StoredTensor<'static>>> {
    vocab::pad(family, family.import_tensors(tensors)?)
}

/// Every linear projection's Hugging Face module name in `family`'s model, in model
/// order (see [`Decoder::projection_modules`]).
pub(crate) fn projection_modules<F: Family>(family: &F) -> Vec<String> {
    adapters::projections(family, &family.shape())
        .into_iter()
        .map(|p| p.module)
        .collect()
}

/// Every parameter's name and shape for `family`'s config, in model order (the
/// embedding and head with [`Shape::padded_vocab`] rows).
pub(crate) fn param_shapes<F: Family>(family: &F) -> Vec<(String, Vec<usize>)> {
    params(family, &family.shape())
        .into_iter()
        .map(|(_, name, dims)| (name, dims))
        .collect()
}

/// Fails unless the shared builder builds `shape`; errors name the field.
pub(crate) fn check(shape: &Shape) -> Result<()> {
    for (field, v) in [
        ("layers", shape.layers),
        ("hidden", shape.hidden),
        ("heads", shape.heads),
        ("kv_heads", shape.kv_heads),
        ("head_dim", shape.head_dim),
        ("ffn", shape.ffn),
        ("vocab", shape.vocab),
        ("context", shape.context),
    ] {
        if v == 0 {
            return Err(Error::config(
                format!("model.{field}"),
                "must be at least 1",
            ));
        }
    }
    if shape.heads % shape.kv_heads != 0 {
        return Err(Error::config(
            "model.kv_heads",
            format!(
                "{} does not divide the {} query heads",
                shape.kv_heads, shape.heads
            ),
        ));
    }
    if shape.mlp == Mlp::Gelu && !shape.bias.mlp {
        return Err(Error::config(
            "model.mlp",
            "a GELU MLP without biases is not built; use biases or a SwiGLU MLP",
        ));
    }
    if shape.norm_offset && (shape.norm != Norm::RmsNorm || shape.qk_norm) {
        return Err(Error::config(
            "model.norm_offset",
            "gains stored as offsets from 1 are built for the RMS norms of the blocks and \
             the head only (not LayerNorm, not the q/k norm)",
        ));
    }
    if shape.embedding_scale.is_some_and(|s| !s.is_finite()) {
        return Err(Error::config(
            "model.embedding_scale",
            "must be a finite number",
        ));
    }
    Ok(())
}

/// Every parameter's slot and shape for `shape`, in model order, weights `[out, in]`
/// (a family that stores them `[in, out]`, [`Family::out_in`], has them transposed by
/// [`Decoder::params`]).
/// The embedding and the head hold [`Shape::padded_vocab`] rows.
fn param_slots(shape: &Shape) -> Vec<(Slot, Vec<usize>)> {
    let (c, v) = (shape.hidden, shape.padded_vocab());
    let heads = shape.heads();
    let layer_norm = shape.norm == Norm::LayerNorm;
    let mut out = vec![(Slot::Embed, vec![v, c])];
    if shape.positions == Positions::Learned {
        out.push((Slot::Positions, vec![shape.context, c]));
    }
    for l in 0..shape.layers {
        let mut add = |s: LayerSlot, dims: Vec<usize>, on: bool| {
            if on {
                out.push((Slot::Layer(l, s), dims));
            }
        };
        add(LayerSlot::Norm1, vec![c], true);
        add(LayerSlot::Norm1Bias, vec![c], layer_norm);
        add(LayerSlot::Qkv, vec![heads.qkv_width(), c], true);
        add(LayerSlot::QkvBias, vec![heads.qkv_width()], shape.bias.qkv);
        add(LayerSlot::QNorm, vec![shape.head_dim], shape.qk_norm);
        add(LayerSlot::KNorm, vec![shape.head_dim], shape.qk_norm);
        add(LayerSlot::O, vec![c, heads.q_width()], true);
        add(LayerSlot::OBias, vec![c], shape.bias.o);
        add(LayerSlot::Norm2, vec![c], true);
        add(LayerSlot::Norm2Bias, vec![c], layer_norm);
        add(LayerSlot::Up, vec![shape.up_width(), c], true);
        add(LayerSlot::UpBias, vec![shape.up_width()], shape.bias.mlp);
        add(LayerSlot::Down, vec![c, shape.ffn], true);
        add(LayerSlot::DownBias, vec![c], shape.bias.mlp);
    }
    out.push((Slot::FinalNorm, vec![c]));
    if layer_norm {
        out.push((Slot::FinalNormBias, vec![c]));
    }
    if !shape.tied_embeddings {
        out.push((Slot::Head, vec![v, c]));
    }
    out
}

/// Whether `slot` is a weight of a linear projection (stored `[in, out]` by a family
/// whose [`Family::out_in`] is false).
fn is_projection(slot: Slot) -> bool {
    matches!(
        slot,
        Slot::Layer(
            _,
            LayerSlot::Qkv | LayerSlot::O | LayerSlot::Up | LayerSlot::Down
        )
    )
}

/// Whether `slot` is a projection's weight or bias: what LoRA adapts, never a module it
/// saves whole.
fn in_projection(slot: Slot) -> bool {
    is_projection(slot)
        || matches!(
            slot,
            Slot::Layer(
                _,
                LayerSlot::QkvBias | LayerSlot::OBias | LayerSlot::UpBias | LayerSlot::DownBias
            )
        )
}

/// How `slot`'s values start (transformers' `_init_weights`): norm gains 1 (0 stored as
/// offsets from 1), biases 0,
/// the residual projections normal with `init_std / √(2·layers)` when the shape scales
/// them (GPT-2), every other weight normal with `init_std`; the rows that pad the
/// vocabulary of the embedding and the head 0.
fn init(shape: &Shape, slot: Slot) -> Init {
    use LayerSlot as L;
    match slot {
        Slot::Embed | Slot::Head if shape.padded_vocab() > shape.vocab => Init::Rows {
            rows: shape.vocab,
            init: Box::new(Init::Normal {
                std: shape.init_std,
            }),
        },
        Slot::FinalNorm | Slot::Layer(_, L::Norm1 | L::Norm2 | L::QNorm | L::KNorm) => {
            Init::Constant(if shape.norm_offset { 0.0 } else { 1.0 })
        }
        Slot::FinalNormBias
        | Slot::Layer(
            _,
            L::Norm1Bias | L::Norm2Bias | L::QkvBias | L::OBias | L::UpBias | L::DownBias,
        ) => Init::Constant(0.0),
        Slot::Layer(_, L::O | L::Down) if shape.scaled_residual_init => Init::Normal {
            std: shape.init_std / ((2 * shape.layers) as f64).sqrt(),
        },
        _ => Init::Normal {
            std: shape.init_std,
        },
    }
}

impl<F: Family> Decoder<F> {
    /// Checks `tokens` continuing the sequence `cache` holds, and that the cache fits the
    /// model's context.
    fn check_cached(&self, tokens: &[u32], cache: &KvCache) -> Result<()> {
        self.check_batch(&Batch::row(tokens))?;
        if cache.capacity() > self.shape.context {
            return Err(Error::config(
                "kv cache",
                format!(
                    "holds up to {} positions, more than the model's {} = {}",
                    cache.capacity(),
                    F::CONTEXT_FIELD,
                    self.shape.context
                ),
            ));
        }
        Ok(())
    }
}

impl<F: Family> Model for Decoder<F> {
    fn describe(&self) -> String {
        let s = &self.shape;
        let heads = if s.kv_heads == s.heads && s.head_dim * s.heads == s.hidden {
            format!("{} heads", s.heads)
        } else {
            format!(
                "{} heads ({} key/value) of {}",
                s.heads, s.kv_heads, s.head_dim
            )
        };
        format!(
            "{}: {} layers, {heads}, {} wide, MLP {}, vocab {}, context {}, {} head \
             ({:.2}M parameters)",
            F::MODEL_TYPE,
            s.layers,
            s.hidden,
            s.ffn,
            s.vocab,
            s.context,
            if s.tied_embeddings { "tied" } else { "untied" },
            self.num_params() as f64 / 1e6
        )
    }

    fn vocab_size(&self) -> usize {
        self.shape.vocab
    }

    fn max_seq_len(&self) -> usize {
        self.shape.context
    }

    fn init_params(&self) -> Vec<ParamInit> {
        let mut out: Vec<ParamInit> = self
            .params()
            .into_iter()
            .map(|(slot, name, shape)| {
                let trains = self.adapter.trains(&name);
                let projection = is_projection(slot);
                let dtype = self
                    .adapter
                    .base_dtype()
                    .filter(|_| projection && !trains)
                    .map(|d| match (d, slot) {
                        (DType::Nf4(_), Slot::Layer(_, s)) => DType::Nf4(self.nf4_parts(s, &name)),
                        _ => d,
                    });
                ParamInit {
                    dtype,
                    trains,
                    name,
                    shape,
                    init: init(&self.shape, slot),
                }
            })
            .collect();
        out.extend(adapters::update_params(&self.updates()));
        out
    }

    fn forward_backward(
        &self,
        pass: &mut Pass<'_>,
        batch: &Batch,
        grad_scale: f32,
        losses: &mut Tensor,
    ) -> Result<PassStats> {
        self.check_batch(batch)?;
        let vocab = self.shape.vocab;
        exec::forward_backward(&self.graph, pass, batch, vocab, grad_scale, losses)
    }

    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<f64> {
        self.check_batch(batch)?;
        exec::loss(&self.graph, pass, batch, self.shape.vocab)
    }

    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
        self.check_batch(batch)?;
        let logits = exec::logits(&self.graph, pass, batch)?;
        Ok(vocab::unpad_logits(&self.shape, logits))
    }

    fn logits_cached(
        &self,
        pass: &mut Pass<'_>,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        self.check_cached(tokens, cache)?;
        let logits = exec::logits_cached(&self.graph, pass, tokens, cache)?;
        Ok(vocab::unpad_logits(&self.shape, logits))
    }

    fn last_logits(
        &self,
        pass: &mut Pass<'_>,
        tokens: &[u32],
        cache: Option<&mut KvCache>,
    ) -> Result<Vec<f32>> {
        let logits = match cache {
            Some(cache) => {
                self.check_cached(tokens, cache)?;
                exec::last_logits_cached(&self.graph, pass, tokens, cache)?
            }
            None => {
                let batch = Batch::row(tokens);
                self.check_batch(&batch)?;
                exec::last_logits(&self.graph, pass, &batch)?
            }
        };
        Ok(vocab::unpad_logits(&self.shape, logits))
    }

    fn decodes_incrementally(&self) -> bool {
        true
    }

    fn write_config(&self, dir: &std::path::Path) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.config.hf_config())
            .map_err(|e| Error::Serde(e.to_string()))?;
        crate::save::atomic::write_atomically(
            &dir.join(crate::save::files::CONFIG_FILE),
            text.as_bytes(),
        )
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let s = &self.shape;
        6.0 * self.num_params() as f64 + 6.0 * (s.layers * s.heads().q_width() * seq_len) as f64
    }

    fn export_tensors<'t>(&self, tensors: Vec<StoredTensor<'t>>) -> Result<Vec<StoredTensor<'t>>> {
        self.config
            .export_tensors(vocab::unpad(&self.config, tensors)?)
    }

    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>> {
        import_tensors(&self.config, tensors)
    }

    fn weights_in_out(&self) -> bool {
        !self.config.out_in()
    }

    fn tied_head(&self) -> Option<(String, String)> {
        self.shape.tied_embeddings.then(|| {
            let head = crate::adapter::HEAD_WEIGHT.to_string();
            (head, self.config.param_name(Slot::Embed))
        })
    }

    fn magnitudes(&self) -> Vec<crate::model::Magnitude> {
        let names: Vec<String> = self.params().into_iter().map(|(_, n, _)| n).collect();
        let updates = self.updates();
        let refs = adapters::update_refs(&updates, names.len());
        let out_in = self.config.out_in();
        refs.into_iter()
            .zip(updates)
            .filter_map(|((l, slot, r), (p, _))| {
                let param = r.magnitude?;
                let weight_name = self.config.param_name(Slot::Layer(l, slot));
                let weight = names.iter().position(|n| *n == weight_name)?;
                Some(crate::model::Magnitude {
                    param,
                    weight,
                    a: r.a,
                    b: r.b,
                    scale: r.adapted.scale,
                    block: crate::ops::lora::dora::Block {
                        offset: r.adapted.offset,
                        width: r.adapted.width,
                        in_features: p.in_features,
                        transposed: out_in,
                    },
                })
            })
            .collect()
    }

    fn adapter(&self) -> Option<&dyn Adapter> {
        Some(self.adapter.as_ref())
    }

    fn with_adapter(&self, adapter: Arc<dyn Adapter>) -> Result<Box<dyn Model>> {
        Ok(Box::new(self.clone().with_adapter(adapter)?))
    }
}
