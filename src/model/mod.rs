//! Models: the `Model` trait, the shared decoder and its families (GPT-2, Llama, Qwen2,
//! Qwen3), their
//! parameters and graphs.

mod decoder;
mod directory;
pub mod exec;
pub mod families;
mod family;
mod gpt2;
mod graph;
mod kv_cache;
mod llama;
mod llama_config;
mod model_config;
mod qwen2;
mod qwen3;
mod shape;
mod shape_flags;
mod staging;

pub use crate::param::{Init, Param, ParamInit};
pub use decoder::Decoder;
pub use directory::{read_model_config, read_model_dir, ModelDir};
pub use exec::StashStats;
pub use families::{parse_hf_config, read_hf_config};
pub use family::{llama_name, AnyFamily, Family, FamilyConfig, LayerSlot, Slot};
pub use gpt2::{Gpt2, Gpt2Config};
pub use graph::{Graph, Node, OpOverride, Section, Value};
pub use kv_cache::KvCache;
pub use llama::Llama;
pub use llama_config::{LlamaConfig, Rope, RopeScaling};
pub use model_config::ModelConfig;
pub use qwen2::{Qwen2, Qwen2Config};
pub use qwen3::{Qwen3, Qwen3Config};
pub use shape::{Biases, Mlp, Norm, Positions, Shape, VOCAB_MULTIPLE};
pub(crate) use shape_flags::set;
pub use shape_flags::ShapeFlags;

use crate::adapter::Adapter;
use crate::checkpoint::CheckpointPolicy;
use crate::device::Backend;
use crate::error::Result;
use crate::ops::{AttentionPath, LossPath};
use crate::save::StoredTensor;
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;

/// What a model's forward and backward pass works with.
pub struct Pass<'a> {
    /// The backend every op runs on.
    pub backend: &'a dyn Backend,
    /// The parameters, in the order [`Model::init_params`] gave them.
    pub params: &'a mut [Param],
    /// Decides which activations are kept for backward.
    pub checkpoint: &'a dyn CheckpointPolicy,
    /// Dtype of activations (the precision's compute dtype).
    pub dtype: DType,
    /// Offload to host memory every activation the policy keeps, fetching it back for
    /// backward ([`crate::Retention::Offload`]).
    pub offload: bool,
    /// Called during backward as soon as a parameter's gradient is complete (no node left
    /// in backward reads it), with the parameters, that one's index and the step's
    /// per-position losses: the optimizer step inside backward. `None` leaves gradients
    /// to the end of the pass.
    pub grad_ready: Option<&'a mut GradReady<'a>>,
    /// The key of the pass's random draws (LoRA dropout): each node draws from it mixed
    /// with the node's name ([`crate::ops::ForwardCx::rng_key`]). `None` for a pass that
    /// draws nothing: evaluation, sampling.
    pub rng_key: Option<u64>,
    /// Sections whose streamed weights ([`Param::streamed`]) are copied to the device
    /// ahead of the one running ([`crate::WeightPlacement::ahead`]); no effect when no
    /// weight streams.
    pub stream_ahead: usize,
}

/// The hook of [`Pass::grad_ready`]: the parameters, the index of one whose gradient is
/// complete, and the step's per-position losses (complete since the loss ran before
/// backward). Every parameter is passed so that the hook can also finish work it started
/// on one whose gradient was complete before (an offloaded update in flight).
pub type GradReady<'h> = dyn FnMut(&mut [Param], usize, &Tensor) -> Result<()> + 'h;

/// One micro-batch of token ids: `inputs[b, t]` predicts `targets[b, t]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Rows.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Input ids, `batch_size · seq_len`, row-major.
    pub inputs: Vec<u32>,
    /// Target ids (inputs shifted by one), same layout.
    pub targets: Vec<u32>,
    /// Each token's position in its document, same layout, where rows hold several
    /// documents (packed examples, a stream cut at its separators): attention stays within
    /// a document and positions restart at 0 at each one (see [`crate::ops::positions`]).
    /// `None`: one document per row, positions `0..T`.
    pub positions: Option<Vec<u32>>,
}

impl Batch {
    /// One row of `tokens` for a forward-only pass (their targets are the tokens
    /// themselves, unread; positions counted from 0).
    pub fn row(tokens: &[u32]) -> Batch {
        Batch {
            batch_size: 1,
            seq_len: tokens.len(),
            inputs: tokens.to_vec(),
            targets: tokens.to_vec(),
            positions: None,
        }
    }

    /// Tokens in the batch (predicted positions).
    pub fn tokens(&self) -> usize {
        self.batch_size * self.seq_len
    }

    /// Positions whose target is trained: those not left out by
    /// [`crate::ops::cross_entropy::IGNORE`] (a loss mask, a document's separator).
    pub fn counted(&self) -> usize {
        self.targets
            .iter()
            .filter(|&&t| t != crate::ops::cross_entropy::IGNORE)
            .count()
    }

    /// Fails unless the batch is non-empty, its rows fit a model whose context is
    /// `context` (named `context_name` in the error, e.g. `n_positions`) and it holds as
    /// many inputs and targets as its shape says.
    pub fn check(&self, context: usize, context_name: &str) -> Result<()> {
        let (b, t) = (self.batch_size, self.seq_len);
        if b == 0 || t == 0 {
            return Err(crate::Error::config(
                "batch_size",
                format!("a batch of {b} rows of {t} tokens is empty; both must be at least 1"),
            ));
        }
        if t > context {
            return Err(crate::Error::config(
                "seq_len",
                format!(
                    "{t} exceeds the model's {context_name} = {context}; use at most {context}"
                ),
            ));
        }
        if self.inputs.len() != b * t || self.targets.len() != b * t {
            return Err(crate::Error::shape(
                "batch",
                format!(
                    "{} inputs and {} targets for {b} rows of {t}",
                    self.inputs.len(),
                    self.targets.len()
                ),
            ));
        }
        crate::ops::positions::check("batch", self.positions.as_deref(), b, t)
    }
}

/// What one forward-and-backward pass reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassStats {
    /// Activation bytes kept and dropped by the checkpoint policy in forward.
    pub stash: StashStats,
    /// Bytes of streamed weights copied from host memory to the device
    /// ([`crate::placement::Placement::Streamed`]).
    pub streamed_bytes: u64,
}

/// A language model trainable by [`crate::Trainer`]: it creates its parameters and runs
/// forward, loss and backward on a batch, accumulating parameter gradients.
pub trait Model: Debug + Send + Sync {
    /// A short description, e.g. `gpt2 (4 layers, 4 heads, 256 wide)`.
    fn describe(&self) -> String;

    /// Vocabulary size (valid token ids are below it).
    fn vocab_size(&self) -> usize;

    /// Longest sequence the model accepts.
    fn max_seq_len(&self) -> usize;

    /// The parameters in model order: names, shapes and how they are initialised.
    fn init_params(&self) -> Vec<ParamInit>;

    /// Forward, loss and backward on `batch`. Gradients are accumulated into the
    /// parameters, with the loss gradient scaled by `grad_scale` (so the sum of the
    /// per-position losses times `grad_scale` is what is differentiated). The loss of
    /// position `i` (row-major over the batch) is added to `losses[i]`, an f32 tensor on
    /// the backend that the trainer reads once per step (see
    /// [`crate::ops::cross_entropy::forward`]).
    fn forward_backward(
        &self,
        pass: &mut Pass<'_>,
        batch: &Batch,
        grad_scale: f32,
        losses: &mut Tensor,
    ) -> Result<PassStats>;

    /// Forward and loss only; returns the sum of per-position losses.
    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<f64>;

    /// Forward only: the logits `[batch_size · seq_len, vocab]` (row-major f32) for every
    /// position of `batch`'s inputs (its targets are not read).
    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>>;

    /// Incremental decoding: the logits `[tokens.len(), vocab]` of `tokens` continuing
    /// the sequence `cache` holds (their positions follow it), as [`Model::logits`] gives
    /// them for those rows of the whole sequence, computing only the new rows and
    /// appending their keys and values to `cache`. The default says the model does not
    /// decode so; [`crate::Trainer::generate`] then reruns the whole context per token.
    fn logits_cached(
        &self,
        pass: &mut Pass<'_>,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        let _ = (pass, tokens, cache);
        Err(crate::Error::config(
            "model",
            format!("{} does not decode with a key/value cache", self.describe()),
        ))
    }

    /// The logits `[vocab]` of the last of `tokens`: what sampling the next token reads.
    /// Without `cache`, `tokens` are the whole context ([`Model::logits`] of one row);
    /// with it, they continue the sequence it holds ([`Model::logits_cached`]). The same
    /// values as those calls give for that row. The default computes every row's logits
    /// and keeps the last; the built-in decoder runs its head on the last row alone.
    fn last_logits(
        &self,
        pass: &mut Pass<'_>,
        tokens: &[u32],
        cache: Option<&mut KvCache>,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(crate::Error::config(
                "tokens",
                "are empty; give at least one token of context",
            ));
        }
        let all = match cache {
            Some(cache) => self.logits_cached(pass, tokens, cache)?,
            None => self.logits(pass, &Batch::row(tokens))?,
        };
        let vocab = all.len() / tokens.len();
        Ok(all[all.len() - vocab..].to_vec())
    }

    /// Whether [`Model::logits_cached`] is implemented.
    fn decodes_incrementally(&self) -> bool {
        false
    }

    /// Writes the model's config into `dir` (for GPT-2, Hugging Face's `config.json`).
    fn write_config(&self, dir: &std::path::Path) -> Result<()>;

    /// Training FLOPs per token (forward and backward, no recomputation), as llm.c counts
    /// them: `6·N + 6·L·C·T` for sequence length `seq_len`.
    fn flops_per_token(&self, seq_len: usize) -> f64;

    /// The parameters (by [`Model::init_params`] name) as the model's file format names and
    /// shapes them: what `model.safetensors` holds. The identity unless the model fuses
    /// parameters the format keeps apart ([`Llama`]'s projections). The tensors are read
    /// only when the file is written (a save reads each parameter from the device then),
    /// so a mapping by rows ([`StoredTensor::rows`], [`StoredTensor::stack`]) keeps the
    /// save to one tensor's values at a time; [`StoredTensor::values`] reads one now.
    fn export_tensors<'t>(&self, tensors: Vec<StoredTensor<'t>>) -> Result<Vec<StoredTensor<'t>>> {
        Ok(tensors)
    }

    /// The inverse of [`Model::export_tensors`]: a file's tensors by the model's parameter
    /// names. Errors name a tensor that is missing or misshapen.
    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>> {
        Ok(tensors)
    }

    /// Whether projection weights are stored `[in, out]` (GPT-2's `Conv1D`; PEFT's
    /// `fan_in_fan_out`) rather than `[out, in]` (`nn.Linear`).
    fn weights_in_out(&self) -> bool {
        false
    }

    /// The adapter the model trains through ([`Adapter`]: which parameters train, and
    /// the low-rank updates it adds); `None` for a model that trains every parameter and
    /// takes no adapter.
    fn adapter(&self) -> Option<&dyn Adapter> {
        None
    }

    /// The same model trained through `adapter`. The default refuses: a model of your own
    /// that takes adapters says how.
    fn with_adapter(&self, adapter: Arc<dyn Adapter>) -> Result<Box<dyn Model>> {
        let _ = adapter;
        Err(crate::Error::config(
            "adapter",
            format!("{} takes no adapter", self.describe()),
        ))
    }

    /// When the model ties its output head to the token embedding: the name the Hugging
    /// Face format gives the head (`lm_head.weight`) and the embedding's parameter name. A
    /// PEFT adapter that trains the embedding whole (`modules_to_save`, with
    /// `ensure_weight_tying`) holds it again under the head's name. `None` for an untied
    /// head (the default).
    fn tied_head(&self) -> Option<(String, String)> {
        None
    }

    /// The DoRA magnitudes among the parameters, each with what its starting value is
    /// computed from (the norms of its block of `W + s·B·A`, set by the trainer once the
    /// base weights are). The default has none.
    fn magnitudes(&self) -> Vec<Magnitude> {
        Vec::new()
    }
}

/// A DoRA magnitude parameter and where its starting value comes from (parameter
/// indices in [`Model::init_params`] order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Magnitude {
    /// The magnitude `m` (`[width]`).
    pub param: usize,
    /// The projection's base weight `W`.
    pub weight: usize,
    /// The update's `A`.
    pub a: usize,
    /// The update's `B`.
    pub b: usize,
    /// The update's scale `s`.
    pub scale: f32,
    /// Where the update lies in `W`.
    pub block: crate::ops::lora::dora::Block,
}

/// A boxed model is a model: a trainer can be built from [`ModelConfig::build`]'s result.
impl Model for Box<dyn Model> {
    fn describe(&self) -> String {
        (**self).describe()
    }

    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }

    fn max_seq_len(&self) -> usize {
        (**self).max_seq_len()
    }

    fn init_params(&self) -> Vec<ParamInit> {
        (**self).init_params()
    }

    fn forward_backward(
        &self,
        pass: &mut Pass<'_>,
        batch: &Batch,
        grad_scale: f32,
        losses: &mut Tensor,
    ) -> Result<PassStats> {
        (**self).forward_backward(pass, batch, grad_scale, losses)
    }

    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<f64> {
        (**self).loss(pass, batch)
    }

    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
        (**self).logits(pass, batch)
    }

    fn logits_cached(
        &self,
        pass: &mut Pass<'_>,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        (**self).logits_cached(pass, tokens, cache)
    }

    fn last_logits(
        &self,
        pass: &mut Pass<'_>,
        tokens: &[u32],
        cache: Option<&mut KvCache>,
    ) -> Result<Vec<f32>> {
        (**self).last_logits(pass, tokens, cache)
    }

    fn decodes_incrementally(&self) -> bool {
        (**self).decodes_incrementally()
    }

    fn write_config(&self, dir: &std::path::Path) -> Result<()> {
        (**self).write_config(dir)
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        (**self).flops_per_token(seq_len)
    }

    fn export_tensors<'t>(&self, tensors: Vec<StoredTensor<'t>>) -> Result<Vec<StoredTensor<'t>>> {
        (**self).export_tensors(tensors)
    }

    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>> {
        (**self).import_tensors(tensors)
    }

    fn weights_in_out(&self) -> bool {
        (**self).weights_in_out()
    }

    fn adapter(&self) -> Option<&dyn Adapter> {
        (**self).adapter()
    }

    fn with_adapter(&self, adapter: Arc<dyn Adapter>) -> Result<Box<dyn Model>> {
        (**self).with_adapter(adapter)
    }

    fn magnitudes(&self) -> Vec<Magnitude> {
        (**self).magnitudes()
    }

    fn tied_head(&self) -> Option<(String, String)> {
        (**self).tied_head()
    }
}

/// The model `shape` describes, with freshly declared parameters: the first registered
/// family ([`families::FAMILIES`]) whose shape it is — a [`Gpt2`] for a GPT-2 shape
/// (multi-head attention, a 4h GELU MLP, LayerNorms with biases, tied embeddings and
/// learned positions), a [`Llama`] for a Llama shape (RMSNorm, SwiGLU, no biases, rotary
/// positions), ... Other shapes are refused with an error naming what each family lacks.
pub fn build(shape: &Shape) -> Result<Box<dyn Model>> {
    build_with(shape, AttentionPath::Fused, LossPath::Fused, None)
}

/// [`build`], with the attention computed by `attention` and the loss by `loss`, the
/// fused loss in chunks of `loss_chunk` positions (`None`: chosen from the vocabulary).
pub fn build_with(
    shape: &Shape,
    attention: AttentionPath,
    loss: LossPath,
    loss_chunk: Option<usize>,
) -> Result<Box<dyn Model>> {
    families::from_shape(shape)?.build_with(attention, loss, loss_chunk)
}
