//! Devices and backends: the runtime choice of where training runs.

mod backend;
pub(crate) mod cpu;
pub mod cuda;

pub use backend::{AdamWStep, Backend};
pub use cpu::CpuBackend;

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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
    /// The best device available, and why it was chosen. This build has no GPU backend,
    /// so it is the CPU, with the reason and what the CUDA probe ([`cuda::probe`]) found.
    pub fn best() -> (Device, String) {
        let found = match cuda::probe() {
            Ok(info) => format!("found {info}"),
            Err(reason) => reason,
        };
        (
            Device::Cpu,
            format!("using the CPU: this build of trainkit has no CUDA backend yet ({found})"),
        )
    }

    /// A backend running on this device.
    pub fn backend(self) -> Result<Arc<dyn Backend>> {
        match self {
            Device::Cpu => Ok(Arc::new(CpuBackend::new())),
            Device::Cuda(i) => Err(Error::Backend {
                backend: "cuda",
                message: format!(
                    "cannot use cuda:{i}: this build of trainkit has no CUDA backend yet; \
                     use the CPU (`--device cpu`)"
                ),
            }),
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
