//! The step's gradient guard: the clipping multiplier and the skip decision, kept on the
//! device so a step never waits for the host before its update.
//!
//! The guard's kernel call ([`grad_guard`], an [`OpKernel`] with its operand checks and
//! FLOP count) writes a plain f32 record tensor laid out as the constants below say
//! ([`RECORD_LEN`] elements: [`SCALE`], [`GRAD_NORM`], [`LOSS_SUM`]); [`StepRecord`] reads
//! it on the host and [`GradScale`] hands its first element to the optimizer. The CPU
//! twin is `cpu.rs`, the CUDA launch `cuda.rs` (its kernel, `grad_guard`, is one of
//! `kernels/reductions.cu`, whose partial sums of squares it shares).

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::device::cpu::{each, ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Index in the record of the gradient multiplier: the clipping coefficient over the loss
/// scale, NaN when the loss or the gradient norm is not finite (the update is skipped).
pub const SCALE: usize = 0;
/// Index in the record of the global gradient norm, with the loss scale removed.
pub const GRAD_NORM: usize = 1;
/// Index in the record of the sum of the step's per-position losses.
pub const LOSS_SUM: usize = 2;
/// Elements (f32) of the record tensor.
pub const RECORD_LEN: usize = 3;

/// Floating-point operations per gradient element (a square and a sum, as
/// `sum_squares`).
const FLOPS: u64 = 2;

/// The end of a step's backward, on the device: writes the step's record (read by
/// [`StepRecord`]) to `record` (f32, [`RECORD_LEN`] elements) from the gradients `grads`
/// (scaled by `loss_scale`) and the per-row losses `losses`. The squared norm and the loss
/// sum are accumulated in f64; the multiplier is PyTorch's `clip_grad_norm_` coefficient
/// (see [`crate::optim::clip_coefficient`], 1 when `max_norm <= 0`) divided by
/// `loss_scale`, or NaN when the loss or the norm is not finite, which tells the
/// optimizer to skip the update.
pub fn grad_guard(
    be: &dyn Backend,
    record: &mut Tensor,
    grads: &[&Tensor],
    losses: &Tensor,
    max_norm: f32,
    loss_scale: f32,
) -> Result<()> {
    be.run(&mut Guard {
        record,
        grads,
        losses,
        max_norm,
        loss_scale,
    })
}

/// The record [`grad_guard`] would write from gradients whose squared norm, `sum_squares`
/// (f64, with the loss scale in it), was summed elsewhere (under ZeRO-2 each rank holds
/// only its share of the gradients, and the ranks sum their squares), and the
/// per-row `losses`: a new f32 tensor of [`RECORD_LEN`] elements labelled `label`. The
/// values are computed on the host (a backend that holds none gets zeros).
pub fn record_from_squares(
    be: &dyn Backend,
    sum_squares: f64,
    losses: &Tensor,
    max_norm: f32,
    loss_scale: f32,
    label: &str,
) -> Result<Tensor> {
    check_record_losses(losses)?;
    let r = if be.holds_data() {
        let loss_sum: f64 = be.to_f32(losses)?.iter().map(|&l| l as f64).sum();
        cpu::record(sum_squares, loss_sum, max_norm, loss_scale)
    } else {
        [0.0; RECORD_LEN]
    };
    be.upload(
        &r,
        &[RECORD_LEN],
        DType::F32,
        crate::memory::MemoryCategory::Workspace,
        label,
    )
}

/// The call of [`grad_guard`].
struct Guard<'a> {
    record: &'a mut Tensor,
    grads: &'a [&'a Tensor],
    losses: &'a Tensor,
    max_norm: f32,
    loss_scale: f32,
}

impl OpKernel for Guard<'_> {
    fn name(&self) -> &'static str {
        "grad_guard"
    }

    fn label(&self) -> &str {
        self.record.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("grad_guard", self.grads)?;
        check_record(self.record, self.losses)
    }

    fn flops(&self) -> u64 {
        let n: usize = self.grads.iter().map(|g| g.numel()).sum();
        each(n, FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::grad_guard(
            self.record,
            self.grads,
            self.losses,
            self.max_norm,
            self.loss_scale,
        );
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::grad_guard(
            be,
            self.record,
            self.grads,
            self.losses,
            self.max_norm,
            self.loss_scale,
        )
    }
}

/// Checks `grad_guard`'s losses: f32.
fn check_record_losses(losses: &Tensor) -> Result<()> {
    ensure(losses.dtype() == DType::F32, "grad_guard", || {
        format!("the losses `{}` must be f32", losses.label())
    })
}

/// Checks `grad_guard`'s record and losses (the contract every backend shares).
fn check_record(record: &Tensor, losses: &Tensor) -> Result<()> {
    check_record_losses(losses)?;
    ensure(
        record.dtype() == DType::F32 && record.numel() == RECORD_LEN,
        "grad_guard",
        || {
            format!(
                "the step record `{}` must be f32 with {} elements, not {} {:?}",
                record.label(),
                RECORD_LEN,
                record.dtype(),
                record.shape()
            )
        },
    )
}

/// What [`grad_guard`] leaves on the device at the end of a step's backward: a
/// 3-element f32 tensor `[scale, grad_norm, loss_sum]` (at [`SCALE`], [`GRAD_NORM`] and
/// [`LOSS_SUM`]). The trainer reads it once, after
/// the update has been queued, to log the loss and the norm and to count skipped steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepRecord {
    /// The gradient multiplier (clipping coefficient over the loss scale); not finite when
    /// the update was skipped.
    pub scale: f32,
    /// The global gradient norm, with the loss scale removed.
    pub grad_norm: f32,
    /// The sum of the step's per-position losses.
    pub loss_sum: f32,
}

impl StepRecord {
    /// Elements of the record tensor.
    pub const LEN: usize = RECORD_LEN;

    /// Reads the record from its tensor (on a GPU: waits for the queued work).
    pub fn read(backend: &dyn Backend, record: &Tensor) -> Result<StepRecord> {
        check(record, Self::LEN, "step record")?;
        Ok(Self::from_values(&backend.to_f32(record)?))
    }

    /// The record in `values`, [`StepRecord::LEN`] of them or more, as the guard writes it.
    pub(crate) fn from_values(values: &[f32]) -> StepRecord {
        StepRecord {
            scale: values[SCALE],
            grad_norm: values[GRAD_NORM],
            loss_sum: values[LOSS_SUM],
        }
    }

    /// Whether the loss and the gradient norm were finite, so the update was applied.
    pub fn finite(&self) -> bool {
        self.scale.is_finite()
    }
}

/// The gradient multiplier an [`crate::Optimizer`] receives: element 0 of a device f32
/// tensor (the [`StepRecord`]'s `scale`, at [`SCALE`]). A value that is not finite means the step's
/// loss or gradient norm was not: the optimizer must then leave the weights and its
/// state untouched.
///
/// Passing [`GradScale::tensor`] to [`adamw::update`](super::adamw::update) applies it on the device, as
/// PyTorch's fused AdamW takes `grad_scale` and `found_inf` tensors. An optimizer built
/// from host-valued ops calls [`GradScale::read`] instead, which costs one wait for the
/// device per step.
#[derive(Clone, Copy, Debug)]
pub struct GradScale<'a> {
    tensor: &'a Tensor,
}

impl<'a> GradScale<'a> {
    /// The multiplier held in element 0 of `tensor` (f32).
    pub fn new(tensor: &'a Tensor) -> Result<Self> {
        check(tensor, 1, "gradient scale")?;
        Ok(GradScale { tensor })
    }

    /// The tensor holding the multiplier in its element 0.
    pub fn tensor(&self) -> &'a Tensor {
        self.tensor
    }

    /// The multiplier on the host, or `None` when the update must be skipped. On a GPU
    /// this waits for every queued op.
    pub fn read(&self, backend: &dyn Backend) -> Result<Option<f32>> {
        let s = backend.to_f32(self.tensor)?[0];
        Ok(s.is_finite().then_some(s))
    }
}

fn check(t: &Tensor, min_len: usize, what: &str) -> Result<()> {
    if t.dtype() != DType::F32 || t.numel() < min_len {
        return Err(Error::Backend {
            backend: "optimizer",
            message: format!(
                "the {what} `{}` must be an f32 tensor of at least {min_len} elements, not {} {:?}",
                t.label(),
                t.dtype(),
                t.shape()
            ),
        });
    }
    Ok(())
}
