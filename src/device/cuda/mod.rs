//! The CUDA side of trainkit: kernel sources and their NVRTC compilation, the on-disk
//! cache of compiled PTX, the probe that says whether a usable GPU is present, and the
//! CPU emulator that runs the kernels where there is no GPU ([`KernelEmulator`]).
//!
//! Everything here builds and runs where no CUDA is installed: cudarc loads the CUDA
//! libraries lazily (`dynamic-loading`), and every entry point first checks that the
//! library it needs is present, returning an error (or, for the probe, a reason) instead
//! of letting cudarc panic. There is no CUDA [`Backend`](super::Backend) yet: these are
//! its parts.

pub mod cache;
pub mod embedding;
pub mod emulator;
pub mod kernels;
pub mod probe;

pub use cache::{CacheOutcome, KernelCache};
pub use emulator::KernelEmulator;
pub use kernels::{
    compile, find_include_dir, nvrtc_version, CompileOptions, KernelFile, KERNEL_FILES,
};
pub use probe::{probe, CudaInfo};
