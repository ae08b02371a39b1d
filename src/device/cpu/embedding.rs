//! Token and position embeddings.

use super::{btc, ensure, read, write};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Checks the operands of `embedding` (`x` the output) and `embedding_backward` (`x`
/// the output's gradient), the contract every backend shares, and returns
/// `(B, T, C, vocab)`.
pub(crate) fn check(
    op: &'static str,
    x: &Tensor,
    tokens: &[u32],
    wte: &Tensor,
    wpe: Option<&Tensor>,
) -> Result<(usize, usize, usize, usize)> {
    let (b, t, c) = btc(x, op)?;
    let (v, cw) = wte.rows_cols();
    ensure(cw == c, op, || {
        format!("embedding width differs: activations {c}, wte {cw}")
    })?;
    if let Some(wpe) = wpe {
        let (p, cp) = wpe.rows_cols();
        ensure(cp == c, op, || {
            format!("embedding width differs: activations {c}, wpe {cp}")
        })?;
        ensure(t <= p, op, || {
            format!("sequence length {t} exceeds the {p} positions of wpe")
        })?;
    }
    ensure(tokens.len() == b * t, op, || {
        format!("{} tokens for a [{b}, {t}] batch", tokens.len())
    })?;
    if let Some(bad) = tokens.iter().find(|&&tok| tok as usize >= v) {
        return Err(Error::data(
            "tokens",
            format!("token id {bad} is beyond the vocabulary of {v}; use a tokenizer that matches the model's vocab_size"),
        ));
    }
    Ok((b, t, c, v))
}

/// `(T, C)` of a checked `[B, T, C]` tensor.
fn time_width(x: &Tensor) -> (usize, usize) {
    match *x.shape() {
        [_, t, c] => (t, c),
        _ => (0, 0),
    }
}

pub(super) fn forward(out: &mut Tensor, tokens: &[u32], wte: &Tensor, wpe: Option<&Tensor>) {
    let (t, c) = time_width(out);
    if t * c == 0 {
        return;
    }
    let we = read(wte);
    let pe = wpe.map(read);
    write(out, false, |o| {
        o.par_chunks_mut(c).enumerate().for_each(|(row, o)| {
            let tok = tokens[row] as usize;
            let w = &we[tok * c..(tok + 1) * c];
            match &pe {
                Some(pe) => {
                    let pos = row % t;
                    let p = &pe[pos * c..(pos + 1) * c];
                    for i in 0..c {
                        o[i] = w[i] + p[i];
                    }
                }
                None => o.copy_from_slice(w),
            }
        })
    });
}

pub(super) fn backward(
    dwte: &mut Tensor,
    dwpe: Option<&mut Tensor>,
    dout: &Tensor,
    tokens: &[u32],
) {
    let (t, c) = time_width(dout);
    if t * c == 0 {
        return;
    }
    let d = read(dout);
    // Rows are added in token order: deterministic.
    write(dwte, true, |dw| {
        for (row, g) in d.chunks_exact(c).enumerate() {
            let tok = tokens[row] as usize;
            for (a, v) in dw[tok * c..(tok + 1) * c].iter_mut().zip(g) {
                *a += v;
            }
        }
    });
    let Some(dwpe) = dwpe else { return };
    write(dwpe, true, |dp| {
        for (row, g) in d.chunks_exact(c).enumerate() {
            let pos = row % t;
            for (a, v) in dp[pos * c..(pos + 1) * c].iter_mut().zip(g) {
                *a += v;
            }
        }
    });
}
