//! NF4 rows dequantized on the GPU.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/nf4.cu`, listed once in
//! [`KERNELS`].

use crate::device::cuda::backend::{ptr, CudaBackend, BLOCK};
use crate::device::cuda::{Args, KernelFile};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// The kernels of `kernels/nf4.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "nf4.cu",
    source: include_str!("../../../kernels/nf4.cu"),
    kernels: &[
        "nf4_dequantize_f32",
        "nf4_dequantize_bf16",
        "nf4_dequantize_f16",
    ],
};
inventory::submit!(KERNELS);

/// `out = elements start.. of `w` (packed NF4, in its parts), dequantized to `out`'s
/// dtype.
pub(crate) fn dequantize(
    be: &CudaBackend,
    out: &mut Tensor,
    w: &Tensor,
    start: usize,
) -> Result<()> {
    let count = out.numel();
    if count == 0 {
        return Ok(());
    }
    let DType::Nf4(parts) = w.dtype() else {
        unreachable!("checked by the call: `w` is NF4")
    };
    let mut n = [0usize; 3];
    for (slot, (_, len, _)) in n.iter_mut().zip(parts.of(w.numel())) {
        *slot = len;
    }
    be.launch(
        &format!("nf4_dequantize_{}", out.dtype()),
        be.grid(count),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(w)?)
            .i64(start)
            .i64(count)
            .i64(n[0])
            .i64(n[1])
            .i64(n[2]),
    )
}
