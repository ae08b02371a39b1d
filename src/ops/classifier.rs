//! The classifier: hidden states to logits over the vocabulary.

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `logits = x · Wᵀ`, `[rows, V]`, with `W` `[V, C]` (the token embedding when tied, as
/// in GPT-2, or its own head).
///
/// Input: `x`. Parameter: `W`. Output: `logits`. Backward reads `x`; the gradient of the
/// logits is written over them by the loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Classifier;

impl Op for Classifier {
    fn name(&self) -> &'static str {
        "classifier"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let (rows, _) = inputs[0].rows_cols();
        let (vocab, _) = weights[0].rows_cols();
        Ok(vec![(vec![rows, vocab], dtype)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut logits = cx.alloc(0)?;
        cx.backend.matmul(
            &mut logits,
            cx.input(0)?,
            cx.weights[0],
            None,
            false,
            true,
            false,
        )?;
        cx.outputs[0] = Some(logits);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dlogits = cx.take_grad_out(0)?;
        let (dx, fresh) = cx.grads_in[0].buffer(be)?;
        be.matmul(
            dx,
            &dlogits,
            cx.params[0].weight(),
            None,
            false,
            false,
            !fresh,
        )?;
        let x = cx.inputs[0].get()?;
        if !cx.params[0].wants_grad() {
            drop(dlogits);
            cx.inputs[0].release();
            return Ok(());
        }
        be.matmul(
            cx.params[0].grad_mut(be)?,
            &dlogits,
            x,
            None,
            true,
            false,
            true,
        )?;
        drop(dlogits);
        cx.inputs[0].release();
        Ok(())
    }
}
