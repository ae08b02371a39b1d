//! Causal attention from the fused `[B, T, 3C]` projections: scores, the causal softmax and
//! the weighted values, each with its backward.
//!
//! CPU twin: `src/device/cpu/attention.rs`. Kernels: `kernels/attention.cu`, listed once in [`KERNELS`].

use super::super::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use super::super::gpu::Args;
use super::super::kernels::KernelFile;
use crate::device::cpu::{self, ensure_shape, per_element};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/attention.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "attention.cu",
    source: include_str!("../../../../kernels/attention.cu"),
    kernels: &[
        "attention_scores_f32",
        "attention_scores_bf16",
        "attention_scores_backward_f32",
        "attention_scores_backward_bf16",
        "softmax_causal_f32",
        "softmax_causal_bf16",
        "softmax_causal_backward_f32",
        "softmax_causal_backward_bf16",
        "attention_values_f32",
        "attention_values_bf16",
        "attention_values_backward_dprobs_f32",
        "attention_values_backward_dprobs_bf16",
        "attention_values_backward_dv_f32",
        "attention_values_backward_dv_bf16",
    ],
};

pub(crate) fn scores(
    be: &CudaBackend,
    scores: &mut Tensor,
    qkv: &Tensor,
    n_head: usize,
) -> Result<()> {
    let flops = cpu::attention::AttentionFlops::new(qkv, n_head).scores;
    let _op = be.ledger.op("attention_scores", flops, scores.label());
    let d = cpu::attention::dims(qkv, n_head, "attention_scores")?;
    ensure_shape(scores, &[d.b, d.h, d.t, d.t], "attention_scores")?;
    ensure_dtype(scores, qkv.dtype(), "attention_scores")?;
    let n = scores.numel();
    if n == 0 {
        return Ok(());
    }
    let scale = 1.0 / (d.hs as f32).sqrt();
    be.launch(
        &format!("attention_scores_{}", qkv.dtype()),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(scores)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(d.c)
            .i64(d.h)
            .f32(scale),
    )
}

pub(crate) fn scores_backward(
    be: &CudaBackend,
    dqkv: &mut Tensor,
    dscores: &Tensor,
    qkv: &Tensor,
    n_head: usize,
) -> Result<()> {
    let flops = cpu::attention::AttentionFlops::new(qkv, n_head).scores_backward;
    let _op = be
        .ledger
        .op("attention_scores_backward", flops, dqkv.label());
    let d = cpu::attention::dims(qkv, n_head, "attention_scores_backward")?;
    ensure_shape(dqkv, qkv.shape(), "attention_scores_backward")?;
    ensure_shape(dscores, &[d.b, d.h, d.t, d.t], "attention_scores_backward")?;
    let dt = qkv.dtype();
    ensure_dtype(dqkv, dt, "attention_scores_backward")?;
    if qkv.numel() == 0 {
        return Ok(());
    }
    let dscores = be.as_dtype(dscores, dt)?;
    let scale = 1.0 / (d.hs as f32).sqrt();
    be.launch(
        &format!("attention_scores_backward_{dt}"),
        be.grid(d.b * d.t * 2 * d.c),
        BLOCK,
        Args::new()
            .ptr(ptr(dqkv)?)
            .ptr(ptr(&dscores)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(d.c)
            .i64(d.h)
            .f32(scale),
    )
}

pub(crate) fn softmax(be: &CudaBackend, probs: &mut Tensor, scores: &Tensor) -> Result<()> {
    let flops = cpu::attention::softmax_flops(scores, per_element::SOFTMAX);
    let _op = be.ledger.op("softmax_causal", flops, probs.label());
    let t = cpu::attention::square_rows(scores, "softmax_causal")?;
    ensure_shape(probs, scores.shape(), "softmax_causal")?;
    ensure_dtype(probs, scores.dtype(), "softmax_causal")?;
    let rows = scores.numel().checked_div(t).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    be.launch(
        &format!("softmax_causal_{}", scores.dtype()),
        be.grid_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(probs)?)
            .ptr(ptr(scores)?)
            .i64(rows)
            .i64(t),
    )
}

pub(crate) fn softmax_backward(
    be: &CudaBackend,
    dscores: &mut Tensor,
    dprobs: &Tensor,
    probs: &Tensor,
) -> Result<()> {
    let flops = cpu::attention::softmax_flops(probs, per_element::SOFTMAX_BACKWARD);
    let _op = be
        .ledger
        .op("softmax_causal_backward", flops, dscores.label());
    let t = cpu::attention::square_rows(probs, "softmax_causal_backward")?;
    ensure_shape(dscores, probs.shape(), "softmax_causal_backward")?;
    ensure_shape(dprobs, probs.shape(), "softmax_causal_backward")?;
    let dt = probs.dtype();
    ensure_dtype(dscores, dt, "softmax_causal_backward")?;
    let rows = probs.numel().checked_div(t).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    let dprobs = be.as_dtype(dprobs, dt)?;
    be.launch(
        &format!("softmax_causal_backward_{dt}"),
        be.grid_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(dscores)?)
            .ptr(ptr(&dprobs)?)
            .ptr(ptr(probs)?)
            .i64(rows)
            .i64(t),
    )
}

pub(crate) fn values(
    be: &CudaBackend,
    out: &mut Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    n_head: usize,
) -> Result<()> {
    let flops = cpu::attention::AttentionFlops::new(qkv, n_head).values;
    let _op = be.ledger.op("attention_values", flops, out.label());
    let d = cpu::attention::dims(qkv, n_head, "attention_values")?;
    ensure_shape(out, &[d.b, d.t, d.c], "attention_values")?;
    ensure_shape(probs, &[d.b, d.h, d.t, d.t], "attention_values")?;
    let dt = qkv.dtype();
    ensure_dtype(out, dt, "attention_values")?;
    if out.numel() == 0 {
        return Ok(());
    }
    let probs = be.as_dtype(probs, dt)?;
    be.launch(
        &format!("attention_values_{dt}"),
        be.grid(out.numel()),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(&probs)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(d.c)
            .i64(d.h),
    )
}

pub(crate) fn values_backward(
    be: &CudaBackend,
    dprobs: &mut Tensor,
    dqkv: &mut Tensor,
    dout: &Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    n_head: usize,
) -> Result<()> {
    let flops = cpu::attention::AttentionFlops::new(qkv, n_head).values_backward;
    let _op = be
        .ledger
        .op("attention_values_backward", flops, dprobs.label());
    let d = cpu::attention::dims(qkv, n_head, "attention_values_backward")?;
    ensure_shape(dout, &[d.b, d.t, d.c], "attention_values_backward")?;
    ensure_shape(probs, &[d.b, d.h, d.t, d.t], "attention_values_backward")?;
    ensure_shape(dprobs, probs.shape(), "attention_values_backward")?;
    ensure_shape(dqkv, qkv.shape(), "attention_values_backward")?;
    let dt = qkv.dtype();
    ensure_dtype(dprobs, dt, "attention_values_backward")?;
    ensure_dtype(dqkv, dt, "attention_values_backward")?;
    if qkv.numel() == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, dt)?;
    let probs = be.as_dtype(probs, dt)?;
    let dims = |a: Args| a.i64(d.b).i64(d.t).i64(d.c).i64(d.h);
    be.launch(
        &format!("attention_values_backward_dprobs_{dt}"),
        be.grid(dprobs.numel()),
        BLOCK,
        dims(
            Args::new()
                .ptr(ptr(dprobs)?)
                .ptr(ptr(&dout)?)
                .ptr(ptr(qkv)?),
        ),
    )?;
    be.launch(
        &format!("attention_values_backward_dv_{dt}"),
        be.grid(d.b * d.t * d.c),
        BLOCK,
        dims(
            Args::new()
                .ptr(ptr(dqkv)?)
                .ptr(ptr(&dout)?)
                .ptr(ptr(&probs)?),
        ),
    )
}
