//! The CUDA C kernel sources (kernels/*.cu, embedded in the binary) and their compilation
//! to PTX by NVRTC.
//!
//! Each file in kernels/ holds one op family; its kernels are `extern "C"` with a fixed
//! name, `<op>_<dtype>[_<dtype>...]`, which the backend loads by name. The family's host
//! code (the family's `cuda.rs`) declares the file and those names once and registers it;
//! [`kernel_files`] gathers the registrations. kernels/common.cuh
//! (loads and stores, the half-warp reductions, the CPU's `exp`) is prepended to every
//! file before compiling, with `#line` directives so NVRTC's messages name the right file
//! and line.
//!
//! NVRTC does not ship `cuda_bf16.h`: the include directory of a CUDA toolkit, or of the
//! `nvidia-cuda-runtime` pip wheel, is passed in (see [`find_include_dir`]).

use super::nvrtc::{Nvrtc, Output};
use crate::device::CustomKernel;
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Helpers shared by every kernel file (prepended to each before compiling).
pub const COMMON_SOURCE: &str = include_str!("../../../kernels/common.cuh");

/// One kernel source file: its name in kernels/, its text, and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// File name in kernels/, e.g. `gelu.cu`.
    pub name: &'static str,
    /// The file's text (without the common prelude).
    pub source: &'static str,
    /// The `extern "C"` kernel names it defines, each the `.entry` of one PTX function.
    pub kernels: &'static [&'static str],
}

impl KernelFile {
    /// The text NVRTC compiles: the common prelude, then the file, each with a `#line`
    /// directive naming it.
    pub fn full_source(&self) -> String {
        with_common(self.name, self.source)
    }
}

/// `source` (the text of file `file`) as NVRTC compiles it: the common prelude, then the
/// source, each with a `#line` directive naming it.
pub fn with_common(file: &str, source: &str) -> String {
    format!("#line 1 \"common.cuh\"\n{COMMON_SOURCE}\n#line 1 \"{file}\"\n{source}")
}

/// The text NVRTC compiles for a kernel written outside trainkit: its source, as file
/// `<name>.cu`, after the common prelude ([`with_common`]).
pub fn custom_full_source(kernel: &dyn CustomKernel) -> String {
    with_common(&format!("{}.cu", kernel.name()), kernel.source())
}

inventory::collect!(KernelFile);

/// Every kernel file of the CUDA backend, with the kernels each defines, ordered by file
/// name. Each op family registers its own file beside the code that launches it
/// (`KERNELS` in the family's `cuda.rs`, submitted with `inventory::submit!`), so the
/// backend names no family; a kernel file written outside trainkit goes through
/// [`super::CudaBackend::load_kernels`] instead.
pub fn kernel_files() -> &'static [&'static KernelFile] {
    static FILES: OnceLock<Vec<&'static KernelFile>> = OnceLock::new();
    FILES.get_or_init(|| {
        let mut files: Vec<&'static KernelFile> = inventory::iter::<KernelFile>().collect();
        files.sort_by_key(|f| f.name);
        files
    })
}

/// The kernel file named `name` (e.g. `gelu.cu`).
pub fn kernel_file(name: &str) -> Option<&'static KernelFile> {
    kernel_files().iter().copied().find(|f| f.name == name)
}

/// How NVRTC compiles a kernel file: the target architecture and the include directory
/// holding `cuda_bf16.h`. Everything else is fixed (see [`CompileOptions::flags`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// The target: a real architecture, `sm_XY` (`sm_90` for Hopper, `sm_80` for
    /// Ampere), for PTX and machine code; or a virtual one, `compute_XY`, for PTX alone
    /// (see [`CompileOptions::for_device`]). Always set: NVRTC's default (sm_75 in 13.0)
    /// would not use the device's features.
    pub arch: String,
    /// Directory holding `cuda_bf16.h` (see [`find_include_dir`]).
    pub include_dir: PathBuf,
}

impl CompileOptions {
    /// Options for `arch` (`sm_XY`) with headers from `include_dir`.
    pub fn new(arch: impl Into<String>, include_dir: impl Into<PathBuf>) -> Self {
        CompileOptions {
            arch: arch.into(),
            include_dir: include_dir.into(),
        }
    }

    /// Options for a device of compute capability `major.minor` (`sm_90` for 9.0).
    pub fn for_compute_capability(major: i32, minor: i32, include_dir: impl Into<PathBuf>) -> Self {
        Self::new(format!("sm_{major}{minor}"), include_dir)
    }

    /// Options for a device of compute capability `cc` when NVRTC makes machine code for
    /// the real architectures `supported` (`XY` numbers, as
    /// [`Nvrtc::supported_archs`] gives them): the device's own `sm_XY` when NVRTC knows
    /// it (or does not say), else PTX for the newest virtual architecture it knows,
    /// `compute_XY`, which the driver assembles for the device when it loads it.
    pub fn for_device(cc: (i32, i32), supported: &[i32], include_dir: impl Into<PathBuf>) -> Self {
        let own = cc.0 * 10 + cc.1;
        match supported.iter().copied().filter(|&a| a <= own).max() {
            Some(a) if a != own => Self::new(format!("compute_{a}"), include_dir),
            _ => Self::for_compute_capability(cc.0, cc.1, include_dir),
        }
    }

    /// Whether the target is a real architecture (`sm_XY`), for which NVRTC also makes
    /// machine code.
    pub fn is_real(&self) -> bool {
        self.arch.starts_with("sm_")
    }

    /// The NVRTC command-line options, in order; also part of the cache key.
    ///
    /// Fast math stays off, and `--fmad=false` keeps NVRTC from fusing `a * b + c` into
    /// one rounding: every kernel then rounds where its CPU twin rounds (Rust never fuses
    /// on its own), IEEE division and square root included, so element-wise ops, AdamW,
    /// GELU, layer norm and the softmaxes give the CPU's results bit for bit, and the
    /// parity tests can be strict. A kernel that wants a fused multiply-add (the
    /// products in attention) asks for it with `fmaf`. Denormals are kept (`--ftz=false`)
    /// as on the CPU.
    pub fn flags(&self) -> Vec<String> {
        vec![
            format!("--gpu-architecture={}", self.arch),
            format!("--include-path={}", self.include_dir.display()),
            "-std=c++17".to_string(),
            "--fmad=false".to_string(),
            "--ftz=false".to_string(),
            "--prec-div=true".to_string(),
            "--prec-sqrt=true".to_string(),
        ]
    }

    fn check_arch(&self) -> Result<()> {
        let digits = self
            .arch
            .strip_prefix("sm_")
            .or_else(|| self.arch.strip_prefix("compute_"))
            .unwrap_or("");
        if digits.len() >= 2 && digits.chars().all(|c| c.is_ascii_digit()) {
            Ok(())
        } else {
            Err(backend_error(format!(
                "`{}` is not a CUDA architecture; use sm_XY, e.g. sm_90 for Hopper or sm_80 \
                 for Ampere (or compute_XY for PTX alone)",
                self.arch
            )))
        }
    }
}

fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda",
        message: message.into(),
    }
}

/// The process's NVRTC as trainkit's error.
fn nvrtc() -> Result<&'static Nvrtc> {
    Nvrtc::get().map_err(backend_error)
}

/// The version of the NVRTC library found, `(major, minor)`: an error, not a panic, when
/// there is none.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    Ok(nvrtc()?.version())
}

/// What NVRTC made of one kernel file: the PTX, and the machine code for a real
/// architecture (`sm_XY`), which the backend loads without a second compilation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// The PTX: the fallback the driver assembles when the machine code does not load.
    pub ptx: String,
    /// The CUBIN for `sm_XY`; `None` when the target was virtual (`compute_XY`).
    pub cubin: Option<Vec<u8>>,
}

/// Compiles one CUDA C source with NVRTC: PTX, and machine code when `options.arch` is
/// a real architecture.
///
/// Returns an error (never panics) when NVRTC is missing, naming how to install it, and
/// NVRTC's log when the source does not compile.
pub fn compile(source: &str, options: &CompileOptions) -> Result<Compiled> {
    run_nvrtc(source, options, false).map(|o| Compiled {
        ptx: o.ptx,
        cubin: o.cubin,
    })
}

fn run_nvrtc(source: &str, options: &CompileOptions, verbose: bool) -> Result<Output> {
    options.check_arch()?;
    if source.contains('\0') {
        return Err(backend_error("a kernel source contains a NUL byte"));
    }
    let mut flags = options.flags();
    if verbose {
        flags.push("--ptxas-options=--verbose".to_string());
    }
    nvrtc()?
        .compile(source, "kernel.cu", &flags)
        .map_err(|log| {
            backend_error(format!(
                "NVRTC could not compile for {}:\n{}",
                options.arch, log
            ))
        })
}

/// One kernel's resources as ptxas assigned them for an architecture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel (`.entry`) name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per block, in bytes.
    pub shared_bytes: u64,
    /// Stack frame per thread, in bytes (local arrays and spills).
    pub stack_bytes: u64,
    /// Bytes of registers spilled to local memory, stored and loaded.
    pub spill_stores: u64,
    /// See `spill_stores`.
    pub spill_loads: u64,
}

/// A kernel file compiled through ptxas to machine code: the PTX, the CUBIN and each
/// kernel's resources.
#[derive(Clone, Debug)]
pub struct Assembly {
    /// The PTX (the fallback the driver assembles when the machine code does not load).
    pub ptx: String,
    /// The machine code for the architecture (what the backend loads).
    pub cubin: Vec<u8>,
    /// Per kernel, as ptxas reported them.
    pub kernels: Vec<KernelResources>,
}

/// Compiles one CUDA C source as [`compile`] does, for a real architecture, with
/// ptxas's report of each kernel's registers, shared memory, stack and spills. Needs no
/// GPU: the machine code is what the backend loads on the device, so its resources can be
/// checked before it runs.
pub fn assemble(source: &str, options: &CompileOptions) -> Result<Assembly> {
    let out = run_nvrtc(source, options, true)?;
    let cubin = out.cubin.ok_or_else(|| {
        backend_error(format!(
            "NVRTC gave no machine code for {}: assemble needs a real architecture (sm_XY)",
            options.arch
        ))
    })?;
    Ok(Assembly {
        ptx: out.ptx,
        cubin,
        kernels: ptxas_resources(&out.log),
    })
}

/// Each kernel's resources from ptxas's `--verbose` report, in the order it reports them.
pub fn ptxas_resources(log: &str) -> Vec<KernelResources> {
    let mut kernels: Vec<KernelResources> = Vec::new();
    // The number before `unit` in `text` (e.g. `18432 bytes smem`).
    let number_before = |text: &str, unit: &str| -> Option<u64> {
        let at = text.find(unit)?;
        text[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            kernels.push(KernelResources {
                name: name.to_string(),
                ..KernelResources::default()
            });
        } else if let Some(k) = kernels.last_mut() {
            if line.contains("bytes stack frame") {
                k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used ") && line.contains(" registers") {
                k.registers = number_before(line, " registers").unwrap_or(0) as u32;
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    kernels
}

/// The `.version` of a PTX module, `(major, minor)`: a driver loads PTX up to the version
/// its CUDA release knows (9.0 for the 580 drivers of CUDA 13.0).
pub fn ptx_version(ptx: &str) -> Option<(u32, u32)> {
    ptx.lines().find_map(|line| {
        let v = line.trim().strip_prefix(".version")?.trim();
        let (major, minor) = v.split_once('.')?;
        Some((major.parse().ok()?, minor.trim().parse().ok()?))
    })
}

/// The names of the kernels (`.entry` functions) a PTX module defines, in order.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|line| {
            let rest = line.trim().split(".entry ").nth(1)?;
            let name = rest.split(['(', ' ']).next()?;
            Some(name.to_string())
        })
        .collect()
}

/// The environment variable that names the CUDA include directory explicitly.
pub const INCLUDE_ENV: &str = "TRAINKIT_CUDA_INCLUDE";

/// The header that must be found (NVRTC has no built-in copy).
const BF16_HEADER: &str = "cuda_bf16.h";

/// The directory holding `cuda_bf16.h`, for [`CompileOptions::include_dir`].
///
/// Looks, in order, in:
/// 1. `$TRAINKIT_CUDA_INCLUDE` (when set, it must hold the header);
/// 2. `$CUDA_HOME/include`, then `$CUDA_PATH/include`;
/// 3. `/usr/local/cuda/include`;
/// 4. `nvidia/cu13/include` beside each `LD_LIBRARY_PATH` entry that ends in
///    `nvidia/cu13/lib` (where the pip wheels put libnvrtc);
/// 5. `nvidia/cu13/include` in the site-packages directories `python3` reports (one
///    short `python3 -c` run, only when everything above failed).
///
/// Fails with the places it looked and how to point at the headers.
pub fn find_include_dir() -> Result<PathBuf> {
    find_include_dir_with(&|name| std::env::var_os(name), true)
}

/// [`find_include_dir`] with the environment given by `env`, asking `python3` only when
/// `ask_python` is set.
pub(crate) fn find_include_dir_with(
    env: &dyn Fn(&str) -> Option<OsString>,
    ask_python: bool,
) -> Result<PathBuf> {
    let has_header = |dir: &Path| dir.join(BF16_HEADER).is_file();
    if let Some(dir) = env(INCLUDE_ENV).filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        return if has_header(&dir) {
            Ok(dir)
        } else {
            Err(backend_error(format!(
                "{INCLUDE_ENV}={} holds no {BF16_HEADER}: point it at a CUDA include \
                 directory (a toolkit's include/, or site-packages/nvidia/cu13/include of \
                 the `nvidia-cuda-runtime==13.0.*` pip wheel)",
                dir.display()
            )))
        };
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env(var).filter(|v| !v.is_empty()) {
            candidates.push(PathBuf::from(root).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Some(paths) = env("LD_LIBRARY_PATH") {
        for lib in std::env::split_paths(&paths) {
            if lib.ends_with("nvidia/cu13/lib") {
                if let Some(root) = lib.parent() {
                    candidates.push(root.join("include"));
                }
            }
        }
    }
    if let Some(found) = candidates.iter().find(|d| has_header(d)) {
        return Ok(found.clone());
    }
    if ask_python {
        for site in python_site_packages() {
            let dir = site.join("nvidia/cu13/include");
            if has_header(&dir) {
                return Ok(dir);
            }
            candidates.push(dir);
        }
    }
    let looked: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
    Err(backend_error(format!(
        "{BF16_HEADER} was not found (looked in {}): set {INCLUDE_ENV} to a CUDA include \
         directory, a toolkit's include/ or site-packages/nvidia/cu13/include of the pip \
         wheel (`python3 -m pip install 'nvidia-cuda-runtime==13.0.*'`)",
        looked.join(", ")
    )))
}

/// The site-packages directories of `python3`, if it runs.
fn python_site_packages() -> Vec<PathBuf> {
    let script = "import site\n\
                  paths = list(site.getsitepackages()) + [site.getusersitepackages()]\n\
                  print('\\n'.join(paths))";
    match std::process::Command::new("python3")
        .args(["-c", script])
        .stderr(std::process::Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| PathBuf::from(l.trim()))
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_read_per_kernel() {
        let log = "ptxas info    : 3 bytes gmem
ptxas info    : Compiling entry function 'flash_attention_backward_dkv_f32' for 'sm_80'
ptxas info    : Function properties for flash_attention_backward_dkv_f32
ptxas         .     32 bytes stack frame, 32 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 32 bytes cumulative stack size, 46336 bytes smem, 436 bytes cmem[0]
ptxas info    : Compile time = 151.717 ms
ptxas info    : Compiling entry function 'gelu_f32' for 'sm_80'
ptxas info    : Function properties for gelu_f32
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 380 bytes cmem[0]
";
        assert_eq!(
            ptxas_resources(log),
            vec![
                KernelResources {
                    name: "flash_attention_backward_dkv_f32".into(),
                    registers: 168,
                    shared_bytes: 46336,
                    stack_bytes: 32,
                    spill_stores: 32,
                    spill_loads: 28,
                },
                KernelResources {
                    name: "gelu_f32".into(),
                    registers: 30,
                    ..KernelResources::default()
                },
            ]
        );
    }
    use std::collections::{HashMap, HashSet};

    /// The kernels' column sums add the CPU's blocks of rows, in the CPU's order: their
    /// block is the CPU's `ROW_BLOCK`.
    #[test]
    fn the_kernels_sum_columns_in_the_cpus_row_blocks() {
        let define = COMMON_SOURCE
            .lines()
            .find_map(|l| l.strip_prefix("#define TK_GRAD_ROW_BLOCK "))
            .expect("common.cuh defines TK_GRAD_ROW_BLOCK");
        assert_eq!(
            define.trim().parse::<usize>().unwrap(),
            crate::device::cpu::elementwise::ROW_BLOCK
        );
    }

    #[test]
    fn kernel_names_are_unique_and_follow_the_naming_scheme() {
        let mut seen = HashSet::new();
        for file in kernel_files() {
            assert!(!file.kernels.is_empty(), "{} defines no kernel", file.name);
            for k in file.kernels {
                assert!(seen.insert(*k), "kernel {k} is listed twice");
                // Every name appears in its file, whole or as a macro's prefix.
                let mut stem = *k;
                for _ in 0..3 {
                    // Dtypes, and the tensor-core attention's tilings and head sizes.
                    for suffix in [
                        "_bf16m", "_f32", "_bf16", "_f16", "_wide", "_narrow", "_d64", "_d80",
                        "_d96", "_d128",
                    ] {
                        stem = stem.trim_end_matches(suffix);
                    }
                }
                assert!(
                    file.source.contains(stem),
                    "{}: no trace of {k} ({stem})",
                    file.name
                );
            }
        }
        assert_eq!(seen.len(), 247);
    }

    #[test]
    fn every_source_is_prefixed_by_the_common_helpers() {
        let f = kernel_file("gelu.cu").unwrap();
        let s = f.full_source();
        assert!(s.starts_with("#line 1 \"common.cuh\"\n"));
        assert!(s.contains("#line 1 \"gelu.cu\"\n"));
        assert!(s.contains("#include <cuda_bf16.h>"));
        assert!(kernel_file("nope.cu").is_none());
    }

    #[test]
    fn options_always_name_the_architecture_and_keep_fast_math_off() {
        let o = CompileOptions::for_compute_capability(9, 0, "/inc");
        assert_eq!(o.arch, "sm_90");
        let flags = o.flags();
        assert_eq!(flags[0], "--gpu-architecture=sm_90");
        assert!(flags.contains(&"--include-path=/inc".to_string()));
        assert!(flags.contains(&"--fmad=false".to_string()));
        assert!(!flags.iter().any(|f| f.contains("fast")));
        assert!(CompileOptions::new("sm_80", "/inc").check_arch().is_ok());
        let err = CompileOptions::new("hopper", "/inc")
            .check_arch()
            .unwrap_err();
        assert!(err.to_string().contains("sm_90"), "{err}");
    }

    #[test]
    fn a_device_nvrtc_does_not_know_gets_ptx_for_the_newest_it_knows() {
        let known = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(
            CompileOptions::for_device((9, 0), &known, "/i").arch,
            "sm_90"
        );
        assert_eq!(
            CompileOptions::for_device((8, 6), &known, "/i").arch,
            "sm_86"
        );
        let newer = CompileOptions::for_device((13, 0), &known, "/i");
        assert_eq!(newer.arch, "compute_120");
        assert!(!newer.is_real() && newer.check_arch().is_ok());
        assert_eq!(
            CompileOptions::for_device((8, 7), &known, "/i").arch,
            "compute_86"
        );
        // An NVRTC that does not list its architectures: the device's own.
        assert_eq!(CompileOptions::for_device((9, 0), &[], "/i").arch, "sm_90");
    }

    #[test]
    fn ptx_headers_are_parsed() {
        let ptx = "//\n.version 9.0\n.target sm_90\n.address_size 64\n\n\
                   .visible .entry gelu_f32(\n\t.param .u64 a\n)\n{\n}\n\
                   .visible .entry sum_squares_finish(\n)\n";
        assert_eq!(ptx_version(ptx), Some((9, 0)));
        assert_eq!(ptx_entries(ptx), vec!["gelu_f32", "sum_squares_finish"]);
        assert_eq!(ptx_version("nothing"), None);
    }

    /// A directory `<tmp>/trainkit-<tag>-<pid>` holding `include/cuda_bf16.h`.
    fn fake_root(tag: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("trainkit-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(root.join("include")).unwrap();
        std::fs::write(root.join("include").join(BF16_HEADER), "// test").unwrap();
        root
    }

    fn env_of(pairs: Vec<(&'static str, OsString)>) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<&str, OsString> = pairs.into_iter().collect();
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn include_dir_discovery_follows_its_order() {
        let explicit = fake_root("explicit").join("include");
        let home = fake_root("home");
        let path = fake_root("path");
        let wheel = fake_root("wheel").join("nvidia/cu13");
        std::fs::create_dir_all(wheel.join("include")).unwrap();
        std::fs::create_dir_all(wheel.join("lib")).unwrap();
        std::fs::write(wheel.join("include").join(BF16_HEADER), "// test").unwrap();
        let ld_path =
            std::env::join_paths([Path::new("/nonexistent"), &wheel.join("lib")]).unwrap();

        // The explicit variable wins over everything.
        let env = env_of(vec![
            (INCLUDE_ENV, explicit.clone().into()),
            ("CUDA_HOME", home.clone().into()),
        ]);
        assert_eq!(find_include_dir_with(&env, false).unwrap(), explicit);
        // A wrong explicit directory is an error naming the variable.
        let env = env_of(vec![
            (INCLUDE_ENV, "/nonexistent/include".into()),
            ("CUDA_HOME", home.clone().into()),
        ]);
        let err = find_include_dir_with(&env, false).unwrap_err().to_string();
        assert!(err.contains(INCLUDE_ENV), "{err}");
        // CUDA_HOME, then CUDA_PATH, before the pip wheel.
        let env = env_of(vec![
            ("CUDA_HOME", home.clone().into()),
            ("CUDA_PATH", path.clone().into()),
            ("LD_LIBRARY_PATH", ld_path.clone()),
        ]);
        assert_eq!(
            find_include_dir_with(&env, false).unwrap(),
            home.join("include")
        );
        let env = env_of(vec![
            ("CUDA_HOME", "/nonexistent".into()),
            ("CUDA_PATH", path.clone().into()),
        ]);
        assert_eq!(
            find_include_dir_with(&env, false).unwrap(),
            path.join("include")
        );
        if !Path::new("/usr/local/cuda/include")
            .join(BF16_HEADER)
            .is_file()
        {
            // The pip wheel beside LD_LIBRARY_PATH.
            let env = env_of(vec![("LD_LIBRARY_PATH", ld_path.clone())]);
            assert_eq!(
                find_include_dir_with(&env, false).unwrap(),
                wheel.join("include")
            );
            // Nothing anywhere: the error says what to set.
            let err = find_include_dir_with(&env_of(vec![]), false)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(INCLUDE_ENV) && err.contains(BF16_HEADER),
                "{err}"
            );
        }
        let wheel_root = wheel.parent().unwrap().parent().unwrap();
        for root in [explicit.parent().unwrap(), &home, &path, wheel_root] {
            let _ = std::fs::remove_dir_all(root);
        }
    }

    #[test]
    fn compile_refuses_a_bad_architecture_before_touching_nvrtc() {
        let err = compile("", &CompileOptions::new("90", "/inc")).unwrap_err();
        assert!(err.to_string().contains("not a CUDA architecture"), "{err}");
    }
}
