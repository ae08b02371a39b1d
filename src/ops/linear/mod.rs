//! Linear projections: plain, with a residual added, and with a GELU after them; and the
//! fused products they run ([`matmul_bias_gelu`], [`weight_bias_grad`]).

pub(crate) mod fused;
pub(crate) mod product;

pub use fused::{matmul_bias_gelu, weight_bias_grad};

use super::lora::{Base, LoraProjection};
use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

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
