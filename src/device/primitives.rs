//! The element-wise and reduction primitives every backend has (cast, fill, add, axpy,
//! scale, copy of rows, the bias gradient's column sums, sums of squares), as kernel calls: [`Backend`]'s methods of the
//! same names build one and hand it to [`Backend::run`], so each primitive's check, FLOPs,
//! CPU loop and CUDA launch sit together here, and a backend implements none of them.

use super::cpu::{each, elementwise, ensure_float, CpuBackend};
use super::cuda::ops::{elementwise as gpu, reductions};
use super::cuda::CudaBackend;
use super::OpKernel;
use crate::error::Result;
use crate::tensor::Tensor;

/// Floating-point operations per element: 1 for `add`, `scale` and a bias gradient's
/// column sum, 2 for `axpy`; casts, fills and copies count 0.
const ADD: u64 = 1;
const AXPY: u64 = 2;
const SCALE: u64 = 1;
pub(crate) const BIAS_BACKWARD: u64 = 1;

/// `dst = src`, converting (and rounding) to `dst`'s dtype.
pub(crate) struct Cast<'a> {
    pub dst: &'a mut Tensor,
    pub src: &'a Tensor,
}

impl OpKernel for Cast<'_> {
    fn name(&self) -> &'static str {
        "cast"
    }
    fn label(&self) -> &str {
        self.dst.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("cast", &[self.dst, self.src])?;
        elementwise::same_len(self.dst, self.src, "cast")
    }
    fn flops(&self) -> u64 {
        0
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        elementwise::cast(self.dst, self.src);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        gpu::launch_cast(be, self.dst, self.src)
    }
}

/// Every element set to `value`.
pub(crate) struct Fill<'a> {
    pub t: &'a mut Tensor,
    pub value: f32,
}

impl OpKernel for Fill<'_> {
    fn name(&self) -> &'static str {
        "fill"
    }
    fn label(&self) -> &str {
        self.t.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("fill", &[self.t])
    }
    fn flops(&self) -> u64 {
        0
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        elementwise::fill(self.t, self.value);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        gpu::fill(be, self.t, self.value)
    }
}

/// `out = a + b`, element-wise.
pub(crate) struct Add<'a> {
    pub out: &'a mut Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
}

impl OpKernel for Add<'_> {
    fn name(&self) -> &'static str {
        "add"
    }
    fn label(&self) -> &str {
        self.out.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("add", &[self.out, self.a, self.b])?;
        elementwise::same_len(self.out, self.a, "add")?;
        elementwise::same_len(self.out, self.b, "add")
    }
    fn flops(&self) -> u64 {
        each(self.out.numel(), ADD)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        elementwise::add(self.out, self.a, self.b);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        gpu::add(be, self.out, self.a, self.b)
    }
}

/// `y += alpha * x`, element-wise.
pub(crate) struct Axpy<'a> {
    pub y: &'a mut Tensor,
    pub alpha: f32,
    pub x: &'a Tensor,
}

impl OpKernel for Axpy<'_> {
    fn name(&self) -> &'static str {
        "axpy"
    }
    fn label(&self) -> &str {
        self.y.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("axpy", &[self.y, self.x])?;
        elementwise::same_len(self.y, self.x, "axpy")
    }
    fn flops(&self) -> u64 {
        each(self.y.numel(), AXPY)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        elementwise::axpy(self.y, self.alpha, self.x);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        gpu::axpy(be, self.y, self.alpha, self.x)
    }
}

/// Rows of `src` set into (or added to) rows of `dst` (see [`Backend::copy_rows`]).
pub(crate) struct CopyRows<'a> {
    pub dst: &'a mut Tensor,
    pub dst_row: usize,
    pub src: &'a Tensor,
    pub src_row: usize,
    pub rows: usize,
    pub accumulate: bool,
}

impl OpKernel for CopyRows<'_> {
    fn name(&self) -> &'static str {
        "copy_rows"
    }
    fn label(&self) -> &str {
        self.dst.label()
    }
    fn check(&self) -> Result<()> {
        let (dst, src) = (&*self.dst, self.src);
        elementwise::check_copy_rows(dst, self.dst_row, src, self.src_row, self.rows)
    }
    fn flops(&self) -> u64 {
        let n = self.rows.saturating_mul(self.src.rows_cols().1);
        if self.accumulate {
            each(n, ADD)
        } else {
            0
        }
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let (dr, sr, rows, acc) = (self.dst_row, self.src_row, self.rows, self.accumulate);
        elementwise::copy_rows(self.dst, dr, self.src, sr, rows, acc);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let (dr, sr, rows, acc) = (self.dst_row, self.src_row, self.rows, self.accumulate);
        gpu::copy_rows(be, self.dst, dr, self.src, sr, rows, acc)
    }
}

/// `x *= alpha`, element-wise.
pub(crate) struct Scale<'a> {
    pub x: &'a mut Tensor,
    pub alpha: f32,
}

impl OpKernel for Scale<'_> {
    fn name(&self) -> &'static str {
        "scale"
    }
    fn label(&self) -> &str {
        self.x.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("scale", &[self.x])
    }
    fn flops(&self) -> u64 {
        each(self.x.numel(), SCALE)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        elementwise::scale(self.x, self.alpha);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        gpu::scale(be, self.x, self.alpha)
    }
}

/// `dbias += column sums of dout` (the bias gradient of a matmul).
pub(crate) struct BiasBackward<'a> {
    pub dbias: &'a mut Tensor,
    pub dout: &'a Tensor,
}

impl OpKernel for BiasBackward<'_> {
    fn name(&self) -> &'static str {
        "bias_backward"
    }
    fn label(&self) -> &str {
        self.dbias.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("bias_backward", &[self.dbias, self.dout])?;
        elementwise::check_bias_backward(self.dbias, self.dout)
    }
    fn flops(&self) -> u64 {
        each(self.dout.numel(), BIAS_BACKWARD)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        elementwise::bias_backward(self.dbias, self.dout);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        gpu::bias_backward(be, self.dbias, self.dout)
    }
}

/// Floating-point operations per element of a sum of squares (a multiply and an add).
const SUM_SQUARES: u64 = 2;

/// `total = Σ x²` over every element of `x`, accumulated in f64 in a fixed order.
pub(crate) struct SumSquares<'a> {
    pub x: &'a Tensor,
    pub total: f64,
}

impl OpKernel for SumSquares<'_> {
    fn name(&self) -> &'static str {
        "sum_squares"
    }
    fn label(&self) -> &str {
        self.x.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("sum_squares", &[self.x])
    }
    fn flops(&self) -> u64 {
        each(self.x.numel(), SUM_SQUARES)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        self.total = elementwise::sum_squares(self.x);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        self.total = reductions::sum_squares(be, self.x)?;
        Ok(())
    }
}

/// `totals[k] = Σ x²` over every element of tensor `k` of `xs`, accumulated in f64, each
/// as [`SumSquares`] gives it: on a GPU in one pass with one read back.
pub(crate) struct SumSquaresEach<'a, 'b> {
    pub xs: &'a [&'b Tensor],
    pub totals: Vec<f64>,
}

impl OpKernel for SumSquaresEach<'_, '_> {
    fn name(&self) -> &'static str {
        "sum_squares"
    }
    fn label(&self) -> &str {
        "gradients"
    }
    fn check(&self) -> Result<()> {
        ensure_float("sum_squares", self.xs)
    }
    fn flops(&self) -> u64 {
        each(self.xs.iter().map(|x| x.numel()).sum(), SUM_SQUARES)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        self.totals = self
            .xs
            .iter()
            .map(|x| elementwise::sum_squares(x))
            .collect();
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        self.totals = reductions::sum_squares_each(be, self.xs)?;
        Ok(())
    }
}

/// `total = Σ x²` over every element of every tensor of `xs` (the squared global norm of
/// the gradients), accumulated in f64: on the CPU tensor by tensor in order, on a GPU in
/// one pass with one read back.
pub(crate) struct SumSquaresAll<'a, 'b> {
    pub xs: &'a [&'b Tensor],
    pub total: f64,
}

impl OpKernel for SumSquaresAll<'_, '_> {
    fn name(&self) -> &'static str {
        "sum_squares"
    }
    fn label(&self) -> &str {
        "gradients"
    }
    fn check(&self) -> Result<()> {
        ensure_float("sum_squares", self.xs)
    }
    fn flops(&self) -> u64 {
        each(self.xs.iter().map(|x| x.numel()).sum(), SUM_SQUARES)
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let mut total = 0f64;
        for x in self.xs {
            total += elementwise::sum_squares(x);
        }
        self.total = total;
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        self.total = reductions::sum_squares_all(be, self.xs)?;
        Ok(())
    }
}
