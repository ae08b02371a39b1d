//! RMS normalization (Llama's norm): `out = x · rstd · weight` over each row, with
//! `rstd = 1/√(mean(x²) + eps)` in f32, saved as `[rows]` f32 for backward.
//!
//! The family: the graph node [`RmsNorm`], the two kernel calls ([`forward`] and
//! [`backward`]) with their operand checks and FLOP counts, the CPU twin (`cpu.rs`) and the
//! CUDA launches (`cuda.rs`, over `kernels/rmsnorm.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{each, ensure, ensure_f32, ensure_float, ensure_shape};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Floating-point operations per element of the forward and of the backward.
const FLOPS: u64 = 4;
const FLOPS_BACKWARD: u64 = 11;

/// Normalizes each row of `x` into `out` (the compute dtype) and writes each row's
/// reciprocal RMS to `rstd` (`[rows]` f32).
pub fn forward(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<()> {
    be.run(&mut Forward {
        out,
        rstd,
        x,
        weight,
        eps,
    })
}

/// Backward of [`forward`]: accumulates into `dx` and `dweight`.
pub fn backward(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<()> {
    be.run(&mut Backward {
        dx,
        dweight,
        dout,
        x,
        weight,
        rstd,
    })
}

/// The forward call of [`forward`].
struct Forward<'a> {
    out: &'a mut Tensor,
    rstd: &'a mut Tensor,
    x: &'a Tensor,
    weight: &'a Tensor,
    eps: f32,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "rmsnorm"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        let (out, rstd, x, weight) = (&*self.out, &*self.rstd, self.x, self.weight);
        ensure_float("rmsnorm", &[out, rstd, x, weight])?;
        let (rows, c) = x.rows_cols();
        ensure_shape(out, x.shape(), "rmsnorm")?;
        ensure_shape(rstd, &[rows], "rmsnorm")?;
        ensure_f32(rstd, "rmsnorm")?;
        ensure(weight.numel() == c, "rmsnorm", || {
            format!(
                "weight `{}` has {} elements for rows of {c}",
                weight.label(),
                weight.numel()
            )
        })
    }

    fn flops(&self) -> u64 {
        each(self.x.numel(), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(self.out, self.rstd, self.x, self.weight, self.eps)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(be, self.out, self.rstd, self.x, self.weight, self.eps)
    }
}

/// The backward call of [`backward`].
struct Backward<'a> {
    dx: &'a mut Tensor,
    dweight: &'a mut Tensor,
    dout: &'a Tensor,
    x: &'a Tensor,
    weight: &'a Tensor,
    rstd: &'a Tensor,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "rmsnorm_backward"
    }

    fn label(&self) -> &str {
        self.dx.label()
    }

    fn check(&self) -> Result<()> {
        let (dx, dweight, dout, x, weight, rstd) = (
            &*self.dx,
            &*self.dweight,
            self.dout,
            self.x,
            self.weight,
            self.rstd,
        );
        let op = "rmsnorm_backward";
        ensure_float(op, &[dx, dweight, dout, x, weight, rstd])?;
        let (rows, c) = x.rows_cols();
        ensure_shape(dx, x.shape(), op)?;
        ensure_shape(dout, x.shape(), op)?;
        ensure_shape(rstd, &[rows], op)?;
        ensure(weight.numel() == c && dweight.numel() == c, op, || {
            format!("weight and dweight must have {c} elements")
        })
    }

    fn flops(&self) -> u64 {
        each(self.x.numel(), FLOPS_BACKWARD)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::backward(
            self.dx,
            self.dweight,
            self.dout,
            self.x,
            self.weight,
            self.rstd,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward(
            be,
            self.dx,
            self.dweight,
            self.dout,
            self.x,
            self.weight,
            self.rstd,
        )
    }
}

/// `out = x · rstd · weight` over each row, with `rstd = 1/√(mean(x²) + eps)` in f32
/// (Llama's norm).
///
/// Input: `x`. Parameter: weight. Outputs: `out` (the compute dtype) and `rstd` (`[rows]`
/// f32). Backward reads `x` and `rstd`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm {
    /// Added to the mean square.
    pub eps: f32,
}

impl Op for RmsNorm {
    fn name(&self) -> &'static str {
        "rmsnorm"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let x = inputs[0];
        let (rows, _) = x.rows_cols();
        Ok(vec![(x.shape().to_vec(), dtype), (vec![rows], DType::F32)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0b10,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let x = cx.input(0)?;
        let mut out = cx.alloc(0)?;
        let mut rstd = cx.alloc(1)?;
        forward(cx.backend, &mut out, &mut rstd, x, cx.weights[0], self.eps)?;
        cx.outputs[0] = Some(out);
        cx.outputs[1] = Some(rstd);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let dx = cx.grads_in[0].accumulate(be)?;
        let (weight, dweight) = cx.params[0].weight_and_grad(be)?;
        backward(
            be,
            dx,
            dweight,
            &dout,
            cx.inputs[0].get()?,
            weight,
            cx.outputs[1].get()?,
        )?;
        cx.inputs[0].release();
        cx.outputs[1].release();
        drop(dout);
        Ok(())
    }
}

/// Gemma's RMS norm: `out = x · rstd · (1 + w)`, the gain stored as its offset from 1 (a
/// freshly initialised norm has `w = 0`). Composed from [`RmsNorm`]'s kernels with the
/// gain `1 + w` made for each call (a `[C]` workspace in the activations' dtype); its
/// gradient is the gain's.
///
/// Input: `x`. Parameter: `w`. Outputs: `out` (the compute dtype) and `rstd` (`[rows]`
/// f32). Backward reads `x` and `rstd`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OffsetRmsNorm {
    /// Added to the mean square.
    pub eps: f32,
}

/// The gain `1 + w` in `dtype`, a workspace of `w`'s length.
fn unit_offset(be: &dyn Backend, w: &Tensor, dtype: DType) -> Result<Tensor> {
    let mut gain = be.empty(
        w.shape(),
        dtype,
        crate::memory::MemoryCategory::Workspace,
        &format!("{}.plus_one", w.label()),
    )?;
    be.fill(&mut gain, 1.0)?;
    be.axpy(&mut gain, 1.0, w)?;
    Ok(gain)
}

impl Op for OffsetRmsNorm {
    fn name(&self) -> &'static str {
        "offset_rmsnorm"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        RmsNorm { eps: self.eps }.output_shapes(inputs, weights, dtype, batch)
    }

    fn saves(&self) -> Saves {
        RmsNorm { eps: self.eps }.saves()
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let x = cx.input(0)?;
        let gain = unit_offset(cx.backend, cx.weights[0], x.dtype())?;
        let mut out = cx.alloc(0)?;
        let mut rstd = cx.alloc(1)?;
        forward(cx.backend, &mut out, &mut rstd, x, &gain, self.eps)?;
        drop(gain);
        cx.outputs[0] = Some(out);
        cx.outputs[1] = Some(rstd);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let x = cx.inputs[0].get()?;
        let gain = unit_offset(be, cx.params[0].weight(), x.dtype())?;
        let dx = cx.grads_in[0].accumulate(be)?;
        let dweight = cx.params[0].grad_mut(be)?;
        backward(
            be,
            dx,
            dweight,
            &dout,
            cx.inputs[0].get()?,
            &gain,
            cx.outputs[1].get()?,
        )?;
        drop(gain);
        cx.inputs[0].release();
        cx.outputs[1].release();
        drop(dout);
        Ok(())
    }
}
