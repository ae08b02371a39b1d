//! The pieces every linear projection is made of: the product into an output, its
//! shape, the input's gradient and the parameters' (for those that train).

use super::fused::weight_bias_grad;
use crate::device::Backend;
use crate::error::Result;
use crate::ops::nf4;
use crate::ops::ParamGrad;
use crate::ops::{ForwardCx, GradIn};
use crate::tensor::Tensor;

/// Output columns of `x · op(W)`, and the output shape: `x`'s leading dimensions and them.
pub(crate) fn product_shape(x: &Tensor, w: &Tensor, transposed: bool) -> Vec<usize> {
    let (rows, cols) = w.rows_cols();
    with_width(x.shape(), if transposed { rows } else { cols })
}

/// `shape` with its last dimension (the width of a row) set to `width`.
pub(crate) fn with_width(shape: &[usize], width: usize) -> Vec<usize> {
    let mut shape = shape.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = width;
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
    weight_product(be, buf, dy, w, None, !transposed, !fresh)
}

/// `out (+)= a · op(W) (+ bias)` for a projection's weight `W` (`op(W) = Wᵀ` when
/// `transposed`): the backend's `matmul`, or the dequantizing product for an NF4 `W`.
pub(crate) fn weight_product(
    be: &dyn Backend,
    out: &mut Tensor,
    a: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    transposed: bool,
    accumulate: bool,
) -> Result<()> {
    if w.dtype().is_nf4() {
        nf4::matmul(be, out, a, w, bias, transposed, accumulate)
    } else {
        be.matmul(out, a, w, bias, false, transposed, accumulate)
    }
}

/// The parameter gradients of `y = x · op(W) (+ b)` for those that train: `dW += op(x)ᵀ ·
/// dy` and `db += Σ dy` as one call ([`weight_bias_grad`]) when both train, one of them
/// otherwise, nothing for a frozen projection.
pub(crate) fn param_grads(
    be: &dyn Backend,
    w: &mut ParamGrad<'_>,
    bias: Option<&mut ParamGrad<'_>>,
    x: &Tensor,
    dy: &Tensor,
    transposed: bool,
) -> Result<()> {
    let bias = bias.filter(|b| b.wants_grad());
    match (w.wants_grad(), bias) {
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
/// starts with (`W` is `weights[0]`, `b` is `weights[1]` when `bias`); an NF4 `W` goes
/// through the dequantizing product ([`nf4::matmul`]).
pub(crate) fn project(
    cx: &ForwardCx<'_>,
    i: usize,
    x: &Tensor,
    bias: bool,
    transposed: bool,
) -> Result<Tensor> {
    let mut y = cx.alloc(i)?;
    let b = bias.then(|| cx.weights[1]);
    weight_product(cx.backend, &mut y, x, cx.weights[0], b, transposed, false)?;
    Ok(y)
}
