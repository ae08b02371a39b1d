//! NF4 rows dequantized on the host: the CPU twin of `kernels/nf4.cu`, which is the
//! layout's own dequantization ([`super::format::dequantize_range`]).

use super::format::dequantize_range;
use crate::device::cpu::write;
use crate::tensor::{Storage, Tensor};

/// `out = elements start.. of `w` (packed NF4, in its parts), dequantized and rounded to
/// `out`'s dtype.
pub(crate) fn dequantize(out: &mut Tensor, w: &Tensor, start: usize) {
    let Storage::Nf4 { bytes, len, parts } = w.storage() else {
        unreachable!("checked by the call: `w` is NF4 in host memory")
    };
    write(out, false, |o| {
        dequantize_range(bytes, *len, *parts, start, o)
    });
}
