//! Every CUDA kernel file compiles with NVRTC, for Hopper (sm_90) and Ampere (sm_80), to
//! PTX that defines exactly the kernels `kernel_files()` lists, at a PTX version the CUDA
//! 13.0 driver (580) loads; and that PTX assembles (ptxas, inside NVRTC) to machine code
//! whose every kernel fits a block's static shared memory (48 KiB) and spills no register
//! to local memory (a spill is a slow local-memory round trip in a kernel's inner loop;
//! launch bounds or fewer live values mend it). Each file's most register-hungry kernel
//! is printed.
//!
//! Needs no GPU: only libnvrtc and the CUDA headers (the pip wheels
//! `nvidia-cuda-nvrtc==13.0.*` and `nvidia-cuda-runtime==13.0.*` are enough; `.ci/run`
//! installs them). Without them the tests print `skipped: <reason>` and pass, unless
//! `TRAINKIT_REQUIRE_NVRTC=1`, which turns the skip into a failure.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use trainkit::device::cuda::cache::{CacheOutcome, KernelCache, Versions};
use trainkit::device::cuda::kernels::{
    self, assemble, compile, find_include_dir, nvrtc_version, ptx_entries, ptx_version,
    CompileOptions,
};

/// The newest PTX ISA the 580 driver (CUDA 13.0) loads.
const MAX_PTX: (u32, u32) = (9, 0);

/// Static shared memory a block may declare (more needs dynamic shared memory and an
/// opt-in attribute).
const MAX_STATIC_SHARED: u64 = 48 << 10;

/// Architectures every kernel must compile for.
const ARCHS: [&str; 2] = ["sm_90", "sm_80"];

/// Writes to the test's stderr, past the test harness's capture, so CI logs show it.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// The include directory when NVRTC and the headers are present; `None` (after printing
/// why) when they are not and not required.
fn nvrtc_or_skip() -> Option<(PathBuf, (i32, i32))> {
    let found = nvrtc_version().and_then(|v| Ok((find_include_dir()?, v)));
    match found {
        Ok(found) => Some(found),
        Err(e) => {
            if std::env::var("TRAINKIT_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("TRAINKIT_REQUIRE_NVRTC=1, but NVRTC cannot run: {e}");
            }
            say(&format!("skipped: {e}"));
            None
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm90_and_sm80() {
    let Some((include, version)) = nvrtc_or_skip() else {
        return;
    };
    say(&format!(
        "NVRTC {}.{}, headers from {}",
        version.0,
        version.1,
        include.display()
    ));
    let mut failures = Vec::new();
    for arch in ARCHS {
        let options = CompileOptions::new(arch, &include);
        let mut kernels = 0;
        let mut versions = BTreeSet::new();
        for file in kernels::kernel_files() {
            let start = std::time::Instant::now();
            let assembly = match assemble(&file.full_source(), &options) {
                Ok(a) => a,
                Err(e) => {
                    failures.push(format!("{} for {arch}: {e}", file.name));
                    continue;
                }
            };
            let ptx = &assembly.ptx;
            if !assembly.cubin.starts_with(b"\x7fELF") {
                failures.push(format!("{} for {arch}: ptxas gave no ELF", file.name));
            }
            let listed: BTreeSet<&str> = file.kernels.iter().copied().collect();
            let assembled: BTreeSet<&str> =
                assembly.kernels.iter().map(|k| k.name.as_str()).collect();
            if listed != assembled {
                failures.push(format!(
                    "{} for {arch}: ptxas assembled {assembled:?}, kernel_files() lists {listed:?}",
                    file.name
                ));
            }
            for k in &assembly.kernels {
                if k.spill_stores > 0 || k.spill_loads > 0 {
                    failures.push(format!(
                        "{} for {arch}: `{}` spills {} bytes (stores) and {} (loads) at {} \
                         registers",
                        file.name, k.name, k.spill_stores, k.spill_loads, k.registers
                    ));
                }
                if k.shared_bytes > MAX_STATIC_SHARED {
                    failures.push(format!(
                        "{} for {arch}: `{}` declares {} bytes of shared memory, over {}",
                        file.name, k.name, k.shared_bytes, MAX_STATIC_SHARED
                    ));
                }
            }
            let entries: BTreeSet<String> = ptx_entries(ptx).into_iter().collect();
            let listed: BTreeSet<String> = file.kernels.iter().map(|k| k.to_string()).collect();
            for missing in listed.difference(&entries) {
                failures.push(format!("{} for {arch}: no `.entry {missing}`", file.name));
            }
            for extra in entries.difference(&listed) {
                failures.push(format!(
                    "{} for {arch}: kernel `{extra}` is not listed in kernel_files()",
                    file.name
                ));
            }
            match ptx_version(ptx) {
                Some(v) if v <= MAX_PTX => {
                    versions.insert(format!("{}.{}", v.0, v.1));
                }
                other => failures.push(format!(
                    "{} for {arch}: PTX .version {other:?}, the 580 driver loads up to {}.{}",
                    file.name, MAX_PTX.0, MAX_PTX.1
                )),
            }
            if !ptx.contains(&format!(".target {arch}")) {
                failures.push(format!(
                    "{} for {arch}: PTX targets another arch",
                    file.name
                ));
            }
            kernels += entries.len();
            let most = assembly.kernels.iter().max_by_key(|k| k.registers);
            say(&format!(
                "  {arch} {:<17} {:>2} kernels  {:>5.2} s  most registers: {}",
                file.name,
                entries.len(),
                start.elapsed().as_secs_f64(),
                most.map_or("-".into(), |k| format!(
                    "{} ({}, {} B shared)",
                    k.registers, k.name, k.shared_bytes
                ))
            ));
        }
        say(&format!(
            "{arch}: {} files, {kernels} kernels, PTX .version {}",
            kernels::kernel_files().len(),
            versions.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The body of kernel `name` in a PTX module: from its `.entry` to the next one.
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no `.entry {name}`"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(rest.len(), |i| i);
    &rest[..end]
}

/// The fused attention's 16-bit kernels multiply on the tensor cores (`mma.sync` with bf16
/// or f16 operands and f32 accumulators) on sm_80 and sm_90, not in the SIMT fallback
/// that the f32 kernels use.
#[test]
fn the_16_bit_attention_kernels_use_the_tensor_cores() {
    let Some((include, _)) = nvrtc_or_skip() else {
        return;
    };
    let file = kernels::kernel_files()
        .iter()
        .find(|f| f.name == "flash_attention.cu")
        .expect("the fused attention's kernel file");
    for arch in ARCHS {
        let ptx = compile(&file.full_source(), &CompileOptions::new(arch, &include))
            .unwrap()
            .ptx;
        for kernel in ["forward", "backward_dkv", "backward_dq"] {
            for (dtype, mma) in [
                (
                    "bf16",
                    Some("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
                ),
                (
                    "f16",
                    Some("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
                ),
                ("f32", None),
            ] {
                let name = format!("flash_attention_{kernel}_{dtype}");
                let body = entry_body(&ptx, &name);
                match mma {
                    Some(mma) => assert!(body.contains(mma), "{arch}: `{name}` has no `{mma}`"),
                    None => assert!(!body.contains("mma.sync"), "{arch}: `{name}` uses mma"),
                }
            }
        }
    }
}

/// The tensor-core attention's backward adds its dQ sums two floats at a time on sm_90
/// (one vector reduction, `red.global.add.v2.f32`), one at a time on sm_80, which has no
/// vector reduction.
#[test]
fn the_attention_backward_adds_dq_in_pairs_on_hopper() {
    let Some((include, _)) = nvrtc_or_skip() else {
        return;
    };
    let file = kernels::kernel_file("flash_attention_mma.cu").expect("the tensor-core attention");
    for (arch, pairs) in [("sm_90", true), ("sm_80", false)] {
        let ptx = compile(&file.full_source(), &CompileOptions::new(arch, &include))
            .unwrap()
            .ptx;
        for (d, tiling) in [64, 80, 96, 128]
            .iter()
            .flat_map(|d| [(d, "wide"), (d, "narrow")])
        {
            let name = format!("flash_attention_mma_backward_d{d}_{tiling}_bf16");
            let body = entry_body(&ptx, &name);
            let vector = body.contains("red.global.add.v2.f32");
            assert_eq!(vector, pairs, "{arch}: `{name}`");
            let scalar = ["red.global.add.f32", "atom.global.add.f32"];
            assert!(
                vector || scalar.iter().any(|s| body.contains(s)),
                "{arch}: `{name}`"
            );
        }
    }
}

#[test]
fn compiled_machine_code_is_served_from_the_cache_the_second_time() {
    let Some((include, version)) = nvrtc_or_skip() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("trainkit-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = KernelCache::new(&dir);
    let file = kernels::kernel_file("gelu.cu").unwrap();
    let options = CompileOptions::new("sm_90", &include);
    let source = file.full_source();
    let versions = Versions {
        nvrtc: version,
        driver: 13000,
    };
    let get = || {
        cache
            .get_or_compile(file.name, &source, &options, versions, compile)
            .unwrap()
    };
    let (first, o1) = get();
    let (second, o2) = get();
    assert_eq!((o1, o2), (CacheOutcome::Compiled, CacheOutcome::Hit));
    assert_eq!(first, second);
    // The machine code is an ELF image for sm_90, beside the PTX.
    let cubin = first
        .cubin
        .as_deref()
        .expect("NVRTC made machine code for sm_90");
    assert!(cubin.starts_with(b"\x7fELF"), "not an ELF image");
    assert_eq!(ptx_version(&first.ptx).map(|v| v <= MAX_PTX), Some(true));
    assert_eq!(cache.module(file, &options, 13000).unwrap(), first);
    // A virtual architecture gives PTX alone, cached as such.
    let virt = CompileOptions::new("compute_90", &include);
    let (ptx_only, _) = cache
        .get_or_compile(file.name, &source, &virt, versions, compile)
        .unwrap();
    assert!(ptx_only.cubin.is_none());
    assert_eq!(ptx_entries(&ptx_only.ptx), ptx_entries(&first.ptx));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_kernel_that_does_not_compile_reports_nvrtc_log() {
    let Some((include, _)) = nvrtc_or_skip() else {
        return;
    };
    let src = "#line 1 \"broken.cu\"\nextern \"C\" __global__ void k(float* x) { x[0] = y; }\n";
    let err = compile(src, &CompileOptions::new("sm_90", &include))
        .unwrap_err()
        .to_string();
    assert!(err.contains("broken.cu") && err.contains("\"y\""), "{err}");
}

/// The kernels written for bandwidth read in 16-byte loads and keep their operands in
/// registers: the norms' forward and input gradients (a warp per row), the first pass of
/// the norms' parameter gradients and of the bias gradient (8 columns a thread), RoPE (8
/// pairs a thread), GELU and the multi-tensor AdamW, whose table of tensors, passed by
/// value and indexed by the block, is read from the parameter space rather than copied to
/// local memory. RoPE's sines and cosines may: CUDA's `sinf` and `cosf` reduce an angle
/// beyond 105,615 radians (positions past about 100k at the lowest frequency) with a
/// table of words in local memory, a path no shorter position takes.
#[test]
fn the_bandwidth_kernels_load_16_bytes_and_use_no_local_memory() {
    let Some((include, _)) = nvrtc_or_skip() else {
        return;
    };
    let cases = [
        ("layernorm.cu", "layernorm_backward_dx"),
        ("rmsnorm.cu", "rmsnorm_backward_dx"),
        ("layernorm.cu", "layernorm_f"),
        ("layernorm.cu", "layernorm_bf"),
        ("rmsnorm.cu", "rmsnorm_f"),
        ("rmsnorm.cu", "rmsnorm_bf"),
        ("layernorm.cu", "layernorm_backward_params_"),
        ("rmsnorm.cu", "rmsnorm_backward_params_"),
        ("elementwise.cu", "bias_backward_partial_"),
        ("rope.cu", "rope_"),
        ("adamw.cu", "adamw_multi_f32"),
        ("gelu.cu", "gelu_"),
        ("cross_entropy.cu", "cross_entropy_"),
        ("glu.cu", "swiglu_"),
        ("glu.cu", "geglu_"),
    ];
    for arch in ARCHS {
        for (file, prefix) in cases {
            let file = kernels::kernel_files()
                .iter()
                .find(|f| f.name == file)
                .expect("a kernel file of trainkit's");
            let ptx = compile(&file.full_source(), &CompileOptions::new(arch, &include))
                .unwrap()
                .ptx;
            // A column sum's second pass reads its f32 workspace a column a lane.
            let first_passes = file
                .kernels
                .iter()
                .filter(|k| k.starts_with(prefix) && !k.contains("_finish_"));
            for kernel in first_passes {
                let body = entry_body(&ptx, kernel);
                assert!(
                    body.contains(".v4.u32") || body.contains(".v4.f32"),
                    "{arch}: `{kernel}` has no 16-byte load or store"
                );
                assert!(
                    !body.contains(".local") || file.name == "rope.cu",
                    "{arch}: `{kernel}` uses local memory"
                );
            }
        }
    }
}
