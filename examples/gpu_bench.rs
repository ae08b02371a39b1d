//! GPU throughput and memory of a full training step (forward, backward, AdamW) for a
//! preset model (GPT-2 124M by default) at sequence length 1024, in FP32, mixed bf16 and
//! mixed fp16 (with its dynamic loss scale): the median and the best of the timed steps
//! after warm-up, the ledger's peak and the pool's, under fp16 the steps the scale
//! skipped, and the model FLOP/s of the median step (the model's `flops_per_token`: 6N +
//! 6·L·h·T for GPT-2) with the MFU when `--peak-tflops` is given.
//!
//! `cargo run --release --example gpu_bench` on a machine with an NVIDIA GPU (driver 580
//! or newer, NVRTC 13.0 and the CUDA headers; see docs/guide.md). Options:
//! `-- --model gpt2|gpt2-xl|llama-3.2-1b|... --batch 8 --seq 1024 --steps 10 --warmup 3
//! --recompute none|selective|full --tf32 --precision all|fp32|bf16|fp16 --ops
//! --kernels --peak-tflops 989 --bias-grad-epilogue --optimizer-offload
//! --optimizer-in-backward --lora 16 --qlora 16 --stream-weights`.
//!
//! `--lora R` trains a LoRA of rank R (α 2R) on every projection over the frozen model,
//! `--qlora R` the same over an NF4 base; `--stream-weights` keeps that frozen base in
//! page-locked host memory and copies each section's weights to the device one section
//! ahead of its use (`StreamFrozen`), and prints what a step streamed and at what rate, so
//! that a streamed run's step time can be set beside the resident one's.
//!
//! `--optimizer-offload` keeps the master weights and optimizer state in host memory and
//! runs the update there (`TrainerOptions::optimizer_offload`);
//! `--optimizer-in-backward` updates each parameter inside backward (without clipping).
//!
//! `--host-link` measures the link to host memory instead: a 256 MiB bf16 tensor copied
//! each way through `Backend::transfer`, from and to page-locked host memory (as the
//! offloaded optimizer's weights and gradients are) and pageable memory.
//!
//! `--bias-grad-epilogue` computes bias gradients in the weight gradient's cuBLASLt
//! epilogue instead of trainkit's column-sum kernel (`CudaOptions::bias_grad_epilogue`),
//! to compare.
//!
//! After the steps, every product's cuBLASLt algorithm is listed with how it was chosen:
//! timed the first time its shape ran (its time and the heuristic's first choice's),
//! saved by an earlier process, or untimed. `--untuned-products` takes the heuristic's
//! first choice for every product (`CudaOptions::tune_products` off), to compare.
//!
//! `--kernels` times every kernel launch and cuBLASLt product of the timed steps with CUDA
//! events (`CudaBackend::time_kernels`), the launches queued as in a plain run, and prints
//! them per kernel: device time per step, calls per step, time per call and share of the
//! steps' wall time, the longest first.
//!
//! `--ops` profiles instead: the backend waits for the GPU at both ends of every op
//! (`CudaOptions::sync_ops`), and after the timed steps each precision prints where the
//! device's time went, op by op (time, calls, GFLOP/s). Its tokens/s are those of the
//! synchronized steps, slower than a plain run's.

use std::sync::Arc;
use std::time::Instant;
use trainkit::data::DataLoader;
use trainkit::device::cuda::{
    probe, ChoiceSource, CudaBackend, CudaOptions, KernelTime, ProductChoice,
};
use trainkit::memory::{format_bytes, MemoryCategory, OpProfile};
use trainkit::{
    Backend, CheckpointPolicy, DType, Fp32, Full, MixedBf16, MixedFp16, ModelConfig, NoRecompute,
    Precision, Rng, Selective, Trainer,
};

struct Args {
    model: String,
    seq: usize,
    peak_tflops: Option<f64>,
    batch: usize,
    steps: usize,
    warmup: usize,
    recompute: String,
    tf32: bool,
    precision: String,
    ops: bool,
    kernels: bool,
    bias_grad_epilogue: bool,
    tiled_attention: bool,
    narrow_attention: bool,
    untuned_products: bool,
    optimizer_offload: bool,
    /// LoRA rank over the frozen model, and whether its base is NF4.
    lora: Option<(usize, bool)>,
    stream_weights: bool,
    optimizer_in_backward: bool,
    host_link: bool,
}

fn args() -> trainkit::Result<Args> {
    let a: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        a.iter()
            .position(|x| x == flag)
            .and_then(|i| a.get(i + 1).cloned())
    };
    let num = |flag: &str, default: usize, least: usize| match get(flag) {
        None => Ok(default),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n >= least => Ok(n),
            _ => Err(trainkit::Error::config(
                flag,
                format!("takes a whole number of at least {least}, not `{v}`"),
            )),
        },
    };
    let one_of = |flag: &str, default: &str, allowed: &[&str]| {
        let v = get(flag).unwrap_or_else(|| default.into());
        if allowed.contains(&v.as_str()) {
            Ok(v)
        } else {
            Err(trainkit::Error::config(
                flag,
                format!("takes one of {}, not `{v}`", allowed.join(", ")),
            ))
        }
    };
    let peak_tflops = match get("--peak-tflops") {
        None => None,
        Some(v) => match v.parse::<f64>() {
            Ok(p) if p.is_finite() && p > 0.0 => Some(p),
            _ => {
                return Err(trainkit::Error::config(
                    "--peak-tflops",
                    format!("takes the device's peak TFLOP/s (e.g. 989), not `{v}`"),
                ))
            }
        },
    };
    Ok(Args {
        model: get("--model").unwrap_or_else(|| "gpt2".into()),
        seq: num("--seq", 1024, 1)?,
        peak_tflops,
        batch: num("--batch", 8, 1)?,
        steps: num("--steps", 10, 1)?,
        warmup: num("--warmup", 3, 0)?,
        recompute: one_of("--recompute", "none", &["none", "selective", "full"])?,
        tf32: a.iter().any(|x| x == "--tf32"),
        precision: one_of("--precision", "all", &["all", "fp32", "bf16", "fp16"])?,
        ops: a.iter().any(|x| x == "--ops"),
        kernels: a.iter().any(|x| x == "--kernels"),
        bias_grad_epilogue: a.iter().any(|x| x == "--bias-grad-epilogue"),
        tiled_attention: a.iter().any(|x| x == "--tiled-attention"),
        narrow_attention: a.iter().any(|x| x == "--narrow-attention"),
        untuned_products: a.iter().any(|x| x == "--untuned-products"),
        optimizer_offload: a.iter().any(|x| x == "--optimizer-offload"),
        lora: match (get("--lora"), get("--qlora")) {
            (Some(_), Some(_)) => {
                return Err(trainkit::Error::config(
                    "--qlora",
                    "give --lora R or --qlora R, not both",
                ))
            }
            (Some(_), None) => Some((num("--lora", 16, 1)?, false)),
            (None, Some(_)) => Some((num("--qlora", 16, 1)?, true)),
            (None, None) => None,
        },
        stream_weights: a.iter().any(|x| x == "--stream-weights"),
        optimizer_in_backward: a.iter().any(|x| x == "--optimizer-in-backward"),
        host_link: a.iter().any(|x| x == "--host-link"),
    })
}

fn run<P: Precision + Default>(
    name: &str,
    backend: Arc<CudaBackend>,
    policy: Box<dyn CheckpointPolicy>,
    a: &Args,
) -> trainkit::Result<()> {
    let config = ModelConfig::preset(&a.model)?;
    let seq = a.seq;
    let vocab = config.vocab_size();
    let mut rng = Rng::new(0);
    let tokens: Vec<u32> = (0..a.batch * seq * (a.warmup + a.steps + 1) + 1)
        .map(|_| rng.below(vocab) as u32)
        .collect();
    let data = DataLoader::new(tokens, a.batch, seq)?;
    let mut model = config.build()?;
    if let Some((rank, nf4)) = a.lora {
        let lora = trainkit::Lora::new(rank, 2.0 * rank as f64, &["all-linear"])?;
        let lora = if nf4 { lora.with_nf4_base() } else { lora };
        model = model.with_adapter(Arc::new(lora))?;
    }
    let flops_per_token = model.flops_per_token(seq);
    let be: Arc<dyn Backend> = backend.clone();
    let mut t = Trainer::builder(model, be, data)
        .precision(P::default())
        .checkpoint(policy)
        .observer(OpProfile::default())
        .options(trainkit::TrainerOptions {
            optimizer_offload: a.optimizer_offload,
            optimizer_in_backward: a.optimizer_in_backward,
            grad_clip: if a.optimizer_in_backward { 0.0 } else { 1.0 },
            placement: if a.stream_weights {
                Box::new(trainkit::StreamFrozen::default())
            } else {
                trainkit::placement::resident()
            },
            ..trainkit::TrainerOptions::default()
        })
        .build()?;
    for _ in 0..a.warmup {
        t.step()?;
    }
    backend.synchronize()?;
    let before_timed = t.observer().clone();
    let mut secs = vec![];
    let mut peak = 0;
    let mut pool_peak = 0;
    let mut skipped = 0;
    let mut streamed = 0;
    let mut waits = vec![];
    let uploads = backend.upload_stats().uploads;
    let moved = backend.host_transfers();
    if a.kernels {
        backend.kernel_times()?;
        backend.time_kernels(true);
    }
    for _ in 0..a.steps {
        let start = Instant::now();
        let before = backend.host_waits();
        let s = t.step()?;
        waits.push(backend.host_waits() - before);
        backend.synchronize()?;
        secs.push(start.elapsed().as_secs_f64());
        peak = peak.max(s.memory.peak_total);
        skipped += s.skipped as usize;
        streamed = streamed.max(s.streamed_bytes);
        if let Some(d) = s.memory.device {
            pool_peak = pool_peak.max(d.pool_reserved_peak);
        }
    }
    secs.sort_by(f64::total_cmp);
    let tok = (a.batch * seq) as f64;
    let median = tok / secs[secs.len() / 2];
    let tflops = median * flops_per_token * 1e-12;
    let mfu = a.peak_tflops.map_or(String::new(), |p| {
        format!(", MFU {:.1}%", 100.0 * tflops / p)
    });
    println!(
        "{name}: {}, batch {} × {seq}, recompute {}: median {median:.0} tokens/s, best {:.0} \
         tokens/s; ledger peak {}, pool peak {}; {skipped} of the timed steps skipped, loss \
         scale {}; model {tflops:.1} TFLOP/s{mfu}",
        a.model,
        a.batch,
        a.recompute,
        tok / secs[0],
        format_bytes(peak),
        format_bytes(pool_peak),
        t.precision().loss_scale()
    );
    // The host waits inside each step (the loss read: one), and the uploads.
    let stats = backend.upload_stats();
    println!(
        "{name}: host waits per step {} (most), uploads per step {:.1}, upload ring {}",
        waits.iter().max().copied().unwrap_or(0),
        (stats.uploads - uploads) as f64 / a.steps as f64,
        format_bytes(stats.ring_bytes)
    );
    if a.stream_weights {
        // What a step streamed, and the rate that needs over the median step.
        let host = t
            .backend()
            .ledger()
            .snapshot()
            .peak
            .get(MemoryCategory::Streamed);
        println!(
            "{name}: streamed {} per step ({:.1} GB/s over the median step), {} of weights in \
             host memory",
            format_bytes(streamed),
            streamed as f64 / secs[secs.len() / 2] / 1e9,
            format_bytes(host)
        );
    }
    if a.optimizer_offload {
        // How the gradients and weights crossed to and from the host's optimizer: queued
        // on the copy stream from page-locked memory, or waited for (pageable).
        let now = backend.host_transfers();
        let (queued, waited) = (now.queued - moved.queued, now.waited - moved.waited);
        let host = t.backend().ledger().snapshot().peak.host();
        println!(
            "{name}: host transfers per step {:.1} queued (page-locked), {:.1} waited \
             (pageable), {} buffers locked; host memory peak {}",
            queued as f64 / a.steps as f64,
            waited as f64 / a.steps as f64,
            now.pinned_buffers,
            format_bytes(host)
        );
    }
    if a.ops {
        print!(
            "{}",
            t.observer().since(&before_timed).table(secs.iter().sum())
        );
    }
    if a.kernels {
        let times = backend.kernel_times()?;
        backend.time_kernels(false);
        kernel_table(name, &times, a.steps, secs.iter().sum());
    }
    Ok(())
}

/// The per-kernel table of `--kernels`: per step over `steps` steps that took `wall`
/// seconds in all.
fn kernel_table(name: &str, times: &[KernelTime], steps: usize, wall: f64) {
    let total: f64 = times.iter().map(|t| t.millis).sum();
    let per_step = |v: f64| v / steps as f64;
    println!(
        "{name}: kernels, device time per step {:.2} ms of {:.2} ms wall ({} kinds)",
        per_step(total),
        per_step(wall * 1e3),
        times.len()
    );
    println!(
        "{:<56} {:>9} {:>7} {:>10} {:>6}",
        "kernel", "ms/step", "calls", "us/call", "share"
    );
    for t in times {
        println!(
            "{:<56} {:>9.3} {:>7.1} {:>10.1} {:>5.1}%",
            t.name,
            per_step(t.millis),
            per_step(t.calls as f64),
            1e3 * t.millis / t.calls as f64,
            100.0 * t.millis / (wall * 1e3)
        );
    }
}

/// The GPU's link to its host memory: a 256 MiB bf16 tensor copied each way, from and to
/// page-locked and pageable host memory; the median and the best of 7 copies after one.
fn host_link(backend: &CudaBackend) -> trainkit::Result<()> {
    let n = 128 << 20;
    let bytes = 2.0 * n as f64;
    let host = backend.host().expect("the CUDA backend has host memory");
    let mut device = backend.zeros(&[n], DType::Bf16, MemoryCategory::Gradients, "link")?;
    // Gradients are page-locked in host memory held for the GPU; a workspace is not.
    for (kind, category) in [
        ("page-locked", MemoryCategory::Gradients),
        ("pageable", MemoryCategory::Workspace),
    ] {
        let mut h = host.zeros(&[n], DType::Bf16, category, "link")?;
        let time = |f: &mut dyn FnMut() -> trainkit::Result<()>| {
            f()?;
            let mut s = vec![];
            for _ in 0..7 {
                let start = Instant::now();
                f()?;
                s.push(start.elapsed().as_secs_f64());
            }
            s.sort_by(f64::total_cmp);
            Ok::<_, trainkit::Error>((bytes / s[3] / 1e9, bytes / s[0] / 1e9))
        };
        let down = time(&mut || backend.transfer(&mut h, &device))?;
        let up = time(&mut || backend.transfer(&mut device, &h))?;
        println!(
            "host link, {kind}: device to host {:.1} GB/s (best {:.1}), host to device {:.1} \
             GB/s (best {:.1}); {:?}",
            down.0,
            down.1,
            up.0,
            up.1,
            backend.host_transfers()
        );
    }
    Ok(())
}

fn policy(name: &str) -> Box<dyn CheckpointPolicy> {
    match name {
        "selective" => Box::new(Selective),
        "full" => Box::new(Full),
        _ => Box::new(NoRecompute),
    }
}

fn main() {
    if let Err(e) = bench() {
        eprintln!("gpu_bench: {e}");
        std::process::exit(1);
    }
}

fn bench() -> trainkit::Result<()> {
    let a = args()?;
    let info = match probe() {
        Ok(info) => info,
        Err(reason) => {
            println!("gpu_bench needs a GPU: {reason}");
            return Ok(());
        }
    };
    println!("device: {info}");
    let backend = Arc::new(CudaBackend::with_options(
        info.ordinal,
        CudaOptions {
            allow_tf32: a.tf32,
            sync_ops: a.ops,
            bias_grad_epilogue: a.bias_grad_epilogue,
            tiled_attention: a.tiled_attention,
            narrow_attention: a.narrow_attention,
            tune_products: !a.untuned_products,
        },
    )?);
    println!("libraries: {}", backend.describe());
    if a.host_link {
        return host_link(&backend);
    }
    if a.ops {
        println!("profiling: every op waits for the GPU at both ends (slower steps)");
    }
    if a.bias_grad_epilogue {
        println!("bias gradients: in the weight gradient's cuBLASLt epilogue");
    }
    let all = a.precision == "all";
    if !all && !["fp32", "bf16", "fp16"].contains(&a.precision.as_str()) {
        println!(
            "--precision takes all, fp32, bf16 or fp16, not `{}`",
            a.precision
        );
        std::process::exit(2);
    }
    if all || a.precision == "fp32" {
        run::<Fp32>(
            if a.tf32 { "fp32 (tf32 on)" } else { "fp32" },
            backend.clone(),
            policy(&a.recompute),
            &a,
        )?;
    }
    if all || a.precision == "bf16" {
        run::<MixedBf16>("bf16 mixed", backend.clone(), policy(&a.recompute), &a)?;
    }
    if all || a.precision == "fp16" {
        run::<MixedFp16>("fp16 mixed", backend.clone(), policy(&a.recompute), &a)?;
    }
    product_table(&backend.product_choices());
    Ok(())
}

/// How each product's cuBLASLt algorithm was chosen, one line a shape.
fn product_table(choices: &[ProductChoice]) {
    let count = |s| choices.iter().filter(|c| c.source == s).count();
    let moved = choices
        .iter()
        .filter(|c| c.source != ChoiceSource::Heuristic && c.chosen != 0)
        .count();
    println!(
        "products: {} shapes, {} timed, {} saved by an earlier run, {} untimed; {moved} run \
         another algorithm than the heuristic's first",
        choices.len(),
        count(ChoiceSource::Timed),
        count(ChoiceSource::Saved),
        count(ChoiceSource::Heuristic)
    );
    for c in choices {
        let how = match (c.source, c.first_us, c.chosen_us) {
            (ChoiceSource::Timed, Some(first), Some(chosen)) => format!(
                "timed: candidate {} of {}, {chosen:.1} µs a run (the heuristic's first \
                 {first:.1} µs, {:.2}×)",
                c.chosen + 1,
                c.candidates,
                first / chosen
            ),
            (ChoiceSource::Timed, _, Some(chosen)) => format!(
                "timed: candidate {} of {}, {chosen:.1} µs a run (the heuristic's first \
                 failed)",
                c.chosen + 1,
                c.candidates
            ),
            (ChoiceSource::Saved, ..) if c.chosen < c.candidates => {
                format!("saved: candidate {} of {}", c.chosen + 1, c.candidates)
            }
            (ChoiceSource::Saved, ..) => "saved: not among the heuristic's candidates now".into(),
            _ => format!("untimed, the heuristic's first of {}", c.candidates),
        };
        println!("  {}: {how}", c.name);
    }
}
