//! The column blocks of a fused projection on the CPU: an update added to its columns,
//! and the gradient of those columns taken out; and the dropout of an update's input.
//! f32 arithmetic, one rounding at the store, as `kernels/lora.cu`.

use super::Keep;
use crate::device::cpu::{read, write};
use crate::rng::counter_bits;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Whether element `i` is kept: the top 24 bits of its random bits (`counter_bits` of
/// `keep.key`) reach `keep.threshold`.
pub(crate) fn kept(keep: &Keep, i: usize) -> bool {
    (counter_bits(keep.key, i as u64) >> 40) >= keep.threshold
}

/// `dst = kept ? src · scale : 0` (or `dst += …` when `accumulate`), on checked operands.
pub(crate) fn dropout(dst: &mut Tensor, src: &Tensor, keep: &Keep, accumulate: bool) {
    let s = read(src);
    write(dst, accumulate, |d| {
        d.par_iter_mut().enumerate().for_each(|(i, d)| {
            let v = if kept(keep, i) {
                s[i] * keep.scale
            } else {
                0.0
            };
            *d = if accumulate { *d + v } else { v };
        })
    });
}

/// `dst[r, offset..offset + width] += src[r, ..]`, on checked operands.
pub(crate) fn add_cols(dst: &mut Tensor, offset: usize, src: &Tensor) {
    let (cols, width) = (dst.rows_cols().1, src.rows_cols().1);
    if width == 0 {
        return;
    }
    let s = read(src);
    write(dst, true, |d| {
        for (d, s) in d.chunks_mut(cols).zip(s.chunks(width)) {
            for (d, s) in d[offset..offset + width].iter_mut().zip(s) {
                *d += s;
            }
        }
    });
}

/// `dst[r, ..] = src[r, offset..offset + width]`, on checked operands.
pub(crate) fn take_cols(dst: &mut Tensor, src: &Tensor, offset: usize) {
    let (cols, width) = (src.rows_cols().1, dst.rows_cols().1);
    if width == 0 {
        return;
    }
    let s = read(src);
    write(dst, false, |d| {
        for (d, s) in d.chunks_mut(width).zip(s.chunks(cols)) {
            d.copy_from_slice(&s[offset..offset + width]);
        }
    });
}

/// DoRA's column norms `n[c] = ‖W_c + scale · D_c‖` (see [`super::dora`]), on checked
/// operands: each feature's sum of squares in f32 in input order, as `kernels/lora.cu`.
pub(crate) fn dora_norm(n: &mut Tensor, w: &Tensor, d: &Tensor, scale: f32, at: &super::Block) {
    let (wv, dv) = (read(w), read(d));
    let (inf, ldw) = (at.in_features, w.rows_cols().1);
    write(n, false, |n| {
        n.par_iter_mut().enumerate().for_each(|(c, n)| {
            let mut acc = 0.0f32;
            for k in 0..inf {
                let wi = if at.transposed {
                    (at.offset + c) * inf + k
                } else {
                    k * ldw + at.offset + c
                };
                let v = wv[wi] + scale * dv[c * inf + k];
                acc += v * v;
            }
            *n = acc.sqrt();
        })
    });
}

/// `y[r, offset + c] = g · (y − b) + b` with `g = m[c] / n[c]` (no bias: `g · y`), on
/// checked operands.
pub(crate) fn dora_scale_cols(
    y: &mut Tensor,
    m: &Tensor,
    n: &Tensor,
    bias: Option<&Tensor>,
    offset: usize,
) {
    let cols = y.rows_cols().1;
    let (m, n) = (read(m), read(n));
    let b = bias.map(read);
    write(y, true, |y| {
        for row in y.chunks_mut(cols) {
            for (c, y) in row[offset..offset + m.len()].iter_mut().enumerate() {
                let g = m[c] / n[c];
                *y = match &b {
                    Some(b) => g * (*y - b[offset + c]) + b[offset + c],
                    None => g * *y,
                };
            }
        }
    });
}

/// `out[c] = (Σ_r dy[r, offset + c] · v[r, c]) / n[c]`, on checked operands: each
/// column's rows in order in f32, as `kernels/lora.cu`.
pub(crate) fn dora_magnitude_grad(
    out: &mut Tensor,
    dy: &Tensor,
    v: &Tensor,
    n: &Tensor,
    offset: usize,
) {
    let (cols, width) = (dy.rows_cols().1, v.rows_cols().1);
    let (dy, v, n) = (read(dy), read(v), read(n));
    let rows = v.len() / width.max(1);
    write(out, false, |out| {
        out.par_iter_mut().enumerate().for_each(|(c, o)| {
            let mut acc = 0.0f32;
            for r in 0..rows {
                acc += dy[r * cols + offset + c] * v[r * width + c];
            }
            *o = acc / n[c];
        })
    });
}
