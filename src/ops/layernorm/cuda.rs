//! Layer normalization and its backward (dx per row; the parameter gradients in two
//! passes over blocks of 128 rows).
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/layernorm.cu`, listed once in [`KERNELS`].

use crate::device::cpu::ensure_f32;
use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK, ROW_BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/layernorm.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "layernorm.cu",
    source: include_str!("../../../kernels/layernorm.cu"),
    kernels: &[
        "layernorm_f32",
        "layernorm_bf16",
        "layernorm_backward_dx_f32",
        "layernorm_backward_dx_bf16",
        "layernorm_backward_params_f32",
        "layernorm_backward_params_bf16",
        "layernorm_backward_params_finish_f32",
        "layernorm_backward_params_finish_bf16",
        "layernorm_f16",
        "layernorm_backward_dx_f16",
        "layernorm_backward_params_f16",
        "layernorm_backward_params_finish_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    stats: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    ensure_dtype(out, x.dtype(), "layernorm")?;
    if rows * c == 0 {
        return Ok(());
    }
    let dt = x.dtype();
    let weight = be.as_dtype(weight, dt)?;
    let bias = be.as_dtype(bias, dt)?;
    be.launch(
        &format!("layernorm_{dt}"),
        be.grid_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(stats)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&weight)?)
            .ptr(ptr(&bias)?)
            .i64(rows)
            .i64(c)
            .f32(eps),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    be: &CudaBackend,
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dbias: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    stats: &Tensor,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    // The kernels read the statistics as f32.
    ensure_f32(stats, "layernorm_backward")?;
    ensure_dtype(dbias, dweight.dtype(), "layernorm_backward")?;
    if rows * c == 0 {
        return Ok(());
    }
    let dt = x.dtype();
    let dx_dt = dx.dtype();
    ensure_dtype(dx, dt, "layernorm_backward")?;
    let dout = be.as_dtype(dout, dt)?;
    let weight = be.as_dtype(weight, dt)?;
    be.launch(
        &format!("layernorm_backward_dx_{dx_dt}"),
        be.grid_warp_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(dx)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&weight)?)
            .ptr(ptr(stats)?)
            .i64(rows)
            .i64(c),
    )?;
    let blocks = rows.div_ceil(ROW_BLOCK);
    let partial = be.scratch(blocks * 2 * c * 4, "layernorm_backward.partial")?;
    be.launch(
        &format!("layernorm_backward_params_{dt}"),
        be.grid(blocks * c),
        BLOCK,
        Args::new()
            .ptr(ptr(&partial)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(x)?)
            .ptr(ptr(stats)?)
            .i64(rows)
            .i64(c),
    )?;
    be.launch(
        &format!("layernorm_backward_params_finish_{}", dweight.dtype()),
        be.grid(c),
        BLOCK,
        Args::new()
            .ptr(ptr(dweight)?)
            .ptr(ptr(dbias)?)
            .ptr(ptr(&partial)?)
            .i64(blocks)
            .i64(c),
    )
}
