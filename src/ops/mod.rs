//! Op nodes: the layer ops models are built from, one type per op, each saying what it
//! reads, what it produces, what its backward needs, and how it runs forward and backward
//! through the [`Backend`].
//!
//! A model is a list of nodes over named values ([`crate::model::Graph`]); the one
//! executor ([`crate::model::exec`]) runs them, offers every value backward needs to the
//! checkpoint policy, and recomputes a dropped value by running the node that produced it
//! with [`ForwardCx::wanted`] set to that output. A new op is a new type implementing
//! [`Op`]; nothing else changes.

pub mod attention;
mod classifier;
pub mod cross_entropy;
pub mod embedding;
pub mod flash_attention;
pub mod gelu;
pub mod glu;
pub mod layernorm;
pub mod linear;
mod linear_cross_entropy;
pub mod lora;
pub mod nf4;
pub mod positions;
pub mod qk_norm;
pub mod rmsnorm;
pub mod rope;
pub mod update_rounding;

pub use attention::{CausalAttention, Heads};
pub use classifier::Classifier;
pub use embedding::{EmbeddingScale, LearnedEmbedding, TokenEmbedding};
pub use flash_attention::{AttentionPath, FlashAttention};
pub use glu::{Gate, Glu};
pub use layernorm::LayerNorm;
pub use linear::{GeluLinearResidual, Linear, LinearGelu, LinearResidual};
pub use linear_cross_entropy::{
    LinearCrossEntropy, LossPath, LOGITS_CHUNK_BYTES, LOGITS_CHUNK_MAX_BYTES, MAX_LOSS_CHUNKS,
};
pub use qk_norm::QkNorm;
pub use rmsnorm::{OffsetRmsNorm, RmsNorm};
pub use rope::Rope;

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};
use std::any::Any;
use std::fmt::Debug;

/// `op` as the concrete op type `T`, if it is one: how an [`crate::model::OpOverride`]
/// finds the settings of the op it replaces.
pub fn downcast<T: Op>(op: &dyn Op) -> Option<&T> {
    (op as &dyn Any).downcast_ref::<T>()
}

/// Which inputs and outputs of a node its backward reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saves {
    /// Bit `i` set: input `i` is read by backward.
    pub inputs: u32,
    /// Bit `i` set: output `i` is read by backward.
    pub outputs: u32,
}

impl Saves {
    /// Whether backward reads input `i`.
    pub fn input(&self, i: usize) -> bool {
        self.inputs >> i & 1 == 1
    }

    /// Whether backward reads output `i`.
    pub fn output(&self, i: usize) -> bool {
        self.outputs >> i & 1 == 1
    }
}

/// One op of a model's graph.
///
/// Inputs and outputs are activations (values of the graph, positional); parameters are
/// handles into the model's parameter list, in the order the op documents.
pub trait Op: Any + Debug + Send + Sync {
    /// The op's name in errors, e.g. `layernorm`.
    fn name(&self) -> &'static str;

    /// The shape and dtype of each output, from the inputs and weights, in the compute
    /// dtype `dtype`, for a batch of `[rows, tokens per row]`.
    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>>;

    /// The inputs and outputs its backward reads: the activations it saves.
    fn saves(&self) -> Saves;

    /// Which inputs a forward run needs given the outputs wanted and those already
    /// present (bit `i`: input `i`); all of them unless the op says otherwise.
    fn inputs_needed(&self, _wanted: &[bool], _present: &[bool]) -> u32 {
        u32::MAX
    }

    /// Computes at least the [`ForwardCx::wanted`] outputs into [`ForwardCx::outputs`].
    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()>;

    /// Accumulates the gradients of the inputs ([`BackwardCx::grads_in`]) and of the
    /// parameters from those of the outputs.
    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()>;

    /// The loss this node computes itself when it ends a graph's head (a classifier fused
    /// with the cross-entropy, [`LinearCrossEntropy`]); `None`, the default, for a node
    /// whose output is the logits the executor's cross-entropy reads.
    fn as_loss(&self) -> Option<&dyn FusedLoss> {
        None
    }

    /// The heads of causal attention when this op is one: its input 0 the fused `qkv`
    /// (laid out as [`crate::ops::Heads`] says), its last output the attended values
    /// (`[B, T, H·D]`). Incremental decoding then runs it against a key/value cache
    /// ([`crate::model::KvCache`]) instead of [`Op::forward`]. `None`, the default, for
    /// every other op, which decoding runs on the new tokens' rows alone.
    fn attention_heads(&self) -> Option<crate::ops::Heads> {
        None
    }
}

/// A node that computes the loss from its inputs and parameters, without handing logits
/// to the executor: the last node of a graph's head. The executor calls
/// [`FusedLoss::loss`] where the materialized path runs the cross-entropy; the node's
/// [`Op::backward`] then only passes on the input gradients `loss` wrote.
pub trait FusedLoss {
    /// Adds each position's loss to [`LossCx::losses`] and, with
    /// [`LossCx::grad_scale`], writes the gradients of the inputs
    /// ([`LossCx::grads_in`]) and accumulates those of the parameters.
    fn loss(&self, cx: &mut LossCx<'_>) -> Result<()>;

    /// The logits `[rows, vocab]` of every position of the inputs, for sampling and
    /// [`crate::Model::logits`].
    fn logits(
        &self,
        backend: &dyn Backend,
        inputs: &[&Tensor],
        weights: &[&Tensor],
    ) -> Result<Tensor>;
}

/// What a [`FusedLoss`] works with.
pub struct LossCx<'a> {
    /// The backend every op runs on.
    pub backend: &'a dyn Backend,
    /// The node's inputs.
    pub inputs: Vec<&'a Tensor>,
    /// The node's parameters: their weights and the gradients to accumulate (none for a
    /// frozen one).
    pub params: Vec<ParamGrad<'a>>,
    /// The target id of each position (row-major over the batch).
    pub targets: &'a [u32],
    /// Valid ids are below this; wider weights are padding.
    pub vocab: usize,
    /// The scale of the loss gradient; `None` computes the loss alone (evaluation).
    pub grad_scale: Option<f32>,
    /// Each position's loss is added here (f32, see [`cross_entropy::forward`]).
    pub losses: &'a mut Tensor,
    /// The gradient of each input, written when `grad_scale` is set.
    pub grads_in: Vec<GradIn>,
}

/// What a node's forward works with.
pub struct ForwardCx<'a> {
    /// The backend every op runs on.
    pub backend: &'a dyn Backend,
    /// The input activations (present for those [`Op::inputs_needed`] names).
    pub inputs: Vec<Option<&'a Tensor>>,
    /// The weights of the node's parameters.
    pub weights: Vec<&'a Tensor>,
    /// The batch's token ids (read by embeddings).
    pub tokens: &'a [u32],
    /// Each token's position in its document (`[B·T]`, see [`positions`]; `None`: one
    /// document per row), read by attention and position embeddings.
    pub positions: Option<&'a [u32]>,
    /// The key of this node's random draws (dropout) in this pass: the same in its
    /// forward, its recomputation and its backward, another for every node and
    /// micro-batch; `None` in a pass that draws nothing (evaluation), where an op that
    /// would draw is the identity.
    pub rng_key: Option<u64>,
    /// Outputs asked for.
    pub wanted: Vec<bool>,
    /// Outputs that already exist (during recomputation), which the op may read.
    pub present: Vec<Option<&'a Tensor>>,
    /// The outputs the op computed.
    pub outputs: Vec<Option<Tensor>>,
    /// Shape and dtype of each output.
    pub shapes: Vec<(Vec<usize>, DType)>,
    /// Ledger label of each output.
    pub labels: Vec<String>,
}

impl<'a> ForwardCx<'a> {
    /// Input `i`.
    pub fn input(&self, i: usize) -> Result<&'a Tensor> {
        self.inputs[i].ok_or_else(|| missing(&format!("input {i}")))
    }

    /// A buffer for output `i`, for an op to overwrite.
    pub fn alloc(&self, i: usize) -> Result<Tensor> {
        let (shape, dtype) = &self.shapes[i];
        self.backend
            .empty(shape, *dtype, MemoryCategory::Activations, &self.labels[i])
    }

    /// Output `i`: the one just computed, else the one already present.
    pub fn output(&self, i: usize) -> Result<&Tensor> {
        self.outputs[i]
            .as_ref()
            .or(self.present[i])
            .ok_or_else(|| missing(&self.labels[i]))
    }
}

/// A saved activation handed to a node's backward: owned when this node is its last
/// reader (the op may free it early), borrowed otherwise.
#[derive(Debug)]
pub enum Saved<'a> {
    /// Not saved for this node.
    None,
    /// This node is the last reader: freed when released or when backward ends.
    Owned(Tensor),
    /// Read by a node whose backward runs later.
    Borrowed(&'a Tensor),
}

impl Saved<'_> {
    /// The tensor.
    pub fn get(&self) -> Result<&Tensor> {
        match self {
            Saved::Owned(t) => Ok(t),
            Saved::Borrowed(t) => Ok(t),
            Saved::None => Err(missing("a saved activation")),
        }
    }

    /// Frees the tensor now if this node owns it.
    pub fn release(&mut self) {
        *self = Saved::None;
    }
}

/// The gradient of one input of a node: absent until a reader of the input writes it;
/// later readers (in backward order) accumulate into it.
#[derive(Debug)]
pub struct GradIn {
    /// The gradient so far.
    pub tensor: Option<Tensor>,
    /// Its shape and dtype (the input's).
    pub shape: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
    /// Its ledger label, e.g. `h.3.d_qkv`.
    pub label: String,
}

impl GradIn {
    /// The gradient buffer for an op that accumulates into it: zeros when new.
    pub fn accumulate(&mut self, backend: &dyn Backend) -> Result<&mut Tensor> {
        if self.tensor.is_none() {
            self.tensor = Some(backend.zeros(
                &self.shape,
                self.dtype,
                MemoryCategory::Activations,
                &self.label,
            )?);
        }
        Ok(self.tensor.as_mut().expect("allocated above"))
    }

    /// The gradient buffer and whether it is new: a new one is for the op to overwrite,
    /// an existing one to accumulate into (matrix products' `accumulate`).
    pub fn buffer(&mut self, backend: &dyn Backend) -> Result<(&mut Tensor, bool)> {
        let fresh = self.tensor.is_none();
        if fresh {
            self.tensor = Some(backend.empty(
                &self.shape,
                self.dtype,
                MemoryCategory::Activations,
                &self.label,
            )?);
        }
        Ok((self.tensor.as_mut().expect("allocated above"), fresh))
    }

    /// Runs `f` on a buffer to overwrite: the gradient itself when new, else a
    /// temporary that is then added to it.
    pub fn overwrite(
        &mut self,
        backend: &dyn Backend,
        f: impl FnOnce(&mut Tensor) -> Result<()>,
    ) -> Result<()> {
        let (buf, fresh) = self.buffer(backend)?;
        if fresh {
            return f(buf);
        }
        let mut tmp = backend.empty(
            &self.shape,
            self.dtype,
            MemoryCategory::Activations,
            &self.label,
        )?;
        f(&mut tmp)?;
        backend.axpy(self.tensor.as_mut().expect("present"), 1.0, &tmp)
    }

    /// Adds `g`: moved in when the gradient is new, added to it otherwise.
    pub fn add(&mut self, backend: &dyn Backend, g: Tensor) -> Result<()> {
        match self.tensor.as_mut() {
            None => {
                self.tensor = Some(g);
                Ok(())
            }
            Some(t) => backend.axpy(t, 1.0, &g),
        }
    }
}

/// One parameter of a node as its backward sees it: the weights, and the gradient to
/// accumulate into when the parameter trains. Ops never see the optimizer's side of a
/// parameter (master weights, state); which parameters train is the trainer's decision,
/// made before backward runs.
#[derive(Debug)]
pub struct ParamGrad<'a> {
    name: &'a str,
    weight: &'a Tensor,
    /// The parameter's gradient slot, when it trains.
    grad: Option<&'a mut Option<Tensor>>,
    /// The dtype gradients are kept in.
    grad_dtype: DType,
    /// A frozen parameter's gradient where an op could not skip it: freed with the view.
    scratch: Option<Tensor>,
}

impl<'a> ParamGrad<'a> {
    /// The view of parameter `name` with `weight`, whose gradient (kept in `grad_dtype`)
    /// accumulates in `grad` when it trains (`None`: frozen).
    pub fn new(
        name: &'a str,
        weight: &'a Tensor,
        grad: Option<&'a mut Option<Tensor>>,
        grad_dtype: DType,
    ) -> Self {
        ParamGrad {
            name,
            weight,
            grad,
            grad_dtype,
            scratch: None,
        }
    }

    /// The parameter's name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// The weights (compute dtype).
    pub fn weight(&self) -> &'a Tensor {
        self.weight
    }

    /// Whether the parameter's gradient is wanted (it trains): an op skips the work that
    /// only serves a gradient that is not.
    pub fn wants_grad(&self) -> bool {
        self.grad.is_some()
    }

    /// The gradient to accumulate into (add to it, never overwrite: several nodes and
    /// micro-batches add up in it), allocated zeroed on first use. An op that cannot skip
    /// a frozen parameter's gradient (a norm's gain, computed with its input's) gets a
    /// buffer that is freed when its backward is done.
    pub fn grad_mut(&mut self, backend: &dyn Backend) -> Result<&mut Tensor> {
        let slot = match self.grad.as_deref_mut() {
            Some(slot) => slot,
            None => &mut self.scratch,
        };
        if slot.is_none() {
            *slot = Some(backend.zeros(
                self.weight.shape(),
                self.grad_dtype,
                MemoryCategory::Gradients,
                self.name,
            )?);
        }
        Ok(slot.as_mut().expect("allocated above"))
    }

    /// The weights and the gradient ([`ParamGrad::grad_mut`]), for an op that reads one
    /// and accumulates into the other.
    pub fn weight_and_grad(&mut self, backend: &dyn Backend) -> Result<(&'a Tensor, &mut Tensor)> {
        let weight = self.weight;
        Ok((weight, self.grad_mut(backend)?))
    }
}

/// What a node's backward works with.
pub struct BackwardCx<'a> {
    /// The backend every op runs on.
    pub backend: &'a dyn Backend,
    /// The saved inputs ([`Saves::inputs`]).
    pub inputs: Vec<Saved<'a>>,
    /// The saved outputs ([`Saves::outputs`]).
    pub outputs: Vec<Saved<'a>>,
    /// The node's parameters: their weights and the gradients to accumulate (none for a
    /// frozen one).
    pub params: Vec<ParamGrad<'a>>,
    /// The batch's token ids (read by embeddings).
    pub tokens: &'a [u32],
    /// Each token's position in its document, as [`ForwardCx::positions`].
    pub positions: Option<&'a [u32]>,
    /// The key of this node's random draws, as [`ForwardCx::rng_key`].
    pub rng_key: Option<u64>,
    /// The gradient of each output (`None`: nothing flows back through it).
    pub grads_out: Vec<Option<Tensor>>,
    /// The ledger label of each output's gradient, e.g. `h.3.d_fc_out`, for a buffer
    /// the op allocates in its place.
    pub grad_labels_out: Vec<String>,
    /// The gradient of each input, for the op to write or accumulate.
    pub grads_in: Vec<GradIn>,
}

impl BackwardCx<'_> {
    /// The gradient of output `i`, taken (the op frees it when done).
    pub fn take_grad_out(&mut self, i: usize) -> Result<Tensor> {
        self.grads_out[i]
            .take()
            .ok_or_else(|| missing(&format!("the gradient of output {i}")))
    }
}

/// The error of a value, input or gradient the graph should hold but does not: a graph
/// whose nodes disagree about what they read and write.
pub(crate) fn missing(what: &str) -> Error {
    Error::Backend {
        backend: "executor",
        message: format!("{what} is missing"),
    }
}
