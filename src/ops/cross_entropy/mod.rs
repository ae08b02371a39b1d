//! Softmax cross-entropy over the vocabulary, fused with its gradient: each row's loss is
//! added to a device tensor of losses, and the logits can be overwritten by their gradient
//! in the same pass.
//!
//! The family: the kernel call ([`forward`]) with its operand checks and FLOP count, the
//! CPU twin (`cpu.rs`) and the CUDA launch (`cuda.rs`, over `kernels/cross_entropy.cu`).
//! The graph nodes that end in it are [`super::Classifier`] (through the executor) and
//! [`super::LinearCrossEntropy`].

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::device::cpu::{each, ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Floating-point operations per logit of the loss alone, and of the loss with the
/// gradient.
const FLOPS: u64 = 4;
const FLOPS_GRAD: u64 = 5;

/// The target of a position left out of the loss (PyTorch's `ignore_index`): its row adds
/// nothing to its loss and, with a gradient, gets a zero gradient row.
pub const IGNORE: u32 = u32::MAX;

/// Cross-entropy of each row of `logits` (`[rows, Vp]`, columns from `vocab` on are
/// padding and ignored) against `targets`, in f32; a row whose target is [`IGNORE`] adds
/// 0 and its gradient is 0. Each row's loss is added to
/// `losses[row]` (f32, at least `rows` elements), which stays on the device: a
/// training step reads its losses once, at its end. With `grad_scale`, `logits` is
/// overwritten by its gradient `grad_scale · (softmax - onehot)` (0 on padding
/// columns).
pub fn forward(
    be: &dyn Backend,
    logits: &mut Tensor,
    targets: &[u32],
    vocab: usize,
    grad_scale: Option<f32>,
    losses: &mut Tensor,
) -> Result<()> {
    forward_rows(be, logits, targets, 0, vocab, grad_scale, losses)
}

/// [`forward`] for rows `start..start + rows` of a longer list of targets, `all`, whose
/// row `start` is the logits' first: the chunks of one chunked loss share one list, which
/// the CUDA backend then uploads once rather than once per chunk.
pub fn forward_rows(
    be: &dyn Backend,
    logits: &mut Tensor,
    all: &[u32],
    start: usize,
    vocab: usize,
    grad_scale: Option<f32>,
    losses: &mut Tensor,
) -> Result<()> {
    let rows = logits.rows_cols().0;
    let end = start.checked_add(rows).filter(|&e| e <= all.len());
    let Some(end) = end else {
        return Err(Error::shape(
            "cross_entropy",
            format!(
                "rows {start}..{start} + {rows} of the logits are beyond the {} targets",
                all.len()
            ),
        ));
    };
    be.run(&mut Forward {
        logits,
        targets: &all[start..end],
        all,
        start,
        vocab,
        grad_scale,
        losses,
    })
}

/// The call of [`forward_rows`].
struct Forward<'a> {
    logits: &'a mut Tensor,
    /// The targets of the logits' rows.
    targets: &'a [u32],
    /// The list they are part of, from row `start` on.
    all: &'a [u32],
    start: usize,
    vocab: usize,
    grad_scale: Option<f32>,
    losses: &'a mut Tensor,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn label(&self) -> &str {
        self.logits.label()
    }

    fn check(&self) -> Result<()> {
        let (logits, losses) = (&*self.logits, &*self.losses);
        ensure_float("cross_entropy", &[logits, losses])?;
        let (rows, _) = check(logits, self.targets, self.vocab)?;
        check_losses(losses, rows)
    }

    fn flops(&self) -> u64 {
        let per = match self.grad_scale {
            Some(_) => FLOPS_GRAD,
            None => FLOPS,
        };
        each(self.targets.len().saturating_mul(self.vocab), per)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(
            self.logits,
            self.targets,
            self.vocab,
            self.grad_scale,
            self.losses,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(
            be,
            self.logits,
            self.all,
            self.start,
            self.vocab,
            self.grad_scale,
            self.losses,
        )
    }
}

/// Checks the logits and targets (the contract every backend shares) and returns the
/// logits' `(rows, padded vocab)`.
fn check(logits: &Tensor, targets: &[u32], vocab: usize) -> Result<(usize, usize)> {
    let (rows, vp) = logits.rows_cols();
    ensure(targets.len() == rows, "cross_entropy", || {
        format!("{} targets for {rows} rows of logits", targets.len())
    })?;
    ensure(vocab > 0 && vocab <= vp, "cross_entropy", || {
        format!("vocab {vocab} must be in 1..={vp} (the logits' width)")
    })?;
    if let Some(bad) = targets
        .iter()
        .find(|&&t| t != IGNORE && t as usize >= vocab)
    {
        return Err(Error::data(
            "targets",
            format!("token id {bad} is beyond the vocabulary of {vocab}; use a tokenizer that matches the model's vocab_size"),
        ));
    }
    Ok((rows, vp))
}

/// Checks the tensor the row losses are added to: f32 with at least `rows` elements.
fn check_losses(losses: &Tensor, rows: usize) -> Result<()> {
    ensure(
        losses.dtype() == DType::F32 && losses.numel() >= rows,
        "cross_entropy",
        || {
            format!(
                "the losses `{}` must be f32 with at least {rows} elements, not {} {:?}",
                losses.label(),
                losses.dtype(),
                losses.shape()
            )
        },
    )
}
