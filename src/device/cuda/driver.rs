//! The real GPU under the CUDA backend, through cudarc's driver, NVRTC and cuBLASLt
//! bindings.
//!
//! One context and one stream per backend, and a second stream for copies to and from
//! host memory (offloaded activations, [`super::pinned`]). Memory comes from the device's
//! default stream-ordered pool (`cuMemAllocFromPoolAsync`) with its release threshold at
//! [`release_threshold`]: freed memory stays in the pool and is reused instead of going
//! back to the driver at every synchronization, except the last slice of the device,
//! which is given back so that what the driver allocates outside the pool (kernels loaded
//! lazily, cuBLASLt's kernels for a new shape, local memory of spilling kernels) finds
//! room. An allocation that fails trims the pool and is tried once more; every
//! `CUDA_ERROR_OUT_OF_MEMORY` (allocation, launch, product, module load) is
//! [`Error::OutOfMemory`].
//!
//! Kernels are compiled by NVRTC for the device's own architecture, through the on-disk
//! cache ([`super::cache`]), and their machine code (CUBIN) is loaded as is; the PTX is
//! the fallback, assembled by the driver, with its log in any error. Every kernel of
//! every file is resolved once at start-up. Products go through cuBLASLt, with the
//! algorithm chosen by its heuristic once per shape and kept; a product it has no
//! algorithm for is reported as such ([`GemmRun::NoAlgorithm`]) and runs as a plain
//! kernel. NVRTC and cuBLASLt are opened by trainkit itself, by their versioned names
//! ([`super::libraries`]).

use super::cublaslt::{CublasLt, Status};
use super::driver_error::{driver_error, is_oom};
use super::gpu::{
    too_much_shared, AllocError, DevicePtr, Gemm, GemmRun, Gpu, GpuMemory, HostPtr, LoadedFiles,
    MatrixLayout, MatrixType, Ticket, UploadStats,
};
use super::kernels::{find_include_dir, kernel_files, with_common, CompileOptions, Compiled};
use super::libraries;
use super::nvrtc::Nvrtc;
use super::pinned::Pinned;
use super::probe::{probe_device, CudaInfo};
use super::product_tuning::{
    choice_name, AlgoBytes, ChoiceDevice, GemmKey, ProductChoice, SavedChoices, Trials, Tuner,
    TIMED_RUNS,
};
use super::staging::{Staged, Staging};
use super::timing::{gemm_name, EventTimer};
use super::KernelCache;
use crate::error::{Error, Result};
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaStream};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// cuBLASLt's workspace: 32 MiB on Hopper and newer, 4 MiB before (NVIDIA's advice).
pub(crate) fn gemm_workspace_bytes(major: i32) -> usize {
    if major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// A cuBLASLt failure as trainkit's error: [`Error::OutOfMemory`] when it could not get
/// memory (`CUBLAS_STATUS_ALLOC_FAILED`).
fn blas_error(what: &str, e: Status) -> Error {
    if e.is_out_of_memory() {
        return Error::OutOfMemory {
            message: format!("cuBLASLt {what}: the GPU is out of memory ({e})"),
        };
    }
    Error::Backend {
        backend: "cuda",
        message: format!("cuBLASLt {what}: {e}"),
    }
}

/// The pool's release threshold on a device of `total` bytes: all of it but the larger
/// of 1 GiB and 1/32 of the device. Across a synchronization the pool keeps at most this
/// much of the memory it holds unused; the rest goes back to the driver, for what the
/// driver allocates outside the pool.
pub(crate) fn release_threshold(total: u64) -> u64 {
    total.saturating_sub((1u64 << 30).max(total / 32))
}

/// Kernel file `file`, whose complete source is `source`, compiled for `options` on the
/// device `info` describes: through the on-disk cache where there is one, else by NVRTC.
fn compile(
    cache: Option<&KernelCache>,
    file: &str,
    source: &str,
    options: &CompileOptions,
    info: &CudaInfo,
) -> Result<Compiled> {
    match cache {
        Some(cache) => cache.compiled(file, source, options, info.driver_version),
        None => super::compile(source, options),
    }
}

/// Loads a compiled kernel file: its machine code, or, where there is none or the driver
/// refuses it, its PTX, assembled by the driver, with the driver's log in any error.
fn load_module(compiled: &Compiled, file: &str) -> Result<drv_sys::CUmodule> {
    if let Some(cubin) = &compiled.cubin {
        // SAFETY: the image is a complete CUBIN that outlives the call; the context is
        // current.
        match unsafe { drv::module::load_data(cubin.as_ptr() as *const c_void) } {
            Ok(module) => return Ok(module),
            Err(e) if is_oom(e) => {
                return Err(driver_error(
                    &format!("loading the machine code of {file}"),
                    e,
                ))
            }
            Err(e) => log::warn!(
                "the driver refused the machine code of {file} ({e}); assembling its PTX"
            ),
        }
    }
    load_ptx(&compiled.ptx, file)
}

/// Loads PTX through `cuModuleLoadDataEx`, with the driver's error log in the message.
fn load_ptx(ptx: &str, file: &str) -> Result<drv_sys::CUmodule> {
    let image = CString::new(ptx).map_err(|_| Error::Backend {
        backend: "cuda",
        message: format!("the PTX of {file} contains a NUL byte"),
    })?;
    let mut log = vec![0u8; 16 << 10];
    let mut options = [
        drv_sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        drv_sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    let mut module: drv_sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the image is NUL-terminated PTX; the log buffer holds the size given; the
    // context is current.
    let status = unsafe {
        drv_sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr() as *const c_void,
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    match status.result() {
        Ok(()) => Ok(module),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let what = if text.trim().is_empty() {
                format!("loading the PTX of {file}")
            } else {
                format!("loading the PTX of {file} ({})", text.trim())
            };
            Err(driver_error(&what, e))
        }
    }
}

/// The shared memory every block may have without the kernel opting in (48 KiB).
const DEFAULT_SHARED_BYTES: u32 = 48 << 10;

/// Events that order one stream after another: no timing (cheaper to record).
const NO_TIMING: drv_sys::CUevent_flags = drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;

/// A GPU driven through cudarc.
pub(crate) struct DriverGpu {
    /// Page-locked slots that small uploads are copied through. The first field, so it is
    /// dropped first, after `drop` has synchronized the stream and while the context lives.
    staging: Mutex<Staging>,
    /// Page-locked buffers of offloaded tensors; dropped, like `staging`, after `drop` has
    /// synchronized both streams.
    pinned: Mutex<Pinned>,
    info: CudaInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Copies to and from host memory, beside the compute stream.
    copy: Arc<CudaStream>,
    /// Collectives across ranks (NCCL), beside the compute stream: each waits for the
    /// compute work queued before it, and compute waits for them only where it reads
    /// their results.
    comm: Arc<CudaStream>,
    pool: drv_sys::CUmemoryPool,
    modules: Vec<drv_sys::CUmodule>,
    functions: HashMap<&'static str, drv_sys::CUfunction>,
    /// NVRTC's options for this device (kernels written outside trainkit compile later).
    options: CompileOptions,
    /// Kernel files written outside trainkit, loaded on first use: modules and functions.
    custom: LoadedFiles<drv_sys::CUmodule, drv_sys::CUfunction>,
    blas: &'static CublasLt,
    lt: lt_sys::cublasLtHandle_t,
    /// The algorithm of each product run so far, or `None` where the heuristic has none.
    algos: Mutex<HashMap<GemmKey, Option<lt_sys::cublasLtMatmulAlgo_t>>>,
    /// How each new product's algorithm is chosen ([`super::product_tuning`]).
    tuner: Tuner,
    max_blocks: u32,
    /// The most shared memory a block may opt into ([`Gpu::max_shared_bytes`]).
    max_shared: u32,
    /// The dynamic shared memory each kernel has been allowed so far, where it asked for
    /// more than the 48 KiB a block gets without opting in (keyed by the function).
    shared_allowed: Mutex<HashMap<usize, u32>>,
    /// Downloads and synchronizations so far.
    waits: AtomicU64,
    /// Modules loaded so far (kernel files, trainkit's and others').
    module_loads: AtomicU64,
    /// Uploads so far.
    uploads: AtomicU64,
    /// The files NVRTC, cuBLASLt and the driver were loaded from, for [`Gpu::describe`].
    libraries: String,
    /// Events around launches and products while per-kernel timing is on.
    timer: EventTimer,
}

// SAFETY: the raw handles are used only through the driver, which is thread-safe once the
// context is bound; every method binds it first.
unsafe impl Send for DriverGpu {}
unsafe impl Sync for DriverGpu {}

impl std::fmt::Debug for DriverGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DriverGpu({})", self.info)
    }
}

impl DriverGpu {
    /// Waits for the stream, counting the wait.
    fn wait(&self) -> Result<()> {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| driver_error("waiting for the GPU", e))
    }

    /// Opens GPU `ordinal`: checks the libraries, creates the context, stream and pool,
    /// compiles (or loads from the cache) every kernel, and creates the cuBLASLt handle.
    /// With `tune_products`, each new product's algorithm is chosen by timing
    /// ([`super::product_tuning`]), the choices saved beside the kernel cache.
    pub(crate) fn new(ordinal: usize, tune_products: bool) -> Result<DriverGpu> {
        let info = probe_device(ordinal).map_err(|reason| Error::Backend {
            backend: "cuda",
            message: format!("cannot use cuda:{ordinal}: {reason}"),
        })?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("creating a context", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating a stream", e))?;
        let copy = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the copy stream", e))?;
        let comm = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the communication stream", e))?;
        // SAFETY: the context is current (CudaContext::new binds it); the pool handle comes
        // from the driver and the attribute value is a u64 as the attribute requires.
        let pool = unsafe {
            let pool = drv::device::get_default_mem_pool(ctx.cu_device())
                .map_err(|e| driver_error("finding the device's memory pool", e))?;
            let mut threshold = release_threshold(info.total_memory);
            drv::mem_pool::set_attribute(
                pool,
                drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut c_void,
            )
            .map_err(|e| driver_error("setting the pool's release threshold", e))?;
            pool
        };
        let staging = Staging::new()?;
        let pinned = Pinned::new()?;
        let backend = |message: String| Error::Backend {
            backend: "cuda",
            message,
        };
        let nvrtc = Nvrtc::get().map_err(backend)?;
        let blas = CublasLt::get().map_err(backend)?;
        let include = find_include_dir()?;
        let options =
            CompileOptions::for_device(info.compute_capability, nvrtc.supported_archs(), include);
        let cache = KernelCache::in_default_dir();
        let mut modules = Vec::new();
        let mut functions = HashMap::new();
        for file in kernel_files() {
            let source = file.full_source();
            let compiled = compile(cache.as_ref(), file.name, &source, &options, &info)?;
            let module = load_module(&compiled, file.name)?;
            modules.push(module);
            for &name in file.kernels {
                let cname = CString::new(name).expect("kernel names have no NUL");
                // SAFETY: the module was just loaded and is kept alive in `modules`.
                let f = unsafe { drv::module::get_function(module, cname) }
                    .map_err(|e| driver_error(&format!("finding kernel {name}"), e))?;
                functions.insert(name, f);
            }
        }
        let lt = blas
            .create_handle()
            .map_err(|e| blas_error("creating a handle", e))?;
        let (major, minor) = nvrtc.version();
        let libraries = format!(
            "NVRTC {major}.{minor} {}, cuBLASLt {} {}, driver {}",
            nvrtc.path().display(),
            blas.version(),
            blas.path().display(),
            libraries::driver_file()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "(file unknown)".to_string())
        );
        let module_loads = AtomicU64::new(modules.len() as u64);
        let sms = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("reading the multiprocessor count", e))?;
        let max_shared = ctx
            .attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| driver_error("reading the shared memory a block may have", e))?;
        let saved = SavedChoices::open(
            cache.as_ref().map(KernelCache::dir),
            &ChoiceDevice {
                name: info.name.clone(),
                compute_capability: info.compute_capability,
                cublaslt: blas.version(),
                workspace_bytes: gemm_workspace_bytes(info.compute_capability.0),
            },
        );
        Ok(DriverGpu {
            staging: Mutex::new(staging),
            pinned: Mutex::new(pinned),
            info,
            ctx,
            stream,
            copy,
            comm,
            pool,
            modules,
            functions,
            options,
            custom: LoadedFiles::new(),
            blas,
            lt,
            algos: Mutex::new(HashMap::new()),
            tuner: Tuner::new(tune_products, saved),
            max_blocks: (sms.max(1) as u32) * 8,
            max_shared: max_shared.max(0) as u32,
            shared_allowed: Mutex::new(HashMap::new()),
            waits: AtomicU64::new(0),
            module_loads,
            uploads: AtomicU64::new(0),
            libraries,
            timer: EventTimer::new(),
        })
    }

    fn pinned(&self) -> std::sync::MutexGuard<'_, Pinned> {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context", e))
    }

    fn pool_attribute(&self, attr: drv_sys::CUmemPool_attribute) -> u64 {
        let mut value = 0u64;
        // SAFETY: these pool attributes are u64 values; the pool lives as long as the device.
        let ok = unsafe {
            drv::mem_pool::get_attribute(self.pool, attr, &mut value as *mut u64 as *mut c_void)
        };
        if ok.is_err() {
            return 0;
        }
        value
    }
}

impl Drop for DriverGpu {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        let _ = self.stream.synchronize();
        let _ = self.copy.synchronize();
        let _ = self.comm.synchronize();
        self.timer.destroy();
        // SAFETY: the handle and modules were created here and are not used after this.
        unsafe {
            let _ = self.blas.destroy_handle(self.lt);
            for &m in &self.modules {
                let _ = drv::module::unload(m);
            }
            for m in self.custom.take_all() {
                let _ = drv::module::unload(m);
            }
        }
        let _ = self.stream.synchronize();
    }
}

fn data_type(t: MatrixType) -> lt_sys::cudaDataType {
    match t {
        MatrixType::F32 => lt_sys::cudaDataType::CUDA_R_32F,
        MatrixType::Bf16 => lt_sys::cudaDataType::CUDA_R_16BF,
        MatrixType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
    }
}

/// A cuBLASLt descriptor destroyed on drop.
struct Descriptors {
    lt: &'static CublasLt,
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created by cuBLASLt below and destroyed once.
        unsafe {
            let _ = self.lt.destroy_matmul_desc(self.desc);
            for l in self.layouts {
                if !l.is_null() {
                    let _ = self.lt.destroy_matrix_layout(l);
                }
            }
        }
    }
}

/// The cuBLASLt matmul descriptor and the three matrix layouts of `g`: compute type, the
/// operands' transposes, the epilogue (bias, GELU with its auxiliary output) and the
/// epilogue's pointers. Host calls only: no device or handle is needed.
fn descriptors(lt: &'static CublasLt, g: &Gemm) -> Result<Descriptors> {
    let compute = if g.allow_tf32 && g.a_layout.ty == MatrixType::F32 {
        lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let desc = lt
        .create_matmul_desc(compute, lt_sys::cudaDataType::CUDA_R_32F)
        .map_err(|e| blas_error("creating a matmul descriptor", e))?;
    let layout = |l: &MatrixLayout| {
        lt.create_matrix_layout(data_type(l.ty), l.rows, l.cols, l.ld)
            .map_err(|e| blas_error("creating a matrix layout", e))
    };
    let mut d = Descriptors {
        lt,
        desc,
        layouts: [std::ptr::null_mut(); 3],
    };
    d.layouts[0] = layout(&g.a_layout)?;
    d.layouts[1] = layout(&g.b_layout)?;
    d.layouts[2] = layout(&g.d_layout)?;
    // cublasOperation_t as a 32-bit integer: 0 = N, 1 = T.
    let op = |t: bool| t as i32;
    let set = |attr: lt_sys::cublasLtMatmulDescAttributes_t, ptr: *const c_void, size| {
        // SAFETY: each value below has the size and type its attribute documents.
        unsafe { lt.set_matmul_desc_attribute(desc, attr, ptr, size) }
            .map_err(|e| blas_error("setting a matmul attribute", e))
    };
    use lt_sys::cublasLtMatmulDescAttributes_t as A;
    let (ta, tb) = (op(g.trans_a), op(g.trans_b));
    set(
        A::CUBLASLT_MATMUL_DESC_TRANSA,
        &ta as *const _ as *const c_void,
        std::mem::size_of_val(&ta),
    )?;
    set(
        A::CUBLASLT_MATMUL_DESC_TRANSB,
        &tb as *const _ as *const c_void,
        std::mem::size_of_val(&tb),
    )?;
    use lt_sys::cublasLtEpilogue_t as E;
    let dgelu = g.dgelu_aux != 0;
    let epilogue = match (g.bias != 0, g.gelu_aux != 0, g.bias_grad != 0, dgelu) {
        (false, false, false, false) => None,
        (true, false, false, false) => Some(E::CUBLASLT_EPILOGUE_BIAS),
        (false, true, false, false) => Some(E::CUBLASLT_EPILOGUE_GELU_AUX),
        (true, true, false, false) => Some(E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS),
        (false, false, true, false) if g.bias_grad_of_b => Some(E::CUBLASLT_EPILOGUE_BGRADB),
        (false, false, true, false) => Some(E::CUBLASLT_EPILOGUE_BGRADA),
        (false, false, false, true) => Some(E::CUBLASLT_EPILOGUE_DGELU),
        _ => {
            return Err(Error::Backend {
                backend: "cuda",
                message: "a product asked for a bias gradient or GELU gradient together with \
                          another epilogue, which trainkit does not combine"
                    .into(),
            })
        }
    };
    if let Some(epilogue) = epilogue {
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epilogue as *const _ as *const c_void,
            std::mem::size_of_val(&epilogue),
        )?;
    }
    let aux = if dgelu { g.dgelu_aux } else { g.gelu_aux };
    if aux != 0 {
        // The pre-GELU values (written by GELU_AUX, read by DGELU), in D's type and layout
        // (ld a multiple of 8).
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &aux as *const u64 as *const c_void,
            std::mem::size_of::<u64>(),
        )?;
        let ld: i64 = g.d_layout.ld;
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
            &ld as *const i64 as *const c_void,
            std::mem::size_of::<i64>(),
        )?;
    }
    // The bias, or the bias gradient the epilogue writes: one vector, in D's type.
    let bias = if g.bias != 0 { g.bias } else { g.bias_grad };
    if bias != 0 {
        let bias_type = data_type(g.d_layout.ty);
        set(
            A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
            &bias_type as *const _ as *const c_void,
            std::mem::size_of_val(&bias_type),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &bias as *const u64 as *const c_void,
            std::mem::size_of::<u64>(),
        )?;
    }
    Ok(d)
}

/// A matmul preference allowing `workspace` bytes of scratch memory and matrices A, B, C
/// and D aligned to `align` bytes each (so the heuristic picks no algorithm that needs
/// more than the pointers have). Destroyed by the caller with `destroy_matmul_pref`.
fn preference(
    lt: &CublasLt,
    workspace: usize,
    align: [u32; 4],
) -> Result<lt_sys::cublasLtMatmulPreference_t> {
    use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
    let pref = lt
        .create_matmul_pref()
        .map_err(|e| blas_error("creating preferences", e))?;
    let bytes = workspace as u64;
    // SAFETY: the preference was just created; each value has its attribute's documented
    // type (u64 for the workspace, u32 for the alignments).
    let set = unsafe {
        lt.set_matmul_pref_attribute(
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &bytes as *const u64 as *const c_void,
            std::mem::size_of::<u64>(),
        )
        .and_then(|()| {
            let attrs = [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            attrs.iter().zip(&align).try_for_each(|(&attr, a)| {
                lt.set_matmul_pref_attribute(
                    pref,
                    attr,
                    a as *const u32 as *const c_void,
                    std::mem::size_of::<u32>(),
                )
            })
        })
    };
    if let Err(e) = set {
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt.destroy_matmul_pref(pref) };
        return Err(blas_error("setting the matmul preferences", e));
    }
    Ok(pref)
}

/// The device's side of choosing a product's algorithm: cuBLASLt's check of a saved one,
/// and the candidates' runs between events.
struct DriverTrials<'a> {
    gpu: &'a DriverGpu,
    g: &'a Gemm,
    d: &'a Descriptors,
    candidates: &'a [lt_sys::cublasLtMatmulAlgo_t],
    workspace: usize,
}

impl Trials for DriverTrials<'_> {
    fn fits(&self, algo: &AlgoBytes) -> bool {
        let algo = lt_sys::cublasLtMatmulAlgo_t { data: *algo };
        let d = self.d;
        // SAFETY: the handle and descriptors are live.
        unsafe {
            self.gpu.blas.algorithm_fits(
                self.gpu.lt,
                d.desc,
                d.layouts[0],
                d.layouts[1],
                d.layouts[2],
                d.layouts[2],
                &algo,
                self.workspace,
            )
        }
    }

    fn time(&self) -> Result<Vec<Option<f64>>> {
        self.gpu.time_candidates(self.g, self.d, self.candidates)
    }
}

impl DriverGpu {
    /// The algorithm of product `g` (descriptors `d`, `workspace` bytes of workspace):
    /// the one chosen the first time a product of its key ran, else chosen now (saved by
    /// an earlier process, timed, or the heuristic's first; [`super::product_tuning`]).
    /// `None` where the heuristic has none.
    fn algorithm(
        &self,
        g: &Gemm,
        d: &Descriptors,
        workspace: usize,
    ) -> Result<Option<lt_sys::cublasLtMatmulAlgo_t>> {
        let key = GemmKey::of(g);
        let mut algos = self.algos.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = algos.get(&key) {
            return Ok(*a);
        }
        let lt = self.blas;
        let pref = preference(lt, workspace, key.align)?;
        let count = self.tuner.candidates();
        // SAFETY: the handle, descriptors and preference are live; the preference is
        // destroyed once, after the query.
        let candidates = unsafe {
            let found = lt.algorithms(
                self.lt,
                d.desc,
                d.layouts[0],
                d.layouts[1],
                d.layouts[2],
                d.layouts[2],
                pref,
                count,
            );
            let _ = lt.destroy_matmul_pref(pref);
            found
        }
        .map_err(|e| {
            blas_error(
                &format!(
                    "finding an algorithm for {:?} × {:?} → {:?}",
                    g.a_layout, g.b_layout, g.d_layout
                ),
                e,
            )
        })?;
        if candidates.is_empty() {
            algos.insert(key, None);
            return Ok(None);
        }
        let bytes: Vec<AlgoBytes> = candidates.iter().map(|c| c.data).collect();
        let trials = DriverTrials {
            gpu: self,
            g,
            d,
            candidates: &candidates,
            workspace,
        };
        let chosen = self.tuner.choose(choice_name(g), &key, &bytes, &trials);
        let algo = lt_sys::cublasLtMatmulAlgo_t { data: chosen };
        algos.insert(key, Some(algo));
        Ok(Some(algo))
    }

    /// Queues product `g` (descriptors `d`) with `algo` on the compute stream, writing D
    /// at `out` (and reading C there too, unless `g` names another C).
    ///
    /// # Safety
    /// `g`'s pointers address its layouts, and `out` memory of D's layout.
    unsafe fn matmul(
        &self,
        g: &Gemm,
        d: &Descriptors,
        algo: &lt_sys::cublasLtMatmulAlgo_t,
        out: DevicePtr,
    ) -> std::result::Result<(), Status> {
        // C is D's own buffer (here `out`) unless the product reads another.
        let c = if g.c != 0 { g.c } else { out };
        // SAFETY: the caller's contract.
        unsafe {
            self.blas.matmul(
                self.lt,
                d.desc,
                &g.alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                d.layouts[0],
                g.b as *const c_void,
                d.layouts[1],
                &g.beta as *const f32 as *const c_void,
                c as *const c_void,
                out as *mut c_void,
                d.layouts[2],
                algo,
                g.workspace as *mut c_void,
                g.workspace_bytes,
                self.stream.cu_stream() as lt_sys::cudaStream_t,
            )
        }
    }

    /// Each candidate's time per run of product `g` in milliseconds, in order (`None`
    /// where it failed to run): a run to warm it up, then [`TIMED_RUNS`] between two
    /// events. A product that accumulates into D runs on a zeroed scratch output, so that
    /// its own is added to once, by the run that follows; the other outputs (D beside a C
    /// of its own among them) are written, not added to, and that run overwrites them.
    fn time_candidates(
        &self,
        g: &Gemm,
        d: &Descriptors,
        candidates: &[lt_sys::cublasLtMatmulAlgo_t],
    ) -> Result<Vec<Option<f64>>> {
        let scratch = if g.beta != 0.0 && g.c == 0 {
            let bytes = g.d_layout.bytes();
            let p = self.alloc(bytes).map_err(|e| Error::Backend {
                backend: "cuda",
                message: match e {
                    AllocError::OutOfMemory => {
                        format!("no room for a scratch output of {bytes} bytes")
                    }
                    AllocError::Other(m) => format!("a scratch output of {bytes} bytes: {m}"),
                },
            })?;
            if let Err(e) = self.zero(p, bytes) {
                self.free(p);
                return Err(e);
            }
            Some(p)
        } else {
            None
        };
        let times = self.time_on(g, d, candidates, scratch.unwrap_or(g.d));
        if let Some(p) = scratch {
            self.free(p);
        }
        times
    }

    /// [`DriverGpu::time_candidates`] writing the product to `out`.
    fn time_on(
        &self,
        g: &Gemm,
        d: &Descriptors,
        candidates: &[lt_sys::cublasLtMatmulAlgo_t],
        out: DevicePtr,
    ) -> Result<Vec<Option<f64>>> {
        let stream = self.stream.cu_stream();
        let event_error = |e| driver_error("timing the candidates of a product", e);
        let flags = drv_sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = drv::event::create(flags).map_err(event_error)?;
        let end = match drv::event::create(flags) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: created above, used by nothing else.
                let _ = unsafe { drv::event::destroy(start) };
                return Err(event_error(e));
            }
        };
        // SAFETY: the caller's contract for `g`; `out` has D's layout.
        let run =
            |algo: &lt_sys::cublasLtMatmulAlgo_t| unsafe { self.matmul(g, d, algo, out) }.is_ok();
        let mut times = Vec::with_capacity(candidates.len());
        let mut failure = None;
        for algo in candidates {
            if !run(algo) {
                times.push(None);
                continue;
            }
            // SAFETY: both events belong to this context and are recorded on its stream.
            let timed = unsafe {
                drv::event::record(start, stream).and_then(|()| {
                    let ran = (0..TIMED_RUNS).all(|_| run(algo));
                    drv::event::record(end, stream)?;
                    drv::event::synchronize(end)?;
                    Ok(ran.then(|| drv::event::elapsed(start, end)))
                })
            };
            match timed {
                Ok(Some(Ok(ms))) => times.push(Some(ms as f64 / TIMED_RUNS as f64)),
                Ok(Some(Err(e))) | Err(e) => {
                    failure = Some(event_error(e));
                    break;
                }
                Ok(None) => times.push(None),
            }
        }
        // SAFETY: created above; the stream has passed both (synchronized) or they were
        // never recorded after the last synchronization.
        unsafe {
            let _ = drv::event::destroy(start);
            let _ = drv::event::destroy(end);
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(times),
        }
    }

    /// Gives the pool's unused memory back to the driver, after waiting for both streams
    /// (so that every free queued so far has happened): done once before an allocation,
    /// launch or product that ran out of memory is tried again.
    fn trim(&self) {
        let _ = self.synchronize();
        // SAFETY: the pool belongs to this device; trimming only releases unused memory.
        if let Err(e) = unsafe { drv_sys::cuMemPoolTrimTo(self.pool, 0) }.result() {
            log::warn!("trimming the GPU memory pool failed: {e}");
        }
    }

    /// Lets kernel `f` (named `kernel`) launch with `bytes` of dynamic shared memory, more
    /// than a block gets without opting in: the driver's attribute is raised once per
    /// kernel and size, and a size past the device's limit is an error naming it.
    fn allow_shared(&self, kernel: &str, f: drv_sys::CUfunction, bytes: u32) -> Result<()> {
        let mut allowed = self
            .shared_allowed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if allowed.get(&(f as usize)).is_some_and(|&b| b >= bytes) {
            return Ok(());
        }
        if bytes > self.max_shared {
            return Err(too_much_shared(kernel, bytes, self.max_shared));
        }
        let attribute =
            drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: `f` is a function of a module this context loaded and keeps.
        unsafe { drv::function::set_function_attribute(f, attribute, bytes as i32) }.map_err(
            |e| {
                driver_error(
                    &format!("letting {kernel} have {bytes} bytes of shared memory"),
                    e,
                )
            },
        )?;
        allowed.insert(f as usize, bytes);
        Ok(())
    }

    /// `f`, and once more after [`DriverGpu::trim`] when it ran out of memory.
    fn retry_trimmed<T>(&self, mut f: impl FnMut() -> Result<T>) -> Result<T> {
        match f() {
            Err(Error::OutOfMemory { .. }) => {
                self.trim();
                f()
            }
            other => other,
        }
    }
}

impl Gpu for DriverGpu {
    fn describe(&self) -> String {
        format!(
            "{} ({}; {})",
            self.info.name, self.options.arch, self.libraries
        )
    }

    fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    fn compute_capability(&self) -> (i32, i32) {
        self.info.compute_capability
    }

    fn max_shared_bytes(&self) -> u32 {
        self.max_shared
    }

    fn gemm_workspace_bytes(&self) -> usize {
        gemm_workspace_bytes(self.info.compute_capability.0)
    }

    fn alloc(&self, bytes: usize) -> std::result::Result<DevicePtr, AllocError> {
        self.bind().map_err(|e| AllocError::Other(e.to_string()))?;
        // SAFETY: the pool and stream belong to this context.
        let alloc =
            || unsafe { drv::mem_pool::alloc_async(self.pool, bytes, self.stream.cu_stream()) };
        let first = match alloc() {
            Err(e) if is_oom(e) => {
                // Freed memory may wait on a stream, or lie in pieces too small: trim the
                // pool and try once more.
                self.trim();
                alloc()
            }
            other => other,
        };
        match first {
            Ok(ptr) => Ok(ptr),
            Err(e) if is_oom(e) => Err(AllocError::OutOfMemory),
            Err(e) => Err(AllocError::Other(e.to_string())),
        }
    }

    fn free(&self, ptr: DevicePtr) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from `alloc` on this stream and is freed once.
        if let Err(e) = unsafe { drv::free_async(ptr, self.stream.cu_stream()) } {
            log::error!("freeing GPU memory at {ptr:#x} failed: {e}");
        }
    }

    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.bind()?;
        self.uploads.fetch_add(1, Ordering::Relaxed);
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the caller's buffer at `dst` holds at least `src.len()` bytes; the
        // context is bound.
        match unsafe { staging.upload(dst, src, self.stream.cu_stream()) }? {
            Staged::Queued => Ok(()),
            Staged::Waited => {
                self.waits.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // Larger than the ring takes (weights, once): from pageable memory, which
            // the driver stages before returning, so `src` may be reused at once; the
            // driver may wait for the stream first, so it counts as a wait.
            Staged::TooLarge => {
                self.waits.fetch_add(1, Ordering::Relaxed);
                // SAFETY: as above.
                unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                    .map_err(|e| driver_error("copying to the GPU", e))
            }
        }
    }

    fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.bind()?;
        // SAFETY: the buffer at `src` holds at least `dst.len()` bytes; the stream is
        // synchronized before `dst` is read.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying from the GPU", e))?;
        self.wait()
    }

    fn zero(&self, dst: DevicePtr, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the buffer at `dst` holds at least `bytes` bytes.
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_error("zeroing GPU memory", e))
    }

    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: both buffers hold at least `bytes` bytes.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying on the GPU", e))
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostPtr> {
        self.bind()?;
        self.pinned().alloc(bytes)
    }

    fn free_host(&self, ptr: HostPtr) {
        self.pinned().release(ptr)
    }

    fn offload(&self, dst: HostPtr, src: DevicePtr, bytes: usize) -> Result<()> {
        self.bind()?;
        let (compute, copy) = (self.stream.cu_stream(), self.copy.cu_stream());
        // SAFETY: the caller's buffers hold `bytes` each; both streams are this context's.
        unsafe { self.pinned().offload(dst, src, bytes, compute, copy) }
    }

    fn fetch(&self, dst: DevicePtr, src: HostPtr, bytes: usize) -> Result<Option<Ticket>> {
        self.bind()?;
        let (compute, copy) = (self.stream.cu_stream(), self.copy.cu_stream());
        // SAFETY: as in `offload`.
        unsafe { self.pinned().fetch(dst, src, bytes, compute, copy) }.map(Some)
    }

    fn wait_fetched(&self, ticket: Ticket) -> Result<()> {
        self.bind()?;
        // SAFETY: the compute stream is this context's.
        unsafe { self.pinned().wait(ticket, self.stream.cu_stream()) }
    }

    fn free_after_copy(&self, ptr: DevicePtr) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from `alloc` and is freed once, after the copy that reads it.
        if let Err(e) = unsafe { drv::free_async(ptr, self.copy.cu_stream()) } {
            log::error!("freeing GPU memory at {ptr:#x} failed: {e}");
        }
    }

    fn read_host(&self, dst: &mut [u8], src: HostPtr) -> Result<()> {
        self.bind()?;
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.pinned().settle(src)?;
        // SAFETY: the page-locked buffer at `src` holds at least `dst.len()` bytes and no
        // copy writes it any more.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn register_host(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.bind().is_ok() && self.pinned().register(ptr, bytes)
    }

    fn host_registered(&self, ptr: HostPtr, bytes: usize) -> bool {
        self.pinned().registered(ptr, bytes)
    }

    fn settle_host(&self, ptr: HostPtr) -> Result<()> {
        self.bind()?;
        // Waited for outside the lock, so the trainer's thread queues copies meanwhile.
        let Some(event) = self.pinned().last_copy(ptr) else {
            return Ok(());
        };
        // SAFETY: the event lives until `ptr` is unregistered, which its owner does not do
        // while it waits here.
        unsafe { drv::event::synchronize(event) }
            .map_err(|e| driver_error("waiting for a copy to host memory", e))
    }

    fn unregister_host(&self, ptr: HostPtr) {
        if self.bind().is_ok() {
            self.pinned().unregister(ptr);
        }
    }

    fn download_queued(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<Option<Ticket>> {
        self.bind()?;
        let (compute, copy) = (self.stream.cu_stream(), self.copy.cu_stream());
        // SAFETY: the caller's buffers hold `bytes` each, `dst` registered; both streams
        // are this context's.
        unsafe { self.pinned().download(dst, src, bytes, compute, copy) }.map(Some)
    }

    unsafe fn launch(
        &self,
        kernel: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.bind()?;
        let f = match self.functions.get(kernel) {
            Some(&f) => f,
            None => self.custom.get(kernel).ok_or_else(|| Error::Backend {
                backend: "cuda",
                message: format!("no kernel named {kernel}"),
            })?,
        };
        if shared_bytes > DEFAULT_SHARED_BYTES {
            self.allow_shared(kernel, f, shared_bytes)?;
        }
        let timed = self.timer.start(self.stream.cu_stream())?;
        // A launch that fails queues nothing, so it may be tried again.
        self.retry_trimmed(|| {
            // SAFETY: the caller's contract.
            unsafe {
                drv::launch_kernel(
                    f,
                    (grid.max(1), 1, 1),
                    (block, 1, 1),
                    shared_bytes,
                    self.stream.cu_stream(),
                    params,
                )
            }
            .map_err(|e| driver_error(&format!("launching {kernel}"), e))
        })?;
        self.timer
            .stop(timed, || kernel.to_string(), self.stream.cu_stream())
    }

    fn load_file(&self, file: &str, source: &str, kernels: &[&str]) -> Result<()> {
        self.custom.get_or_load(file, source, kernels, || {
            self.bind()?;
            let full = with_common(file, source);
            let cache = KernelCache::in_default_dir();
            let compiled = compile(cache.as_ref(), file, &full, &self.options, &self.info)?;
            let module = self.retry_trimmed(|| load_module(&compiled, file))?;
            self.module_loads.fetch_add(1, Ordering::Relaxed);
            let mut functions = Vec::with_capacity(kernels.len());
            for &name in kernels {
                let found = CString::new(name)
                    .map_err(|_| Error::Backend {
                        backend: "cuda",
                        message: format!("the kernel name `{name}` contains a NUL byte"),
                    })
                    .and_then(|cname| {
                        // SAFETY: the module was just loaded and is kept with the file.
                        unsafe { drv::module::get_function(module, cname) }.map_err(|e| {
                            driver_error(
                                &format!("finding kernel {name} in {file} (is it `extern \"C\"`?)"),
                                e,
                            )
                        })
                    });
                match found {
                    Ok(f) => functions.push(f),
                    Err(e) => {
                        // SAFETY: loaded above, used by nothing else.
                        let _ = unsafe { drv::module::unload(module) };
                        return Err(e);
                    }
                }
            }
            Ok((module, functions))
        })
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<GemmRun> {
        self.bind()?;
        let d = descriptors(self.blas, g)?;
        let Some(algo) = self.algorithm(g, &d, g.workspace_bytes)? else {
            return Ok(GemmRun::NoAlgorithm);
        };
        let timed = self.timer.start(self.stream.cu_stream())?;
        self.retry_trimmed(|| {
            // SAFETY: the caller's contract: every pointer addresses its layout.
            unsafe { self.matmul(g, &d, &algo, g.d) }.map_err(|e| blas_error("running a matmul", e))
        })?;
        self.timer
            .stop(timed, || gemm_name(g), self.stream.cu_stream())?;
        Ok(GemmRun::Done)
    }

    fn synchronize(&self) -> Result<()> {
        self.wait()?;
        self.comm
            .synchronize()
            .map_err(|e| driver_error("waiting for the communication stream", e))?;
        self.copy
            .synchronize()
            .map_err(|e| driver_error("waiting for the copy stream", e))
    }

    fn comm_stream(&self) -> Result<usize> {
        self.bind()?;
        self.stream
            .record_event(Some(NO_TIMING))
            .and_then(|done| self.comm.wait(&done))
            .map_err(|e| driver_error("ordering the communication stream after compute", e))?;
        Ok(self.comm.cu_stream() as usize)
    }

    fn compute_waits_for_comm(&self) -> Result<()> {
        self.bind()?;
        self.comm
            .record_event(Some(NO_TIMING))
            .and_then(|done| self.stream.wait(&done))
            .map_err(|e| driver_error("ordering compute after the communication stream", e))
    }

    fn comm_idle(&self) -> Result<bool> {
        self.bind()?;
        // SAFETY: the stream belongs to this context, bound above.
        match unsafe { drv_sys::cuStreamQuery(self.comm.cu_stream()) } {
            drv_sys::CUresult::CUDA_SUCCESS => Ok(true),
            drv_sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_error(
                "asking whether the communication stream is done",
                cudarc::driver::DriverError(e),
            )),
        }
    }

    fn host_waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    fn module_loads(&self) -> u64 {
        self.module_loads.load(Ordering::Relaxed)
    }

    fn time_kernels(&self, on: bool) {
        self.timer.set(on);
    }

    fn kernel_times(&self) -> Result<Vec<super::KernelTime>> {
        self.bind()?;
        self.timer.take()
    }

    fn product_choices(&self) -> Vec<ProductChoice> {
        self.tuner.choices()
    }

    fn upload_stats(&self) -> UploadStats {
        let staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        UploadStats {
            uploads: self.uploads.load(Ordering::Relaxed),
            ring_bytes: staging.capacity() as u64,
        }
    }

    fn memory(&self) -> Option<GpuMemory> {
        self.bind().ok()?;
        let (free, total) = self.ctx.mem_get_info().ok()?;
        use drv_sys::CUmemPool_attribute as P;
        Some(GpuMemory {
            pool_reserved: self.pool_attribute(P::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            pool_used: self.pool_attribute(P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            pool_reserved_peak: self.pool_attribute(P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
            free: free as u64,
            total: total as u64,
        })
    }

    fn reset_peak(&self) {
        if self.bind().is_err() {
            return;
        }
        let mut zero = 0u64;
        // SAFETY: the high-water attributes are reset by writing a u64 zero.
        unsafe {
            let _ = drv::mem_pool::set_attribute(
                self.pool,
                drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                &mut zero as *mut u64 as *mut c_void,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLASLt itself, where its library loads (a CUDA toolkit, or the `nvidia-cublas`
    /// wheel on `LD_LIBRARY_PATH`: no GPU needed), accepts every descriptor attribute the
    /// backend sets, with the size and value of each: the check that the emulator, which
    /// models the product and not the library's interface, cannot make. cuBLASLt refuses
    /// an attribute of the wrong size (`CUBLAS_STATUS_INVALID_VALUE`). Skipped, and said,
    /// where the library is missing, unless `TRAINKIT_REQUIRE_CUBLASLT` is set.
    #[test]
    fn cublaslt_accepts_every_descriptor_the_backend_builds() {
        // SAFETY: only tries to dlopen the library by its usual names.
        let Ok(lt) = CublasLt::get() else {
            if std::env::var_os("TRAINKIT_REQUIRE_CUBLASLT").is_some() {
                panic!("cuBLASLt is required (TRAINKIT_REQUIRE_CUBLASLT) but did not load");
            }
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "cuBLASLt descriptor check SKIPPED: libcublasLt.so.13 did not load"
            );
            return;
        };
        let layout = |ty, rows, cols| MatrixLayout {
            ty,
            rows,
            cols,
            ld: rows as i64,
        };
        let types = [MatrixType::F32, MatrixType::Bf16, MatrixType::F16];
        let mut built = 0;
        for operand in types {
            for out in [operand, MatrixType::F32] {
                for (bias, gelu_aux, bias_grad, bias_grad_of_b, dgelu_aux) in [
                    (0, 0, 0, false, 0),
                    (0x2000, 0, 0, false, 0),
                    (0, 0x3000, 0, false, 0),
                    (0x2000, 0x3000, 0, false, 0),
                    (0, 0, 0x4000, false, 0),
                    (0, 0, 0x4000, true, 0),
                    (0, 0, 0, false, 0x5000),
                ] {
                    for (trans_a, trans_b) in [(false, false), (true, false), (false, true)] {
                        for allow_tf32 in [false, true] {
                            let (m, n, k) = (64, 48, 32);
                            let (ar, ac) = if trans_a { (k, m) } else { (m, k) };
                            let (br, bc) = if trans_b { (n, k) } else { (k, n) };
                            let g = Gemm {
                                trans_a,
                                trans_b,
                                m,
                                n,
                                k,
                                a: 0x1000,
                                a_layout: layout(operand, ar, ac),
                                b: 0x1000,
                                b_layout: layout(operand, br, bc),
                                d: 0x1000,
                                c: 0,
                                d_layout: layout(out, m, n),
                                bias,
                                gelu_aux,
                                dgelu_aux,
                                bias_grad,
                                bias_grad_of_b,
                                alpha: 1.0,
                                beta: 0.0,
                                allow_tf32,
                                workspace: 0,
                                workspace_bytes: 0,
                            };
                            if let Err(e) = descriptors(lt, &g) {
                                panic!("cuBLASLt refused the descriptors of {g:?}: {e}");
                            }
                            built += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(built, 3 * 2 * 7 * 3 * 2);
        for (bytes, align) in [
            (0, [256; 4]),
            (gemm_workspace_bytes(8), [16, 2, 4, 8]),
            (gemm_workspace_bytes(9), [256, 128, 64, 32]),
        ] {
            let pref = preference(lt, bytes, align)
                .unwrap_or_else(|e| panic!("{bytes} bytes, alignments {align:?}: {e}"));
            // SAFETY: created above, destroyed once.
            unsafe { lt.destroy_matmul_pref(pref) }.unwrap();
        }
    }

    #[test]
    fn the_pool_gives_back_the_last_slice_of_the_device() {
        const GIB: u64 = 1 << 30;
        assert_eq!(release_threshold(80 * GIB), 80 * GIB - 80 * GIB / 32);
        assert_eq!(release_threshold(24 * GIB), 23 * GIB);
        assert_eq!(release_threshold(GIB / 2), 0);
    }
}
