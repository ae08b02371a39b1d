//! NCCL without a GPU: the real library (the `nvidia-nccl-cu13` wheel CI installs) is
//! opened, its version checked and a communicator id made, and joining a communicator
//! where no GPU answers fails with NCCL's reason; then a stand-in library
//! (tests/fixtures/fake_nccl.c: ranks that all hold the same values) carries the
//! collectives of [`Nccl`] on the CUDA emulator, so that the device path — gradients
//! summed in place on the device, weights broadcast there, host values through device
//! buffers — trains bit for bit as the host path does with the same sums.
//!
//! On a GPU, the bundle's `nccl` phase checks real ranks (docs/guide.md "On a GPU").

#![cfg(feature = "nccl")]

use crate::common;

use common::mirrored::Mirrored;
use common::{corpus_loader, tiny_config, update_bits};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use trainkit::collective::nccl::{NcclLibrary, MIN_VERSION};
use trainkit::collective::{Collective, Nccl, Single};
use trainkit::device::cuda::libraries::Search;
use trainkit::device::CudaBackend;
use trainkit::{Backend, DType, MemoryCategory, TrainerOptions};

fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "nccl: {line}");
}

/// The real NCCL, where the loader finds it (or `None`, said on stderr; a failure when
/// `TRAINKIT_REQUIRE_NCCL` is set, as in CI).
fn real_nccl() -> Option<&'static NcclLibrary> {
    match NcclLibrary::get() {
        Ok(lib) => Some(lib),
        Err(e) => {
            assert!(
                std::env::var_os("TRAINKIT_REQUIRE_NCCL").is_none(),
                "NCCL is required (TRAINKIT_REQUIRE_NCCL) but: {e}"
            );
            say(&format!("checks of the real library SKIPPED: {e}"));
            None
        }
    }
}

/// The stand-in library, compiled once by the host's C compiler (or `None`, said on
/// stderr; a failure when `TRAINKIT_REQUIRE_EMULATOR` is set).
fn fake_nccl() -> Option<&'static NcclLibrary> {
    static FAKE: OnceLock<Option<&'static NcclLibrary>> = OnceLock::new();
    *FAKE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("trainkit-fake-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libnccl.so.2");
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_nccl.c");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
        let built = std::process::Command::new(&cc)
            .args(["-O1", "-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(&src)
            .output();
        match built {
            Ok(o) if o.status.success() => {}
            other => {
                let why = format!("{cc} could not build the stand-in NCCL: {other:?}");
                assert!(
                    std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_none(),
                    "{why}"
                );
                say(&format!("stand-in checks SKIPPED: {why}"));
                return None;
            }
        }
        let opened = NcclLibrary::open(Search::Dir(&dir)).expect("the stand-in opens");
        Some(&*Box::leak(Box::new(opened)))
    })
}

/// How many collectives of NCCL type `ty` (7 f32, 8 f64, 9 bf16, 1 bytes) the stand-in
/// has run in this process.
fn fake_calls(ty: i32) -> i64 {
    let lib = fake_nccl().unwrap();
    // SAFETY: the stand-in exports `long fake_nccl_calls(int)`; the library stays loaded
    // (leaked above), so opening it again returns the same handle.
    unsafe {
        let l = libloading::Library::new(lib.path()).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(i32) -> i64> =
            l.get(b"fake_nccl_calls").unwrap();
        f(ty)
    }
}

/// A count the stand-in keeps (`long symbol(void)`): `fake_nccl_reduces` (reductions to
/// one rank, `ncclReduce`), `fake_nccl_groups` (`ncclGroupStart` calls) or
/// `fake_nccl_grouped` (collectives queued inside a group).
fn fake_count(symbol: &[u8]) -> i64 {
    let lib = fake_nccl().unwrap();
    // SAFETY: as in `fake_calls`; the stand-in exports both as `long f(void)`.
    unsafe {
        let l = libloading::Library::new(lib.path()).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn() -> i64> = l.get(symbol).unwrap();
        f()
    }
}

fn emulated() -> Option<CudaBackend> {
    match CudaBackend::emulated() {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_none(),
                "the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}"
            );
            say(&format!("emulator checks SKIPPED: {e}"));
            None
        }
    }
}

#[test]
fn the_real_library_opens_and_says_why_it_cannot_join_without_a_gpu() {
    let Some(lib) = real_nccl() else { return };
    assert!(lib.version() >= MIN_VERSION, "{}", lib.version());
    say(&format!(
        "NCCL {} at {}",
        trainkit::collective::nccl::version_text(lib.version()),
        lib.path().display()
    ));
    let a = lib.unique_id().expect("an id needs no GPU");
    assert_ne!(a.bytes, [0; 128]);
    if trainkit::device::cuda::probe().is_ok() {
        return; // a GPU answers: joining is the bundle's check
    }
    let e = lib.init_rank(1, a, 0).unwrap_err();
    assert_eq!(e.call, "ncclCommInitRank");
    assert!(!e.text.is_empty(), "{e}");
    say(&format!("without a GPU: {e}"));
}

#[test]
fn a_missing_library_names_what_to_install() {
    let dir = std::env::temp_dir().join("trainkit-no-nccl-here");
    let e = NcclLibrary::open(Search::Dir(&dir)).unwrap_err();
    assert!(
        e.contains("libnccl.so.2") && e.contains("nvidia-nccl-cu13"),
        "{e}"
    );
    let e = NcclLibrary::open_file(&dir.join("libnccl.so.2")).unwrap_err();
    assert!(e.contains("TRAINKIT_NCCL"), "{e}");
}

/// Host values cross through device buffers, each collective as NCCL runs it.
#[test]
fn host_values_cross_through_the_device() {
    let (Some(lib), Some(cuda)) = (fake_nccl(), emulated()) else {
        return;
    };
    let nccl = Nccl::join_with(lib, &cuda, Arc::new(Mirrored)).unwrap();
    assert_eq!((nccl.rank(), nccl.world(), nccl.local_rank()), (0, 2, 0));
    assert!(
        nccl.describe().contains("NCCL 2.23.5"),
        "{}",
        nccl.describe()
    );
    let mut v = [1.5f32, -2.0, 3.25];
    nccl.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v, [3.0, -4.0, 6.5]);
    let mut d = [1e-300f64, 7.0];
    nccl.all_reduce_sum_f64(&mut d).unwrap();
    assert_eq!(d, [2e-300, 14.0]);
    let mut out = [0.0f32; 2];
    nccl.reduce_scatter_sum(&[1.0, 2.0, 3.0, 4.0], &mut out)
        .unwrap();
    assert_eq!(out, [2.0, 4.0]);
    let mut all = [0.0f32; 4];
    nccl.all_gather(&[5.0, 6.0], &mut all).unwrap();
    assert_eq!(all, [5.0, 6.0, 5.0, 6.0]);
    let mut b = *b"bytes";
    nccl.broadcast(&mut b, 0).unwrap();
    assert_eq!(&b, b"bytes");
    nccl.broadcast(&mut b, 1).unwrap();
    assert_eq!(b, [0; 5]);
    assert!(nccl.broadcast(&mut b, 2).is_err(), "root 2 of a world of 2");
    assert!(nccl.all_gather(&[1.0], &mut all).is_err(), "4 is not 2 × 1");
    nccl.barrier().unwrap();
}

/// Device tensors are summed (and broadcast) in place on the device in their own dtype,
/// to the values the host path gives; a host tensor still goes the host way.
#[test]
fn device_tensors_are_summed_in_place_on_the_device() {
    let (Some(lib), Some(cuda)) = (fake_nccl(), emulated()) else {
        return;
    };
    let nccl = Nccl::join_with(lib, &cuda, Arc::new(Mirrored)).unwrap();
    let values: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) * 0.37).collect();
    for (dtype, ty) in [(DType::F32, 7), (DType::Bf16, 9)] {
        let mut t = cuda
            .upload(&values, &[300], dtype, MemoryCategory::Gradients, "g")
            .unwrap();
        let before = fake_calls(ty);
        trainkit::collective::all_reduce_tensor(&nccl, &cuda, &mut t).unwrap();
        assert!(
            fake_calls(ty) > before,
            "{dtype}: summed by NCCL in its dtype"
        );
        let want: Vec<f32> = values
            .iter()
            .map(|v| dtype.round(2.0 * dtype.round(*v)))
            .collect();
        assert_eq!(cuda.to_f32(&t).unwrap(), want, "{dtype}");
        let on_host = cuda.host().unwrap();
        let mut host = on_host
            .upload(&want, &[300], dtype, MemoryCategory::Gradients, "h")
            .unwrap();
        let before = fake_calls(7);
        trainkit::collective::all_reduce_tensor(&nccl, on_host.as_ref(), &mut host).unwrap();
        assert_eq!(
            fake_calls(7),
            before + 1,
            "{dtype}: a host tensor is summed in f32"
        );
        let twice: Vec<f32> = want.iter().map(|v| dtype.round(2.0 * v)).collect();
        assert_eq!(on_host.to_f32(&host).unwrap(), twice, "{dtype} on the host");
        let before = fake_calls(ty);
        trainkit::collective::broadcast_tensor(&nccl, &cuda, &mut t, 0).unwrap();
        assert_eq!(
            fake_calls(ty),
            before + 1,
            "{dtype}: broadcast on the device"
        );
        assert_eq!(cuda.to_f32(&t).unwrap(), want, "{dtype}: rank 0's own");
        trainkit::collective::broadcast_tensor(&nccl, &cuda, &mut t, 1).unwrap();
        assert_eq!(
            cuda.to_f32(&t).unwrap(),
            vec![0.0; 300],
            "{dtype}: rank 1's"
        );
    }
}

/// Two training steps of a small GPT-2 on the emulator as rank 0 of two mirrored ranks,
/// once through the host engine and once through NCCL's device path: the same losses
/// and bit for bit the same weights, master weights and optimizer state, for DDP, ZeRO-1
/// and ZeRO-2 (whose gradients NCCL reduces to their owners, where the host path sums
/// them on every rank), in f32 and in mixed bf16, updating after backward and inside it
/// (each bucket's parameters as the next bucket is sent), with buckets small enough to
/// hold a few gradients each.
#[test]
fn the_device_path_trains_bitwise_as_the_host_path() {
    let (Some(lib), Some(_)) = (fake_nccl(), emulated()) else {
        return;
    };
    for (zero, bf16, in_backward) in [0, 1, 2]
        .into_iter()
        .flat_map(|z| [(z, false), (z, true)])
        .flat_map(|(z, b)| [(z, b, false), (z, b, true)])
    {
        let run = |on_device: bool| {
            let cuda = Arc::new(CudaBackend::emulated().unwrap());
            let collective: Arc<dyn Collective> = if on_device {
                Arc::new(Nccl::join_with(lib, &cuda, Arc::new(Mirrored)).unwrap())
            } else {
                Arc::new(Mirrored)
            };
            let be: Arc<dyn Backend> = cuda;
            let model = trainkit::Gpt2::new(tiny_config()).unwrap();
            let options = TrainerOptions {
                zero_stage: zero,
                bucket_bytes: 8 << 10,
                optimizer_in_backward: in_backward,
                grad_clip: if in_backward { 0.0 } else { 1.0 },
                ..TrainerOptions::default()
            };
            let loader = corpus_loader(20_000, 3, 2, 16);
            let precision: Box<dyn trainkit::Precision> = if bf16 {
                Box::new(trainkit::MixedBf16::default())
            } else {
                Box::new(trainkit::Fp32)
            };
            let mut t = trainkit::Trainer::builder(model, be, loader)
                .precision(precision)
                .options(options)
                .collective(collective)
                .build()
                .unwrap();
            let losses: Vec<u64> = (0..2).map(|_| t.step().unwrap().loss.to_bits()).collect();
            (losses, update_bits(&t))
        };
        let calls = || fake_calls(7) + fake_calls(9);
        let counts = || {
            [
                calls(),
                fake_count(b"fake_nccl_reduces"),
                fake_count(b"fake_nccl_groups"),
                fake_count(b"fake_nccl_grouped"),
            ]
        };
        let before = counts();
        let device = run(true);
        let after = counts();
        let [sums, reduces, groups, grouped] = [0, 1, 2, 3].map(|k| after[k] - before[k]);
        assert!(sums > 0, "zero {zero}: NCCL carried the step");
        // ZeRO-2 reduces each gradient to its owner at once; the others sum buckets of
        // gradients on every rank, a group each (some holding several).
        assert_eq!(reduces > 0, zero == 2, "zero {zero}: reduced to owners");
        assert_eq!(groups > 0, zero < 2, "zero {zero}: buckets as groups");
        if zero < 2 {
            assert!(
                grouped > groups,
                "zero {zero}: {grouped} sums in {groups} groups"
            );
        }
        let host = run(false);
        let what = format!("zero {zero} bf16 {bf16} inside backward {in_backward}");
        assert_eq!(device.0, host.0, "{what}: losses");
        assert!(device.1 == host.1, "{what}: weights and state");
    }
}

/// A world of one over NCCL: the communicator forms, and training is what it is alone.
#[test]
fn one_process_over_nccl_is_one_process() {
    let (Some(lib), Some(cuda)) = (fake_nccl(), emulated()) else {
        return;
    };
    let nccl = Nccl::join_with(lib, &cuda, Arc::new(Single)).unwrap();
    assert_eq!(nccl.world(), 1);
    assert!(
        nccl.describe().contains("one process"),
        "{}",
        nccl.describe()
    );
    let mut v = [1.0f32, 2.0];
    nccl.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v, [1.0, 2.0]);
}
