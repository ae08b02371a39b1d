//! Token and learned position embeddings (GPT-2's input).

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`, `[B, T, C]`.
///
/// No activation inputs (it reads the batch's tokens). Parameters: wte `[V, C]`, wpe
/// `[P, C]`. Output: `out`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LearnedEmbedding;

impl Op for LearnedEmbedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn output_shapes(
        &self,
        _inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        [b, t]: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let (_, c) = weights
            .first()
            .map(|w| w.rows_cols())
            .ok_or_else(|| Error::shape("embedding", "needs the token embedding"))?;
        Ok(vec![(vec![b, t, c], dtype)])
    }

    fn saves(&self) -> Saves {
        Saves::default()
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut out = cx.alloc(0)?;
        cx.backend
            .embedding(&mut out, cx.tokens, cx.weights[0], Some(cx.weights[1]))?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        cx.params[1].grad_mut(be)?;
        let (wte, wpe) = cx.params.split_at_mut(1);
        let dwte = wte[0].grad_mut(be)?;
        let dwpe = wpe[0].grad_mut(be)?;
        be.embedding_backward(dwte, Some(dwpe), &dout, cx.tokens)
    }
}
