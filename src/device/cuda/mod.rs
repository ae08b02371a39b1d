//! The CUDA side of trainkit: the backend ([`CudaBackend`]; the host code of each op
//! family in `ops/<family>.rs`, beside `cpu/<family>.rs` and `kernels/<family>.cu`),
//! kernel sources and their NVRTC compilation, the on-disk cache of compiled kernels, the
//! probe that says whether a usable GPU is present, and the CPU emulator that runs the
//! kernels where there is no GPU ([`KernelEmulator`]).
//!
//! Everything here builds and runs where no CUDA is installed: NVRTC and cuBLASLt are
//! opened by trainkit on first use ([`libraries`]), the driver by cudarc lazily
//! (`dynamic-loading`), and every entry point first checks that the library it needs is
//! present, returning an error (or, for the probe, a reason) instead of panicking.
//! [`CudaBackend`] is the [`Backend`](super::Backend); it runs on a GPU, or on the CUDA
//! emulator where there is none (for tests).

pub(crate) mod backend;
pub mod cache;
pub mod cublaslt;
mod driver;
mod driver_error;
mod emulated;
mod emulated_offload;
pub mod emulator;
mod gpu;
pub mod kernels;
pub mod libraries;
pub mod nvrtc;
pub(crate) mod ops;
#[cfg(test)]
pub(crate) mod parity;
mod pinned;
mod primitives;
pub mod probe;
mod product_tuning;
mod staging;
pub mod timing;

pub use backend::{
    ptr as device_ptr, CudaBackend, CudaOptions, HostTransfers, Operand, BLOCK, ROWS_PER_BLOCK,
};
pub use cache::{CacheOutcome, KernelCache, Versions};
pub use emulator::KernelEmulator;
pub(crate) use gpu::DeviceBuffer;
#[cfg(feature = "nccl")]
pub(crate) use gpu::{AllocError, Gpu};
pub use gpu::{Args, DevicePtr, GpuMemory, UploadStats};
pub use kernels::{
    compile, find_include_dir, kernel_files, nvrtc_version, CompileOptions, Compiled, KernelFile,
};
pub use probe::{probe, CudaInfo};
pub use product_tuning::{ChoiceSource, ProductChoice};
pub use timing::KernelTime;
