//! The step's gradient guard on the GPU: one partial sum of squares per block of every
//! gradient (`sum_squares_partial_*`), then one block that adds them and the losses and
//! writes the record, all in f64; nothing is read back.
//!
//! CPU twin: `cpu.rs` beside this file. Kernel: `grad_guard` in `kernels/reductions.cu`,
//! listed in that file's `KERNELS` (`src/device/cuda/ops/reductions.rs`).

use crate::device::cuda::ops::reductions::square_partials;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend};
use crate::error::Result;
use crate::tensor::Tensor;

pub(crate) fn grad_guard(
    be: &CudaBackend,
    record: &mut Tensor,
    grads: &[&Tensor],
    losses: &Tensor,
    max_norm: f32,
    loss_scale: f32,
) -> Result<()> {
    // One partial per block of every gradient in one buffer, then one block that adds
    // them and the losses and writes the record: nothing is read back.
    let (partial, slots) = square_partials(be, grads, "grad_guard.partial")?;
    be.launch(
        "grad_guard",
        1,
        32,
        Args::new()
            .ptr(ptr(record)?)
            .ptr(ptr(&partial)?)
            .i64(slots)
            .ptr(ptr(losses)?)
            .i64(losses.numel())
            .f32(max_norm)
            .f32(loss_scale),
    )
}
