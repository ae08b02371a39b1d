//! Gated linear units over a fused gate-and-up projection, and their backward.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/glu.cu`, listed once in [`KERNELS`]
//! (`swiglu_*` and `geglu_*`, one pair of kernels per gate and dtype).

use super::Gate;
use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/glu.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "glu.cu",
    source: include_str!("../../../kernels/glu.cu"),
    kernels: &[
        "swiglu_f32",
        "swiglu_bf16",
        "swiglu_f16",
        "swiglu_backward_f32",
        "swiglu_backward_bf16",
        "swiglu_backward_f16",
        "geglu_f32",
        "geglu_bf16",
        "geglu_f16",
        "geglu_backward_f32",
        "geglu_backward_bf16",
        "geglu_backward_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(
    be: &CudaBackend,
    gate: Gate,
    out: &mut Tensor,
    gate_up: &Tensor,
) -> Result<()> {
    let (rows, f) = out.rows_cols();
    let dt = gate_up.dtype();
    ensure_dtype(out, dt, gate.name())?;
    if rows * f == 0 {
        return Ok(());
    }
    be.launch(
        &format!("{}_{dt}", gate.name()),
        be.grid(rows * f.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(gate_up)?)
            .i64(rows)
            .i64(f),
    )
}

pub(crate) fn backward(
    be: &CudaBackend,
    gate: Gate,
    dgate_up: &mut Tensor,
    dout: &Tensor,
    gate_up: &Tensor,
) -> Result<()> {
    let (rows, f) = dout.rows_cols();
    let dt = gate_up.dtype();
    ensure_dtype(dgate_up, dt, gate.backward_name())?;
    if rows * f == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, dt)?;
    be.launch(
        &format!("{}_{dt}", gate.backward_name()),
        be.grid(rows * f.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(dgate_up)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(gate_up)?)
            .i64(rows)
            .i64(f),
    )
}

/// [`backward`] over `gate_up`'s own buffer: each thread reads its pair of gate and up
/// values before it writes their gradients, so the kernel runs in place.
pub(crate) fn backward_in_place(
    be: &CudaBackend,
    gate: Gate,
    gate_up: &mut Tensor,
    dout: &Tensor,
) -> Result<()> {
    let (rows, f) = dout.rows_cols();
    let dt = gate_up.dtype();
    if rows * f == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, dt)?;
    let p = ptr(gate_up)?;
    be.launch(
        &format!("{}_{dt}", gate.backward_name()),
        be.grid(rows * f.div_ceil(8)),
        BLOCK,
        Args::new().ptr(p).ptr(ptr(&dout)?).ptr(p).i64(rows).i64(f),
    )
}
