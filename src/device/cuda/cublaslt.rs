//! cuBLASLt, opened by trainkit itself ([`super::libraries`]: `libcublasLt.so.13` first):
//! the functions the backend's products call, through one table.

use super::libraries::{Library, Search};
use cudarc::cublaslt::sys as lt;
use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::OnceLock;

/// A failed call: the function and cuBLASLt's status (`cublasStatus_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// The function that failed.
    pub call: &'static str,
    /// Its status code.
    pub code: i32,
}

impl Status {
    /// `CUBLAS_STATUS_ALLOC_FAILED`: cuBLASLt could not get memory.
    pub const ALLOC_FAILED: i32 = 3;
    /// `CUBLAS_STATUS_NOT_SUPPORTED`: no algorithm for the product.
    pub const NOT_SUPPORTED: i32 = 15;

    /// The status's name, as cuBLAS spells it.
    pub fn name(&self) -> &'static str {
        match self.code {
            0 => "CUBLAS_STATUS_SUCCESS",
            1 => "CUBLAS_STATUS_NOT_INITIALIZED",
            3 => "CUBLAS_STATUS_ALLOC_FAILED",
            7 => "CUBLAS_STATUS_INVALID_VALUE",
            8 => "CUBLAS_STATUS_ARCH_MISMATCH",
            11 => "CUBLAS_STATUS_MAPPING_ERROR",
            13 => "CUBLAS_STATUS_EXECUTION_FAILED",
            14 => "CUBLAS_STATUS_INTERNAL_ERROR",
            15 => "CUBLAS_STATUS_NOT_SUPPORTED",
            16 => "CUBLAS_STATUS_LICENSE_ERROR",
            _ => "an unknown status",
        }
    }

    /// Whether cuBLASLt ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == Self::ALLOC_FAILED
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} returned {} ({})", self.call, self.name(), self.code)
    }
}

type R = c_int;

/// cuBLASLt's functions, as the backend calls them.
#[derive(Debug)]
pub struct CublasLt {
    lib: Library,
    version: usize,
    create: unsafe extern "C" fn(*mut lt::cublasLtHandle_t) -> R,
    destroy: unsafe extern "C" fn(lt::cublasLtHandle_t) -> R,
    desc_create: unsafe extern "C" fn(
        *mut lt::cublasLtMatmulDesc_t,
        lt::cublasComputeType_t,
        lt::cudaDataType_t,
    ) -> R,
    desc_set: unsafe extern "C" fn(
        lt::cublasLtMatmulDesc_t,
        lt::cublasLtMatmulDescAttributes_t,
        *const c_void,
        usize,
    ) -> R,
    desc_destroy: unsafe extern "C" fn(lt::cublasLtMatmulDesc_t) -> R,
    layout_create:
        unsafe extern "C" fn(*mut lt::cublasLtMatrixLayout_t, lt::cudaDataType, u64, u64, i64) -> R,
    layout_destroy: unsafe extern "C" fn(lt::cublasLtMatrixLayout_t) -> R,
    pref_create: unsafe extern "C" fn(*mut lt::cublasLtMatmulPreference_t) -> R,
    pref_set: unsafe extern "C" fn(
        lt::cublasLtMatmulPreference_t,
        lt::cublasLtMatmulPreferenceAttributes_t,
        *const c_void,
        usize,
    ) -> R,
    pref_destroy: unsafe extern "C" fn(lt::cublasLtMatmulPreference_t) -> R,
    heuristic: unsafe extern "C" fn(
        lt::cublasLtHandle_t,
        lt::cublasLtMatmulDesc_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatmulPreference_t,
        c_int,
        *mut lt::cublasLtMatmulHeuristicResult_t,
        *mut c_int,
    ) -> R,
    check_algo: unsafe extern "C" fn(
        lt::cublasLtHandle_t,
        lt::cublasLtMatmulDesc_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatrixLayout_t,
        lt::cublasLtMatrixLayout_t,
        *const lt::cublasLtMatmulAlgo_t,
        *mut lt::cublasLtMatmulHeuristicResult_t,
    ) -> R,
    matmul: unsafe extern "C" fn(
        lt::cublasLtHandle_t,
        lt::cublasLtMatmulDesc_t,
        *const c_void,
        *const c_void,
        lt::cublasLtMatrixLayout_t,
        *const c_void,
        lt::cublasLtMatrixLayout_t,
        *const c_void,
        *const c_void,
        lt::cublasLtMatrixLayout_t,
        *mut c_void,
        lt::cublasLtMatrixLayout_t,
        *const lt::cublasLtMatmulAlgo_t,
        *mut c_void,
        usize,
        lt::cudaStream_t,
    ) -> R,
}

fn check(call: &'static str, code: R) -> Result<(), Status> {
    if code == 0 {
        Ok(())
    } else {
        Err(Status { call, code })
    }
}

/// What a cuBLASLt `…Create` call writes through its first argument, or its status.
fn created<T>(call: &'static str, create: impl FnOnce(*mut *mut T) -> R) -> Result<*mut T, Status> {
    let mut out = std::ptr::null_mut();
    check(call, create(&mut out))?;
    Ok(out)
}

impl CublasLt {
    /// Opens cuBLASLt where `search` says (see [`super::libraries`]).
    pub fn open(search: Search<'_>) -> Result<CublasLt, String> {
        let lib = Library::open("cublasLt", search, "cublasLtGetVersion").map_err(|tried| {
            format!(
                "cuBLASLt was not found ({tried}): install it from a CUDA 13 toolkit or the \
                 `nvidia-cublas==13.0.*` pip wheel, and put its lib directory on \
                 LD_LIBRARY_PATH"
            )
        })?;
        // SAFETY: each type is the documented signature of the cuBLASLt function named.
        unsafe {
            let version: unsafe extern "C" fn() -> usize = lib.function("cublasLtGetVersion")?;
            Ok(CublasLt {
                version: version(),
                create: lib.function("cublasLtCreate")?,
                destroy: lib.function("cublasLtDestroy")?,
                desc_create: lib.function("cublasLtMatmulDescCreate")?,
                desc_set: lib.function("cublasLtMatmulDescSetAttribute")?,
                desc_destroy: lib.function("cublasLtMatmulDescDestroy")?,
                layout_create: lib.function("cublasLtMatrixLayoutCreate")?,
                layout_destroy: lib.function("cublasLtMatrixLayoutDestroy")?,
                pref_create: lib.function("cublasLtMatmulPreferenceCreate")?,
                pref_set: lib.function("cublasLtMatmulPreferenceSetAttribute")?,
                pref_destroy: lib.function("cublasLtMatmulPreferenceDestroy")?,
                heuristic: lib.function("cublasLtMatmulAlgoGetHeuristic")?,
                check_algo: lib.function("cublasLtMatmulAlgoCheck")?,
                matmul: lib.function("cublasLtMatmul")?,
                lib,
            })
        }
    }

    /// The process's cuBLASLt, opened through the loader's search on first use.
    pub fn get() -> Result<&'static CublasLt, String> {
        static LT: OnceLock<Result<CublasLt, String>> = OnceLock::new();
        LT.get_or_init(|| CublasLt::open(Search::Loader))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The file cuBLASLt was loaded from.
    pub fn path(&self) -> &Path {
        self.lib.path()
    }

    /// Its version, `major * 10000 + minor * 100 + patch` (130000 for 13.0.0).
    pub fn version(&self) -> usize {
        self.version
    }

    /// A new handle.
    pub fn create_handle(&self) -> Result<lt::cublasLtHandle_t, Status> {
        // SAFETY: the pointer is valid for writes.
        created("cublasLtCreate", |h| unsafe { (self.create)(h) })
    }

    /// Destroys a handle.
    ///
    /// # Safety
    /// `h` must come from [`CublasLt::create_handle`] and not be used afterwards.
    pub unsafe fn destroy_handle(&self, h: lt::cublasLtHandle_t) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtDestroy", unsafe { (self.destroy)(h) })
    }

    /// A matmul descriptor.
    pub fn create_matmul_desc(
        &self,
        compute: lt::cublasComputeType_t,
        scale: lt::cudaDataType_t,
    ) -> Result<lt::cublasLtMatmulDesc_t, Status> {
        // SAFETY: the pointer is valid for writes.
        created("cublasLtMatmulDescCreate", |d| unsafe {
            (self.desc_create)(d, compute, scale)
        })
    }

    /// Sets a matmul descriptor attribute.
    ///
    /// # Safety
    /// `value` must point to `size` bytes of the attribute's documented type.
    pub unsafe fn set_matmul_desc_attribute(
        &self,
        d: lt::cublasLtMatmulDesc_t,
        attr: lt::cublasLtMatmulDescAttributes_t,
        value: *const c_void,
        size: usize,
    ) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtMatmulDescSetAttribute", unsafe {
            (self.desc_set)(d, attr, value, size)
        })
    }

    /// Destroys a matmul descriptor.
    ///
    /// # Safety
    /// `d` must be live and not used afterwards.
    pub unsafe fn destroy_matmul_desc(&self, d: lt::cublasLtMatmulDesc_t) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtMatmulDescDestroy", unsafe {
            (self.desc_destroy)(d)
        })
    }

    /// A matrix layout.
    pub fn create_matrix_layout(
        &self,
        ty: lt::cudaDataType,
        rows: u64,
        cols: u64,
        ld: i64,
    ) -> Result<lt::cublasLtMatrixLayout_t, Status> {
        // SAFETY: the pointer is valid for writes.
        created("cublasLtMatrixLayoutCreate", |l| unsafe {
            (self.layout_create)(l, ty, rows, cols, ld)
        })
    }

    /// Destroys a matrix layout.
    ///
    /// # Safety
    /// `l` must be live and not used afterwards.
    pub unsafe fn destroy_matrix_layout(
        &self,
        l: lt::cublasLtMatrixLayout_t,
    ) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtMatrixLayoutDestroy", unsafe {
            (self.layout_destroy)(l)
        })
    }

    /// A matmul preference.
    pub fn create_matmul_pref(&self) -> Result<lt::cublasLtMatmulPreference_t, Status> {
        // SAFETY: the pointer is valid for writes.
        created("cublasLtMatmulPreferenceCreate", |p| unsafe {
            (self.pref_create)(p)
        })
    }

    /// Sets a preference attribute.
    ///
    /// # Safety
    /// `value` must point to `size` bytes of the attribute's documented type.
    pub unsafe fn set_matmul_pref_attribute(
        &self,
        p: lt::cublasLtMatmulPreference_t,
        attr: lt::cublasLtMatmulPreferenceAttributes_t,
        value: *const c_void,
        size: usize,
    ) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtMatmulPreferenceSetAttribute", unsafe {
            (self.pref_set)(p, attr, value, size)
        })
    }

    /// Destroys a preference.
    ///
    /// # Safety
    /// `p` must be live and not used afterwards.
    pub unsafe fn destroy_matmul_pref(
        &self,
        p: lt::cublasLtMatmulPreference_t,
    ) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtMatmulPreferenceDestroy", unsafe {
            (self.pref_destroy)(p)
        })
    }

    /// The heuristic's algorithms for the product, best first, at most `count` of them
    /// (none when it has none).
    ///
    /// # Safety
    /// The handle, descriptor, layouts and preference must be live.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn algorithms(
        &self,
        h: lt::cublasLtHandle_t,
        desc: lt::cublasLtMatmulDesc_t,
        a: lt::cublasLtMatrixLayout_t,
        b: lt::cublasLtMatrixLayout_t,
        c: lt::cublasLtMatrixLayout_t,
        d: lt::cublasLtMatrixLayout_t,
        pref: lt::cublasLtMatmulPreference_t,
        count: usize,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>, Status> {
        let count = count.clamp(1, 64);
        // SAFETY: plain C structs, written by cuBLASLt before they are read.
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; count];
        let mut found: c_int = 0;
        // SAFETY: the caller's contract; the outputs are valid for `count` results.
        let code = unsafe {
            (self.heuristic)(
                h,
                desc,
                a,
                b,
                c,
                d,
                pref,
                count as c_int,
                results.as_mut_ptr(),
                &mut found,
            )
        };
        if code == Status::NOT_SUPPORTED {
            return Ok(Vec::new());
        }
        check("cublasLtMatmulAlgoGetHeuristic", code)?;
        let found = (found.max(0) as usize).min(count);
        Ok(results[..found]
            .iter()
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect())
    }

    /// Whether `algo` (saved by an earlier process) can run the product the descriptor
    /// and layouts describe, with at most `workspace_bytes` of workspace.
    ///
    /// # Safety
    /// The handle, descriptor and layouts must be live.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn algorithm_fits(
        &self,
        h: lt::cublasLtHandle_t,
        desc: lt::cublasLtMatmulDesc_t,
        a: lt::cublasLtMatrixLayout_t,
        b: lt::cublasLtMatrixLayout_t,
        c: lt::cublasLtMatrixLayout_t,
        d: lt::cublasLtMatrixLayout_t,
        algo: &lt::cublasLtMatmulAlgo_t,
        workspace_bytes: usize,
    ) -> bool {
        // SAFETY: a plain C struct, written by cuBLASLt before it is read.
        let mut result: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: the caller's contract; the output is valid for one result.
        let code = unsafe { (self.check_algo)(h, desc, a, b, c, d, algo, &mut result) };
        code == 0 && result.workspaceSize <= workspace_bytes
    }

    /// `D = alpha op(A) op(B) + beta C` with `algo` (C has D's layout).
    ///
    /// # Safety
    /// Every pointer must address memory of its layout on the handle's device, and
    /// `workspace` at least `workspace_bytes`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        h: lt::cublasLtHandle_t,
        desc: lt::cublasLtMatmulDesc_t,
        alpha: *const c_void,
        a: *const c_void,
        a_layout: lt::cublasLtMatrixLayout_t,
        b: *const c_void,
        b_layout: lt::cublasLtMatrixLayout_t,
        beta: *const c_void,
        c: *const c_void,
        d: *mut c_void,
        d_layout: lt::cublasLtMatrixLayout_t,
        algo: &lt::cublasLtMatmulAlgo_t,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: lt::cudaStream_t,
    ) -> Result<(), Status> {
        // SAFETY: the caller's contract.
        check("cublasLtMatmul", unsafe {
            (self.matmul)(
                h,
                desc,
                alpha,
                a,
                a_layout,
                b,
                b_layout,
                beta,
                c,
                d_layout,
                d,
                d_layout,
                algo,
                workspace,
                workspace_bytes,
                stream,
            )
        })
    }
}
