//! An optimizer written outside trainkit, with a kernel of its own: Lion
//! (examples/lion/lion.rs), whose update is a `CustomKernel` with CUDA C source and a CPU
//! twin. It matches its closed form on the CPU, trains the tiny GPT-2, runs on the host
//! (optimizer offload) bitwise as on the device, gives the CPU's results on the CUDA
//! emulator, compiles with NVRTC, and round-trips through a config file as
//! `[optimizer] kind = "lion"`.
//!
//! The emulator checks skip with a printed reason where no C++ compiler runs, unless
//! `TRAINKIT_REQUIRE_EMULATOR` is set; the NVRTC check skips where NVRTC or the CUDA
//! headers are missing, unless `TRAINKIT_REQUIRE_NVRTC=1`.

use crate::common;
#[path = "../examples/lion/lion.rs"]
mod example;

use common::{corpus_loader, tiny_config, values};
use example::{Lion, LionUpdate};
use std::io::Write;
use std::sync::Arc;
use trainkit::config::RunConfig;
use trainkit::device::cuda::kernels::{
    compile, custom_full_source, find_include_dir, nvrtc_version, ptx_entries, CompileOptions,
};
use trainkit::device::cuda::CudaBackend;
use trainkit::optim::GradScale;
use trainkit::{
    Backend, CpuBackend, DType, Fp32, Gpt2, MemoryCategory, Optimizer, Tensor, Trainer,
};

/// Writes to the real stderr, past the test harness's capture.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "lion: {line}");
}

/// The emulated CUDA backend, or `None` (said on stderr) where it cannot be built.
fn emulated() -> Option<CudaBackend> {
    match CudaBackend::emulated() {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}");
            }
            say(&format!("CUDA emulator check SKIPPED: {e}"));
            None
        }
    }
}

fn upload(be: &dyn Backend, v: &[f32], shape: &[usize], dt: DType, label: &str) -> Tensor {
    be.upload(v, shape, dt, MemoryCategory::Workspace, label)
        .unwrap()
}

/// Runs `steps` Lion updates of one tensor through `Backend::custom` with the gradient
/// `grad(step)` and multiplier `scale(step)`: the values and the momentum.
fn run_updates(
    be: &dyn Backend,
    init: &[f32],
    grad: &dyn Fn(u64) -> Vec<f32>,
    scale: &dyn Fn(u64) -> f32,
    grad_dtype: DType,
    hp: &Lion,
    steps: u64,
) -> (Vec<f32>, Vec<f32>) {
    let n = init.len();
    let mut p = upload(be, init, &[n], DType::F32, "p");
    let mut m = upload(be, &vec![0.0; n], &[n], DType::F32, "m");
    for step in 1..=steps {
        let g = upload(be, &grad(step), &[n], grad_dtype, "g");
        let s = upload(be, &[scale(step)], &[1], DType::F32, "scale");
        let decay = 1.0 - hp.lr * hp.weight_decay;
        be.custom(
            &LionUpdate,
            &mut [&mut p, &mut m],
            &[&g, &s],
            &[hp.lr, hp.beta1, hp.beta2, decay],
        )
        .unwrap();
    }
    (be.to_f32(&p).unwrap(), be.to_f32(&m).unwrap())
}

/// The update kernel's CPU twin against Lion's closed form for a constant gradient, one
/// step by hand with a multiplier, and the skip on a multiplier that is not finite.
#[test]
fn the_cpu_update_matches_the_closed_form() {
    let be = CpuBackend::new();
    let hp = Lion {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Lion::default()
    };
    let init = [0.5f32, -1.0, 2.0, 0.0, 1.5, -0.25];
    let g = [0.3f32, -0.2, 1e-3, 4.0, -0.7, 0.0];
    let n = 7u64;
    // With a constant gradient g and m₀ = 0, m_t = (1 − β2^t)·g, so c_t has the sign of g
    // at every step and p_n = p₀·aⁿ − lr·sign(g)·(1 − aⁿ)/(1 − a) with a = 1 − lr·wd.
    let (p, m) = run_updates(&be, &init, &|_| g.to_vec(), &|_| 1.0, DType::F32, &hp, n);
    let (lr, a) = (hp.lr as f64, 1.0 - hp.lr as f64 * hp.weight_decay as f64);
    for i in 0..init.len() {
        let sign = [-1.0, 0.0, 1.0][1 + (g[i] > 0.0) as usize - (g[i] < 0.0) as usize];
        let an = a.powi(n as i32);
        let want = init[i] as f64 * an - lr * sign * (1.0 - an) / (1.0 - a);
        assert!(
            (p[i] as f64 - want).abs() < 1e-5,
            "p[{i}]: {} vs closed form {want}",
            p[i]
        );
        let want_m = (1.0 - (hp.beta2 as f64).powi(n as i32)) * g[i] as f64;
        assert!(
            (m[i] as f64 - want_m).abs() < 1e-6,
            "m[{i}]: {} vs {want_m}",
            m[i]
        );
    }
    // One step by hand, with a multiplier: the sign follows β1·m + (1 − β1)·g·s.
    let (p1, m1) = run_updates(
        &be,
        &[1.0, 1.0],
        &|_| vec![2.0, -2.0],
        &|_| 0.5,
        DType::F32,
        &hp,
        1,
    );
    let decay = 1.0 - hp.lr * hp.weight_decay;
    assert_eq!(p1, vec![decay - hp.lr, decay + hp.lr]);
    assert_eq!(m1, vec![1.0 - hp.beta2, -(1.0 - hp.beta2)]);
    // A multiplier that is not finite skips the update: values and momentum untouched.
    for bad in [f32::NAN, f32::INFINITY] {
        let (p, m) = run_updates(&be, &init, &|_| g.to_vec(), &|_| bad, DType::F32, &hp, 2);
        assert_eq!(p, init.to_vec(), "{bad}");
        assert!(m.iter().all(|v| *v == 0.0), "{bad}");
    }
}

/// The optimizer itself: lazily one state tensor per parameter, 4 bytes each, decay on
/// matrices only; and a few steps of the tiny GPT-2 on the CPU lower its loss.
#[test]
fn lion_trains_the_tiny_gpt2_on_the_cpu() {
    let model = Gpt2::new(tiny_config()).unwrap();
    let lion = Lion {
        lr: 3e-3,
        weight_decay: 0.1,
        ..Lion::default()
    };
    let mut t = Trainer::builder(model, common::cpu(), corpus_loader(50_000, 2, 4, 16))
        .optimizer(lion)
        .build()
        .unwrap();
    let stats: Vec<_> = (0..12).map(|_| t.step().unwrap()).collect();
    assert!(stats.iter().all(|s| !s.skipped));
    let first = (stats[0].loss + stats[1].loss) / 2.0;
    let last = (stats[10].loss + stats[11].loss) / 2.0;
    assert!(last < first - 0.5, "loss falls: {first} -> {last}");
    for p in t.params() {
        assert_eq!(p.state().len(), 1, "{}: one momentum tensor", p.name());
        assert_eq!(p.state()[0].shape(), p.shape());
    }
    assert_eq!(t.optimizer().state_bytes_per_param(), 4);
}

/// Lion on the host (`optimizer_offload`): its state and the f32 master weights in host
/// memory, its CPU twin run there on a host thread, bitwise the update on the device, in
/// mixed bf16 after backward (with clipping) and inside it.
#[test]
fn lion_on_the_host_is_bitwise_lion_on_the_device() {
    let run = |offload: bool, in_backward: bool| {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, common::cpu(), corpus_loader(50_000, 2, 4, 16))
            .precision(trainkit::MixedBf16::default())
            .optimizer(Lion {
                lr: 3e-3,
                weight_decay: 0.1,
                ..Lion::default()
            })
            .options(trainkit::TrainerOptions {
                optimizer_offload: offload,
                optimizer_in_backward: in_backward,
                grad_clip: if in_backward { 0.0 } else { 1.0 },
                ..trainkit::TrainerOptions::default()
            })
            .build()
            .unwrap();
        let losses: Vec<u64> = (0..3).map(|_| t.step().unwrap().loss.to_bits()).collect();
        let host = t.backend().ledger().snapshot().live.host();
        let state: Vec<Vec<u32>> = t
            .params()
            .iter()
            .map(|p| {
                assert_eq!(p.offloaded(), offload, "{}", p.name());
                let be = p.state_backend(t.backend().as_ref());
                let m = be.to_f32(&p.state()[0]).unwrap();
                m.iter().map(|x| x.to_bits()).collect()
            })
            .collect();
        (losses, values(&t), state, host)
    };
    for in_backward in [false, true] {
        let (device, host) = (run(false, in_backward), run(true, in_backward));
        assert_eq!(device.0, host.0, "losses, in backward {in_backward}");
        assert_eq!(device.1, host.1, "weights, in backward {in_backward}");
        assert_eq!(device.2, host.2, "momentum, in backward {in_backward}");
        assert_eq!(device.3, 0);
        assert!(
            host.3 > 0,
            "the momentum and master weights live in host memory"
        );
    }
}

/// The kernel on the emulator against its CPU twin, bit for bit (both round where the
/// other does, with no fused multiply-adds): several steps with varying gradients, a
/// clipping multiplier, weight decay, and an f32 or a bf16 gradient.
#[test]
fn the_emulated_update_equals_the_cpu_bit_for_bit() {
    let Some(emu) = emulated() else { return };
    let cpu = CpuBackend::new();
    let hp = Lion {
        lr: 1e-3,
        weight_decay: 0.1,
        ..Lion::default()
    };
    let n = 1000;
    let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grad = |step: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + 1.0) * 0.11 * step as f32).cos() * 0.01)
            .collect()
    };
    let scale = |step: u64| if step == 2 { f32::NAN } else { 0.75 };
    for dt in [DType::F32, DType::Bf16] {
        let want = run_updates(&cpu, &init, &grad, &scale, dt, &hp, 4);
        let got = run_updates(&emu, &init, &grad, &scale, dt, &hp, 4);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.0), bits(&want.0), "values, {dt} gradient");
        assert_eq!(bits(&got.1), bits(&want.1), "momentum, {dt} gradient");
        assert_ne!(want.0, init, "the updates moved the values");
    }
}

/// Three training steps of the tiny GPT-2 with Lion on the emulated CUDA backend track the
/// CPU's. The losses agree to 1e-5 (relative). Lion moves every element by ±lr (plus
/// decay) whatever its gradient's size, so an element whose `c` is near 0 may take the
/// other sign on the other backend (gradients agree to about 1e-5, not bitwise): no element
/// may differ by more than the 2·lr per step such a flip costs, and at most 1% of the
/// elements may differ by more than 1e-6.
#[test]
fn lion_on_the_emulator_tracks_the_cpu() {
    let Some(emu) = emulated() else { return };
    let lion = Lion {
        lr: 1e-3,
        weight_decay: 0.1,
        ..Lion::default()
    };
    let steps = 3;
    let run = |be: Arc<dyn Backend>| {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, be, corpus_loader(20_000, 1, 2, 16))
            .precision(Fp32)
            .optimizer(lion)
            .build()
            .unwrap();
        let losses: Vec<f64> = (0..steps).map(|_| t.step().unwrap().loss).collect();
        (losses, values(&t))
    };
    let want = run(Arc::new(CpuBackend::new()));
    let got = run(Arc::new(emu));
    for (g, w) in got.0.iter().zip(&want.0) {
        assert!(((g - w) / w).abs() < 1e-5, "loss {g} vs {w}");
    }
    let bound = 2.0 * lion.lr * steps as f32 + 1e-6;
    let (mut total, mut differ) = (0usize, 0usize);
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        for (j, (g, w)) in g.iter().zip(w).enumerate() {
            assert!((g - w).abs() <= bound, "value {i}[{j}]: {g} vs {w}");
            total += 1;
            differ += ((g - w).abs() > 1e-6) as usize;
        }
    }
    say(&format!(
        "emulator vs CPU after {steps} steps: {differ} of {total} values differ by more than 1e-6"
    ));
    assert!(differ * 100 <= total, "{differ} of {total} values differ");
}

/// The user kernel compiles with NVRTC through trainkit's path (common header prepended)
/// for Hopper and Ampere, to PTX that defines exactly `lion_update`.
#[test]
fn the_lion_kernel_compiles_with_nvrtc() {
    let found = nvrtc_version().and_then(|v| Ok((find_include_dir()?, v)));
    let (include, version) = match found {
        Ok(found) => found,
        Err(e) => {
            if std::env::var("TRAINKIT_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("TRAINKIT_REQUIRE_NVRTC=1, but NVRTC cannot run: {e}");
            }
            say(&format!("NVRTC check skipped: {e}"));
            return;
        }
    };
    let source = custom_full_source(&LionUpdate);
    assert!(source.contains("#line 1 \"lion_update.cu\""));
    for arch in ["sm_90", "sm_80"] {
        let ptx = compile(&source, &CompileOptions::new(arch, &include))
            .unwrap_or_else(|e| panic!("{arch}: {e}"))
            .ptx;
        assert_eq!(ptx_entries(&ptx), vec!["lion_update"], "{arch}");
        say(&format!(
            "NVRTC {}.{} compiled lion_update for {arch}",
            version.0, version.1
        ));
    }
}

/// `[optimizer] kind = "lion"` in a run config: the defaults, explicit values, JSON and
/// TOML round trips, and bad values as errors naming the field.
#[test]
fn lion_round_trips_through_a_config_file() {
    let cfg = RunConfig::from_toml("[optimizer]\nkind = \"lion\"\n").unwrap();
    assert_eq!(
        serde_json::to_string(&cfg.optimizer).unwrap(),
        r#"{"kind":"lion","lr":0.0001,"beta1":0.9,"beta2":0.99,"weight_decay":0.0}"#
    );
    let text =
        "[optimizer]\nkind = \"lion\"\nlr = 3e-4\nbeta1 = 0.95\nbeta2 = 0.98\nweight_decay = 0.1\n";
    let cfg = RunConfig::from_toml(text).unwrap();
    let want: Box<dyn Optimizer> = Box::new(Lion {
        lr: 3e-4,
        beta1: 0.95,
        beta2: 0.98,
        weight_decay: 0.1,
    });
    assert_eq!(
        serde_json::to_string(&cfg.optimizer).unwrap(),
        serde_json::to_string(&want).unwrap()
    );
    assert_eq!(cfg.optimizer.learning_rate(), 3e-4);
    let again = RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    assert_eq!(again.to_toml().unwrap(), cfg.to_toml().unwrap());
    assert!(cfg.to_toml().unwrap().contains("kind = \"lion\""));
    let err = RunConfig::from_toml("[optimizer]\nkind = \"lion\"\nbetas = [0.9, 0.99]\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("betas"), "{err}");
    // A bad value is refused at the first step, naming the field.
    let be = CpuBackend::new();
    let mut bad = Lion {
        beta1: 1.5,
        ..Lion::default()
    };
    let one = upload(&be, &[1.0], &[1], DType::F32, "scale");
    let err = bad
        .update(&be, &mut [], 1e-3, GradScale::new(&one).unwrap(), 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("optimizer.beta1"), "{err}");
}
