//! Layer normalization with a gain and a bias (GPT-2's): `out = (x − mean) · rstd · weight
//! + bias` over each row, statistics in f32.
//!
//! The family: the graph node [`LayerNorm`], the kernel calls [`forward`] and [`backward`]
//! with their operand checks and FLOP counts, the CPU twin (`cpu.rs`) and the CUDA launches
//! (`cuda.rs`, over `kernels/layernorm.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{each, ensure, ensure_f32, ensure_float, ensure_shape};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Floating-point operations per element of the forward and of the backward.
const FLOPS: u64 = 8;
const FLOPS_BACKWARD: u64 = 19;

/// Layer normalization of each row of `x`: `out = (x - mean) · rstd · weight + bias`,
/// statistics in f32, written to `stats` as `[rows, 2]` = (mean, rstd).
pub fn forward(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    stats: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
) -> Result<()> {
    be.run(&mut Forward {
        out,
        stats,
        x,
        weight,
        bias,
        eps,
    })
}

/// Backward of [`forward`]: accumulates into `dx`, `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dbias: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    stats: &Tensor,
) -> Result<()> {
    be.run(&mut Backward {
        dx,
        dweight,
        dbias,
        dout,
        x,
        weight,
        stats,
    })
}

struct Forward<'a> {
    out: &'a mut Tensor,
    stats: &'a mut Tensor,
    x: &'a Tensor,
    weight: &'a Tensor,
    bias: &'a Tensor,
    eps: f32,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "layernorm"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        let (out, stats) = (&*self.out, &*self.stats);
        ensure_float("layernorm", &[out, stats, self.x, self.weight, self.bias])?;
        check_forward(out, stats, self.x, self.weight, self.bias).map(drop)
    }

    fn flops(&self) -> u64 {
        each(self.x.numel(), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(
            self.out,
            self.stats,
            self.x,
            self.weight,
            self.bias,
            self.eps,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let (out, stats) = (&mut *self.out, &mut *self.stats);
        cuda::forward(be, out, stats, self.x, self.weight, self.bias, self.eps)
    }
}

struct Backward<'a> {
    dx: &'a mut Tensor,
    dweight: &'a mut Tensor,
    dbias: &'a mut Tensor,
    dout: &'a Tensor,
    x: &'a Tensor,
    weight: &'a Tensor,
    stats: &'a Tensor,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "layernorm_backward"
    }

    fn label(&self) -> &str {
        self.dx.label()
    }

    fn check(&self) -> Result<()> {
        let (dx, dw, db) = (&*self.dx, &*self.dweight, &*self.dbias);
        let (dout, x, w, stats) = (self.dout, self.x, self.weight, self.stats);
        ensure_float("layernorm_backward", &[dx, dw, db, dout, x, w, stats])?;
        check_backward(dx, dw, db, dout, x, w, stats).map(drop)
    }

    fn flops(&self) -> u64 {
        each(self.x.numel(), FLOPS_BACKWARD)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let (dx, dw, db) = (&mut *self.dx, &mut *self.dweight, &mut *self.dbias);
        cpu::backward(dx, dw, db, self.dout, self.x, self.weight, self.stats)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let (dx, dw, db) = (&mut *self.dx, &mut *self.dweight, &mut *self.dbias);
        cuda::backward(be, dx, dw, db, self.dout, self.x, self.weight, self.stats)
    }
}

/// Checks `layernorm`'s operands (the contract every backend shares) and returns
/// `(rows, C)`.
pub(crate) fn check_forward(
    out: &Tensor,
    stats: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<(usize, usize)> {
    let (rows, c) = x.rows_cols();
    ensure_shape(out, x.shape(), "layernorm")?;
    ensure_shape(stats, &[rows, 2], "layernorm")?;
    ensure_f32(stats, "layernorm")?;
    ensure(
        weight.numel() == c && bias.numel() == c,
        "layernorm",
        || format!("weight and bias must have {c} elements"),
    )?;
    Ok((rows, c))
}

/// Checks `layernorm_backward`'s operands (the contract every backend shares) and
/// returns `(rows, C)`.
pub(crate) fn check_backward(
    dx: &Tensor,
    dweight: &Tensor,
    dbias: &Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    stats: &Tensor,
) -> Result<(usize, usize)> {
    let (rows, c) = x.rows_cols();
    ensure_shape(dx, x.shape(), "layernorm_backward")?;
    ensure_shape(dout, x.shape(), "layernorm_backward")?;
    ensure_shape(stats, &[rows, 2], "layernorm_backward")?;
    ensure(
        weight.numel() == c && dweight.numel() == c && dbias.numel() == c,
        "layernorm_backward",
        || format!("weight, dweight and dbias must have {c} elements"),
    )?;
    Ok((rows, c))
}

/// `out = (x − mean) · rstd · weight + bias` over each row, statistics in f32.
///
/// Input: `x`. Parameters: weight, bias. Outputs: `out` (the compute dtype) and `stats`
/// (`[rows, 2]` f32: mean and reciprocal standard deviation). Backward reads `x` and
/// `stats`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm {
    /// Added to the variance.
    pub eps: f32,
}

impl Op for LayerNorm {
    fn name(&self) -> &'static str {
        "layernorm"
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
        Ok(vec![
            (x.shape().to_vec(), dtype),
            (vec![rows, 2], DType::F32),
        ])
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
        let mut stats = cx.alloc(1)?;
        forward(
            cx.backend,
            &mut out,
            &mut stats,
            x,
            cx.weights[0],
            cx.weights[1],
            self.eps,
        )?;
        cx.outputs[0] = Some(out);
        cx.outputs[1] = Some(stats);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let dx = cx.grads_in[0].accumulate(be)?;
        // The bias gradient first, then the weight's, as the parameters' first use.
        cx.params[1].grad_mut(be)?;
        let (w, b) = cx.params.split_at_mut(1);
        let (weight, dweight) = w[0].weight_and_grad(be)?;
        let dbias = b[0].grad_mut(be)?;
        backward(
            be,
            dx,
            dweight,
            dbias,
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
