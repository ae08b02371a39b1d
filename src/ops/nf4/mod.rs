//! NF4: frozen projection weights in 4.127 bits per element, as QLoRA stores them.
//!
//! - [`format`](mod@format) ([`crate::tensor::nf4`]): bitsandbytes' NF4 with double-quantized
//!   absmaxes, on the host: quantization (when a checkpoint is loaded) and the reference
//!   dequantization.
//! - [`DType::Nf4`](crate::tensor::DType::Nf4) is the packed dtype, in [`Parts`] (one per Hugging Face module of a
//!   fused weight): the ledger and the meta backend count its exact bytes; uploading f32
//!   values to it quantizes them.
//! - [`dequantize`]: elements of an NF4 tensor dequantized to a float tensor, one door
//!   call with a CPU twin (`cpu.rs`) and a CUDA kernel (`cuda.rs` over `kernels/nf4.cu`).
//! - [`matmul`]: the dequantizing product the projections run when their weight is NF4
//!   (`product.rs`): the weight is dequantized a block of rows at a time into a bounded
//!   buffer and each block multiplied as it comes, so no full dequantized weight is kept.

pub(crate) mod cpu;
pub(crate) mod cuda;
mod product;

pub use crate::tensor::nf4 as format;
pub use format::{
    dequantize as dequantize_host, dequantize_parts, dynamic_code, pack, quantize, quantize_parts,
    Layout, Parts, BLOCK, CODE, STATS_BLOCK,
};
pub use product::{matmul, matmul_in_blocks, CHUNK_ELEMENTS};

use crate::device::cpu::{ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};

/// `out = w[start .. start + out.numel()]` (elements of an NF4 tensor, row-major),
/// dequantized and rounded to `out`'s float dtype.
pub fn dequantize(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    w: &Tensor,
    start: usize,
) -> Result<()> {
    be.run(&mut Dequantize { out, w, start })
}

struct Dequantize<'a> {
    out: &'a mut Tensor,
    w: &'a Tensor,
    start: usize,
}

impl OpKernel for Dequantize<'_> {
    fn name(&self) -> &'static str {
        "nf4_dequantize"
    }
    fn label(&self) -> &str {
        self.w.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("nf4_dequantize", &[self.out])?;
        ensure(
            self.w.dtype().is_nf4() && self.start + self.out.numel() <= self.w.numel(),
            "nf4_dequantize",
            || {
                format!(
                    "`{}` ({}, {} elements) must be NF4 and hold elements {}..{}",
                    self.w.label(),
                    self.w.dtype(),
                    self.w.numel(),
                    self.start,
                    self.start + self.out.numel()
                )
            },
        )
    }
    fn flops(&self) -> u64 {
        2 * self.out.numel() as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        if !matches!(self.w.storage(), Storage::Nf4 { .. }) {
            return Err(crate::error::Error::Backend {
                backend: "cpu",
                message: format!("`{}` does not live in host memory", self.w.label()),
            });
        }
        cpu::dequantize(self.out, self.w, self.start);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::dequantize(be, self.out, self.w, self.start)
    }
}
