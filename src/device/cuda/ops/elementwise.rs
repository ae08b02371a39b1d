//! Element-wise ops: casts, fill, `add`, `axpy`, `scale`, and the bias gradient (two
//! passes, no atomics).
//!
//! CPU twin: `src/device/cpu/elementwise.rs`. Kernels: `kernels/elementwise.cu`, listed once in [`KERNELS`].

use super::super::backend::{ptr, CudaBackend, Operand, BLOCK, ROW_BLOCK};
use super::super::gpu::Args;
use super::super::kernels::KernelFile;
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};

/// The kernels of `kernels/elementwise.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "elementwise.cu",
    source: include_str!("../../../../kernels/elementwise.cu"),
    kernels: &[
        "cast_f32_f32",
        "cast_f32_bf16",
        "cast_bf16_f32",
        "cast_bf16_bf16",
        "fill_f32",
        "fill_bf16",
        "scale_f32",
        "scale_bf16",
        "bias_backward_partial_f32",
        "bias_backward_partial_bf16",
        "bias_backward_finish_f32",
        "bias_backward_finish_bf16",
        "axpy_f32_f32",
        "axpy_f32_bf16",
        "axpy_bf16_f32",
        "axpy_bf16_bf16",
        "add_f32_f32_f32",
        "add_f32_f32_bf16",
        "add_f32_bf16_f32",
        "add_f32_bf16_bf16",
        "add_bf16_f32_f32",
        "add_bf16_f32_bf16",
        "add_bf16_bf16_f32",
        "add_bf16_bf16_bf16",
        "cast_f32_f16",
        "cast_f16_f32",
        "cast_f16_f16",
        "fill_f16",
        "scale_f16",
        "bias_backward_partial_f16",
        "bias_backward_finish_f16",
        "axpy_f32_f16",
        "axpy_f16_f32",
        "axpy_f16_f16",
        "add_f32_f32_f16",
        "add_f32_f16_f32",
        "add_f32_f16_f16",
        "add_f16_f32_f32",
        "add_f16_f32_f16",
        "add_f16_f16_f32",
        "add_f16_f16_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn launch_cast(be: &CudaBackend, dst: &mut Tensor, src: &Tensor) -> Result<()> {
    let n = dst.numel();
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("cast_{}_{}", dst.dtype(), src.dtype()),
        be.grid(n),
        BLOCK,
        Args::new().ptr(ptr(dst)?).ptr(ptr(src)?).i64(n),
    )
}

pub(crate) fn fill(be: &CudaBackend, t: &mut Tensor, value: f32) -> Result<()> {
    let n = t.numel();
    if n == 0 {
        return Ok(());
    }
    if value == 0.0 && value.is_sign_positive() {
        return be.gpu.zero(ptr(t)?, t.bytes() as usize);
    }
    be.launch(
        &format!("fill_{}", t.dtype()),
        be.grid(n),
        BLOCK,
        Args::new().ptr(ptr(t)?).f32(value).i64(n),
    )
}

pub(crate) fn add(be: &CudaBackend, out: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("add_{}_{}_{}", out.dtype(), a.dtype(), b.dtype()),
        be.grid(n),
        BLOCK,
        Args::new().ptr(ptr(out)?).ptr(ptr(a)?).ptr(ptr(b)?).i64(n),
    )
}

pub(crate) fn axpy(be: &CudaBackend, y: &mut Tensor, alpha: f32, x: &Tensor) -> Result<()> {
    let n = y.numel();
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("axpy_{}_{}", y.dtype(), x.dtype()),
        be.grid(n),
        BLOCK,
        Args::new().ptr(ptr(y)?).f32(alpha).ptr(ptr(x)?).i64(n),
    )
}

/// Rows of `src` into rows of `dst`: the `cast` kernel (or `axpy` with `alpha = 1` when
/// accumulating) on the two row ranges, addressed by offsetting the tensors' pointers.
pub(crate) fn copy_rows(
    be: &CudaBackend,
    dst: &mut Tensor,
    dst_row: usize,
    src: &Tensor,
    src_row: usize,
    rows: usize,
    accumulate: bool,
) -> Result<()> {
    let cols = src.rows_cols().1;
    let n = rows * cols;
    if n == 0 {
        return Ok(());
    }
    let d = ptr(dst)? + (dst_row * cols * dst.dtype().size()) as u64;
    let s = ptr(src)? + (src_row * cols * src.dtype().size()) as u64;
    if accumulate {
        be.launch(
            &format!("axpy_{}_{}", dst.dtype(), src.dtype()),
            be.grid(n),
            BLOCK,
            Args::new().ptr(d).f32(1.0).ptr(s).i64(n),
        )
    } else {
        be.launch(
            &format!("cast_{}_{}", dst.dtype(), src.dtype()),
            be.grid(n),
            BLOCK,
            Args::new().ptr(d).ptr(s).i64(n),
        )
    }
}

pub(crate) fn scale(be: &CudaBackend, x: &mut Tensor, alpha: f32) -> Result<()> {
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("scale_{}", x.dtype()),
        be.grid(n),
        BLOCK,
        Args::new().ptr(ptr(x)?).f32(alpha).i64(n),
    )
}

/// The row sums of `rows × cols` into an f32 `[ceil(rows / ROW_BLOCK), cols]` workspace,
/// then their total added to `dbias` (the bias gradient, two passes, no atomics).
pub(crate) fn bias_backward(be: &CudaBackend, dbias: &mut Tensor, dout: &Tensor) -> Result<()> {
    let (rows, cols) = dout.rows_cols();
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let blocks = rows.div_ceil(ROW_BLOCK);
    let partial = be.scratch(blocks * cols * 4, "bias_backward.partial")?;
    be.launch(
        &format!("bias_backward_partial_{}", dout.dtype()),
        be.grid(blocks * cols.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(&partial)?)
            .ptr(ptr(dout)?)
            .i64(rows)
            .i64(cols),
    )?;
    be.launch(
        &format!("bias_backward_finish_{}", dbias.dtype()),
        be.grid_columns(cols),
        BLOCK,
        Args::new()
            .ptr(ptr(dbias)?)
            .ptr(ptr(&partial)?)
            .i64(blocks)
            .i64(cols),
    )
}

impl CudaBackend {
    /// `t` as `dtype`: `t` itself, or a cast copy in the workspace.
    pub fn as_dtype<'a>(&self, t: &'a Tensor, dtype: DType) -> Result<Operand<'a>> {
        if t.dtype() == dtype {
            return Ok(Operand::Borrowed(t));
        }
        let mut c = self.alloc(
            t.shape(),
            dtype,
            MemoryCategory::Workspace,
            &format!("{}.as_{dtype}", t.label()),
            false,
        )?;
        launch_cast(self, &mut c, t)?;
        Ok(Operand::Owned(c))
    }
}
