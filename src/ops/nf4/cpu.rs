//! NF4 rows dequantized on the host: the CPU twin of `kernels/nf4.cu`.

use super::format::{dequantize_into, Layout, BLOCK};
use crate::device::cpu::write;
use crate::tensor::{Storage, Tensor};
use rayon::prelude::*;

/// `out = elements start.. of `w` (packed NF4), dequantized and rounded to `out`'s dtype.
pub(crate) fn dequantize(out: &mut Tensor, w: &Tensor, start: usize) {
    let Storage::Nf4 { bytes, len } = w.storage() else {
        unreachable!("checked by the call: `w` is NF4 in host memory")
    };
    let layout = Layout::of(*len);
    let first = start / BLOCK;
    let last = (start + out.numel()).div_ceil(BLOCK).min(layout.blocks);
    let absmax = super::format::absmaxes_of(bytes, &layout, first..last);
    write(out, false, |o| {
        // Chunks of whole absmax blocks (from `start`), in parallel.
        let head = (BLOCK - start % BLOCK) % BLOCK;
        let (first_part, rest) = o.split_at_mut(head.min(o.len()));
        dequantize_into(bytes, &absmax, first * BLOCK, start, first_part);
        let base = start + first_part.len();
        rest.par_chunks_mut(BLOCK * 64)
            .enumerate()
            .for_each(|(i, chunk)| {
                dequantize_into(bytes, &absmax, first * BLOCK, base + i * BLOCK * 64, chunk)
            });
    });
}
