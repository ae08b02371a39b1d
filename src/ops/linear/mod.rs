//! Linear projections: plain, with a residual added, with a GELU after them, and with a
//! residual added to the projection of a GELU's output; and the fused products they run
//! ([`matmul_bias_gelu`], [`matmul_residual`], [`matmul_dgelu`], [`weight_bias_grad`]).

pub(crate) mod fused;
pub(crate) mod product;

pub use fused::{matmul_bias_gelu, matmul_dgelu, matmul_residual, weight_bias_grad};

use super::lora::{Base, LoraProjection};
use super::{missing, BackwardCx, ForwardCx, Op, Saves};
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};
use product::param_grads;

/// The three nodes here are [`LoraProjection`]s without updates whose base trains: one
/// implementation of the product, its GELU and their backward serves all of them.
fn projection(base: Base, bias: bool, transposed: bool) -> LoraProjection {
    LoraProjection {
        base,
        bias,
        transposed,
        base_trains: true,
        adapters: Vec::new(),
    }
}

/// `y = x · op(W) (+ b)`: with `transposed`, `W` is stored `[out, in]` (PyTorch's
/// `Linear`, Llama), otherwise `[in, out]` (GPT-2's `Conv1D`).
///
/// Input: `x`. Parameters: `W`, then `b` when `bias`. Output: `y`. Backward reads `x`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Linear {
    /// Whether a bias parameter follows the weight.
    pub bias: bool,
    /// Whether the weight is stored `[out, in]`.
    pub transposed: bool,
}

impl Op for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        projection(Base::Linear, self.bias, self.transposed)
            .output_shapes(inputs, weights, dtype, batch)
    }

    fn saves(&self) -> Saves {
        projection(Base::Linear, self.bias, self.transposed).saves()
    }

    fn inputs_needed(&self, wanted: &[bool], present: &[bool]) -> u32 {
        projection(Base::Linear, self.bias, self.transposed).inputs_needed(wanted, present)
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        projection(Base::Linear, self.bias, self.transposed).forward(cx)
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        projection(Base::Linear, self.bias, self.transposed).backward(cx)
    }
}

/// `y = residual + x · op(W) (+ b)`: a block's output projection added to the residual
/// stream, in one output buffer.
///
/// Inputs: `residual`, `x`. Parameters: `W`, then `b` when `bias`. Output: `y`.
/// Backward reads `x`; the residual's gradient is `y`'s, passed through.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearResidual {
    /// Whether a bias parameter follows the weight.
    pub bias: bool,
    /// Whether the weight is stored `[out, in]`.
    pub transposed: bool,
}

impl Op for LinearResidual {
    fn name(&self) -> &'static str {
        "linear_residual"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        projection(Base::Residual, self.bias, self.transposed)
            .output_shapes(inputs, weights, dtype, batch)
    }

    fn saves(&self) -> Saves {
        projection(Base::Residual, self.bias, self.transposed).saves()
    }

    fn inputs_needed(&self, wanted: &[bool], present: &[bool]) -> u32 {
        projection(Base::Residual, self.bias, self.transposed).inputs_needed(wanted, present)
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        projection(Base::Residual, self.bias, self.transposed).forward(cx)
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        projection(Base::Residual, self.bias, self.transposed).backward(cx)
    }
}

/// `pre = x · op(W) + b` and `out = gelu(pre)` (tanh approximation): the first layer of
/// GPT-2's MLP, run as one op ([`matmul_bias_gelu`]).
///
/// Input: `x`. Parameters: `W`, `b`. Outputs: `pre`, `out`. Backward reads `x` and
/// `pre`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearGelu {
    /// Whether the weight is stored `[out, in]`.
    pub transposed: bool,
}

impl Op for LinearGelu {
    fn name(&self) -> &'static str {
        "linear_gelu"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        projection(Base::Gelu, true, self.transposed).output_shapes(inputs, weights, dtype, batch)
    }

    fn saves(&self) -> Saves {
        projection(Base::Gelu, true, self.transposed).saves()
    }

    fn inputs_needed(&self, wanted: &[bool], present: &[bool]) -> u32 {
        projection(Base::Gelu, true, self.transposed).inputs_needed(wanted, present)
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        projection(Base::Gelu, true, self.transposed).forward(cx)
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        projection(Base::Gelu, true, self.transposed).backward(cx)
    }
}

/// `y = residual + act · op(W) (+ b)` where `act = gelu(pre)`: GPT-2's MLP output
/// projection, reading the GELU's input beside its output so that backward carries the
/// input gradient through the GELU in the same product ([`matmul_dgelu`]: cuBLASLt's
/// `DGELU` epilogue on a GPU). `pre` receives the gradient, `act` none: the gradient of
/// the GELU's output is never a tensor, and [`LinearGelu`]'s backward takes `pre`'s as it
/// comes. The values are those of [`LinearResidual`] followed by the GELU's backward.
///
/// Inputs: `residual`, `act`, `pre`. Parameters: `W`, then `b` when `bias`. Output: `y`.
/// Backward reads `act` (for `W`'s gradient) and `pre`; the residual's gradient is `y`'s,
/// passed through.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeluLinearResidual {
    /// Whether a bias parameter follows the weight.
    pub bias: bool,
    /// Whether the weight is stored `[out, in]`.
    pub transposed: bool,
}

impl GeluLinearResidual {
    fn base(&self) -> LoraProjection {
        projection(Base::Residual, self.bias, self.transposed)
    }
}

impl Op for GeluLinearResidual {
    fn name(&self) -> &'static str {
        "gelu_linear_residual"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        self.base().output_shapes(inputs, weights, dtype, batch)
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b110,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        self.base().forward(cx)
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        if cx.params.len() < 1 + usize::from(self.bias) || cx.grads_in.len() < 3 {
            return Err(missing("the weight or an input of a linear layer"));
        }
        let dy = cx.take_grad_out(0)?;
        let pre = cx.inputs[2].get()?;
        let w = cx.params[0].weight();
        let (buf, fresh) = cx.grads_in[2].buffer(be)?;
        if fresh {
            matmul_dgelu(be, buf, &dy, w, pre, !self.transposed)?;
        } else {
            // Another reader of `pre` gave it a gradient already: add this one to it.
            let mut part = be.empty(
                pre.shape(),
                pre.dtype(),
                MemoryCategory::Activations,
                &cx.grads_in[2].label,
            )?;
            matmul_dgelu(be, &mut part, &dy, w, pre, !self.transposed)?;
            let (buf, _) = cx.grads_in[2].buffer(be)?;
            be.axpy(buf, 1.0, &part)?;
        }
        cx.inputs[2].release();
        let (w, rest) = cx.params.split_at_mut(1);
        let bias = if self.bias { Some(&mut rest[0]) } else { None };
        param_grads(
            be,
            &mut w[0],
            bias,
            cx.inputs[1].get()?,
            &dy,
            self.transposed,
        )?;
        cx.inputs[1].release();
        cx.grads_in[0].add(be, dy)
    }
}
