//! GELU (tanh approximation) and its backward.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/gelu.cu`, listed once in [`KERNELS`].

use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/gelu.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "gelu.cu",
    source: include_str!("../../../kernels/gelu.cu"),
    kernels: &[
        "gelu_f32",
        "gelu_bf16",
        "gelu_backward_f32",
        "gelu_backward_bf16",
        "gelu_f16",
        "gelu_backward_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(be: &CudaBackend, out: &mut Tensor, x: &Tensor) -> Result<()> {
    let n = x.numel();
    ensure_dtype(out, x.dtype(), "gelu")?;
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("gelu_{}", x.dtype()),
        be.grid(n.div_ceil(8)),
        BLOCK,
        Args::new().ptr(ptr(out)?).ptr(ptr(x)?).i64(n),
    )
}

pub(crate) fn backward(be: &CudaBackend, dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()> {
    let n = x.numel();
    ensure_dtype(dx, x.dtype(), "gelu_backward")?;
    if n == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, x.dtype())?;
    be.launch(
        &format!("gelu_backward_{}", x.dtype()),
        be.grid(n.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(dx)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&dout)?)
            .i64(n),
    )
}
