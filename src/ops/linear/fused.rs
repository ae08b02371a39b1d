//! The products of a linear layer that a GPU fuses with their neighbour: the forward
//! product with its bias and GELU (`matmul_bias_gelu`), the forward product with the
//! residual it is added to (`matmul_residual`), the input gradient of a layer whose input
//! is a GELU's output carried through the GELU (`matmul_dgelu`), and the weight gradient
//! with the bias gradient (`weight_bias_grad`).
//!
//! Each is one kernel call through [`Backend::run`], one span carrying the FLOPs of both
//! parts on every backend. The CPU runs its parts one after the other (the composed
//! reference); the CUDA backend runs the product with cuBLASLt's epilogue (GELU with the
//! pre-activation as its auxiliary output, the residual read as C, GELU's derivative at
//! the pre-activation, or the bias gradient's column sums), and falls
//! back to the same two parts, inside the same span, where the epilogue does not apply or
//! the library has no algorithm for it.

use crate::device::cpu::elementwise::{check_bias_backward, same_len};
use crate::device::cpu::{self, each, ensure_float};
use crate::device::cuda::ops::{elementwise as gpu, matmul as lt};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::ops::gelu;
use crate::tensor::Tensor;

/// Floating-point operations per element of a bias gradient's column sum.
const BIAS_BACKWARD: u64 = 1;

/// Floating-point operations per element of a residual add.
const RESIDUAL: u64 = 1;

/// `pre = a · b + bias` and `out = gelu(pre)`: the first layer of an MLP, one op.
pub fn matmul_bias_gelu(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    pre: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: &Tensor,
) -> Result<()> {
    be.run(&mut BiasGelu {
        out,
        pre,
        a,
        b,
        bias,
    })
}

/// `y = residual + x · op(W) (+ bias)` (`op(W) = Wᵀ` with `trans_w`), overwritten: a
/// block's output projection added to the residual stream, one op. The CPU (the composed
/// reference) writes the product into `y`, rounded to its dtype, then adds the residual;
/// the CUDA backend reads the residual as cuBLASLt's C (beta 1), so the sum is rounded
/// once from the f32 accumulator and the add is no pass over memory of its own.
pub fn matmul_residual(
    be: &(impl Backend + ?Sized),
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    trans_w: bool,
) -> Result<()> {
    be.run(&mut Residual {
        y,
        x,
        w,
        bias,
        residual,
        trans_w,
    })
}

/// `dpre = gelu'(pre) ⊙ (dy · op(W))` (`op(W) = Wᵀ` with `trans_w`), overwritten: the
/// gradient of `pre` through a linear layer whose input was `gelu(pre)` and whose output
/// gradient is `dy`, one op. The CPU (the composed reference) writes the product into
/// `dpre`, rounded to its dtype, then multiplies it in place by GELU's derivative; the
/// CUDA backend multiplies in cuBLASLt's `DGELU` epilogue, from the f32 accumulator, so
/// that the input gradient of the GELU's output never exists as a tensor (and in bf16 the
/// product is not rounded before the multiplication).
pub fn matmul_dgelu(
    be: &(impl Backend + ?Sized),
    dpre: &mut Tensor,
    dy: &Tensor,
    w: &Tensor,
    pre: &Tensor,
    trans_w: bool,
) -> Result<()> {
    be.run(&mut Dgelu {
        dpre,
        dy,
        w,
        pre,
        trans_w,
    })
}

/// A linear layer's parameter gradients from its input `x` and output gradient `dy`, one
/// op: `dw += xᵀ · dy` (weights stored `[in, out]`), or `dw += dyᵀ · x` with `transposed`
/// (stored `[out, in]`), and `dbias += column sums of dy`.
pub fn weight_bias_grad(
    be: &(impl Backend + ?Sized),
    dw: &mut Tensor,
    dbias: &mut Tensor,
    x: &Tensor,
    dy: &Tensor,
    transposed: bool,
) -> Result<()> {
    be.run(&mut WeightBiasGrad {
        dw,
        dbias,
        x,
        dy,
        transposed,
    })
}

struct BiasGelu<'a> {
    out: &'a mut Tensor,
    pre: &'a mut Tensor,
    a: &'a Tensor,
    b: &'a Tensor,
    bias: &'a Tensor,
}

impl OpKernel for BiasGelu<'_> {
    fn name(&self) -> &'static str {
        "matmul_bias_gelu"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float(
            "matmul_bias_gelu",
            &[self.out, self.pre, self.a, self.b, self.bias],
        )?;
        cpu::matmul::dims(self.pre, self.a, self.b, Some(self.bias), false, false)?;
        same_len(self.out, self.pre, "gelu")
    }

    fn flops(&self) -> u64 {
        cpu::matmul::flops(self.pre, self.a, true, false)
            .saturating_add(each(self.out.numel(), gelu::FLOPS))
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        be.matmul_kernel(
            self.pre,
            self.a,
            self.b,
            Some(self.bias),
            false,
            false,
            false,
        )?;
        gelu::cpu::forward(self.out, self.pre);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        if lt::matmul_bias_gelu(be, self.out, self.pre, self.a, self.b, self.bias)? {
            return Ok(());
        }
        be.matmul_kernel(
            self.pre,
            self.a,
            self.b,
            Some(self.bias),
            false,
            false,
            false,
        )?;
        gelu::cuda::forward(be, self.out, self.pre)
    }
}

struct Residual<'a> {
    y: &'a mut Tensor,
    x: &'a Tensor,
    w: &'a Tensor,
    bias: Option<&'a Tensor>,
    residual: &'a Tensor,
    trans_w: bool,
}

impl OpKernel for Residual<'_> {
    fn name(&self) -> &'static str {
        "matmul_residual"
    }

    fn label(&self) -> &str {
        self.y.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("matmul_residual", &[self.y, self.x, self.w, self.residual])?;
        if let Some(b) = self.bias {
            ensure_float("matmul_residual", &[b])?;
        }
        cpu::matmul::dims(self.y, self.x, self.w, self.bias, false, self.trans_w)?;
        same_len(self.y, self.residual, "matmul_residual")
    }

    fn flops(&self) -> u64 {
        cpu::matmul::flops(self.y, self.x, self.bias.is_some(), false)
            .saturating_add(each(self.y.numel(), RESIDUAL))
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        self.product(be)?;
        cpu::elementwise::axpy(self.y, 1.0, self.residual);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let (y, x, w) = (&mut *self.y, self.x, self.w);
        if lt::matmul_residual(be, y, x, w, self.bias, self.residual, self.trans_w)? {
            return Ok(());
        }
        self.product(be)?;
        gpu::axpy(be, self.y, 1.0, self.residual)
    }
}

impl Residual<'_> {
    /// The product with its bias alone, into `y`: the first of the composed form's parts.
    fn product(&mut self, be: &impl Backend) -> Result<()> {
        let (x, w, bias) = (self.x, self.w, self.bias);
        be.matmul_kernel(self.y, x, w, bias, false, self.trans_w, false)
    }
}

struct Dgelu<'a> {
    dpre: &'a mut Tensor,
    dy: &'a Tensor,
    w: &'a Tensor,
    pre: &'a Tensor,
    trans_w: bool,
}

impl OpKernel for Dgelu<'_> {
    fn name(&self) -> &'static str {
        "matmul_dgelu"
    }

    fn label(&self) -> &str {
        self.dpre.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("matmul_dgelu", &[self.dpre, self.dy, self.w, self.pre])?;
        cpu::matmul::dims(self.dpre, self.dy, self.w, None, false, self.trans_w)?;
        same_len(self.dpre, self.pre, "matmul_dgelu")
    }

    fn flops(&self) -> u64 {
        cpu::matmul::flops(self.dpre, self.dy, false, false)
            .saturating_add(each(self.dpre.numel(), gelu::FLOPS_BACKWARD))
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        be.matmul_kernel(self.dpre, self.dy, self.w, None, false, self.trans_w, false)?;
        gelu::cpu::backward_in_place(self.dpre, self.pre);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        if lt::matmul_dgelu(be, self.dpre, self.dy, self.w, self.pre, self.trans_w)? {
            return Ok(());
        }
        be.matmul_kernel(self.dpre, self.dy, self.w, None, false, self.trans_w, false)?;
        gelu::cuda::backward_in_place(be, self.dpre, self.pre)
    }
}

struct WeightBiasGrad<'a> {
    dw: &'a mut Tensor,
    dbias: &'a mut Tensor,
    x: &'a Tensor,
    dy: &'a Tensor,
    transposed: bool,
}

impl WeightBiasGrad<'_> {
    /// The product's operands: `dw += op(a)ᵀ · b`.
    fn operands(&self) -> (&Tensor, &Tensor) {
        if self.transposed {
            (self.dy, self.x)
        } else {
            (self.x, self.dy)
        }
    }
}

impl OpKernel for WeightBiasGrad<'_> {
    fn name(&self) -> &'static str {
        "weight_bias_grad"
    }

    fn label(&self) -> &str {
        self.dw.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("weight_bias_grad", &[self.dw, self.dbias, self.x, self.dy])?;
        let (a, b) = self.operands();
        cpu::matmul::dims(self.dw, a, b, None, true, false)?;
        check_bias_backward(self.dbias, self.dy)
    }

    fn flops(&self) -> u64 {
        let (a, _) = self.operands();
        cpu::matmul::flops(self.dw, a, false, true)
            .saturating_add(each(self.dy.numel(), BIAS_BACKWARD))
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        let (a, b) = if self.transposed {
            (self.dy, self.x)
        } else {
            (self.x, self.dy)
        };
        be.matmul_kernel(self.dw, a, b, None, true, false, true)?;
        cpu::elementwise::bias_backward(self.dbias, self.dy);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        if lt::weight_bias_grad(be, self.dw, self.dbias, self.x, self.dy, self.transposed)? {
            return Ok(());
        }
        let (a, b) = if self.transposed {
            (self.dy, self.x)
        } else {
            (self.x, self.dy)
        };
        be.matmul_kernel(self.dw, a, b, None, true, false, true)?;
        gpu::bias_backward(be, self.dbias, self.dy)
    }
}
