//! Token and position embeddings.

use crate::device::cpu::{read, write};

use crate::tensor::Tensor;
use rayon::prelude::*;

/// `(T, C)` of a checked `[B, T, C]` tensor.
fn time_width(x: &Tensor) -> (usize, usize) {
    match *x.shape() {
        [_, t, c] => (t, c),
        _ => (0, 0),
    }
}

pub(crate) fn forward(
    out: &mut Tensor,
    tokens: &[u32],
    wte: &Tensor,
    wpe: Option<&Tensor>,
    positions: Option<&[u32]>,
) {
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
                    let pos = positions.map_or(row % t, |p| p[row] as usize);
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

pub(crate) fn backward(
    dwte: &mut Tensor,
    dwpe: Option<&mut Tensor>,
    dout: &Tensor,
    tokens: &[u32],
    positions: Option<&[u32]>,
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
            let pos = positions.map_or(row % t, |p| p[row] as usize);
            for (a, v) in dp[pos * c..(pos + 1) * c].iter_mut().zip(g) {
                *a += v;
            }
        }
    });
}
