//! NVRTC, opened by trainkit itself ([`super::libraries`]: `libnvrtc.so.13` first), with
//! the check that it is no newer than the driver.
//!
//! A driver loads PTX and machine code only up to its own CUDA release: NVRTC 13.2's PTX
//! (`.version 9.2`) fails on a 13.0 driver with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` and
//! no further word. [`check_against_driver`] refuses such an NVRTC before anything is
//! compiled, naming both versions and the fix.

use super::libraries::{Library, Search};
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::Path;
use std::sync::OnceLock;

type Program = *mut c_void;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;
type NumArchsFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type ArchsFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// NVRTC's success status.
const SUCCESS: c_int = 0;

/// How to get the NVRTC trainkit's kernels are built with, for messages.
pub const NVRTC_HELP: &str = "install a CUDA 13.0 toolkit, or the pip wheels \
     (`python3 -m pip install 'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'`), \
     and put the directory holding libnvrtc.so.13 (a toolkit's lib64/, or the wheel's \
     site-packages/nvidia/cu13/lib) first on LD_LIBRARY_PATH";

/// An opened NVRTC: its functions, version and the architectures it compiles for.
#[derive(Debug)]
pub struct Nvrtc {
    lib: Library,
    version: (i32, i32),
    archs: Vec<i32>,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    cubin_size: SizeFn,
    cubin: GetFn,
    destroy: DestroyFn,
}

/// What one compilation produced.
#[derive(Clone, Debug)]
pub struct Output {
    /// The PTX.
    pub ptx: String,
    /// The machine code, when the target was a real architecture (`sm_XY`); `None` for a
    /// virtual one (`compute_XY`), whose PTX the driver assembles when it loads it.
    pub cubin: Option<Vec<u8>>,
    /// NVRTC's log (warnings; ptxas's report with `--ptxas-options=--verbose`).
    pub log: String,
}

impl Nvrtc {
    /// Opens NVRTC where `search` says (see [`super::libraries`]).
    pub fn open(search: Search<'_>) -> Result<Nvrtc, String> {
        let lib = Library::open("nvrtc", search, "nvrtcVersion")
            .map_err(|tried| format!("NVRTC was not found ({tried}): {NVRTC_HELP}"))?;
        // SAFETY: each type is the documented signature of the NVRTC function named.
        unsafe {
            let version: VersionFn = lib.function("nvrtcVersion")?;
            let num_archs: NumArchsFn = lib.function("nvrtcGetNumSupportedArchs")?;
            let archs_fn: ArchsFn = lib.function("nvrtcGetSupportedArchs")?;
            let (mut major, mut minor) = (0, 0);
            if version(&mut major, &mut minor) != SUCCESS {
                return Err(format!(
                    "{} did not report its version: {NVRTC_HELP}",
                    lib.path().display()
                ));
            }
            let mut n = 0;
            let mut archs = Vec::new();
            if num_archs(&mut n) == SUCCESS && n > 0 {
                archs = vec![0; n as usize];
                if archs_fn(archs.as_mut_ptr()) != SUCCESS {
                    archs.clear();
                }
            }
            Ok(Nvrtc {
                version: (major, minor),
                archs,
                create: lib.function("nvrtcCreateProgram")?,
                compile: lib.function("nvrtcCompileProgram")?,
                log_size: lib.function("nvrtcGetProgramLogSize")?,
                log: lib.function("nvrtcGetProgramLog")?,
                ptx_size: lib.function("nvrtcGetPTXSize")?,
                ptx: lib.function("nvrtcGetPTX")?,
                cubin_size: lib.function("nvrtcGetCUBINSize")?,
                cubin: lib.function("nvrtcGetCUBIN")?,
                destroy: lib.function("nvrtcDestroyProgram")?,
                lib,
            })
        }
    }

    /// The process's NVRTC, opened through the loader's search on first use.
    pub fn get() -> Result<&'static Nvrtc, String> {
        static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
        NVRTC
            .get_or_init(|| Nvrtc::open(Search::Loader))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// `(major, minor)`, e.g. `(13, 0)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The file NVRTC was loaded from.
    pub fn path(&self) -> &Path {
        self.lib.path()
    }

    /// The real architectures it compiles machine code for, as `XY` numbers (90 for
    /// sm_90), in its own order (oldest first).
    pub fn supported_archs(&self) -> &[i32] {
        &self.archs
    }

    /// Compiles `source` (named `name` in messages) with `flags`: the PTX, the machine
    /// code when the target is a real architecture, and the log; or, when it does not
    /// compile, the log.
    pub fn compile(&self, source: &str, name: &str, flags: &[String]) -> Result<Output, String> {
        let src = CString::new(source).map_err(|_| "the source contains a NUL byte")?;
        let cname = CString::new(name).map_err(|_| "the file name contains a NUL byte")?;
        let flags: Vec<CString> = flags
            .iter()
            .map(|f| CString::new(f.as_str()).map_err(|_| format!("NUL byte in flag {f:?}")))
            .collect::<Result<_, _>>()?;
        let ptrs: Vec<*const c_char> = flags.iter().map(|f| f.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: the strings are NUL-terminated and outlive the calls; the program is
        // destroyed once, below, on every path after it was created.
        unsafe {
            let status = (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if status != SUCCESS {
                return Err(format!("nvrtcCreateProgram failed (status {status})"));
            }
            let compiled = (self.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr());
            let log = self.text(prog, self.log_size, self.log).unwrap_or_default();
            let out = if compiled != SUCCESS {
                Err(if log.trim().is_empty() {
                    format!("status {compiled}")
                } else {
                    log.trim_end().to_string()
                })
            } else {
                self.text(prog, self.ptx_size, self.ptx)
                    .ok_or_else(|| "NVRTC gave no PTX".to_string())
                    .map(|ptx| Output {
                        ptx,
                        cubin: self.bytes(prog, self.cubin_size, self.cubin),
                        log,
                    })
            };
            (self.destroy)(&mut prog);
            out
        }
    }

    /// A sized output of `prog` (log, PTX, CUBIN) as bytes; `None` when empty or failed.
    ///
    /// # Safety
    /// `prog` must be a live program.
    unsafe fn bytes(&self, prog: Program, size: SizeFn, get: GetFn) -> Option<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: the caller's contract; the buffer holds `n` bytes.
        unsafe {
            if size(prog, &mut n) != SUCCESS || n == 0 {
                return None;
            }
            let mut buf = vec![0u8; n];
            if get(prog, buf.as_mut_ptr().cast()) != SUCCESS {
                return None;
            }
            Some(buf)
        }
    }

    /// A NUL-terminated text output of `prog` (log, PTX).
    ///
    /// # Safety
    /// `prog` must be a live program.
    unsafe fn text(&self, prog: Program, size: SizeFn, get: GetFn) -> Option<String> {
        // SAFETY: the caller's contract.
        let mut bytes = unsafe { self.bytes(prog, size, get) }?;
        if let Some(end) = bytes.iter().position(|&b| b == 0) {
            bytes.truncate(end);
        }
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Refuses an NVRTC newer than the driver: the driver (CUDA `driver_version`, 13000 for
/// 13.0) loads code only from its own release or older. The message names both versions,
/// the file NVRTC came from and the fix.
pub fn check_against_driver(
    nvrtc: (i32, i32),
    nvrtc_path: &Path,
    driver_version: i32,
) -> Result<(), String> {
    let driver = (driver_version / 1000, driver_version % 1000 / 10);
    if nvrtc <= driver {
        return Ok(());
    }
    Err(format!(
        "NVRTC {}.{} ({}) is newer than the NVIDIA driver, which supports CUDA {}.{}: the \
         driver would refuse the code it compiles. Use the NVRTC of CUDA {}.{} \
         (`python3 -m pip install 'nvidia-cuda-nvrtc=={}.{}.*'`, its site-packages/nvidia/cu13/lib \
         first on LD_LIBRARY_PATH), or update the driver",
        nvrtc.0,
        nvrtc.1,
        nvrtc_path.display(),
        driver.0,
        driver.1,
        driver.0,
        driver.1,
        driver.0,
        driver.1,
    ))
}

#[cfg(test)]
mod tests {
    use super::super::libraries::build_fake_libraries;
    use super::*;

    /// A fake libnvrtc reporting version `major.minor`, with every function trainkit
    /// binds (all but the version failing).
    fn fake_nvrtc(major: i32, minor: i32) -> String {
        let mut c = format!(
            "int nvrtcVersion(int *a, int *b) {{ *a = {major}; *b = {minor}; return 0; }}\n\
             int nvrtcGetNumSupportedArchs(int *n) {{ *n = 2; return 0; }}\n\
             int nvrtcGetSupportedArchs(int *a) {{ a[0] = 80; a[1] = 90; return 0; }}\n"
        );
        for f in [
            "nvrtcCreateProgram",
            "nvrtcCompileProgram",
            "nvrtcGetProgramLogSize",
            "nvrtcGetProgramLog",
            "nvrtcGetPTXSize",
            "nvrtcGetPTX",
            "nvrtcGetCUBINSize",
            "nvrtcGetCUBIN",
            "nvrtcDestroyProgram",
        ] {
            c.push_str(&format!("int {f}(void) {{ return 7; }}\n"));
        }
        c
    }

    #[test]
    fn an_nvrtc_newer_than_the_driver_is_refused_naming_both_versions() {
        let dir = std::env::temp_dir().join(format!("trainkit-nvrtc-{}", std::process::id()));
        let libs = [
            ("libnvrtc.so", fake_nvrtc(13, 2)),
            ("libnvrtc.so.13", fake_nvrtc(13, 0)),
        ];
        if !build_fake_libraries(&dir, &libs) {
            return;
        }
        // The versioned file is taken over the unversioned one, and passes.
        let n = Nvrtc::open(Search::Dir(&dir)).unwrap();
        assert_eq!(n.version(), (13, 0));
        assert!(
            n.path().ends_with("libnvrtc.so.13"),
            "{}",
            n.path().display()
        );
        assert_eq!(n.supported_archs(), &[80, 90]);
        assert!(check_against_driver(n.version(), n.path(), 13000).is_ok());
        // A failing compile is an error, not a panic.
        assert!(n.compile("x", "x.cu", &[]).is_err());
        drop(n);
        // With only the unversioned 13.2 present, a 13.0 driver refuses it.
        std::fs::remove_file(dir.join("libnvrtc.so.13")).unwrap();
        let n = Nvrtc::open(Search::Dir(&dir)).unwrap();
        assert_eq!(n.version(), (13, 2));
        let err = check_against_driver(n.version(), n.path(), 13000).unwrap_err();
        for part in [
            "NVRTC 13.2",
            "CUDA 13.0",
            "nvidia-cuda-nvrtc==13.0.*",
            "libnvrtc.so",
        ] {
            assert!(err.contains(part), "{part} missing from: {err}");
        }
        // A newer driver takes it.
        assert!(check_against_driver((13, 2), n.path(), 13020).is_ok());
        assert!(check_against_driver((13, 2), n.path(), 14000).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
