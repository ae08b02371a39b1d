//! The fused AdamW update (PyTorch semantics), reading the step's gradient multiplier on
//! the device and writing the bf16 or f16 compute copy in the same pass.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/adamw.cu`, listed once in
//! [`KERNELS`].

use super::AdamWStep;
use crate::device::cuda::ops::elementwise::launch_cast;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// The kernels of `kernels/adamw.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "adamw.cu",
    source: include_str!("../../../kernels/adamw.cu"),
    kernels: &[
        "adamw_f32_bf16",
        "adamw_f32_f16",
        "adamw_bf16_bf16",
        "adamw_f16_f16",
        "adamw_f32_bf16_bf16m",
        "adamw_bf16_bf16_bf16m",
    ],
};

/// The kernel suffix `{G}_{C}` for a gradient of dtype `grad` and the device pointer of the
/// compute copy the kernel writes in its pass (0 for none), or, for a copy no kernel
/// writes (f32, or a 16-bit dtype other than a 16-bit gradient's), the copy to cast after.
pub(crate) fn compute_copy(
    grad: DType,
    compute: Option<&mut Tensor>,
) -> Result<(String, u64, Option<&mut Tensor>)> {
    let half = |d: DType| matches!(d, DType::Bf16 | DType::F16);
    Ok(match compute {
        Some(c) if half(c.dtype()) && (grad == DType::F32 || grad == c.dtype()) => {
            (format!("{grad}_{}", c.dtype()), ptr(c)?, None)
        }
        other => {
            let c = if half(grad) { grad } else { DType::Bf16 };
            (format!("{grad}_{c}"), 0, other)
        }
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    be: &CudaBackend,
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
    compute: Option<&mut Tensor>,
) -> Result<()> {
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
    // bf16 moments (with an f32 or bf16 gradient: the shared check).
    let moments = if m.dtype() == DType::Bf16 {
        "_bf16m"
    } else {
        ""
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    be.launch(
        &format!("adamw_{suffix}{moments}"),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(param)?)
            .ptr(ptr(grad)?)
            .ptr(ptr(m)?)
            .ptr(ptr(v)?)
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
