//! The memory-bound kernels alone, at the shapes of the models trainkit trains: LayerNorm
//! forward and backward (GPT-2 124M: 8 × 1024 rows of 768), RMSNorm forward and backward
//! (Llama 3.2 1B: 8 × 1024 rows of 2048) in bf16 with f32 gain gradients, and AdamW over
//! every parameter of GPT-2 124M (f32 values, gradients and moments, the bf16 compute copy
//! written in the same pass, as mixed precision runs it). Milliseconds per call (the median
//! of `--iters` timings of 5 calls between two waits for the GPU), the bytes each call
//! must move (every input read once, every output written once) and that rate against
//! `--bandwidth` GB/s (the device's peak). `benches/reference/norms_adamw.py` times
//! PyTorch's `F.layer_norm`, `F.rms_norm` and fused AdamW at the same shapes, so the bundle
//! runs the two side by side.
//!
//! `cargo run --release --example kernel_bench -- [--iters 20] [--bandwidth 3350]
//! [--json FILE] [--emulator]`. Needs a GPU; says so and exits 0 without one
//! (`--emulator` runs the calls on the CUDA emulator instead, to try the code).

#[path = "support/timing.rs"]
mod timing;

use std::io::Write;
use timing::time;
use trainkit::device::cuda::{probe, CudaBackend};
use trainkit::memory::MemoryCategory;
use trainkit::ops::{layernorm, rmsnorm};
use trainkit::optim::adamw::{update_many, AdamWStep, AdamWTensor};
use trainkit::{Backend, DType, ModelConfig, Rng, Tensor};

fn main() {
    if let Err(e) = bench() {
        eprintln!("kernel_bench: {e}");
        std::process::exit(1);
    }
}

/// One timed kernel: its name, shape, time and bytes.
struct Row {
    kernel: &'static str,
    shape: String,
    ms: f64,
    bytes: f64,
}

fn random(
    be: &CudaBackend,
    rng: &mut Rng,
    shape: &[usize],
    dtype: DType,
) -> trainkit::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    be.upload(&v, shape, dtype, MemoryCategory::Activations, "bench")
}

fn bench() -> trainkit::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let number = |flag: &str, default: f64| -> trainkit::Result<f64> {
        match get(flag) {
            Some(v) => v.parse::<f64>().ok().filter(|x| *x > 0.0).ok_or_else(|| {
                trainkit::Error::config(flag, format!("`{v}` is not a positive number"))
            }),
            None => Ok(default),
        }
    };
    let iters = number("--iters", 20.0)? as usize;
    let bandwidth = number("--bandwidth", 3350.0)?;
    let mut json =
        match get("--json") {
            Some(path) => Some(std::fs::File::create(&path).map_err(|e| {
                trainkit::Error::config("--json", format!("cannot write {path}: {e}"))
            })?),
            None => None,
        };
    // `--emulator`: the same calls on the CUDA emulator (a rehearsal of the code; its
    // times say nothing of a GPU).
    let be = if args.iter().any(|a| a == "--emulator") {
        println!("device: the CUDA emulator (times are the host's)");
        CudaBackend::emulated()?
    } else {
        match probe() {
            Ok(info) => {
                println!("device: {info}");
                CudaBackend::new(info.ordinal)?
            }
            Err(reason) => {
                println!("kernel_bench needs a GPU: {reason}");
                return Ok(());
            }
        }
    };
    let mut rng = Rng::new(3);
    let (bf16, f32) = (DType::Bf16, DType::F32);
    let mut rows = Vec::new();

    // LayerNorm, GPT-2 124M.
    let (n, c) = (8 * 1024, 768);
    let x = random(&be, &mut rng, &[n, c], bf16)?;
    let dout = random(&be, &mut rng, &[n, c], bf16)?;
    let (w, b) = (
        random(&be, &mut rng, &[c], bf16)?,
        random(&be, &mut rng, &[c], bf16)?,
    );
    let mut out = be.zeros(&[n, c], bf16, MemoryCategory::Activations, "out")?;
    let mut stats = be.zeros(&[n, 2], f32, MemoryCategory::Activations, "stats")?;
    let mut dx = be.zeros(&[n, c], bf16, MemoryCategory::Activations, "dx")?;
    let mut dw = be.zeros(&[c], f32, MemoryCategory::Gradients, "dw")?;
    let mut db = be.zeros(&[c], f32, MemoryCategory::Gradients, "db")?;
    let e = (n * c * 2) as f64;
    let ms = time(&be, iters, || {
        layernorm::forward(&be, &mut out, &mut stats, &x, &w, &b, 1e-5)
    })?;
    rows.push(Row {
        kernel: "layernorm forward",
        shape: format!("{n} x {c} bf16"),
        ms,
        bytes: 2.0 * e + (n * 8) as f64,
    });
    let ms = time(&be, iters, || {
        layernorm::backward(&be, &mut dx, &mut dw, &mut db, &dout, &x, &w, &stats)
    })?;
    // dout and x read, dx read and written (it accumulates), the statistics read.
    rows.push(Row {
        kernel: "layernorm backward",
        shape: format!("{n} x {c} bf16"),
        ms,
        bytes: 4.0 * e + (n * 8) as f64,
    });

    // RMSNorm, Llama 3.2 1B.
    let (n, c) = (8 * 1024, 2048);
    let x = random(&be, &mut rng, &[n, c], bf16)?;
    let dout = random(&be, &mut rng, &[n, c], bf16)?;
    let w = random(&be, &mut rng, &[c], bf16)?;
    let mut out = be.zeros(&[n, c], bf16, MemoryCategory::Activations, "out")?;
    let mut rstd = be.zeros(&[n], f32, MemoryCategory::Activations, "rstd")?;
    let mut dx = be.zeros(&[n, c], bf16, MemoryCategory::Activations, "dx")?;
    let mut dw = be.zeros(&[c], f32, MemoryCategory::Gradients, "dw")?;
    let e = (n * c * 2) as f64;
    let ms = time(&be, iters, || {
        rmsnorm::forward(&be, &mut out, &mut rstd, &x, &w, 1e-5)
    })?;
    rows.push(Row {
        kernel: "rmsnorm forward",
        shape: format!("{n} x {c} bf16"),
        ms,
        bytes: 2.0 * e + (n * 4) as f64,
    });
    let ms = time(&be, iters, || {
        rmsnorm::backward(&be, &mut dx, &mut dw, &dout, &x, &w, &rstd)
    })?;
    rows.push(Row {
        kernel: "rmsnorm backward",
        shape: format!("{n} x {c} bf16"),
        ms,
        bytes: 4.0 * e + (n * 4) as f64,
    });

    // AdamW over GPT-2 124M's parameters.
    let model = ModelConfig::preset("gpt2")?.build()?;
    let shapes: Vec<Vec<usize>> = model.init_params().into_iter().map(|p| p.shape).collect();
    let mut state = Vec::new();
    for s in &shapes {
        state.push((
            random(&be, &mut rng, s, f32)?,
            random(&be, &mut rng, s, f32)?,
            be.zeros(s, f32, MemoryCategory::OptimizerState, "m")?,
            be.zeros(s, f32, MemoryCategory::OptimizerState, "v")?,
            be.zeros(s, bf16, MemoryCategory::Weights, "compute")?,
        ));
    }
    let elements: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let mut step = 0u64;
    let ms = time(&be, iters, || {
        step += 1;
        let hp = AdamWStep {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 1.0,
        };
        let mut tensors: Vec<AdamWTensor<'_>> = state
            .iter_mut()
            .map(|(p, g, m, v, c)| AdamWTensor {
                decays: p.shape().len() >= 2,
                param: p,
                grad: g,
                m,
                v,
                compute: Some(c),
            })
            .collect();
        update_many(&be, &mut tensors, &hp, None)
    })?;
    // The value, gradient and moments read, the value and moments written, the bf16 copy
    // written: 30 bytes an element.
    rows.push(Row {
        kernel: "adamw",
        shape: format!(
            "gpt2 124M, {elements} f32 elements, {} tensors",
            shapes.len()
        ),
        ms,
        bytes: 30.0 * elements as f64,
    });

    for r in rows {
        let gbs = r.bytes / (r.ms * 1e-3) / 1e9;
        let pct = 100.0 * gbs / bandwidth;
        println!(
            "{:<20} {:<44} {:9.4} ms {:8.0} GB/s {:5.1}% of {bandwidth:.0} GB/s",
            r.kernel, r.shape, r.ms, gbs, pct
        );
        if let Some(f) = json.as_mut() {
            writeln!(
                f,
                "{{\"kernel\": \"{}\", \"impl\": \"trainkit\", \"shape\": \"{}\", \"ms\": {:.4}, \
                 \"bytes\": {:.0}, \"gb_s\": {gbs:.1}, \"pct_of_bandwidth\": {pct:.1}}}",
                r.kernel, r.shape, r.ms, r.bytes
            )
            .map_err(|e| trainkit::Error::config("--json", e.to_string()))?;
        }
    }
    Ok(())
}
