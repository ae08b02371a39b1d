//! The operand checks of the attention ops (the contract every backend shares) and the
//! dimensions of a checked `qkv`, which the fused attention (`crate::ops::flash_attention`)
//! checks its operands with too.

use crate::device::cpu::{ensure, ensure_shape};
use crate::error::{Error, Result};
use crate::ops::Heads;
use crate::tensor::Tensor;

/// The dimensions of an attention op: batch, sequence, the heads, and the widths of a
/// `qkv` row (`w`) and an output row (`c`).
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) heads: Heads,
    pub(crate) w: usize,
    pub(crate) c: usize,
}

impl Dims {
    /// The dimensions of a checked `qkv` with `heads`, read without checking (zeros where
    /// the shape does not fit).
    pub(crate) fn of(qkv: &Tensor, heads: Heads) -> Dims {
        let (b, t) = match *qkv.shape() {
            [b, t, _] => (b, t),
            _ => (0, 0),
        };
        Dims {
            b,
            t,
            heads,
            w: heads.qkv_width(),
            c: heads.q_width(),
        }
    }

    /// Query heads.
    pub(crate) fn h(&self) -> usize {
        self.heads.n_head
    }

    /// Head width.
    pub(crate) fn hs(&self) -> usize {
        self.heads.head_dim
    }
}

/// Checks a `[B, T, (H + 2·KV)·D]` `qkv` with valid `heads`, and returns its dimensions.
pub(crate) fn dims(qkv: &Tensor, heads: Heads, op: &'static str) -> Result<Dims> {
    heads.check(op)?;
    let [_, _, w] = *qkv.shape() else {
        return Err(Error::shape(
            op,
            format!(
                "`{}` must be [B, T, (H + 2·KV)·D], it is {:?}",
                qkv.label(),
                qkv.shape()
            ),
        ));
    };
    ensure(w == heads.qkv_width(), op, || {
        format!(
            "`{}` has rows of {w}; {} query and {} key/value heads of {} need (H + 2·KV)·D \
             = {}",
            qkv.label(),
            heads.n_head,
            heads.n_kv_head,
            heads.head_dim,
            heads.qkv_width()
        )
    })?;
    Ok(Dims::of(qkv, heads))
}

/// Checks `attention_scores`' operands (the contract every backend shares).
pub(crate) fn check_scores(scores: &Tensor, qkv: &Tensor, heads: Heads) -> Result<()> {
    let d = dims(qkv, heads, "attention_scores")?;
    ensure_shape(scores, &[d.b, d.h(), d.t, d.t], "attention_scores")
}

/// Checks `attention_scores_backward`'s operands (the contract every backend shares).
pub(crate) fn check_scores_backward(
    dqkv: &Tensor,
    dscores: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = dims(qkv, heads, "attention_scores_backward")?;
    ensure_shape(dqkv, qkv.shape(), "attention_scores_backward")?;
    ensure_shape(
        dscores,
        &[d.b, d.h(), d.t, d.t],
        "attention_scores_backward",
    )
}

/// Checks `softmax_causal`'s operands (the contract every backend shares).
pub(crate) fn check_softmax(probs: &Tensor, scores: &Tensor) -> Result<()> {
    square_rows(scores, "softmax_causal")?;
    ensure_shape(probs, scores.shape(), "softmax_causal")
}

/// Checks `softmax_causal_backward`'s operands (the contract every backend shares).
pub(crate) fn check_softmax_backward(
    dscores: &Tensor,
    dprobs: &Tensor,
    probs: &Tensor,
) -> Result<()> {
    square_rows(probs, "softmax_causal_backward")?;
    ensure_shape(dscores, probs.shape(), "softmax_causal_backward")?;
    ensure_shape(dprobs, probs.shape(), "softmax_causal_backward")
}

/// Checks `attention_values`' operands (the contract every backend shares).
pub(crate) fn check_values(out: &Tensor, probs: &Tensor, qkv: &Tensor, heads: Heads) -> Result<()> {
    let d = dims(qkv, heads, "attention_values")?;
    ensure_shape(out, &[d.b, d.t, d.c], "attention_values")?;
    ensure_shape(probs, &[d.b, d.h(), d.t, d.t], "attention_values")
}

/// Checks `attention_values_backward`'s operands (the contract every backend shares).
pub(crate) fn check_values_backward(
    dprobs: &Tensor,
    dqkv: &Tensor,
    dout: &Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = dims(qkv, heads, "attention_values_backward")?;
    ensure_shape(dout, &[d.b, d.t, d.c], "attention_values_backward")?;
    ensure_shape(probs, &[d.b, d.h(), d.t, d.t], "attention_values_backward")?;
    ensure_shape(dprobs, probs.shape(), "attention_values_backward")?;
    ensure_shape(dqkv, qkv.shape(), "attention_values_backward")
}

/// `T` of checked `[B, H, T, T]` scores or probabilities.
pub(crate) fn square_side(t: &Tensor) -> usize {
    t.shape().last().copied().unwrap_or(0)
}

pub(crate) fn square_rows(t: &Tensor, op: &'static str) -> Result<usize> {
    let s = t.shape();
    ensure(s.len() == 4 && s[2] == s[3], op, || {
        format!("`{}` must be [B, H, T, T], it is {s:?}", t.label())
    })?;
    Ok(s[3])
}
