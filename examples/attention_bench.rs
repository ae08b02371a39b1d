//! The fused attention's forward and backward alone, at the shapes of the models trainkit
//! trains (GPT-2 124M, Llama 3.2 1B, Llama 3.1 8B), on the tensor-core kernels in their
//! wide tiling (the default) and in their narrow one (`CudaOptions::narrow_attention`), and
//! on the tiled kernels: milliseconds per call (the median of `--iters` timed calls, each batch of
//! calls between two waits for the GPU) and TFLOP/s by the published convention (causal
//! forward 2·B·H·T²·D, half the square's 4·B·H·T²·D; backward 2.5 times the forward).
//! `benches/reference/attention_sdpa.py` times PyTorch's scaled_dot_product_attention at
//! the same shapes, so the bundle runs the two side by side.
//!
//! `cargo run --release --example attention_bench -- [--iters 20] [--dtype bf16|f16]
//! [--json FILE]`. Prints one line per (shape, kernels, direction), and with `--json`
//! writes them as JSON lines. Needs a GPU; says so and exits 0 without one.

#[path = "support/timing.rs"]
mod timing;

use std::io::Write;
use timing::time;
use trainkit::device::cuda::{probe, CudaBackend, CudaOptions};
use trainkit::memory::MemoryCategory;
use trainkit::ops::flash_attention;
use trainkit::ops::Heads;
use trainkit::{Backend, DType, Rng};

/// A shape of the benchmark: its name, batch, sequence, query heads, key/value heads, head
/// size.
struct Shape {
    name: &'static str,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "gpt2-124m",
        b: 8,
        t: 1024,
        h: 12,
        kv: 12,
        d: 64,
    },
    Shape {
        name: "llama-3.2-1b",
        b: 4,
        t: 2048,
        h: 32,
        kv: 8,
        d: 64,
    },
    Shape {
        name: "llama-3.1-8b",
        b: 4,
        t: 2048,
        h: 32,
        kv: 8,
        d: 128,
    },
];

fn main() {
    if let Err(e) = bench() {
        eprintln!("attention_bench: {e}");
        std::process::exit(1);
    }
}

fn bench() -> trainkit::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let iters: usize = match get("--iters") {
        Some(v) => v.parse().map_err(|_| {
            trainkit::Error::config("--iters", format!("`{v}` is not a count of timed calls"))
        })?,
        None => 20,
    };
    let dtype = match get("--dtype").as_deref() {
        None | Some("bf16") => DType::Bf16,
        Some("f16") => DType::F16,
        Some(other) => {
            return Err(trainkit::Error::config(
                "--dtype",
                format!("`{other}` is not one of bf16, f16"),
            ))
        }
    };
    let mut json =
        match get("--json") {
            Some(path) => Some(std::fs::File::create(&path).map_err(|e| {
                trainkit::Error::config("--json", format!("cannot write {path}: {e}"))
            })?),
            None => None,
        };
    let info = match probe() {
        Ok(info) => info,
        Err(reason) => {
            println!("attention_bench needs a GPU: {reason}");
            return Ok(());
        }
    };
    println!("device: {info}");
    let fast = CudaBackend::new(info.ordinal)?;
    let with = |options| CudaBackend::with_options(info.ordinal, options);
    let narrow = with(CudaOptions {
        narrow_attention: true,
        ..CudaOptions::default()
    })?;
    let tiled = with(CudaOptions {
        tiled_attention: true,
        ..CudaOptions::default()
    })?;
    let cat = MemoryCategory::Activations;
    for s in SHAPES {
        let heads = Heads {
            n_head: s.h,
            n_kv_head: s.kv,
            head_dim: s.d,
        };
        let (w, c) = (heads.qkv_width(), heads.q_width());
        let mut rng = Rng::new(7);
        let qkv_host: Vec<f32> = (0..s.b * s.t * w).map(|_| rng.normal() as f32).collect();
        let dout_host: Vec<f32> = (0..s.b * s.t * c).map(|_| rng.normal() as f32).collect();
        let flops_fwd = 2.0 * (s.b * s.h * s.d) as f64 * (s.t * s.t) as f64;
        let runs = [
            ("tensor-core", &fast),
            ("tensor-core-narrow", &narrow),
            ("tiled", &tiled),
        ];
        for (kernels, be) in runs {
            let qkv = be.upload(&qkv_host, &[s.b, s.t, w], dtype, cat, "qkv")?;
            let dout = be.upload(&dout_host, &[s.b, s.t, c], dtype, cat, "dout")?;
            let mut out = be.zeros(&[s.b, s.t, c], dtype, cat, "out")?;
            let mut lse = be.zeros(&[s.b, s.h, s.t], DType::F32, cat, "lse")?;
            let mut dqkv = be.zeros(&[s.b, s.t, w], dtype, cat, "dqkv")?;
            let fwd = time(be, iters, || {
                flash_attention::forward(be, &mut out, &mut lse, &qkv, heads)
            })?;
            let bwd = time(be, iters, || {
                flash_attention::backward(be, &mut dqkv, &dout, &out, &lse, &qkv, heads)
            })?;
            for (dir, ms, flops) in [
                ("forward", fwd, flops_fwd),
                ("backward", bwd, 2.5 * flops_fwd),
            ] {
                let tflops = flops / (ms * 1e-3) / 1e12;
                println!(
                    "{:<13} B={} T={} H={} KV={} D={} {dtype} {kernels:<18} {dir:<8} {ms:8.3} ms {tflops:7.1} TFLOP/s",
                    s.name, s.b, s.t, s.h, s.kv, s.d
                );
                if let Some(f) = json.as_mut() {
                    writeln!(
                        f,
                        "{{\"shape\": \"{}\", \"b\": {}, \"t\": {}, \"h\": {}, \"kv\": {}, \"d\": {}, \
                         \"dtype\": \"{dtype}\", \"impl\": \"trainkit-{kernels}\", \"direction\": \"{dir}\", \
                         \"ms\": {ms:.4}, \"tflops\": {tflops:.2}}}",
                        s.name, s.b, s.t, s.h, s.kv, s.d
                    )
                    .map_err(|e| trainkit::Error::config("--json", e.to_string()))?;
                }
            }
        }
    }
    Ok(())
}
