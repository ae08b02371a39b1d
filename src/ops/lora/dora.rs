//! DoRA (weight-decomposed low-rank adaptation, PEFT's `use_dora`): the adapted weight's
//! direction `W + s·B·A` rescaled per output feature to a trained magnitude `m`,
//! `W' = (m / ‖W + s·B·A‖) ⊙ (W + s·B·A)`, the norm taken over the input features and
//! detached from the gradient, as PEFT computes it.
//!
//! Applied to a projection's output block (bias `b`, none for a frozen one without):
//! `y = g ⊙ (x·Wᵀ + s·(x Aᵀ) Bᵀ) + b` with `g = m / ‖W + s·B·A‖`, so the low-rank update
//! runs as plain LoRA's and the block's columns are then rescaled ([`scale_cols`]). Its
//! backward: `dm = Σ_rows dy ⊙ v / ‖W + s·B·A‖` ([`magnitude_grad`], `v` the block before the
//! scaling) and `g ⊙ dy` for everything LoRA's backward computes.
//!
//! Three kernels (`kernels/lora.cu`, CPU twins in `cpu.rs`, bitwise equal): the norms of
//! one block ([`weight_norm`]), the scaling, and the magnitude's gradient.

use super::{cpu, cuda};
use crate::device::cpu::{ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::ops::nf4;
use crate::tensor::{DType, Tensor};

pub use super::Block;

/// `‖W_c + scale · (B·A)_c‖` for each output feature `c` of `block` (f32, `[width]`): the
/// detached norms DoRA divides its magnitude by. `a` is `[rank, in]`, `b` `[width, rank]`;
/// an NF4 `w` is dequantized first (its block alone where the block's rows are
/// contiguous), into `b`'s dtype.
pub fn weight_norm(
    be: &dyn Backend,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    scale: f32,
    block: Block,
    label: &str,
) -> Result<Tensor> {
    let dtype = b.dtype();
    let mut d = be.empty(
        &[block.width, block.in_features],
        dtype,
        MemoryCategory::Workspace,
        &format!("{label}.dora_delta"),
    )?;
    be.matmul(&mut d, b, a, None, false, false, false)?;
    let mut n = be.empty(
        &[block.width],
        DType::F32,
        MemoryCategory::Workspace,
        &format!("{label}.dora_norm"),
    )?;
    if w.dtype().is_nf4() {
        let (shape, start, at) = if block.transposed {
            let shape = [block.width, block.in_features];
            (
                shape,
                block.offset * block.in_features,
                Block { offset: 0, ..block },
            )
        } else {
            let (rows, cols) = w.rows_cols();
            ([rows, cols], 0, block)
        };
        let mut dense = be.empty(
            &shape,
            dtype,
            MemoryCategory::Workspace,
            &format!("{label}.dora_base"),
        )?;
        nf4::dequantize(be, &mut dense, w, start)?;
        be.run(&mut Norm {
            n: &mut n,
            w: &dense,
            d: &d,
            scale,
            block: at,
        })?;
    } else {
        be.run(&mut Norm {
            n: &mut n,
            w,
            d: &d,
            scale,
            block,
        })?;
    }
    Ok(n)
}

/// `y[r, offset + c] = (m[c] / n[c]) · (y − b) + b` over the block of `m`'s width (`b`
/// the bias's column; none: `y · m / n`): DoRA's rescaling of an output block, or of its
/// gradient (without a bias).
pub fn scale_cols(
    be: &dyn Backend,
    y: &mut Tensor,
    m: &Tensor,
    n: &Tensor,
    bias: Option<&Tensor>,
    offset: usize,
) -> Result<()> {
    be.run(&mut ScaleCols {
        y,
        m,
        n,
        bias,
        offset,
    })
}

/// `out[c] = (Σ_r dy[r, offset + c] · v[r, c]) / n[c]` (`out` f32 `[width]`): the gradient
/// of DoRA's magnitude, `v` being the block's output before the scaling.
pub fn magnitude_grad(
    be: &dyn Backend,
    out: &mut Tensor,
    dy: &Tensor,
    v: &Tensor,
    n: &Tensor,
    offset: usize,
) -> Result<()> {
    be.run(&mut MagnitudeGrad {
        out,
        dy,
        v,
        n,
        offset,
    })
}

/// `n` must be f32 of `width` elements.
fn check_norms(op: &'static str, n: &Tensor, width: usize) -> Result<()> {
    ensure(n.dtype() == DType::F32 && n.numel() == width, op, || {
        format!(
            "`{}` {:?} ({}) must be the f32 norms of {width} features",
            n.label(),
            n.shape(),
            n.dtype()
        )
    })
}

struct Norm<'a> {
    n: &'a mut Tensor,
    w: &'a Tensor,
    d: &'a Tensor,
    scale: f32,
    block: Block,
}

impl OpKernel for Norm<'_> {
    fn name(&self) -> &'static str {
        "dora_norm"
    }
    fn label(&self) -> &str {
        self.n.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("dora_norm", &[self.w, self.d])?;
        check_norms("dora_norm", self.n, self.block.width)?;
        let b = self.block;
        let (rows, cols) = self.w.rows_cols();
        let fits = if b.transposed {
            cols == b.in_features && b.offset + b.width <= rows
        } else {
            rows == b.in_features && b.offset + b.width <= cols
        };
        ensure(
            fits && self.d.shape() == [b.width, b.in_features] && self.w.dtype() == self.d.dtype(),
            "dora_norm",
            || {
                format!(
                    "`{}` {:?} ({}) must hold output features {}..{} of {} inputs ({}), and \
                     `{}` {:?} ({}) be [{}, {}] of its dtype",
                    self.w.label(),
                    self.w.shape(),
                    self.w.dtype(),
                    b.offset,
                    b.offset + b.width,
                    b.in_features,
                    if b.transposed {
                        "[out, in]"
                    } else {
                        "[in, out]"
                    },
                    self.d.label(),
                    self.d.shape(),
                    self.d.dtype(),
                    b.width,
                    b.in_features
                )
            },
        )
    }
    fn flops(&self) -> u64 {
        4 * self.d.numel() as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::dora_norm(self.n, self.w, self.d, self.scale, &self.block);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::dora_norm(be, self.n, self.w, self.d, self.scale, &self.block)
    }
}

struct ScaleCols<'a> {
    y: &'a mut Tensor,
    m: &'a Tensor,
    n: &'a Tensor,
    bias: Option<&'a Tensor>,
    offset: usize,
}

impl OpKernel for ScaleCols<'_> {
    fn name(&self) -> &'static str {
        "dora_scale_cols"
    }
    fn label(&self) -> &str {
        self.y.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("dora_scale_cols", &[self.y, self.m])?;
        let width = self.m.numel();
        check_norms("dora_scale_cols", self.n, width)?;
        let cols = self.y.rows_cols().1;
        let bias_fits = self
            .bias
            .is_none_or(|b| b.numel() == cols && b.dtype() == self.y.dtype());
        ensure(
            self.offset + width <= cols && self.m.dtype() == self.y.dtype() && bias_fits,
            "dora_scale_cols",
            || {
                format!(
                    "`{}` {:?} ({}) must have columns {}..{} for the magnitude `{}` {:?} ({}) \
                     and a bias of its width and dtype",
                    self.y.label(),
                    self.y.shape(),
                    self.y.dtype(),
                    self.offset,
                    self.offset + width,
                    self.m.label(),
                    self.m.shape(),
                    self.m.dtype()
                )
            },
        )
    }
    fn flops(&self) -> u64 {
        3 * (self.y.numel() / self.y.rows_cols().1.max(1) * self.m.numel()) as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::dora_scale_cols(self.y, self.m, self.n, self.bias, self.offset);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::dora_scale_cols(be, self.y, self.m, self.n, self.bias, self.offset)
    }
}

struct MagnitudeGrad<'a> {
    out: &'a mut Tensor,
    dy: &'a Tensor,
    v: &'a Tensor,
    n: &'a Tensor,
    offset: usize,
}

impl OpKernel for MagnitudeGrad<'_> {
    fn name(&self) -> &'static str {
        "dora_magnitude_grad"
    }
    fn label(&self) -> &str {
        self.out.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("dora_magnitude_grad", &[self.dy, self.v])?;
        let (rows, cols) = self.dy.rows_cols();
        let (vrows, width) = self.v.rows_cols();
        check_norms("dora_magnitude_grad", self.n, width)?;
        check_norms("dora_magnitude_grad", self.out, width)?;
        ensure(
            rows == vrows && self.offset + width <= cols && self.dy.dtype() == self.v.dtype(),
            "dora_magnitude_grad",
            || {
                format!(
                    "`{}` {:?} ({}) must be columns {}..{} of `{}` {:?} ({}), row for row, in \
                     one dtype",
                    self.v.label(),
                    self.v.shape(),
                    self.v.dtype(),
                    self.offset,
                    self.offset + width,
                    self.dy.label(),
                    self.dy.shape(),
                    self.dy.dtype()
                )
            },
        )
    }
    fn flops(&self) -> u64 {
        2 * self.v.numel() as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::dora_magnitude_grad(self.out, self.dy, self.v, self.n, self.offset);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::dora_magnitude_grad(be, self.out, self.dy, self.v, self.n, self.offset)
    }
}
