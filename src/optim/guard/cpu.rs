//! The step's gradient guard on the CPU, the reference of `grad_guard` in
//! `kernels/reductions.cu`: global norm, clipping multiplier and skip decision, written as
//! a plain f32 record (the layout of `mod.rs`: [`SCALE`], [`GRAD_NORM`], [`LOSS_SUM`]).

use super::{GRAD_NORM, LOSS_SUM, RECORD_LEN, SCALE};
use crate::device::cpu::elementwise::sum_squares;
use crate::device::cpu::{read, write};
use crate::optim::clip_coefficient;
use crate::tensor::Tensor;

/// The record's values, computed in f64 as the GPU's kernel does: the squared norm
/// summed tensor by tensor, the losses in row order.
pub(super) fn record(
    sum_squares: f64,
    loss_sum: f64,
    max_norm: f32,
    loss_scale: f32,
) -> [f32; RECORD_LEN] {
    let norm = sum_squares.sqrt() / loss_scale as f64;
    let scale = if norm.is_finite() && loss_sum.is_finite() {
        clip_coefficient(norm, max_norm as f64) / loss_scale
    } else {
        f32::NAN
    };
    let mut r = [0f32; RECORD_LEN];
    r[SCALE] = scale;
    r[GRAD_NORM] = norm as f32;
    r[LOSS_SUM] = loss_sum as f32;
    r
}

/// The guard, on checked operands.
pub(crate) fn grad_guard(
    out: &mut Tensor,
    grads: &[&Tensor],
    losses: &Tensor,
    max_norm: f32,
    loss_scale: f32,
) {
    let sum_squares: f64 = grads.iter().map(|g| sum_squares(g)).sum();
    let loss_sum: f64 = read(losses).iter().map(|&l| l as f64).sum();
    let r = record(sum_squares, loss_sum, max_norm, loss_scale);
    write(out, false, |o| o.copy_from_slice(&r));
}
