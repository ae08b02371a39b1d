//! Softmax cross-entropy over the vocabulary, fused with its gradient.

use super::{ensure, read, write};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use rayon::prelude::*;

pub(super) fn cross_entropy(
    logits: &mut Tensor,
    targets: &[u32],
    vocab: usize,
    grad_scale: Option<f32>,
) -> Result<f64> {
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
    let mut losses = vec![0f64; rows];
    match grad_scale {
        None => {
            let l = read(logits);
            l.par_chunks(vp)
                .zip(losses.par_iter_mut())
                .zip(targets.par_iter())
                .for_each(|((row, loss), &t)| {
                    let row = &row[..vocab];
                    let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                    let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
                    *loss = (sum.ln() + max - row[t as usize]) as f64;
                });
        }
        Some(scale) => {
            write(logits, true, |l| {
                l.par_chunks_mut(vp)
                    .zip(losses.par_iter_mut())
                    .zip(targets.par_iter())
                    .for_each(|((row, loss), &t)| {
                        let (row, pad) = row.split_at_mut(vocab);
                        let t = t as usize;
                        let target_logit = row[t];
                        let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                        let mut sum = 0f32;
                        for v in row.iter_mut() {
                            let e = (*v - max).exp();
                            sum += e;
                            *v = e;
                        }
                        *loss = (sum.ln() + max - target_logit) as f64;
                        let inv = 1.0 / sum;
                        for v in row.iter_mut() {
                            *v *= inv * scale;
                        }
                        row[t] -= scale;
                        pad.fill(0.0);
                    })
            });
        }
    }
    Ok(losses.iter().sum())
}
