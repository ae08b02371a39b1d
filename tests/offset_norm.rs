//! A fused op written outside trainkit through the public kernel door
//! (examples/offset_norm/offset_norm.rs: Gemma's `1 + w` RMS norm, a row reduction with
//! its CPU twin and its own CUDA kernels), put into an existing family (Llama) with an
//! `OpOverride`. It matches its composed reference (trainkit's RMS norm with the gain
//! `1 + w`), gives the CPU's results bit for bit on the CUDA emulator in every dtype, runs
//! in a Llama on the CPU and the emulator with equal losses, keeps recomputation exact, and
//! compiles with NVRTC.
//!
//! The emulator checks skip with a printed reason where no C++ compiler runs, unless
//! `TRAINKIT_REQUIRE_EMULATOR` is set; the NVRTC check skips where NVRTC or the CUDA
//! headers are missing, unless `TRAINKIT_REQUIRE_NVRTC=1`.

mod common;
#[path = "../examples/offset_norm/offset_norm.rs"]
mod offset_norm;

use common::randn;
use offset_norm::{OffsetNorms, KERNELS};
use std::io::Write;
use std::sync::Arc;
use trainkit::checkpoint::{Full, NoRecompute};
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::device::cuda::kernels::{compile, find_include_dir, ptx_entries, CompileOptions};
use trainkit::device::cuda::{probe, CudaBackend};
use trainkit::model::{Rope, RopeScaling};
use trainkit::ops::rmsnorm;
use trainkit::{
    Backend, CheckpointPolicy, CpuBackend, DType, Fp32, Llama, LlamaConfig, MemoryCategory,
    MixedBf16, Precision, Rng, Tensor, Trainer,
};

fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "offset_norm: {line}");
}

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

fn up(be: &dyn Backend, v: &[f32], shape: &[usize], dt: DType) -> Tensor {
    be.upload(v, shape, dt, MemoryCategory::Workspace, "t")
        .unwrap()
}

/// Forward and backward of the op on `be`: out, rstd, dx, dweight.
fn run_op(
    be: &dyn Backend,
    data: &[Vec<f32>; 4],
    rows: usize,
    c: usize,
    dt: DType,
    gt: DType,
) -> Vec<Vec<f32>> {
    let [x, w, d, dx0] = data;
    let (x, w, d) = (
        up(be, x, &[rows, c], dt),
        up(be, w, &[c], dt),
        up(be, d, &[rows, c], dt),
    );
    let mut out = up(be, &vec![0.0; rows * c], &[rows, c], dt);
    let mut rstd = up(be, &vec![0.0; rows], &[rows], DType::F32);
    offset_norm::forward(be, &mut out, &mut rstd, &x, &w, 1e-6).unwrap();
    let mut dx = up(be, dx0, &[rows, c], dt);
    let mut dw = up(be, &vec![0.5; c], &[c], gt);
    offset_norm::backward(be, &mut dx, &mut dw, &d, &x, &w, &rstd).unwrap();
    [&out, &rstd, &dx, &dw]
        .iter()
        .map(|t| be.to_f32(t).unwrap())
        .collect()
}

fn inputs(rows: usize, c: usize, seed: u64) -> [Vec<f32>; 4] {
    let mut rng = Rng::new(seed);
    [
        randn(&mut rng, rows * c, 1.0),
        randn(&mut rng, c, 0.1),
        randn(&mut rng, rows * c, 1.0),
        randn(&mut rng, rows * c, 1.0),
    ]
}

/// The fused op equals trainkit's RMS norm with the gain `1 + w` (its composed reference)
/// to f32 rounding, forward and backward.
#[test]
fn the_fused_op_matches_its_composed_reference() {
    let be = CpuBackend::new();
    let (rows, c) = (7, 40);
    let data = inputs(rows, c, 3);
    let got = run_op(&be, &data, rows, c, DType::F32, DType::F32);
    let [x, w, d, dx0] = &data;
    let gain: Vec<f32> = w.iter().map(|w| 1.0 + w).collect();
    let (x, g, d) = (
        up(&be, x, &[rows, c], DType::F32),
        up(&be, &gain, &[c], DType::F32),
        up(&be, d, &[rows, c], DType::F32),
    );
    let mut out = up(&be, &vec![0.0; rows * c], &[rows, c], DType::F32);
    let mut rstd = up(&be, &vec![0.0; rows], &[rows], DType::F32);
    rmsnorm::forward(&be, &mut out, &mut rstd, &x, &g, 1e-6).unwrap();
    let mut dx = up(&be, dx0, &[rows, c], DType::F32);
    let mut dw = up(&be, &vec![0.5; c], &[c], DType::F32);
    rmsnorm::backward(&be, &mut dx, &mut dw, &d, &x, &g, &rstd).unwrap();
    let want: Vec<Vec<f32>> = [&out, &rstd, &dx, &dw]
        .iter()
        .map(|t| be.to_f32(t).unwrap())
        .collect();
    for (k, name) in ["out", "rstd", "dx", "dweight"].iter().enumerate() {
        for (i, (g, w)) in got[k].iter().zip(&want[k]).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{name}[{i}]: {g} vs {w}"
            );
        }
    }
    // A bad shape is an error naming the op, not a panic.
    let mut bad = up(&be, &vec![0.0; rows], &[rows], DType::F32);
    let err = offset_norm::forward(&be, &mut bad, &mut rstd, &x, &g, 1e-6).unwrap_err();
    assert!(err.to_string().contains("offset_rmsnorm"), "{err}");
}

/// The CUDA kernels, loaded through the public door and run on the emulator, give the CPU
/// twin's results bit for bit, in f32, bf16 and f16, with f32 and bf16 weight gradients;
/// the ledger records the op under its own name.
#[test]
fn the_kernels_match_the_cpu_twin_bit_for_bit_on_the_emulator() {
    let Some(emu) = emulated() else { return };
    kernels_match_the_cpu(&emu);
}

/// On a GPU (the GPU bundle runs this binary there): the same kernels, compiled by NVRTC
/// for the device, give the CPU twin's results bit for bit, and a Llama with the op tracks
/// the CPU's losses.
#[test]
fn the_kernels_run_on_a_gpu_as_on_the_cpu() {
    let info = match probe() {
        Ok(info) => info,
        Err(reason) => {
            say(&format!("GPU checks SKIPPED: no usable GPU ({reason})"));
            return;
        }
    };
    let gpu = CudaBackend::new(info.ordinal)
        .unwrap_or_else(|e| panic!("{info} answers but the backend fails: {e}"));
    say(&format!("GPU checks run on {info}"));
    kernels_match_the_cpu(&gpu);
    let cpu = || Arc::new(CpuBackend::new()) as Arc<dyn Backend>;
    let (want, _) = train(cpu(), Fp32, NoRecompute, 2);
    let (got, _) = train(Arc::new(gpu), Fp32, NoRecompute, 2);
    for (g, w) in got.iter().zip(&want) {
        assert!(((g - w) / w).abs() < 1e-4, "f32 loss {g} vs {w}");
    }
}

/// The op's forward and backward on `cuda` equal the CPU twin's bit for bit, in f32, bf16
/// and f16, with f32 and bf16 weight gradients; loading the file twice is a no-op, and a
/// file reusing one of trainkit's kernel names is refused.
fn kernels_match_the_cpu(emu: &CudaBackend) {
    let cpu = CpuBackend::new();
    for (dt, gt) in [
        (DType::F32, DType::F32),
        (DType::Bf16, DType::F32),
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::F32),
    ] {
        for (rows, c) in [(3usize, 24usize), (37, 5)] {
            let data = inputs(rows, c, 11);
            let want = run_op(&cpu, &data, rows, c, dt, gt);
            let got = run_op(emu, &data, rows, c, dt, gt);
            for (k, name) in ["out", "rstd", "dx", "dweight"].iter().enumerate() {
                for (i, (g, w)) in got[k].iter().zip(&want[k]).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dt}/{gt} {rows}x{c} {name}[{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
    // Loading the same file again is a no-op; a file reusing one of trainkit's kernel
    // names is refused with a message naming it.
    emu.load_kernels(&KERNELS).unwrap();
    let clash = trainkit::device::cuda::KernelFile {
        name: "clash.cu",
        source: "extern \"C\" __global__ void rmsnorm_f32() {}",
        kernels: &["rmsnorm_f32"],
    };
    let err = emu.load_kernels(&clash).unwrap_err().to_string();
    assert!(err.contains("rmsnorm_f32"), "{err}");
}

fn config() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        rope: Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
    }
}

fn loader() -> DataLoader {
    let text = SyntheticCorpus::builtin().generate(20_000, 1);
    DataLoader::new(ByteTokenizer.encode(&text), 2, 16).unwrap()
}

/// Losses and, after the last step, every parameter's values.
fn train<P: Precision + 'static, C: CheckpointPolicy + 'static>(
    be: Arc<dyn Backend>,
    precision: P,
    checkpoint: C,
    steps: usize,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    let model = Llama::new(config()).unwrap().with_override(OffsetNorms);
    let mut t = Trainer::builder(model, be, loader())
        .precision(precision)
        .checkpoint(checkpoint)
        .build()
        .unwrap();
    let losses = (0..steps).map(|_| t.step().unwrap().loss).collect();
    (losses, common::values(&t))
}

/// The override puts the op in every norm of a Llama (five in two layers), and the model
/// trains: recomputation stays bitwise exact, and clones keep the override.
#[test]
fn a_llama_with_the_op_trains_and_recomputes_exactly() {
    let model = Llama::new(config()).unwrap().with_override(OffsetNorms);
    let copy = model.clone();
    let g = copy.graph();
    let names: Vec<&str> = g
        .layers
        .iter()
        .chain([&g.embedding, &g.head])
        .flat_map(|s| &s.nodes)
        .map(|n| n.op.name())
        .collect();
    assert_eq!(names.iter().filter(|n| **n == "offset_rmsnorm").count(), 5);
    assert!(!names.contains(&"rmsnorm"));
    let cpu = || Arc::new(CpuBackend::new()) as Arc<dyn Backend>;
    let (plain, values) = train(cpu(), Fp32, NoRecompute, 4);
    assert!(plain[3] < plain[0], "losses {plain:?}");
    let (full, full_values) = train(cpu(), Fp32, Full, 4);
    assert_eq!(plain, full);
    assert_eq!(values, full_values);
}

/// On the emulator, the Llama with the user's kernels gives the CPU's losses, in f32 and
/// in bf16.
#[test]
fn a_llama_with_the_op_on_the_emulator_tracks_the_cpu() {
    if emulated().is_none() {
        return;
    }
    let emu = || Arc::new(emulated().unwrap()) as Arc<dyn Backend>;
    let cpu = || Arc::new(CpuBackend::new()) as Arc<dyn Backend>;
    let (want, _) = train(cpu(), Fp32, NoRecompute, 2);
    let (got, _) = train(emu(), Fp32, NoRecompute, 2);
    for (g, w) in got.iter().zip(&want) {
        assert!(((g - w) / w).abs() < 1e-5, "f32 loss {g} vs {w}");
    }
    let (want, _) = train(cpu(), MixedBf16::default(), NoRecompute, 2);
    let (got, _) = train(emu(), MixedBf16::default(), NoRecompute, 2);
    for (g, w) in got.iter().zip(&want) {
        assert!(((g - w) / w).abs() < 1e-3, "bf16 loss {g} vs {w}");
    }
}

/// The user kernels compile with NVRTC through trainkit's path (common header prepended)
/// for Hopper and Ampere, to PTX defining exactly the kernels the file lists.
#[test]
fn the_kernels_compile_with_nvrtc() {
    let include = match find_include_dir() {
        Ok(dir) => dir,
        Err(e) => {
            if std::env::var("TRAINKIT_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("TRAINKIT_REQUIRE_NVRTC=1, but NVRTC cannot run: {e}");
            }
            say(&format!("NVRTC check skipped: {e}"));
            return;
        }
    };
    for arch in ["sm_90", "sm_80"] {
        let ptx = match compile(&KERNELS.full_source(), &CompileOptions::new(arch, &include)) {
            Ok(compiled) => compiled.ptx,
            Err(e) if std::env::var("TRAINKIT_REQUIRE_NVRTC").as_deref() != Ok("1") => {
                say(&format!("NVRTC check skipped: {e}"));
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        };
        let mut entries = ptx_entries(&ptx);
        entries.sort();
        let mut want: Vec<&str> = KERNELS.kernels.to_vec();
        want.sort();
        assert_eq!(entries, want, "{arch}");
    }
}
