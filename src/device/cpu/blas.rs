//! An optional CBLAS library for the CPU backend's matrix products, loaded at run time.
//!
//! trainkit's own products run on the `gemm` crate. A machine with Intel MKL (the library
//! PyTorch's CPU build multiplies with), OpenBLAS or BLIS can hand them to that library
//! instead: [`Blas::load`] opens it and finds `cblas_sgemm`, and
//! [`CpuBackend::with_blas`](super::CpuBackend::with_blas) (or `$TRAINKIT_BLAS` through
//! [`CpuBackend::from_env`](super::CpuBackend::from_env)) uses it for every product.
//!
//! trainkit keeps its own threading: a product is still cut into tiles that depend on its
//! shape only, each tile is one `cblas_sgemm` call on one thread, so the library is told to
//! run single-threaded (MKL's sequential layer, `openblas_set_num_threads(1)`,
//! `bli_thread_set_num_threads(1)`). MKL is also put in its conditional numerical
//! reproducibility mode, so the same product gives the same bits wherever its buffers
//! lie in memory: the recompute policies rely on that.

use super::product::Product;
use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};

/// The environment variable [`CpuBackend::from_env`](super::CpuBackend::from_env) reads: the
/// path of a shared library exporting `cblas_sgemm`.
pub const BLAS_ENV: &str = "TRAINKIT_BLAS";

/// `cblas_sgemm(layout, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`.
type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

/// CBLAS's enumerations.
const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// MKL's `MKL_THREADING_SEQUENTIAL` and `MKL_CBWR_AUTO | MKL_CBWR_STRICT`.
const MKL_THREADING_SEQUENTIAL: c_int = 1;
const MKL_CBWR_AUTO_STRICT: c_int = 2 | 0x10000;

/// A loaded CBLAS library.
pub struct Blas {
    sgemm: Sgemm,
    path: PathBuf,
    name: String,
    // Keeps `sgemm` valid; dropped last.
    _library: libloading::Library,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("path", &self.path)
            .field("name", &self.name)
            .finish()
    }
}

impl std::fmt::Display for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.path.display())
    }
}

fn blas_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Config {
        field: BLAS_ENV.to_string(),
        message: format!(
            "{}: {message}. Point it at a CBLAS shared library (Intel MKL's \
             libmkl_rt.so, OpenBLAS's libopenblas.so, BLIS's libblis.so), or unset it to \
             use trainkit's built-in products",
            path.display()
        ),
    }
}

impl Blas {
    /// The library `$TRAINKIT_BLAS` names; `None` when it is unset or empty, which means
    /// the `gemm` crate.
    pub fn path_from_env() -> Option<PathBuf> {
        std::env::var_os(BLAS_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    }

    /// Opens the shared library at `path`, finds `cblas_sgemm` and makes the library run
    /// each call on the calling thread alone.
    ///
    /// A library trainkit does not recognize (not MKL, OpenBLAS or BLIS) is used as it is,
    /// with a warning: if it starts threads of its own, they compete with trainkit's.
    pub fn load(path: impl AsRef<Path>) -> Result<Blas> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(blas_error(path, "no such file"));
        }
        // SAFETY: loading runs the library's initializers; a CBLAS library's are benign.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|e| blas_error(path, format!("cannot be loaded ({e})")))?;
        // SAFETY: the symbol is CBLAS's `cblas_sgemm`, whose signature is `Sgemm`.
        let sgemm = unsafe { library.get::<Sgemm>(b"cblas_sgemm\0") }
            .map(|s| *s)
            .map_err(|_| blas_error(path, "it does not export `cblas_sgemm`"))?;
        // SAFETY: each symbol below is looked up by its documented name and called with its
        // documented signature before any product runs.
        let name = unsafe { single_threaded(&library) };
        let name = name.unwrap_or_else(|| {
            log::warn!(
                "{}: not Intel MKL, OpenBLAS or BLIS; trainkit cannot tell it to run each \
                 product on one thread, and if it starts threads of its own they compete \
                 with trainkit's",
                path.display()
            );
            "a CBLAS library".to_string()
        });
        Ok(Blas {
            sgemm,
            path: path.to_path_buf(),
            name,
            _library: library,
        })
    }

    /// The library's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the library says it is (e.g. MKL's version string).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `p` through `cblas_sgemm`. Returns false, having done nothing, when CBLAS
    /// cannot express the strides or the sizes exceed its 32-bit integers.
    ///
    /// # Safety
    /// The pointers must cover the described matrices.
    pub(super) unsafe fn sgemm(&self, p: &Product) -> bool {
        let (Some((ta, lda)), Some((tb, ldb))) = (
            operand(p.m, p.k, p.a_rs, p.a_cs),
            operand(p.k, p.n, p.b_rs, p.b_cs),
        ) else {
            return false;
        };
        let ints = [p.m, p.n, p.k, lda, ldb];
        if p.dst_rs < p.n.max(1) as isize || ints.iter().any(|&v| v > c_int::MAX as usize) {
            return false;
        }
        let Ok(ldc) = c_int::try_from(p.dst_rs) else {
            return false;
        };
        let beta = if p.accumulate { 1.0 } else { 0.0 };
        (self.sgemm)(
            ROW_MAJOR,
            ta,
            tb,
            p.m as c_int,
            p.n as c_int,
            p.k as c_int,
            p.scale,
            p.a,
            lda as c_int,
            p.b,
            ldb as c_int,
            beta,
            p.dst,
            ldc,
        );
        true
    }
}

/// CBLAS's transpose flag and leading dimension for a `[rows, cols]` row-major operand
/// view whose element `(i, j)` lies at `i·rs + j·cs`; `None` when neither stride is 1.
fn operand(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<(c_int, usize)> {
    let (rows_i, cols_i) = (rows as isize, cols as isize);
    if cs == 1 && (rs >= cols_i.max(1) || rows <= 1) {
        Some((NO_TRANS, (rs.max(cols_i).max(1)) as usize))
    } else if rs == 1 && (cs >= rows_i.max(1) || cols <= 1) {
        Some((TRANS, (cs.max(rows_i).max(1)) as usize))
    } else {
        None
    }
}

/// Puts a known library in single-threaded mode and returns its name; `None` for a library
/// trainkit does not recognize.
///
/// # Safety
/// `library` must be a loaded CBLAS library; the symbols are MKL's, OpenBLAS's and BLIS's.
unsafe fn single_threaded(library: &libloading::Library) -> Option<String> {
    if let Ok(set_layer) =
        library.get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_Set_Threading_Layer\0")
    {
        set_layer(MKL_THREADING_SEQUENTIAL);
        if let Ok(cbwr) = library.get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_CBWR_Set\0") {
            let status = cbwr(MKL_CBWR_AUTO_STRICT);
            if status != 0 {
                log::warn!("MKL refused its strict reproducible mode (status {status})");
            }
        }
        let mut version = [0 as c_char; 256];
        let name = library
            .get::<unsafe extern "C" fn(*mut c_char, c_int)>(b"MKL_Get_Version_String\0")
            .ok()
            .map(|get| {
                get(version.as_mut_ptr(), version.len() as c_int - 1);
                CStr::from_ptr(version.as_ptr())
                    .to_string_lossy()
                    .trim()
                    .to_string()
            })
            .filter(|s| !s.is_empty());
        return Some(name.unwrap_or_else(|| "Intel MKL".to_string()));
    }
    if let Ok(set) = library.get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0") {
        set(1);
        let config = library
            .get::<unsafe extern "C" fn() -> *const c_char>(b"openblas_get_config\0")
            .ok()
            .map(|get| get())
            .filter(|p| !p.is_null())
            .map(|p| CStr::from_ptr(p).to_string_lossy().trim().to_string());
        return Some(match config {
            Some(c) if !c.is_empty() => format!("OpenBLAS ({c})"),
            _ => "OpenBLAS".to_string(),
        });
    }
    if let Ok(set) = library.get::<unsafe extern "C" fn(i64)>(b"bli_thread_set_num_threads\0") {
        set(1);
        return Some("BLIS".to_string());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{operand, NO_TRANS, TRANS};

    #[test]
    fn operands_map_to_cblas_transposes() {
        // A row-major [4, 3] matrix inside rows of 5.
        assert_eq!(operand(4, 3, 5, 1), Some((NO_TRANS, 5)));
        // The transpose of a row-major [3, 4] matrix.
        assert_eq!(operand(4, 3, 1, 4), Some((TRANS, 4)));
        // One row: its row stride is meaningless.
        assert_eq!(operand(1, 3, 0, 1), Some((NO_TRANS, 3)));
        // Neither stride is 1, or rows overlap: CBLAS cannot express it.
        assert_eq!(operand(4, 3, 6, 2), None);
        assert_eq!(operand(4, 3, 2, 1), None);
    }
}
