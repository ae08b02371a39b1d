//! Softmax cross-entropy over the vocabulary, fused with its gradient.

use super::simd::{self, simd_fn};
use super::{ensure, read, write};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Checks `cross_entropy`'s operands (the contract every backend shares) and returns the
/// logits' `(rows, padded vocab)`.
pub(crate) fn check(logits: &Tensor, targets: &[u32], vocab: usize) -> Result<(usize, usize)> {
    let (rows, vp) = logits.rows_cols();
    ensure(targets.len() == rows, "cross_entropy", || {
        format!("{} targets for {rows} rows of logits", targets.len())
    })?;
    ensure(vocab > 0 && vocab <= vp, "cross_entropy", || {
        format!("vocab {vocab} must be in 1..={vp} (the logits' width)")
    })?;
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::data(
            "targets",
            format!("token id {bad} is beyond the vocabulary of {vocab}; use a tokenizer that matches the model's vocab_size"),
        ));
    }
    Ok((rows, vp))
}

pub(super) fn cross_entropy(
    logits: &mut Tensor,
    targets: &[u32],
    vocab: usize,
    grad_scale: Option<f32>,
) -> Result<f64> {
    let (rows, vp) = check(logits, targets, vocab)?;
    let mut losses = vec![0f64; rows];
    match grad_scale {
        None => {
            let l = read(logits);
            l.par_chunks(vp)
                .zip(losses.par_iter_mut())
                .zip(targets.par_iter())
                .for_each(|((row, loss), &t)| *loss = row_loss(&row[..vocab], t as usize));
        }
        Some(scale) => {
            write(logits, true, |l| {
                l.par_chunks_mut(vp)
                    .zip(losses.par_iter_mut())
                    .zip(targets.par_iter())
                    .for_each(|((row, loss), &t)| {
                        let (row, pad) = row.split_at_mut(vocab);
                        *loss = row_loss_and_grad(row, t as usize, scale);
                        pad.fill(0.0);
                    })
            });
        }
    }
    Ok(losses.iter().sum())
}

simd_fn! {
    /// `logsumexp(row) - row[t]`, in f64 for the caller's sum.
    fn row_loss(row: &[f32], t: usize) -> f64 {
        let max = simd::max(row);
        let mut acc = [0f32; 16];
        for c in row.chunks(16) {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += simd::exp(v - max);
            }
        }
        let sum = simd::sum(&acc);
        (sum.ln() + max - row[t]) as f64
    }
}

simd_fn! {
    /// The row's loss; the row is overwritten by `scale · (softmax - onehot(t))`.
    fn row_loss_and_grad(row: &mut [f32], t: usize, scale: f32) -> f64 {
        let target_logit = row[t];
        let max = simd::max(row);
        for v in row.iter_mut() {
            *v = simd::exp(*v - max);
        }
        let sum = simd::sum(row);
        let loss = (sum.ln() + max - target_logit) as f64;
        let k = scale / sum;
        for v in row.iter_mut() {
            *v *= k;
        }
        row[t] -= scale;
        loss
    }
}
