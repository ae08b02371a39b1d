//! The device layer under the CUDA backend: memory, transfers, kernel launches and
//! matrix products, behind one trait with two implementations: the real GPU
//! ([`super::driver::DriverGpu`], through cudarc) and the emulator
//! ([`super::emulated::EmulatedGpu`], host memory and the kernels compiled for the CPU).
//!
//! The backend ([`super::CudaBackend`]) computes every launch configuration, kernel
//! argument list and matrix layout itself and hands them to this layer, so running it on
//! the emulator checks all of that code, not a copy of it.

use crate::error::{Error, Result};
use crate::tensor::DType;
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A device address (a `CUdeviceptr`; a host address on the emulator). 0 is the null
/// pointer, used for empty buffers.
pub type DevicePtr = u64;

/// An address in page-locked host memory (what [`Gpu::alloc_host`] returns).
pub(crate) type HostPtr = u64;

/// A copy to the device queued by [`Gpu::fetch`] that compute has not yet been made to
/// wait for ([`Gpu::wait_fetched`]).
pub(crate) type Ticket = u64;

/// Why an allocation failed.
#[derive(Debug)]
pub(crate) enum AllocError {
    /// The device has no room for it.
    OutOfMemory,
    /// Anything else, with the driver's message.
    Other(String),
}

/// The device's own view of its memory, for the step report beside the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuMemory {
    /// Bytes the stream-ordered pool holds from the device (`RESERVED_MEM_CURRENT`).
    pub pool_reserved: u64,
    /// Bytes of the pool handed out to live allocations (`USED_MEM_CURRENT`).
    pub pool_used: u64,
    /// The most the pool has held since the last reset (`RESERVED_MEM_HIGH`).
    pub pool_reserved_peak: u64,
    /// Free device memory (`cuMemGetInfo`).
    pub free: u64,
    /// Total device memory (`cuMemGetInfo`).
    pub total: u64,
}

/// Element type of a matrix in a product (cuBLASLt's `cudaDataType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MatrixType {
    /// f32.
    F32,
    /// bf16.
    Bf16,
    /// f16.
    F16,
}

impl MatrixType {
    /// Bytes per element.
    pub(crate) fn bytes(self) -> usize {
        match self {
            MatrixType::F32 => 4,
            MatrixType::Bf16 | MatrixType::F16 => 2,
        }
    }
}

impl TryFrom<DType> for MatrixType {
    type Error = crate::error::Error;

    /// f32, bf16 and f16; u8 codes are no operand of a product.
    fn try_from(d: DType) -> Result<Self> {
        match d {
            DType::F32 => Ok(MatrixType::F32),
            DType::Bf16 => Ok(MatrixType::Bf16),
            DType::F16 => Ok(MatrixType::F16),
            DType::U8 | DType::Nf4(_) => Err(crate::error::Error::Backend {
                backend: "cuda",
                message: format!(
                    "a {d} tensor holds codes, not numbers: matmul takes f32, bf16 or f16 \
                     (an NF4 weight goes through ops::nf4's product)"
                ),
            }),
        }
    }
}

/// One matrix of a product, column-major as cuBLASLt sees it: `rows × cols` as stored,
/// with leading dimension `ld`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MatrixLayout {
    /// Element type.
    pub ty: MatrixType,
    /// Rows as stored (column-major).
    pub rows: u64,
    /// Columns as stored.
    pub cols: u64,
    /// Leading dimension (elements between consecutive columns).
    pub ld: i64,
}

impl MatrixLayout {
    /// The bytes a matrix of this layout spans: `ld` elements a column, `cols` columns.
    pub(crate) fn bytes(&self) -> usize {
        self.ld.max(0) as usize * self.cols as usize * self.ty.bytes()
    }
}

/// `D = alpha · op(A) · op(B) + beta · C (+ bias)` in cuBLASLt's column-major terms, with
/// C the buffer at `c` (D's layout) or D itself. `op(A)` is `m × k`, `op(B)` is `k × n`, D
/// is `m × n`; the bias (one value per row of D, D's element type) is added by the
/// epilogue. With `gelu_aux`,
/// the epilogue also applies GELU (tanh approximation): the value before it is stored at
/// `gelu_aux` (D's type and layout) and D receives GELU of it. With `dgelu_aux`, D
/// receives the product times GELU's derivative at the values there (the input gradient of
/// a GELU's input: cuBLASLt's `DGELU`). With `bias_grad`, the epilogue also writes the sums
/// of one operand over k (a linear layer's bias gradient).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    /// Transpose A.
    pub trans_a: bool,
    /// Transpose B.
    pub trans_b: bool,
    /// Rows of D.
    pub m: u64,
    /// Columns of D.
    pub n: u64,
    /// The reduction length.
    pub k: u64,
    /// A's address and layout.
    pub a: DevicePtr,
    /// A as stored.
    pub a_layout: MatrixLayout,
    /// B's address.
    pub b: DevicePtr,
    /// B as stored.
    pub b_layout: MatrixLayout,
    /// D's address.
    pub d: DevicePtr,
    /// C's address (D's type and layout, read when `beta` is not 0), or 0 when C is D:
    /// another buffer for a sum written beside its addend (a residual added to a
    /// projection), D itself for a product added to what D holds.
    pub c: DevicePtr,
    /// D's layout.
    pub d_layout: MatrixLayout,
    /// The bias vector (length m), or 0 for none.
    pub bias: DevicePtr,
    /// Where the pre-GELU values go when the epilogue applies GELU, or 0 for no GELU.
    pub gelu_aux: DevicePtr,
    /// The pre-GELU values (D's type and layout) whose GELU derivative the epilogue
    /// multiplies D by (`DGELU`), or 0. Not with any other epilogue.
    pub dgelu_aux: DevicePtr,
    /// Where the epilogue writes a bias gradient, or 0 for none: the sums over k of op(A),
    /// one per row of D (`BGRADA`), or with `bias_grad_of_b` of op(B), one per column of D
    /// (`BGRADB`), in D's element type. Written, not added to; D itself is still
    /// `alpha · op(A) · op(B) + beta · C`. Not with `bias` or `gelu_aux`.
    pub bias_grad: DevicePtr,
    /// Which operand `bias_grad` sums: false A, true B.
    pub bias_grad_of_b: bool,
    /// Multiplies the product.
    pub alpha: f32,
    /// Multiplies C (0: D is overwritten; 1: C is added, to itself when C is D).
    pub beta: f32,
    /// Allow TF32 tensor cores for f32 operands.
    pub allow_tf32: bool,
    /// Scratch memory for the library ([`Gpu::gemm_workspace_bytes`] at `workspace`).
    pub workspace: DevicePtr,
    /// Bytes at `workspace`.
    pub workspace_bytes: usize,
}

impl Gemm {
    /// The address C is read from: `c`, or D's when C is D.
    pub(crate) fn c_ptr(&self) -> DevicePtr {
        if self.c != 0 {
            self.c
        } else {
            self.d
        }
    }
}

/// The operations the CUDA backend needs from a device. Every call is queued on one
/// stream, in order; only [`Gpu::download`] and [`Gpu::synchronize`] wait.
pub(crate) trait Gpu: Debug + Send + Sync {
    /// What this device is, for messages: `NVIDIA H100 80GB HBM3 (sm_90)`.
    fn describe(&self) -> String;

    /// The most blocks worth launching for a grid-stride kernel of 256 threads.
    fn max_blocks(&self) -> u32;

    /// The device's compute capability, `(major, minor)`: `(9, 0)` on Hopper. The
    /// emulator reports `(9, 0)`: it runs every instruction trainkit's kernels use.
    fn compute_capability(&self) -> (i32, i32);

    /// The most shared memory one block may have, static and dynamic together, in bytes,
    /// once a kernel opts in beyond the 48 KiB every block gets (227 KiB on Hopper, 163 KiB
    /// on the A100, 99 KiB on other Ampere and Ada cards). The emulator reports Hopper's.
    fn max_shared_bytes(&self) -> u32;

    /// Scratch bytes [`Gpu::gemm`] wants (the backend allocates them, in the ledger).
    fn gemm_workspace_bytes(&self) -> usize;

    /// `bytes` of device memory (stream-ordered; 256-byte aligned).
    fn alloc(&self, bytes: usize) -> std::result::Result<DevicePtr, AllocError>;

    /// Returns an allocation (stream-ordered: queued work that uses it finishes first).
    fn free(&self, ptr: DevicePtr);

    /// Copies host bytes to the device; `src` may be reused once this returns.
    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;

    /// Copies device bytes to the host, waiting for queued work.
    fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<()>;

    /// Zeroes `bytes` at `dst`.
    fn zero(&self, dst: DevicePtr, bytes: usize) -> Result<()>;

    /// Copies `bytes` from `src` to `dst` on the device.
    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()>;

    /// `bytes` of page-locked host memory for a tensor offloaded from the device (reused
    /// once the copies queued on it are done).
    fn alloc_host(&self, bytes: usize) -> Result<HostPtr>;

    /// Returns page-locked memory from [`Gpu::alloc_host`]; it is reused only after the
    /// copies queued on it have run.
    fn free_host(&self, ptr: HostPtr);

    /// Queues the copy of `bytes` from the device at `src` to the host at `dst` on the copy
    /// stream, after the work queued so far on the compute stream; compute goes on.
    fn offload(&self, dst: HostPtr, src: DevicePtr, bytes: usize) -> Result<()>;

    /// Queues the copy of `bytes` from the host at `src` to the device at `dst` on the copy
    /// stream. Returns the ticket compute must wait for before it reads `dst`
    /// ([`Gpu::wait_fetched`]), or `None` when the copy is already done.
    fn fetch(&self, dst: DevicePtr, src: HostPtr, bytes: usize) -> Result<Option<Ticket>>;

    /// Makes the work queued on the compute stream from now on wait for the copy of
    /// `ticket` (a wait on the device, not on the host: it costs time only when the copy
    /// is late).
    fn wait_fetched(&self, ticket: Ticket) -> Result<()>;

    /// Returns device memory whose last reader is a copy queued by [`Gpu::offload`]
    /// (stream-ordered after that copy, not after compute).
    fn free_after_copy(&self, ptr: DevicePtr);

    /// Copies page-locked host bytes at `src` into `dst`, once the copies queued on them
    /// are done.
    fn read_host(&self, dst: &mut [u8], src: HostPtr) -> Result<()>;

    /// Page-locks `bytes` of host memory the caller owns at `ptr` (a host tensor that
    /// crosses to the device), so that [`Gpu::fetch`] and [`Gpu::download_queued`] copy
    /// it asynchronously; false when it stays pageable (too small to be worth it, or the
    /// driver refused). The caller unlocks it ([`Gpu::unregister_host`]) before freeing.
    fn register_host(&self, ptr: HostPtr, bytes: usize) -> bool;

    /// Whether `bytes` at `ptr` are host memory [`Gpu::register_host`] locked.
    fn host_registered(&self, ptr: HostPtr, bytes: usize) -> bool;

    /// Waits on the host until the copies queued on the registered memory at `ptr` have
    /// run.
    fn settle_host(&self, ptr: HostPtr) -> Result<()>;

    /// Waits for the copies queued on the registered memory at `ptr`, then unlocks it.
    fn unregister_host(&self, ptr: HostPtr);

    /// Queues the copy of `bytes` from the device at `src` to registered host memory at
    /// `dst` on the copy stream, after the work queued so far on the compute stream;
    /// compute goes on. Returns the ticket compute waits for before it touches `src`
    /// again ([`Gpu::wait_fetched`]), or `None` when the copy is already done; the host
    /// waits with [`Gpu::settle_host`] before it reads `dst`.
    fn download_queued(&self, dst: HostPtr, src: DevicePtr, bytes: usize)
        -> Result<Option<Ticket>>;

    /// Launches `kernel` on a 1-D grid of 1-D blocks, each with `shared_bytes` of dynamic
    /// shared memory (`extern __shared__`; more than 48 KiB is opted into for the kernel
    /// first, up to [`Gpu::max_shared_bytes`] with its static shared memory).
    ///
    /// # Safety
    /// `params` must match the kernel's signature (cuLaunchKernel's conventions: each
    /// entry points to one argument's value), and every pointer argument must address
    /// device memory large enough for what the kernel touches.
    unsafe fn launch(
        &self,
        kernel: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()>;

    /// Makes the kernels of file `file` (CUDA C written outside trainkit, `source`,
    /// without the common prelude, defining `kernels`) launchable by [`Gpu::launch`]:
    /// compiled on first use, then kept. The same file name with another source, or a
    /// kernel name another file defines, is an error.
    fn load_file(&self, file: &str, source: &str, kernels: &[&str]) -> Result<()>;

    /// Runs one matrix product, or says that the library has no algorithm for it
    /// (nothing was written: the caller runs it another way).
    ///
    /// # Safety
    /// The layouts must describe memory that the pointers address.
    unsafe fn gemm(&self, g: &Gemm) -> Result<GemmRun>;

    /// Waits until all queued work is done.
    fn synchronize(&self) -> Result<()>;

    /// The communication stream's raw handle (a `CUstream`; 0 on the emulator, whose
    /// work runs as it is queued), made to wait first for the work queued so far on the
    /// compute stream, with the device's context current on the calling thread: a
    /// library's collective queued on it (NCCL) reads what compute wrote, while compute
    /// goes on.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    fn comm_stream(&self) -> Result<usize>;

    /// Makes the work queued on the compute stream from now on wait for the work queued
    /// so far on the communication stream (a wait on the device, not on the host).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    fn compute_waits_for_comm(&self) -> Result<()>;

    /// Whether the work queued on the communication stream so far has finished, without
    /// waiting for it (a wait that can watch something else meanwhile: NCCL's errors).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    fn comm_idle(&self) -> Result<bool>;

    /// The device's memory numbers, where it has them.
    fn memory(&self) -> Option<GpuMemory>;

    /// Starts a new peak for [`GpuMemory::pool_reserved_peak`].
    fn reset_peak(&self) {}

    /// How many times the host has waited for the device so far: each
    /// [`Gpu::download`] and [`Gpu::synchronize`] counts once.
    fn host_waits(&self) -> u64;

    /// How many kernel modules have been loaded so far: one per kernel file at start-up,
    /// then one per file written outside trainkit, on its first use.
    fn module_loads(&self) -> u64;

    /// The uploads so far and the size of the page-locked ring they go through.
    fn upload_stats(&self) -> UploadStats;

    /// Turns per-kernel timing on or off ([`super::timing`]).
    fn time_kernels(&self, on: bool);

    /// The device time of the launches and products timed since timing was turned on or
    /// last read, summed per kernel; waits for them to end.
    fn kernel_times(&self) -> Result<Vec<super::KernelTime>>;

    /// How the algorithm of each product run so far was chosen
    /// ([`super::product_tuning`]); none on a device without cuBLASLt (the emulator).
    fn product_choices(&self) -> Vec<super::ProductChoice> {
        Vec::new()
    }
}

/// What `Gpu::upload_stats` reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UploadStats {
    /// Uploads so far (`Gpu::upload` calls).
    pub uploads: u64,
    /// The size of the page-locked ring uploads are copied through, in bytes: it grows to
    /// what the uploads between two waits for the device need.
    pub ring_bytes: u64,
}

/// What [`Gpu::gemm`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmRun {
    /// The product ran (is queued).
    Done,
    /// The library has no algorithm for this product; nothing was written.
    NoAlgorithm,
}

/// Where a [`DeviceBuffer`]'s bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Device memory.
    Device,
    /// Page-locked host memory held for the device (an offloaded tensor).
    Host,
}

/// A device allocation holding `len` elements of `dtype`, returned on drop; or, for an
/// offloaded tensor, page-locked host memory held for the device.
pub(crate) struct DeviceBuffer {
    ptr: DevicePtr,
    len: usize,
    dtype: DType,
    gpu: Arc<dyn Gpu>,
    place: Place,
    /// The last reader is a copy to the host: freed after it, on the copy stream.
    copied_out: AtomicBool,
    /// A copy into or out of this buffer compute has not waited for yet (its ticket + 1;
    /// 0: none).
    pending: AtomicU64,
}

impl DeviceBuffer {
    /// Allocates `len` elements of `dtype` (uninitialized).
    pub(crate) fn alloc(
        gpu: &Arc<dyn Gpu>,
        len: usize,
        dtype: DType,
    ) -> std::result::Result<DeviceBuffer, AllocError> {
        let bytes = dtype.bytes(len);
        let ptr = if bytes == 0 { 0 } else { gpu.alloc(bytes)? };
        Ok(DeviceBuffer::at(gpu, ptr, len, dtype, Place::Device))
    }

    /// Allocates `len` elements of `dtype` in page-locked host memory held for the device.
    pub(crate) fn alloc_host(gpu: &Arc<dyn Gpu>, len: usize, dtype: DType) -> Result<DeviceBuffer> {
        let bytes = dtype.bytes(len);
        let ptr = if bytes == 0 {
            0
        } else {
            gpu.alloc_host(bytes)?
        };
        Ok(DeviceBuffer::at(gpu, ptr, len, dtype, Place::Host))
    }

    fn at(gpu: &Arc<dyn Gpu>, ptr: u64, len: usize, dtype: DType, place: Place) -> Self {
        DeviceBuffer {
            ptr,
            len,
            dtype,
            gpu: Arc::clone(gpu),
            place,
            copied_out: AtomicBool::new(false),
            pending: AtomicU64::new(0),
        }
    }

    /// The device address of the first element (a host address for a buffer in host
    /// memory). Before reading it, compute waits for a pending copy ([`Self::ready`]).
    pub(crate) fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Whether the bytes are in page-locked host memory (an offloaded tensor).
    pub(crate) fn is_host(&self) -> bool {
        self.place == Place::Host
    }

    /// Makes compute wait for a copy into this buffer that is still pending.
    pub(crate) fn ready(&self) -> Result<()> {
        match self.pending.swap(0, Ordering::AcqRel) {
            0 => Ok(()),
            t => self.gpu.wait_fetched(t - 1),
        }
    }

    /// Copies this device buffer into `host` (page-locked, as many bytes) on the copy
    /// stream; this buffer is then freed after that copy rather than after compute.
    pub(crate) fn offload_into(&self, host: &DeviceBuffer) -> Result<()> {
        self.ready()?;
        if self.bytes() > 0 {
            self.gpu.offload(host.ptr, self.ptr, self.bytes())?;
            self.copied_out.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Copies the registered host memory at `src` ([`Gpu::register_host`], as many bytes
    /// as this buffer holds) into this buffer on the copy stream; compute waits for it
    /// where this buffer is next used, and the host must not write `src` before
    /// [`Gpu::settle_host`].
    pub(crate) fn fetch_from_registered(&self, src: HostPtr) -> Result<()> {
        self.ready()?;
        if self.bytes() == 0 {
            return Ok(());
        }
        if let Some(t) = self.gpu.fetch(self.ptr, src, self.bytes())? {
            self.pending.store(t + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Copies this buffer into the registered host memory at `dst` (as many bytes) on
    /// the copy stream; compute waits for the copy before it touches this buffer again,
    /// and the host before it reads `dst` ([`Gpu::settle_host`]).
    pub(crate) fn download_to_registered(&self, dst: HostPtr) -> Result<()> {
        self.ready()?;
        if self.bytes() == 0 {
            return Ok(());
        }
        if let Some(t) = self.gpu.download_queued(dst, self.ptr, self.bytes())? {
            self.pending.store(t + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Copies this host buffer into `dst` (device memory, as many bytes) on the copy
    /// stream; compute waits for it where `dst` is first used.
    pub(crate) fn fetch_into(&self, dst: &DeviceBuffer) -> Result<()> {
        if self.bytes() == 0 {
            return Ok(());
        }
        if let Some(t) = self.gpu.fetch(dst.ptr, self.ptr, self.bytes())? {
            dst.pending.store(t + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of the elements.
    pub(crate) fn bytes(&self) -> usize {
        self.dtype.bytes(self.len)
    }

    /// The elements as f32 (waits for queued work).
    pub(crate) fn to_f32(&self) -> Result<Vec<f32>> {
        let mut raw = vec![0u8; self.bytes()];
        self.read_bytes(&mut raw)?;
        Ok(self.dtype.decode(&raw, self.len))
    }

    /// Copies the elements' bytes into `dst` (as many bytes; waits for queued work).
    pub(crate) fn read_bytes(&self, dst: &mut [u8]) -> Result<()> {
        debug_assert_eq!(dst.len(), self.bytes());
        self.ready()?;
        if dst.is_empty() {
            Ok(())
        } else if self.is_host() {
            self.gpu.read_host(dst, self.ptr)
        } else {
            self.gpu.download(dst, self.ptr)
        }
    }

    /// Overwrites the elements with the bytes `src` (as many bytes).
    pub(crate) fn write_bytes(&self, src: &[u8]) -> Result<()> {
        debug_assert_eq!(src.len(), self.bytes());
        if src.is_empty() {
            return Ok(());
        }
        self.ready()?;
        self.gpu.upload(self.ptr, src)
    }

    /// Overwrites the elements with `data`, rounded to the buffer's dtype.
    pub(crate) fn write_f32(&self, data: &[f32]) -> Result<()> {
        debug_assert_eq!(data.len(), self.len);
        self.write_bytes(&self.dtype.encode(data))
    }
}

impl Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer({} × {} at {:#x}{})",
            self.len,
            self.dtype,
            self.ptr,
            if self.is_host() { ", host" } else { "" }
        )
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // A copy still to land here must be ordered before the memory is reused.
        if let Err(e) = self.ready() {
            log::error!("waiting for a copy into {:#x} failed: {e}", self.ptr);
        }
        match self.place {
            Place::Host => self.gpu.free_host(self.ptr),
            Place::Device if *self.copied_out.get_mut() => self.gpu.free_after_copy(self.ptr),
            Place::Device => self.gpu.free(self.ptr),
        }
    }
}

/// Kernel arguments in cuLaunchKernel's form: each scalar in its own 8-byte slot, each
/// value passed by value ([`Args::bytes`]) in a buffer of its own, and a pointer to each.
#[derive(Debug, Default)]
pub struct Args {
    slots: Vec<u64>,
    /// Values passed by value, 8-byte aligned.
    blobs: Vec<Vec<u64>>,
    /// Each argument in order: `Ok(slot)` or `Err(blob)`.
    order: Vec<std::result::Result<usize, usize>>,
}

/// The largest value [`Args::bytes`] passes: the 4 KiB of parameters every architecture
/// takes, less room for the scalars beside it.
pub const MAX_BY_VALUE: usize = 2048;

impl Args {
    /// No arguments yet.
    pub fn new() -> Self {
        Args {
            slots: Vec::with_capacity(16),
            blobs: Vec::new(),
            order: Vec::with_capacity(16),
        }
    }

    fn slot(mut self, v: u64) -> Self {
        self.order.push(Ok(self.slots.len()));
        self.slots.push(v);
        self
    }

    /// A value passed by value, such as a struct of a fixed-size array (`struct { float
    /// f[256]; }`): `data` must be exactly the parameter's size, at most
    /// `MAX_BY_VALUE` bytes. It travels with the launch, so it needs no upload.
    pub fn bytes(mut self, data: &[u8]) -> Self {
        let mut blob = vec![0u64; data.len().div_ceil(8)];
        for (i, b) in data.iter().enumerate() {
            blob[i / 8] |= (*b as u64) << (8 * (i % 8));
        }
        self.order.push(Err(self.blobs.len()));
        self.blobs.push(blob);
        self
    }

    /// A device pointer.
    pub fn ptr(self, p: DevicePtr) -> Self {
        self.slot(p)
    }

    /// A 64-bit integer (`i64` in the kernels).
    pub fn i64(self, v: usize) -> Self {
        self.slot(v as i64 as u64)
    }

    /// An `int`.
    pub fn i32(self, v: i32) -> Self {
        self.slot(v as u32 as u64)
    }

    /// A `float`.
    pub fn f32(self, v: f32) -> Self {
        self.slot(v.to_bits() as u64)
    }

    /// The size of the largest value passed by value, in bytes (0 when none is).
    pub(crate) fn largest_by_value(&self) -> usize {
        self.blobs.iter().map(|b| 8 * b.len()).max().unwrap_or(0)
    }

    /// Pointers to the arguments, for the launch. Values narrower than 8 bytes sit in the
    /// low bytes of their slot, which is where a little-endian read of the narrower type
    /// finds them.
    pub(crate) fn params(&mut self) -> Vec<*mut c_void> {
        let slots = self.slots.as_mut_ptr();
        let blobs: Vec<*mut u64> = self.blobs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        self.order
            .iter()
            .map(|o| match *o {
                // SAFETY: the index is inside `slots`, which outlives the launch.
                Ok(i) => (unsafe { slots.add(i) }) as *mut c_void,
                Err(i) => blobs[i] as *mut c_void,
            })
            .collect()
    }
}

/// The kernel files written outside trainkit that a device has loaded
/// ([`Gpu::load_file`]): each file with its source and the device's handle `M` for it
/// (a module), and each of its kernels with the handle `F` to launch it by.
pub(crate) struct LoadedFiles<M, F> {
    loaded: Mutex<Loaded<M, F>>,
}

struct Loaded<M, F> {
    files: HashMap<String, (String, M)>,
    kernels: HashMap<String, (String, F)>,
}

impl<M, F: Clone> LoadedFiles<M, F> {
    /// None loaded yet.
    pub(crate) fn new() -> Self {
        LoadedFiles {
            loaded: Mutex::new(Loaded {
                files: HashMap::new(),
                kernels: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Loaded<M, F>> {
        self.loaded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The handle of kernel `name`, if loaded.
    pub(crate) fn get(&self, name: &str) -> Option<F> {
        self.lock().kernels.get(name).map(|(_, h)| h.clone())
    }

    /// Loads file `file` (text `source`, defining `kernels`) with `load`, which returns
    /// the file's handle and one handle per kernel in the order of `kernels`, unless it is
    /// loaded already. The same file name with another source, or a kernel name another
    /// file defines, is an error.
    pub(crate) fn get_or_load(
        &self,
        file: &str,
        source: &str,
        kernels: &[&str],
        load: impl FnOnce() -> Result<(M, Vec<F>)>,
    ) -> Result<()> {
        let mut loaded = self.lock();
        let clash = |message: String| crate::error::Error::Backend {
            backend: "cuda",
            message,
        };
        if let Some((known, _)) = loaded.files.get(file) {
            return if known == source {
                Ok(())
            } else {
                Err(clash(format!(
                    "two kernel files are named `{file}` with different sources: give each \
                     file a name of its own"
                )))
            };
        }
        if let Some((name, (other, _))) = kernels
            .iter()
            .find_map(|k| loaded.kernels.get(*k).map(|e| (k, e)))
        {
            return Err(clash(format!(
                "the kernel `{name}` of `{file}` is defined by `{other}` already: give each \
                 kernel a name of its own"
            )));
        }
        let (module, handles) = load()?;
        for (name, handle) in kernels.iter().zip(handles) {
            loaded
                .kernels
                .insert(name.to_string(), (file.to_string(), handle));
        }
        loaded
            .files
            .insert(file.to_string(), (source.to_string(), module));
        Ok(())
    }

    /// Every file's handle, emptying the set (to release them).
    pub(crate) fn take_all(&self) -> Vec<M> {
        let mut loaded = self.lock();
        loaded.kernels.clear();
        std::mem::take(&mut loaded.files)
            .into_values()
            .map(|(_, m)| m)
            .collect()
    }
}

/// The error of a launch that asks for more shared memory than a block may have.
pub(crate) fn too_much_shared(kernel: &str, asked: u32, max: u32) -> Error {
    Error::Backend {
        backend: "cuda",
        message: format!(
            "launching {kernel}: {asked} bytes of dynamic shared memory asked, but a block of \
             this device may have at most {max}"
        ),
    }
}
