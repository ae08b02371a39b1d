//! The step's gradient guard: the clipping multiplier and the skip decision, kept on the
//! device so a step never waits for the host before its update.

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// What [`Backend::grad_guard`] leaves on the device at the end of a step's backward: a
/// 3-element f32 tensor `[scale, grad_norm, loss_sum]`. The trainer reads it once, after
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
    pub const LEN: usize = 3;

    /// Reads the record from its tensor (on a GPU: waits for the queued work).
    pub fn read(backend: &dyn Backend, record: &Tensor) -> Result<StepRecord> {
        check(record, Self::LEN, "step record")?;
        let v = backend.to_f32(record)?;
        Ok(StepRecord {
            scale: v[0],
            grad_norm: v[1],
            loss_sum: v[2],
        })
    }

    /// Whether the loss and the gradient norm were finite, so the update was applied.
    pub fn finite(&self) -> bool {
        self.scale.is_finite()
    }
}

/// The gradient multiplier an [`crate::Optimizer`] receives: element 0 of a device f32
/// tensor (the [`StepRecord`]'s `scale`). A value that is not finite means the step's
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
