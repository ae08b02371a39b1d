//! The CUDA side of trainkit: the backend ([`CudaBackend`]; the host code of each op
//! family in `ops/<family>.rs`, beside `cpu/<family>.rs` and `kernels/<family>.cu`),
//! kernel sources and their NVRTC compilation, the on-disk cache of compiled PTX, the probe that says whether a
//! usable GPU is present, and the CPU emulator that runs the kernels where there is no
//! GPU ([`KernelEmulator`]).
//!
//! Everything here builds and runs where no CUDA is installed: cudarc loads the CUDA
//! libraries lazily (`dynamic-loading`), and every entry point first checks that the
//! library it needs is present, returning an error (or, for the probe, a reason) instead
//! of letting cudarc panic. [`CudaBackend`] is the [`Backend`](super::Backend); it runs
//! on a GPU, or on the CUDA emulator where there is none (for tests).

pub(crate) mod backend;
pub mod cache;
mod driver;
mod emulated;
mod emulated_offload;
pub mod emulator;
mod gpu;
pub mod kernels;
pub(crate) mod ops;
mod pinned;
pub mod probe;
mod staging;

pub use backend::{ptr as device_ptr, CudaBackend, CudaOptions, Operand, BLOCK, ROWS_PER_BLOCK};
pub use cache::{CacheOutcome, KernelCache};
pub use emulator::KernelEmulator;
pub(crate) use gpu::DeviceBuffer;
pub use gpu::{Args, DevicePtr, GpuMemory};
pub use kernels::{
    compile, find_include_dir, nvrtc_version, CompileOptions, KernelFile, KERNEL_FILES,
};
pub use ops::embedding::TokenBuckets;
pub use probe::{probe, CudaInfo};
