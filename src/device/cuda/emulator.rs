//! trainkit's CUDA kernels on the host: every kernel file compiled by the host's C++
//! compiler against a CPU emulation of the CUDA programming model (kernels/emu/), so the
//! CUDA backend's kernels run, and are tested, where there is no GPU.
//!
//! Each file of [`kernel_files`] becomes one translation unit: `kernels/emu/emu.h` (the
//! CUDA builtins: thread and block indices, `__syncthreads`, the warp shuffles, ...), then
//! the file's [`KernelFile::full_source`] (`#include <cuda_bf16.h>` finds the host stand-in
//! `kernels/emu/cuda_bf16.h`), then one trampoline per kernel, `tk_emu_<kernel>`, which
//! takes a launch with `cuLaunchKernel`'s conventions. With `kernels/emu/emu.cpp` (the
//! scheduler) they are linked into one shared library, built once per set of sources and
//! compiler and kept in a directory as a cache, then loaded.
//!
//! A launch runs its blocks one after another on the calling thread; the threads of a
//! block are fibers, so barriers and shuffles have their lockstep semantics, and a
//! deadlock or a divergent `__syncthreads` is an error instead of a hang. Arithmetic is
//! the host's IEEE arithmetic with `-ffp-contract=off`, as NVRTC's `--fmad=false`: the
//! kernels give the results they give on the device wherever those are specified bit for
//! bit (everything but the last bit of `logf` and the like). See kernels/README.md for
//! what the emulation does not check.

use super::kernels::{kernel_files, KernelFile};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable naming the directory where the emulation library is built
/// and cached (default: `<temp dir>/trainkit-emu`).
pub const DIR_ENV: &str = "TRAINKIT_EMU_DIR";

/// The environment variable naming the C++ compiler (default: `c++`).
pub const CXX_ENV: &str = "CXX";

/// The CUDA builtins on the CPU.
const EMU_HEADER: &str = include_str!("../../../kernels/emu/emu.h");
/// The host stand-in for CUDA's `cuda_bf16.h`.
const BF16_HEADER: &str = include_str!("../../../kernels/emu/cuda_bf16.h");
/// The host stand-in for CUDA's `cuda_fp16.h`.
const FP16_HEADER: &str = include_str!("../../../kernels/emu/cuda_fp16.h");
/// The scheduler: fibers, barriers, warp collectives.
const RUNTIME_SOURCE: &str = include_str!("../../../kernels/emu/emu.cpp");

/// Flags of every compilation: IEEE arithmetic with no contraction of `a * b + c` (as
/// NVRTC's `--fmad=false`), position-independent code for the shared library, symbols
/// hidden but the trampolines.
const COMPILE_FLAGS: &[&str] = &[
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
];

/// Flags of the link.
const LINK_FLAGS: &[&str] = &["-shared", "-fPIC"];

/// Bumped when the layout of the generated sources changes.
const GENERATOR_VERSION: &str = "trainkit cuda emulator v1";

/// A trampoline: `tk_emu_<kernel>(gx, gy, gz, bx, by, bz, shared_bytes, params, err,
/// err_len)`, 0 on success.
type LaunchFn = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> c_int;

/// `tk_emu_arity_<kernel>()`: how many arguments the kernel takes.
type ArityFn = unsafe extern "C" fn() -> u32;

/// One kernel of the library.
#[derive(Clone, Copy)]
struct Entry {
    launch: LaunchFn,
    arity: u32,
}

/// trainkit's CUDA kernels compiled for the host and run by a CPU emulation of the CUDA
/// model.
///
/// Built by [`KernelEmulator::new`] or [`KernelEmulator::build_in`]; launches go through
/// [`KernelEmulator::launch`], by kernel name (the names of [`kernel_files`]). It can be
/// shared between threads: launches from different threads run at the same time, each
/// with its own shared memory.
pub struct KernelEmulator {
    kernels: HashMap<String, Entry>,
    path: PathBuf,
    // Keeps the trampolines loaded; dropped last.
    _library: libloading::Library,
}

impl std::fmt::Debug for KernelEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelEmulator")
            .field("library", &self.path)
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

fn emu_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda-emulator",
        message: message.into(),
    }
}

/// One translation unit of kernels: a name (for messages), its CUDA source (what NVRTC
/// would compile) and the `extern "C"` kernels it defines.
#[derive(Clone, Debug)]
struct KernelSource {
    name: String,
    source: String,
    kernels: Vec<String>,
}

impl KernelSource {
    fn of(file: &KernelFile) -> Self {
        KernelSource {
            name: file.name.to_string(),
            source: file.full_source(),
            kernels: file.kernels.iter().map(|k| k.to_string()).collect(),
        }
    }
}

/// The C++ compiler: the program and the arguments that come with it (`$CXX` may be
/// `ccache g++`), and what `--version` says (part of the cache key).
#[derive(Clone, Debug)]
struct Compiler {
    program: OsString,
    args: Vec<OsString>,
    version: String,
}

impl Compiler {
    /// `$CXX`, else `c++`.
    fn from_env() -> Result<Compiler> {
        match std::env::var_os(CXX_ENV).filter(|v| !v.is_empty()) {
            Some(cxx) => Compiler::detect(&cxx, true),
            None => Compiler::detect(std::ffi::OsStr::new("c++"), false),
        }
    }

    /// Runs `<cxx> --version`; the error says what was tried and how to get a compiler.
    fn detect(cxx: &std::ffi::OsStr, from_env: bool) -> Result<Compiler> {
        let text = cxx.to_string_lossy();
        let mut words = text.split_whitespace().map(OsString::from);
        let program = words.next().unwrap_or_else(|| OsString::from("c++"));
        let args: Vec<OsString> = words.collect();
        let tried = if from_env {
            format!("`{text}` (from ${CXX_ENV})")
        } else {
            format!("`{text}` (${CXX_ENV} is not set)")
        };
        let help = format!(
            "the CUDA emulator compiles trainkit's kernels with a C++17 compiler: set \
             ${CXX_ENV} to one (e.g. CXX=g++ or CXX=clang++), or install one \
             (`apt-get install g++` on Debian and Ubuntu)"
        );
        let output = Command::new(&program)
            .args(&args)
            .arg("--version")
            .output()
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    emu_error(format!("no C++ compiler found: tried {tried}; {help}"))
                } else {
                    emu_error(format!("cannot run the C++ compiler {tried}: {e}; {help}"))
                }
            })?;
        if !output.status.success() {
            return Err(emu_error(format!(
                "the C++ compiler {tried} failed on --version ({}): {}; {help}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        Ok(Compiler {
            program,
            args,
            version: String::from_utf8_lossy(&output.stdout).trim().to_string(),
        })
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args);
        c
    }

    fn describe(&self) -> String {
        let mut words = vec![self.program.to_string_lossy().into_owned()];
        words.extend(self.args.iter().map(|a| a.to_string_lossy().into_owned()));
        words.join(" ")
    }
}

impl KernelEmulator {
    /// Builds (or reuses, from a cache keyed by a hash of all sources, the compiler and its
    /// flags) the emulation library; `dir` is where it is built.
    ///
    /// The compiler is `$CXX`, else `c++`. Several processes may build in the same `dir` at
    /// once: each builds under a name of its own and renames the library into place.
    pub fn build_in(dir: &Path) -> Result<KernelEmulator> {
        let compiler = Compiler::from_env()?;
        build(dir, &compiler, &trainkit_sources())
    }

    /// The same, in the default directory: `$TRAINKIT_EMU_DIR`, else
    /// `<std::env::temp_dir()>/trainkit-emu`.
    pub fn new() -> Result<KernelEmulator> {
        Self::build_in(&default_dir())
    }

    /// A library of one kernel file written outside trainkit: `file`, whose text is
    /// `source` (as NVRTC gets it, the common prelude included) defining `kernels`, built
    /// like trainkit's own (the same compiler, flags and cache directory) into a library
    /// of its own.
    pub(crate) fn build_file(
        file: &str,
        source: String,
        kernels: &[&str],
    ) -> Result<KernelEmulator> {
        let compiler = Compiler::from_env()?;
        let unit = KernelSource {
            name: file.to_string(),
            source,
            kernels: kernels.iter().map(|k| k.to_string()).collect(),
        };
        build(&default_dir(), &compiler, &[unit])
    }

    /// The shared library the kernels run from.
    pub fn library_path(&self) -> &Path {
        &self.path
    }

    /// Whether the library has a kernel named `kernel`.
    pub fn has_kernel(&self, kernel: &str) -> bool {
        self.kernels.contains_key(kernel)
    }

    /// How many arguments `kernel` takes, if the library has it.
    pub fn arity(&self, kernel: &str) -> Option<usize> {
        self.kernels.get(kernel).map(|e| e.arity as usize)
    }

    /// Runs one kernel launch to completion, with cuLaunchKernel's conventions: `params[i]`
    /// points to the i-th argument's value; device pointers are host addresses.
    ///
    /// `grid` and `block` are (x, y, z); a block has at most 1024 threads. `shared_bytes`
    /// is the dynamic shared memory (`extern __shared__`) of each block. Unlike
    /// cuLaunchKernel, `params` must have exactly as many entries as the kernel has
    /// arguments. Errors: an unknown kernel, bad launch dimensions, and whatever the
    /// emulation finds while the kernel runs (a deadlock, a divergent `__syncthreads`, a
    /// shuffle reading a lane that takes no part, `__trap`), with the block, thread and
    /// source line.
    ///
    /// # Safety
    ///
    /// Every `params[i]` must point to a valid value of the kernel's i-th argument type,
    /// and every pointer argument must be valid for all the accesses the kernel makes with
    /// that launch configuration: the kernel runs as native code in this process.
    pub unsafe fn launch(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let entry = self.kernels.get(kernel).ok_or_else(|| {
            emu_error(format!(
                "no kernel named `{kernel}`: the emulation library has the {} kernels of \
                 trainkit's kernel files (src/device/cuda/kernels.rs)",
                self.kernels.len()
            ))
        })?;
        if params.len() != entry.arity as usize {
            return Err(emu_error(format!(
                "kernel {kernel} takes {} arguments, but {} were given",
                entry.arity,
                params.len()
            )));
        }
        let mut err = vec![0u8; 4096];
        // SAFETY: the trampoline reads `params.len()` pointers from `params` (checked
        // above), each as the caller promised; it writes at most `err.len()` bytes,
        // NUL-terminated, to `err`.
        let rc = unsafe {
            (entry.launch)(
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                params.as_mut_ptr(),
                err.as_mut_ptr().cast::<c_char>(),
                err.len(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        Err(emu_error(String::from_utf8_lossy(&err[..end]).into_owned()))
    }
}

/// Every kernel file of trainkit.
fn trainkit_sources() -> Vec<KernelSource> {
    kernel_files().iter().map(|f| KernelSource::of(f)).collect()
}

/// `$TRAINKIT_EMU_DIR`, else `<temp dir>/trainkit-emu`.
fn default_dir() -> PathBuf {
    match std::env::var_os(DIR_ENV).filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir().join("trainkit-emu"),
    }
}

/// The translation unit of one kernel file: the emulation header, the CUDA source in a
/// namespace of its own (files may define helpers with the same names), then the
/// trampolines.
fn translation_unit(index: usize, file: &KernelSource) -> Result<String> {
    let ns = format!("tk_emu_file_{index}");
    let source = rewrite_extern_shared(&file.source, &file.name)?;
    let mut tu = String::with_capacity(source.len() + 256 * file.kernels.len() + 256);
    tu.push_str("// Generated by trainkit (src/device/cuda/emulator.rs) from ");
    tu.push_str(&file.name);
    tu.push_str(".\n#include \"emu.h\"\n");
    tu.push_str(&format!("namespace {ns} {{\n"));
    tu.push_str(&source);
    tu.push_str("\n}\n#line 1 \"<trampolines>\"\n");
    for k in &file.kernels {
        tu.push_str(&format!(
            "extern \"C\" __attribute__((visibility(\"default\"))) int tk_emu_{k}(\
             unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
             unsigned shared_bytes, void** params, char* err, size_t err_len) {{\n\
             \x20   return ::tk_emu::launch(&{ns}::{k}, \"{k}\", gx, gy, gz, bx, by, bz, \
             shared_bytes, params, err, err_len);\n}}\n\
             extern \"C\" __attribute__((visibility(\"default\"))) unsigned \
             tk_emu_arity_{k}(void) {{ return ::tk_emu::arity(&{ns}::{k}); }}\n"
        ));
    }
    Ok(tu)
}

/// The file name of unit `index`: `<index>-<stem>.cpp`, e.g. `2-gelu.cpp`.
fn unit_file_name(index: usize, name: &str) -> String {
    let stem = name.strip_suffix(".cu").unwrap_or(name);
    let stem: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("{index}-{stem}.cpp")
}

/// Rewrites each `extern __shared__ T name[];` (dynamic shared memory) as a pointer to the
/// launch's dynamic shared memory, which lives at a fixed address per OS thread:
/// `static thread_local T* const name = ...;`. Lines keep their numbers.
fn rewrite_extern_shared(source: &str, file: &str) -> Result<String> {
    const DECL: &str = "extern __shared__";
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find(DECL) {
        out.push_str(&rest[..at]);
        let after = &rest[at + DECL.len()..];
        let semi = after
            .find(';')
            .ok_or_else(|| emu_error(format!("{file}: `{DECL}` without a `;` after it")))?;
        let decl = &after[..semi];
        let bad = || {
            emu_error(format!(
                "{file}: cannot read the dynamic shared memory declaration `{DECL}{decl};` \
                 (expected `{DECL} T name[];`)"
            ))
        };
        let stripped = strip_alignment(decl);
        let body = stripped.trim_end();
        let body = body.strip_suffix(']').ok_or_else(bad)?.trim_end();
        let body = body.strip_suffix('[').ok_or_else(bad)?.trim_end();
        let name_start = body
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let (ty, name) = (body[..name_start].trim(), &body[name_start..]);
        if ty.is_empty() || name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(bad());
        }
        out.push_str(&format!(
            "static thread_local {ty}* const {name} = \
             reinterpret_cast<{ty}*>(::tk_emu::dynamic_shared_memory());"
        ));
        out.push_str(&"\n".repeat(decl.matches('\n').count()));
        rest = &after[semi + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `decl` without `__align__(..)`, `alignas(..)` and `__attribute__((..))` (the buffer is
/// aligned to 256 bytes anyway).
fn strip_alignment(decl: &str) -> String {
    let mut s = decl.to_string();
    for word in ["__align__", "alignas", "__attribute__"] {
        while let Some(at) = s.find(word) {
            let open = at + word.len();
            let Some(paren) = s[open..].find('(').map(|p| open + p) else {
                break;
            };
            if !s[open..paren].trim().is_empty() {
                break;
            }
            let mut depth = 0usize;
            let mut end = None;
            for (i, c) in s[paren..].char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(paren + i + 1);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let Some(end) = end else { break };
            s.replace_range(at..end, " ");
        }
    }
    s
}

/// Builds the library for `sources` with `compiler` in `dir` (or finds it there), and
/// loads it.
fn build(dir: &Path, compiler: &Compiler, sources: &[KernelSource]) -> Result<KernelEmulator> {
    let units: Vec<(String, String)> = sources
        .iter()
        .enumerate()
        .map(|(i, f)| Ok((unit_file_name(i, &f.name), translation_unit(i, f)?)))
        .collect::<Result<_>>()?;
    let key = cache_key(compiler, &units);
    let lib_name = format!(
        "{}trainkit-emu-{key}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let lib_path = dir.join(&lib_name);
    if lib_path.is_file() {
        // A library that does not load (damaged, another platform's) is built again.
        if let Ok(emu) = load(&lib_path, sources) {
            return Ok(emu);
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| {
        emu_error(format!(
            "cannot create the emulator's build directory {}: {e} (set ${DIR_ENV} to a \
             writable directory)",
            dir.display()
        ))
    })?;
    let work = unique_work_dir(dir, &key);
    let built = compile_library(&work, compiler, &units);
    let result = built.and_then(|tmp_lib| {
        std::fs::rename(&tmp_lib, &lib_path).map_err(|e| {
            emu_error(format!(
                "cannot move the emulation library to {}: {e}",
                lib_path.display()
            ))
        })
    });
    let _ = std::fs::remove_dir_all(&work);
    result?;
    load(&lib_path, sources)
}

/// A fresh directory under `dir` for one build: process id and a counter keep concurrent
/// builds (other processes, other threads) apart.
fn unique_work_dir(dir: &Path, key: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    dir.join(format!(
        "build-{}-{}-{n}-{nanos}",
        &key[..16],
        std::process::id()
    ))
}

/// Writes the sources to `work`, compiles every unit in parallel and links them; the path
/// of the library in `work`.
fn compile_library(
    work: &Path,
    compiler: &Compiler,
    units: &[(String, String)],
) -> Result<PathBuf> {
    let io = |path: &Path, e: std::io::Error| {
        emu_error(format!(
            "{}: {e} (set ${DIR_ENV} to a writable directory)",
            path.display()
        ))
    };
    std::fs::create_dir_all(work).map_err(|e| io(work, e))?;
    let mut files: Vec<(String, &str)> = vec![
        ("emu.h".to_string(), EMU_HEADER),
        ("cuda_bf16.h".to_string(), BF16_HEADER),
        ("cuda_fp16.h".to_string(), FP16_HEADER),
        ("emu.cpp".to_string(), RUNTIME_SOURCE),
    ];
    files.extend(units.iter().map(|(n, s)| (n.clone(), s.as_str())));
    for (name, text) in &files {
        let path = work.join(name);
        std::fs::write(&path, text).map_err(|e| io(&path, e))?;
    }
    let mut cpp: Vec<&str> = vec!["emu.cpp"];
    cpp.extend(units.iter().map(|(n, _)| n.as_str()));
    let results: Vec<Result<PathBuf>> = std::thread::scope(|scope| {
        let handles: Vec<_> = cpp
            .iter()
            .map(|name| {
                scope.spawn(move || {
                    let object = work.join(format!("{name}.o"));
                    let mut cmd = compiler.command();
                    cmd.args(COMPILE_FLAGS)
                        .arg("-I")
                        .arg(work)
                        .arg("-c")
                        .arg(work.join(name))
                        .arg("-o")
                        .arg(&object);
                    run(cmd, compiler, &format!("compile {name}"))?;
                    Ok(object)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(emu_error("a compile thread panicked")))
            })
            .collect()
    });
    let objects: Vec<PathBuf> = results.into_iter().collect::<Result<_>>()?;
    let lib = work.join(format!(
        "{}trainkit-emu{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let mut cmd = compiler.command();
    cmd.args(LINK_FLAGS).args(&objects).arg("-o").arg(&lib);
    run(cmd, compiler, "link the emulation library")?;
    Ok(lib)
}

/// Runs one compiler command; its diagnostics in the error when it fails.
fn run(mut cmd: Command, compiler: &Compiler, what: &str) -> Result<()> {
    let output = cmd.output().map_err(|e| {
        emu_error(format!(
            "cannot run the C++ compiler `{}` to {what}: {e}",
            compiler.describe()
        ))
    })?;
    if output.status.success() {
        return Ok(());
    }
    let mut log = String::from_utf8_lossy(&output.stderr).into_owned();
    log.push_str(&String::from_utf8_lossy(&output.stdout));
    const MAX: usize = 8000;
    if log.len() > MAX {
        let mut cut = MAX;
        while !log.is_char_boundary(cut) {
            cut -= 1;
        }
        log.truncate(cut);
        log.push_str("\n[...]");
    }
    Err(emu_error(format!(
        "`{}` could not {what} ({}):\n{}",
        compiler.describe(),
        output.status,
        log.trim_end()
    )))
}

/// Loads the library and resolves every kernel's trampoline.
fn load(path: &Path, sources: &[KernelSource]) -> Result<KernelEmulator> {
    // SAFETY: the library is one this module built from trainkit's sources; loading it
    // runs no initializers but the C++ runtime's.
    let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
        emu_error(format!(
            "cannot load the emulation library {}: {e}",
            path.display()
        ))
    })?;
    let mut kernels = HashMap::new();
    for k in sources.iter().flat_map(|f| &f.kernels) {
        let missing = |e: libloading::Error| {
            emu_error(format!(
                "the emulation library {} has no trampoline for kernel {k}: {e}",
                path.display()
            ))
        };
        // SAFETY: the generated trampolines have exactly these signatures; the function
        // pointers are used only while `library` is loaded (it is kept with them).
        let entry = unsafe {
            let launch: LaunchFn = *library
                .get::<LaunchFn>(format!("tk_emu_{k}").as_bytes())
                .map_err(missing)?;
            let arity: ArityFn = *library
                .get::<ArityFn>(format!("tk_emu_arity_{k}").as_bytes())
                .map_err(missing)?;
            Entry {
                launch,
                arity: arity(),
            }
        };
        kernels.insert(k.clone(), entry);
    }
    Ok(KernelEmulator {
        kernels,
        path: path.to_path_buf(),
        _library: library,
    })
}

/// 32 hex digits: FNV-1a (128 bits) of the generator version, every source, the compiler
/// (its command and `--version`) and the flags.
fn cache_key(compiler: &Compiler, units: &[(String, String)]) -> String {
    let mut h = Fnv128::new();
    h.field(GENERATOR_VERSION.as_bytes());
    h.field(EMU_HEADER.as_bytes());
    h.field(BF16_HEADER.as_bytes());
    h.field(RUNTIME_SOURCE.as_bytes());
    for (name, text) in units {
        h.field(name.as_bytes());
        h.field(text.as_bytes());
    }
    h.field(compiler.describe().as_bytes());
    h.field(compiler.version.as_bytes());
    for flag in COMPILE_FLAGS.iter().chain(LINK_FLAGS) {
        h.field(flag.as_bytes());
    }
    format!("{:032x}", h.0)
}

/// FNV-1a, 128 bits: stable across Rust versions, unlike std's `DefaultHasher`.
struct Fnv128(u128);

impl Fnv128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;

    fn new() -> Self {
        Fnv128(Self::OFFSET)
    }

    /// The length, then the bytes, so that fields cannot run into each other.
    fn field(&mut self, bytes: &[u8]) {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= *b as u128;
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }
}

/// trainkit's kernels, built once per test process for the parity tests
/// ([`super::parity`]); `None` (saying why) without a C++ compiler, unless
/// `TRAINKIT_REQUIRE_EMULATOR` is set.
#[cfg(test)]
pub(crate) fn trainkit_emulator() -> Option<&'static KernelEmulator> {
    static EMU: std::sync::OnceLock<Option<KernelEmulator>> = std::sync::OnceLock::new();
    EMU.get_or_init(|| tests::build_or_skip(trainkit_sources))
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::kernels::COMMON_SOURCE;
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::tensor::DType;
    use crate::Rng;
    use half::bf16;
    use std::ffi::OsStr;
    use std::sync::OnceLock;

    /// Set (to 1) where a missing C++ compiler must fail the tests instead of skipping
    /// them (CI).
    const REQUIRE_ENV: &str = "TRAINKIT_REQUIRE_EMULATOR";

    /// Kernels that exercise the emulation itself (barriers, shuffles, errors), with
    /// trainkit's common helpers before them as for a kernel file.
    const TEST_KERNELS: &str = r#"
// Every shuffle, for widths 1 .. 32 and offsets 0 .. 31: out[(case * 4 + op) * n + tid].
extern "C" __global__ void shuffles(int* out, int n) {
    const int tid = threadIdx.x;
    const int v = 1000 + tid;
    int k = 0;
    for (int w = 1; w <= 32; w *= 2) {
        for (int d = 0; d < 32; ++d) {
            out[k++ * n + tid] = __shfl_sync(0xffffffffu, v, d, w);
            out[k++ * n + tid] = __shfl_up_sync(0xffffffffu, v, (unsigned)d, w);
            out[k++ * n + tid] = __shfl_down_sync(0xffffffffu, v, (unsigned)d, w);
            out[k++ * n + tid] = __shfl_xor_sync(0xffffffffu, v, d, w);
        }
    }
}

// 64-bit shuffles, half-warp masks, the ballot and votes, the common half_sum.
extern "C" __global__ void warp_misc(double* sums, unsigned* votes, float* halves) {
    const int tid = threadIdx.x;
    double v = 0.5 * tid + 1e10;
    for (int w = 16; w > 0; w >>= 1) v += __shfl_xor_sync(0xffffffffu, v, w);
    sums[tid] = v;
    votes[3 * tid] = __ballot_sync(0xffffffffu, tid % 3 == 0);
    votes[3 * tid + 1] = __any_sync(half_mask(), tid == 20);
    votes[3 * tid + 2] = __all_sync(half_mask(), tid < 20);
    halves[tid] = half_sum((float)tid);
}

// Reverses each block through static shared memory.
extern "C" __global__ void reverse_block(float* out, const float* in) {
    __shared__ float tile[1024];
    const unsigned n = blockDim.x, i = threadIdx.x, base = blockIdx.x * n;
    tile[i] = in[base + i];
    __syncthreads();
    out[base + i] = tile[n - 1 - i];
}

// The same through dynamic shared memory (blockDim.x floats).
extern "C" __global__ void reverse_dynamic(float* out, const float* in) {
    extern __shared__ __align__(16) float dyn[];
    const unsigned n = blockDim.x, i = threadIdx.x, base = blockIdx.x * n;
    dyn[i] = in[base + i];
    __syncthreads();
    out[base + i] = dyn[n - 1 - i];
}

// Threads from `k` on return at once; the others reduce predicates across the block.
extern "C" __global__ void barrier_counts(int* out, int k) {
    if ((int)threadIdx.x >= k) return;
    const int c = __syncthreads_count(threadIdx.x % 3 == 0);
    const int a = __syncthreads_and(threadIdx.x < 1000);
    const int o = __syncthreads_or(threadIdx.x == 5);
    __syncthreads();
    if (threadIdx.x == 0) {
        out[0] = c;
        out[1] = a;
        out[2] = o;
    }
}

// The six indices of every thread of a 3-D launch.
extern "C" __global__ void indices(unsigned* out) {
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned g = block * (blockDim.x * blockDim.y * blockDim.z) + t;
    out[6 * g + 0] = threadIdx.x;
    out[6 * g + 1] = threadIdx.y;
    out[6 * g + 2] = threadIdx.z;
    out[6 * g + 3] = blockIdx.x;
    out[6 * g + 4] = blockIdx.y;
    out[6 * g + 5] = blockIdx.z;
}

// bf16 conversions both ways, and a * b + c against fmaf.
extern "C" __global__ void conversions(unsigned short* to_bf16, unsigned short* from_f64,
                                       float* widened, float* products, const float* x,
                                       const double* xd, i64 n) {
    TK_FOR_EACH(i, n) {
        to_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
        from_f64[i] = __bfloat16_as_ushort(__double2bfloat16(xd[i]));
        widened[i] = __bfloat162float(__ushort_as_bfloat16((unsigned short)i));
        const float a = x[i], b = x[(i + 1) % n], c = x[(i + 2) % n];
        products[2 * i] = a * b + c;
        products[2 * i + 1] = fmaf(a, b, c);
    }
}

// Errors.
extern "C" __global__ void deadlock(int* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncwarp();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void divergent(int* out) {
    if (threadIdx.x & 1) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void reads_exited(float* out) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

extern "C" __global__ void traps(int* out) {
    if (blockIdx.x == 1 && threadIdx.x == 7) __trap();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}
"#;

    const TEST_KERNEL_NAMES: &[&str] = &[
        "shuffles",
        "warp_misc",
        "reverse_block",
        "reverse_dynamic",
        "barrier_counts",
        "indices",
        "conversions",
        "deadlock",
        "divergent",
        "reads_exited",
        "traps",
    ];

    /// Skips (returns `None`, saying why) when no C++ compiler can be run, unless
    /// `TRAINKIT_REQUIRE_EMULATOR` is set; any other build failure fails.
    pub(super) fn build_or_skip(sources: fn() -> Vec<KernelSource>) -> Option<KernelEmulator> {
        let compiler = match Compiler::from_env() {
            Ok(c) => c,
            Err(e) => {
                if std::env::var_os(REQUIRE_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
                    panic!("{REQUIRE_ENV} is set, but the CUDA emulator cannot be built: {e}");
                }
                eprintln!(
                    "CUDA emulator tests skipped: {e} (set {REQUIRE_ENV}=1 to make this a \
                     failure)"
                );
                return None;
            }
        };
        let start = std::time::Instant::now();
        let emu = build(&default_dir(), &compiler, &sources()).unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "emulation library {} ready in {:.2?}",
            emu.library_path().display(),
            start.elapsed()
        );
        Some(emu)
    }

    fn test_sources() -> Vec<KernelSource> {
        vec![KernelSource {
            name: "emulator_test.cu".to_string(),
            source: format!(
                "#line 1 \"common.cuh\"\n{COMMON_SOURCE}\n#line 1 \"emulator_test.cu\"\n\
                 {TEST_KERNELS}"
            ),
            kernels: TEST_KERNEL_NAMES.iter().map(|k| k.to_string()).collect(),
        }]
    }

    /// The test kernels above, built once per test process.
    fn test_emulator() -> Option<&'static KernelEmulator> {
        static EMU: OnceLock<Option<KernelEmulator>> = OnceLock::new();
        EMU.get_or_init(|| build_or_skip(test_sources)).as_ref()
    }

    /// The device's two passes: one f64 partial per block, then one warp adds them.
    fn emulated_sum_squares<T: 'static + Copy>(emu: &KernelEmulator, kernel: &str, x: &[T]) -> f64 {
        let blocks = 5u32;
        let mut partial = vec![f64::NAN; blocks as usize];
        let mut x = x.to_vec();
        let n = x.len() as i64;
        let a = Args::new().ptr(&mut partial).ptr(&mut x).arg(n);
        launch(emu, kernel, blocks, 256, 0, a).unwrap();
        let mut out = [f64::NAN];
        let a = Args::new()
            .ptr(&mut out)
            .ptr(&mut partial)
            .arg(blocks as i64);
        launch(emu, "sum_squares_finish", 1, 32, 0, a).unwrap();
        out[0]
    }

    /// One tensor of `sum_squares_multi_*`'s table (kernels/reductions.cu's `SquaresTensor`).
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct SquaresTensor {
        x: *const c_void,
        n: i64,
        slot: i64,
        grid: i64,
    }

    /// kernels/reductions.cu's `SquaresTable`, passed by value.
    #[repr(C)]
    struct SquaresTable {
        t: [SquaresTensor; 32],
        count: i64,
    }

    #[test]
    fn the_multi_tensor_sum_of_squares_leaves_each_tensors_partials() {
        let Some(emu) = emulator() else { return };
        // Tensors with grids of 3, 1 and 2 blocks of 256 threads (the first walks its
        // elements more than once a thread), in one launch and one launch each.
        let sizes_grids = [(3000usize, 3i64), (17, 1), (1025, 2)];
        for dtype in DTYPES {
            let mut xs: Vec<Buf> = sizes_grids
                .iter()
                .enumerate()
                .map(|(k, &(n, _))| Buf::new(&random(n, 2.0, 80 + k as u64), dtype))
                .collect();
            let slots: i64 = sizes_grids.iter().map(|(_, g)| g).sum();
            let kernel = |what: &str| format!("sum_squares_{what}_{}", suffix(dtype));
            let mut want = vec![f64::NAN; slots as usize];
            let mut at = 0usize;
            for (x, &(n, grid)) in xs.iter_mut().zip(&sizes_grids) {
                let mut part = vec![f64::NAN; grid as usize];
                let a = Args::new().ptr(&mut part).buf(x).arg(n as i64);
                launch(emu, &kernel("partial"), grid as u32, 256, 0, a).unwrap();
                want[at..at + grid as usize].copy_from_slice(&part);
                at += grid as usize;
            }
            let empty = SquaresTensor {
                x: std::ptr::null(),
                n: 0,
                slot: 0,
                grid: 0,
            };
            let mut table = SquaresTable {
                t: [empty; 32],
                count: sizes_grids.len() as i64,
            };
            let mut slot = 0;
            for (k, (x, &(n, grid))) in xs.iter_mut().zip(&sizes_grids).enumerate() {
                table.t[k] = SquaresTensor {
                    x: x.ptr() as *const c_void,
                    n: n as i64,
                    slot,
                    grid,
                };
                slot += grid;
            }
            let mut got = vec![f64::NAN; slots as usize];
            let a = Args::new().ptr(&mut got).arg(table);
            launch(emu, &kernel("multi"), slots as u32, 256, 0, a).unwrap();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        }
    }

    #[test]
    fn sum_squares_matches_the_cpu_to_f64_rounding() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        let xs = random(10_007, 3.0, 3);
        for dtype in DTYPES {
            let want = be
                .sum_squares(&upload(&be, &xs, &[xs.len()], dtype))
                .unwrap();
            let got = match dtype {
                DType::U8 | DType::Nf4(_) => {
                    unreachable!("the kernels under test take f32, bf16 or f16")
                }
                DType::F32 => emulated_sum_squares(emu, "sum_squares_partial_f32", &xs),
                DType::Bf16 => emulated_sum_squares(emu, "sum_squares_partial_bf16", &to_bf16(&xs)),
                DType::F16 => emulated_sum_squares(emu, "sum_squares_partial_f16", &to_f16(&xs)),
            };
            let rel = ((got - want) / want).abs();
            assert!(
                rel < 1e-12,
                "{dtype:?}: emulated {got}, cpu {want} (rel {rel:e})"
            );
        }
    }

    #[test]
    fn elementwise_kernels_match_the_cpu_bit_for_bit() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        let n = 1000usize;
        let (xs, ys, zs) = (random(n, 2.0, 20), random(n, 2.0, 21), random(n, 1e-3, 22));
        let ln = n as i64;
        for d in DTYPES {
            for s in DTYPES {
                if !instantiated(&[d, s]) {
                    continue;
                }
                let src = upload(&be, &xs, &[n], s);
                let mut dst = zeros(&be, &[n], d);
                be.cast(&mut dst, &src).unwrap();
                let mut out = Buf::new(&vec![0.0; n], d);
                let mut x = Buf::new(&xs, s);
                let a = Args::new().buf(&mut out).buf(&mut x).arg(ln);
                launch(
                    emu,
                    &format!("cast_{}_{}", suffix(d), suffix(s)),
                    2,
                    128,
                    0,
                    a,
                )
                .unwrap();
                assert_bitwise("cast", &out.values(), &be.to_f32(&dst).unwrap());

                // y += alpha · x
                let mut y_cpu = upload(&be, &ys, &[n], d);
                be.axpy(&mut y_cpu, -0.37, &src).unwrap();
                let mut y = Buf::new(&ys, d);
                let a = Args::new().buf(&mut y).arg(-0.37f32).buf(&mut x).arg(ln);
                launch(
                    emu,
                    &format!("axpy_{}_{}", suffix(d), suffix(s)),
                    3,
                    64,
                    0,
                    a,
                )
                .unwrap();
                assert_bitwise("axpy", &y.values(), &be.to_f32(&y_cpu).unwrap());

                for b in DTYPES {
                    if !instantiated(&[d, s, b]) {
                        continue;
                    }
                    let bt = upload(&be, &zs, &[n], b);
                    let mut out_cpu = zeros(&be, &[n], d);
                    be.add(&mut out_cpu, &src, &bt).unwrap();
                    let mut out = Buf::new(&vec![0.0; n], d);
                    let mut bb = Buf::new(&zs, b);
                    let a = Args::new().buf(&mut out).buf(&mut x).buf(&mut bb).arg(ln);
                    let k = format!("add_{}_{}_{}", suffix(d), suffix(s), suffix(b));
                    launch(emu, &k, 2, 96, 0, a).unwrap();
                    assert_bitwise(&k, &out.values(), &be.to_f32(&out_cpu).unwrap());
                }
            }
            let t = suffix(d);
            let mut f_cpu = zeros(&be, &[n], d);
            be.fill(&mut f_cpu, 0.1).unwrap();
            let mut f = Buf::new(&ys, d);
            let a = Args::new().buf(&mut f).arg(0.1f32).arg(ln);
            launch(emu, &format!("fill_{t}"), 1, 256, 0, a).unwrap();
            assert_bitwise("fill", &f.values(), &be.to_f32(&f_cpu).unwrap());
            let mut s_cpu = upload(&be, &ys, &[n], d);
            be.scale(&mut s_cpu, 1.7).unwrap();
            let mut sc = Buf::new(&ys, d);
            let a = Args::new().buf(&mut sc).arg(1.7f32).arg(ln);
            launch(emu, &format!("scale_{t}"), 1, 256, 0, a).unwrap();
            assert_bitwise("scale", &sc.values(), &be.to_f32(&s_cpu).unwrap());

            // The bias gradient: 300 rows in 10 blocks of 32 (the last one part full), 37
            // columns (no 16-byte loads); then 4,200 rows (132 blocks: more than one chunk
            // of the second pass) of 48 columns (16-byte loads).
            for (rows, cols) in [(300usize, 37usize), (4200, 48)] {
                let douts = random(rows * cols, 1.0, 23);
                let db0 = random(cols, 0.1, 24);
                let dout = upload(&be, &douts, &[rows, cols], d);
                let mut db_cpu = upload(&be, &db0, &[cols], d);
                be.bias_backward(&mut db_cpu, &dout).unwrap();
                let blocks = rows.div_ceil(crate::device::cpu::elementwise::ROW_BLOCK);
                let mut partial = vec![f32::NAN; blocks * cols];
                let mut dout_buf = Buf::new(&douts, d);
                let a = Args::new()
                    .ptr(&mut partial)
                    .buf(&mut dout_buf)
                    .arg(rows as i64)
                    .arg(cols as i64);
                launch(emu, &format!("bias_backward_partial_{t}"), 1, 64, 0, a).unwrap();
                let mut db = Buf::new(&db0, d);
                let a = Args::new()
                    .buf(&mut db)
                    .ptr(&mut partial)
                    .arg(blocks as i64)
                    .arg(cols as i64);
                launch(emu, &format!("bias_backward_finish_{t}"), 1, 64, 0, a).unwrap();
                assert_bitwise("bias_backward", &db.values(), &be.to_f32(&db_cpu).unwrap());
            }
        }
    }

    #[test]
    fn shuffles_follow_cuda_semantics() {
        let Some(emu) = test_emulator() else { return };
        let n = 64usize; // two warps
        let cases = 6 * 32 * 4;
        let mut out = vec![-1i32; cases * n];
        let a = Args::new().ptr(&mut out).arg(n as i32);
        launch(emu, "shuffles", 1, n as u32, 0, a).unwrap();
        let mut k = 0;
        for w in [1usize, 2, 4, 8, 16, 32] {
            for d in 0..32usize {
                for op in ["idx", "up", "down", "xor"] {
                    for tid in 0..n {
                        let (warp, lane) = (tid / 32 * 32, tid % 32);
                        let seg = lane / w * w;
                        let src = match op {
                            "idx" => seg + d % w,
                            "up" if lane >= seg + d => lane - d,
                            "down" if lane + d < seg + w => lane + d,
                            // Earlier segments may be read, later ones not.
                            "xor" if (lane ^ d) < seg + w => lane ^ d,
                            _ => lane,
                        };
                        assert_eq!(
                            out[k * n + tid],
                            1000 + (warp + src) as i32,
                            "{op} width {w} offset {d} thread {tid}"
                        );
                    }
                    k += 1;
                }
            }
        }
    }

    #[test]
    fn warp_votes_64_bit_shuffles_and_half_warp_sums() {
        let Some(emu) = test_emulator() else { return };
        let mut sums = vec![0f64; 64];
        let mut votes = vec![0u32; 3 * 64];
        let mut halves = vec![0f32; 64];
        let a = Args::new().ptr(&mut sums).ptr(&mut votes).ptr(&mut halves);
        launch(emu, "warp_misc", 1, 64, 0, a).unwrap();
        for tid in 0..64usize {
            let warp = tid / 32 * 32;
            // Every lane ends with the warp's sum, in the butterfly's order.
            let mut v: Vec<f64> = (0..32).map(|l| 0.5 * (warp + l) as f64 + 1e10).collect();
            for w in [16, 8, 4, 2, 1] {
                v = (0..32).map(|l| v[l] + v[l ^ w]).collect();
            }
            assert_eq!(sums[tid].to_bits(), v[tid % 32].to_bits(), "thread {tid}");
            let ballot = (0..32)
                .filter(|l| (warp + l) % 3 == 0)
                .fold(0u32, |m, l| m | 1 << l);
            assert_eq!(votes[3 * tid], ballot, "ballot, thread {tid}");
            let half: Vec<usize> = (tid / 16 * 16..tid / 16 * 16 + 16).collect();
            assert_eq!(
                votes[3 * tid + 1],
                half.contains(&20) as u32,
                "any, thread {tid}"
            );
            assert_eq!(
                votes[3 * tid + 2],
                half.iter().all(|&t| t < 20) as u32,
                "all, {tid}"
            );
            let lanes: Vec<f32> = half.iter().map(|&t| t as f32).collect();
            let mut h = lanes.clone();
            for w in [8, 4, 2, 1] {
                h = (0..16).map(|l| h[l] + h[l ^ w]).collect();
            }
            assert_eq!(halves[tid], h[tid % 16], "half_sum, thread {tid}");
        }
    }

    #[test]
    fn syncthreads_is_a_barrier_for_static_and_dynamic_shared_memory() {
        let Some(emu) = test_emulator() else { return };
        for (kernel, block, shared) in [
            ("reverse_block", 1024u32, 0u32),
            ("reverse_block", 96, 0),
            ("reverse_dynamic", 1024, 4096),
            ("reverse_dynamic", 40, 160),
        ] {
            let blocks = 3usize;
            let n = blocks * block as usize;
            let mut input: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let mut out = vec![f32::NAN; n];
            let a = Args::new().ptr(&mut out).ptr(&mut input);
            launch(emu, kernel, blocks as u32, block, shared, a).unwrap();
            for (i, v) in out.iter().enumerate() {
                let (blk, t) = (i / block as usize, i % block as usize);
                let want = (blk * block as usize + block as usize - 1 - t) as f32;
                assert_eq!(*v, want, "{kernel} block {block}: out[{i}]");
            }
        }
    }

    #[test]
    fn exited_threads_count_as_arrived_at_syncthreads() {
        let Some(emu) = test_emulator() else { return };
        for (block, k) in [(256u32, 100i32), (64, 64), (64, 1), (1, 1), (1024, 777)] {
            let mut out = vec![-1i32; 3];
            let a = Args::new().ptr(&mut out).arg(k);
            launch(emu, "barrier_counts", 2, block, 0, a).unwrap();
            let count = (0..k).filter(|t| t % 3 == 0).count() as i32;
            assert_eq!(out, vec![count, 1, (k > 5) as i32], "block {block}, k {k}");
        }
    }

    #[test]
    fn three_dimensional_launches_number_every_thread() {
        let Some(emu) = test_emulator() else { return };
        let (grid, block) = ((2u32, 3u32, 2u32), (4u32, 2u32, 3u32));
        let total = (grid.0 * grid.1 * grid.2 * block.0 * block.1 * block.2) as usize;
        let mut out = vec![u32::MAX; 6 * total];
        let mut args = Args::new().ptr(&mut out);
        let mut params = args.params();
        unsafe { emu.launch("indices", grid, block, 0, &mut params) }.unwrap();
        let mut g = 0;
        for bz in 0..grid.2 {
            for by in 0..grid.1 {
                for bx in 0..grid.0 {
                    for tz in 0..block.2 {
                        for ty in 0..block.1 {
                            for tx in 0..block.0 {
                                assert_eq!(&out[6 * g..6 * g + 6], &[tx, ty, tz, bx, by, bz]);
                                g += 1;
                            }
                        }
                    }
                }
            }
        }
    }

    /// f64 to bf16 rounded once to nearest even (`half`'s `from_f64` first drops the low
    /// 32 bits of the f64, which can turn a value just above a tie into a tie).
    fn bf16_of_f64(d: f64) -> bf16 {
        let e = ((d.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        let ulp = 2f64.powi(e.max(-126) - 7);
        let v = (d / ulp).round_ties_even() * ulp;
        if v.abs() > f32::from_bits(0x7f7f_0000) as f64 {
            bf16::from_f32(if v > 0.0 {
                f32::INFINITY
            } else {
                f32::NEG_INFINITY
            })
        } else {
            bf16::from_f32(v as f32)
        }
    }

    #[test]
    fn bf16_rounding_and_fused_multiply_add_are_the_hosts() {
        let Some(emu) = test_emulator() else { return };
        let mut rng = Rng::new(12);
        let mut x: Vec<f32> = (0..4000)
            .map(|_| f32::from_bits(rng.next_u64() as u32))
            .collect();
        x.extend(random(4000, 10.0, 13));
        // Ties, either side of them, the largest values, NaNs with payloads.
        for bits in [
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f7f_8000,
            0x7fc0_0001,
            0xff80_0001,
            0x7f80_0000,
            0x0000_8000,
            0x8000_0001,
        ] {
            x.push(f32::from_bits(bits));
        }
        let n = x.len();
        let mut xd: Vec<f64> = (0..n)
            .map(|i| {
                let v = x[i] as f64;
                if v.is_finite() {
                    v * (1.0 + (i % 7) as f64 * 1e-9)
                } else {
                    v
                }
            })
            .collect();
        let mut to_bf16_bits = vec![0u16; n];
        let mut from_f64 = vec![0u16; n];
        let mut widened = vec![0f32; n];
        let mut products = vec![0f32; 2 * n];
        let a = Args::new()
            .ptr(&mut to_bf16_bits)
            .ptr(&mut from_f64)
            .ptr(&mut widened)
            .ptr(&mut products)
            .ptr(&mut x)
            .ptr(&mut xd)
            .arg(n as i64);
        launch(emu, "conversions", 4, 256, 0, a).unwrap();
        for i in 0..n {
            assert_eq!(
                to_bf16_bits[i],
                bf16::from_f32(x[i]).to_bits(),
                "bf16 of {:#010x}",
                x[i].to_bits()
            );
            if !xd[i].is_nan() {
                assert_eq!(
                    from_f64[i],
                    bf16_of_f64(xd[i]).to_bits(),
                    "bf16 of {:e}",
                    xd[i]
                );
            }
            let w = bf16::from_bits(i as u16).to_f32();
            assert!(widened[i].to_bits() == w.to_bits() || w.is_nan() && widened[i].is_nan());
            let (a, b, c) = (x[i], x[(i + 1) % n], x[(i + 2) % n]);
            let (two, one) = (a * b + c, a.mul_add(b, c));
            assert!(
                products[2 * i].to_bits() == two.to_bits() || two.is_nan(),
                "a * b + c at {i}"
            );
            assert!(
                products[2 * i + 1].to_bits() == one.to_bits() || one.is_nan(),
                "fmaf at {i}"
            );
        }
    }

    #[test]
    fn deadlocks_divergence_and_traps_are_errors_and_later_launches_still_run() {
        let Some(emu) = test_emulator() else { return };
        let mut out = vec![0i32; 64];
        let err = launch(emu, "deadlock", 1, 32, 0, Args::new().ptr(&mut out)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("deadlock") && msg.contains("__syncthreads"),
            "{msg}"
        );
        assert!(
            msg.contains("__syncwarp") && msg.contains("emulator_test.cu"),
            "{msg}"
        );
        let err = launch(emu, "divergent", 1, 32, 0, Args::new().ptr(&mut out)).unwrap_err();
        assert!(err.to_string().contains("divergent __syncthreads"), "{err}");
        let mut f = vec![0f32; 32];
        let err = launch(emu, "reads_exited", 1, 32, 0, Args::new().ptr(&mut f)).unwrap_err();
        assert!(
            err.to_string().contains("reads lane 3, which has exited"),
            "{err}"
        );
        let err = launch(emu, "traps", 2, 32, 0, Args::new().ptr(&mut out)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("__trap") && msg.contains("block (1, 0, 0)"),
            "{msg}"
        );
        assert!(msg.contains("thread (7, 0, 0)"), "{msg}");
        // Bad launches.
        let err = launch(emu, "traps", 1, 1025, 0, Args::new().ptr(&mut out)).unwrap_err();
        assert!(err.to_string().contains("1024"), "{err}");
        let err = launch(emu, "traps", 0, 32, 0, Args::new().ptr(&mut out)).unwrap_err();
        assert!(err.to_string().contains("at least 1"), "{err}");
        let err = launch(emu, "traps", 1, 32, 0, Args::new()).unwrap_err();
        assert!(err.to_string().contains("takes 1 arguments"), "{err}");
        // The fibers left in the middle of those launches start afresh.
        let mut input: Vec<f32> = (0..1024).map(|i| i as f32).collect();
        let mut rev = vec![0f32; 1024];
        let a = Args::new().ptr(&mut rev).ptr(&mut input);
        launch(emu, "reverse_block", 1, 1024, 0, a).unwrap();
        assert!(rev.iter().enumerate().all(|(i, v)| *v == (1023 - i) as f32));
    }

    #[test]
    fn launches_from_several_threads_run_side_by_side() {
        let Some(emu) = test_emulator() else { return };
        std::thread::scope(|s| {
            for t in 0..3u32 {
                s.spawn(move || {
                    for round in 0..20u32 {
                        let n = 512usize;
                        let mut input: Vec<f32> = (0..n)
                            .map(|i| (i as u32 * 7 + t * 1000 + round) as f32)
                            .collect();
                        let mut out = vec![0f32; n];
                        let a = Args::new().ptr(&mut out).ptr(&mut input);
                        launch(emu, "reverse_block", 2, 256, 0, a).unwrap();
                        for i in 0..n {
                            assert_eq!(out[i], input[i / 256 * 256 + 255 - i % 256]);
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn every_kernel_of_every_file_is_loaded() {
        let Some(emu) = emulator() else { return };
        for file in kernel_files() {
            for k in file.kernels {
                assert!(emu.has_kernel(k), "{k}");
                // An output and something to compute it from (a table by value counts one).
                assert!(emu.arity(k).unwrap() >= 2, "{k}");
            }
        }
        assert_eq!(emu.arity("gelu_f32"), Some(3));
        assert_eq!(emu.arity("adamw_bf16_bf16"), Some(14));
        assert_eq!(emu.arity("adamw8bit_f32_f16"), Some(16));
        assert_eq!(emu.arity("sum_squares_multi_bf16"), Some(2));
    }

    #[test]
    fn a_wide_launch_is_quick() {
        let Some(emu) = emulator() else { return };
        let n = 64 * 256;
        let mut x = vec![0f32; n];
        let start = std::time::Instant::now();
        let a = Args::new().ptr(&mut x).arg(1.5f32).arg(n as i64);
        launch(emu, "fill_f32", 64, 256, 0, a).unwrap();
        let elapsed = start.elapsed();
        assert!(x.iter().all(|v| *v == 1.5));
        eprintln!("fill_f32, 64 blocks of 256 threads: {elapsed:.2?}");
    }

    #[test]
    fn an_unknown_kernel_is_an_error_naming_it() {
        let Some(emu) = emulator() else { return };
        let err = launch(emu, "gelu_f64", 1, 32, 0, Args::new()).unwrap_err();
        assert!(err.to_string().contains("`gelu_f64`"), "{err}");
        assert!(err.to_string().contains("cuda-emulator"), "{err}");
    }

    #[test]
    fn a_missing_compiler_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("trainkit-emu-nocxx-{}", std::process::id()));
        let missing = OsStr::new("/nonexistent/trainkit-no-such-c++");
        let err = Compiler::detect(missing, true)
            .and_then(|c| build(&dir, &c, &trainkit_sources()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no C++ compiler found"), "{err}");
        assert!(err.contains("/nonexistent/trainkit-no-such-c++"), "{err}");
        assert!(
            err.contains("$CXX") && err.contains("apt-get install g++"),
            "{err}"
        );
        assert!(!dir.exists(), "nothing is built without a compiler");
    }

    #[test]
    fn extern_shared_declarations_become_pointers_to_the_dynamic_buffer() {
        let src = "a\n    extern __shared__ __align__(16) float smem[];\nb";
        let out = rewrite_extern_shared(src, "t.cu").unwrap();
        assert_eq!(
            out,
            "a\n    static thread_local float* const smem = \
             reinterpret_cast<float*>(::tk_emu::dynamic_shared_memory());\nb"
        );
        let out =
            rewrite_extern_shared("extern __shared__ unsigned char\n raw [ ];", "t.cu").unwrap();
        assert!(
            out.contains("unsigned char* const raw =") && out.ends_with(";\n"),
            "{out}"
        );
        let err = rewrite_extern_shared("extern __shared__ float *p;", "t.cu").unwrap_err();
        assert!(err.to_string().contains("t.cu"), "{err}");
    }

    #[test]
    fn the_cache_key_follows_sources_and_compiler() {
        let c = Compiler {
            program: "c++".into(),
            args: vec![],
            version: "g++ 12".to_string(),
        };
        let units = vec![("0-a.cpp".to_string(), "int a;".to_string())];
        let k = cache_key(&c, &units);
        assert_eq!(k.len(), 32);
        assert_eq!(k, cache_key(&c, &units));
        let other = vec![("0-a.cpp".to_string(), "int b;".to_string())];
        assert_ne!(k, cache_key(&c, &other));
        let newer = Compiler {
            version: "g++ 13".to_string(),
            ..c.clone()
        };
        assert_ne!(k, cache_key(&newer, &units));
    }
}
