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
