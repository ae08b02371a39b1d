//! GELU with the tanh approximation (GPT-2's `gelu_new`), element-wise, and its backward.
//!
//! The family: the kernel calls [`forward`] and [`backward`] with their operand checks and
//! FLOP counts, the CPU twin (`cpu.rs`) and the CUDA launches (`cuda.rs`, over
//! `kernels/gelu.cu`). The graph node that applies it is [`crate::ops::LinearGelu`].

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::device::cpu::elementwise::same_len;
use crate::device::cpu::{each, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::tensor::Tensor;

/// Floating-point operations per element of the forward and of the backward.
pub(crate) const FLOPS: u64 = 9;
pub(crate) const FLOPS_BACKWARD: u64 = 19;

/// GELU with the tanh approximation, element-wise: `out = gelu(x)`.
pub fn forward(be: &(impl Backend + ?Sized), out: &mut Tensor, x: &Tensor) -> Result<()> {
    be.run(&mut Forward { out, x })
}

/// `dx = gelu'(x) · dout` (overwritten).
pub fn backward(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    x: &Tensor,
    dout: &Tensor,
) -> Result<()> {
    be.run(&mut Backward { dx, x, dout })
}

struct Forward<'a> {
    out: &'a mut Tensor,
    x: &'a Tensor,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("gelu", &[self.out, self.x])?;
        same_len(self.out, self.x, "gelu")
    }

    fn flops(&self) -> u64 {
        each(self.x.numel(), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(self.out, self.x);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(be, self.out, self.x)
    }
}

struct Backward<'a> {
    dx: &'a mut Tensor,
    x: &'a Tensor,
    dout: &'a Tensor,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "gelu_backward"
    }

    fn label(&self) -> &str {
        self.dx.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("gelu_backward", &[self.dx, self.x, self.dout])?;
        same_len(self.dx, self.x, "gelu_backward")?;
        same_len(self.dx, self.dout, "gelu_backward")
    }

    fn flops(&self) -> u64 {
        each(self.x.numel(), FLOPS_BACKWARD)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::backward(self.dx, self.x, self.dout);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward(be, self.dx, self.x, self.dout)
    }
}
