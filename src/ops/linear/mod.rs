//! Linear projections: plain, with a residual added, and with a GELU after them; and the
//! fused products they run ([`matmul_bias_gelu`], [`weight_bias_grad`]).

mod fused;

pub use fused::{matmul_bias_gelu, weight_bias_grad};

use super::gelu;
use super::{linear_backward, BackwardCx, ForwardCx, GradIn, Op, Saves};
use crate::device::Backend;
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::param::Param;
use crate::tensor::{DType, Tensor};

/// Output columns of `x · op(W)`, and the output shape: `x`'s leading dimensions and them.
pub(crate) fn product_shape(x: &Tensor, w: &Tensor, transposed: bool) -> Vec<usize> {
    let (rows, cols) = w.rows_cols();
    let n = if transposed { rows } else { cols };
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    shape
}

/// `dx (+)= dy · op(W)ᵀ`: the input's gradient of `y = x · op(W) (+ b)`, written into
/// `dx` when new, added to it otherwise.
pub(crate) fn input_grad(
    be: &dyn Backend,
    w: &Tensor,
    dy: &Tensor,
    dx: &mut GradIn,
    transposed: bool,
) -> Result<()> {
    let (buf, fresh) = dx.buffer(be)?;
    be.matmul(buf, dy, w, None, false, !transposed, !fresh)
}

/// The parameter gradients of `y = x · op(W) (+ b)` for those that train: `dW += op(x)ᵀ ·
/// dy` and `db += Σ dy` as one call ([`weight_bias_grad`]) when both train, one of them
/// otherwise, nothing for a frozen projection.
pub(crate) fn param_grads(
    be: &dyn Backend,
    w: &mut Param,
    bias: Option<&mut Param>,
    x: &Tensor,
    dy: &Tensor,
    transposed: bool,
) -> Result<()> {
    let bias = bias.filter(|b| b.trains());
    match (w.trains(), bias) {
        (true, Some(b)) => {
            let dw = w.grad_mut(be)?;
            weight_bias_grad(be, dw, b.grad_mut(be)?, x, dy, transposed)
        }
        (true, None) if transposed => be.matmul(w.grad_mut(be)?, dy, x, None, true, false, true),
        (true, None) => be.matmul(w.grad_mut(be)?, x, dy, None, true, false, true),
        (false, Some(b)) => be.bias_backward(b.grad_mut(be)?, dy),
        (false, None) => Ok(()),
    }
}

/// `x · op(W) (+ b)` into a new buffer for output `i`: the product every projection here
/// starts with (`W` is `weights[0]`, `b` is `weights[1]` when `bias`).
pub(crate) fn project(
    cx: &ForwardCx<'_>,
    i: usize,
    x: &Tensor,
    bias: bool,
    transposed: bool,
) -> Result<Tensor> {
    let mut y = cx.alloc(i)?;
    let b = bias.then(|| cx.weights[1]);
    cx.backend
        .matmul(&mut y, x, cx.weights[0], b, false, transposed, false)?;
    Ok(y)
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
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        Ok(vec![(
            product_shape(inputs[0], weights[0], self.transposed),
            dtype,
        )])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let y = project(cx, 0, cx.input(0)?, self.bias, self.transposed)?;
        cx.outputs[0] = Some(y);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let dy = cx.take_grad_out(0)?;
        linear_backward(
            cx.backend,
            &mut cx.params,
            cx.inputs[0].get()?,
            &dy,
            Some(&mut cx.grads_in[0]),
            self.transposed,
        )?;
        cx.inputs[0].release();
        drop(dy);
        Ok(())
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
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        Ok(vec![(inputs[0].shape().to_vec(), dtype)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b10,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut y = project(cx, 0, cx.input(1)?, self.bias, self.transposed)?;
        cx.backend.axpy(&mut y, 1.0, cx.input(0)?)?;
        cx.outputs[0] = Some(y);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dy = cx.take_grad_out(0)?;
        linear_backward(
            be,
            &mut cx.params,
            cx.inputs[1].get()?,
            &dy,
            Some(&mut cx.grads_in[1]),
            self.transposed,
        )?;
        cx.inputs[1].release();
        cx.grads_in[0].add(be, dy)
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
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let shape = product_shape(inputs[0], weights[0], self.transposed);
        Ok(vec![(shape.clone(), dtype), (shape, dtype)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0b1,
        }
    }

    fn inputs_needed(&self, wanted: &[bool], present: &[bool]) -> u32 {
        // The GELU alone, from a pre-activation that is still there, needs no input.
        if !wanted[0] && present[0] {
            0
        } else {
            u32::MAX
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let (want_pre, want_out) = (cx.wanted[0], cx.wanted[1]);
        if want_out && !want_pre {
            if let Some(pre) = cx.present[0] {
                let mut out = cx.alloc(1)?;
                gelu::forward(be, &mut out, pre)?;
                cx.outputs[1] = Some(out);
                return Ok(());
            }
        }
        let x = cx.input(0)?;
        if !want_out || self.transposed {
            // The product alone (and its GELU as an op of its own where the weights are
            // stored [out, in], which the fused epilogue does not take).
            let pre = project(cx, 0, x, true, self.transposed)?;
            if want_out {
                let mut out = cx.alloc(1)?;
                gelu::forward(be, &mut out, &pre)?;
                cx.outputs[1] = Some(out);
            }
            cx.outputs[0] = Some(pre);
            return Ok(());
        }
        let mut pre = cx.alloc(0)?;
        let mut out = cx.alloc(1)?;
        matmul_bias_gelu(be, &mut out, &mut pre, x, cx.weights[0], cx.weights[1])?;
        cx.outputs[0] = Some(pre);
        cx.outputs[1] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(1)?;
        let pre = cx.outputs[0].get()?;
        let (shape, dtype) = (pre.shape().to_vec(), pre.dtype());
        let mut dpre = be.empty(
            &shape,
            dtype,
            MemoryCategory::Activations,
            &cx.grad_labels_out[0],
        )?;
        gelu::backward(be, &mut dpre, pre, &dout)?;
        cx.outputs[0].release();
        drop(dout);
        linear_backward(
            be,
            &mut cx.params,
            cx.inputs[0].get()?,
            &dpre,
            Some(&mut cx.grads_in[0]),
            self.transposed,
        )?;
        cx.inputs[0].release();
        drop(dpre);
        Ok(())
    }
}
