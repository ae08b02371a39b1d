//! Gated linear units, the activation of a gated MLP: `out = act(gate) · up` from a fused
//! `[.., 2F]` projection holding the gate in its first `F` columns and the up projection in
//! its last `F`. The gate's activation is a [`Gate`]: SiLU (SwiGLU, Llama's MLP) or the
//! tanh GELU (GeGLU, Gemma's).
//!
//! The family: the graph node [`Glu`], the kernel calls [`forward`] and [`backward`] with
//! their operand checks and FLOP counts, the CPU twin (`cpu.rs`) and the CUDA launches
//! (`cuda.rs`, over `kernels/glu.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{BackwardCx, ForwardCx, Op, Saved, Saves};
use crate::device::cpu::elementwise::same_len;
use crate::device::cpu::{each, ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The activation applied to the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gate {
    /// `silu(g) = g · σ(g)`: SwiGLU.
    Silu,
    /// The tanh GELU (GPT-2's `gelu_new`, Gemma's `gelu_pytorch_tanh`): GeGLU.
    Gelu,
}

impl Gate {
    /// The op's name (its ledger span and its kernels' prefix): `swiglu` or `geglu`.
    pub fn name(self) -> &'static str {
        match self {
            Gate::Silu => "swiglu",
            Gate::Gelu => "geglu",
        }
    }

    /// The backward's name: `swiglu_backward` or `geglu_backward`.
    pub fn backward_name(self) -> &'static str {
        match self {
            Gate::Silu => "swiglu_backward",
            Gate::Gelu => "geglu_backward",
        }
    }

    /// Floating-point operations per output of the forward and of the backward (for the
    /// GELU, as [`super::gelu`] counts it, plus the products with the up projection and
    /// the output gradient).
    fn flops(self) -> (u64, u64) {
        match self {
            Gate::Silu => (5, 11),
            Gate::Gelu => (10, 21),
        }
    }
}

/// `out = act(gate) · up` where `gate_up` holds the gate in its first `F` columns and the
/// up projection in its last `F` (`out` is `[.., F]`).
pub fn forward(
    be: &(impl Backend + ?Sized),
    gate: Gate,
    out: &mut Tensor,
    gate_up: &Tensor,
) -> Result<()> {
    be.run(&mut Forward { gate, out, gate_up })
}

/// Backward of [`forward`]: writes the gate and up gradients side by side into
/// `dgate_up` (overwritten).
pub fn backward(
    be: &(impl Backend + ?Sized),
    gate: Gate,
    dgate_up: &mut Tensor,
    dout: &Tensor,
    gate_up: &Tensor,
) -> Result<()> {
    be.run(&mut Backward {
        gate,
        dgate_up,
        dout,
        gate_up,
    })
}

/// [`backward`] in place: overwrites `gate_up` with the gate and up gradients (for the
/// caller that reads `gate_up` for the last time: no second `[.., 2F]` buffer).
pub fn backward_in_place(
    be: &(impl Backend + ?Sized),
    gate: Gate,
    gate_up: &mut Tensor,
    dout: &Tensor,
) -> Result<()> {
    be.run(&mut BackwardInPlace {
        gate,
        gate_up,
        dout,
    })
}

struct Forward<'a> {
    gate: Gate,
    out: &'a mut Tensor,
    gate_up: &'a Tensor,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        self.gate.name()
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        let op = self.gate.name();
        ensure_float(op, &[self.out, self.gate_up])?;
        check(op, self.out, self.gate_up, &[]).map(drop)
    }

    fn flops(&self) -> u64 {
        each(self.out.numel(), self.gate.flops().0)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(self.gate, self.out, self.gate_up);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(be, self.gate, self.out, self.gate_up)
    }
}

struct Backward<'a> {
    gate: Gate,
    dgate_up: &'a mut Tensor,
    dout: &'a Tensor,
    gate_up: &'a Tensor,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        self.gate.backward_name()
    }

    fn label(&self) -> &str {
        self.dgate_up.label()
    }

    fn check(&self) -> Result<()> {
        let op = self.gate.backward_name();
        ensure_float(op, &[self.dgate_up, self.dout, self.gate_up])?;
        check(op, self.dout, self.gate_up, &[self.dgate_up])?;
        same_len(self.dgate_up, self.gate_up, op)
    }

    fn flops(&self) -> u64 {
        each(self.dout.numel(), self.gate.flops().1)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::backward(self.gate, self.dgate_up, self.dout, self.gate_up);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward(be, self.gate, self.dgate_up, self.dout, self.gate_up)
    }
}

struct BackwardInPlace<'a> {
    gate: Gate,
    gate_up: &'a mut Tensor,
    dout: &'a Tensor,
}

impl OpKernel for BackwardInPlace<'_> {
    fn name(&self) -> &'static str {
        self.gate.backward_name()
    }

    fn label(&self) -> &str {
        self.gate_up.label()
    }

    fn check(&self) -> Result<()> {
        let op = self.gate.backward_name();
        ensure_float(op, &[self.gate_up, self.dout])?;
        check(op, self.dout, self.gate_up, &[]).map(drop)
    }

    fn flops(&self) -> u64 {
        each(self.dout.numel(), self.gate.flops().1)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::backward_in_place(self.gate, self.gate_up, self.dout);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward_in_place(be, self.gate, self.gate_up, self.dout)
    }
}

/// Checks the operands (the contract every backend shares): `gate_up` has the rows of
/// `out` and twice its columns, and `others` are shaped as `out` or as `gate_up` (their
/// element counts are compared). Returns `F`.
fn check(op: &'static str, out: &Tensor, gate_up: &Tensor, others: &[&Tensor]) -> Result<usize> {
    let (rows, f) = out.rows_cols();
    let (rows2, f2) = gate_up.rows_cols();
    ensure(rows == rows2 && f2 == 2 * f, op, || {
        format!(
            "`{}` {:?} must hold the gate and up projections of `{}` {:?} side by side \
             ([.., 2F] for [.., F])",
            gate_up.label(),
            gate_up.shape(),
            out.label(),
            out.shape()
        )
    })?;
    for t in others {
        ensure(
            t.numel() == out.numel() || t.numel() == gate_up.numel(),
            op,
            || {
                format!(
                    "`{}` {:?} matches neither `{}` nor `{}`",
                    t.label(),
                    t.shape(),
                    out.label(),
                    gate_up.label()
                )
            },
        )?;
    }
    Ok(f)
}

/// `out = act(gate) · up` from a fused `[.., 2F]` projection holding the gate in its first
/// `F` columns and the up projection in its last `F` (see [`forward`]).
///
/// Input: `gate_up`. Output: `out` (`[.., F]`). Backward reads `gate_up`, and writes its
/// gradient into `gate_up`'s buffer when it is that buffer's last reader (the
/// `[.., 2F]` gradient then takes no memory of its own).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Glu {
    /// The gate's activation.
    pub gate: Gate,
}

impl Glu {
    /// SwiGLU (Llama, Qwen): `silu(gate) · up`.
    pub const SWIGLU: Glu = Glu { gate: Gate::Silu };
    /// GeGLU (Gemma): `gelu(gate) · up`.
    pub const GEGLU: Glu = Glu { gate: Gate::Gelu };
}

impl Op for Glu {
    fn name(&self) -> &'static str {
        self.gate.name()
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
                    self.gate.name(),
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
        forward(cx.backend, self.gate, &mut out, cx.input(0)?)?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let (be, gate) = (cx.backend, self.gate);
        let dout = cx.take_grad_out(0)?;
        // The last reader of `gate_up`, with no gradient of it yet: the gradient takes
        // its buffer.
        if cx.grads_in[0].tensor.is_none() {
            if let Saved::Owned(_) = cx.inputs[0] {
                if let Saved::Owned(mut t) = std::mem::replace(&mut cx.inputs[0], Saved::None) {
                    backward_in_place(be, gate, &mut t, &dout)?;
                    cx.grads_in[0].tensor = Some(t);
                    return Ok(());
                }
            }
        }
        let gate_up = cx.inputs[0].get()?;
        cx.grads_in[0].overwrite(be, |dgu| backward(be, gate, dgu, &dout, gate_up))?;
        cx.inputs[0].release();
        Ok(())
    }
}
