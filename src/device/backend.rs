//! The `Backend` trait: the small seam every device implements.
//!
//! A backend holds buffers (zeros, empty, upload, read, copy, offload, fetch), runs a few
//! element-wise and reduction primitives and the matrix product (its bias as a parameter;
//! the fused GELU and bias-gradient forms are calls of the linear family,
//! [`crate::ops::linear`]), and is the kernel door through which every op family
//! runs its own kernels ([`Backend::run`] over an [`OpKernel`], see
//! [`crate::device::OpKernel`]). Op families (norms, rotary, attention, losses, optimizer
//! updates) are not methods here: each owns its folder under `src/ops/` (or
//! `src/optim/`) with its operand check, FLOP count, CPU twin and CUDA launch.
//!
//! Each op, a primitive or a family's call, is checked and spanned in one place: the
//! provided methods here run the shared operand check, open the span ([`Ledger::op`]) with
//! the op's name, the label of the tensor it writes and its floating-point operations,
//! call the backend's kernel method (or, for a call, [`Backend::dispatch`]) and end the
//! span with the result, so a failed op records neither its flops nor its event. A backend
//! implements the `*_kernel` methods and `dispatch` only: a kernel may assume that its
//! operands passed the shared check, records no span, and checks only what is its own
//! (the CUDA backend's dtype rules, for example). The meta backend computes nothing, so it
//! records the same spans and FLOP counts as the CPU.

use super::cpu;
use super::primitives;
use super::{CustomKernel, Device, OpKernel};
use crate::error::Result;
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Tensor};
use std::fmt::Debug;
use std::sync::Arc;

/// The seam between model code and hardware: a device's buffers and ops.
///
/// Model and optimizer code is written once against this trait; `CpuBackend` is the
/// reference, GPU backends implement the same ops. Shapes follow one convention: a tensor
/// used as a matrix has all leading dimensions as rows and its last dimension as columns.
/// Outputs are written in the output tensor's dtype; arithmetic is f32, and bf16 values
/// are rounded (to nearest even) only when stored. Unless a method says it accumulates,
/// it overwrites its output.
///
/// Callers use the op methods (`matmul`, `add`, `run`, ...); a backend implements the
/// kernel methods (`matmul_kernel`, `upload_kernel`, ...) and [`Backend::dispatch`], and
/// leaves the op methods as they are. Each op method checks its operands with the contract
/// every backend shares, opens the op's ledger span ([`Ledger::op`]) with the op's name,
/// the label of the tensor it writes and its floating-point operations, runs the kernel
/// and ends the span with the kernel's result (a failed op records neither flops nor an
/// event); a kernel is called only with operands that passed the check, and records no
/// span of its own.
pub trait Backend: Debug + Send + Sync {
    /// Short name: `cpu`, `cuda`.
    fn name(&self) -> &'static str;

    /// The device this backend runs on.
    fn device(&self) -> Device;

    /// What the backend runs on, in words: its name, or for a GPU the device, its
    /// architecture and the library files it loaded (`NVIDIA H100 80GB HBM3 (sm_90; NVRTC
    /// 13.0 /…/libnvrtc.so.13, cuBLASLt 130000 /…/libcublasLt.so.13, driver /…)`).
    fn describe(&self) -> String {
        self.name().to_string()
    }

    /// This backend as trainkit's CUDA backend, when it is one (for NCCL, which queues its
    /// work on the backend's stream).
    fn as_cuda(&self) -> Option<&super::cuda::CudaBackend> {
        None
    }

    /// The ledger that counts every buffer this backend allocates.
    fn ledger(&self) -> &Ledger;

    /// Whether tensors hold elements: false for the meta backend, whose tensors have a
    /// shape and ledger bytes only (so initial values need not be drawn for it).
    fn holds_data(&self) -> bool {
        true
    }

    /// Waits until queued work is done (no-op on the CPU).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The device's own memory numbers (a GPU's pool and `cuMemGetInfo`), to show beside
    /// the ledger's; `None` on the CPU.
    fn device_memory(&self) -> Option<super::cuda::GpuMemory> {
        None
    }

    /// Starts a new high-water mark of [`Backend::device_memory`] (no-op on the CPU).
    fn reset_device_peak(&self) {}

    /// Runs one call of an op family's kernel (the op wrapper, written once for every op):
    /// checks the operands ([`OpKernel::check`]), opens the op's ledger span with its
    /// name, the label of the tensor it writes and its FLOPs, dispatches the call to this
    /// backend ([`Backend::dispatch`]) and ends the span with the result, so a failed call
    /// records neither its flops nor its event.
    fn run(&self, call: &mut dyn OpKernel) -> Result<()> {
        call.check()?;
        let op = self.ledger().op(call.name(), call.flops(), call.label());
        op.finish(self.dispatch(call))
    }

    /// The kernel door: runs a checked call on this backend, inside its ledger span
    /// ([`Backend::run`] is the way in). The CPU backend runs [`OpKernel::cpu`], the CUDA
    /// backend [`OpKernel::cuda`], and the meta backend, whose tensors hold no data,
    /// nothing.
    fn dispatch(&self, call: &mut dyn OpKernel) -> Result<()>;

    /// A zero-filled tensor.
    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor>;

    /// A tensor for an op to overwrite entirely: its contents are unspecified (stale
    /// values of a reused buffer, never uninitialized memory). Backends without a cheaper
    /// way return zeros.
    fn empty(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.zeros(shape, dtype, category, label)
    }

    // ---- Ops: the shared check, the ledger span, the kernel. ----

    /// A tensor holding `data` (host values, row-major), rounded to `dtype`. Fails unless
    /// `shape` holds `data.len()` elements.
    fn upload(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        cpu::elementwise::check_upload(data, shape, dtype, label)?;
        let op = self.ledger().op("upload", 0, label);
        op.finish(self.upload_kernel(data, shape, dtype, category, label))
    }

    /// The elements as f32, in row-major order.
    fn to_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        let op = self.ledger().op("to_f32", 0, t.label());
        op.finish(self.to_f32_kernel(t))
    }

    /// A new tensor with the same dtype, shape and elements.
    fn copy(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        let op = self.ledger().op("copy", 0, label);
        op.finish(self.copy_kernel(t, category, label))
    }

    /// Moves `t` into host memory held for the device: the result has `t`'s shape, dtype,
    /// elements and label, under [`MemoryCategory::Offloaded`], and `t` is freed. A GPU
    /// backend copies on its own stream into page-locked memory, so compute goes on while
    /// the copy runs; the CPU's copy is a separately accounted host buffer.
    fn offload(&self, t: Tensor) -> Result<Tensor> {
        let op = self.ledger().op("offload", 0, t.label());
        op.finish(self.offload_kernel(t))
    }

    /// Brings a tensor [`Backend::offload`] moved to host memory back to the device, under
    /// `category` (its label kept); the host copy is freed. A GPU backend starts the copy
    /// on its own stream at once and makes compute wait for it only where the tensor is
    /// first used, so a fetch issued early (the next layer's activations during this
    /// layer's backward) overlaps with compute.
    fn fetch(&self, t: Tensor, category: MemoryCategory) -> Result<Tensor> {
        let op = self.ledger().op("fetch", 0, t.label());
        op.finish(self.fetch_kernel(t, category))
    }

    /// Host memory for an optimizer that runs on the host
    /// ([`crate::TrainerOptions::optimizer_offload`]): a CPU backend whose tensors live in
    /// host memory and are counted in this backend's ledger under
    /// [`MemoryCategory::Offloaded`], whatever category they are created with, so that
    /// one ledger shows device and host bytes apart. Every call returns the same backend.
    /// `None` for a backend with no host memory of its own (the default: a backend written
    /// outside trainkit says how it reaches the host by overriding this and
    /// [`Backend::transfer_kernel`]).
    fn host(&self) -> Option<Arc<dyn Backend>> {
        None
    }

    /// `dst = src` across the host boundary, bytes as they are: one of the two is this
    /// backend's tensor and the other its [`Backend::host`]'s (a gradient on its way to
    /// the host, updated weights on their way back). Both have the same dtype and number
    /// of elements. The copy is done when this returns: the host side may be read or
    /// written at once ([`Backend::transfer_queued`] does not wait).
    fn transfer(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        self.transfer_queued(dst, src)?;
        self.settle(dst)?;
        self.settle(src)
    }

    /// [`Backend::transfer`], queued where the backend can copy asynchronously (CUDA, from
    /// and to page-locked host memory, on its copy stream): the device side is ordered as
    /// usual, but the host side must not be read (`dst`) or written (`src`) before
    /// [`Backend::settle`] has waited for it. Dropping it is safe at any time.
    fn transfer_queued(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        cpu::ensure(
            dst.dtype() == src.dtype() && dst.numel() == src.numel(),
            "transfer",
            || {
                format!(
                    "`{}` ({} × {}) cannot receive `{}` ({} × {}): the dtype and the number \
                     of elements must agree",
                    dst.label(),
                    dst.numel(),
                    dst.dtype(),
                    src.label(),
                    src.numel(),
                    src.dtype()
                )
            },
        )?;
        let op = self.ledger().op("transfer", 0, dst.label());
        op.finish(self.transfer_kernel(dst, src))
    }

    /// Waits on the host until the copies [`Backend::transfer_queued`] queued into or out
    /// of the host tensor `t` have run. The default does nothing: a backend whose
    /// transfers finish before they return has nothing to wait for.
    fn settle(&self, t: &Tensor) -> Result<()> {
        let _ = t;
        Ok(())
    }

    /// `dst = src`, converting (and rounding) to `dst`'s dtype.
    fn cast(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        self.run(&mut primitives::Cast { dst, src })
    }

    /// Every element set to `value`.
    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        self.run(&mut primitives::Fill { t, value })
    }

    /// `out = a + b`, element-wise.
    fn add(&self, out: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
        self.run(&mut primitives::Add { out, a, b })
    }

    /// `y += alpha * x`, element-wise.
    fn axpy(&self, y: &mut Tensor, alpha: f32, x: &Tensor) -> Result<()> {
        self.run(&mut primitives::Axpy { y, alpha, x })
    }

    /// Rows `dst_row..dst_row + rows` of `dst` set to (with `accumulate`: added to) rows
    /// `src_row..src_row + rows` of `src`, converting to `dst`'s dtype with one rounding:
    /// a chunk of positions taken from or written back to a `[positions, width]` tensor
    /// (both tensors have the same width, their last dimension).
    fn copy_rows(
        &self,
        dst: &mut Tensor,
        dst_row: usize,
        src: &Tensor,
        src_row: usize,
        rows: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.run(&mut primitives::CopyRows {
            dst,
            dst_row,
            src,
            src_row,
            rows,
            accumulate,
        })
    }

    /// `x *= alpha`, element-wise.
    fn scale(&self, x: &mut Tensor, alpha: f32) -> Result<()> {
        self.run(&mut primitives::Scale { x, alpha })
    }

    /// Sum of squares of all elements, accumulated in f64 in a fixed order.
    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        let mut call = primitives::SumSquares { x, total: 0.0 };
        self.run(&mut call)?;
        Ok(call.total)
    }

    /// The sum of squares of every element of every tensor in `xs`, accumulated in f64:
    /// the squared global gradient norm, as one `sum_squares` span labelled `gradients`
    /// (a GPU sums every tensor in one pass with a single read back to the host).
    fn sum_squares_all(&self, xs: &[&Tensor]) -> Result<f64> {
        let mut call = primitives::SumSquaresAll { xs, total: 0.0 };
        self.run(&mut call)?;
        Ok(call.total)
    }

    /// Each tensor's sum of squares in f64, as [`Backend::sum_squares`] gives it (a GPU
    /// sums them all in one pass with a single read back to the host).
    fn sum_squares_each(&self, xs: &[&Tensor]) -> Result<Vec<f64>> {
        let mut call = primitives::SumSquaresEach {
            xs,
            totals: vec![0.0; xs.len()],
        };
        self.run(&mut call)?;
        Ok(call.totals)
    }

    /// `out (+)= op(a) · op(b) (+ bias)` with f32 accumulation, where `op` transposes when
    /// `trans_a` / `trans_b` is set. `out` is `[m, n]`, `op(a)` is `[m, k]`, `op(b)` is
    /// `[k, n]`; `bias` (length n) is added to every row. With `accumulate` the product is
    /// added to `out`'s contents and rounded once.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        cpu::ensure_float("matmul", &[out, a, b])?;
        cpu::matmul::dims(out, a, b, bias, trans_a, trans_b)?;
        let flops = cpu::matmul::flops(out, a, bias.is_some(), trans_a);
        let op = self.ledger().op("matmul", flops, out.label());
        op.finish(self.matmul_kernel(out, a, b, bias, trans_a, trans_b, accumulate))
    }

    /// `dbias += column sums of dout` (the bias gradient of a matmul).
    fn bias_backward(&self, dbias: &mut Tensor, dout: &Tensor) -> Result<()> {
        self.run(&mut primitives::BiasBackward { dbias, dout })
    }

    /// Runs a kernel written outside trainkit ([`CustomKernel`]) element-wise over the
    /// elements of `outputs[0]`: each output is read and written, each input read, and
    /// `scalars` passed by value (see [`crate::device::custom`] for the convention). The
    /// span is named by [`CustomKernel::name`] and carries
    /// [`CustomKernel::flops_per_element`] per element of `outputs[0]`. The CPU backend
    /// runs the kernel's CPU twin, the CUDA backend compiles its CUDA source (once,
    /// through NVRTC and the kernel cache) and launches it, the meta backend computes
    /// nothing.
    fn custom(
        &self,
        kernel: &dyn CustomKernel,
        outputs: &mut [&mut Tensor],
        inputs: &[&Tensor],
        scalars: &[f32],
    ) -> Result<()> {
        self.run(&mut super::custom::Call {
            kernel,
            outputs,
            inputs,
            scalars,
        })
    }

    // ---- Kernels: what a backend implements. ----
    //
    // Each is called by the op of the same name with operands that passed the op's shared
    // check, inside the op's ledger span: a kernel checks only its backend's own
    // constraints and opens no span.

    /// The kernel of [`Backend::upload`]: `shape` holds `data.len()` elements.
    fn upload_kernel(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor>;

    /// The kernel of [`Backend::to_f32`].
    fn to_f32_kernel(&self, t: &Tensor) -> Result<Vec<f32>>;

    /// The kernel of [`Backend::copy`].
    fn copy_kernel(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor>;

    /// The kernel of [`Backend::offload`]. The default copies into a new buffer of the
    /// backend's own under [`MemoryCategory::Offloaded`] (host memory on the CPU).
    fn offload_kernel(&self, t: Tensor) -> Result<Tensor> {
        let label = t.label().to_string();
        self.copy_kernel(&t, MemoryCategory::Offloaded, &label)
    }

    /// The kernel of [`Backend::fetch`]. The default copies into a new buffer under
    /// `category`.
    fn fetch_kernel(&self, t: Tensor, category: MemoryCategory) -> Result<Tensor> {
        let label = t.label().to_string();
        self.copy_kernel(&t, category, &label)
    }

    /// The kernel of [`Backend::transfer_queued`]: dtypes and sizes agree. It may return
    /// before a copy has run where [`Backend::settle`] waits for it. The default refuses,
    /// as the default [`Backend::host`] has no host memory.
    fn transfer_kernel(&self, dst: &mut Tensor, _src: &Tensor) -> Result<()> {
        Err(crate::error::Error::Backend {
            backend: self.name(),
            message: format!(
                "cannot copy `{}` across the host boundary: this backend has no host memory \
                 (Backend::host)",
                dst.label()
            ),
        })
    }

    /// The kernel of [`Backend::matmul`]: the shapes agree (`out` is `[m, n]`, `op(a)`
    /// `[m, k]`, `op(b)` `[k, n]`, `bias` has `n` elements).
    #[allow(clippy::too_many_arguments)]
    fn matmul_kernel(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()>;
}
