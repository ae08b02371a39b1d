//! The column blocks of a fused projection, LoRA's dropout and DoRA's column norms,
//! scaling and magnitude gradient on the GPU.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/lora.cu`, listed once in
//! [`KERNELS`].

use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use crate::device::cuda::{Args, KernelFile};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/lora.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "lora.cu",
    source: include_str!("../../../kernels/lora.cu"),
    kernels: &[
        "lora_add_cols_f32",
        "lora_add_cols_bf16",
        "lora_add_cols_f16",
        "lora_take_cols_f32",
        "lora_take_cols_bf16",
        "lora_take_cols_f16",
        "lora_dropout_f32",
        "lora_dropout_bf16",
        "lora_dropout_f16",
        "dora_norm_f32",
        "dora_norm_bf16",
        "dora_norm_f16",
        "dora_scale_cols_f32",
        "dora_scale_cols_bf16",
        "dora_scale_cols_f16",
        "dora_magnitude_grad_f32",
        "dora_magnitude_grad_bf16",
        "dora_magnitude_grad_f16",
    ],
};
inventory::submit!(KERNELS);

/// Launches `kernel` over `rows · width` elements of a `[rows, cols]` tensor's block.
fn launch(
    be: &CudaBackend,
    kernel: &'static str,
    dst: &mut Tensor,
    src: &Tensor,
    cols: usize,
    offset: usize,
    width: usize,
) -> Result<()> {
    let dt = src.dtype();
    ensure_dtype(dst, dt, kernel)?;
    let rows = src.numel().max(dst.numel()) / cols.max(1);
    if rows * width == 0 {
        return Ok(());
    }
    be.launch(
        &format!("{kernel}_{dt}"),
        be.grid(rows * width),
        BLOCK,
        Args::new()
            .ptr(ptr(dst)?)
            .ptr(ptr(src)?)
            .i64(rows)
            .i64(cols)
            .i64(offset)
            .i64(width),
    )
}

pub(crate) fn add_cols(
    be: &CudaBackend,
    dst: &mut Tensor,
    offset: usize,
    src: &Tensor,
) -> Result<()> {
    let (cols, width) = (dst.rows_cols().1, src.rows_cols().1);
    launch(be, "lora_add_cols", dst, src, cols, offset, width)
}

pub(crate) fn dropout(
    be: &CudaBackend,
    dst: &mut Tensor,
    src: &Tensor,
    keep: super::Keep,
    accumulate: bool,
) -> Result<()> {
    let (n, dt) = (src.numel(), src.dtype());
    ensure_dtype(dst, dt, "lora_dropout")?;
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("lora_dropout_{dt}"),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(dst)?)
            .ptr(ptr(src)?)
            .i64(n)
            .i64(keep.key as usize)
            .i64(keep.threshold as usize)
            .f32(keep.scale)
            .i64(usize::from(accumulate)),
    )
}

pub(crate) fn take_cols(
    be: &CudaBackend,
    dst: &mut Tensor,
    src: &Tensor,
    offset: usize,
) -> Result<()> {
    let (cols, width) = (src.rows_cols().1, dst.rows_cols().1);
    launch(be, "lora_take_cols", dst, src, cols, offset, width)
}

pub(crate) fn dora_norm(
    be: &CudaBackend,
    n: &mut Tensor,
    w: &Tensor,
    d: &Tensor,
    scale: f32,
    at: &super::Block,
) -> Result<()> {
    let dt = d.dtype();
    ensure_dtype(w, dt, "dora_norm")?;
    if at.width == 0 {
        return Ok(());
    }
    be.launch(
        &format!("dora_norm_{dt}"),
        be.grid(at.width),
        BLOCK,
        Args::new()
            .ptr(ptr(n)?)
            .ptr(ptr(w)?)
            .ptr(ptr(d)?)
            .f32(scale)
            .i64(at.in_features)
            .i64(w.rows_cols().1)
            .i64(at.offset)
            .i64(at.width)
            .i64(usize::from(at.transposed)),
    )
}

pub(crate) fn dora_scale_cols(
    be: &CudaBackend,
    y: &mut Tensor,
    m: &Tensor,
    n: &Tensor,
    bias: Option<&Tensor>,
    offset: usize,
) -> Result<()> {
    let dt = y.dtype();
    ensure_dtype(m, dt, "dora_scale_cols")?;
    let (rows, cols) = y.rows_cols();
    let width = m.numel();
    let bias = match bias {
        Some(b) => {
            ensure_dtype(b, dt, "dora_scale_cols")?;
            ptr(b)?
        }
        None => 0,
    };
    if rows * width == 0 {
        return Ok(());
    }
    be.launch(
        &format!("dora_scale_cols_{dt}"),
        be.grid(rows * width),
        BLOCK,
        Args::new()
            .ptr(ptr(y)?)
            .ptr(ptr(m)?)
            .ptr(ptr(n)?)
            .ptr(bias)
            .i64(rows)
            .i64(cols)
            .i64(offset)
            .i64(width),
    )
}

pub(crate) fn dora_magnitude_grad(
    be: &CudaBackend,
    out: &mut Tensor,
    dy: &Tensor,
    v: &Tensor,
    n: &Tensor,
    offset: usize,
) -> Result<()> {
    let dt = dy.dtype();
    ensure_dtype(v, dt, "dora_magnitude_grad")?;
    let (rows, cols) = dy.rows_cols();
    let width = v.rows_cols().1;
    if width == 0 {
        return Ok(());
    }
    be.launch(
        &format!("dora_magnitude_grad_{dt}"),
        be.grid(width),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(dy)?)
            .ptr(ptr(v)?)
            .ptr(ptr(n)?)
            .i64(rows)
            .i64(cols)
            .i64(offset)
            .i64(width),
    )
}
