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
inventory::submit!(KERNELS);

/// The rows of `logits` against targets `start..` of `all` (checked by the caller). The
/// whole list is uploaded once and kept while the calls ask for the same list (the chunks
/// of one loss), each chunk reading its rows of it.
pub(crate) fn forward(
    be: &CudaBackend,
    logits: &mut Tensor,
    all: &[u32],
    start: usize,
    vocab: usize,
    grad_scale: Option<f32>,
    losses: &mut Tensor,
) -> Result<()> {
    let (rows, vp) = logits.rows_cols();
    if rows == 0 {
        return Ok(());
    }
    let kept = be.kept_u32(all, "cross_entropy.targets")?;
    let targets = ptr(&kept)? + 4 * start as u64;
    // One block of BLOCK (the kernel's TK_CE_LANES) threads per row.
    be.launch(
        &format!("cross_entropy_{}", logits.dtype()),
        be.grid(rows * BLOCK as usize),
        BLOCK,
        Args::new()
            .ptr(ptr(logits)?)
            .ptr(ptr(losses)?)
            .ptr(targets)
            .i64(rows)
            .i64(vp)
            .i64(vocab)
            .f32(grad_scale.unwrap_or(0.0))
            .i32(grad_scale.is_some() as i32),
    )
}
