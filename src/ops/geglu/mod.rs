//! GeGLU's gate, the activation of Gemma's MLP: `out = gelu(gate) · up` (the tanh GELU)
//! from a fused `[.., 2F]` projection holding the gate in its first `F` columns and the up
//! projection in its last `F`, laid out as [`super::geglu`]'s.
//!
//! The family: the graph node [`GeGlu`], the kernel calls [`forward`] and [`backward`]
//! with their FLOP counts (the operand checks are SwiGLU's), the CPU twin (`cpu.rs`) and
//! the CUDA launches (`cuda.rs`, over `kernels/geglu.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::swiglu::check;
use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::elementwise::same_len;
use crate::device::cpu::{each, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Floating-point operations per output of the forward and of the backward (the GELU's,
/// as [`super::gelu`] counts them, and the products with the up projection and the
/// output gradient).
const FLOPS: u64 = 10;
const FLOPS_BACKWARD: u64 = 21;

/// GeGLU's gate: `out = gelu(gate) · up` where `gate_up` holds the gate in its first
/// `F` columns and the up projection in its last `F` (`out` is `[.., F]`).
pub fn forward(be: &(impl Backend + ?Sized), out: &mut Tensor, gate_up: &Tensor) -> Result<()> {
    be.run(&mut Forward { out, gate_up })
}

/// Backward of [`forward`]: writes the gate and up gradients side by side into
/// `dgate_up` (overwritten).
pub fn backward(
    be: &(impl Backend + ?Sized),
    dgate_up: &mut Tensor,
    dout: &Tensor,
    gate_up: &Tensor,
) -> Result<()> {
    be.run(&mut Backward {
        dgate_up,
        dout,
        gate_up,
    })
}

struct Forward<'a> {
    out: &'a mut Tensor,
    gate_up: &'a Tensor,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "geglu"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("geglu", &[self.out, self.gate_up])?;
        check("geglu", self.out, self.gate_up, &[]).map(drop)
    }

    fn flops(&self) -> u64 {
        each(self.out.numel(), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(self.out, self.gate_up);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(be, self.out, self.gate_up)
    }
}

struct Backward<'a> {
    dgate_up: &'a mut Tensor,
    dout: &'a Tensor,
    gate_up: &'a Tensor,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "geglu_backward"
    }

    fn label(&self) -> &str {
        self.dgate_up.label()
    }

    fn check(&self) -> Result<()> {
        let op = "geglu_backward";
        ensure_float(op, &[self.dgate_up, self.dout, self.gate_up])?;
        check(op, self.dout, self.gate_up, &[self.dgate_up])?;
        same_len(self.dgate_up, self.gate_up, op)
    }

    fn flops(&self) -> u64 {
        each(self.dout.numel(), FLOPS_BACKWARD)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::backward(self.dgate_up, self.dout, self.gate_up);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward(be, self.dgate_up, self.dout, self.gate_up)
    }
}

/// `out = gelu(gate) · up` (the tanh GELU) from a fused `[.., 2F]` projection holding the gate in its first
/// `F` columns and the up projection in its last `F` (see [`forward`]).
///
/// Input: `gate_up`. Output: `out` (`[.., F]`). Backward reads `gate_up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeGlu;

impl Op for GeGlu {
    fn name(&self) -> &'static str {
        "geglu"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let gate_up = inputs[0];
        let mut shape = gate_up.shape().to_vec();
        match shape.last_mut() {
            Some(last) if *last % 2 == 0 => *last /= 2,
            _ => {
                return Err(Error::shape(
                    "geglu",
                    format!(
                        "`{}` {:?} must end in an even width: the gate and up projections \
                         side by side",
                        gate_up.label(),
                        gate_up.shape()
                    ),
                ))
            }
        }
        Ok(vec![(shape, dtype)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut out = cx.alloc(0)?;
        forward(cx.backend, &mut out, cx.input(0)?)?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let gate_up = cx.inputs[0].get()?;
        cx.grads_in[0].overwrite(be, |dgu| backward(be, dgu, &dout, gate_up))?;
        cx.inputs[0].release();
        Ok(())
    }
}
