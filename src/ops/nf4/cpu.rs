//! NF4 rows dequantized on the host: the CPU twin of `kernels/nf4.cu`.

use super::format::{absmaxes_of, dequantize_into, Layout, BLOCK};
use crate::device::cpu::write;
use crate::tensor::{Storage, Tensor};
use rayon::prelude::*;

/// `out = elements start.. of `w` (packed NF4, in its parts), dequantized and rounded to
/// `out`'s dtype.
pub(crate) fn dequantize(out: &mut Tensor, w: &Tensor, start: usize) {
    let Storage::Nf4 { bytes, len, parts } = w.storage() else {
        unreachable!("checked by the call: `w` is NF4 in host memory")
    };
    let spans = parts.of(*len);
    let end = start + out.numel();
    write(out, false, |o| {
        for (part_start, part_len, byte) in spans {
            let (from, to) = (start.max(part_start), end.min(part_start + part_len));
            if from >= to {
                continue;
            }
            let layout = Layout::of(part_len);
            let packed = &bytes[byte..byte + layout.bytes];
            let local = from - part_start;
            part(packed, &layout, local, &mut o[from - start..to - start]);
        }
    });
}

/// Elements `start..start + out.len()` of one part (`packed`, laid out as `layout`).
fn part(packed: &[u8], layout: &Layout, start: usize, out: &mut [f32]) {
    let first = start / BLOCK;
    let last = (start + out.len()).div_ceil(BLOCK).min(layout.blocks);
    let absmax = absmaxes_of(packed, layout, first..last);
    // The head up to a block boundary, then chunks of whole blocks in parallel.
    let head = (BLOCK - start % BLOCK) % BLOCK;
    let (head_part, rest) = out.split_at_mut(head.min(out.len()));
    dequantize_into(packed, &absmax, first * BLOCK, start, head_part);
    let base = start + head_part.len();
    rest.par_chunks_mut(BLOCK * 64)
        .enumerate()
        .for_each(|(i, chunk)| {
            dequantize_into(packed, &absmax, first * BLOCK, base + i * BLOCK * 64, chunk)
        });
}
