//! `CudaBackend`: the struct, its allocation and transfers, and the launch helpers every op
//! family shares; its [`Backend`](crate::Backend) impl is in `primitives.rs`, which dispatches each
//! primitive to `ops/` (the op families' kernels are in `crate::ops::<family>::cuda`).
//!
//! The [`Backend`](crate::Backend) trait checks each op's operands and records its ledger span, as for
//! every backend; the kernel methods here check only the CUDA backend's own constraints
//! (dtypes its kernels accept), pick the kernel by the dtypes of the tensors
//! (`<op>_<dtype>...`), and launch it. Work is
//! queued, not waited for: only reads to the host (`to_f32`, `sum_squares`) and
//! `synchronize` wait. A training step's losses, gradient norm and skip decision stay on
//! the device (`cross_entropy` adds to a device tensor, `grad_guard` and `adamw` read
//! it), so a step waits once, for its logged loss. Op spans therefore time the host's
//! side of a launch, not the kernel, unless [`CudaOptions::sync_ops`] makes each span wait
//! for the device at both ends (for profiling).
//!
//! Temporary buffers (the two-pass reductions' partial sums, uploaded token ids, casts of
//! operands, cuBLASLt's workspace) are tensors in the ledger's `Workspace` category, so
//! the ledger still counts every byte trainkit holds on the device.

use super::emulated::EmulatedGpu;
use super::gpu::{Args, DeviceBuffer, DevicePtr, Gpu, HostPtr, UploadStats, MAX_BY_VALUE};
use super::kernels::{kernel_files, KernelFile};
use crate::device::cpu::{ensure, HostPin};
use crate::device::CpuBackend;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::{format_bytes, Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Threads per block of every kernel but `sum_squares_finish` (32).
pub const BLOCK: u32 = 256;
/// Rows per block of the half-warp-per-row kernels (16 lanes a row).
pub const ROWS_PER_BLOCK: usize = BLOCK as usize / 16;
/// The bytes of rows [`CudaBackend::grid_cached_rows`] keeps in flight: a third of the
/// L2 cache of an H100 or H200 (50 MiB), two fifths of an A100's (40 MiB).
pub(crate) const CACHED_ROWS_BYTES: usize = 16 << 20;

/// [`CudaBackend::grid_cached_rows`] on a device whose grids take up to `most` blocks
/// (eight per multiprocessor).
fn cached_rows_grid(rows: usize, row_bytes: usize, most: usize) -> u32 {
    let sms = (most / 8).max(1);
    (CACHED_ROWS_BYTES / row_bytes.max(1))
        .clamp(sms, most.max(sms))
        .clamp(1, rows.max(1)) as u32
}

/// Rows per partial sum of the two-pass parameter gradients (common.cuh's
/// TK_GRAD_ROW_BLOCK): the CPU's block, so that the sums are added in its order.
pub(crate) const ROW_BLOCK: usize = crate::device::cpu::elementwise::ROW_BLOCK;

/// Settings of a CUDA backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let f32 products use TF32 tensor cores (faster, about 10 mantissa bits). Off by
    /// default, so `Fp32` training is f32 throughout.
    pub allow_tf32: bool,
    /// Wait for the GPU at both ends of every op span, so that each op's recorded duration
    /// (and an [`OpProfile`](crate::memory::OpProfile)) is the device's time for the op
    /// rather than the host's time to queue it. For profiling: whole steps run slower.
    pub sync_ops: bool,
    /// Compute a linear layer's bias gradient in the weight gradient's cuBLASLt product
    /// (the `BGRADA`/`BGRADB` epilogue, a pass over the output gradient fewer) instead of
    /// with trainkit's column-sum kernel after it. Off by default, as in llm.c, which wires
    /// the same epilogue but sums with a kernel of its own: which is faster is for a GPU
    /// to measure (`gpu_bench --bias-grad-epilogue`).
    pub bias_grad_epilogue: bool,
    /// Run the fused attention on `flash_attention.cu`'s tiled kernels even where the
    /// tensor-core kernels (`flash_attention_mma.cu`: bf16 and f16, heads of 64, 80, 96
    /// or 128 columns, sm_80 and later) apply. For comparison (`gpu_bench
    /// --tiled-attention`); off by default.
    pub tiled_attention: bool,
    /// Run the tensor-core attention in its narrow tiling: forward blocks of 64 query rows
    /// and 64-key steps, backward blocks of 64 keys on four warps, their copies
    /// single-buffered, in steps of 16 queries above 64 columns (the default, wide tiling:
    /// 128-row forward blocks; backward blocks of 128 keys on eight warps at 64 columns,
    /// double-buffered, in steps of 32 queries above 64 columns). For comparison
    /// (`gpu_bench --narrow-attention`; `attention_bench` times both); off by default.
    pub narrow_attention: bool,
    /// Choose each product's cuBLASLt algorithm by timing the heuristic's top candidates
    /// the first time a product of its shape runs, and save the choice beside the kernel
    /// cache for the next process on the machine (a resumed run takes the algorithms of
    /// the run it resumes). On by default; off takes the heuristic's first choice
    /// untimed, the same on every device with the same cuBLASLt (`gpu_bench
    /// --untuned-products`). [`CudaBackend::product_choices`] says what each product
    /// took. No effect on the emulator.
    pub tune_products: bool,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            allow_tf32: false,
            sync_ops: false,
            bias_grad_epilogue: false,
            tiled_attention: false,
            narrow_attention: false,
            tune_products: true,
        }
    }
}

/// The CUDA backend: trainkit's kernels (NVRTC-compiled) and cuBLASLt on one GPU, or on
/// the CUDA emulator ([`CudaBackend::emulated`]).
pub struct CudaBackend {
    pub(super) gpu: Arc<dyn Gpu>,
    pub(super) ledger: Ledger,
    pub(super) device: Device,
    pub(super) options: CudaOptions,
    pub(super) gemm_workspace: Mutex<Option<Tensor>>,
    /// Cleared when cuBLASLt fails a product with the GELU epilogue: from then on the
    /// product and the GELU run as two ops.
    pub(super) gelu_epilogue: AtomicBool,
    /// Cleared when cuBLASLt fails a product with the GELU-gradient (`DGELU`) epilogue:
    /// from then on the product and the GELU's backward run apart.
    pub(super) dgelu_epilogue: AtomicBool,
    /// Set by [`CudaOptions::bias_grad_epilogue`]; cleared when cuBLASLt fails a product
    /// with a bias-gradient epilogue: the weight and bias gradients then run as two ops.
    pub(super) bias_grad_epilogue: AtomicBool,
    /// The values [`CudaBackend::kept_u32`] keeps on the device, with their host copy:
    /// one list per label.
    pub(super) kept: Mutex<Vec<(Vec<u32>, Arc<Tensor>)>>,
    /// The host memory of [`Backend::host`](crate::Backend::host), made on first use.
    pub(super) host: OnceLock<Arc<CpuBackend>>,
    /// Transfers queued on the copy stream (page-locked host side) and copied at once
    /// (pageable host side).
    pub(super) queued_transfers: AtomicU64,
    pub(super) waited_transfers: AtomicU64,
}

/// How [`Backend::transfer_queued`](crate::Backend::transfer_queued) moved tensors between the GPU and its host memory
/// ([`CudaBackend::host_transfers`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTransfers {
    /// Copies queued on the copy stream, their host side page-locked: compute and the
    /// host go on while they run.
    pub queued: u64,
    /// Copies from or to pageable host memory (small tensors, or memory the driver would
    /// not lock): the host waits for each.
    pub waited: u64,
    /// Host buffers page-locked now.
    pub pinned_buffers: usize,
}

/// Page-locking for the host memory of [`Backend::host`](crate::Backend::host), through the GPU's
/// `cuMemHostRegister`.
#[derive(Debug)]
pub(super) struct GpuPin(pub(super) Arc<dyn Gpu>);

impl HostPin for GpuPin {
    fn pin(&self, ptr: usize, bytes: usize) -> bool {
        self.0.register_host(ptr as HostPtr, bytes)
    }

    fn settle(&self, ptr: usize) {
        if let Err(e) = self.0.settle_host(ptr as HostPtr) {
            log::error!("{e}");
        }
    }

    fn unpin(&self, ptr: usize) {
        self.0.unregister_host(ptr as HostPtr)
    }
}

/// How the figures of an out-of-memory error begin ([`CudaBackend::explain`] adds them
/// once).
const FIGURES: &str = "trainkit holds";

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({} on {})", self.device, self.gpu.describe())
    }
}

impl CudaBackend {
    /// The backend on GPU `ordinal` with default options. Fails, never panics, with a
    /// sentence saying what is missing when the GPU or a CUDA library cannot be used.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    /// The backend on GPU `ordinal`.
    pub fn with_options(ordinal: usize, options: CudaOptions) -> Result<CudaBackend> {
        let gpu = super::driver::DriverGpu::new(ordinal, options.tune_products)?;
        Ok(Self::on(Arc::new(gpu), Device::Cuda(ordinal), options))
    }

    /// The backend on the CUDA emulator: trainkit's kernels compiled for the host by the
    /// system's C++ compiler and run with CUDA's threads, warps and barriers emulated;
    /// products by a reference loop from cuBLASLt's description. For testing the backend
    /// where there is no GPU: slow, and silent about code generation and timing.
    pub fn emulated() -> Result<CudaBackend> {
        Self::emulated_with_capacity(None)
    }

    /// The emulated backend with a device memory size of `capacity` bytes (allocations
    /// beyond it fail as they would on a full GPU).
    pub fn emulated_with_capacity(capacity: Option<u64>) -> Result<CudaBackend> {
        Self::emulated_with(capacity, CudaOptions::default())
    }

    /// The emulated backend with a device memory size of `capacity` bytes (as
    /// [`CudaBackend::emulated_with_capacity`]) and the given settings.
    pub fn emulated_with(capacity: Option<u64>, options: CudaOptions) -> Result<CudaBackend> {
        let gpu = EmulatedGpu::new(capacity)?;
        Ok(Self::on(Arc::new(gpu), Device::Cuda(0), options))
    }

    /// The device this backend queues its work on (for a library that queues work after
    /// it: NCCL).
    #[cfg(feature = "nccl")]
    pub(crate) fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    fn on(gpu: Arc<dyn Gpu>, device: Device, options: CudaOptions) -> CudaBackend {
        let ledger = Ledger::new();
        if options.sync_ops {
            let g = Arc::clone(&gpu);
            ledger.set_op_fence(Some(Arc::new(move || g.synchronize())));
        }
        CudaBackend {
            gpu,
            ledger,
            device,
            options,
            gemm_workspace: Mutex::new(None),
            gelu_epilogue: AtomicBool::new(true),
            dgelu_epilogue: AtomicBool::new(true),
            bias_grad_epilogue: AtomicBool::new(options.bias_grad_epilogue),
            kept: Mutex::new(Vec::new()),
            host: OnceLock::new(),
            queued_transfers: AtomicU64::new(0),
            waited_transfers: AtomicU64::new(0),
        }
    }

    /// How transfers between the GPU and its host memory ran so far: queued on the copy
    /// stream from and to page-locked memory, or waited for (pageable memory).
    pub fn host_transfers(&self) -> HostTransfers {
        HostTransfers {
            queued: self.queued_transfers.load(Ordering::Relaxed),
            waited: self.waited_transfers.load(Ordering::Relaxed),
            pinned_buffers: self.host.get().map_or(0, |h| h.pinned_buffers()),
        }
    }

    /// The settings this backend was made with.
    pub fn options(&self) -> CudaOptions {
        self.options
    }

    /// How many times the host has waited for the GPU so far (every read of device
    /// memory and every synchronization counts once). A training step waits once, to read
    /// its loss for the log.
    pub fn host_waits(&self) -> u64 {
        self.gpu.host_waits()
    }

    /// How many kernel modules have been loaded so far: one per kernel file of trainkit's
    /// at start-up, then one per file written outside trainkit on its first use, never
    /// again during training.
    pub fn module_loads(&self) -> u64 {
        self.gpu.module_loads()
    }

    /// The uploads so far and the size of the page-locked ring they go through (it grows
    /// to what the uploads between two waits for the device need).
    pub fn upload_stats(&self) -> UploadStats {
        self.gpu.upload_stats()
    }

    pub(super) fn alloc(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
        zero: bool,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes(n) as u64;
        if let Some(err) = self.ledger.would_refuse(category, bytes, label) {
            return Err(err);
        }
        let buf = DeviceBuffer::alloc(&self.gpu, n, dtype).map_err(|e| match e {
            super::gpu::AllocError::OutOfMemory => self.out_of_memory(bytes, category, label),
            super::gpu::AllocError::Other(message) => Error::Backend {
                backend: "cuda",
                message: format!(
                    "allocating {} for `{label}`: {message}",
                    format_bytes(bytes)
                ),
            },
        })?;
        if zero && bytes > 0 {
            self.gpu
                .zero(buf.ptr(), bytes as usize)
                .map_err(|e| self.explain(e))?;
        }
        Tensor::new(Storage::Device(buf), shape, category, label, &self.ledger)
    }

    fn out_of_memory(&self, bytes: u64, category: MemoryCategory, label: &str) -> Error {
        Error::OutOfMemory {
            message: format!(
                "the GPU ({}) has no room for {} for `{label}` ({category}): {}",
                self.gpu.describe(),
                format_bytes(bytes),
                self.memory_figures()
            ),
        }
    }

    /// What trainkit holds, by category, what the device has free and its pool holds, and
    /// what to try: the body of every out-of-memory error (it starts with [`FIGURES`]).
    fn memory_figures(&self) -> String {
        let snap = self.ledger.snapshot();
        let live: Vec<String> = snap
            .live
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(c, b)| format!("{c} {}", format_bytes(b)))
            .collect();
        let device = match self.gpu.memory() {
            Some(m) if m.total > 0 => format!(
                "; the device has {} free of {} and its pool holds {}",
                format_bytes(m.free),
                format_bytes(m.total),
                format_bytes(m.pool_reserved)
            ),
            _ => String::new(),
        };
        format!(
            "{FIGURES} {} ({}){device}; use a smaller batch with more accumulation \
             steps, a recompute policy or mixed precision (`trainkit memory` and `trainkit \
             train --autofit` say what fits)",
            format_bytes(snap.live.total()),
            if live.is_empty() {
                "nothing".to_string()
            } else {
                live.join(", ")
            },
        )
    }

    /// A workspace tensor of `bytes` (rounded up to whole f32s), contents unspecified:
    /// temporary buffers of a kernel call, counted by the ledger.
    pub fn scratch(&self, bytes: usize, label: &str) -> Result<Tensor> {
        self.alloc(
            &[bytes.div_ceil(4)],
            DType::F32,
            MemoryCategory::Workspace,
            label,
            false,
        )
    }

    /// `values` on the device, in a workspace tensor.
    pub(crate) fn upload_u32(&self, values: &[u32], label: &str) -> Result<Tensor> {
        let t = self.scratch(values.len() * 4, label)?;
        if !values.is_empty() {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.gpu
                .upload(ptr(&t)?, &bytes)
                .map_err(|e| self.explain(e))?;
        }
        Ok(t)
    }

    /// `values` on the device, uploaded once while the calls ask for the same values under
    /// the same label (the targets of one loss, read chunk by chunk; a batch's positions,
    /// read by every layer): a workspace tensor the backend keeps until it is asked for
    /// other values under that label (one list per label). The caller holds the handle
    /// while it queues the launches that read it, so a call from another thread that
    /// replaces the list cannot free it under them.
    pub(crate) fn kept_u32(&self, values: &[u32], label: &str) -> Result<Arc<Tensor>> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((host, t)) = kept.iter().find(|(_, t)| t.label() == label) {
            if host.as_slice() == values {
                return Ok(t.clone());
            }
        }
        // The old list is freed (stream-ordered, after the kernels that read it) once
        // nobody holds it.
        kept.retain(|(_, t)| t.label() != label);
        let t = Arc::new(self.upload_u32(values, label)?);
        kept.push((values.to_vec(), t.clone()));
        Ok(t)
    }

    /// A batch's `positions` on the device ([`CudaBackend::kept_u32`], so every layer
    /// reads one upload), or none (the kernels' plain layout, a null pointer).
    pub(crate) fn positions(&self, positions: Option<&[u32]>) -> Result<KeptPositions> {
        positions
            .map(|p| self.kept_u32(p, "batch.positions"))
            .transpose()
            .map(KeptPositions)
    }

    /// The device's compute capability, `(major, minor)` (`(9, 0)` on Hopper and on the
    /// emulator).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.gpu.compute_capability()
    }

    /// The most shared memory one block of this device may have once a kernel opts in
    /// (227 KiB on Hopper; the emulator reports Hopper's).
    pub fn max_shared_bytes(&self) -> u32 {
        self.gpu.max_shared_bytes()
    }

    /// Blocks (of [`BLOCK`] threads) for a grid-stride loop over `n` elements.
    pub fn grid(&self, n: usize) -> u32 {
        n.div_ceil(BLOCK as usize)
            .clamp(1, self.gpu.max_blocks() as usize) as u32
    }

    /// Blocks (of [`BLOCK`] threads) for a half-warp-per-row kernel over `rows` rows.
    pub fn grid_rows(&self, rows: usize) -> u32 {
        rows.div_ceil(ROWS_PER_BLOCK)
            .clamp(1, self.gpu.max_blocks() as usize * 4) as u32
    }

    /// Turns per-kernel timing on or off (off by default): while on, every kernel launch
    /// and cuBLASLt product is bracketed by CUDA events (on the emulator, timed by the
    /// host's clock), which [`CudaBackend::kernel_times`] reads. The launches stay queued;
    /// each costs two event records more.
    pub fn time_kernels(&self, on: bool) {
        self.gpu.time_kernels(on);
    }

    /// The device time of the launches and products timed since timing was turned on or
    /// last read, summed per kernel, the longest first. Waits for them to end.
    pub fn kernel_times(&self) -> Result<Vec<super::KernelTime>> {
        self.gpu.kernel_times()
    }

    /// How the cuBLASLt algorithm of each product run so far was chosen, in the order the
    /// products first ran ([`CudaOptions::tune_products`]): timed, saved by an earlier
    /// process, or the heuristic's first choice. Empty on the emulator, which has no
    /// cuBLASLt.
    pub fn product_choices(&self) -> Vec<super::ProductChoice> {
        self.gpu.product_choices()
    }

    /// Blocks for a kernel that reads each of `rows` rows of `row_bytes` more than once, a
    /// block a row (grid-stride): as many rows in flight as keep about 16 MiB in the L2
    /// cache (a third of an H100's), so that the rereads come from it rather than from
    /// memory; at least a block per multiprocessor, at most [`CudaBackend::grid`]'s eight.
    pub fn grid_cached_rows(&self, rows: usize, row_bytes: usize) -> u32 {
        cached_rows_grid(rows, row_bytes, self.gpu.max_blocks() as usize)
    }

    /// Blocks (of [`BLOCK`] threads) for the second pass of a column sum over `columns`
    /// columns (common.cuh's `tk_column_total`: a block per 32 columns).
    pub fn grid_columns(&self, columns: usize) -> u32 {
        columns
            .div_ceil(32)
            .clamp(1, self.gpu.max_blocks() as usize) as u32
    }

    /// Blocks (of [`BLOCK`] threads) for a warp-per-row kernel over `rows` rows
    /// (kernels/common.cuh's warp rows).
    pub fn grid_warp_rows(&self, rows: usize) -> u32 {
        rows.div_ceil(BLOCK as usize / 32)
            .clamp(1, self.gpu.max_blocks() as usize * 8) as u32
    }

    /// Makes the kernels of `file` (CUDA C written outside trainkit) launchable by
    /// [`CudaBackend::launch_kernel`]: on a GPU, compiled by NVRTC for the device (with
    /// `kernels/common.cuh` prepended, and the kernel cache on disk) and loaded the first
    /// time, a no-op after; on the emulator, built for the host by the C++ compiler. The
    /// same file name with another source, or a kernel name that trainkit or another file
    /// defines, is an error.
    pub fn load_kernels(&self, file: &KernelFile) -> Result<()> {
        if let Some((name, own)) = file.kernels.iter().find_map(|k| {
            kernel_files()
                .iter()
                .find(|f| f.kernels.contains(k))
                .map(|f| (k, f))
        }) {
            return Err(Error::Backend {
                backend: "cuda",
                message: format!(
                    "the kernel `{name}` of `{}` has the name of trainkit's own (in kernels/{}): \
                     give yours another",
                    file.name, own.name
                ),
            });
        }
        self.gpu
            .load_file(file.name, file.source, file.kernels)
            .map_err(|e| self.explain(e))
    }

    /// Launches `kernel` (one of trainkit's, or of a file loaded with
    /// [`CudaBackend::load_kernels`]) on `grid` blocks of `block` threads, on the backend's
    /// stream; the work is queued, not waited for.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type (a device
    /// pointer per pointer, `i64` for `long long`, ...), and every pointer must address a
    /// buffer large enough for every access the kernel makes with this launch shape: the
    /// kernel runs unchecked on the device (or as native code on the emulator).
    pub unsafe fn launch_kernel(
        &self,
        kernel: &str,
        grid: u32,
        block: u32,
        args: Args,
    ) -> Result<()> {
        self.launch(kernel, grid, block, args)
    }

    pub(crate) fn launch(&self, kernel: &str, grid: u32, block: u32, args: Args) -> Result<()> {
        self.launch_shared(kernel, grid, block, 0, args)
    }

    /// [`CudaBackend::launch`] with `shared_bytes` of dynamic shared memory a block
    /// (`extern __shared__`), which may pass the 48 KiB a block has by default up to
    /// [`CudaBackend::max_shared_bytes`].
    pub(crate) fn launch_shared(
        &self,
        kernel: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        mut args: Args,
    ) -> Result<()> {
        let by_value = args.largest_by_value();
        if by_value > MAX_BY_VALUE {
            return Err(Error::Backend {
                backend: "cuda",
                message: format!(
                    "launching {kernel}: a value of {by_value} bytes passed by value; at most \
                     {MAX_BY_VALUE} travel with a launch (pass a device pointer instead)"
                ),
            });
        }
        let mut params = args.params();
        // SAFETY: every call site passes the kernel's arguments in its declared order and
        // types (see kernels/*.cu), with device pointers to buffers whose sizes the op
        // checked against the shapes first.
        unsafe {
            self.gpu
                .launch(kernel, grid, block, shared_bytes, &mut params)
        }
        .map_err(|e| self.explain(e))
    }

    /// `e`, with the ledger's and the device's figures and what to try added when it is
    /// an out-of-memory error from outside an allocation (a launch, a product, a copy, a
    /// module load) that does not carry them yet.
    pub(crate) fn explain(&self, e: Error) -> Error {
        match e {
            Error::OutOfMemory { message } if !message.contains(FIGURES) => Error::OutOfMemory {
                message: format!("{message}: {}", self.memory_figures()),
            },
            other => other,
        }
    }
}

/// An operand in the dtype an op needs: the caller's tensor or a converted copy
/// ([`CudaBackend::as_dtype`]).
#[derive(Debug)]
pub enum Operand<'a> {
    /// The caller's tensor, already in the dtype.
    Borrowed(&'a Tensor),
    /// A cast copy in the workspace.
    Owned(Tensor),
}

impl std::ops::Deref for Operand<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Operand::Borrowed(t) => t,
            Operand::Owned(t) => t,
        }
    }
}

/// A batch's positions on the device while launches that read them are queued
/// ([`CudaBackend::positions`]).
pub(crate) struct KeptPositions(Option<Arc<Tensor>>);

impl KeptPositions {
    /// The address the kernels take: the positions, or 0 (null) without.
    pub(crate) fn ptr(&self) -> Result<DevicePtr> {
        self.0.as_deref().map_or(Ok(0), ptr)
    }
}

/// The device address of `t`'s first element (a kernel argument, [`Args::ptr`]), or an
/// error for a tensor of another backend.
pub fn ptr(t: &Tensor) -> Result<DevicePtr> {
    match t.storage() {
        Storage::Device(d) => {
            d.ready()?;
            Ok(d.ptr())
        }
        _ => Err(Error::Backend {
            backend: "cuda",
            message: format!(
                "`{}` lives in host memory, not on the GPU: keep a model's tensors on one \
                 device",
                t.label()
            ),
        }),
    }
}

/// Fails unless `t` has `dtype`.
pub(crate) fn ensure_dtype(t: &Tensor, dtype: DType, op: &'static str) -> Result<()> {
    ensure(t.dtype() == dtype, op, || {
        format!("`{}` must be {dtype}, it is {}", t.label(), t.dtype())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::CpuBackend;
    use crate::device::Backend;

    /// The cross-entropy's rows in flight on an H100 (132 multiprocessors): GPT-2's bf16
    /// rows (50,304 ids) keep 16 MiB of them, larger rows one a multiprocessor, and a
    /// small chunk no more blocks than it has rows.
    #[test]
    fn rows_read_more_than_once_stay_within_the_cache() {
        let most = 132 * 8;
        assert_eq!(cached_rows_grid(8192, 50_304 * 2, most), 166);
        assert_eq!(cached_rows_grid(8192, 50_304 * 4, most), 132);
        assert_eq!(cached_rows_grid(8192, 128_256 * 2, most), 132);
        assert_eq!(cached_rows_grid(8192, 256, most), 1056);
        assert_eq!(cached_rows_grid(100, 50_304 * 2, most), 100);
        assert_eq!(cached_rows_grid(0, 50_304 * 2, 4), 1);
    }

    /// The emulated GPU, or `None` (a skip) where the emulator cannot be built and is not
    /// required.
    fn emulated() -> Option<EmulatedGpu> {
        match EmulatedGpu::new(None) {
            Ok(gpu) => Some(gpu),
            Err(e) if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() => {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}")
            }
            Err(_) => None,
        }
    }

    /// A library with no algorithm for any product: every product runs as the plain
    /// kernel (kernels/matmul.cu), for each operand and output type, both transposes,
    /// with a bias and accumulating, and matches the product in f64 to the output type's
    /// rounding; the GELU epilogue's caller falls back to two ops, whose product is plain;
    /// a product reading its residual as C runs plain on a copy of it.
    #[test]
    fn products_without_an_algorithm_run_as_the_plain_kernel() {
        let Some(mut gpu) = emulated() else {
            return;
        };
        gpu.refuse_products = true;
        let be = CudaBackend::on(Arc::new(gpu), Device::Cuda(0), CudaOptions::default());
        // Shapes that leave partial 16 × 16 tiles and a partial inner tile.
        let (m, n, k) = (19usize, 21usize, 35usize);
        let value = |i: usize, f: f32| (i as f32 * f).sin();
        for (operand, out_dtype, tol) in [
            (DType::F32, DType::F32, 1e-5),
            (DType::Bf16, DType::Bf16, 1e-2),
            (DType::Bf16, DType::F32, 1e-5),
            (DType::F16, DType::F16, 2e-3),
            (DType::F16, DType::F32, 1e-5),
        ] {
            for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
                for (accumulate, with_bias) in [(false, false), (true, true)] {
                    let a_shape = if trans_a { [k, m] } else { [m, k] };
                    let b_shape = if trans_b { [n, k] } else { [k, n] };
                    let a: Vec<f32> = (0..m * k).map(|i| value(i, 0.37)).collect();
                    let b: Vec<f32> = (0..k * n).map(|i| value(i, 0.11)).collect();
                    let d0: Vec<f32> = (0..m * n).map(|i| value(i, 0.05)).collect();
                    let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.05 - 0.3).collect();
                    let up = |v: &[f32], s: &[usize], dt| {
                        be.upload(v, s, dt, MemoryCategory::Activations, "x")
                            .unwrap()
                    };
                    let (ta, tb) = (up(&a, &a_shape, operand), up(&b, &b_shape, operand));
                    let tbias = up(&bias, &[n], out_dtype);
                    let mut out = up(&d0, &[m, n], out_dtype);
                    let bias_arg = with_bias.then_some(&tbias);
                    be.matmul_kernel(&mut out, &ta, &tb, bias_arg, trans_a, trans_b, accumulate)
                        .unwrap();
                    let got = be.to_f32(&out).unwrap();
                    // The reference from the rounded operands, in f64.
                    let (ra, rb) = (be.to_f32(&ta).unwrap(), be.to_f32(&tb).unwrap());
                    let rd0 = be.to_f32(&up(&d0, &[m, n], out_dtype)).unwrap();
                    let rbias = be.to_f32(&tbias).unwrap();
                    for i in 0..m {
                        for j in 0..n {
                            let mut want = 0f64;
                            for l in 0..k {
                                let x = if trans_a {
                                    ra[l * m + i]
                                } else {
                                    ra[i * k + l]
                                };
                                let y = if trans_b {
                                    rb[j * k + l]
                                } else {
                                    rb[l * n + j]
                                };
                                want += x as f64 * y as f64;
                            }
                            if accumulate {
                                want += rd0[i * n + j] as f64;
                            }
                            if with_bias {
                                want += rbias[j] as f64;
                            }
                            let g = got[i * n + j] as f64;
                            assert!(
                                (g - want).abs() <= tol * want.abs().max(1.0),
                                "{operand}→{out_dtype} trans {trans_a}/{trans_b} acc \
                                 {accumulate} [{i},{j}]: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        // The GELU epilogue has no algorithm either: two ops, the product plain.
        let cpu = CpuBackend::new();
        let run = |be: &dyn Backend| {
            let up = |v: Vec<f32>, s: &[usize]| {
                be.upload(&v, s, DType::F32, MemoryCategory::Activations, "x")
                    .unwrap()
            };
            let a = up((0..m * k).map(|i| value(i, 0.3)).collect(), &[m, k]);
            let b = up((0..k * 16).map(|i| value(i, 0.7)).collect(), &[k, 16]);
            let bias = up((0..16).map(|i| value(i, 0.2)).collect(), &[16]);
            let mut pre = up(vec![f32::NAN; m * 16], &[m, 16]);
            let mut out = up(vec![f32::NAN; m * 16], &[m, 16]);
            crate::ops::linear::matmul_bias_gelu(be, &mut out, &mut pre, &a, &b, &bias).unwrap();
            (be.to_f32(&pre).unwrap(), be.to_f32(&out).unwrap())
        };
        let (want, got) = (run(&cpu), run(&be));
        for (g, w) in got.0.iter().chain(&got.1).zip(want.0.iter().chain(&want.1)) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
        }
        // A product reading its residual as C: the plain kernel adds to D, which takes
        // C's values first; the residual itself is left as it was.
        let run = |be: &dyn Backend| {
            let up = |v: Vec<f32>, s: &[usize]| {
                be.upload(&v, s, DType::F32, MemoryCategory::Activations, "x")
                    .unwrap()
            };
            let x = up((0..m * k).map(|i| value(i, 0.3)).collect(), &[m, k]);
            let w = up((0..16 * k).map(|i| value(i, 0.7)).collect(), &[16, k]);
            let bias = up((0..16).map(|i| value(i, 0.2)).collect(), &[16]);
            let residual = up((0..m * 16).map(|i| value(i, 0.9)).collect(), &[m, 16]);
            let mut y = up(vec![f32::NAN; m * 16], &[m, 16]);
            crate::ops::linear::matmul_residual(be, &mut y, &x, &w, Some(&bias), &residual, true)
                .unwrap();
            (be.to_f32(&y).unwrap(), be.to_f32(&residual).unwrap())
        };
        let (want, got) = (run(&cpu), run(&be));
        assert_eq!(got.1, want.1, "the residual is read, not written");
        for (g, w) in got.0.iter().zip(&want.0) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
        }
    }

    /// A launch that runs out of memory (a kernel's local memory, a lazily loaded module)
    /// is [`Error::OutOfMemory`], with the ledger's figures and what to try, as an
    /// allocation's is; the backend works on after it.
    #[test]
    fn an_out_of_memory_launch_is_out_of_memory_with_the_figures() {
        let Some(gpu) = emulated() else {
            return;
        };
        let gpu = Arc::new(gpu);
        gpu.failing_launches
            .store(1, std::sync::atomic::Ordering::Relaxed);
        let be = CudaBackend::on(gpu.clone(), Device::Cuda(0), CudaOptions::default());
        let x = be
            .upload(
                &[1.0, -2.0, 3.0],
                &[3],
                DType::F32,
                MemoryCategory::Activations,
                "x",
            )
            .unwrap();
        let err = be.as_dtype(&x, DType::Bf16).unwrap_err();
        let Error::OutOfMemory { message } = &err else {
            panic!("not an out-of-memory error: {err}");
        };
        for part in [
            "launching cast_",
            "CUDA_ERROR_OUT_OF_MEMORY",
            "trainkit holds",
            "activations",
            "smaller batch",
        ] {
            assert!(message.contains(part), "{part} missing from: {message}");
        }
        let y = be.as_dtype(&x, DType::Bf16).unwrap();
        assert_eq!(be.to_f32(&y).unwrap(), vec![1.0, -2.0, 3.0]);
        // Through an op's door: the figures are added once.
        gpu.failing_launches
            .store(1, std::sync::atomic::Ordering::Relaxed);
        let mut out = be
            .empty(&[3], DType::F32, MemoryCategory::Activations, "y")
            .unwrap();
        let err = crate::ops::gelu::forward(&be, &mut out, &x).unwrap_err();
        let Error::OutOfMemory { message } = &err else {
            panic!("not an out-of-memory error: {err}");
        };
        assert!(message.contains("launching gelu_"), "{message}");
        assert_eq!(message.matches(FIGURES).count(), 1, "{message}");
    }

    /// The emulator counts module loads as the driver does: one per kernel file at
    /// start-up, one per file written outside trainkit on its first use, none after.
    #[test]
    fn modules_load_once() {
        let Some(gpu) = emulated() else {
            return;
        };
        let be = CudaBackend::on(Arc::new(gpu), Device::Cuda(0), CudaOptions::default());
        let start = be.module_loads();
        assert_eq!(start, kernel_files().len() as u64);
        const FILE: KernelFile = KernelFile {
            name: "module_load_test.cu",
            source: "extern \"C\" __global__ void module_load_test_fill(float* x, i64 n) {\n\
                     TK_FOR_EACH(i, n) { x[i] = 2.0f; }\n}\n",
            kernels: &["module_load_test_fill"],
        };
        for _ in 0..3 {
            be.load_kernels(&FILE).unwrap();
            let x = be
                .upload(
                    &[0.0; 5],
                    &[5],
                    DType::F32,
                    MemoryCategory::Activations,
                    "x",
                )
                .unwrap();
            // SAFETY: the kernel takes a float pointer and its length.
            unsafe {
                be.launch_kernel(
                    "module_load_test_fill",
                    1,
                    BLOCK,
                    Args::new().ptr(ptr(&x).unwrap()).i64(5),
                )
            }
            .unwrap();
            assert_eq!(be.to_f32(&x).unwrap(), vec![2.0; 5]);
        }
        assert_eq!(be.module_loads(), start + 1);
    }

    /// A library without an algorithm for the GELU epilogue: the product and the GELU run
    /// as two ops, with the same values, and the epilogue is not tried again.
    #[test]
    fn a_refused_gelu_epilogue_falls_back_to_two_ops() {
        let mut gpu = match EmulatedGpu::new(None) {
            Ok(gpu) => gpu,
            Err(e) if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() => {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}")
            }
            Err(_) => return,
        };
        gpu.refuse_gelu_epilogue = true;
        let be = CudaBackend::on(Arc::new(gpu), Device::Cuda(0), CudaOptions::default());
        let cpu = CpuBackend::new();
        let (m, n, k) = (5usize, 16usize, 7usize);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.05 - 0.3).collect();
        let run = |be: &dyn Backend| {
            let up = |v: &[f32], s: &[usize]| {
                be.upload(v, s, DType::F32, MemoryCategory::Activations, "x")
                    .unwrap()
            };
            let (a, b, bias) = (up(&a, &[m, k]), up(&b, &[k, n]), up(&bias, &[n]));
            let mut pre = up(&vec![f32::NAN; m * n], &[m, n]);
            let mut out = up(&vec![f32::NAN; m * n], &[m, n]);
            crate::ops::linear::matmul_bias_gelu(be, &mut out, &mut pre, &a, &b, &bias).unwrap();
            (be.to_f32(&pre).unwrap(), be.to_f32(&out).unwrap())
        };
        let want = run(&cpu);
        for _ in 0..2 {
            let got = run(&be);
            for (g, w) in got.0.iter().chain(&got.1).zip(want.0.iter().chain(&want.1)) {
                assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
            }
            assert!(!be.gelu_epilogue.load(std::sync::atomic::Ordering::Relaxed));
        }
    }

    /// The input gradient carried through a GELU (`matmul_dgelu`): in one product with
    /// cuBLASLt's DGELU epilogue, and with the epilogue refused by the library as the
    /// product then the GELU's backward in place, for both weight layouts, in f32 and
    /// bf16, equal to the CPU's composed op (the epilogue multiplies the f32 accumulator,
    /// the CPU the product rounded to the output's dtype: bf16 agrees to its rounding).
    #[test]
    fn the_gelu_gradient_takes_the_epilogue_or_falls_back_to_two_ops() {
        let make = |refuse: bool| -> Option<CudaBackend> {
            let mut gpu = match EmulatedGpu::new(None) {
                Ok(gpu) => gpu,
                Err(e) if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() => {
                    panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}")
                }
                Err(_) => return None,
            };
            gpu.refuse_gelu_epilogue = refuse;
            Some(CudaBackend::on(
                Arc::new(gpu),
                Device::Cuda(0),
                CudaOptions::default(),
            ))
        };
        let cpu = CpuBackend::new();
        let (rows, din, dout) = (37usize, 24usize, 20usize);
        let dy: Vec<f32> = (0..rows * dout).map(|i| (i as f32 * 0.11).cos()).collect();
        let pre: Vec<f32> = (0..rows * din)
            .map(|i| 2.0 * (i as f32 * 0.37).sin())
            .collect();
        let w: Vec<f32> = (0..din * dout).map(|i| i as f32 * 0.01 - 0.5).collect();
        let run = |be: &dyn Backend, trans_w: bool, dtype: DType| {
            let up = |v: &[f32], s: &[usize]| {
                be.upload(v, s, dtype, MemoryCategory::Activations, "x")
                    .unwrap()
            };
            let w_shape = if trans_w { [din, dout] } else { [dout, din] };
            let (dy, w, pre) = (
                up(&dy, &[rows, dout]),
                up(&w, &w_shape),
                up(&pre, &[rows, din]),
            );
            let mut dpre = up(&vec![f32::NAN; rows * din], &[rows, din]);
            crate::ops::linear::matmul_dgelu(be, &mut dpre, &dy, &w, &pre, trans_w).unwrap();
            be.to_f32(&dpre).unwrap()
        };
        for refuse in [false, true] {
            let Some(be) = make(refuse) else { return };
            for dtype in [DType::F32, DType::Bf16] {
                let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                for trans_w in [false, true] {
                    let (want, got) = (run(&cpu, trans_w, dtype), run(&be, trans_w, dtype));
                    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= tol * scale,
                            "refused {refuse} {dtype} trans {trans_w}: {g} vs {w}"
                        );
                    }
                }
            }
            assert_eq!(
                be.dgelu_epilogue.load(std::sync::atomic::Ordering::Relaxed),
                !refuse
            );
        }
    }

    /// A linear layer's weight and bias gradients in one product (cuBLASLt's bias-gradient
    /// epilogue) match the CPU's two ops, for both weight layouts, accumulating into
    /// gradients that already hold values; and with the epilogue refused by the library,
    /// or not asked for (the default), the two ops run instead, with the same values.
    #[test]
    fn weight_and_bias_gradients_take_the_epilogue_or_fall_back_to_two_ops() {
        let make = |refuse: bool, epilogue: bool| -> Option<CudaBackend> {
            let mut gpu = match EmulatedGpu::new(None) {
                Ok(gpu) => gpu,
                Err(e) if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() => {
                    panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}")
                }
                Err(_) => return None,
            };
            gpu.refuse_bias_grad_epilogue = refuse;
            let options = CudaOptions {
                bias_grad_epilogue: epilogue,
                ..CudaOptions::default()
            };
            Some(CudaBackend::on(Arc::new(gpu), Device::Cuda(0), options))
        };
        let cpu = CpuBackend::new();
        let (rows, din, dout) = (37usize, 12usize, 20usize);
        let x: Vec<f32> = (0..rows * din).map(|i| (i as f32 * 0.37).sin()).collect();
        let dy: Vec<f32> = (0..rows * dout).map(|i| (i as f32 * 0.11).cos()).collect();
        let dw0: Vec<f32> = (0..din * dout).map(|i| i as f32 * 0.01 - 0.5).collect();
        let db0: Vec<f32> = (0..dout).map(|i| i as f32 * 0.05 - 0.3).collect();
        let run = |be: &dyn Backend, transposed: bool| {
            let up = |v: &[f32], s: &[usize]| {
                be.upload(v, s, DType::F32, MemoryCategory::Activations, "x")
                    .unwrap()
            };
            let w_shape = if transposed { [dout, din] } else { [din, dout] };
            let (x, dy) = (up(&x, &[rows, din]), up(&dy, &[rows, dout]));
            let (mut dw, mut db) = (up(&dw0, &w_shape), up(&db0, &[dout]));
            be.ledger().set_recording(true);
            crate::ops::linear::weight_bias_grad(be, &mut dw, &mut db, &x, &dy, transposed)
                .unwrap();
            // The epilogue's column sums go to a workspace vector, which the two-op form
            // does not allocate.
            let sums = be.ledger().drain_events().iter().any(|e| {
                matches!(e, crate::memory::MemoryEvent::Alloc { label, .. } if label.ends_with(".sums"))
            });
            (be.to_f32(&dw).unwrap(), be.to_f32(&db).unwrap(), sums)
        };
        for transposed in [false, true] {
            let want = run(&cpu, transposed);
            assert!(!want.2, "the CPU runs the two parts");
            for (refuse, epilogue, fused) in [
                (false, true, true),
                (true, true, false),
                (false, false, false),
            ] {
                let Some(be) = make(refuse, epilogue) else {
                    return;
                };
                for _ in 0..2 {
                    let got = run(&be, transposed);
                    for (g, w) in got.0.iter().chain(&got.1).zip(want.0.iter().chain(&want.1)) {
                        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
                    }
                    // A refused epilogue allocated its sums before cuBLASLt refused it,
                    // and is not tried again.
                    let on = be
                        .bias_grad_epilogue
                        .load(std::sync::atomic::Ordering::Relaxed);
                    assert_eq!(on, fused, "refused {refuse}, epilogue {epilogue}");
                    assert_eq!(got.2 && on, fused, "refused {refuse}, epilogue {epilogue}");
                }
            }
        }
    }
}
