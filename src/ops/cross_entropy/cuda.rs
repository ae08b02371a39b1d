//! Cross-entropy per row, optionally writing the gradient over the logits; the losses
//! stay on the device.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/cross_entropy.cu`, listed once in
//! [`KERNELS`].

use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/cross_entropy.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "cross_entropy.cu",
    source: include_str!("../../../kernels/cross_entropy.cu"),
    kernels: &[
        "cross_entropy_f32",
        "cross_entropy_bf16",
        "cross_entropy_f16",
    ],
};

pub(crate) fn forward(
    be: &CudaBackend,
    logits: &mut Tensor,
    targets: &[u32],
    vocab: usize,
    grad_scale: Option<f32>,
    losses: &mut Tensor,
) -> Result<()> {
    let (rows, vp) = (targets.len(), logits.rows_cols().1);
    if rows == 0 {
        return Ok(());
    }
    let tg = be.upload_u32(targets, "cross_entropy.targets")?;
    be.launch(
        &format!("cross_entropy_{}", logits.dtype()),
        be.grid_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(logits)?)
            .ptr(ptr(losses)?)
            .ptr(ptr(&tg)?)
            .i64(rows)
            .i64(vp)
            .i64(vocab)
            .f32(grad_scale.unwrap_or(0.0))
            .i32(grad_scale.is_some() as i32),
    )
}
