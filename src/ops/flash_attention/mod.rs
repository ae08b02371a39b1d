//! Fused causal attention: the output and one log-sum-exp per query row, never a
//! `[B, H, T, T]` tensor; and the choice between it and the materialized attention.
//!
//! The family: the graph node [`FlashAttention`] (and [`AttentionPath`], the choice), the
//! two kernel calls ([`forward`] and [`backward`]) with their operand checks and FLOP
//! counts, the CPU twin (`cpu.rs`) and the CUDA launches (`cuda.rs`, over
//! `kernels/flash_attention.cu`). The shapes are those of the materialized attention
//! ([`crate::ops::attention`]), whose checks of `qkv` these share.

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{ensure_f32, ensure_float, ensure_shape};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::ops::attention::{dims, Dims};
use crate::ops::Heads;
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

/// Checks `flash_attention`'s operands (the contract every backend shares).
pub(crate) fn check(out: &Tensor, lse: &Tensor, qkv: &Tensor, heads: Heads) -> Result<()> {
    let op = "flash_attention";
    let d = dims(qkv, heads, op)?;
    ensure_shape(out, &[d.b, d.t, d.c], op)?;
    ensure_shape(lse, &[d.b, d.h(), d.t], op)?;
    ensure_f32(lse, op)
}

/// Checks `flash_attention_backward`'s operands (the contract every backend shares).
pub(crate) fn check_backward(
    dqkv: &Tensor,
    dout: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let op = "flash_attention_backward";
    let d = dims(qkv, heads, op)?;
    ensure_shape(dqkv, qkv.shape(), op)?;
    ensure_shape(dout, &[d.b, d.t, d.c], op)?;
    ensure_shape(out, &[d.b, d.t, d.c], op)?;
    ensure_shape(lse, &[d.b, d.h(), d.t], op)?;
    ensure_f32(lse, op)
}

/// Floating-point operations of the fused attention with these operands, over the causal
/// entries its tiles compute (the materialized attention's block triangle): forward
/// `4·D + 5` per entry (the scores, the online softmax, the weighted values), backward
/// `10·D + 6` (the scores again, the value and probability gradients, the query and key
/// gradients, the softmax backward), plus the output scaling and `rowsum(dO ∘ O)`. Zero
/// for shapes the op refuses.
pub(crate) struct FlashFlops {
    pub forward: u64,
    pub backward: u64,
}

impl FlashFlops {
    pub(crate) fn new(qkv: &Tensor, heads: Heads) -> FlashFlops {
        let Ok(d) = dims(qkv, heads, "flash_attention") else {
            return FlashFlops {
                forward: 0,
                backward: 0,
            };
        };
        let area = cpu::tile_area(d.t);
        let (bh, hs, t) = ((d.b * d.h()) as u64, d.hs() as u64, d.t as u64);
        FlashFlops {
            forward: bh * (area * (4 * hs + 5) + t * (hs + 2)),
            backward: bh * (area * (10 * hs + 6) + 2 * t * hs),
        }
    }
}

/// Fused causal attention: `out[b, t, head h] = Σ_{j <= t} softmax_j(scale · q_t ·
/// k_j) · v_j` with query head `h` and the key and value head it shares (`out`
/// `[B, T, H·D]`), and `lse[b, h, t]` (`[B, H, T]`, f32) the natural log of the
/// softmax's denominator, `ln Σ_{j <= t} exp(scale · q_t · k_j)`, scale = 1/sqrt(D).
/// Computed in tiles with an online softmax: no `[T, T]` tensor exists. Agrees with
/// [`attention::scores`](crate::ops::attention::scores),
/// [`attention::softmax`](crate::ops::attention::softmax) and
/// [`attention::values`](crate::ops::attention::values) to rounding.
pub fn forward(
    be: &dyn Backend,
    out: &mut Tensor,
    lse: &mut Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    forward_in_documents(be, out, lse, qkv, heads, None)
}

/// [`forward`] over rows that hold several documents: query `i` attends only keys
/// `i − positions[i] ..= i`, its own document's (`positions` `[B·T]`, see
/// [`crate::ops::positions`]; `None` is [`forward`]). Key tiles that lie wholly before
/// every query of a tile's document are skipped.
pub fn forward_in_documents(
    be: &dyn Backend,
    out: &mut Tensor,
    lse: &mut Tensor,
    qkv: &Tensor,
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Forward {
        out,
        lse,
        qkv,
        heads,
        positions,
    })
}

/// Backward of [`forward`]: overwrites `dqkv` (shaped as `qkv`) with the query, key and
/// value gradients (each key and value head's summed over the query heads sharing it),
/// recomputing the probabilities tile by tile from `qkv` and `lse`, with
/// `rowsum(dout ∘ out)` for the softmax backward.
pub fn backward(
    be: &dyn Backend,
    dqkv: &mut Tensor,
    dout: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    backward_in_documents(be, dqkv, dout, out, lse, qkv, heads, None)
}

/// Backward of [`forward_in_documents`] (the same `positions`).
#[allow(clippy::too_many_arguments)]
pub fn backward_in_documents(
    be: &dyn Backend,
    dqkv: &mut Tensor,
    dout: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    qkv: &Tensor,
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Backward {
        dqkv,
        dout,
        out,
        lse,
        qkv,
        heads,
        positions,
    })
}

/// The call of [`forward`].
struct Forward<'a> {
    out: &'a mut Tensor,
    lse: &'a mut Tensor,
    qkv: &'a Tensor,
    heads: Heads,
    positions: Option<&'a [u32]>,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "flash_attention"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("flash_attention", &[self.out, self.qkv])?;
        check(self.out, self.lse, self.qkv, self.heads)?;
        let d = Dims::of(self.qkv, self.heads);
        super::positions::check("flash_attention", self.positions, d.b, d.t)
    }

    fn flops(&self) -> u64 {
        FlashFlops::new(self.qkv, self.heads).forward
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        cpu::forward(
            be.blas(),
            self.out,
            self.lse,
            self.qkv,
            self.heads,
            self.positions,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(be, self.out, self.lse, self.qkv, self.heads, self.positions)
    }
}

/// The call of [`backward`].
struct Backward<'a> {
    dqkv: &'a mut Tensor,
    dout: &'a Tensor,
    out: &'a Tensor,
    lse: &'a Tensor,
    qkv: &'a Tensor,
    heads: Heads,
    positions: Option<&'a [u32]>,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "flash_attention_backward"
    }

    fn label(&self) -> &str {
        self.dqkv.label()
    }

    fn check(&self) -> Result<()> {
        let (dqkv, dout, out, lse, qkv) = (&*self.dqkv, self.dout, self.out, self.lse, self.qkv);
        ensure_float("flash_attention_backward", &[dqkv, dout, out, qkv])?;
        check_backward(dqkv, dout, out, lse, qkv, self.heads)?;
        let d = Dims::of(qkv, self.heads);
        super::positions::check("flash_attention_backward", self.positions, d.b, d.t)
    }

    fn flops(&self) -> u64 {
        FlashFlops::new(self.qkv, self.heads).backward
    }

    fn cpu(&mut self, be: &CpuBackend) -> Result<()> {
        cpu::backward(
            be.blas(),
            self.dqkv,
            self.dout,
            self.out,
            self.lse,
            self.qkv,
            self.heads,
            self.positions,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward(
            be,
            self.dqkv,
            self.dout,
            self.out,
            self.lse,
            self.qkv,
            self.heads,
            self.positions,
        )
    }
}

/// Fused causal attention ([`forward`]): `out = softmax(q·kᵀ/√D, causal) · v` per query
/// head, with the key and value head it shares, from `qkv` `[B, T, (H + 2·KV)·D]` laid out
/// as [`Heads`] says.
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
        forward_in_documents(
            cx.backend,
            &mut out,
            &mut lse,
            qkv,
            self.heads,
            cx.positions,
        )?;
        if cx.wanted[0] && cx.present[0].is_none() {
            cx.outputs[0] = Some(lse);
        }
        if cx.wanted[1] && cx.present[1].is_none() {
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
        let dout = cx.take_grad_out(1)?;
        let qkv = cx.inputs[0].get()?;
        let lse = cx.outputs[0].get()?;
        let out = cx.outputs[1].get()?;
        let positions = cx.positions;
        cx.grads_in[0].overwrite(be, |dqkv| {
            backward_in_documents(be, dqkv, &dout, out, lse, qkv, heads, positions)
        })?;
        drop(dout);
        cx.outputs[0].release();
        cx.outputs[1].release();
        cx.inputs[0].release();
        Ok(())
    }
}
