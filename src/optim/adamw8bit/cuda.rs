//! The 8-bit AdamW update: block-wise quantized moments dequantized, updated and
//! requantized in one pass, one block of threads per quantization block.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/adamw8bit.cu`, listed once in
//! [`KERNELS`].

use super::QuantizedMoments;
use super::QUANT_BLOCK;
use crate::device::cuda::ops::elementwise::launch_cast;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::optim::adamw::cuda::compute_copy;
use crate::optim::adamw::AdamWStep;
use crate::tensor::Tensor;

/// The kernels of `kernels/adamw8bit.cu`, named once: the backend launches these names,
/// NVRTC and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "adamw8bit.cu",
    source: include_str!("../../../kernels/adamw8bit.cu"),
    kernels: &[
        "adamw8bit_f32_bf16",
        "adamw8bit_f32_f16",
        "adamw8bit_bf16_bf16",
        "adamw8bit_f16_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn update(
    be: &CudaBackend,
    param: &mut Tensor,
    grad: &Tensor,
    moments: QuantizedMoments<'_>,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
    compute: Option<&mut Tensor>,
) -> Result<()> {
    // The kernel's one element per thread and its shared-memory reduction assume this.
    const _: () = assert!(BLOCK as usize == QUANT_BLOCK);
    let n = param.numel();
    let scale = match scale {
        Some(s) => ptr(s)?,
        None => 0,
    };
    if n == 0 {
        return Ok(());
    }
    // The kernel writes a 16-bit compute copy in its pass; another is cast after.
    let (suffix, fused, after) = compute_copy(grad.dtype(), compute)?;
    let (step_size, bc2_sqrt, decay) = hp.constants();
    be.launch(
        &format!("adamw8bit_{suffix}"),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(param)?)
            .ptr(ptr(grad)?)
            .ptr(ptr(moments.m)?)
            .ptr(ptr(moments.m_absmax)?)
            .ptr(ptr(moments.v)?)
            .ptr(ptr(moments.v_absmax)?)
            .ptr(scale)
            .ptr(fused)
            .i64(n)
            .f32(hp.beta1)
            .f32(hp.beta2)
            .f32(hp.eps)
            .f32(hp.grad_scale)
            .f32(step_size)
            .f32(bc2_sqrt)
            .f32(decay),
    )?;
    match after {
        Some(c) => launch_cast(be, c, param),
        None => Ok(()),
    }
}
