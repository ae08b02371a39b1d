//! Layer normalization with a gain and a bias (GPT-2's).

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

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
        cx.backend.layernorm(
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
        be.layernorm_backward(
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
