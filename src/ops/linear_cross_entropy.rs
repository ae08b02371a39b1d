//! The classifier fused with the cross-entropy: the loss and its gradients in chunks of
//! positions, never a `[tokens, vocab]` tensor.

use super::{cross_entropy, BackwardCx, ForwardCx, FusedLoss, LossCx, Op, Saves};
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// The bytes a chunk's logits aim at when the chunk is chosen automatically: the rows of
/// a chunk are at least `LOGITS_CHUNK_BYTES / (vocab · element size)`, rounded down to a
/// multiple of 256 (the CPU's product tiles), and at least 256; more (up to
/// [`LOGITS_CHUNK_MAX_BYTES`]) where that would take more than [`MAX_LOSS_CHUNKS`] chunks.
pub const LOGITS_CHUNK_BYTES: usize = 32 << 20;

/// The most bytes an automatic chunk's logits grow to so as to keep to
/// [`MAX_LOSS_CHUNKS`] chunks: 1024 positions of Llama 3's 128256 ids in bf16 (8 chunks
/// of a batch of 8 × 1024, each reading and writing the 1 GiB f32 gradient of the head,
/// where 16 of 512 took twice that traffic).
pub const LOGITS_CHUNK_MAX_BYTES: usize = 256 << 20;

/// The chunks an automatic chunk size aims at, at most. Each chunk's weight-gradient
/// product reads and writes the whole classifier gradient (`dW += dlogitsᵀ · x`, f32
/// beside a mixed-precision model), so the chunk count sets that traffic: GPT-2 124M's
/// head (50257 × 768) at 8 × 1024 positions in bf16 takes 8 chunks of 1024 (2.5 GB of
/// gradient traffic a step, 103 MB of logits) where chunks of 32 MiB took 32 of 256
/// (9.9 GB), while a batch of 1 × 1024 keeps 4 chunks of 256 (26 MB of logits).
pub const MAX_LOSS_CHUNKS: usize = 8;

/// Automatic chunks are a multiple of this many rows (the CPU's product tiles).
const CHUNK_ALIGN: usize = 256;

/// Automatic chunks have at least this many rows: each chunk's three products read the
/// whole classifier weight (and its gradient) once for `2·k` flops per element, and the
/// CPU's products repack the weight at each call, so smaller chunks cost time (measured on
/// a 50257-id head in f32: 128 rows +10% CPU time per step, 256 +1%, 512 none). 256
/// keeps the loss phase of GPT-2 124M (bf16, full recompute, T = 1024) under the layers'
/// own activation peak, for about 1% of CPU time.
const MIN_CHUNK: usize = 256;

/// How a model's head computes the loss: the classifier's product fused with the
/// cross-entropy in chunks ([`LinearCrossEntropy`], the default), or the `[tokens, vocab]`
/// logits materialized and the cross-entropy run over them ([`super::Classifier`], the
/// reference).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossPath {
    /// The fused linear cross-entropy, in chunks of positions.
    #[default]
    Fused,
    /// The logits of every position, then the cross-entropy over them.
    Materialized,
}

impl LossPath {
    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            LossPath::Fused => "fused",
            LossPath::Materialized => "materialized",
        }
    }

    /// The path named `name` (`fused` or `materialized`); an error naming `field` and the
    /// allowed values otherwise.
    pub fn parse(field: &str, name: &str) -> Result<Self> {
        match name {
            "fused" => Ok(LossPath::Fused),
            "materialized" => Ok(LossPath::Materialized),
            other => Err(Error::config(
                field,
                format!("`{other}` is not a loss path; use `fused` or `materialized`"),
            )),
        }
    }
}

impl std::fmt::Display for LossPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The classifier `logits = x · Wᵀ` (`W` `[V, C]`: the token embedding when tied, or its
/// own head) fused with the softmax cross-entropy, computed a chunk of positions at a
/// time: per chunk the logits `[chunk, V]` in the compute dtype, each row's loss (its
/// log-sum-exp in f32), the logits' gradient written over them, then the chunk's rows of
/// `dx = dlogits · W` and `dW += dlogitsᵀ · x`, accumulated in the gradient's dtype (f32
/// products). Only one chunk's logits exist at a time.
///
/// Input: `x` `[rows, C]`. Parameter: `W`. No output: the node ends the head, and the
/// executor calls its [`FusedLoss::loss`] with the targets where the materialized path
/// runs the cross-entropy. The gradients are computed there, with the loss (as
/// Liger-Kernel does), not recomputed in backward (as Cut Cross-Entropy does): the loss
/// is the last op of forward and the head's backward follows at once, so computing them
/// together costs no extra product and `dx` is the gradient backward needs next anyway.
/// Backward reads nothing and only passes `dx` on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinearCrossEntropy {
    /// Positions per chunk; `None` chooses from the vocabulary (see
    /// [`LinearCrossEntropy::chunk_rows`]).
    pub chunk: Option<usize>,
}

impl LinearCrossEntropy {
    /// The fused loss with chunks of `chunk` positions (`None`: chosen from the
    /// vocabulary). A chunk of 0 positions is an error naming `field`.
    pub fn new(field: &str, chunk: Option<usize>) -> Result<Self> {
        if chunk == Some(0) {
            return Err(Error::config(
                field,
                "a chunk of 0 positions is empty; use at least 1, or leave it unset to \
                 choose from the vocabulary",
            ));
        }
        Ok(LinearCrossEntropy { chunk })
    }

    /// Positions per chunk for `rows` positions over a vocabulary of `vocab` (the
    /// weight's rows) in `dtype`: the configured chunk, else the rows whose logits take
    /// about [`LOGITS_CHUNK_BYTES`] (a multiple of 256, at least 256), or, where that
    /// makes more than [`MAX_LOSS_CHUNKS`] chunks, an eighth of the positions (rounded up
    /// to a multiple of 256) up to the rows of [`LOGITS_CHUNK_MAX_BYTES`]; then the
    /// positions split evenly over that many chunks (rounded up to a multiple of 256, no
    /// larger). Never more than `rows`.
    pub fn chunk_rows(&self, rows: usize, vocab: usize, dtype: DType) -> usize {
        let chunk = self.chunk.unwrap_or_else(|| {
            let row_bytes = vocab.max(1).saturating_mul(dtype.size());
            let fit = |bytes: usize| (bytes / row_bytes / CHUNK_ALIGN * CHUNK_ALIGN).max(MIN_CHUNK);
            let (small, large) = (fit(LOGITS_CHUNK_BYTES), fit(LOGITS_CHUNK_MAX_BYTES));
            let chunk = if rows.div_ceil(small) <= MAX_LOSS_CHUNKS {
                small
            } else {
                rows.div_ceil(MAX_LOSS_CHUNKS)
                    .next_multiple_of(CHUNK_ALIGN)
                    .min(large)
            };
            let chunks = rows.div_ceil(chunk).max(1);
            rows.div_ceil(chunks)
                .next_multiple_of(CHUNK_ALIGN)
                .min(chunk)
        });
        chunk.clamp(1, rows.max(1))
    }
}

impl Op for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "linear_cross_entropy"
    }

    fn output_shapes(
        &self,
        _inputs: &[&Tensor],
        _weights: &[&Tensor],
        _dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        Ok(Vec::new())
    }

    fn saves(&self) -> Saves {
        Saves::default()
    }

    fn forward(&self, _cx: &mut ForwardCx<'_>) -> Result<()> {
        Ok(())
    }

    fn backward(&self, _cx: &mut BackwardCx<'_>) -> Result<()> {
        // The input's gradient was written by `loss`, and the weight's accumulated there.
        Ok(())
    }

    fn as_loss(&self) -> Option<&dyn FusedLoss> {
        Some(self)
    }
}

impl FusedLoss for LinearCrossEntropy {
    fn loss(&self, cx: &mut LossCx<'_>) -> Result<()> {
        let x = *cx
            .inputs
            .first()
            .ok_or_else(|| super::missing("the fused loss's input"))?;
        let rows = x.rows_cols().0;
        let vocab_rows = cx
            .params
            .first()
            .ok_or_else(|| super::missing("the classifier's weight"))?
            .weight()
            .rows_cols()
            .0;
        if cx.targets.len() != rows {
            return Err(Error::shape(
                "linear_cross_entropy",
                format!("{} targets for {rows} positions", cx.targets.len()),
            ));
        }
        let chunk = self.chunk_rows(rows, vocab_rows, x.dtype());
        // Whether the input's gradient exists already (then it is added to).
        let mut existed = cx.grads_in.first().is_some_and(|g| g.tensor.is_some());
        // Positions left out of the loss (a loss mask) cost no work: the chunks cover the
        // runs of counted positions only, and the input's gradient starts at zero so that
        // the rows of the others stay zero.
        let runs = counted_runs(cx.targets);
        if runs != [(0, rows)] {
            if cx.grad_scale.is_some() && !existed {
                cx.grads_in
                    .first_mut()
                    .ok_or_else(|| super::missing("the fused loss's input gradient"))?
                    .accumulate(cx.backend)?;
                existed = true;
            }
            if runs.is_empty() && cx.grad_scale.is_some() && cx.params[0].wants_grad() {
                // Nothing counts: the weight's gradient still exists, untouched.
                cx.params[0].grad_mut(cx.backend)?;
            }
        }
        // The per-position losses, read as a column so that a chunk's can be added to its
        // rows; the shape is restored at the end, also on error.
        let losses_shape = cx.losses.shape().to_vec();
        let total = cx.losses.numel();
        cx.losses.reshape(&[total, 1])?;
        let result = runs.iter().try_for_each(|&(from, to)| {
            (from..to)
                .step_by(chunk)
                .try_for_each(|start| self.chunk(cx, x, start, chunk.min(to - start), existed))
        });
        cx.losses.reshape(&losses_shape)?;
        result
    }

    fn logits(
        &self,
        backend: &dyn Backend,
        inputs: &[&Tensor],
        weights: &[&Tensor],
    ) -> Result<Tensor> {
        let (Some(&x), Some(&w)) = (inputs.first(), weights.first()) else {
            return Err(super::missing("the classifier's input or weight"));
        };
        let mut logits = backend.empty(
            &[x.rows_cols().0, w.rows_cols().0],
            x.dtype(),
            MemoryCategory::Activations,
            "logits",
        )?;
        backend.matmul(&mut logits, x, w, None, false, true, false)?;
        Ok(logits)
    }
}

/// The maximal runs `(from, to)` of positions whose target counts (is not
/// [`cross_entropy::IGNORE`]), in order: `[(0, n)]` when every one does.
fn counted_runs(targets: &[u32]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, &t) in targets.iter().enumerate() {
        match (t != cross_entropy::IGNORE, start) {
            (true, None) => start = Some(i),
            (false, Some(from)) => {
                runs.push((from, i));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(from) = start {
        runs.push((from, targets.len()));
    }
    runs
}

impl LinearCrossEntropy {
    /// The loss (and gradients) of positions `start..start + n` of `x`.
    fn chunk(
        &self,
        cx: &mut LossCx<'_>,
        x: &Tensor,
        start: usize,
        n: usize,
        existed: bool,
    ) -> Result<()> {
        let be = cx.backend;
        let (rows, width) = x.rows_cols();
        let whole = n == rows;
        let act = MemoryCategory::Activations;
        let x_chunk = if whole {
            None
        } else {
            let label = format!("{}.chunk", x.label());
            let mut t = be.empty(&[n, width], x.dtype(), act, &label)?;
            be.copy_rows(&mut t, 0, x, start, n, false)?;
            Some(t)
        };
        let xc = x_chunk.as_ref().unwrap_or(x);
        let w = cx.params[0].weight();
        let mut logits = be.empty(&[n, w.rows_cols().0], x.dtype(), act, "logits")?;
        be.matmul(&mut logits, xc, w, None, false, true, false)?;
        let (targets, vocab, scale) = (cx.targets, cx.vocab, cx.grad_scale);
        if whole {
            cross_entropy::forward(be, &mut logits, targets, vocab, scale, cx.losses)?;
        } else {
            let mut part = be.zeros(&[n, 1], DType::F32, act, "losses.chunk")?;
            cross_entropy::forward_rows(be, &mut logits, targets, start, vocab, scale, &mut part)?;
            be.copy_rows(cx.losses, start, &part, 0, n, true)?;
        }
        if cx.grad_scale.is_none() {
            return Ok(());
        }
        let dlogits = logits;
        let dx = cx
            .grads_in
            .first_mut()
            .ok_or_else(|| super::missing("the fused loss's input gradient"))?;
        let (buf, _) = dx.buffer(be)?;
        if whole {
            be.matmul(buf, &dlogits, w, None, false, false, existed)?;
        } else {
            let label = format!("{}.chunk", buf.label());
            let mut part = be.empty(&[n, width], buf.dtype(), act, &label)?;
            be.matmul(&mut part, &dlogits, w, None, false, false, false)?;
            // A new gradient is written chunk by chunk; an existing one is added to.
            be.copy_rows(buf, start, &part, 0, n, existed)?;
        }
        if !cx.params[0].wants_grad() {
            return Ok(());
        }
        be.matmul(
            cx.params[0].grad_mut(be)?,
            &dlogits,
            xc,
            None,
            true,
            false,
            true,
        )?;
        Ok(())
    }
}
