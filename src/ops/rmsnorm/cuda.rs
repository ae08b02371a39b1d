//! RMS normalization on the GPU: the forward, and the backward (dx per row; the weight
//! gradient in two passes over blocks of [`ROW_BLOCK`] rows).
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/rmsnorm.cu`, listed once in
//! [`KERNELS`].

use crate::device::cpu::ensure_f32;
use crate::device::cuda::backend::{ensure_dtype, ROW_BLOCK};
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/rmsnorm.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "rmsnorm.cu",
    source: include_str!("../../../kernels/rmsnorm.cu"),
    kernels: &[
        "rmsnorm_f32",
        "rmsnorm_bf16",
        "rmsnorm_backward_dx_f32",
        "rmsnorm_backward_dx_bf16",
        "rmsnorm_backward_params_f32",
        "rmsnorm_backward_params_bf16",
        "rmsnorm_backward_params_finish_f32",
        "rmsnorm_backward_params_finish_bf16",
        "rmsnorm_f16",
        "rmsnorm_backward_dx_f16",
        "rmsnorm_backward_params_f16",
        "rmsnorm_backward_params_finish_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    ensure_dtype(out, x.dtype(), "rmsnorm")?;
    if rows * c == 0 {
        return Ok(());
    }
    let dt = x.dtype();
    let weight = be.as_dtype(weight, dt)?;
    be.launch(
        &format!("rmsnorm_{dt}"),
        be.grid_warp_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(rstd)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&weight)?)
            .i64(rows)
            .i64(c)
            .f32(eps),
    )
}

pub(crate) fn backward(
    be: &CudaBackend,
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    // The kernels read the statistics as f32.
    ensure_f32(rstd, "rmsnorm_backward")?;
    if rows * c == 0 {
        return Ok(());
    }
    let dt = x.dtype();
    ensure_dtype(dx, dt, "rmsnorm_backward")?;
    let dout = be.as_dtype(dout, dt)?;
    let weight = be.as_dtype(weight, dt)?;
    be.launch(
        &format!("rmsnorm_backward_dx_{dt}"),
        be.grid_warp_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(dx)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&weight)?)
            .ptr(ptr(rstd)?)
            .i64(rows)
            .i64(c),
    )?;
    let blocks = rows.div_ceil(ROW_BLOCK);
    let partial = be.scratch(blocks * c * 4, "rmsnorm_backward.partial")?;
    be.launch(
        &format!("rmsnorm_backward_params_{dt}"),
        be.grid(blocks * c.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(&partial)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(x)?)
            .ptr(ptr(rstd)?)
            .i64(rows)
            .i64(c),
    )?;
    be.launch(
        &format!("rmsnorm_backward_params_finish_{}", dweight.dtype()),
        be.grid_columns(c),
        BLOCK,
        Args::new()
            .ptr(ptr(dweight)?)
            .ptr(ptr(&partial)?)
            .i64(blocks)
            .i64(c),
    )
}
