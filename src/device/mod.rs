//! Devices and backends: the runtime choice of where training runs.

mod backend;
pub mod cpu;
pub mod cuda;
pub mod custom;
mod kernel;
mod meta;
mod primitives;

pub use backend::Backend;
pub use cpu::{Blas, CpuBackend, BLAS_ENV};
pub use cuda::CudaBackend;
pub use custom::CustomKernel;
pub use kernel::{ensure_same_shape, OpKernel};
pub use meta::MetaBackend;

use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// An op fence ([`crate::memory::Ledger::set_op_fence`]) that waits for `backend`'s queued
/// work: with it set on the backend's ledger, each recorded op span times the device's work
/// for the op (a no-op wait on the CPU, whose ops finish before they return). The fence
/// holds the backend weakly (the backend owns the ledger that holds the fence), and does
/// nothing once the backend is gone.
pub fn op_fence(backend: &Arc<dyn Backend>) -> crate::memory::OpFence {
    let weak = Arc::downgrade(backend);
    Arc::new(move || weak.upgrade().map_or(Ok(()), |b| b.synchronize()))
}

/// Where training runs, chosen at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The host CPU (the reference backend).
    Cpu,
    /// An NVIDIA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// The best device available, and why it was chosen: the first GPU when the CUDA
    /// driver, NVRTC, cuBLAS and cuBLASLt load, a device answers ([`cuda::probe()`]) and the
    /// CUDA headers NVRTC needs are found ([`cuda::find_include_dir`]); otherwise the CPU,
    /// with the reason.
    pub fn best() -> (Device, String) {
        match cuda::probe() {
            Ok(info) => match cuda::find_include_dir() {
                Ok(_) => (Device::Cuda(info.ordinal), format!("using {info}")),
                Err(e) => (Device::Cpu, format!("using the CPU: found {info}, but {e}")),
            },
            Err(reason) => (Device::Cpu, format!("using the CPU: {reason}")),
        }
    }

    /// A backend running on this device. The CPU's runs its matrix products on the CBLAS
    /// library `$TRAINKIT_BLAS` names, if set ([`CpuBackend::from_env`]).
    pub fn backend(self) -> Result<Arc<dyn Backend>> {
        self.backend_with(cuda::CudaOptions::default())
    }

    /// A backend running on this device, a GPU's with `options` (the CPU has none).
    pub fn backend_with(self, options: cuda::CudaOptions) -> Result<Arc<dyn Backend>> {
        match self {
            Device::Cpu => {
                let cpu = CpuBackend::from_env()?;
                if let Some(blas) = cpu.blas() {
                    log::info!("CPU matrix products: {blas}");
                }
                Ok(Arc::new(cpu))
            }
            Device::Cuda(i) => Ok(Arc::new(cuda::CudaBackend::with_options(i, options)?)),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
