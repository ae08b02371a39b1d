//! The CUDA driver's failures as trainkit's errors, out of memory told apart.

use crate::error::Error;
use cudarc::driver::{result as drv, sys as drv_sys};

/// A driver call's failure as trainkit's error, saying what was being done:
/// [`Error::OutOfMemory`] for `CUDA_ERROR_OUT_OF_MEMORY` (the backend adds its figures).
pub(super) fn driver_error(what: &str, e: drv::DriverError) -> Error {
    if is_oom(e) {
        return Error::OutOfMemory {
            message: format!("{what}: the GPU is out of memory (CUDA_ERROR_OUT_OF_MEMORY)"),
        };
    }
    Error::Backend {
        backend: "cuda",
        message: format!("{what}: {e}"),
    }
}

/// Whether the driver ran out of device (or page-locked host) memory.
pub(super) fn is_oom(e: drv::DriverError) -> bool {
    e.0 == drv_sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
}
