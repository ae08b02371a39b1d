//! Compiled kernels cached on disk, so NVRTC runs once per kernel file, architecture,
//! NVRTC and driver version rather than at every start.
//!
//! An entry holds what NVRTC made of one file ([`Compiled`]): the machine code (CUBIN),
//! which the backend loads as is, and the PTX, its fallback. It is named
//! `<file stem>-<key>.module`, where the key is a 128-bit FNV-1a hash of the complete
//! source (common prelude included), the NVRTC flags (architecture, include directory,
//! math options), the NVRTC version and the driver's CUDA version. FNV-1a is implemented
//! here, so keys do not change with the Rust version (std's `DefaultHasher` may) or a
//! crate's release; it is not a cryptographic hash, which a private cache does not need.
//!
//! The entry's layout: the line `trainkit-module v2`, the PTX's length (u64, little
//! endian) and bytes, the CUBIN's length (0 for none) and bytes, then a 128-bit FNV-1a
//! checksum (little endian) of everything before it. An entry that is truncated, altered
//! or unreadable is compiled again and rewritten, never an error. Entries are written
//! atomically ([`write_atomically`]), so concurrent processes at worst both compile.
//!
//! The directory is `$TRAINKIT_CACHE_DIR` when set, else `$XDG_CACHE_HOME/trainkit/kernels`,
//! else `~/.cache/trainkit/kernels`. The products' cuBLASLt algorithms chosen by timing
//! are saved there too (`CudaOptions::tune_products`).

use super::kernels::{self, CompileOptions, Compiled, KernelFile};
use crate::error::Result;
use crate::save::write_atomically;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Whether [`KernelCache::get_or_compile`] found the module or compiled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// A valid entry was on disk.
    Hit,
    /// The module was compiled (no entry, or a corrupt one) and stored.
    Compiled,
}

/// The versions a compiled module depends on besides its source and flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Versions {
    /// NVRTC's `(major, minor)`.
    pub nvrtc: (i32, i32),
    /// The driver's CUDA version (13000 for 13.0); 0 where there is no driver.
    pub driver: i32,
}

/// A directory of compiled kernels, keyed by source, options, NVRTC and driver version.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

/// Environment variable naming the cache directory.
pub const CACHE_ENV: &str = "TRAINKIT_CACHE_DIR";

/// The first line of every entry.
const MAGIC: &[u8] = b"trainkit-module v2\n";

impl KernelCache {
    /// A cache in `dir` (created when the first entry is written).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// The cache in the default directory (see the module documentation), or `None` when
    /// neither `TRAINKIT_CACHE_DIR`, `XDG_CACHE_HOME` nor `HOME` is set.
    pub fn in_default_dir() -> Option<Self> {
        default_dir_with(&|name| std::env::var_os(name)).map(Self::new)
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of `source` compiled with `options` under `versions`: 32 hex digits.
    pub fn key(source: &str, options: &CompileOptions, versions: Versions) -> String {
        let mut h = Fnv128::new();
        h.field(b"trainkit kernel cache v2");
        h.field(source.as_bytes());
        for flag in options.flags() {
            h.field(flag.as_bytes());
        }
        let (major, minor) = versions.nvrtc;
        h.field(format!("nvrtc {major}.{minor}").as_bytes());
        h.field(format!("driver {}", versions.driver).as_bytes());
        format!("{:032x}", h.finish())
    }

    /// Where the entry for kernel file `file` (e.g. `gelu.cu`) with `key` lives.
    pub fn entry_path(&self, file: &str, key: &str) -> PathBuf {
        let stem = file.strip_suffix(".cu").unwrap_or(file);
        self.dir.join(format!("{stem}-{key}.module"))
    }

    /// The compiled `source` for `options`: from the cache when a valid entry exists, else
    /// from `compile` (then stored). Only `compile`'s errors are returned; cache trouble
    /// (an unreadable or corrupt entry, a directory that cannot be written) is logged and
    /// worked around.
    pub fn get_or_compile(
        &self,
        file: &str,
        source: &str,
        options: &CompileOptions,
        versions: Versions,
        compile: impl FnOnce(&str, &CompileOptions) -> Result<Compiled>,
    ) -> Result<(Compiled, CacheOutcome)> {
        let path = self.entry_path(file, &Self::key(source, options, versions));
        match std::fs::read(&path) {
            Ok(bytes) => match decode_entry(&bytes) {
                Some(module) => return Ok((module, CacheOutcome::Hit)),
                None => log::warn!(
                    "kernel cache entry {} is corrupt: compiling {file} again",
                    path.display()
                ),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!(
                "kernel cache entry {} is unreadable ({e}): compiling {file} again",
                path.display()
            ),
        }
        let module = compile(source, options)?;
        let stored = std::fs::create_dir_all(&self.dir)
            .map_err(|e| crate::error::Error::io(&self.dir, e))
            .and_then(|()| write_atomically(&path, &encode_entry(&module)));
        if let Err(e) = stored {
            log::warn!("could not store compiled {file} in the kernel cache: {e}");
        }
        Ok((module, CacheOutcome::Compiled))
    }

    /// A kernel file compiled for `options`, through the cache and NVRTC, for a driver of
    /// CUDA version `driver` (0 where there is none).
    pub fn module(
        &self,
        file: &KernelFile,
        options: &CompileOptions,
        driver: i32,
    ) -> Result<Compiled> {
        self.compiled(file.name, &file.full_source(), options, driver)
    }

    /// [`KernelCache::module`] for the file named `file` whose complete source (common
    /// prelude included) is `source`: a kernel file written outside trainkit.
    pub fn compiled(
        &self,
        file: &str,
        source: &str,
        options: &CompileOptions,
        driver: i32,
    ) -> Result<Compiled> {
        let versions = Versions {
            nvrtc: kernels::nvrtc_version()?,
            driver,
        };
        self.get_or_compile(file, source, options, versions, kernels::compile)
            .map(|(module, _)| module)
    }
}

/// The default cache directory, with the environment given by `env`.
fn default_dir_with(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(CACHE_ENV) {
        return Some(dir);
    }
    // The XDG spec ignores relative values.
    if let Some(xdg) = set("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(xdg.join("trainkit").join("kernels"));
    }
    set("HOME").map(|home| home.join(".cache").join("trainkit").join("kernels"))
}

/// The entry's bytes (see the module documentation).
fn encode_entry(module: &Compiled) -> Vec<u8> {
    let cubin = module.cubin.as_deref().unwrap_or(&[]);
    let mut out = Vec::with_capacity(MAGIC.len() + 32 + module.ptx.len() + cubin.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(module.ptx.len() as u64).to_le_bytes());
    out.extend_from_slice(module.ptx.as_bytes());
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(cubin);
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The module of a well-formed entry whose checksum matches.
fn decode_entry(bytes: &[u8]) -> Option<Compiled> {
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(16)?)?;
    if u128::from_le_bytes(sum.try_into().ok()?) != checksum(body) {
        return None;
    }
    let mut rest = body.strip_prefix(MAGIC)?;
    let take = |rest: &mut &[u8]| -> Option<Vec<u8>> {
        let (len, tail) = rest.split_at_checked(8)?;
        let len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
        let (field, tail) = tail.split_at_checked(len)?;
        *rest = tail;
        Some(field.to_vec())
    };
    let ptx = String::from_utf8(take(&mut rest)?).ok()?;
    let cubin = take(&mut rest)?;
    (rest.is_empty() && !ptx.is_empty()).then_some(Compiled {
        ptx,
        cubin: (!cubin.is_empty()).then_some(cubin),
    })
}

fn checksum(bytes: &[u8]) -> u128 {
    let mut h = Fnv128::new();
    h.field(bytes);
    h.finish()
}

/// 128-bit FNV-1a (offset basis and prime from the FNV specification), over fields each
/// preceded by its length so that no two field lists hash the same bytes.
struct Fnv128(u128);

impl Fnv128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;

    fn new() -> Self {
        Fnv128(Self::OFFSET)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u128;
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    fn field(&mut self, bytes: &[u8]) {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
    }

    fn finish(&self) -> u128 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn temp_cache(tag: &str) -> KernelCache {
        let dir = std::env::temp_dir().join(format!(
            "trainkit-kernel-cache-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        KernelCache::new(dir)
    }

    const PTX: &str = ".version 9.0\n.target sm_90\n.visible .entry k()\n{\n\tret;\n}\n";

    /// A compile function that counts its calls; machine code for real architectures.
    fn counting<'a>(
        calls: &'a Cell<usize>,
    ) -> impl Fn(&str, &CompileOptions) -> Result<Compiled> + 'a {
        move |src: &str, o: &CompileOptions| {
            calls.set(calls.get() + 1);
            Ok(Compiled {
                ptx: format!("{PTX}// {} {}\n", o.arch, src.len()),
                cubin: o
                    .is_real()
                    .then(|| format!("\x7fELF {}", o.arch).into_bytes()),
            })
        }
    }

    const V13: Versions = Versions {
        nvrtc: (13, 0),
        driver: 13000,
    };

    #[test]
    fn fnv128_matches_the_reference_values() {
        // FNV-1a 128 of "" and "a" from the FNV reference implementation.
        let mut h = Fnv128::new();
        h.bytes(b"");
        assert_eq!(h.finish(), 0x6c62272e07bb014262b821756295c58d);
        let mut h = Fnv128::new();
        h.bytes(b"a");
        assert_eq!(h.finish(), 0xd228cb696f1a8caf78912b704e4a8964);
    }

    #[test]
    fn a_second_request_is_a_hit() {
        let cache = temp_cache("hit");
        let calls = Cell::new(0);
        let o = CompileOptions::new("sm_90", "/inc");
        let (a, first) = cache
            .get_or_compile("gelu.cu", "src", &o, V13, counting(&calls))
            .unwrap();
        let (b, second) = cache
            .get_or_compile("gelu.cu", "src", &o, V13, counting(&calls))
            .unwrap();
        assert_eq!((first, second), (CacheOutcome::Compiled, CacheOutcome::Hit));
        assert_eq!(a, b);
        assert_eq!(calls.get(), 1);
        let key = KernelCache::key("src", &o, V13);
        assert!(cache
            .entry_path("gelu.cu", &key)
            .ends_with(format!("gelu-{key}.module")));
        assert!(a.cubin.is_some());
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn changed_source_options_or_nvrtc_miss() {
        let cache = temp_cache("miss");
        let calls = Cell::new(0);
        let o90 = CompileOptions::new("sm_90", "/inc");
        let o80 = CompileOptions::new("sm_80", "/inc");
        let other_inc = CompileOptions::new("sm_90", "/other");
        let nvrtc_13_1 = Versions {
            nvrtc: (13, 1),
            ..V13
        };
        let driver_13_1 = Versions {
            driver: 13010,
            ..V13
        };
        let ptx_only = CompileOptions::new("compute_90", "/inc");
        for (src, o, v) in [
            ("src", &o90, V13),
            ("src", &o80, V13),
            ("src", &other_inc, V13),
            ("src2", &o90, V13),
            ("src", &o90, nvrtc_13_1),
            ("src", &o90, driver_13_1),
            ("src", &ptx_only, V13),
        ] {
            let (_, outcome) = cache
                .get_or_compile("gelu.cu", src, o, v, counting(&calls))
                .unwrap();
            assert_eq!(outcome, CacheOutcome::Compiled, "{src} {o:?} {v:?}");
        }
        assert_eq!(calls.get(), 7);
        // PTX alone round-trips as PTX alone.
        let (module, outcome) = cache
            .get_or_compile("gelu.cu", "src", &ptx_only, V13, counting(&calls))
            .unwrap();
        assert_eq!((outcome, module.cubin), (CacheOutcome::Hit, None));
        let (module, outcome) = cache
            .get_or_compile("gelu.cu", "src", &o80, V13, counting(&calls))
            .unwrap();
        assert_eq!(outcome, CacheOutcome::Hit);
        assert!(module.ptx.contains("sm_80"));
        assert_eq!(module.cubin.as_deref(), Some(&b"\x7fELF sm_80"[..]));
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn a_corrupt_entry_is_compiled_again() {
        let cache = temp_cache("corrupt");
        let calls = Cell::new(0);
        let o = CompileOptions::new("sm_90", "/inc");
        let (good, _) = cache
            .get_or_compile("adamw.cu", "src", &o, V13, counting(&calls))
            .unwrap();
        let path = cache.entry_path("adamw.cu", &KernelCache::key("src", &o, V13));
        let full = std::fs::read(&path).unwrap();
        let corruptions: Vec<Vec<u8>> = vec![
            full[..full.len() / 2].to_vec(),         // truncated
            full.iter().map(|b| b ^ 0x20).collect(), // altered
            vec![0xff, 0xfe, 0x00],                  // garbage
            Vec::new(),                              // empty
            full[..full.len() - 16].to_vec(),        // no checksum
            {
                // A well-formed checksum over a wrong layout.
                let mut b = b"trainkit-module v1\n".to_vec();
                b.extend_from_slice(&checksum(&b).to_le_bytes());
                b
            },
        ];
        for (i, bad) in corruptions.into_iter().enumerate() {
            std::fs::write(&path, bad).unwrap();
            let (module, outcome) = cache
                .get_or_compile("adamw.cu", "src", &o, V13, counting(&calls))
                .unwrap();
            assert_eq!((outcome, &module), (CacheOutcome::Compiled, &good), "{i}");
            // Rewritten: the next request hits.
            let (_, outcome) = cache
                .get_or_compile("adamw.cu", "src", &o, V13, counting(&calls))
                .unwrap();
            assert_eq!(outcome, CacheOutcome::Hit, "{i}");
        }
        // An entry that is a directory (unreadable as a file) is worked around too.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let (_, outcome) = cache
            .get_or_compile("adamw.cu", "src", &o, V13, counting(&calls))
            .unwrap();
        assert_eq!(outcome, CacheOutcome::Compiled);
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn compile_errors_pass_through_and_store_nothing() {
        let cache = temp_cache("error");
        let o = CompileOptions::new("sm_90", "/inc");
        let err = cache
            .get_or_compile("gelu.cu", "src", &o, V13, |_, _| {
                Err(crate::Error::Backend {
                    backend: "cuda",
                    message: "no NVRTC".into(),
                })
            })
            .unwrap_err();
        assert!(err.to_string().contains("no NVRTC"));
        assert!(!cache.dir().exists());
    }

    #[test]
    fn the_default_directory_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let all = env(&[(CACHE_ENV, "/c"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(default_dir_with(&all), Some(PathBuf::from("/c")));
        let xdg = env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(
            default_dir_with(&xdg),
            Some(PathBuf::from("/x/trainkit/kernels"))
        );
        let relative_xdg = env(&[("XDG_CACHE_HOME", "x"), ("HOME", "/h")]);
        assert_eq!(
            default_dir_with(&relative_xdg),
            Some(PathBuf::from("/h/.cache/trainkit/kernels"))
        );
        assert_eq!(default_dir_with(&env(&[])), None);
    }
}
