//! Causal self-attention over a fused q, k, v projection, with the probabilities
//! materialized (`[B, H, T, T]`): multi-head, grouped-query and multi-query alike, in three
//! steps (scores, softmax, values), each with its backward.
//!
//! `qkv` is `[B, T, (H + 2·KV)·D]` (see [`Heads`]): queries, then keys, then values, head
//! after head; query head `h` reads key and value head `h / (H / KV)`. Scores and
//! probabilities are `[B, H, T, T]` with zeros above the diagonal; the output is
//! `[B, T, H·D]`.
//!
//! The family: the graph node [`CausalAttention`], the six kernel calls ([`scores`],
//! [`softmax`], [`values`] and their backwards) with their operand checks (`check.rs`) and
//! FLOP counts, the CPU twin (`cpu.rs`) and the CUDA launches (`cuda.rs`, over
//! `kernels/attention.cu`).

mod check;
pub(crate) mod cpu;
pub(crate) mod cuda;
pub mod decode;
mod heads;

pub(crate) use check::{dims, square_side, Dims};

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::ensure_float;
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};
pub use heads::Heads;

/// Floating-point operations per causal entry of the softmax and of its backward.
const SOFTMAX_FLOPS: u64 = 5;
const SOFTMAX_BACKWARD_FLOPS: u64 = 4;

/// Floating-point operations of each attention op with these operands, as the kernels
/// execute them: products over whole row blocks of the causal triangle (`cpu.rs`, 2 per
/// multiply-add, plus 1 per output for the score scaling), 5 per causal entry for the
/// softmax (max, subtract, exp, sum, normalise) and 4 for its backward. Zero for shapes
/// the ops refuse.
pub(crate) struct AttentionFlops {
    pub scores: u64,
    pub scores_backward: u64,
    pub values: u64,
    pub values_backward: u64,
}

impl AttentionFlops {
    pub(crate) fn new(qkv: &Tensor, heads: Heads) -> AttentionFlops {
        let Ok(d) = dims(qkv, heads, "attention") else {
            return AttentionFlops {
                scores: 0,
                scores_backward: 0,
                values: 0,
                values_backward: 0,
            };
        };
        let area = cpu::block_area(d.t);
        let (bh, hs, t) = ((d.b * d.h()) as u64, d.hs() as u64, d.t as u64);
        AttentionFlops {
            // S = scale · Q·Kᵀ on the blocks.
            scores: bh * area * (2 * hs + 1),
            // dQ = scale · dS·K and dK = scale · dSᵀ·Q.
            scores_backward: bh * hs * (4 * area + 2 * t),
            // O = P·V.
            values: bh * 2 * hs * area,
            // dP = dO·Vᵀ and dV = Pᵀ·dO.
            values_backward: bh * 4 * hs * area,
        }
    }
}

/// Floating-point operations of the causal softmax (`per_entry` 5) or its backward (4)
/// over `[B, H, T, T]` `probs`: the triangle `j <= i` only. Zero for other shapes.
pub(crate) fn softmax_flops(probs: &Tensor, per_entry: u64) -> u64 {
    match *probs.shape() {
        [b, h, t, t2] if t == t2 => (b * h) as u64 * (t * (t + 1) / 2) as u64 * per_entry,
        _ => 0,
    }
}

/// Causal attention scores: `scores[b, h, i, j] = scale · q_i · k_j` for `j <= i`, and
/// 0 above the diagonal, with query head `h` and the key head it shares; `qkv` is
/// `[B, T, (H + 2·KV)·D]` laid out as [`Heads`] says, `scores` is `[B, H, T, T]`,
/// scale = 1/sqrt(D).
pub fn scores(be: &dyn Backend, scores: &mut Tensor, qkv: &Tensor, heads: Heads) -> Result<()> {
    be.run(&mut Scores { scores, qkv, heads })
}

/// Backward of [`scores`]: writes the q and k blocks of `dqkv`, each key head's gradient
/// summed over the query heads sharing it (entries of `dscores` above the diagonal are
/// ignored).
pub fn scores_backward(
    be: &dyn Backend,
    dqkv: &mut Tensor,
    dscores: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    be.run(&mut ScoresBackward {
        dqkv,
        dscores,
        qkv,
        heads,
    })
}

/// Row softmax of causal scores over `j <= i` (statistics in f32); 0 above the diagonal.
pub fn softmax(be: &dyn Backend, probs: &mut Tensor, scores: &Tensor) -> Result<()> {
    softmax_in_documents(be, probs, scores, None)
}

/// [`softmax`] over rows that hold several documents: row `i` of batch row `b` over
/// `i − positions[b, i] ..= i` only, its own document's keys (`positions` `[B·T]`, see
/// [`crate::ops::positions`]; `None` is [`softmax`]); 0 elsewhere. [`softmax_backward`]
/// needs no positions: it reads the zeros.
pub fn softmax_in_documents(
    be: &dyn Backend,
    probs: &mut Tensor,
    scores: &Tensor,
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Softmax {
        probs,
        scores,
        positions,
    })
}

/// Backward of [`softmax`]: `dscores = probs · (dprobs - Σ probs · dprobs)` on `j <= i`,
/// 0 above.
pub fn softmax_backward(
    be: &dyn Backend,
    dscores: &mut Tensor,
    dprobs: &Tensor,
    probs: &Tensor,
) -> Result<()> {
    be.run(&mut SoftmaxBackward {
        dscores,
        dprobs,
        probs,
    })
}

/// `out[b, t, head h] = Σ_j probs[b, h, t, j] · v[b, j, head of h]`; `out` is
/// `[B, T, H·D]`.
pub fn values(
    be: &dyn Backend,
    out: &mut Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    be.run(&mut Values {
        out,
        probs,
        qkv,
        heads,
    })
}

/// Backward of [`values`]: writes `dprobs` (0 above the diagonal) and the v block of
/// `dqkv`.
pub fn values_backward(
    be: &dyn Backend,
    dprobs: &mut Tensor,
    dqkv: &mut Tensor,
    dout: &Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    be.run(&mut ValuesBackward {
        dprobs,
        dqkv,
        dout,
        probs,
        qkv,
        heads,
    })
}

/// The call of [`scores`].
struct Scores<'a> {
    scores: &'a mut Tensor,
    qkv: &'a Tensor,
    heads: Heads,
}

impl OpKernel for Scores<'_> {
    fn name(&self) -> &'static str {
        "attention_scores"
    }

    fn label(&self) -> &str {
        self.scores.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("attention_scores", &[self.scores, self.qkv])?;
        check::check_scores(self.scores, self.qkv, self.heads)
    }

    fn flops(&self) -> u64 {
        AttentionFlops::new(self.qkv, self.heads).scores
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        cpu::scores(be.blas(), self.scores, self.qkv, self.heads)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::scores(be, self.scores, self.qkv, self.heads)
    }
}

/// The call of [`scores_backward`].
struct ScoresBackward<'a> {
    dqkv: &'a mut Tensor,
    dscores: &'a Tensor,
    qkv: &'a Tensor,
    heads: Heads,
}

impl OpKernel for ScoresBackward<'_> {
    fn name(&self) -> &'static str {
        "attention_scores_backward"
    }

    fn label(&self) -> &str {
        self.dqkv.label()
    }

    fn check(&self) -> Result<()> {
        let (dqkv, dscores, qkv) = (&*self.dqkv, self.dscores, self.qkv);
        ensure_float("attention_scores_backward", &[dqkv, dscores, qkv])?;
        check::check_scores_backward(dqkv, dscores, qkv, self.heads)
    }

    fn flops(&self) -> u64 {
        AttentionFlops::new(self.qkv, self.heads).scores_backward
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        cpu::scores_backward(be.blas(), self.dqkv, self.dscores, self.qkv, self.heads)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::scores_backward(be, self.dqkv, self.dscores, self.qkv, self.heads)
    }
}

/// The call of [`softmax`].
struct Softmax<'a> {
    probs: &'a mut Tensor,
    scores: &'a Tensor,
    positions: Option<&'a [u32]>,
}

impl OpKernel for Softmax<'_> {
    fn name(&self) -> &'static str {
        "softmax_causal"
    }

    fn label(&self) -> &str {
        self.probs.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("softmax_causal", &[self.probs, self.scores])?;
        check::check_softmax(self.probs, self.scores)?;
        let s = self.scores.shape();
        super::positions::check("softmax_causal", self.positions, s[0], s[2])
    }

    fn flops(&self) -> u64 {
        softmax_flops(self.scores, SOFTMAX_FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::softmax(self.probs, self.scores, self.positions)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::softmax(be, self.probs, self.scores, self.positions)
    }
}

/// The call of [`softmax_backward`].
struct SoftmaxBackward<'a> {
    dscores: &'a mut Tensor,
    dprobs: &'a Tensor,
    probs: &'a Tensor,
}

impl OpKernel for SoftmaxBackward<'_> {
    fn name(&self) -> &'static str {
        "softmax_causal_backward"
    }

    fn label(&self) -> &str {
        self.dscores.label()
    }

    fn check(&self) -> Result<()> {
        let (dscores, dprobs, probs) = (&*self.dscores, self.dprobs, self.probs);
        ensure_float("softmax_causal_backward", &[dscores, dprobs, probs])?;
        check::check_softmax_backward(dscores, dprobs, probs)
    }

    fn flops(&self) -> u64 {
        softmax_flops(self.probs, SOFTMAX_BACKWARD_FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::softmax_backward(self.dscores, self.dprobs, self.probs)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::softmax_backward(be, self.dscores, self.dprobs, self.probs)
    }
}

/// The call of [`values`].
struct Values<'a> {
    out: &'a mut Tensor,
    probs: &'a Tensor,
    qkv: &'a Tensor,
    heads: Heads,
}

impl OpKernel for Values<'_> {
    fn name(&self) -> &'static str {
        "attention_values"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        let (out, probs, qkv) = (&*self.out, self.probs, self.qkv);
        ensure_float("attention_values", &[out, probs, qkv])?;
        check::check_values(out, probs, qkv, self.heads)
    }

    fn flops(&self) -> u64 {
        AttentionFlops::new(self.qkv, self.heads).values
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        cpu::values(be.blas(), self.out, self.probs, self.qkv, self.heads)
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::values(be, self.out, self.probs, self.qkv, self.heads)
    }
}

/// The call of [`values_backward`].
struct ValuesBackward<'a> {
    dprobs: &'a mut Tensor,
    dqkv: &'a mut Tensor,
    dout: &'a Tensor,
    probs: &'a Tensor,
    qkv: &'a Tensor,
    heads: Heads,
}

impl OpKernel for ValuesBackward<'_> {
    fn name(&self) -> &'static str {
        "attention_values_backward"
    }

    fn label(&self) -> &str {
        self.dprobs.label()
    }

    fn check(&self) -> Result<()> {
        let (dprobs, dqkv, dout, probs, qkv) =
            (&*self.dprobs, &*self.dqkv, self.dout, self.probs, self.qkv);
        ensure_float(
            "attention_values_backward",
            &[dprobs, dqkv, dout, probs, qkv],
        )?;
        check::check_values_backward(dprobs, dqkv, dout, probs, qkv, self.heads)
    }

    fn flops(&self) -> u64 {
        AttentionFlops::new(self.qkv, self.heads).values_backward
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        cpu::values_backward(
            be.blas(),
            self.dprobs,
            self.dqkv,
            self.dout,
            self.probs,
            self.qkv,
            self.heads,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::values_backward(
            be,
            self.dprobs,
            self.dqkv,
            self.dout,
            self.probs,
            self.qkv,
            self.heads,
        )
    }
}

/// Causal attention: `out = softmax(q·kᵀ/√D, causal) · v` per query head, with the key
/// and value head it shares, from `qkv` `[B, T, (H + 2·KV)·D]` laid out as [`Heads`] says;
/// within each document where the batch has positions ([`ForwardCx::positions`]).
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
            self::scores(be, &mut scores, qkv, self.heads)?;
            let mut probs = cx.alloc(0)?;
            softmax_in_documents(be, &mut probs, &scores, cx.positions)?;
            drop(scores);
            cx.outputs[0] = Some(probs);
        }
        if cx.wanted[1] {
            let mut out = cx.alloc(1)?;
            values(be, &mut out, cx.output(0)?, qkv, self.heads)?;
            cx.outputs[1] = Some(out);
        }
        Ok(())
    }

    fn attention_heads(&self) -> Option<Heads> {
        Some(self.heads)
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
            values_backward(be, &mut dprobs, dqkv, &datt, probs, qkv, heads)?;
            drop(datt);
            let mut dscores = act(&dscores_label)?;
            softmax_backward(be, &mut dscores, &dprobs, probs)?;
            drop(dprobs);
            scores_backward(be, dqkv, &dscores, qkv, heads)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_flops_follow_the_blocks() {
        let be = crate::CpuBackend::new();
        use crate::Backend;
        // B 2, T 70, C 8, 2 heads of 4.
        let qkv = be
            .zeros(
                &[2, 70, 24],
                crate::DType::F32,
                crate::MemoryCategory::Activations,
                "qkv",
            )
            .unwrap();
        let f = AttentionFlops::new(&qkv, Heads::mha(2, 8));
        assert_eq!(f.scores, 4 * 4516 * 9);
        assert_eq!(f.values, 4 * 2 * 4 * 4516);
        assert_eq!(f.values_backward, 2 * f.values);
        assert_eq!(f.scores_backward, 4 * 4 * (4 * 4516 + 140));
        // Heads that do not divide the width: the op refuses, nothing is counted.
        assert_eq!(AttentionFlops::new(&qkv, Heads::mha(3, 8)).scores, 0);
    }
}
