//! Fused causal attention: the output and one log-sum-exp per query row, never a
//! `[B, H, T, T]` tensor; and the choice between it and the materialized attention.

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::attention::{dims, Dims};
use crate::device::Heads;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// How a model's layers compute causal attention: fused ([`FlashAttention`], the
/// default: tiles with an online softmax, memory linear in T) or materialized
/// ([`super::CausalAttention`]: the `[B, H, T, T]` probabilities kept for backward, the
/// reference the fused one is tested against).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionPath {
    /// Tiles with an online softmax; backward recomputes the probabilities tile by tile.
    #[default]
    Fused,
    /// The scores and probabilities as `[B, H, T, T]` tensors.
    Materialized,
}

impl AttentionPath {
    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            AttentionPath::Fused => "fused",
            AttentionPath::Materialized => "materialized",
        }
    }

    /// The path named `name` (`fused` or `materialized`); an error naming `field` and the
    /// allowed values otherwise.
    pub fn parse(field: &str, name: &str) -> Result<Self> {
        match name {
            "fused" => Ok(AttentionPath::Fused),
            "materialized" => Ok(AttentionPath::Materialized),
            other => Err(Error::config(
                field,
                format!("`{other}` is not an attention path; use `fused` or `materialized`"),
            )),
        }
    }
}

impl std::fmt::Display for AttentionPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Fused causal attention ([`crate::Backend::flash_attention`]): `out = softmax(q·kᵀ/√D,
/// causal) · v` per query head, with the key and value head it shares, from `qkv`
/// `[B, T, (H + 2·KV)·D]` laid out as [`Heads`] says.
///
/// Input: `qkv`. Outputs: `lse` (`[B, H, T]`, f32: each query row's log-sum-exp, linear
/// in T) and `out` (`[B, T, H·D]`). Backward reads `qkv`, `lse` and `out` and recomputes
/// the probabilities tile by tile; a policy that drops `lse` or `out` has them recomputed
/// from `qkv` by rerunning the forward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashAttention {
    /// The query, key and value heads.
    pub heads: Heads,
}

impl Op for FlashAttention {
    fn name(&self) -> &'static str {
        "flash_attention"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let h = self.heads;
        let Dims { b, t, .. } = dims(inputs[0], h, "flash_attention")?;
        Ok(vec![
            (vec![b, h.n_head, t], DType::F32),
            (vec![b, t, h.q_width()], dtype),
        ])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0b11,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        // One pass computes both outputs; when only one is wanted (recomputation), the
        // other is computed and dropped.
        let qkv = cx.input(0)?;
        let mut lse = cx.alloc(0)?;
        let mut out = cx.alloc(1)?;
        cx.backend
            .flash_attention(&mut out, &mut lse, qkv, self.heads)?;
        if cx.wanted[0] && cx.present[0].is_none() {
            cx.outputs[0] = Some(lse);
        }
        if cx.wanted[1] && cx.present[1].is_none() {
            cx.outputs[1] = Some(out);
        }
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let heads = self.heads;
        let dout = cx.take_grad_out(1)?;
        let qkv = cx.inputs[0].get()?;
        let lse = cx.outputs[0].get()?;
        let out = cx.outputs[1].get()?;
        cx.grads_in[0].overwrite(be, |dqkv| {
            be.flash_attention_backward(dqkv, &dout, out, lse, qkv, heads)
        })?;
        drop(dout);
        cx.outputs[0].release();
        cx.outputs[1].release();
        cx.inputs[0].release();
        Ok(())
    }
}
