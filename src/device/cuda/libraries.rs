//! The CUDA libraries trainkit opens itself, NVRTC and cuBLASLt, by their versioned names
//! first, and the file each one came from.
//!
//! cudarc's loader tries a library's unversioned name (`libnvrtc.so`) before the versioned
//! one (`libnvrtc.so.13`). The unversioned name exists only among a toolkit's development
//! files, never in NVIDIA's pip wheels, so a toolkit of another release in the loader's
//! cache would win over the wheel directory on `LD_LIBRARY_PATH`. trainkit therefore opens
//! these two libraries itself, `lib<name>.so.13` first and `lib<name>.so` only when no
//! versioned file is found, and calls them through the function tables of
//! [`super::nvrtc`] and [`super::cublaslt`]. The driver (one per machine) is still opened
//! by cudarc. Which file each library came from is reported in `trainkit train`'s device
//! line and in the GPU bundle's report ([`Library::path`], [`driver_file`]).

use std::ffi::{c_void, CStr};
use std::path::{Path, PathBuf};

/// The CUDA major release whose libraries trainkit's bindings are written for.
pub const CUDA_MAJOR: u32 = 13;

/// Where a library is looked for.
#[derive(Clone, Copy, Debug)]
pub enum Search<'a> {
    /// The dynamic loader's own search: `LD_LIBRARY_PATH`, then its cache and the
    /// default directories.
    Loader,
    /// This directory only.
    Dir(&'a Path),
}

/// The file names tried for library `stem` (e.g. `nvrtc`), in order: the versioned name
/// (`libnvrtc.so.13`), then the unversioned one (`libnvrtc.so`).
pub fn candidates(stem: &str) -> [String; 2] {
    [
        format!("lib{stem}.so.{CUDA_MAJOR}"),
        format!("lib{stem}.so"),
    ]
}

/// An opened library, with the name it was opened by and the file it came from.
pub struct Library {
    lib: libloading::Library,
    name: String,
    path: PathBuf,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Library({} at {})", self.name, self.path.display())
    }
}

impl Library {
    /// Opens library `stem`, trying [`candidates`] in order where `search` says, and
    /// resolves the file it came from through `symbol` (any function it exports). Fails
    /// with every name tried and why each did not open.
    pub fn open(stem: &str, search: Search<'_>, symbol: &str) -> Result<Library, String> {
        Self::open_names(&candidates(stem), search, symbol)
    }

    /// Opens the first of the file `names` that loads, where `search` says, and resolves
    /// the file it came from through `symbol` (any function it exports). Fails with every
    /// name tried and why each did not open.
    pub fn open_names(
        names: &[String],
        search: Search<'_>,
        symbol: &str,
    ) -> Result<Library, String> {
        let mut tried = Vec::new();
        for name in names {
            let target = match search {
                Search::Loader => PathBuf::from(name),
                Search::Dir(dir) => dir.join(name),
            };
            // SAFETY: loading a CUDA library runs only its initializers, which have no
            // preconditions.
            match unsafe { libloading::Library::new(&target) } {
                Ok(lib) => {
                    let mut opened = Library {
                        lib,
                        name: name.to_string(),
                        path: target.clone(),
                    };
                    // SAFETY: only the symbol's address is taken, it is not called.
                    if let Ok(f) = unsafe { opened.function::<*const c_void>(symbol) } {
                        if let Some(file) = file_of(f as usize) {
                            opened.path = file;
                        }
                    }
                    return Ok(opened);
                }
                Err(e) => tried.push(format!("{}: {e}", target.display())),
            }
        }
        Err(format!("tried {}", tried.join("; ")))
    }

    /// The name the library was opened by (`libnvrtc.so.13`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file the library was loaded from, as the loader resolved it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The exported function `symbol` as a value of type `T` (a function pointer type).
    ///
    /// # Safety
    /// `T` must be the symbol's type (a function pointer with its exact signature).
    pub unsafe fn function<T: Copy>(&self, symbol: &str) -> Result<T, String> {
        // SAFETY: the caller guarantees the type.
        let found = unsafe { self.lib.get::<T>(symbol) };
        found
            .map(|s| *s)
            .map_err(|e| format!("{} has no `{symbol}` ({e})", self.path.display()))
    }
}

/// The file holding the code at address `addr`, as the dynamic loader knows it.
pub fn file_of(addr: usize) -> Option<PathBuf> {
    // SAFETY: a plain C struct of pointers, all null until dladdr fills it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only looks the address up in the loader's tables (it reads nothing
    // there); `info` is valid for writes.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_string_lossy().into_owned());
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

/// The file the CUDA driver library (opened by cudarc) was loaded from, where it loads.
pub fn driver_file() -> Option<PathBuf> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    // SAFETY: the library is present, so cudarc's loader does not panic; only the
    // symbol's address is taken.
    let f = unsafe {
        cudarc::driver::sys::culib()
            .get::<*const c_void>(b"cuDriverGetVersion\0")
            .ok()
            .map(|s| *s)
    }?;
    file_of(f as usize)
}

/// Builds shared libraries exporting the given C functions, for tests of the loading
/// order: each `(file name, C source)` is compiled by the host's C compiler into `dir`.
/// False (the test is skipped) when there is no C compiler, unless
/// `TRAINKIT_REQUIRE_EMULATOR` is set; panics on any other failure.
#[cfg(test)]
pub(crate) fn build_fake_libraries(dir: &Path, libs: &[(&str, String)]) -> bool {
    std::fs::create_dir_all(dir).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    for (file, source) in libs {
        let src = dir.join(format!("{file}.c"));
        std::fs::write(&src, source).unwrap();
        let out = std::process::Command::new(&cc)
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join(file))
            .arg(&src)
            .output();
        match out {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                assert!(
                    std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_none(),
                    "no C compiler ({cc}) to build the fake libraries"
                );
                return false;
            }
            Err(e) => panic!("{cc}: {e}"),
            Ok(o) => assert!(
                o.status.success(),
                "{cc} failed on {file}: {}",
                String::from_utf8_lossy(&o.stderr)
            ),
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_names_come_first() {
        assert_eq!(candidates("nvrtc"), ["libnvrtc.so.13", "libnvrtc.so"]);
        assert_eq!(
            candidates("cublasLt"),
            ["libcublasLt.so.13", "libcublasLt.so"]
        );
    }

    #[test]
    fn the_versioned_file_wins_and_its_path_is_reported() {
        let dir = std::env::temp_dir().join(format!("trainkit-libs-{}", std::process::id()));
        let lib = |v: i32| format!("int fake_version(void) {{ return {v}; }}\n");
        if !build_fake_libraries(&dir, &[("libfake.so", lib(1)), ("libfake.so.13", lib(13))]) {
            return;
        }
        type Version = unsafe extern "C" fn() -> i32;
        let opened = Library::open("fake", Search::Dir(&dir), "fake_version").unwrap();
        assert_eq!(opened.name(), "libfake.so.13");
        assert_eq!(
            opened.path(),
            std::fs::canonicalize(dir.join("libfake.so.13")).unwrap()
        );
        // SAFETY: the fake library's function has this signature.
        let v = unsafe { opened.function::<Version>("fake_version").unwrap()() };
        assert_eq!(v, 13);
        // Without the versioned file, the unversioned one (closed first: the loader would
        // hand back a library still open under the same path).
        drop(opened);
        std::fs::remove_file(dir.join("libfake.so.13")).unwrap();
        let opened = Library::open("fake", Search::Dir(&dir), "fake_version").unwrap();
        assert_eq!(opened.name(), "libfake.so");
        // SAFETY: as above.
        let v = unsafe { opened.function::<Version>("fake_version").unwrap()() };
        assert_eq!(v, 1);
        let missing = unsafe { opened.function::<Version>("nothing") }.unwrap_err();
        assert!(missing.contains("nothing"), "{missing}");
        drop(opened);
        // Neither: the error names both files.
        std::fs::remove_file(dir.join("libfake.so")).unwrap();
        let err = Library::open("fake", Search::Dir(&dir), "fake_version").unwrap_err();
        assert!(
            err.contains("libfake.so.13") && err.contains("libfake.so:"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
