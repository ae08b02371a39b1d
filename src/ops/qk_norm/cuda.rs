//! The per-head q/k norm on the GPU: the forward, and the backward (dx per head row; each
//! gain's gradient in two passes over blocks of [`ROW_BLOCK`] rows of its group).
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/qk_norm.cu`, listed once in
//! [`KERNELS`].

use crate::device::cpu::ensure_f32;
use crate::device::cuda::backend::{ensure_dtype, ROW_BLOCK};
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::ops::Heads;
use crate::tensor::Tensor;

/// The kernels of `kernels/qk_norm.cu`, named once: the backend launches these names,
/// NVRTC and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "qk_norm.cu",
    source: include_str!("../../../kernels/qk_norm.cu"),
    kernels: &[
        "qk_norm_f32",
        "qk_norm_bf16",
        "qk_norm_f16",
        "qk_norm_backward_dx_f32",
        "qk_norm_backward_dx_bf16",
        "qk_norm_backward_dx_f16",
        "qk_norm_backward_params_f32",
        "qk_norm_backward_params_bf16",
        "qk_norm_backward_params_f16",
    ],
};
inventory::submit!(KERNELS);

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    rstd: &mut Tensor,
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    heads: Heads,
    eps: f32,
) -> Result<()> {
    let (tokens, _) = qkv.rows_cols();
    ensure_dtype(out, qkv.dtype(), "qk_norm")?;
    if tokens == 0 {
        return Ok(());
    }
    let dt = qkv.dtype();
    let (wq, wk) = (be.as_dtype(wq, dt)?, be.as_dtype(wk, dt)?);
    let head_rows = tokens * (heads.n_head + 2 * heads.n_kv_head);
    be.launch(
        &format!("qk_norm_{dt}"),
        be.grid_rows(head_rows),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(rstd)?)
            .ptr(ptr(qkv)?)
            .ptr(ptr(&wq)?)
            .ptr(ptr(&wk)?)
            .i64(tokens)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
            .f32(eps),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    be: &CudaBackend,
    dx: &mut Tensor,
    dwq: &mut Tensor,
    dwk: &mut Tensor,
    dout: &Tensor,
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    rstd: &Tensor,
    heads: Heads,
) -> Result<()> {
    let (tokens, _) = qkv.rows_cols();
    // The kernels read the statistics as f32.
    ensure_f32(rstd, "qk_norm_backward")?;
    if tokens == 0 {
        return Ok(());
    }
    let dt = qkv.dtype();
    ensure_dtype(dx, dt, "qk_norm_backward")?;
    let dout = be.as_dtype(dout, dt)?;
    let (wq, wk) = (be.as_dtype(wq, dt)?, be.as_dtype(wk, dt)?);
    let (h, kv, d) = (heads.n_head, heads.n_kv_head, heads.head_dim);
    be.launch(
        &format!("qk_norm_backward_dx_{dt}"),
        be.grid_rows(tokens * (h + 2 * kv)),
        BLOCK,
        Args::new()
            .ptr(ptr(dx)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(qkv)?)
            .ptr(ptr(&wq)?)
            .ptr(ptr(&wk)?)
            .ptr(ptr(rstd)?)
            .i64(tokens)
            .i64(h)
            .i64(kv)
            .i64(d),
    )?;
    for (grad, first, n) in [(dwq, 0, h), (dwk, h, kv)] {
        let blocks = (tokens * n).div_ceil(ROW_BLOCK);
        let partial = be.scratch(blocks * d * 4, "qk_norm_backward.partial")?;
        be.launch(
            &format!("qk_norm_backward_params_{dt}"),
            be.grid(blocks * d),
            BLOCK,
            Args::new()
                .ptr(ptr(&partial)?)
                .ptr(ptr(&dout)?)
                .ptr(ptr(qkv)?)
                .ptr(ptr(rstd)?)
                .i64(tokens)
                .i64(h)
                .i64(kv)
                .i64(d)
                .i64(first)
                .i64(n),
        )?;
        // The RMS norm's second pass: the partial sums added in block order.
        be.launch(
            &format!("rmsnorm_backward_params_finish_{}", grad.dtype()),
            be.grid_columns(d),
            BLOCK,
            Args::new()
                .ptr(ptr(grad)?)
                .ptr(ptr(&partial)?)
                .i64(blocks)
                .i64(d),
        )?;
    }
    Ok(())
}
