//! The per-head q/k norm on the CPU, the reference of `kernels/qk_norm.cu`: each query
//! and key head is normalised as a row of [`crate::ops::rmsnorm`] (its sums in 16 lanes, as
//! the kernel's half-warp per head),
//! and each gain's gradient is summed over its group's rows (token after token) per block
//! of `ROW_BLOCK` rows, then block after block, so results are bitwise reproducible.

use crate::device::cpu::elementwise::ROW_BLOCK;
use crate::device::cpu::simd::{self, simd_fn};
use crate::device::cpu::{read, write};
use crate::error::Result;
use crate::ops::rmsnorm::cpu::weight_grad_row;
use crate::ops::Heads;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// The forward, on checked operands.
pub(crate) fn forward(
    out: &mut Tensor,
    rstd: &mut Tensor,
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    heads: Heads,
    eps: f32,
) -> Result<()> {
    let (d, qk) = (heads.head_dim, heads.n_head + heads.n_kv_head);
    let width = heads.qkv_width();
    let (rows, _) = qkv.rows_cols();
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let (x, wq, wk) = (read(qkv), read(wq), read(wk));
    let mut r = vec![0f32; rows * qk];
    write(out, false, |o| {
        o.par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .zip(r.par_chunks_mut(qk))
            .for_each(|((o, x), r)| {
                for (j, (o, x)) in o.chunks_mut(d).zip(x.chunks(d)).enumerate() {
                    match j {
                        j if j < heads.n_head => forward_row(o, &mut r[j], x, &wq, eps),
                        j if j < qk => forward_row(o, &mut r[j], x, &wk, eps),
                        _ => o.copy_from_slice(x),
                    }
                }
            })
    });
    write(rstd, false, |o| o.copy_from_slice(&r));
    Ok(())
}

/// The backward, on checked operands: the rows' input gradients (value heads pass their
/// gradient through), and each gain's gradient over its group.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dx: &mut Tensor,
    dwq: &mut Tensor,
    dwk: &mut Tensor,
    dout: &Tensor,
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    rstd: &Tensor,
    heads: Heads,
) -> Result<()> {
    let (d, qk) = (heads.head_dim, heads.n_head + heads.n_kv_head);
    let width = heads.qkv_width();
    let (tokens, _) = qkv.rows_cols();
    if tokens == 0 || d == 0 {
        return Ok(());
    }
    let (x, dy, wq, wk, r) = (read(qkv), read(dout), read(wq), read(wk), read(rstd));
    write(dx, true, |o| {
        o.par_chunks_mut(width).enumerate().for_each(|(t, o)| {
            for (j, o) in o.chunks_mut(d).enumerate() {
                let at = t * width + j * d;
                let (x, dy) = (&x[at..at + d], &dy[at..at + d]);
                match j {
                    j if j < heads.n_head => input_grad_row(o, x, dy, &wq, r[t * qk + j]),
                    j if j < qk => input_grad_row(o, x, dy, &wk, r[t * qk + j]),
                    _ => o.iter_mut().zip(dy).for_each(|(o, g)| *o += g),
                }
            }
        })
    });
    // Group rows: head `first + i` of token `t` is row `t·n + i`.
    let group = |first: usize, n: usize| -> Vec<Vec<f32>> {
        let rows = tokens * n;
        (0..rows.div_ceil(ROW_BLOCK))
            .into_par_iter()
            .map(|blk| {
                let mut dw = vec![0f32; d];
                for row in blk * ROW_BLOCK..rows.min((blk + 1) * ROW_BLOCK) {
                    let (t, j) = (row / n, first + row % n);
                    let at = t * width + j * d;
                    weight_grad_row(&mut dw, &x[at..at + d], &dy[at..at + d], r[t * qk + j]);
                }
                dw
            })
            .collect()
    };
    for (grad, partial) in [
        (dwq, group(0, heads.n_head)),
        (dwk, group(heads.n_head, heads.n_kv_head)),
    ] {
        write(grad, true, |g| {
            for p in &partial {
                for (g, p) in g.iter_mut().zip(p) {
                    *g += p;
                }
            }
        });
    }
    Ok(())
}

simd_fn! {
    /// One head normalised, `o = x·rstd·w`, `rstd = 1/√(mean(x²) + eps)`, its sum in 16
    /// interleaved lanes (the kernel's half-warp per head).
    fn forward_row(o: &mut [f32], r: &mut f32, x: &[f32], w: &[f32], eps: f32) {
        let c = x.len();
        let rstd = 1.0 / (simd::dot(x, x) / c as f32 + eps).sqrt();
        for i in 0..c {
            o[i] = x[i] * rstd * w[i];
        }
        *r = rstd;
    }
}

simd_fn! {
    /// One head's input gradient, `dx += rstd·(w·dy − x·rstd²·mean(w·dy·x))`, its sum in 16
    /// interleaved lanes (the kernel's half-warp per head).
    fn input_grad_row(o: &mut [f32], x: &[f32], d: &[f32], w: &[f32], rstd: f32) {
        let c = x.len();
        let mut acc = [0f32; 16];
        for (xc, (dc, wc)) in x.chunks(16).zip(d.chunks(16).zip(w.chunks(16))) {
            for i in 0..xc.len() {
                acc[i] += wc[i] * dc[i] * xc[i];
            }
        }
        let k = simd::sum(&acc) / c as f32 * rstd * rstd;
        for i in 0..c {
            o[i] += rstd * (w[i] * d[i] - x[i] * k);
        }
    }
}
