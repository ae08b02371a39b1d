//! Causal self-attention over a fused q, k, v projection, with the probabilities
//! materialized (`[B, H, T, T]`): multi-head, grouped-query and multi-query alike.

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::attention::{dims, Dims};
use crate::device::Heads;
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};

/// Causal attention: `out = softmax(q·kᵀ/√D, causal) · v` per query head, with the key
/// and value head it shares, from `qkv` `[B, T, (H + 2·KV)·D]` laid out as [`Heads`] says.
///
/// Input: `qkv`. Outputs: `probs` (`[B, H, T, T]`, grows with T²) and `out`
/// (`[B, T, H·D]`).
/// The scores are a transient of the forward. Backward reads `qkv` and `probs`; a policy
/// that drops the probabilities has them recomputed from `qkv` alone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalAttention {
    /// The query, key and value heads.
    pub heads: Heads,
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
        let h = self.heads;
        let Dims { b, t, .. } = dims(inputs[0], h, "attention")?;
        Ok(vec![
            (vec![b, h.n_head, t, t], dtype),
            (vec![b, t, h.q_width()], dtype),
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
            be.attention_scores(&mut scores, qkv, self.heads)?;
            let mut probs = cx.alloc(0)?;
            be.softmax_causal(&mut probs, &scores)?;
            drop(scores);
            cx.outputs[0] = Some(probs);
        }
        if cx.wanted[1] {
            let mut out = cx.alloc(1)?;
            be.attention_values(&mut out, cx.output(0)?, qkv, self.heads)?;
            cx.outputs[1] = Some(out);
        }
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let heads = self.heads;
        let datt = cx.take_grad_out(1)?;
        let qkv = cx.inputs[0].get()?;
        let probs = cx.outputs[0].get()?;
        let (shape, dtype) = (probs.shape().to_vec(), probs.dtype());
        let dprobs_label = &cx.grad_labels_out[0];
        let dscores_label = format!("{}.d_attn_scores", scope(dprobs_label));
        cx.grads_in[0].overwrite(be, |dqkv| {
            let act = |label: &str| be.empty(&shape, dtype, MemoryCategory::Activations, label);
            let mut dprobs = act(dprobs_label)?;
            be.attention_values_backward(&mut dprobs, dqkv, &datt, probs, qkv, heads)?;
            drop(datt);
            let mut dscores = act(&dscores_label)?;
            be.softmax_causal_backward(&mut dscores, &dprobs, probs)?;
            drop(dprobs);
            be.attention_scores_backward(dqkv, &dscores, qkv, heads)
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
