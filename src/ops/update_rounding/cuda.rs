//! Writing f32 updates back into bf16 weights on the GPU. CPU twin: `cpu.rs` beside this
//! file. Kernels: `kernels/update_rounding.cu`, listed once in [`KERNELS`].

use super::UpdateRounding;
use crate::device::cuda::backend::{ptr, CudaBackend};
use crate::device::cuda::{Args, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/update_rounding.cu`, named once: the backend launches these
/// names, NVRTC and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "update_rounding.cu",
    source: include_str!("../../../kernels/update_rounding.cu"),
    kernels: &["update_rounding_expand", "update_rounding_round"],
};
inventory::submit!(KERNELS);

pub(crate) fn expand(
    be: &CudaBackend,
    master: &mut Tensor,
    w: &Tensor,
    comp: Option<&Tensor>,
) -> Result<()> {
    let n = w.numel();
    if n == 0 {
        return Ok(());
    }
    be.launch(
        "update_rounding_expand",
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(master)?)
            .ptr(ptr(w)?)
            .ptr(comp.map_or(Ok(0), ptr)?)
            .i64(n),
    )
}

pub(crate) fn round(
    be: &CudaBackend,
    w: &mut Tensor,
    comp: Option<&mut Tensor>,
    master: &Tensor,
    mode: UpdateRounding,
    key: u64,
) -> Result<()> {
    let n = w.numel();
    if n == 0 {
        return Ok(());
    }
    let mode_id = match mode {
        UpdateRounding::Nearest => 0,
        UpdateRounding::Stochastic => 1,
        UpdateRounding::Kahan => 2,
    };
    be.launch(
        "update_rounding_round",
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(w)?)
            .ptr(comp.map_or(Ok(0), |c| ptr(c))?)
            .ptr(ptr(master)?)
            .i64(n)
            .i64(mode_id)
            .i64(key as usize),
    )
}
