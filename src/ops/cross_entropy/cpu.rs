//! Softmax cross-entropy over the vocabulary, fused with its gradient, on the CPU: the
//! reference of `kernels/cross_entropy.cu`.

use super::IGNORE;
use crate::device::cpu::simd::{self, simd_fn};
use crate::device::cpu::{read, write};
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// The loss (and with `grad_scale` the gradient over the logits), on checked operands.
pub(crate) fn forward(
    logits: &mut Tensor,
    targets: &[u32],
    vocab: usize,
    grad_scale: Option<f32>,
    out: &mut Tensor,
) -> Result<()> {
    let (rows, vp) = (targets.len(), logits.rows_cols().1);
    let mut losses = vec![0f32; rows];
    match grad_scale {
        None => {
            let l = read(logits);
            l.par_chunks(vp)
                .zip(losses.par_iter_mut())
                .zip(targets.par_iter())
                .for_each(|((row, loss), &t)| {
                    if t != IGNORE {
                        *loss = row_loss(&row[..vocab], t as usize);
                    }
                });
        }
        Some(scale) => {
            write(logits, true, |l| {
                l.par_chunks_mut(vp)
                    .zip(losses.par_iter_mut())
                    .zip(targets.par_iter())
                    .for_each(|((row, loss), &t)| {
                        if t == IGNORE {
                            row.fill(0.0);
                            return;
                        }
                        let (row, pad) = row.split_at_mut(vocab);
                        *loss = row_loss_and_grad(row, t as usize, scale);
                        pad.fill(0.0);
                    })
            });
        }
    }
    write(out, true, |o| {
        for (o, l) in o.iter_mut().zip(&losses) {
            *o += l;
        }
    });
    Ok(())
}

/// Threads of the kernel's block per row.
const ROW_LANES: usize = 256;

/// The partial sums of a row's exponentials: the kernel's 256 threads of 8 consecutive
/// columns of every 2048 (column `c` adds into slot `c % 2048`, in order of `c`).
const ROW_SLOTS: usize = 8 * ROW_LANES;

/// `Σ f(v)` over the row in the kernel's order: [`ROW_SLOTS`] partial sums, each thread's 8
/// pairwise (distances 4, 2, 1), then the 256 threads pairwise (128, ..., 1).
#[inline(always)]
fn row_sum(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; ROW_SLOTS];
    for c in row.chunks(ROW_SLOTS) {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += f(*v);
        }
    }
    let mut lanes = [0f32; ROW_LANES];
    for (l, a) in lanes.iter_mut().zip(acc.chunks_exact(8)) {
        *l = simd::reduce([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
    }
    simd::reduce(lanes)
}

simd_fn! {
    /// `logsumexp(row) - row[t]`.
    fn row_loss(row: &[f32], t: usize) -> f32 {
        let max = simd::max(row);
        let sum = row_sum(row, |v| simd::exp(v - max));
        sum.ln() + max - row[t]
    }
}

simd_fn! {
    /// The row's loss; the row is overwritten by `scale · (softmax - onehot(t))`.
    fn row_loss_and_grad(row: &mut [f32], t: usize, scale: f32) -> f32 {
        let target_logit = row[t];
        let max = simd::max(row);
        for v in row.iter_mut() {
            *v = simd::exp(*v - max);
        }
        let sum = row_sum(row, |v| v);
        let loss = sum.ln() + max - target_logit;
        let k = scale / sum;
        for v in row.iter_mut() {
            *v *= k;
        }
        row[t] -= scale;
        loss
    }
}
