//! Causal self-attention over a fused q, k, v projection, with the probabilities
//! materialized (`[B, H, T, T]`).

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};

/// Multi-head causal attention: `out = softmax(q·kᵀ/√d, causal) · v` per head, from `qkv`
/// `[B, T, 3C]` (q, k, v blocks, heads contiguous in each).
///
/// Input: `qkv`. Outputs: `probs` (`[B, H, T, T]`, grows with T²) and `out` (`[B, T, C]`).
/// The scores are a transient of the forward. Backward reads `qkv` and `probs`; a policy
/// that drops the probabilities has them recomputed from `qkv` alone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalAttention {
    /// Attention heads.
    pub n_head: usize,
}

impl Op for CausalAttention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let qkv = inputs[0];
        let [b, t, c3] = *qkv.shape() else {
            return Err(Error::shape(
                "attention",
                format!(
                    "`{}` must be [B, T, 3C], it is {:?}",
                    qkv.label(),
                    qkv.shape()
                ),
            ));
        };
        Ok(vec![
            (vec![b, self.n_head, t, t], dtype),
            (vec![b, t, c3 / 3], dtype),
        ])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0b1,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let qkv = cx.input(0)?;
        if cx.present[0].is_none() {
            let (shape, dtype) = &cx.shapes[0];
            let label = format!("{}.attn_scores", scope(&cx.labels[0]));
            let mut scores = be.empty(shape, *dtype, MemoryCategory::Activations, &label)?;
            be.attention_scores(&mut scores, qkv, self.n_head)?;
            let mut probs = cx.alloc(0)?;
            be.softmax_causal(&mut probs, &scores)?;
            drop(scores);
            cx.outputs[0] = Some(probs);
        }
        if cx.wanted[1] {
            let mut out = cx.alloc(1)?;
            be.attention_values(&mut out, cx.output(0)?, qkv, self.n_head)?;
            cx.outputs[1] = Some(out);
        }
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let n_head = self.n_head;
        let datt = cx.take_grad_out(1)?;
        let qkv = cx.inputs[0].get()?;
        let probs = cx.outputs[0].get()?;
        let (shape, dtype) = (probs.shape().to_vec(), probs.dtype());
        let dprobs_label = &cx.grad_labels_out[0];
        let dscores_label = format!("{}.d_attn_scores", scope(dprobs_label));
        cx.grads_in[0].overwrite(be, |dqkv| {
            let act = |label: &str| be.empty(&shape, dtype, MemoryCategory::Activations, label);
            let mut dprobs = act(dprobs_label)?;
            be.attention_values_backward(&mut dprobs, dqkv, &datt, probs, qkv, n_head)?;
            drop(datt);
            let mut dscores = act(&dscores_label)?;
            be.softmax_causal_backward(&mut dscores, &dprobs, probs)?;
            drop(dprobs);
            be.attention_scores_backward(dqkv, &dscores, qkv, n_head)
        })?;
        cx.outputs[0].release();
        cx.inputs[0].release();
        Ok(())
    }
}

/// The scope of a label, `h.3` of `h.3.attn_probs`: the transient scores are named in it.
fn scope(label: &str) -> &str {
    label.rsplit_once('.').map_or("", |(scope, _)| scope)
}
