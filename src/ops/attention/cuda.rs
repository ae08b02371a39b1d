//! Causal attention on the GPU from the fused `[B, T, (H + 2·KV)·D]` projections: scores, the
//! causal softmax and the weighted values, each with its backward.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/attention.cu`, listed once in
//! [`KERNELS`].

use super::{square_side, Dims};
use crate::device::cuda::backend::ensure_dtype;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::ops::Heads;
use crate::tensor::Tensor;

/// The kernels of `kernels/attention.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "attention.cu",
    source: include_str!("../../../kernels/attention.cu"),
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
        "attention_scores_f16",
        "attention_scores_backward_f16",
        "softmax_causal_f16",
        "softmax_causal_backward_f16",
        "attention_values_f16",
        "attention_values_backward_dprobs_f16",
        "attention_values_backward_dv_f16",
        "attention_decode_softmax",
        "attention_decode_scores_f32",
        "attention_decode_scores_bf16",
        "attention_decode_scores_f16",
        "attention_decode_values_f32",
        "attention_decode_values_bf16",
        "attention_decode_values_f16",
    ],
};
inventory::submit!(KERNELS);

/// The decode kernels ([`super::decode::decode`]): scores into f32 scratch `[n·H, keys]`,
/// its softmax, the weighted values.
pub(crate) fn decode(
    be: &CudaBackend,
    out: &mut Tensor,
    qkv: &Tensor,
    kv: &Tensor,
    heads: Heads,
    start: usize,
) -> Result<()> {
    use crate::device::Backend;
    use crate::memory::MemoryCategory;
    let dt = qkv.dtype();
    let n = qkv.numel() / heads.qkv_width().max(1);
    let (rows, keys) = (n * heads.n_head, start + n);
    if rows == 0 {
        return Ok(());
    }
    let p = be.empty(
        &[rows, keys],
        crate::tensor::DType::F32,
        MemoryCategory::Workspace,
        "attention_decode.probs",
    )?;
    let scale = 1.0 / (heads.head_dim as f32).sqrt();
    let dims = |a: Args| {
        a.i64(n)
            .i64(start)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
    };
    be.launch(
        &format!("attention_decode_scores_{dt}"),
        be.grid(rows * keys),
        BLOCK,
        dims(Args::new().ptr(ptr(&p)?).ptr(ptr(qkv)?).ptr(ptr(kv)?)).f32(scale),
    )?;
    be.launch(
        "attention_decode_softmax",
        be.grid(rows),
        BLOCK,
        Args::new().ptr(ptr(&p)?).i64(rows).i64(keys),
    )?;
    be.launch(
        &format!("attention_decode_values_{dt}"),
        be.grid(rows * heads.head_dim),
        BLOCK,
        dims(Args::new().ptr(ptr(out)?).ptr(ptr(&p)?).ptr(ptr(kv)?)),
    )?;
    drop(p);
    Ok(())
}

pub(crate) fn scores(
    be: &CudaBackend,
    scores: &mut Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    ensure_dtype(scores, qkv.dtype(), "attention_scores")?;
    let n = scores.numel();
    if n == 0 {
        return Ok(());
    }
    let scale = 1.0 / (d.hs() as f32).sqrt();
    be.launch(
        &format!("attention_scores_{}", qkv.dtype()),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(scores)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
            .f32(scale),
    )
}

pub(crate) fn scores_backward(
    be: &CudaBackend,
    dqkv: &mut Tensor,
    dscores: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    let dt = qkv.dtype();
    ensure_dtype(dqkv, dt, "attention_scores_backward")?;
    if qkv.numel() == 0 {
        return Ok(());
    }
    let dscores = be.as_dtype(dscores, dt)?;
    let scale = 1.0 / (d.hs() as f32).sqrt();
    be.launch(
        &format!("attention_scores_backward_{dt}"),
        be.grid(d.b * d.t * (heads.q_width() + heads.kv_width())),
        BLOCK,
        Args::new()
            .ptr(ptr(dqkv)?)
            .ptr(ptr(&dscores)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
            .f32(scale),
    )
}

pub(crate) fn softmax(
    be: &CudaBackend,
    probs: &mut Tensor,
    scores: &Tensor,
    positions: Option<&[u32]>,
) -> Result<()> {
    let t = square_side(scores);
    ensure_dtype(probs, scores.dtype(), "softmax_causal")?;
    let rows = scores.numel().checked_div(t).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    let pos = be.positions(positions)?;
    be.launch(
        &format!("softmax_causal_{}", scores.dtype()),
        be.grid_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(probs)?)
            .ptr(ptr(scores)?)
            .i64(rows)
            .i64(t)
            .i64(scores.shape()[1])
            .ptr(pos.ptr()?),
    )
}

pub(crate) fn softmax_backward(
    be: &CudaBackend,
    dscores: &mut Tensor,
    dprobs: &Tensor,
    probs: &Tensor,
) -> Result<()> {
    let t = square_side(probs);
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
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
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
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim),
    )
}

pub(crate) fn values_backward(
    be: &CudaBackend,
    dprobs: &mut Tensor,
    dqkv: &mut Tensor,
    dout: &Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    let dt = qkv.dtype();
    ensure_dtype(dprobs, dt, "attention_values_backward")?;
    ensure_dtype(dqkv, dt, "attention_values_backward")?;
    if qkv.numel() == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, dt)?;
    let probs = be.as_dtype(probs, dt)?;
    let dims = |a: Args| {
        a.i64(d.b)
            .i64(d.t)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
    };
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
        be.grid(d.b * d.t * heads.kv_width()),
        BLOCK,
        dims(
            Args::new()
                .ptr(ptr(dqkv)?)
                .ptr(ptr(&dout)?)
                .ptr(ptr(&probs)?),
        ),
    )
}
