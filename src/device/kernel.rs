//! The kernel door: how an op family runs its own kernels on any backend.
//!
//! An op family (`src/ops/<family>/`, or a crate of your own) describes one call of one of
//! its kernels as a value implementing [`OpKernel`]: the call holds its typed operands
//! (tensors, scalars, token ids), says how to check them, how many floating-point
//! operations the call executes, and how it runs on each backend: [`OpKernel::cpu`] on the
//! host, [`OpKernel::cuda`] through the CUDA backend's public launch API
//! ([`CudaBackend::load_kernels`], [`CudaBackend::launch_kernel`]). [`Backend::run`] is the op
//! wrapper, written once for every op: it runs the check, opens the op's ledger span with
//! its name, the label of the tensor it writes and its FLOPs, dispatches the call to the
//! backend ([`Backend::dispatch`]) and ends the span with the result, so a failed op records
//! neither its flops nor its event. The meta backend runs nothing, so the ledger's spans and
//! FLOP counts are the same on every backend, and a new op needs nothing from it.
//!
//! ```
//! use trainkit::device::{Backend, CpuBackend, CudaBackend, OpKernel};
//! use trainkit::error::Result;
//! use trainkit::memory::MemoryCategory;
//! use trainkit::tensor::{DType, Tensor};
//!
//! /// `out = 2 · x`, on the CPU only.
//! struct Double<'a> {
//!     out: &'a mut Tensor,
//!     x: &'a Tensor,
//! }
//!
//! impl OpKernel for Double<'_> {
//!     fn name(&self) -> &'static str {
//!         "double"
//!     }
//!     fn label(&self) -> &str {
//!         self.out.label()
//!     }
//!     fn check(&self) -> Result<()> {
//!         trainkit::device::ensure_same_shape("double", self.out, self.x)
//!     }
//!     fn flops(&self) -> u64 {
//!         self.x.numel() as u64
//!     }
//!     fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
//!         let x = trainkit::device::cpu::read(self.x);
//!         trainkit::device::cpu::write(self.out, false, |o| {
//!             for (o, x) in o.iter_mut().zip(x.iter()) {
//!                 *o = 2.0 * x;
//!             }
//!         });
//!         Ok(())
//!     }
//! }
//!
//! let be = CpuBackend::new();
//! let x = be.upload(&[1.0, 2.0], &[2], DType::F32, MemoryCategory::Activations, "x")?;
//! let mut out = be.zeros(&[2], DType::F32, MemoryCategory::Activations, "out")?;
//! be.run(&mut Double { out: &mut out, x: &x })?;
//! assert_eq!(be.to_f32(&out)?, vec![2.0, 4.0]);
//! # Ok::<(), trainkit::error::Error>(())
//! ```

use super::cpu::CpuBackend;
use super::cuda::CudaBackend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// One call of an op family's kernel, with its operands: what [`Backend::run`](super::Backend::run) checks,
/// counts and dispatches to the backend that holds the tensors.
///
/// A call borrows its tensors (`&'a mut Tensor` for what it writes, `&'a Tensor` for what
/// it reads), so an op family's public function builds the call and hands it to
/// [`Backend::run`](super::Backend::run). The CPU twin and the CUDA launch of the same call
/// must compute the same thing; the family's tests hold them together on the CUDA emulator.
pub trait OpKernel {
    /// The op's name: the ledger span's name and the first word of its errors.
    fn name(&self) -> &'static str;

    /// The label of the tensor the call writes (the ledger span's label).
    fn label(&self) -> &str;

    /// Checks the operands: the contract every backend shares (shapes, dtypes that hold
    /// numbers, lengths). A backend's own constraints are checked by its launch.
    fn check(&self) -> Result<()>;

    /// The floating-point operations the call executes, the same count on every backend
    /// (each multiply, add, exp, square root or division counting one).
    fn flops(&self) -> u64;

    /// Runs the call on the host (operands checked).
    fn cpu(&mut self, be: &CpuBackend) -> Result<()>;

    /// Runs the call on the CUDA backend (operands checked). The default is an error
    /// naming the op: a family that has no CUDA kernel runs on the CPU only.
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let _ = be;
        Err(Error::Backend {
            backend: "cuda",
            message: format!(
                "the op `{}` has no CUDA kernel: run it on the CPU (`--device cpu`), or give its \
                 OpKernel a `cuda` launch",
                self.name()
            ),
        })
    }
}

/// Fails unless `a` and `b` have the same shape: the check of most element-wise calls.
pub fn ensure_same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    super::cpu::ensure(a.shape() == b.shape(), op, || {
        format!(
            "`{}` has shape {:?} and `{}` has shape {:?}: they must be equal",
            a.label(),
            a.shape(),
            b.label(),
            b.shape()
        )
    })
}
