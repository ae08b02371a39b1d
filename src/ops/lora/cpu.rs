//! The column blocks of a fused projection on the CPU: an update added to its columns,
//! and the gradient of those columns taken out. f32 arithmetic, one rounding at the store,
//! as `kernels/lora.cu`.

use crate::device::cpu::{read, write};
use crate::tensor::Tensor;

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
