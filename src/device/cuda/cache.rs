//! Compiled PTX cached on disk, so NVRTC runs once per kernel file, architecture and
//! NVRTC version rather than at every start.
//!
//! An entry is named `<file stem>-<key>.ptx`, where the key is a 128-bit FNV-1a hash of the
//! complete source (common prelude included), the NVRTC flags (architecture, include
//! directory, math options) and the NVRTC version. FNV-1a is implemented here, so keys do
//! not change with the Rust version (std's `DefaultHasher` may) or a crate's release; it
//! is not a cryptographic hash, which a private cache does not need. Each entry ends with
//! a checksum line of its PTX: an entry that is truncated, altered or unreadable is
//! compiled again and rewritten, never an error. Entries are written atomically
//! ([`write_atomically`]), so concurrent processes at worst both compile.
//!
//! The directory is `$TRAINKIT_CACHE_DIR` when set, else `$XDG_CACHE_HOME/trainkit/kernels`,
//! else `~/.cache/trainkit/kernels`.

use super::kernels::{self, CompileOptions, KernelFile};
use crate::error::Result;
use crate::save::write_atomically;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Whether [`KernelCache::get_or_compile`] found the PTX or compiled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// A valid entry was on disk.
    Hit,
    /// The PTX was compiled (no entry, or a corrupt one) and stored.
    Compiled,
}

/// A directory of compiled PTX, keyed by source, options and NVRTC version.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

/// Environment variable naming the cache directory.
pub const CACHE_ENV: &str = "TRAINKIT_CACHE_DIR";

/// Marks the checksum line that ends every entry.
const CHECKSUM_TAG: &str = "// trainkit-ptx-checksum ";

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

    /// The key of `source` compiled with `options` by NVRTC `nvrtc` (`(major, minor)`):
    /// 32 hex digits.
    pub fn key(source: &str, options: &CompileOptions, nvrtc: (i32, i32)) -> String {
        let mut h = Fnv128::new();
        h.field(b"trainkit kernel cache v1");
        h.field(source.as_bytes());
        for flag in options.flags() {
            h.field(flag.as_bytes());
        }
        h.field(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
        format!("{:032x}", h.finish())
    }

    /// Where the entry for kernel file `file` (e.g. `gelu.cu`) with `key` lives.
    pub fn entry_path(&self, file: &str, key: &str) -> PathBuf {
        let stem = file.strip_suffix(".cu").unwrap_or(file);
        self.dir.join(format!("{stem}-{key}.ptx"))
    }

    /// The PTX of `source` for `options`: from the cache when a valid entry exists, else
    /// from `compile` (then stored). Only `compile`'s errors are returned; cache trouble
    /// (an unreadable or corrupt entry, a directory that cannot be written) is logged and
    /// worked around.
    pub fn get_or_compile(
        &self,
        file: &str,
        source: &str,
        options: &CompileOptions,
        nvrtc: (i32, i32),
        compile: impl FnOnce(&str, &CompileOptions) -> Result<String>,
    ) -> Result<(String, CacheOutcome)> {
        let path = self.entry_path(file, &Self::key(source, options, nvrtc));
        match std::fs::read(&path) {
            Ok(bytes) => match decode_entry(&bytes) {
                Some(ptx) => return Ok((ptx, CacheOutcome::Hit)),
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
        let ptx = compile(source, options)?;
        let stored = std::fs::create_dir_all(&self.dir)
            .map_err(|e| crate::error::Error::io(&self.dir, e))
            .and_then(|()| write_atomically(&path, encode_entry(&ptx).as_bytes()));
        if let Err(e) = stored {
            log::warn!("could not store compiled {file} in the kernel cache: {e}");
        }
        Ok((ptx, CacheOutcome::Compiled))
    }

    /// The PTX of a kernel file for `options`, through the cache and NVRTC.
    pub fn ptx(&self, file: &KernelFile, options: &CompileOptions) -> Result<String> {
        let nvrtc = kernels::nvrtc_version()?;
        let source = file.full_source();
        self.get_or_compile(file.name, &source, options, nvrtc, kernels::compile)
            .map(|(ptx, _)| ptx)
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

/// The PTX followed by its checksum line.
fn encode_entry(ptx: &str) -> String {
    let sep = if ptx.ends_with('\n') { "" } else { "\n" };
    format!("{ptx}{sep}{CHECKSUM_TAG}{:032x}\n", checksum(ptx))
}

/// The PTX of a well-formed entry whose checksum matches.
fn decode_entry(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    let body_end = text.rfind(CHECKSUM_TAG)?;
    let (body, tail) = text.split_at(body_end);
    let sum = tail.strip_prefix(CHECKSUM_TAG)?.strip_suffix('\n')?;
    let sum = u128::from_str_radix(sum, 16).ok()?;
    // encode_entry added a newline when the PTX had none; PTX from NVRTC ends with one.
    (sum == checksum(body) && !body.is_empty()).then(|| body.to_string())
}

fn checksum(ptx: &str) -> u128 {
    let mut h = Fnv128::new();
    h.field(ptx.as_bytes());
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

    /// A compile function that counts its calls.
    fn counting<'a>(
        calls: &'a Cell<usize>,
    ) -> impl Fn(&str, &CompileOptions) -> Result<String> + 'a {
        move |src: &str, o: &CompileOptions| {
            calls.set(calls.get() + 1);
            Ok(format!("{PTX}// {} {}\n", o.arch, src.len()))
        }
    }

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
            .get_or_compile("gelu.cu", "src", &o, (13, 0), counting(&calls))
            .unwrap();
        let (b, second) = cache
            .get_or_compile("gelu.cu", "src", &o, (13, 0), counting(&calls))
            .unwrap();
        assert_eq!((first, second), (CacheOutcome::Compiled, CacheOutcome::Hit));
        assert_eq!(a, b);
        assert_eq!(calls.get(), 1);
        let key = KernelCache::key("src", &o, (13, 0));
        assert!(cache
            .entry_path("gelu.cu", &key)
            .ends_with(format!("gelu-{key}.ptx")));
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn changed_source_options_or_nvrtc_miss() {
        let cache = temp_cache("miss");
        let calls = Cell::new(0);
        let o90 = CompileOptions::new("sm_90", "/inc");
        let o80 = CompileOptions::new("sm_80", "/inc");
        let other_inc = CompileOptions::new("sm_90", "/other");
        for (src, o, v) in [
            ("src", &o90, (13, 0)),
            ("src", &o80, (13, 0)),
            ("src", &other_inc, (13, 0)),
            ("src2", &o90, (13, 0)),
            ("src", &o90, (13, 1)),
        ] {
            let (_, outcome) = cache
                .get_or_compile("gelu.cu", src, o, v, counting(&calls))
                .unwrap();
            assert_eq!(outcome, CacheOutcome::Compiled, "{src} {o:?} {v:?}");
        }
        assert_eq!(calls.get(), 5);
        let (ptx, outcome) = cache
            .get_or_compile("gelu.cu", "src", &o80, (13, 0), counting(&calls))
            .unwrap();
        assert_eq!(outcome, CacheOutcome::Hit);
        assert!(ptx.contains("sm_80"));
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn a_corrupt_entry_is_compiled_again() {
        let cache = temp_cache("corrupt");
        let calls = Cell::new(0);
        let o = CompileOptions::new("sm_90", "/inc");
        let (good, _) = cache
            .get_or_compile("adamw.cu", "src", &o, (13, 0), counting(&calls))
            .unwrap();
        let path = cache.entry_path("adamw.cu", &KernelCache::key("src", &o, (13, 0)));
        let full = std::fs::read(&path).unwrap();
        let corruptions: Vec<Vec<u8>> = vec![
            full[..full.len() / 2].to_vec(),         // truncated
            full.iter().map(|b| b ^ 0x20).collect(), // altered
            vec![0xff, 0xfe, 0x00],                  // not UTF-8
            Vec::new(),                              // empty
            good.as_bytes().to_vec(),                // no checksum
        ];
        for (i, bad) in corruptions.into_iter().enumerate() {
            std::fs::write(&path, bad).unwrap();
            let (ptx, outcome) = cache
                .get_or_compile("adamw.cu", "src", &o, (13, 0), counting(&calls))
                .unwrap();
            assert_eq!(
                (outcome, ptx.as_str()),
                (CacheOutcome::Compiled, good.as_str()),
                "{i}"
            );
            // Rewritten: the next request hits.
            let (_, outcome) = cache
                .get_or_compile("adamw.cu", "src", &o, (13, 0), counting(&calls))
                .unwrap();
            assert_eq!(outcome, CacheOutcome::Hit, "{i}");
        }
        // An entry that is a directory (unreadable as a file) is worked around too.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let (_, outcome) = cache
            .get_or_compile("adamw.cu", "src", &o, (13, 0), counting(&calls))
            .unwrap();
        assert_eq!(outcome, CacheOutcome::Compiled);
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn compile_errors_pass_through_and_store_nothing() {
        let cache = temp_cache("error");
        let o = CompileOptions::new("sm_90", "/inc");
        let err = cache
            .get_or_compile("gelu.cu", "src", &o, (13, 0), |_, _| {
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
