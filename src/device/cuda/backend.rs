//! `CudaBackend`: every [`Backend`] op as kernel launches and cuBLASLt products on one
//! stream.
//!
//! Each op checks its operands with the same contract as the CPU backend (the CPU's
//! checking functions are reused), records one ledger span with the same FLOP count, picks
//! the kernel by the dtypes of its tensors (`<op>_<dtype>...`), and launches it. Work is
//! queued, not waited for: only reads to the host (`to_f32`, `sum_squares`) and
//! `synchronize` wait. A training step's losses, gradient norm and skip decision stay on
//! the device (`cross_entropy` adds to a device tensor, `grad_guard` and `adamw` read
//! it), so a step waits once, for its logged loss. Op spans therefore time the host's
//! side of a launch, not the kernel.
//!
//! Temporary buffers (the two-pass reductions' partial sums, uploaded token ids, casts of
//! operands, cuBLASLt's workspace) are tensors in the ledger's `Workspace` category, so
//! the ledger still counts every byte trainkit holds on the device.

use super::emulated::EmulatedGpu;
use super::gpu::{Args, DeviceBuffer, DevicePtr, Gemm, Gpu, GpuMemory, MatrixLayout};
use super::TokenBuckets;
use crate::device::cpu::{self, each, ensure, ensure_f32, ensure_shape, per_element};
use crate::device::{AdamWStep, Backend, Device};
use crate::error::{Error, Result};
use crate::memory::{format_bytes, Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Threads per block of every kernel but `sum_squares_finish` (32).
const BLOCK: u32 = 256;
/// Rows per block of the half-warp-per-row kernels (16 lanes a row).
const ROWS_PER_BLOCK: usize = BLOCK as usize / 16;
/// Rows per partial sum of the two-pass parameter gradients (the kernels' ROW_BLOCK).
const ROW_BLOCK: usize = 128;

/// Settings of a CUDA backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let f32 products use TF32 tensor cores (faster, about 10 mantissa bits). Off by
    /// default, so `Fp32` training is f32 throughout.
    pub allow_tf32: bool,
}

/// The CUDA backend: trainkit's kernels (NVRTC-compiled) and cuBLASLt on one GPU, or on
/// the CUDA emulator ([`CudaBackend::emulated`]).
pub struct CudaBackend {
    gpu: Arc<dyn Gpu>,
    ledger: Ledger,
    device: Device,
    options: CudaOptions,
    gemm_workspace: Mutex<Option<Tensor>>,
    /// Cleared when cuBLASLt fails a product with the GELU epilogue: from then on the
    /// product and the GELU run as two ops.
    gelu_epilogue: AtomicBool,
}

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
        let gpu = super::driver::DriverGpu::new(ordinal)?;
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
        let gpu = EmulatedGpu::new(capacity)?;
        Ok(Self::on(
            Arc::new(gpu),
            Device::Cuda(0),
            CudaOptions::default(),
        ))
    }

    fn on(gpu: Arc<dyn Gpu>, device: Device, options: CudaOptions) -> CudaBackend {
        CudaBackend {
            gpu,
            ledger: Ledger::new(),
            device,
            options,
            gemm_workspace: Mutex::new(None),
            gelu_epilogue: AtomicBool::new(true),
        }
    }

    /// What the backend runs on, e.g. `NVIDIA H100 80GB HBM3 (sm_90)`.
    pub fn describe(&self) -> String {
        self.gpu.describe()
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

    fn alloc(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
        zero: bool,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = (n * dtype.size()) as u64;
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
            self.gpu.zero(buf.ptr(), bytes as usize)?;
        }
        Tensor::new(Storage::Device(buf), shape, category, label, &self.ledger)
    }

    fn out_of_memory(&self, bytes: u64, category: MemoryCategory, label: &str) -> Error {
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
        Error::OutOfMemory {
            message: format!(
                "the GPU ({}) has no room for {} for `{label}` ({category}): trainkit holds {} \
                 ({}){device}; use a smaller batch with more accumulation steps, a recompute \
                 policy or mixed precision (`trainkit memory` and `trainkit train --autofit` \
                 say what fits)",
                self.gpu.describe(),
                format_bytes(bytes),
                format_bytes(snap.live.total()),
                if live.is_empty() {
                    "nothing".to_string()
                } else {
                    live.join(", ")
                },
            ),
        }
    }

    /// A workspace tensor of `bytes` (rounded up to whole f32s), contents unspecified.
    fn scratch(&self, bytes: usize, label: &str) -> Result<Tensor> {
        self.alloc(
            &[bytes.div_ceil(4)],
            DType::F32,
            MemoryCategory::Workspace,
            label,
            false,
        )
    }

    /// The f64 partial sums of squares of every tensor of `xs` in one workspace buffer
    /// (one per block of each tensor's grid), and how many there are.
    fn square_partials(&self, xs: &[&Tensor], label: &str) -> Result<(Tensor, usize)> {
        let grids: Vec<u32> = xs
            .iter()
            .map(|x| {
                if x.numel() == 0 {
                    0
                } else {
                    self.grid(x.numel())
                }
            })
            .collect();
        let slots: usize = grids.iter().map(|&g| g as usize).sum();
        let partial = self.scratch(slots.max(1) * 8, label)?;
        let base = ptr(&partial)?;
        let mut at = 0usize;
        for (x, &grid) in xs.iter().zip(&grids) {
            if grid == 0 {
                continue;
            }
            self.launch(
                &format!("sum_squares_partial_{}", x.dtype()),
                grid,
                BLOCK,
                Args::new()
                    .ptr(base + (at * 8) as u64)
                    .ptr(ptr(x)?)
                    .i64(x.numel()),
            )?;
            at += grid as usize;
        }
        Ok((partial, slots))
    }

    /// `values` on the device, in a workspace tensor.
    fn upload_u32(&self, values: &[u32], label: &str) -> Result<Tensor> {
        let t = self.scratch(values.len() * 4, label)?;
        if !values.is_empty() {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.gpu.upload(ptr(&t)?, &bytes)?;
        }
        Ok(t)
    }

    /// `t` as `dtype`: `t` itself, or a cast copy in the workspace.
    fn as_dtype<'a>(&self, t: &'a Tensor, dtype: DType) -> Result<Operand<'a>> {
        if t.dtype() == dtype {
            return Ok(Operand::Borrowed(t));
        }
        let mut c = self.alloc(
            t.shape(),
            dtype,
            MemoryCategory::Workspace,
            &format!("{}.as_{dtype}", t.label()),
            false,
        )?;
        self.launch_cast(&mut c, t)?;
        Ok(Operand::Owned(c))
    }

    /// Blocks for a grid-stride loop over `n` elements.
    fn grid(&self, n: usize) -> u32 {
        n.div_ceil(BLOCK as usize)
            .clamp(1, self.gpu.max_blocks() as usize) as u32
    }

    /// Blocks for a half-warp-per-row kernel over `rows` rows.
    fn grid_rows(&self, rows: usize) -> u32 {
        rows.div_ceil(ROWS_PER_BLOCK)
            .clamp(1, self.gpu.max_blocks() as usize * 4) as u32
    }

    fn launch(&self, kernel: &str, grid: u32, block: u32, mut args: Args) -> Result<()> {
        let mut params = args.params();
        // SAFETY: every call site passes the kernel's arguments in its declared order and
        // types (see kernels/*.cu), with device pointers to buffers whose sizes the op
        // checked against the shapes first.
        unsafe { self.gpu.launch(kernel, grid, block, &mut params) }
    }

    fn launch_cast(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        let n = dst.numel();
        if n == 0 {
            return Ok(());
        }
        self.launch(
            &format!("cast_{}_{}", dst.dtype(), src.dtype()),
            self.grid(n),
            BLOCK,
            Args::new().ptr(ptr(dst)?).ptr(ptr(src)?).i64(n),
        )
    }

    /// The cuBLASLt workspace (allocated once, in the ledger).
    fn gemm_workspace(&self) -> Result<(DevicePtr, usize)> {
        let bytes = self.gpu.gemm_workspace_bytes();
        if bytes == 0 {
            return Ok((0, 0));
        }
        let mut w = self
            .gemm_workspace
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if w.is_none() {
            *w = Some(self.scratch(bytes, "cublaslt.workspace")?);
        }
        let t = w.as_ref().expect("set above");
        Ok((ptr(t)?, bytes))
    }

    /// The row sums of `rows × cols` into an f32 `[ceil(rows / 128), cols]` workspace,
    /// then their total added to `dbias` (the bias gradient, two passes, no atomics).
    fn bias_backward_impl(&self, dbias: &mut Tensor, dout: &Tensor) -> Result<()> {
        let (rows, cols) = dout.rows_cols();
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let blocks = rows.div_ceil(ROW_BLOCK);
        let partial = self.scratch(blocks * cols * 4, "bias_backward.partial")?;
        self.launch(
            &format!("bias_backward_partial_{}", dout.dtype()),
            self.grid(blocks * cols),
            BLOCK,
            Args::new()
                .ptr(ptr(&partial)?)
                .ptr(ptr(dout)?)
                .i64(rows)
                .i64(cols),
        )?;
        self.launch(
            &format!("bias_backward_finish_{}", dbias.dtype()),
            self.grid(cols),
            BLOCK,
            Args::new()
                .ptr(ptr(dbias)?)
                .ptr(ptr(&partial)?)
                .i64(blocks)
                .i64(cols),
        )
    }

    /// [`Backend::matmul`] without its ledger span, with `gelu_aux` the address of the
    /// pre-GELU values when the epilogue applies GELU (0: no GELU; the caller checks the
    /// fused form applies).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
        gelu_aux: DevicePtr,
    ) -> Result<()> {
        let (m, n, k) = cpu::matmul::dims(out, a, b, bias, trans_a, trans_b)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        ensure(k > 0, "matmul", || {
            format!(
                "`{}` and `{}` have an empty inner dimension",
                a.label(),
                b.label()
            )
        })?;
        let operand = operand_dtype(a, b);
        let a = self.as_dtype(a, operand)?;
        let b = self.as_dtype(b, operand)?;
        if operand == DType::F32 && out.dtype() == DType::Bf16 {
            // f32 operands into bf16: the product in f32, then added or cast.
            let mut tmp = self.alloc(
                out.shape(),
                DType::F32,
                MemoryCategory::Workspace,
                &format!("{}.f32", out.label()),
                false,
            )?;
            self.gemm(&mut tmp, &a, &b, bias, trans_a, trans_b, false, 0)?;
            return if accumulate {
                let n_el = out.numel();
                let o = ptr(out)?;
                self.launch(
                    "add_bf16_bf16_f32",
                    self.grid(n_el),
                    BLOCK,
                    Args::new().ptr(o).ptr(o).ptr(ptr(&tmp)?).i64(n_el),
                )
            } else {
                self.launch_cast(out, &tmp)
            };
        }
        let bias = match bias {
            Some(t) => Some(self.as_dtype(t, out.dtype())?),
            None => None,
        };
        // Row-major X[r, c] is column-major Xᵀ (r columns of c): out = op(a)·op(b) is
        // outᵀ = op(b)ᵀ·op(a)ᵀ, so cuBLASLt's A is our b and its B is our a, each with its
        // own transpose flag, and D is outᵀ, n × m.
        let colmajor = |t: &Tensor| {
            let (r, c) = t.rows_cols();
            MatrixLayout {
                ty: t.dtype().into(),
                rows: c as u64,
                cols: r as u64,
                ld: c as i64,
            }
        };
        let (workspace, workspace_bytes) = self.gemm_workspace()?;
        let g = Gemm {
            trans_a: trans_b,
            trans_b: trans_a,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            a: ptr(&b)?,
            a_layout: colmajor(&b),
            b: ptr(&a)?,
            b_layout: colmajor(&a),
            d: ptr(out)?,
            d_layout: colmajor(out),
            bias: match &bias {
                Some(t) => ptr(t)?,
                None => 0,
            },
            gelu_aux,
            alpha: 1.0,
            beta: if accumulate { 1.0 } else { 0.0 },
            allow_tf32: self.options.allow_tf32,
            workspace,
            workspace_bytes,
        };
        // SAFETY: the layouts are the tensors' own shapes, checked above.
        unsafe { self.gpu.gemm(&g) }
    }

    fn embedding_backward_impl(
        &self,
        dwte: &mut Tensor,
        dwpe: &mut Tensor,
        dout: &Tensor,
        tokens: &[u32],
    ) -> Result<()> {
        let (b, t, c, _) = cpu::embedding::check("embedding_backward", dout, tokens, dwte, dwpe)?;
        if b * t == 0 || c == 0 {
            return Ok(());
        }
        let buckets = TokenBuckets::new(tokens);
        let bt = self.upload_u32(&buckets.tokens, "embedding_backward.tokens")?;
        let bo = self.upload_u32(&buckets.offsets, "embedding_backward.offsets")?;
        let br = self.upload_u32(&buckets.rows, "embedding_backward.rows")?;
        let suffix = format!("{}_{}", dout.dtype(), dwte.dtype());
        self.launch(
            &format!("embedding_backward_wte_{suffix}"),
            self.grid(buckets.len() * c),
            BLOCK,
            Args::new()
                .ptr(ptr(dwte)?)
                .ptr(ptr(dout)?)
                .ptr(ptr(&bt)?)
                .ptr(ptr(&bo)?)
                .ptr(ptr(&br)?)
                .i64(buckets.len())
                .i64(c),
        )?;
        let dwpe_kernel = format!("embedding_backward_wpe_{}_{}", dout.dtype(), dwpe.dtype());
        let dwpe_ptr = ptr(dwpe)?;
        self.launch(
            &dwpe_kernel,
            self.grid(t * c),
            BLOCK,
            Args::new()
                .ptr(dwpe_ptr)
                .ptr(ptr(dout)?)
                .i64(b)
                .i64(t)
                .i64(c),
        )
    }
}

/// An operand in the dtype an op needs: the caller's tensor or a converted copy.
enum Operand<'a> {
    Borrowed(&'a Tensor),
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

/// The device address of `t`'s first element, or an error for a tensor of another
/// backend.
fn ptr(t: &Tensor) -> Result<DevicePtr> {
    match t.storage() {
        Storage::Device(d) => Ok(d.ptr()),
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
fn ensure_dtype(t: &Tensor, dtype: DType, op: &'static str) -> Result<()> {
    ensure(t.dtype() == dtype, op, || {
        format!("`{}` must be {dtype}, it is {}", t.label(), t.dtype())
    })
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> Device {
        self.device
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn device_memory(&self) -> Option<GpuMemory> {
        self.gpu.memory()
    }

    fn reset_device_peak(&self) {
        self.gpu.reset_peak()
    }

    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label, true)
    }

    fn empty(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label, false)
    }

    fn upload(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        let op = self.ledger.op("upload", 0, label);
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return op.finish(Err(Error::shape(
                "upload",
                format!(
                    "`{label}`: shape {shape:?} holds {numel} elements but {} were given",
                    data.len()
                ),
            )));
        }
        let t = self.alloc(shape, dtype, category, label, false)?;
        if let Storage::Device(d) = t.storage() {
            d.write_f32(data)?;
        }
        op.finish(Ok(t))
    }

    fn to_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        let _op = self.ledger.op("to_f32", 0, t.label());
        match t.storage() {
            Storage::Device(d) => d.to_f32(),
            _ => Err(Error::Backend {
                backend: "cuda",
                message: format!("`{}` lives in host memory, not on the GPU", t.label()),
            }),
        }
    }

    fn copy(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        let op = self.ledger.op("copy", 0, label);
        let out = self.alloc(t.shape(), t.dtype(), category, label, false)?;
        if t.bytes() > 0 {
            self.gpu.copy(ptr(&out)?, ptr(t)?, t.bytes() as usize)?;
        }
        op.finish(Ok(out))
    }

    fn cast(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        let op = self.ledger.op("cast", 0, dst.label());
        op.finish(
            cpu::elementwise::same_len(dst, src, "cast").and_then(|()| self.launch_cast(dst, src)),
        )
    }

    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        let _op = self.ledger.op("fill", 0, t.label());
        let n = t.numel();
        if n == 0 {
            return Ok(());
        }
        if value == 0.0 && value.is_sign_positive() {
            return self.gpu.zero(ptr(t)?, t.bytes() as usize);
        }
        self.launch(
            &format!("fill_{}", t.dtype()),
            self.grid(n),
            BLOCK,
            Args::new().ptr(ptr(t)?).f32(value).i64(n),
        )
    }

    fn add(&self, out: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
        let n = out.numel();
        let _op = self
            .ledger
            .op("add", each(n, per_element::ADD), out.label());
        cpu::elementwise::same_len(out, a, "add")?;
        cpu::elementwise::same_len(out, b, "add")?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            &format!("add_{}_{}_{}", out.dtype(), a.dtype(), b.dtype()),
            self.grid(n),
            BLOCK,
            Args::new().ptr(ptr(out)?).ptr(ptr(a)?).ptr(ptr(b)?).i64(n),
        )
    }

    fn axpy(&self, y: &mut Tensor, alpha: f32, x: &Tensor) -> Result<()> {
        let n = y.numel();
        let _op = self
            .ledger
            .op("axpy", each(n, per_element::AXPY), y.label());
        cpu::elementwise::same_len(y, x, "axpy")?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            &format!("axpy_{}_{}", y.dtype(), x.dtype()),
            self.grid(n),
            BLOCK,
            Args::new().ptr(ptr(y)?).f32(alpha).ptr(ptr(x)?).i64(n),
        )
    }

    fn scale(&self, x: &mut Tensor, alpha: f32) -> Result<()> {
        let n = x.numel();
        let _op = self
            .ledger
            .op("scale", each(n, per_element::SCALE), x.label());
        if n == 0 {
            return Ok(());
        }
        self.launch(
            &format!("scale_{}", x.dtype()),
            self.grid(n),
            BLOCK,
            Args::new().ptr(ptr(x)?).f32(alpha).i64(n),
        )
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        let n = x.numel();
        let _op = self
            .ledger
            .op("sum_squares", each(n, per_element::SUM_SQUARES), x.label());
        if n == 0 {
            return Ok(0.0);
        }
        let grid = self.grid(n);
        let partial = self.scratch(grid as usize * 8, "sum_squares.partial")?;
        let total = self.scratch(8, "sum_squares.total")?;
        self.launch(
            &format!("sum_squares_partial_{}", x.dtype()),
            grid,
            BLOCK,
            Args::new().ptr(ptr(&partial)?).ptr(ptr(x)?).i64(n),
        )?;
        self.launch(
            "sum_squares_finish",
            1,
            32,
            Args::new()
                .ptr(ptr(&total)?)
                .ptr(ptr(&partial)?)
                .i64(grid as usize),
        )?;
        let mut bytes = [0u8; 8];
        self.gpu.download(&mut bytes, ptr(&total)?)?;
        Ok(f64::from_le_bytes(bytes))
    }

    fn sum_squares_all(&self, xs: &[&Tensor]) -> Result<f64> {
        // One partial per block of every tensor in one buffer, one finishing sum over all
        // of them, and one read back.
        let total_n: usize = xs.iter().map(|x| x.numel()).sum();
        let _op = self.ledger.op(
            "sum_squares",
            each(total_n, per_element::SUM_SQUARES),
            "gradients",
        );
        let (partial, slots) = self.square_partials(xs, "sum_squares.partial")?;
        if slots == 0 {
            return Ok(0.0);
        }
        let total = self.scratch(8, "sum_squares.total")?;
        self.launch(
            "sum_squares_finish",
            1,
            32,
            Args::new().ptr(ptr(&total)?).ptr(ptr(&partial)?).i64(slots),
        )?;
        let mut bytes = [0u8; 8];
        self.gpu.download(&mut bytes, ptr(&total)?)?;
        Ok(f64::from_le_bytes(bytes))
    }

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
        let flops = cpu::matmul::flops(out, a, bias.is_some(), trans_a);
        let op = self.ledger.op("matmul", flops, out.label());
        op.finish(self.gemm(out, a, b, bias, trans_a, trans_b, accumulate, 0))
    }

    fn matmul_bias_gelu(
        &self,
        out: &mut Tensor,
        pre: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: &Tensor,
    ) -> Result<()> {
        // cuBLASLt's GELU_AUX_BIAS epilogue writes both outputs from the accumulator:
        // when the operands are of one dtype (or bf16 into f32), both outputs share D's
        // dtype and shape, and the rows are a multiple of 8 elements (the aux's leading
        // dimension). Otherwise the product and the GELU run as two ops.
        let operand = operand_dtype(a, b);
        let (_, cols) = pre.rows_cols();
        let fused = out.dtype() == pre.dtype()
            && out.shape() == pre.shape()
            && !(operand == DType::F32 && pre.dtype() == DType::Bf16)
            && cols % 8 == 0
            && self.gelu_epilogue.load(Ordering::Relaxed);
        if fused {
            let flops =
                cpu::matmul::flops(pre, a, true, false) + each(out.numel(), per_element::GELU);
            let op = self.ledger.op("matmul_bias_gelu", flops, out.label());
            let aux = ptr(pre)?;
            match op.finish(self.gemm(out, a, b, Some(bias), false, false, false, aux)) {
                Ok(()) => return Ok(()),
                // Nothing was written: say so once and run the two ops, which report the
                // error again if it was not the epilogue's.
                Err(e) => {
                    if self.gelu_epilogue.swap(false, Ordering::Relaxed) {
                        log::warn!(
                            "cuBLASLt ran no product with the GELU epilogue ({e}); the MLP's \
                             product and GELU now run as two ops"
                        );
                    }
                }
            }
        }
        self.matmul(pre, a, b, Some(bias), false, false, false)?;
        self.gelu(out, pre)
    }

    fn bias_backward(&self, dbias: &mut Tensor, dout: &Tensor) -> Result<()> {
        let (_, cols) = dout.rows_cols();
        let flops = each(dout.numel(), per_element::BIAS_BACKWARD);
        let op = self.ledger.op("bias_backward", flops, dbias.label());
        let checked = ensure(dbias.numel() == cols, "bias_backward", || {
            format!(
                "`{}` has {} elements, `{}` has {cols} columns",
                dbias.label(),
                dbias.numel(),
                dout.label()
            )
        });
        op.finish(checked.and_then(|()| self.bias_backward_impl(dbias, dout)))
    }

    fn embedding(
        &self,
        out: &mut Tensor,
        tokens: &[u32],
        wte: &Tensor,
        wpe: &Tensor,
    ) -> Result<()> {
        let _op = self.ledger.op(
            "embedding",
            each(out.numel(), per_element::EMBEDDING),
            out.label(),
        );
        let (b, t, c, _) = cpu::embedding::check("embedding", out, tokens, wte, wpe)?;
        if b * t * c == 0 {
            return Ok(());
        }
        let dt = out.dtype();
        let wte = self.as_dtype(wte, dt)?;
        let wpe = self.as_dtype(wpe, dt)?;
        let toks = self.upload_u32(tokens, "embedding.tokens")?;
        self.launch(
            &format!("embedding_{dt}"),
            self.grid(b * t * c),
            BLOCK,
            Args::new()
                .ptr(ptr(out)?)
                .ptr(ptr(&toks)?)
                .ptr(ptr(&wte)?)
                .ptr(ptr(&wpe)?)
                .i64(b * t)
                .i64(t)
                .i64(c),
        )
    }

    fn embedding_backward(
        &self,
        dwte: &mut Tensor,
        dwpe: &mut Tensor,
        dout: &Tensor,
        tokens: &[u32],
    ) -> Result<()> {
        let flops = each(dout.numel(), per_element::EMBEDDING_BACKWARD);
        let op = self.ledger.op("embedding_backward", flops, dwte.label());
        op.finish(self.embedding_backward_impl(dwte, dwpe, dout, tokens))
    }

    fn layernorm(
        &self,
        out: &mut Tensor,
        stats: &mut Tensor,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
    ) -> Result<()> {
        let _op = self.ledger.op(
            "layernorm",
            each(x.numel(), per_element::LAYERNORM),
            out.label(),
        );
        let (rows, c) = cpu::layernorm::check_forward(out, stats, x, weight, bias)?;
        ensure_dtype(out, x.dtype(), "layernorm")?;
        if rows * c == 0 {
            return Ok(());
        }
        let dt = x.dtype();
        let weight = self.as_dtype(weight, dt)?;
        let bias = self.as_dtype(bias, dt)?;
        self.launch(
            &format!("layernorm_{dt}"),
            self.grid_rows(rows),
            BLOCK,
            Args::new()
                .ptr(ptr(out)?)
                .ptr(ptr(stats)?)
                .ptr(ptr(x)?)
                .ptr(ptr(&weight)?)
                .ptr(ptr(&bias)?)
                .i64(rows)
                .i64(c)
                .f32(eps),
        )
    }

    fn layernorm_backward(
        &self,
        dx: &mut Tensor,
        dweight: &mut Tensor,
        dbias: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        stats: &Tensor,
    ) -> Result<()> {
        let _op = self.ledger.op(
            "layernorm_backward",
            each(x.numel(), per_element::LAYERNORM_BACKWARD),
            dx.label(),
        );
        let (rows, c) = cpu::layernorm::check_backward(dx, dweight, dbias, dout, x, weight, stats)?;
        // The kernels read the statistics as f32.
        ensure_f32(stats, "layernorm_backward")?;
        ensure_dtype(dbias, dweight.dtype(), "layernorm_backward")?;
        if rows * c == 0 {
            return Ok(());
        }
        let dt = x.dtype();
        let dx_dt = dx.dtype();
        ensure_dtype(dx, dt, "layernorm_backward")?;
        let dout = self.as_dtype(dout, dt)?;
        let weight = self.as_dtype(weight, dt)?;
        self.launch(
            &format!("layernorm_backward_dx_{dx_dt}"),
            self.grid_rows(rows),
            BLOCK,
            Args::new()
                .ptr(ptr(dx)?)
                .ptr(ptr(&dout)?)
                .ptr(ptr(x)?)
                .ptr(ptr(&weight)?)
                .ptr(ptr(stats)?)
                .i64(rows)
                .i64(c),
        )?;
        let blocks = rows.div_ceil(ROW_BLOCK);
        let partial = self.scratch(blocks * 2 * c * 4, "layernorm_backward.partial")?;
        self.launch(
            &format!("layernorm_backward_params_{dt}"),
            self.grid(blocks * c),
            BLOCK,
            Args::new()
                .ptr(ptr(&partial)?)
                .ptr(ptr(&dout)?)
                .ptr(ptr(x)?)
                .ptr(ptr(stats)?)
                .i64(rows)
                .i64(c),
        )?;
        self.launch(
            &format!("layernorm_backward_params_finish_{}", dweight.dtype()),
            self.grid(c),
            BLOCK,
            Args::new()
                .ptr(ptr(dweight)?)
                .ptr(ptr(dbias)?)
                .ptr(ptr(&partial)?)
                .i64(blocks)
                .i64(c),
        )
    }

    fn gelu(&self, out: &mut Tensor, x: &Tensor) -> Result<()> {
        let n = x.numel();
        let _op = self
            .ledger
            .op("gelu", each(n, per_element::GELU), out.label());
        cpu::elementwise::same_len(out, x, "gelu")?;
        ensure_dtype(out, x.dtype(), "gelu")?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            &format!("gelu_{}", x.dtype()),
            self.grid(n),
            BLOCK,
            Args::new().ptr(ptr(out)?).ptr(ptr(x)?).i64(n),
        )
    }

    fn gelu_backward(&self, dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()> {
        let n = x.numel();
        let _op = self.ledger.op(
            "gelu_backward",
            each(n, per_element::GELU_BACKWARD),
            dx.label(),
        );
        cpu::elementwise::same_len(dx, x, "gelu_backward")?;
        cpu::elementwise::same_len(dout, x, "gelu_backward")?;
        ensure_dtype(dx, x.dtype(), "gelu_backward")?;
        if n == 0 {
            return Ok(());
        }
        let dout = self.as_dtype(dout, x.dtype())?;
        self.launch(
            &format!("gelu_backward_{}", x.dtype()),
            self.grid(n),
            BLOCK,
            Args::new()
                .ptr(ptr(dx)?)
                .ptr(ptr(x)?)
                .ptr(ptr(&dout)?)
                .i64(n),
        )
    }

    fn attention_scores(&self, scores: &mut Tensor, qkv: &Tensor, n_head: usize) -> Result<()> {
        let flops = cpu::attention::AttentionFlops::new(qkv, n_head).scores;
        let _op = self.ledger.op("attention_scores", flops, scores.label());
        let d = cpu::attention::dims(qkv, n_head, "attention_scores")?;
        ensure_shape(scores, &[d.b, d.h, d.t, d.t], "attention_scores")?;
        ensure_dtype(scores, qkv.dtype(), "attention_scores")?;
        let n = scores.numel();
        if n == 0 {
            return Ok(());
        }
        let scale = 1.0 / (d.hs as f32).sqrt();
        self.launch(
            &format!("attention_scores_{}", qkv.dtype()),
            self.grid(n),
            BLOCK,
            Args::new()
                .ptr(ptr(scores)?)
                .ptr(ptr(qkv)?)
                .i64(d.b)
                .i64(d.t)
                .i64(d.c)
                .i64(d.h)
                .f32(scale),
        )
    }

    fn attention_scores_backward(
        &self,
        dqkv: &mut Tensor,
        dscores: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()> {
        let flops = cpu::attention::AttentionFlops::new(qkv, n_head).scores_backward;
        let _op = self
            .ledger
            .op("attention_scores_backward", flops, dqkv.label());
        let d = cpu::attention::dims(qkv, n_head, "attention_scores_backward")?;
        ensure_shape(dqkv, qkv.shape(), "attention_scores_backward")?;
        ensure_shape(dscores, &[d.b, d.h, d.t, d.t], "attention_scores_backward")?;
        let dt = qkv.dtype();
        ensure_dtype(dqkv, dt, "attention_scores_backward")?;
        if qkv.numel() == 0 {
            return Ok(());
        }
        let dscores = self.as_dtype(dscores, dt)?;
        let scale = 1.0 / (d.hs as f32).sqrt();
        self.launch(
            &format!("attention_scores_backward_{dt}"),
            self.grid(d.b * d.t * 2 * d.c),
            BLOCK,
            Args::new()
                .ptr(ptr(dqkv)?)
                .ptr(ptr(&dscores)?)
                .ptr(ptr(qkv)?)
                .i64(d.b)
                .i64(d.t)
                .i64(d.c)
                .i64(d.h)
                .f32(scale),
        )
    }

    fn softmax_causal(&self, probs: &mut Tensor, scores: &Tensor) -> Result<()> {
        let flops = cpu::attention::softmax_flops(scores, per_element::SOFTMAX);
        let _op = self.ledger.op("softmax_causal", flops, probs.label());
        let t = cpu::attention::square_rows(scores, "softmax_causal")?;
        ensure_shape(probs, scores.shape(), "softmax_causal")?;
        ensure_dtype(probs, scores.dtype(), "softmax_causal")?;
        let rows = scores.numel().checked_div(t).unwrap_or(0);
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            &format!("softmax_causal_{}", scores.dtype()),
            self.grid_rows(rows),
            BLOCK,
            Args::new()
                .ptr(ptr(probs)?)
                .ptr(ptr(scores)?)
                .i64(rows)
                .i64(t),
        )
    }

    fn softmax_causal_backward(
        &self,
        dscores: &mut Tensor,
        dprobs: &Tensor,
        probs: &Tensor,
    ) -> Result<()> {
        let flops = cpu::attention::softmax_flops(probs, per_element::SOFTMAX_BACKWARD);
        let _op = self
            .ledger
            .op("softmax_causal_backward", flops, dscores.label());
        let t = cpu::attention::square_rows(probs, "softmax_causal_backward")?;
        ensure_shape(dscores, probs.shape(), "softmax_causal_backward")?;
        ensure_shape(dprobs, probs.shape(), "softmax_causal_backward")?;
        let dt = probs.dtype();
        ensure_dtype(dscores, dt, "softmax_causal_backward")?;
        let rows = probs.numel().checked_div(t).unwrap_or(0);
        if rows == 0 {
            return Ok(());
        }
        let dprobs = self.as_dtype(dprobs, dt)?;
        self.launch(
            &format!("softmax_causal_backward_{dt}"),
            self.grid_rows(rows),
            BLOCK,
            Args::new()
                .ptr(ptr(dscores)?)
                .ptr(ptr(&dprobs)?)
                .ptr(ptr(probs)?)
                .i64(rows)
                .i64(t),
        )
    }

    fn attention_values(
        &self,
        out: &mut Tensor,
        probs: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()> {
        let flops = cpu::attention::AttentionFlops::new(qkv, n_head).values;
        let _op = self.ledger.op("attention_values", flops, out.label());
        let d = cpu::attention::dims(qkv, n_head, "attention_values")?;
        ensure_shape(out, &[d.b, d.t, d.c], "attention_values")?;
        ensure_shape(probs, &[d.b, d.h, d.t, d.t], "attention_values")?;
        let dt = qkv.dtype();
        ensure_dtype(out, dt, "attention_values")?;
        if out.numel() == 0 {
            return Ok(());
        }
        let probs = self.as_dtype(probs, dt)?;
        self.launch(
            &format!("attention_values_{dt}"),
            self.grid(out.numel()),
            BLOCK,
            Args::new()
                .ptr(ptr(out)?)
                .ptr(ptr(&probs)?)
                .ptr(ptr(qkv)?)
                .i64(d.b)
                .i64(d.t)
                .i64(d.c)
                .i64(d.h),
        )
    }

    fn attention_values_backward(
        &self,
        dprobs: &mut Tensor,
        dqkv: &mut Tensor,
        dout: &Tensor,
        probs: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()> {
        let flops = cpu::attention::AttentionFlops::new(qkv, n_head).values_backward;
        let _op = self
            .ledger
            .op("attention_values_backward", flops, dprobs.label());
        let d = cpu::attention::dims(qkv, n_head, "attention_values_backward")?;
        ensure_shape(dout, &[d.b, d.t, d.c], "attention_values_backward")?;
        ensure_shape(probs, &[d.b, d.h, d.t, d.t], "attention_values_backward")?;
        ensure_shape(dprobs, probs.shape(), "attention_values_backward")?;
        ensure_shape(dqkv, qkv.shape(), "attention_values_backward")?;
        let dt = qkv.dtype();
        ensure_dtype(dprobs, dt, "attention_values_backward")?;
        ensure_dtype(dqkv, dt, "attention_values_backward")?;
        if qkv.numel() == 0 {
            return Ok(());
        }
        let dout = self.as_dtype(dout, dt)?;
        let probs = self.as_dtype(probs, dt)?;
        let dims = |a: Args| a.i64(d.b).i64(d.t).i64(d.c).i64(d.h);
        self.launch(
            &format!("attention_values_backward_dprobs_{dt}"),
            self.grid(dprobs.numel()),
            BLOCK,
            dims(
                Args::new()
                    .ptr(ptr(dprobs)?)
                    .ptr(ptr(&dout)?)
                    .ptr(ptr(qkv)?),
            ),
        )?;
        self.launch(
            &format!("attention_values_backward_dv_{dt}"),
            self.grid(d.b * d.t * d.c),
            BLOCK,
            dims(
                Args::new()
                    .ptr(ptr(dqkv)?)
                    .ptr(ptr(&dout)?)
                    .ptr(ptr(&probs)?),
            ),
        )
    }

    fn cross_entropy(
        &self,
        logits: &mut Tensor,
        targets: &[u32],
        vocab: usize,
        grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<()> {
        let per = match grad_scale {
            Some(_) => per_element::CROSS_ENTROPY_GRAD,
            None => per_element::CROSS_ENTROPY,
        };
        let flops = each(targets.len().saturating_mul(vocab), per);
        let _op = self.ledger.op("cross_entropy", flops, logits.label());
        let (rows, vp) = cpu::cross_entropy::check(logits, targets, vocab)?;
        cpu::cross_entropy::check_losses(losses, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let tg = self.upload_u32(targets, "cross_entropy.targets")?;
        self.launch(
            &format!("cross_entropy_{}", logits.dtype()),
            self.grid_rows(rows),
            BLOCK,
            Args::new()
                .ptr(ptr(logits)?)
                .ptr(ptr(losses)?)
                .ptr(ptr(&tg)?)
                .i64(rows)
                .i64(vp)
                .i64(vocab)
                .f32(grad_scale.unwrap_or(0.0))
                .i32(grad_scale.is_some() as i32),
        )
    }

    fn grad_guard(
        &self,
        record: &mut Tensor,
        grads: &[&Tensor],
        losses: &Tensor,
        max_norm: f32,
        loss_scale: f32,
    ) -> Result<()> {
        // One partial per block of every gradient in one buffer, then one block that adds
        // them and the losses and writes the record: nothing is read back.
        let total_n: usize = grads.iter().map(|x| x.numel()).sum();
        let _op = self.ledger.op(
            "grad_guard",
            each(total_n, per_element::SUM_SQUARES),
            record.label(),
        );
        cpu::guard::check(record, losses)?;
        let (partial, slots) = self.square_partials(grads, "grad_guard.partial")?;
        self.launch(
            "grad_guard",
            1,
            32,
            Args::new()
                .ptr(ptr(record)?)
                .ptr(ptr(&partial)?)
                .i64(slots)
                .ptr(ptr(losses)?)
                .i64(losses.numel())
                .f32(max_norm)
                .f32(loss_scale),
        )
    }

    fn adamw(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: &AdamWStep,
        scale: Option<&Tensor>,
        compute: Option<&mut Tensor>,
    ) -> Result<()> {
        let n = param.numel();
        let _op = self
            .ledger
            .op("adamw", each(n, per_element::ADAMW), param.label());
        cpu::adamw::check(param, grad, m, v)?;
        let scale = match scale {
            Some(s) => {
                cpu::adamw::check_scale(s)?;
                ptr(s)?
            }
            None => 0,
        };
        if let Some(c) = &compute {
            cpu::elementwise::same_len(c, param, "adamw")?;
        }
        if n == 0 {
            return Ok(());
        }
        // The kernel writes a bf16 compute copy in its pass; another dtype is cast after.
        let (fused, after) = match compute {
            Some(c) if c.dtype() == DType::Bf16 => (ptr(c)?, None),
            other => (0, other),
        };
        let (step_size, bc2_sqrt, decay) = hp.constants();
        self.launch(
            &format!("adamw_{}", grad.dtype()),
            self.grid(n),
            BLOCK,
            Args::new()
                .ptr(ptr(param)?)
                .ptr(ptr(grad)?)
                .ptr(ptr(m)?)
                .ptr(ptr(v)?)
                .ptr(scale)
                .ptr(fused)
                .i64(n)
                .f32(hp.beta1)
                .f32(hp.beta2)
                .f32(hp.eps)
                .f32(hp.grad_scale)
                .f32(step_size)
                .f32(bc2_sqrt)
                .f32(decay),
        )?;
        match after {
            Some(c) => self.launch_cast(c, param),
            None => Ok(()),
        }
    }
}

/// The dtype both operands of a product are brought to: cuBLASLt multiplies equal
/// operand types (bf16 × bf16 may write f32 or bf16, f32 × f32 writes f32), so mixed
/// operands are multiplied in f32.
fn operand_dtype(a: &Tensor, b: &Tensor) -> DType {
    if a.dtype() == b.dtype() {
        a.dtype()
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::CpuBackend;

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
            be.matmul_bias_gelu(&mut out, &mut pre, &a, &b, &bias)
                .unwrap();
            (be.to_f32(&pre).unwrap(), be.to_f32(&out).unwrap())
        };
        let want = run(&cpu);
        for _ in 0..2 {
            let got = run(&be);
            for (g, w) in got.0.iter().chain(&got.1).zip(want.0.iter().chain(&want.1)) {
                assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
            }
            assert!(!be.gelu_epilogue.load(Ordering::Relaxed));
        }
    }
}
