//! The step's gradient guard: global norm, clipping multiplier and skip decision.

use super::{elementwise, read, write};
use crate::error::Result;
use crate::optim::{clip_coefficient, StepRecord};
use crate::tensor::{DType, Tensor};

/// Checks `grad_guard`'s record and losses (the contract every backend shares).
pub(crate) fn check(record: &Tensor, losses: &Tensor) -> Result<()> {
    super::ensure(losses.dtype() == DType::F32, "grad_guard", || {
        format!("the losses `{}` must be f32", losses.label())
    })?;
    super::ensure(
        record.dtype() == DType::F32 && record.numel() == StepRecord::LEN,
        "grad_guard",
        || {
            format!(
                "the step record `{}` must be f32 with {} elements, not {} {:?}",
                record.label(),
                StepRecord::LEN,
                record.dtype(),
                record.shape()
            )
        },
    )
}

/// The [`StepRecord`] values, computed in f64 as the GPU's kernel does: the squared norm
/// summed tensor by tensor, the losses in row order.
pub(crate) fn record(sum_squares: f64, loss_sum: f64, max_norm: f32, loss_scale: f32) -> [f32; 3] {
    let norm = sum_squares.sqrt() / loss_scale as f64;
    let scale = if norm.is_finite() && loss_sum.is_finite() {
        clip_coefficient(norm, max_norm as f64) / loss_scale
    } else {
        f32::NAN
    };
    [scale, norm as f32, loss_sum as f32]
}

pub(super) fn grad_guard(
    out: &mut Tensor,
    grads: &[&Tensor],
    losses: &Tensor,
    max_norm: f32,
    loss_scale: f32,
) {
    let sum_squares: f64 = grads.iter().map(|g| elementwise::sum_squares(g)).sum();
    let loss_sum: f64 = read(losses).iter().map(|&l| l as f64).sum();
    let r = record(sum_squares, loss_sum, max_norm, loss_scale);
    write(out, false, |o| o.copy_from_slice(&r));
}
