//! The host side of optimizer offload, measured: this machine's memory bandwidth (a copy
//! and a triad over arrays far larger than the caches, on every core), then the AdamW
//! update the offloaded optimizer runs on the host (f32 master weights and moments, the
//! gradient in f32 or bf16, the bf16 compute weights written from the master copy) in
//! parameters per second and in GB/s of state traffic, beside that bandwidth; and the
//! copies across the host boundary (`Backend::transfer`) per parameter.
//!
//! `cargo run --release --example host_adamw` (`-- --elements N` sets the size of each
//! tensor, 2²⁵ by default; `-- --grad bf16` the gradient's dtype, f32 by default).

use rayon::prelude::*;
use std::time::Instant;
use trainkit::memory::MemoryCategory;
use trainkit::optim::adamw::{update, AdamWStep};
use trainkit::{Backend, CpuBackend, DType};

/// Seconds of the fastest and of the median of `runs` calls of `f`, after one warm-up.
fn time(runs: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[runs / 2])
}

fn gbs(bytes: f64, seconds: f64) -> f64 {
    bytes / seconds / 1e9
}

fn main() -> trainkit::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let n: usize = value("--elements").map_or(1 << 25, |v| v.parse().expect("--elements N"));
    let grad_dtype = match value("--grad").as_deref() {
        None | Some("f32") => DType::F32,
        Some("bf16") => DType::Bf16,
        Some(other) => panic!("--grad takes f32 or bf16, not {other}"),
    };
    let runs = 7;
    println!(
        "{n} elements per tensor, {} threads, gradient {grad_dtype}",
        rayon::current_num_threads()
    );

    // Memory bandwidth: copy (4 bytes read, 4 written per element) and triad (8 read, 4
    // written), rayon over the same chunks the CPU kernels use.
    let chunk = 1 << 16;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut c = vec![0f32; n];
    let (copy_best, copy_median) = time(runs, || {
        c.par_chunks_mut(chunk)
            .zip(a.par_chunks(chunk))
            .for_each(|(c, a)| c.copy_from_slice(a));
    });
    let (triad_best, triad_median) = time(runs, || {
        c.par_chunks_mut(chunk)
            .zip(a.par_chunks(chunk).zip(b.par_chunks(chunk)))
            .for_each(|(c, (a, b))| {
                for i in 0..c.len() {
                    c[i] = a[i] + 0.5 * b[i];
                }
            });
    });
    // In place, as AdamW writes its state: c = 0.5·c + a (8 bytes read, 4 written, and
    // no line fetched only to be overwritten).
    let (rmw_best, rmw_median) = time(runs, || {
        c.par_chunks_mut(chunk)
            .zip(a.par_chunks(chunk))
            .for_each(|(c, a)| {
                for i in 0..c.len() {
                    c[i] = 0.5 * c[i] + a[i];
                }
            });
    });
    std::hint::black_box(&c);
    let copy_bw = gbs(8.0 * n as f64, copy_best);
    let triad_bw = gbs(12.0 * n as f64, triad_best);
    let rmw_bw = gbs(12.0 * n as f64, rmw_best);
    println!(
        "memory bandwidth: copy {copy_bw:.1} GB/s (median {:.1}), triad {triad_bw:.1} GB/s \
         (median {:.1}), in place {rmw_bw:.1} GB/s (median {:.1}); bytes counted as the \
         program reads and writes them",
        gbs(8.0 * n as f64, copy_median),
        gbs(12.0 * n as f64, triad_median),
        gbs(12.0 * n as f64, rmw_median)
    );
    drop((a, b, c));

    // The host AdamW update of an offloaded parameter: f32 master weights and moments,
    // the gradient, and the bf16 compute weights written from the master copy.
    let be = CpuBackend::new();
    let upload = |dtype: DType, scale: f32, label: &str| {
        let v: Vec<f32> = (0..n)
            .map(|i| ((i % 1013) as f32 - 506.0) * scale)
            .collect();
        be.upload(&v, &[n], dtype, MemoryCategory::Offloaded, label)
    };
    let mut p = upload(DType::F32, 1e-3, "p")?;
    let g = upload(grad_dtype, 1e-4, "g")?;
    let mut m = upload(DType::F32, 0.0, "m")?;
    let mut v = upload(DType::F32, 0.0, "v")?;
    let mut w = upload(DType::Bf16, 0.0, "w")?;
    let mut step = 0;
    let (best, median) = time(runs, || {
        step += 1;
        let hp = AdamWStep {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 1.0,
        };
        update(&be, &mut p, &g, &mut m, &mut v, &hp, None, None).unwrap();
        be.cast(&mut w, &p).unwrap();
    });
    // Read p, m, v and g, write p, m and v; then read p and write the bf16 weights.
    let bytes = (12 + grad_dtype.size() + 12 + 4 + 2) as f64 * n as f64;
    println!(
        "host AdamW: {:.0} M params/s (median {:.0}), {:.1} GB/s of state traffic ({} bytes \
         per parameter), {:.0}% of the in-place bandwidth",
        n as f64 / best / 1e6,
        n as f64 / median / 1e6,
        gbs(bytes, best),
        bytes as usize / n,
        100.0 * gbs(bytes, best) / rmw_bw
    );

    // The copies across the host boundary: the gradient in, the compute weights out.
    let host = be.host().expect("the CPU backend has host memory");
    let mut g_host = host.empty(&[n], grad_dtype, MemoryCategory::Gradients, "g")?;
    let (g_best, _) = time(runs, || be.transfer(&mut g_host, &g).unwrap());
    let w_host = host.empty(&[n], DType::Bf16, MemoryCategory::Weights, "w")?;
    let (w_best, _) = time(runs, || be.transfer(&mut w, &w_host).unwrap());
    println!(
        "transfer: gradient {:.1} GB/s, compute weights {:.1} GB/s (a memory copy on the CPU; \
         over PCIe on a GPU)",
        gbs(2.0 * (grad_dtype.size() * n) as f64, g_best),
        gbs(2.0 * (2 * n) as f64, w_best)
    );
    let seconds_per_billion = 1e9 / (n as f64 / best);
    println!(
        "an update of 1B parameters on this host: {seconds_per_billion:.2} s ({:.0} GB of state \
         traffic)",
        bytes / n as f64
    );
    Ok(())
}
