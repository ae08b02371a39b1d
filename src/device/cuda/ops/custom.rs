//! Kernels written outside trainkit ([`CustomKernel`]) on the GPU: the source is compiled
//! on first use (NVRTC and the kernel cache on a GPU, the host's C++ compiler on the
//! emulator), then launched element-wise over the first output's elements.
//!
//! CPU twin: the kernel's own [`CustomKernel::cpu`], run by `src/device/custom.rs`.

use super::super::backend::{ptr, CudaBackend, Operand, BLOCK};
use super::super::gpu::Args;
use super::elementwise::launch_cast;
use crate::device::CustomKernel;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// [`crate::device::Backend::custom_kernel`] on the GPU: f32 copies of the operands that
/// are not f32 (in the workspace), one launch, and the copies of bf16 outputs rounded back.
pub(crate) fn custom(
    be: &CudaBackend,
    kernel: &dyn CustomKernel,
    outputs: &mut [&mut Tensor],
    inputs: &[&Tensor],
    scalars: &[f32],
) -> Result<()> {
    let n = outputs.first().map_or(0, |t| t.numel());
    let name = kernel.name();
    be.gpu
        .load_file(&format!("{name}.cu"), kernel.source(), &[name])?;
    if n == 0 {
        return Ok(());
    }
    // Outputs that are not f32 run on an f32 copy, rounded back after the launch.
    let mut widened: Vec<Option<Tensor>> = Vec::with_capacity(outputs.len());
    for t in outputs.iter() {
        widened.push(match be.as_dtype(t, DType::F32)? {
            Operand::Borrowed(_) => None,
            Operand::Owned(copy) => Some(copy),
        });
    }
    let ins: Vec<Operand<'_>> = inputs
        .iter()
        .map(|t| be.as_dtype(t, DType::F32))
        .collect::<Result<_>>()?;
    let mut args = Args::new();
    for (t, copy) in outputs.iter().zip(&widened) {
        args = args.ptr(ptr(copy.as_ref().unwrap_or(t))?);
    }
    for t in &ins {
        args = args.ptr(ptr(t)?);
    }
    for &s in scalars {
        args = args.f32(s);
    }
    be.launch(name, be.grid(n), BLOCK, args.i64(n))?;
    for (t, copy) in outputs.iter_mut().zip(&widened) {
        if let Some(copy) = copy {
            launch_cast(be, t, copy)?;
        }
    }
    Ok(())
}
