//! The host side of each CUDA op family, one file per family beside its CPU twin
//! (`src/device/cpu/<family>.rs`) and its kernels (`kernels/<family>.cu`).
//!
//! Each file implements the CUDA side of an op's kernel method: the
//! [`Backend`](crate::device::Backend) trait has already checked the operands (the
//! contract every backend shares) and opened the op's ledger span, so a file checks only
//! what its kernels require of dtypes, picks the kernel by the dtypes of its tensors and
//! launches it; and each file with a
//! kernel source declares that source and the names of its kernels once, in its
//! `KERNELS` ([`KernelFile`](super::kernels::KernelFile)), registered for [`super::kernels::kernel_files`].
//! [`super::CudaBackend`]'s `Backend` impl only dispatches here; `custom.rs` runs kernels
//! written outside trainkit ([`crate::device::CustomKernel`]).

pub(crate) mod custom;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod reductions;
