//! The CUDA backend's device layer on the CPU: "device" memory is host memory, kernels run
//! in the kernel emulator ([`super::emulator::KernelEmulator`]: the same .cu sources,
//! compiled for the host, with CUDA's threads, warps and barriers emulated), and products
//! are computed by a plain reference loop from the very column-major description the real
//! GPU hands to cuBLASLt.
//!
//! It exists so that the whole CUDA backend (launch configurations, argument lists,
//! workspaces, matrix layouts, the order of operations) runs and is checked against the
//! CPU backend where no GPU is present, as in CI. It is slow, and it proves nothing about
//! PTX code generation, timing or the real memory model: those need a GPU.

use super::emulated_offload::EmulatedOffload;
use super::emulator::KernelEmulator;
use super::gpu::{
    too_much_shared, AllocError, DevicePtr, Gemm, GemmRun, Gpu, GpuMemory, HostPtr, LoadedFiles,
    MatrixLayout, MatrixType, Ticket, UploadStats,
};
use super::kernels::kernel_files;
use super::staging::{Next, RingPlan, FIRST_BYTES, MAX_UPLOAD};
use super::timing::{gemm_name, HostTimer};
use crate::error::{Error, Result};
use rayon::prelude::*;
use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Alignment of every emulated allocation (the pool's on a real GPU).
const ALIGN: usize = 256;

/// The byte every fresh allocation is filled with: 0xFF makes f32 and bf16 NaN, so an
/// element a kernel should have written and did not shows up in a comparison.
const POISON: u8 = 0xFF;

/// The shared memory a Hopper block may opt into (227 KiB), which the emulator reports as
/// its own, as it reports Hopper's compute capability.
const HOPPER_SHARED_BYTES: u32 = 227 << 10;

#[derive(Default)]
struct Pool {
    live: HashMap<DevicePtr, usize>,
    used: u64,
    peak: u64,
}

/// A GPU emulated on the host.
pub(crate) struct EmulatedGpu {
    kernels: KernelEmulator,
    /// Kernels written outside trainkit, each built into a library of its own on first use.
    custom: LoadedFiles<Arc<KernelEmulator>, Arc<KernelEmulator>>,
    pool: Mutex<Pool>,
    /// Refuse allocations beyond this many live bytes (to test out-of-memory handling).
    capacity: Option<u64>,
    /// Downloads and synchronizations so far.
    waits: AtomicU64,
    /// Host buffers of offloaded tensors and the copies back not yet run.
    offload: EmulatedOffload,
    /// Refuse products with the GELU epilogue, as a library without an algorithm for one
    /// would (to test the backend's fallback).
    pub(crate) refuse_gelu_epilogue: bool,
    /// Refuse products with a bias-gradient epilogue, as a library without an algorithm
    /// for one would.
    pub(crate) refuse_bias_grad_epilogue: bool,
    /// Have no algorithm for any product (to test the plain product).
    pub(crate) refuse_products: bool,
    /// Fail this many of the next launches with `CUDA_ERROR_OUT_OF_MEMORY`, as a kernel
    /// whose local memory finds no room would (to test the mapping to
    /// [`Error::OutOfMemory`]).
    pub(crate) failing_launches: AtomicU64,
    /// Kernel files loaded: trainkit's at start-up, then others' on first use.
    module_loads: AtomicU64,
    /// The page-locked ring a GPU copies uploads through, as planned (see
    /// [`super::staging`]): an upload is in flight until the next wait for the device, so
    /// the ring grows as it would where the device lags behind the host.
    ring: Mutex<(RingPlan, u64)>,
    /// Uploads so far.
    uploads: AtomicU64,
    /// The host's clock around launches and products while per-kernel timing is on.
    timer: HostTimer,
}

impl std::fmt::Debug for EmulatedGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EmulatedGpu")
    }
}

impl EmulatedGpu {
    /// Builds (or reuses) the kernel emulator; `capacity` caps live bytes like a device's
    /// memory size.
    pub(crate) fn new(capacity: Option<u64>) -> Result<EmulatedGpu> {
        Ok(EmulatedGpu {
            kernels: KernelEmulator::new()?,
            custom: LoadedFiles::new(),
            pool: Mutex::new(Pool::default()),
            capacity,
            waits: AtomicU64::new(0),
            offload: EmulatedOffload::default(),
            refuse_gelu_epilogue: false,
            refuse_bias_grad_epilogue: false,
            refuse_products: false,
            failing_launches: AtomicU64::new(0),
            module_loads: AtomicU64::new(kernel_files().len() as u64),
            ring: Mutex::new((RingPlan::new(FIRST_BYTES), 0)),
            uploads: AtomicU64::new(0),
            timer: HostTimer::new(),
        })
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a wait for the device: every upload has then been copied.
    fn waited(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.ring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .retire_all();
    }

    /// Plans an upload of `len` bytes through the ring as the GPU's staging does,
    /// counting the waits it would make.
    fn stage(&self, len: usize) {
        self.uploads.fetch_add(1, Ordering::Relaxed);
        if len > MAX_UPLOAD {
            self.waited();
            return;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let (plan, tag) = &mut *ring;
        loop {
            match plan.next(len) {
                Next::At(start) => {
                    plan.push(start, len, *tag);
                    *tag += 1;
                    return;
                }
                Next::Grow(bigger) => *plan = bigger,
                // The oldest upload in flight is the oldest of the plan.
                Next::WaitFor(_) => {
                    self.waits.fetch_add(1, Ordering::Relaxed);
                    plan.retire_oldest();
                }
                Next::TooLarge => {
                    self.waits.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }
}

impl Drop for EmulatedGpu {
    fn drop(&mut self) {
        let pool = std::mem::take(&mut *self.pool());
        for (ptr, bytes) in pool.live {
            // SAFETY: allocated in `alloc` with this layout and not freed since.
            unsafe {
                std::alloc::dealloc(
                    ptr as *mut u8,
                    Layout::from_size_align_unchecked(bytes, ALIGN),
                )
            };
        }
    }
}

/// Reads element `i` of a matrix of type `ty` at `base` as f32.
///
/// # Safety
/// `base` must address at least `i + 1` elements of `ty`.
unsafe fn load(ty: MatrixType, base: DevicePtr, i: usize) -> f32 {
    match ty {
        MatrixType::F32 => *(base as *const f32).add(i),
        MatrixType::Bf16 => half::bf16::from_bits(*(base as *const u16).add(i)).to_f32(),
        MatrixType::F16 => half::f16::from_bits(*(base as *const u16).add(i)).to_f32(),
    }
}

/// Stores `v` (rounded to `ty`) as element `i` of a matrix at `base`.
///
/// # Safety
/// `base` must address at least `i + 1` elements of `ty`.
unsafe fn store(ty: MatrixType, base: DevicePtr, i: usize, v: f32) {
    match ty {
        MatrixType::F32 => *(base as *mut f32).add(i) = v,
        MatrixType::Bf16 => *(base as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
        MatrixType::F16 => *(base as *mut u16).add(i) = half::f16::from_f32(v).to_bits(),
    }
}

/// Element `(r, c)` of `op(X)` for a matrix stored as `layout` at `base`.
///
/// # Safety
/// The layout must describe memory at `base`.
unsafe fn op_element(
    layout: &MatrixLayout,
    base: DevicePtr,
    trans: bool,
    r: usize,
    c: usize,
) -> f32 {
    let (sr, sc) = if trans { (c, r) } else { (r, c) };
    load(layout.ty, base, sr + sc * layout.ld as usize)
}

impl EmulatedGpu {
    /// A launch, untimed (the caller's contract as [`Gpu::launch`]'s).
    unsafe fn launch_untimed(
        &self,
        kernel: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let dims = ((grid.max(1), 1, 1), (block, 1, 1));
        if shared_bytes > self.max_shared_bytes() {
            return Err(too_much_shared(
                kernel,
                shared_bytes,
                self.max_shared_bytes(),
            ));
        }
        let fail = self
            .failing_launches
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if fail.is_ok() {
            return Err(Error::OutOfMemory {
                message: format!(
                    "launching {kernel}: the GPU is out of memory (CUDA_ERROR_OUT_OF_MEMORY, \
                     simulated)"
                ),
            });
        }
        if self.kernels.has_kernel(kernel) {
            return self
                .kernels
                .launch(kernel, dims.0, dims.1, shared_bytes, params);
        }
        match self.custom.get(kernel) {
            Some(emu) => emu.launch(kernel, dims.0, dims.1, shared_bytes, params),
            // trainkit's library names the kernel in its error.
            None => self
                .kernels
                .launch(kernel, dims.0, dims.1, shared_bytes, params),
        }
    }

    /// A product, untimed (the caller's contract as [`Gpu::gemm`]'s).
    unsafe fn gemm_untimed(&self, g: &Gemm) -> Result<GemmRun> {
        if self.refuse_products
            || ((g.gelu_aux != 0 || g.dgelu_aux != 0) && self.refuse_gelu_epilogue)
            || (g.bias_grad != 0 && self.refuse_bias_grad_epilogue)
        {
            return Ok(GemmRun::NoAlgorithm);
        }
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let ldd = g.d_layout.ld as usize;
        let bias_ty = g.d_layout.ty;
        let g = *g;
        (0..n).into_par_iter().for_each(|j| {
            for i in 0..m {
                let mut acc = 0f32;
                for l in 0..k {
                    // SAFETY (whole block): the layouts describe the memory (the caller's
                    // contract), and every index is inside them.
                    unsafe {
                        let a = op_element(&g.a_layout, g.a, g.trans_a, i, l);
                        let b = op_element(&g.b_layout, g.b, g.trans_b, l, j);
                        acc = a.mul_add(b, acc);
                    }
                }
                unsafe {
                    let at = i + j * ldd;
                    let mut v = g.alpha * acc;
                    if g.beta != 0.0 {
                        v += g.beta * load(g.d_layout.ty, g.c_ptr(), at);
                    }
                    if g.bias != 0 {
                        v += load(bias_ty, g.bias, i);
                    }
                    if g.gelu_aux != 0 {
                        store(g.d_layout.ty, g.gelu_aux, at, v);
                        v = gelu_tanh(v);
                    }
                    if g.dgelu_aux != 0 {
                        v *= gelu_tanh_grad(load(g.d_layout.ty, g.dgelu_aux, at));
                    }
                    store(g.d_layout.ty, g.d, at, v);
                }
            }
        });
        if g.bias_grad != 0 {
            // BGRADA: Σ_l op(A)[i, l] for each row i of D; BGRADB: Σ_l op(B)[l, j] for each
            // column j. Summed in f32, written in D's type.
            let len = if g.bias_grad_of_b { n } else { m };
            for idx in 0..len {
                let mut acc = 0f32;
                for l in 0..k {
                    // SAFETY: as above.
                    acc += unsafe {
                        if g.bias_grad_of_b {
                            op_element(&g.b_layout, g.b, g.trans_b, l, idx)
                        } else {
                            op_element(&g.a_layout, g.a, g.trans_a, idx, l)
                        }
                    };
                }
                // SAFETY: the bias gradient holds one element per row (or column) of D.
                unsafe { store(g.d_layout.ty, g.bias_grad, idx, acc) };
            }
        }
        Ok(GemmRun::Done)
    }
}

impl Gpu for EmulatedGpu {
    unsafe fn launch(
        &self,
        kernel: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.timer.time(
            || kernel.to_string(),
            // SAFETY: the caller's contract.
            || unsafe { self.launch_untimed(kernel, grid, block, shared_bytes, params) },
        )
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<GemmRun> {
        // SAFETY: the caller's contract.
        self.timer
            .time(|| gemm_name(g), || unsafe { self.gemm_untimed(g) })
    }

    fn time_kernels(&self, on: bool) {
        self.timer.set(on);
    }

    fn kernel_times(&self) -> Result<Vec<super::KernelTime>> {
        Ok(self.timer.take())
    }

    fn describe(&self) -> String {
        "the CUDA emulator (trainkit's kernels on the CPU)".to_string()
    }

    fn max_blocks(&self) -> u32 {
        // Few blocks: grid-stride loops then take several trips, which is exercised too.
        4
    }

    fn compute_capability(&self) -> (i32, i32) {
        (9, 0)
    }

    fn max_shared_bytes(&self) -> u32 {
        HOPPER_SHARED_BYTES
    }

    fn gemm_workspace_bytes(&self) -> usize {
        0
    }

    fn alloc(&self, bytes: usize) -> std::result::Result<DevicePtr, AllocError> {
        let mut pool = self.pool();
        if let Some(cap) = self.capacity {
            if pool.used + bytes as u64 > cap {
                return Err(AllocError::OutOfMemory);
            }
        }
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| AllocError::Other(e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(AllocError::OutOfMemory);
        }
        // SAFETY: `ptr` addresses `layout.size()` bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, POISON, layout.size()) };
        pool.live.insert(ptr as DevicePtr, layout.size());
        pool.used += layout.size() as u64;
        pool.peak = pool.peak.max(pool.used);
        Ok(ptr as DevicePtr)
    }

    fn free(&self, ptr: DevicePtr) {
        let mut pool = self.pool();
        let Some(bytes) = pool.live.remove(&ptr) else {
            log::error!("the CUDA emulator was asked to free {ptr:#x}, which it never allocated");
            return;
        };
        pool.used -= bytes as u64;
        // SAFETY: allocated in `alloc` with this layout, freed once (removed from `live`).
        unsafe {
            std::alloc::dealloc(
                ptr as *mut u8,
                Layout::from_size_align_unchecked(bytes, ALIGN),
            )
        };
    }

    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.stage(src.len());
        // SAFETY: the caller's buffer at `dst` holds at least `src.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.waited();
        // SAFETY: the buffer at `src` holds at least `dst.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn zero(&self, dst: DevicePtr, bytes: usize) -> Result<()> {
        // SAFETY: the buffer at `dst` holds at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        // SAFETY: both buffers hold at least `bytes` bytes; `std::ptr::copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostPtr> {
        self.offload.alloc(bytes)
    }

    fn free_host(&self, ptr: HostPtr) {
        self.offload.free(ptr)
    }

    fn offload(&self, dst: HostPtr, src: DevicePtr, bytes: usize) -> Result<()> {
        // SAFETY: the caller's buffers hold at least `bytes` bytes each.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn fetch(&self, dst: DevicePtr, src: HostPtr, bytes: usize) -> Result<Option<Ticket>> {
        Ok(Some(self.offload.fetch(dst, src, bytes)))
    }

    fn wait_fetched(&self, ticket: Ticket) -> Result<()> {
        self.offload.wait(ticket);
        Ok(())
    }

    fn free_after_copy(&self, ptr: DevicePtr) {
        self.free(ptr)
    }

    fn read_host(&self, dst: &mut [u8], src: HostPtr) -> Result<()> {
        self.waited();
        // SAFETY: the buffer at `src` holds at least `dst.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn register_host(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.offload.register(ptr, bytes)
    }

    fn host_registered(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.offload.registered(ptr, bytes)
    }

    fn settle_host(&self, ptr: HostPtr) -> Result<()> {
        self.offload.settle(ptr);
        Ok(())
    }

    fn unregister_host(&self, ptr: HostPtr) {
        self.offload.unregister(ptr)
    }

    fn download_queued(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<Option<Ticket>> {
        Ok(Some(self.offload.download(dst, src, bytes)))
    }

    fn load_file(&self, file: &str, source: &str, kernels: &[&str]) -> Result<()> {
        self.custom.get_or_load(file, source, kernels, || {
            let full = super::kernels::with_common(file, source);
            let emu = Arc::new(KernelEmulator::build_file(file, full, kernels)?);
            self.module_loads.fetch_add(1, Ordering::Relaxed);
            Ok((Arc::clone(&emu), vec![emu; kernels.len()]))
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.waited();
        self.offload.flush();
        Ok(())
    }

    fn comm_stream(&self) -> Result<usize> {
        Ok(0)
    }

    fn compute_waits_for_comm(&self) -> Result<()> {
        Ok(())
    }

    fn comm_idle(&self) -> Result<bool> {
        Ok(true)
    }

    fn host_waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    fn module_loads(&self) -> u64 {
        self.module_loads.load(Ordering::Relaxed)
    }

    fn upload_stats(&self) -> UploadStats {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        UploadStats {
            uploads: self.uploads.load(Ordering::Relaxed),
            ring_bytes: ring.0.capacity() as u64,
        }
    }

    fn memory(&self) -> Option<GpuMemory> {
        let pool = self.pool();
        let total = self.capacity.unwrap_or(0);
        Some(GpuMemory {
            pool_reserved: pool.used,
            pool_used: pool.used,
            pool_reserved_peak: pool.peak,
            free: total.saturating_sub(pool.used),
            total,
        })
    }

    fn reset_peak(&self) {
        let mut pool = self.pool();
        pool.peak = pool.used;
    }
}

/// GELU's tanh approximation, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, in f64 (the
/// epilogue's reference).
/// The derivative of [`gelu_tanh`] (what cuBLASLt's `DGELU` epilogue multiplies by).
fn gelu_tanh_grad(x: f32) -> f32 {
    let x = x as f64;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let t = (k * (x + 0.044715 * x * x * x)).tanh();
    (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)) as f32
}

fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    (0.5 * x * (1.0 + u.tanh())) as f32
}
