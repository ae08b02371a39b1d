//! Rotary position embedding of the queries and keys of a fused projection, forward and
//! backward (the same kernel turning the other way).
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/rope.cu`, listed once in [`KERNELS`].

use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::device::{Backend, Heads};
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};

/// The kernels of `kernels/rope.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "rope.cu",
    source: include_str!("../../../kernels/rope.cu"),
    kernels: &["rope_f32", "rope_bf16", "rope_f16"],
};

/// Turns the query and key heads of `x` into `out` by `sign` times each angle.
fn rotate(
    be: &CudaBackend,
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    sign: f32,
    op: &'static str,
) -> Result<()> {
    let (t, w) = match *x.shape() {
        [_, t, w] => (t, w),
        _ => (0, 0),
    };
    let dt = x.dtype();
    ensure_dtype(out, dt, op)?;
    let rows = x.numel().checked_div(w).unwrap_or(0);
    if rows * w == 0 {
        return Ok(());
    }
    // The frequencies (D/2 values) go up with the call, a workspace tensor the ledger counts.
    let freq = be.upload_kernel(
        inv_freq,
        &[inv_freq.len()],
        DType::F32,
        MemoryCategory::Workspace,
        "rope.inv_freq",
    )?;
    be.launch(
        &format!("rope_{dt}"),
        be.grid(rows * w),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&freq)?)
            .i64(rows)
            .i64(t)
            .i64(w)
            .i64(heads.q_width() + heads.kv_width())
            .i64(heads.head_dim)
            .f32(sign),
    )
}

pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
) -> Result<()> {
    rotate(be, out, x, inv_freq, heads, 1.0, "rope")
}

pub(crate) fn backward(
    be: &CudaBackend,
    dx: &mut Tensor,
    dout: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
) -> Result<()> {
    rotate(be, dx, dout, inv_freq, heads, -1.0, "rope_backward")
}
