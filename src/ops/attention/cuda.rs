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

/// The kernels of `kernels/attention.cu` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::ops::attention;
    use crate::tensor::DType;

    #[test]
    fn softmax_matches_the_cpu_bit_for_bit() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        // B 2, H 3, T 37: rows longer and shorter than a half-warp.
        let (b, h, t) = (2usize, 3usize, 37usize);
        let shape = [b, h, t, t];
        let scores = random(b * h * t * t, 2.0, 11);
        let x = upload(&be, &scores, &shape, DType::F32);
        // One document per row, and rows of several documents (the second row's starting
        // past a half-warp).
        let starts = [3, 20, 21, t + 19];
        let mut documents =
            crate::ops::positions::from_document_starts(b, t, |k| starts.contains(&k));
        for positions in [None, Some(&mut documents)] {
            let mut probs = zeros(&be, &shape, DType::F32);
            let pos = positions.as_deref().map(|p| &p[..]);
            attention::softmax_in_documents(&be, &mut probs, &x, pos).unwrap();
            let want = be.to_f32(&probs).unwrap();
            let mut s = scores.clone();
            let mut p = vec![f32::NAN; s.len()];
            let a = Args::new()
                .ptr(&mut p)
                .ptr(&mut s)
                .arg((b * h * t) as i64)
                .arg(t as i64)
                .arg(h as i64);
            let a = match positions {
                Some(d) => a.ptr(d),
                None => a.arg(std::ptr::null_mut::<u32>()),
            };
            launch(emu, "softmax_causal_f32", 4, 128, 0, a).unwrap();
            assert_bitwise("softmax_causal_f32", &p, &want);
        }
    }

    #[test]
    fn attention_kernels_match_the_cpu() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        // Multi-head, grouped-query and multi-query heads.
        let layouts = [(3, 3, 4), (4, 2, 3), (4, 1, 5)].map(|(n_head, n_kv_head, head_dim)| {
            crate::ops::Heads {
                n_head,
                n_kv_head,
                head_dim,
            }
        });
        for (heads, d) in layouts
            .into_iter()
            .flat_map(|heads| DTYPES.map(|d| (heads, d)))
        {
            let (b, t, h) = (2usize, 19usize, heads.n_head);
            let (c, w) = (heads.q_width(), heads.qkv_width());
            let rows = b * h * t;
            let scale = 1.0 / (heads.head_dim as f32).sqrt();
            let qkvs = random(b * t * w, 1.0, 40);
            let dprobs_in = random(rows * t, 1.0, 41);
            let douts = random(b * t * c, 1.0, 42);
            let dims = |a: Args| {
                a.arg(b as i64)
                    .arg(t as i64)
                    .arg(h as i64)
                    .arg(heads.n_kv_head as i64)
                    .arg(heads.head_dim as i64)
            };
            let sfx = suffix(d);
            // The products add in another order than the CPU's: equal to f32 rounding, or
            // to a bf16 step where stored in bf16.
            let tol = if d == DType::F32 { 1e-5 } else { 1e-2 };
            let qkv = upload(&be, &qkvs, &[b, t, w], d);
            let mut scores_cpu = zeros(&be, &[b, h, t, t], d);
            attention::scores(&be, &mut scores_cpu, &qkv, heads).unwrap();
            let mut qkv_buf = Buf::new(&qkvs, d);
            let mut scores = Buf::new(&vec![f32::NAN; rows * t], d);
            let a = dims(Args::new().buf(&mut scores).buf(&mut qkv_buf)).arg(scale);
            launch(emu, &format!("attention_scores_{sfx}"), 4, 128, 0, a).unwrap();
            let scores_want = be.to_f32(&scores_cpu).unwrap();
            assert_close(
                &format!("{heads:?} scores"),
                &scores.values(),
                &scores_want,
                tol,
            );

            // The softmax and its backward from the CPU's scores: bit for bit.
            let mut probs_cpu = zeros(&be, &[b, h, t, t], d);
            attention::softmax(&be, &mut probs_cpu, &scores_cpu).unwrap();
            let mut scores = Buf::new(&scores_want, d);
            let mut probs = Buf::new(&vec![f32::NAN; rows * t], d);
            let a = Args::new()
                .buf(&mut probs)
                .buf(&mut scores)
                .arg(rows as i64)
                .arg(t as i64)
                .arg(h as i64)
                .arg(std::ptr::null_mut::<u32>());
            launch(emu, &format!("softmax_causal_{sfx}"), 2, 64, 0, a).unwrap();
            let probs_want = be.to_f32(&probs_cpu).unwrap();
            assert_bitwise("probs", &probs.values(), &probs_want);
            let dprobs = upload(&be, &dprobs_in, &[b, h, t, t], d);
            let mut dscores_cpu = zeros(&be, &[b, h, t, t], d);
            attention::softmax_backward(&be, &mut dscores_cpu, &dprobs, &probs_cpu).unwrap();
            let mut dprobs_buf = Buf::new(&dprobs_in, d);
            let mut dscores = Buf::new(&vec![f32::NAN; rows * t], d);
            let a = Args::new()
                .buf(&mut dscores)
                .buf(&mut dprobs_buf)
                .buf(&mut probs)
                .arg(rows as i64)
                .arg(t as i64);
            launch(emu, &format!("softmax_causal_backward_{sfx}"), 3, 32, 0, a).unwrap();
            let dscores_want = be.to_f32(&dscores_cpu).unwrap();
            assert_bitwise("dscores", &dscores.values(), &dscores_want);

            // Values and the backward products.
            let mut out_cpu = zeros(&be, &[b, t, c], d);
            attention::values(&be, &mut out_cpu, &probs_cpu, &qkv, heads).unwrap();
            let mut out = Buf::new(&vec![f32::NAN; b * t * c], d);
            let a = dims(Args::new().buf(&mut out).buf(&mut probs).buf(&mut qkv_buf));
            launch(emu, &format!("attention_values_{sfx}"), 2, 64, 0, a).unwrap();
            let out_want = be.to_f32(&out_cpu).unwrap();
            assert_close(&format!("{heads:?} values"), &out.values(), &out_want, tol);

            let dout = upload(&be, &douts, &[b, t, c], d);
            let mut dprobs_cpu = zeros(&be, &[b, h, t, t], d);
            let mut dqkv_cpu = zeros(&be, &[b, t, w], d);
            attention::values_backward(
                &be,
                &mut dprobs_cpu,
                &mut dqkv_cpu,
                &dout,
                &probs_cpu,
                &qkv,
                heads,
            )
            .unwrap();
            attention::scores_backward(&be, &mut dqkv_cpu, &dscores_cpu, &qkv, heads).unwrap();
            let mut dout_buf = Buf::new(&douts, d);
            let mut dp = Buf::new(&vec![f32::NAN; rows * t], d);
            let a = dims(
                Args::new()
                    .buf(&mut dp)
                    .buf(&mut dout_buf)
                    .buf(&mut qkv_buf),
            );
            let k = format!("attention_values_backward_dprobs_{sfx}");
            launch(emu, &k, 2, 64, 0, a).unwrap();
            let dp_want = be.to_f32(&dprobs_cpu).unwrap();
            assert_close(&format!("{heads:?} dprobs"), &dp.values(), &dp_want, tol);
            let mut dqkv = Buf::new(&vec![f32::NAN; b * t * w], d);
            let a = dims(
                Args::new()
                    .buf(&mut dqkv)
                    .buf(&mut dout_buf)
                    .buf(&mut probs),
            );
            launch(
                emu,
                &format!("attention_values_backward_dv_{sfx}"),
                2,
                64,
                0,
                a,
            )
            .unwrap();
            let mut dscores = Buf::new(&dscores_want, d);
            let a = Args::new()
                .buf(&mut dqkv)
                .buf(&mut dscores)
                .buf(&mut qkv_buf);
            let a = dims(a).arg(scale);
            launch(
                emu,
                &format!("attention_scores_backward_{sfx}"),
                2,
                64,
                0,
                a,
            )
            .unwrap();
            let dqkv_want = be.to_f32(&dqkv_cpu).unwrap();
            assert_close(&format!("{heads:?} dqkv"), &dqkv.values(), &dqkv_want, tol);
        }
    }
}
