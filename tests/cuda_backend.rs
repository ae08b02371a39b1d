//! The CUDA backend against its CPU twin: every op on fresh random inputs of several
//! shapes, a full training step in both precisions, the recompute policies, and (on a GPU)
//! the default run's first 50 steps.
//!
//! Each check runs on every CUDA backend this machine has: the CUDA emulator (trainkit's
//! kernels compiled for the host, always present where a C++ compiler is; CI requires it),
//! and a real GPU when one answers. Where one is missing the tests say so plainly on
//! stderr. Relative error (max |cuda − cpu| / max |cpu|) must stay under 1e-5 for f32
//! and 1e-2 for bf16; outputs are poisoned (NaN) before each op, so an element a kernel
//! fails to write shows up.

mod common;

use common::{corpus_loader, grads, randn, tiny_config, values};
use std::sync::{Arc, OnceLock};
use trainkit::device::cuda::{probe, ChoiceSource, CudaBackend, CudaOptions};
use trainkit::ops::Heads;
use trainkit::ops::{
    attention, cross_entropy, embedding, flash_attention, gelu, glu, layernorm, linear, qk_norm,
    rmsnorm, rope, Gate,
};
use trainkit::optim::{adamw, adamw8bit, guard, AdamWStep, QuantizedMoments};
use trainkit::{
    Backend, CheckpointPolicy, CpuBackend, DType, Full, Gpt2, MemoryCategory, MixedBf16, MixedFp16,
    NoRecompute, Precision, Rng, Selective, Tensor, Trainer,
};

/// Writes a line to the real stderr, past the test harness's capture, so that a skipped
/// check is visible in every run.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "cuda_backend: {line}");
}

/// The emulated backend, built once per test process (or `None`, said on stderr).
fn emulated() -> Option<Arc<CudaBackend>> {
    static EMU: OnceLock<Option<Arc<CudaBackend>>> = OnceLock::new();
    EMU.get_or_init(|| match CudaBackend::emulated() {
        Ok(b) => Some(Arc::new(b)),
        Err(e) => {
            if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}");
            }
            say(&format!("CUDA emulator checks SKIPPED: {e}"));
            None
        }
    })
    .clone()
}

/// The GPU backend when a GPU answers (or `None`, said on stderr).
fn gpu() -> Option<Arc<CudaBackend>> {
    static GPU: OnceLock<Option<Arc<CudaBackend>>> = OnceLock::new();
    GPU.get_or_init(|| match probe() {
        Ok(info) => {
            let b = CudaBackend::new(info.ordinal)
                .unwrap_or_else(|e| panic!("{info} answers but the backend fails: {e}"));
            say(&format!("GPU checks run on {info}"));
            Some(Arc::new(b))
        }
        Err(reason) => {
            say(&format!("GPU checks SKIPPED: no usable GPU ({reason})"));
            None
        }
    })
    .clone()
}

/// A new backend of each kind available here, named: for the tests that count a
/// backend's host waits or uploads (the shared ones count the other tests' too).
fn own_backends() -> Vec<(&'static str, Arc<CudaBackend>)> {
    let mut own = vec![];
    if emulated().is_some() {
        own.push(("emulator", Arc::new(CudaBackend::emulated().unwrap())));
    }
    if gpu().is_some() {
        own.push(("gpu", Arc::new(CudaBackend::new(0).unwrap())));
    }
    own
}

/// Every CUDA backend available here, named.
fn cuda_backends() -> Vec<(&'static str, Arc<CudaBackend>)> {
    let mut v = vec![];
    if let Some(b) = emulated() {
        v.push(("emulator", b));
    }
    if let Some(b) = gpu() {
        v.push(("gpu", b));
    }
    v
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::Bf16 => 1e-2,
        DType::F16 => 1e-2,
        DType::U8 | DType::Nf4(_) => 0.0,
    }
}

/// Max |got − want| / max |want| (NaN anywhere in `got` where `want` is finite fails).
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want
        .iter()
        .map(|x| x.abs() as f64)
        .fold(0.0, f64::max)
        .max(1e-30);
    let mut worst = 0f64;
    for (g, w) in got.iter().zip(want) {
        if w.is_finite() && !g.is_finite() {
            return f64::INFINITY;
        }
        worst = worst.max((*g as f64 - *w as f64).abs());
    }
    worst / scale
}

fn check(what: &str, backend: &str, got: &[f32], want: &[f32], dtype: DType) {
    let e = rel_err(got, want);
    assert!(
        e <= tol(dtype),
        "{backend}: {what} ({dtype}) relative error {e:.3e} > {:.0e}; first values got {:?} want {:?}",
        tol(dtype),
        &got[..got.len().min(6)],
        &want[..want.len().min(6)]
    );
}

/// The same values on the CPU and on a CUDA backend.
struct Pair {
    cpu: Tensor,
    cuda: Tensor,
}

fn pair(cpu: &CpuBackend, cuda: &CudaBackend, data: &[f32], shape: &[usize], dt: DType) -> Pair {
    let up = |b: &dyn Backend| {
        b.upload(data, shape, dt, MemoryCategory::Activations, "x")
            .unwrap()
    };
    Pair {
        cpu: up(cpu),
        cuda: up(cuda),
    }
}

/// An output pair: zeros on the CPU, NaN on the device (overwritten by the op).
fn out(cpu: &CpuBackend, cuda: &CudaBackend, shape: &[usize], dt: DType) -> Pair {
    let mut p = Pair {
        cpu: cpu
            .zeros(shape, dt, MemoryCategory::Activations, "out")
            .unwrap(),
        cuda: cuda
            .zeros(shape, dt, MemoryCategory::Activations, "out")
            .unwrap(),
    };
    cuda.fill(&mut p.cuda, f32::NAN).unwrap();
    p
}

fn compare(what: &str, name: &str, cpu: &CpuBackend, cuda: &CudaBackend, p: &Pair) {
    let want = cpu.to_f32(&p.cpu).unwrap();
    let got = cuda.to_f32(&p.cuda).unwrap();
    check(what, name, &got, &want, p.cpu.dtype());
}

const DTYPES: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

/// Whether the CUDA backend has kernels for this mix of dtypes: bf16 and f16 never meet in
/// one op (a run computes in one of them).
fn instantiated(dtypes: &[DType]) -> bool {
    !(dtypes.contains(&DType::Bf16) && dtypes.contains(&DType::F16))
}

#[test]
fn elementwise_ops_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(1);
    for (name, cuda) in cuda_backends() {
        for n in [1usize, 7, 300, 1500] {
            for da in DTYPES {
                for db in DTYPES {
                    if !instantiated(&[da, db]) {
                        continue;
                    }
                    let a = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], da);
                    let b = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], db);
                    for dout in DTYPES {
                        if !instantiated(&[da, db, dout]) {
                            continue;
                        }
                        let mut o = out(&cpu, &cuda, &[n], dout);
                        cpu.add(&mut o.cpu, &a.cpu, &b.cpu).unwrap();
                        cuda.add(&mut o.cuda, &a.cuda, &b.cuda).unwrap();
                        compare(&format!("add {da}+{db} n={n}"), name, &cpu, &cuda, &o);
                    }
                    // cast b into a's dtype
                    let mut o = out(&cpu, &cuda, &[n], da);
                    cpu.cast(&mut o.cpu, &b.cpu).unwrap();
                    cuda.cast(&mut o.cuda, &b.cuda).unwrap();
                    compare(&format!("cast {db}→{da} n={n}"), name, &cpu, &cuda, &o);
                    // y += alpha x
                    let mut y = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], da);
                    cpu.axpy(&mut y.cpu, -0.37, &b.cpu).unwrap();
                    cuda.axpy(&mut y.cuda, -0.37, &b.cuda).unwrap();
                    compare(&format!("axpy {da}+={db} n={n}"), name, &cpu, &cuda, &y);
                }
                let mut x = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], da);
                cpu.scale(&mut x.cpu, 1.7).unwrap();
                cuda.scale(&mut x.cuda, 1.7).unwrap();
                compare(&format!("scale {da} n={n}"), name, &cpu, &cuda, &x);
                cpu.fill(&mut x.cpu, 0.3).unwrap();
                cuda.fill(&mut x.cuda, 0.3).unwrap();
                compare(&format!("fill {da} n={n}"), name, &cpu, &cuda, &x);
                let s = pair(&cpu, &cuda, &randn(&mut rng, n, 2.0), &[n], da);
                let (want, got) = (
                    cpu.sum_squares(&s.cpu).unwrap(),
                    cuda.sum_squares(&s.cuda).unwrap(),
                );
                assert!(
                    ((got - want) / want).abs() < 1e-12,
                    "{name}: sum_squares {da} n={n}: {got} vs {want}"
                );
                let c = cuda
                    .copy(&s.cuda, MemoryCategory::Activations, "c")
                    .unwrap();
                assert_eq!(cuda.to_f32(&c).unwrap(), cpu.to_f32(&s.cpu).unwrap());
            }
        }
        // The sum of squares of many tensors (more than one multi-tensor launch holds, of
        // every dtype in turn, an empty one among them), with one read back.
        let tensors: Vec<_> = (0..70usize)
            .map(|k| {
                let n = [0usize, 1, 17, 300, 2049][k % 5] + k;
                pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, n, 1.5),
                    &[n],
                    DTYPES[k % DTYPES.len()],
                )
            })
            .collect();
        let (want, got) = (
            cpu.sum_squares_all(&tensors.iter().map(|t| &t.cpu).collect::<Vec<_>>())
                .unwrap(),
            cuda.sum_squares_all(&tensors.iter().map(|t| &t.cuda).collect::<Vec<_>>())
                .unwrap(),
        );
        assert!(
            ((got - want) / want).abs() < 1e-12,
            "{name}: sum_squares_all of 70 tensors: {got} vs {want}"
        );
    }
}

/// LoRA's dropout draws the same mask on the GPU as on the CPU, bit for bit, overwriting
/// or accumulating, in every dtype; about `p` of the elements are dropped and the others
/// scaled by `1/(1 − p)`.
#[test]
fn lora_dropout_matches_the_cpu_bit_for_bit() {
    use trainkit::ops::lora::{dropout, Keep};
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(5);
    let n = 4099;
    for (name, cuda) in cuda_backends() {
        for dt in DTYPES {
            for (p, key) in [(0.1f32, 7u64), (0.5, 1 << 40)] {
                let keep = Keep::new(p, key);
                let x = randn(&mut rng, n, 1.0);
                let src = pair(&cpu, &cuda, &x, &[n], dt);
                for accumulate in [false, true] {
                    let init = randn(&mut rng, n, 1.0);
                    let mut dst = pair(&cpu, &cuda, &init, &[n], dt);
                    dropout(&cpu, &mut dst.cpu, &src.cpu, keep, accumulate).unwrap();
                    dropout(cuda.as_ref(), &mut dst.cuda, &src.cuda, keep, accumulate).unwrap();
                    let (want, got) = (
                        cpu.to_f32(&dst.cpu).unwrap(),
                        cuda.to_f32(&dst.cuda).unwrap(),
                    );
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want),
                        "{name}: lora_dropout {dt} p {p} accumulate {accumulate}"
                    );
                    if accumulate || dt != DType::F32 {
                        continue;
                    }
                    let dropped = want.iter().filter(|v| **v == 0.0).count() as f64 / n as f64;
                    assert!(
                        (dropped - p as f64).abs() < 0.03,
                        "dropped {dropped}, p {p}"
                    );
                    for (w, x) in want.iter().zip(&x) {
                        assert!(*w == 0.0 || *w == x * keep.scale, "{w} from {x}");
                    }
                }
            }
        }
    }
}

/// Incremental decoding's attention: new query rows against a key/value cache, bit for
/// bit the CPU's in every dtype (grouped-query heads, several rows, an empty and a filled
/// cache); and whole models decoding through the cache agree with the CPU's.
#[test]
fn decoding_attention_matches_the_cpu_bit_for_bit() {
    use trainkit::ops::attention::decode::{append, decode};
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(6);
    let heads = Heads {
        n_head: 4,
        n_kv_head: 2,
        head_dim: 8,
    };
    let (cap, kv_w) = (12, 2 * heads.kv_width());
    for (name, cuda) in cuda_backends() {
        for dt in DTYPES {
            for (start, n) in [(0, 3), (5, 1), (7, 5)] {
                let mut cache = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, cap * kv_w, 1.0),
                    &[cap, kv_w],
                    dt,
                );
                let qkv_data = randn(&mut rng, n * heads.qkv_width(), 1.0);
                let qkv = pair(&cpu, &cuda, &qkv_data, &[1, n, heads.qkv_width()], dt);
                let mut scratch = out(&cpu, &cuda, &[n, kv_w], dt);
                append(
                    &cpu,
                    &mut cache.cpu,
                    &mut scratch.cpu,
                    &qkv.cpu,
                    heads,
                    start,
                )
                .unwrap();
                append(
                    cuda.as_ref(),
                    &mut cache.cuda,
                    &mut scratch.cuda,
                    &qkv.cuda,
                    heads,
                    start,
                )
                .unwrap();
                let mut o = out(&cpu, &cuda, &[1, n, heads.q_width()], dt);
                decode(&cpu, &mut o.cpu, &qkv.cpu, &cache.cpu, heads, start).unwrap();
                decode(
                    cuda.as_ref(),
                    &mut o.cuda,
                    &qkv.cuda,
                    &cache.cuda,
                    heads,
                    start,
                )
                .unwrap();
                let bits = |b: &dyn Backend, t: &Tensor| -> Vec<u32> {
                    b.to_f32(t).unwrap().iter().map(|f| f.to_bits()).collect()
                };
                assert!(
                    bits(&cpu, &cache.cpu) == bits(cuda.as_ref(), &cache.cuda),
                    "{name}: kv cache {dt} start {start} n {n}"
                );
                assert!(
                    bits(&cpu, &o.cpu) == bits(cuda.as_ref(), &o.cuda),
                    "{name}: attention_decode {dt} start {start} n {n}"
                );
            }
        }
        for (what, model) in [
            ("qwen3", tiny_qwen(3)),
            (
                "gpt2",
                Box::new(Gpt2::new(tiny_config()).unwrap()) as Box<dyn trainkit::Model>,
            ),
        ] {
            let decode_all = |backend: Arc<dyn Backend>, model: Box<dyn trainkit::Model>| {
                let mut t = Trainer::builder(model, backend, corpus_loader(4_000, 1, 1, 8))
                    .build()
                    .unwrap();
                let mut cache = trainkit::KvCache::new(20);
                let tokens: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 251).collect();
                let mut logits = t.logits_cached(&tokens[..9], &mut cache).unwrap();
                for k in 9..20 {
                    logits.extend(t.logits_cached(&tokens[k..k + 1], &mut cache).unwrap());
                }
                // The next token's logits, the head on the last position alone: of the
                // whole context, and of a prompt into a fresh cache.
                logits.extend(t.last_logits(&tokens, None).unwrap());
                let mut fresh = trainkit::KvCache::new(20);
                logits.extend(t.last_logits(&tokens[..13], Some(&mut fresh)).unwrap());
                logits
            };
            let want = decode_all(Arc::new(CpuBackend::new()), model);
            let model = if what == "qwen3" {
                tiny_qwen(3)
            } else {
                Box::new(Gpt2::new(tiny_config()).unwrap())
            };
            let got = decode_all(cuda.clone(), model);
            check(&format!("{what} decoding"), name, &got, &want, DType::F32);
        }
    }
}

#[test]
fn copy_rows_matches_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(4);
    for (name, cuda) in cuda_backends() {
        for (rows, cols, dst_row, src_row, n) in
            [(9, 5, 2, 4, 5), (7, 1, 0, 6, 1), (3, 33, 0, 0, 3)]
        {
            for ds in DTYPES {
                for dd in DTYPES {
                    if !instantiated(&[ds, dd]) {
                        continue;
                    }
                    let src = pair(
                        &cpu,
                        &cuda,
                        &randn(&mut rng, rows * cols, 1.0),
                        &[rows, cols],
                        ds,
                    );
                    for accumulate in [false, true] {
                        let init = randn(&mut rng, rows * cols, 1.0);
                        let mut dst = pair(&cpu, &cuda, &init, &[rows, cols], dd);
                        cpu.copy_rows(&mut dst.cpu, dst_row, &src.cpu, src_row, n, accumulate)
                            .unwrap();
                        cuda.copy_rows(&mut dst.cuda, dst_row, &src.cuda, src_row, n, accumulate)
                            .unwrap();
                        let what = format!(
                            "copy_rows {ds}→{dd} {n} rows of {cols} ({src_row}→{dst_row}, \
                             accumulate {accumulate})"
                        );
                        compare(&what, name, &cpu, &cuda, &dst);
                    }
                }
            }
        }
        // Rows past the end are refused on every backend.
        let src = pair(&cpu, &cuda, &[0.0; 6], &[3, 2], DType::F32);
        let mut dst = pair(&cpu, &cuda, &[0.0; 6], &[3, 2], DType::F32);
        assert!(cpu
            .copy_rows(&mut dst.cpu, 2, &src.cpu, 0, 2, false)
            .is_err());
        assert!(cuda
            .copy_rows(&mut dst.cuda, 0, &src.cuda, 2, 2, true)
            .is_err());
    }
}

#[test]
fn matmul_matches_the_cpu_in_every_layout() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(2);
    // (operand dtype, output dtype)
    let kinds = [
        (DType::F32, DType::F32),
        (DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::F32),
        (DType::F32, DType::Bf16),
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
        (DType::F32, DType::F16),
    ];
    for (name, cuda) in cuda_backends() {
        for &(m, n, k) in &[
            (1usize, 1usize, 1usize),
            (5, 7, 3),
            (33, 17, 40),
            (64, 48, 96),
        ] {
            for (din, dout) in kinds {
                for trans_a in [false, true] {
                    for trans_b in [false, true] {
                        for bias in [false, true] {
                            for accumulate in [false, true] {
                                let ashape = if trans_a { [k, m] } else { [m, k] };
                                let bshape = if trans_b { [n, k] } else { [k, n] };
                                let a =
                                    pair(&cpu, &cuda, &randn(&mut rng, m * k, 1.0), &ashape, din);
                                let b =
                                    pair(&cpu, &cuda, &randn(&mut rng, k * n, 1.0), &bshape, din);
                                let bb = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], dout);
                                let mut o = if accumulate {
                                    pair(&cpu, &cuda, &randn(&mut rng, m * n, 1.0), &[m, n], dout)
                                } else {
                                    out(&cpu, &cuda, &[m, n], dout)
                                };
                                let what = format!(
                                    "matmul {m}x{n}x{k} {din}→{dout} ta={trans_a} tb={trans_b} bias={bias} acc={accumulate}"
                                );
                                cpu.matmul(
                                    &mut o.cpu,
                                    &a.cpu,
                                    &b.cpu,
                                    bias.then_some(&bb.cpu),
                                    trans_a,
                                    trans_b,
                                    accumulate,
                                )
                                .unwrap();
                                cuda.matmul(
                                    &mut o.cuda,
                                    &a.cuda,
                                    &b.cuda,
                                    bias.then_some(&bb.cuda),
                                    trans_a,
                                    trans_b,
                                    accumulate,
                                )
                                .unwrap();
                                // bf16 anywhere: bf16's tolerance.
                                let dt = if din != DType::F32 || dout != DType::F32 {
                                    DType::Bf16
                                } else {
                                    DType::F32
                                };
                                let want = cpu.to_f32(&o.cpu).unwrap();
                                let got = cuda.to_f32(&o.cuda).unwrap();
                                check(&what, name, &got, &want, dt);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_fused_bias_and_gelu_product_matches_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(12);
    // (operand dtype, output dtype); 48 and 64 columns take the GELU epilogue, 20 the
    // two-op form.
    let kinds = [
        (DType::F32, DType::F32),
        (DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::F32),
        (DType::F32, DType::Bf16),
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
        (DType::F32, DType::F16),
    ];
    for (name, cuda) in cuda_backends() {
        for &(m, n, k) in &[(33usize, 48usize, 40usize), (64, 64, 96), (9, 20, 16)] {
            for (din, dout) in kinds {
                let a = pair(&cpu, &cuda, &randn(&mut rng, m * k, 1.0), &[m, k], din);
                let b = pair(&cpu, &cuda, &randn(&mut rng, k * n, 0.3), &[k, n], din);
                let bias = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], dout);
                let mut pre = out(&cpu, &cuda, &[m, n], dout);
                let mut act = out(&cpu, &cuda, &[m, n], dout);
                linear::matmul_bias_gelu(
                    &cpu,
                    &mut act.cpu,
                    &mut pre.cpu,
                    &a.cpu,
                    &b.cpu,
                    &bias.cpu,
                )
                .unwrap();
                linear::matmul_bias_gelu(
                    &*cuda,
                    &mut act.cuda,
                    &mut pre.cuda,
                    &a.cuda,
                    &b.cuda,
                    &bias.cuda,
                )
                .unwrap();
                let what = format!("matmul_bias_gelu {m}x{n}x{k} {din}→{dout}");
                let dt = if din != DType::F32 || dout != DType::F32 {
                    DType::Bf16
                } else {
                    DType::F32
                };
                for (part, p) in [("pre-activation", &pre), ("gelu", &act)] {
                    let want = cpu.to_f32(&p.cpu).unwrap();
                    let got = cuda.to_f32(&p.cuda).unwrap();
                    check(&format!("{what} {part}"), name, &got, &want, dt);
                }
            }
        }
    }
}

/// The output projection with its residual (`matmul_residual`: on CUDA one product reading
/// the residual as cuBLASLt's C) matches the CPU's product-then-add, for both weight
/// layouts, with and without a bias; where the form does not apply (the residual in
/// another dtype, f32 operands into bf16) the product and the add run apart. On the
/// emulator the fused form is one product with `+C` in its name and no `axpy` launch.
#[test]
fn the_product_with_its_residual_matches_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(31);
    // (operand dtype, output and residual dtype, residual dtype, fused)
    let kinds = [
        (DType::F32, DType::F32, DType::F32, true),
        (DType::Bf16, DType::Bf16, DType::Bf16, true),
        (DType::Bf16, DType::F32, DType::F32, true),
        (DType::F16, DType::F16, DType::F16, true),
        (DType::Bf16, DType::Bf16, DType::F32, false),
        (DType::F32, DType::Bf16, DType::Bf16, false),
    ];
    for (name, cuda) in cuda_backends() {
        let own = CudaBackend::emulated().ok();
        for &(m, k, n) in &[(33usize, 40usize, 48usize), (9, 16, 20)] {
            for (din, dout, dres, fused) in kinds {
                for transposed in [false, true] {
                    for with_bias in [false, true] {
                        let w_shape = if transposed { [n, k] } else { [k, n] };
                        let x = pair(&cpu, &cuda, &randn(&mut rng, m * k, 1.0), &[m, k], din);
                        let w = pair(&cpu, &cuda, &randn(&mut rng, k * n, 0.3), &w_shape, din);
                        let bias = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], dout);
                        let res = pair(&cpu, &cuda, &randn(&mut rng, m * n, 2.0), &[m, n], dres);
                        let mut y = out(&cpu, &cuda, &[m, n], dout);
                        let b = |on_cpu: bool| {
                            with_bias.then_some(if on_cpu { &bias.cpu } else { &bias.cuda })
                        };
                        linear::matmul_residual(
                            &cpu,
                            &mut y.cpu,
                            &x.cpu,
                            &w.cpu,
                            b(true),
                            &res.cpu,
                            transposed,
                        )
                        .unwrap();
                        linear::matmul_residual(
                            &*cuda,
                            &mut y.cuda,
                            &x.cuda,
                            &w.cuda,
                            b(false),
                            &res.cuda,
                            transposed,
                        )
                        .unwrap();
                        let what = format!(
                            "matmul_residual {m}x{k}x{n} {din}→{dout} + {dres}, [out, in] \
                             {transposed}, bias {with_bias}"
                        );
                        let dt = if din != DType::F32 || dout != DType::F32 {
                            DType::Bf16
                        } else {
                            DType::F32
                        };
                        let want = cpu.to_f32(&y.cpu).unwrap();
                        let got = cuda.to_f32(&y.cuda).unwrap();
                        check(&what, name, &got, &want, dt);
                        // Which form ran, on an emulator of this test's own.
                        let Some(own) = own.as_ref().filter(|_| name == "emulator") else {
                            continue;
                        };
                        let up = |p: &Pair, dt: DType| {
                            let v = cpu.to_f32(&p.cpu).unwrap();
                            own.upload(&v, p.cpu.shape(), dt, MemoryCategory::Activations, "t")
                                .unwrap()
                        };
                        let (ox, ow, or) = (up(&x, din), up(&w, din), up(&res, dres));
                        let ob = up(&bias, dout);
                        let mut oy = own
                            .zeros(&[m, n], dout, MemoryCategory::Activations, "y")
                            .unwrap();
                        own.time_kernels(true);
                        let ob = with_bias.then_some(&ob);
                        linear::matmul_residual(own, &mut oy, &ox, &ow, ob, &or, transposed)
                            .unwrap();
                        let times = own.kernel_times().unwrap();
                        own.time_kernels(false);
                        let with_c = times.iter().any(|t| t.name.ends_with(" +C"));
                        let axpy = times.iter().any(|t| t.name.starts_with("axpy"));
                        assert_eq!((with_c, axpy), (fused, !fused), "{what}: {times:?}");
                    }
                }
            }
        }
    }
}

/// A linear layer's weight and bias gradients (`weight_bias_grad`: on CUDA two ops by
/// default, or with `bias_grad_epilogue` one product with cuBLASLt's bias-gradient
/// epilogue where the dtypes allow) match the CPU's, for both weight layouts, accumulating
/// into gradients that already hold values.
#[test]
fn weight_and_bias_gradients_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(21);
    // (operand dtype, gradient dtype): the last takes the two-op form.
    let kinds = [
        (DType::F32, DType::F32),
        (DType::Bf16, DType::F32),
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::F32),
        (DType::F16, DType::F16),
        (DType::F32, DType::Bf16),
    ];
    let epilogue = CudaOptions {
        bias_grad_epilogue: true,
        ..CudaOptions::default()
    };
    let mut backends: Vec<(String, Arc<CudaBackend>)> = cuda_backends()
        .into_iter()
        .map(|(name, b)| (name.to_string(), b))
        .collect();
    if emulated().is_some() {
        let b = CudaBackend::emulated_with(None, epilogue).unwrap();
        backends.push(("emulator, bias-gradient epilogue".into(), Arc::new(b)));
    }
    if gpu().is_some() {
        let b = CudaBackend::with_options(0, epilogue).unwrap();
        backends.push(("gpu, bias-gradient epilogue".into(), Arc::new(b)));
    }
    for (name, cuda) in backends {
        let name = name.as_str();
        for &(rows, din, dout) in &[(33usize, 24usize, 40usize), (130, 64, 48), (7, 9, 5)] {
            for (dx, dg) in kinds {
                for transposed in [false, true] {
                    let x = pair(
                        &cpu,
                        &cuda,
                        &randn(&mut rng, rows * din, 1.0),
                        &[rows, din],
                        dx,
                    );
                    let dy = pair(
                        &cpu,
                        &cuda,
                        &randn(&mut rng, rows * dout, 1.0),
                        &[rows, dout],
                        dx,
                    );
                    let w_shape = if transposed { [dout, din] } else { [din, dout] };
                    let mut dw = pair(&cpu, &cuda, &randn(&mut rng, din * dout, 1.0), &w_shape, dg);
                    let mut db = pair(&cpu, &cuda, &randn(&mut rng, dout, 1.0), &[dout], dg);
                    linear::weight_bias_grad(
                        &cpu,
                        &mut dw.cpu,
                        &mut db.cpu,
                        &x.cpu,
                        &dy.cpu,
                        transposed,
                    )
                    .unwrap();
                    linear::weight_bias_grad(
                        &*cuda,
                        &mut dw.cuda,
                        &mut db.cuda,
                        &x.cuda,
                        &dy.cuda,
                        transposed,
                    )
                    .unwrap();
                    let what = format!(
                        "weight_bias_grad {rows}x{din}x{dout} {dx}→{dg} transposed {transposed}"
                    );
                    let dt = if dx != DType::F32 || dg != DType::F32 {
                        DType::Bf16
                    } else {
                        DType::F32
                    };
                    for (part, p) in [("dW", &dw), ("db", &db)] {
                        let want = cpu.to_f32(&p.cpu).unwrap();
                        let got = cuda.to_f32(&p.cuda).unwrap();
                        check(&format!("{what} {part}"), name, &got, &want, dt);
                    }
                }
            }
        }
    }
}

/// Products choose their cuBLASLt algorithm by timing on a GPU (the default): the
/// weight gradient of a linear layer, a product that adds into the gradient already
/// there, is timed on a scratch output and so still adds once, matching the CPU; a
/// product offered more than one algorithm took a timed or saved one, and with tuning
/// off every product took the heuristic's first choice untimed. The emulator has no
/// cuBLASLt and reports no choices.
#[test]
fn products_choose_their_algorithm_by_timing_and_accumulate_once() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(23);
    let (rows, din, dout) = (512usize, 384usize, 256usize);
    let untuned = CudaOptions {
        tune_products: false,
        ..CudaOptions::default()
    };
    let mut backends = vec![];
    if emulated().is_some() {
        backends.push(("emulator", true, Arc::new(CudaBackend::emulated().unwrap())));
    }
    if gpu().is_some() {
        let tuned = CudaBackend::with_options(0, CudaOptions::default()).unwrap();
        backends.push(("gpu", true, Arc::new(tuned)));
        let plain = CudaBackend::with_options(0, untuned).unwrap();
        backends.push(("gpu, untuned", false, Arc::new(plain)));
    }
    for (name, tuned, cuda) in backends {
        for (dx, dg) in [(DType::Bf16, DType::F32), (DType::F32, DType::F32)] {
            let x = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, rows * din, 1.0),
                &[rows, din],
                dx,
            );
            let dy = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, rows * dout, 1.0),
                &[rows, dout],
                dx,
            );
            let mut dw = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, din * dout, 1.0),
                &[din, dout],
                dg,
            );
            let mut db = pair(&cpu, &cuda, &randn(&mut rng, dout, 1.0), &[dout], dg);
            // Twice: the second finds the choice made by the first.
            for _ in 0..2 {
                linear::weight_bias_grad(&cpu, &mut dw.cpu, &mut db.cpu, &x.cpu, &dy.cpu, false)
                    .unwrap();
                linear::weight_bias_grad(
                    &*cuda,
                    &mut dw.cuda,
                    &mut db.cuda,
                    &x.cuda,
                    &dy.cuda,
                    false,
                )
                .unwrap();
            }
            let want = cpu.to_f32(&dw.cpu).unwrap();
            let got = cuda.to_f32(&dw.cuda).unwrap();
            check(
                &format!("tuned weight gradient {dx}→{dg}"),
                name,
                &got,
                &want,
                dx,
            );
        }
        let choices = cuda.product_choices();
        if name == "emulator" {
            assert!(choices.is_empty(), "{choices:?}");
            continue;
        }
        assert!(!choices.is_empty(), "{name}: no product reported");
        for c in &choices {
            say(&format!("{name}: {c:?}"));
            let want_timed = tuned && c.candidates > 1;
            assert_eq!(
                c.source != ChoiceSource::Heuristic,
                want_timed,
                "{name}: {c:?}"
            );
            if c.source == ChoiceSource::Timed {
                assert!(c.chosen < c.candidates && c.chosen_us.is_some(), "{c:?}");
            }
        }
        // One choice per product (two dtypes), however often it ran.
        assert_eq!(choices.len(), 2, "{name}: {choices:?}");
    }
}

#[test]
fn bias_backward_and_embeddings_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(3);
    for (name, cuda) in cuda_backends() {
        for &(rows, cols) in &[(1usize, 3usize), (130, 9), (300, 40)] {
            for dt in DTYPES {
                for dg in DTYPES {
                    if !instantiated(&[dt, dg]) {
                        continue;
                    }
                    let d = pair(
                        &cpu,
                        &cuda,
                        &randn(&mut rng, rows * cols, 1.0),
                        &[rows, cols],
                        dt,
                    );
                    let mut g = pair(&cpu, &cuda, &randn(&mut rng, cols, 1.0), &[cols], dg);
                    cpu.bias_backward(&mut g.cpu, &d.cpu).unwrap();
                    cuda.bias_backward(&mut g.cuda, &d.cuda).unwrap();
                    compare(
                        &format!("bias_backward {rows}x{cols} {dt}→{dg}"),
                        name,
                        &cpu,
                        &cuda,
                        &g,
                    );
                }
            }
        }
        for &(b, t, c, v, p) in &[
            (1usize, 1usize, 4usize, 5usize, 2usize),
            (2, 9, 16, 11, 12),
            (3, 20, 24, 7, 20),
        ] {
            for dt in DTYPES {
                let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
                let wte = pair(&cpu, &cuda, &randn(&mut rng, v * c, 1.0), &[v, c], dt);
                let wpe = pair(&cpu, &cuda, &randn(&mut rng, p * c, 1.0), &[p, c], dt);
                let mut o = out(&cpu, &cuda, &[b, t, c], dt);
                embedding::forward(&cpu, &mut o.cpu, &tokens, &wte.cpu, Some(&wpe.cpu)).unwrap();
                embedding::forward(&*cuda, &mut o.cuda, &tokens, &wte.cuda, Some(&wpe.cuda))
                    .unwrap();
                compare(
                    &format!("embedding b={b} t={t} {dt}"),
                    name,
                    &cpu,
                    &cuda,
                    &o,
                );
                // Without position embeddings (Llama): the token rows alone.
                let mut o = out(&cpu, &cuda, &[b, t, c], dt);
                embedding::forward(&cpu, &mut o.cpu, &tokens, &wte.cpu, None).unwrap();
                embedding::forward(&*cuda, &mut o.cuda, &tokens, &wte.cuda, None).unwrap();
                compare(
                    &format!("embedding without positions b={b} t={t} {dt}"),
                    name,
                    &cpu,
                    &cuda,
                    &o,
                );
                for dg in DTYPES {
                    if !instantiated(&[dt, dg]) {
                        continue;
                    }
                    let dout = pair(
                        &cpu,
                        &cuda,
                        &randn(&mut rng, b * t * c, 1.0),
                        &[b, t, c],
                        dt,
                    );
                    let mut dwte = pair(&cpu, &cuda, &randn(&mut rng, v * c, 1.0), &[v, c], dg);
                    let mut dwpe = pair(&cpu, &cuda, &randn(&mut rng, p * c, 1.0), &[p, c], dg);
                    embedding::backward(
                        &cpu,
                        &mut dwte.cpu,
                        Some(&mut dwpe.cpu),
                        &dout.cpu,
                        &tokens,
                    )
                    .unwrap();
                    embedding::backward(
                        &*cuda,
                        &mut dwte.cuda,
                        Some(&mut dwpe.cuda),
                        &dout.cuda,
                        &tokens,
                    )
                    .unwrap();
                    compare(
                        &format!("embedding_backward dwte {dt}→{dg}"),
                        name,
                        &cpu,
                        &cuda,
                        &dwte,
                    );
                    compare(
                        &format!("embedding_backward dwpe {dt}→{dg}"),
                        name,
                        &cpu,
                        &cuda,
                        &dwpe,
                    );
                }
            }
        }
    }
}

#[test]
fn layernorm_and_gelu_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(4);
    for (name, cuda) in cuda_backends() {
        // Widths of one and of several warp rows (256 columns), vector loads and not.
        for &(rows, c) in &[(1usize, 1usize), (3, 17), (130, 48), (40, 100), (9, 600)] {
            for dt in DTYPES {
                let x = pair(&cpu, &cuda, &randn(&mut rng, rows * c, 2.0), &[rows, c], dt);
                let w = pair(&cpu, &cuda, &randn(&mut rng, c, 1.0), &[c], dt);
                let bias = pair(&cpu, &cuda, &randn(&mut rng, c, 1.0), &[c], dt);
                let mut o = out(&cpu, &cuda, &[rows, c], dt);
                let mut st = out(&cpu, &cuda, &[rows, 2], DType::F32);
                layernorm::forward(
                    &cpu,
                    &mut o.cpu,
                    &mut st.cpu,
                    &x.cpu,
                    &w.cpu,
                    &bias.cpu,
                    1e-5,
                )
                .unwrap();
                layernorm::forward(
                    &*cuda,
                    &mut o.cuda,
                    &mut st.cuda,
                    &x.cuda,
                    &w.cuda,
                    &bias.cuda,
                    1e-5,
                )
                .unwrap();
                compare(&format!("layernorm {rows}x{c} {dt}"), name, &cpu, &cuda, &o);
                compare(
                    &format!("layernorm stats {rows}x{c} {dt}"),
                    name,
                    &cpu,
                    &cuda,
                    &st,
                );
                for dg in DTYPES {
                    if !instantiated(&[dt, dg]) {
                        continue;
                    }
                    let dout = pair(&cpu, &cuda, &randn(&mut rng, rows * c, 1.0), &[rows, c], dt);
                    let mut dx = pair(&cpu, &cuda, &randn(&mut rng, rows * c, 1.0), &[rows, c], dt);
                    let mut dw = pair(&cpu, &cuda, &randn(&mut rng, c, 1.0), &[c], dg);
                    let mut db = pair(&cpu, &cuda, &randn(&mut rng, c, 1.0), &[c], dg);
                    layernorm::backward(
                        &cpu,
                        &mut dx.cpu,
                        &mut dw.cpu,
                        &mut db.cpu,
                        &dout.cpu,
                        &x.cpu,
                        &w.cpu,
                        &st.cpu,
                    )
                    .unwrap();
                    layernorm::backward(
                        &*cuda,
                        &mut dx.cuda,
                        &mut dw.cuda,
                        &mut db.cuda,
                        &dout.cuda,
                        &x.cuda,
                        &w.cuda,
                        &st.cuda,
                    )
                    .unwrap();
                    let what = format!("layernorm_backward {rows}x{c} {dt}/{dg}");
                    compare(&format!("{what} dx"), name, &cpu, &cuda, &dx);
                    compare(&format!("{what} dweight"), name, &cpu, &cuda, &dw);
                    compare(&format!("{what} dbias"), name, &cpu, &cuda, &db);
                }
                let n = rows * c;
                let mut g = out(&cpu, &cuda, &[rows, c], dt);
                gelu::forward(&cpu, &mut g.cpu, &x.cpu).unwrap();
                gelu::forward(&*cuda, &mut g.cuda, &x.cuda).unwrap();
                compare(&format!("gelu n={n} {dt}"), name, &cpu, &cuda, &g);
                let dout = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[rows, c], dt);
                let mut dx = out(&cpu, &cuda, &[rows, c], dt);
                gelu::backward(&cpu, &mut dx.cpu, &x.cpu, &dout.cpu).unwrap();
                gelu::backward(&*cuda, &mut dx.cuda, &x.cuda, &dout.cuda).unwrap();
                compare(&format!("gelu_backward n={n} {dt}"), name, &cpu, &cuda, &dx);
            }
        }
    }
}

#[test]
fn attention_matches_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(5);
    for (name, cuda) in cuda_backends() {
        // Multi-head, grouped-query and multi-query heads: (b, t, heads, kv heads, head dim).
        for &(b, t, h, kv, hd) in &[
            (1usize, 1usize, 1usize, 1usize, 4usize),
            (2, 5, 2, 2, 4),
            (1, 19, 4, 4, 8),
            (2, 19, 4, 2, 8),
            (1, 7, 4, 1, 6),
        ] {
            let heads = Heads {
                n_head: h,
                n_kv_head: kv,
                head_dim: hd,
            };
            let (c, w) = (heads.q_width(), heads.qkv_width());
            for dt in DTYPES {
                let what = format!("b={b} t={t} {heads:?} {dt}");
                let qkv = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, b * t * w, 1.0),
                    &[b, t, w],
                    dt,
                );
                let sh = [b, h, t, t];
                let mut s = out(&cpu, &cuda, &sh, dt);
                attention::scores(&cpu, &mut s.cpu, &qkv.cpu, heads).unwrap();
                attention::scores(&*cuda, &mut s.cuda, &qkv.cuda, heads).unwrap();
                compare(&format!("attention_scores {what}"), name, &cpu, &cuda, &s);
                let mut p = out(&cpu, &cuda, &sh, dt);
                attention::softmax(&cpu, &mut p.cpu, &s.cpu).unwrap();
                attention::softmax(&*cuda, &mut p.cuda, &s.cuda).unwrap();
                compare(&format!("softmax_causal {what}"), name, &cpu, &cuda, &p);
                let mut o = out(&cpu, &cuda, &[b, t, c], dt);
                attention::values(&cpu, &mut o.cpu, &p.cpu, &qkv.cpu, heads).unwrap();
                attention::values(&*cuda, &mut o.cuda, &p.cuda, &qkv.cuda, heads).unwrap();
                compare(&format!("attention_values {what}"), name, &cpu, &cuda, &o);
                // Backward, on the same inputs for both.
                let dout = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, b * t * c, 1.0),
                    &[b, t, c],
                    dt,
                );
                let mut dp = out(&cpu, &cuda, &sh, dt);
                let mut dqkv = out(&cpu, &cuda, &[b, t, w], dt);
                attention::values_backward(
                    &cpu,
                    &mut dp.cpu,
                    &mut dqkv.cpu,
                    &dout.cpu,
                    &p.cpu,
                    &qkv.cpu,
                    heads,
                )
                .unwrap();
                attention::values_backward(
                    &*cuda,
                    &mut dp.cuda,
                    &mut dqkv.cuda,
                    &dout.cuda,
                    &p.cuda,
                    &qkv.cuda,
                    heads,
                )
                .unwrap();
                compare(
                    &format!("attention_values_backward dprobs {what}"),
                    name,
                    &cpu,
                    &cuda,
                    &dp,
                );
                let mut ds = out(&cpu, &cuda, &sh, dt);
                attention::softmax_backward(&cpu, &mut ds.cpu, &dp.cpu, &p.cpu).unwrap();
                attention::softmax_backward(&*cuda, &mut ds.cuda, &dp.cuda, &p.cuda).unwrap();
                compare(
                    &format!("softmax_causal_backward {what}"),
                    name,
                    &cpu,
                    &cuda,
                    &ds,
                );
                attention::scores_backward(&cpu, &mut dqkv.cpu, &ds.cpu, &qkv.cpu, heads).unwrap();
                attention::scores_backward(&*cuda, &mut dqkv.cuda, &ds.cuda, &qkv.cuda, heads)
                    .unwrap();
                // Now every block of dqkv is written: q and k here, v above.
                compare(
                    &format!("attention backward dqkv {what}"),
                    name,
                    &cpu,
                    &cuda,
                    &dqkv,
                );
            }
        }
    }
}

/// The fused attention (forward: output and log-sum-exp; backward: all of dqkv) against
/// the CPU's, for multi-head, grouped-query and multi-query heads, head widths from 16 to
/// 128 and sequences that do not fill a tile; and over rows of several documents
/// (`ops::positions`), which start inside tiles and on a 64-row tile's first row (so whole
/// tiles are skipped).
#[test]
fn flash_attention_matches_the_cpu() {
    use trainkit::ops::positions;
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(11);
    for (name, cuda) in cuda_backends() {
        // (b, t, heads, kv heads, head dim).
        for &(b, t, h, kv, hd) in &[
            (2usize, 70usize, 2usize, 2usize, 16usize),
            (1, 67, 4, 2, 64),
            (1, 33, 4, 1, 128),
            (2, 19, 4, 1, 32),
            (1, 1, 1, 1, 8),
            (2, 151, 2, 1, 32),
            // The tensor-core kernels' head sizes (16-bit dtypes), grouped heads, three
            // tiles and a ragged end.
            (2, 150, 4, 2, 64),
            (1, 90, 2, 1, 80),
            (1, 130, 2, 1, 128),
        ] {
            let heads = Heads {
                n_head: h,
                n_kv_head: kv,
                head_dim: hd,
            };
            let (c, w) = (heads.q_width(), heads.qkv_width());
            let starts = [t / 3, 64, 65, t + t / 2];
            let documents = positions::from_document_starts(b, t, |k| starts.contains(&k));
            let layouts = [None, Some(&documents[..])];
            for (dt, pos) in DTYPES.into_iter().flat_map(|d| layouts.map(|p| (d, p))) {
                let what = format!("b={b} t={t} {heads:?} {dt} documents {}", pos.is_some());
                let qkv = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, b * t * w, 1.0),
                    &[b, t, w],
                    dt,
                );
                let mut o = out(&cpu, &cuda, &[b, t, c], dt);
                let mut lse = out(&cpu, &cuda, &[b, h, t], DType::F32);
                for (be, o, lse, qkv) in [
                    (&cpu as &dyn Backend, &mut o.cpu, &mut lse.cpu, &qkv.cpu),
                    (
                        &*cuda as &dyn Backend,
                        &mut o.cuda,
                        &mut lse.cuda,
                        &qkv.cuda,
                    ),
                ] {
                    flash_attention::forward_in_documents(be, o, lse, qkv, heads, pos).unwrap();
                }
                compare(
                    &format!("flash_attention out {what}"),
                    name,
                    &cpu,
                    &cuda,
                    &o,
                );
                let want = cpu.to_f32(&lse.cpu).unwrap();
                let got = cuda.to_f32(&lse.cuda).unwrap();
                check(
                    &format!("flash_attention lse {what}"),
                    name,
                    &got,
                    &want,
                    dt,
                );
                let dout = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, b * t * c, 1.0),
                    &[b, t, c],
                    dt,
                );
                let mut dqkv = out(&cpu, &cuda, &[b, t, w], dt);
                for (be, dqkv, dout, o, lse, qkv) in [
                    (
                        &cpu as &dyn Backend,
                        &mut dqkv.cpu,
                        &dout.cpu,
                        &o.cpu,
                        &lse.cpu,
                        &qkv.cpu,
                    ),
                    (
                        &*cuda as &dyn Backend,
                        &mut dqkv.cuda,
                        &dout.cuda,
                        &o.cuda,
                        &lse.cuda,
                        &qkv.cuda,
                    ),
                ] {
                    flash_attention::backward_in_documents(be, dqkv, dout, o, lse, qkv, heads, pos)
                        .unwrap();
                }
                compare(
                    &format!("flash_attention_backward dqkv {what}"),
                    name,
                    &cpu,
                    &cuda,
                    &dqkv,
                );
            }
        }
    }
}

#[test]
fn cross_entropy_and_adamw_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(6);
    for (name, cuda) in cuda_backends() {
        for &(rows, vocab, vp) in &[
            (1usize, 1usize, 1usize),
            (5, 11, 16),
            (40, 256, 256),
            (9, 300, 320),
            // 16-byte accesses over three trips of 2048 columns, the last one partial.
            (3, 4100, 4104),
        ] {
            for dt in DTYPES {
                // Every fourth position is left out of the loss.
                let targets: Vec<u32> = (0..rows)
                    .map(|i| match i % 4 {
                        3 => cross_entropy::IGNORE,
                        _ => rng.below(vocab) as u32,
                    })
                    .collect();
                let data = randn(&mut rng, rows * vp, 3.0);
                for grad in [None, Some(0.125f32)] {
                    let mut l = pair(&cpu, &cuda, &data, &[rows, vp], dt);
                    // The row losses are added to what the tensor holds.
                    let before: Vec<f32> = randn(&mut rng, rows, 1.0);
                    let mut losses = pair(&cpu, &cuda, &before, &[rows], DType::F32);
                    cross_entropy::forward(
                        &cpu,
                        &mut l.cpu,
                        &targets,
                        vocab,
                        grad,
                        &mut losses.cpu,
                    )
                    .unwrap();
                    cross_entropy::forward(
                        &*cuda,
                        &mut l.cuda,
                        &targets,
                        vocab,
                        grad,
                        &mut losses.cuda,
                    )
                    .unwrap();
                    compare(
                        &format!("cross_entropy losses {rows}x{vp} {dt} grad={grad:?}"),
                        name,
                        &cpu,
                        &cuda,
                        &losses,
                    );
                    compare(
                        &format!("cross_entropy logits/grad {rows}x{vp} {dt} grad={grad:?}"),
                        name,
                        &cpu,
                        &cuda,
                        &l,
                    );
                }
            }
        }
        for n in [1usize, 257, 3000] {
            for dg in DTYPES {
                let mut p = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], DType::F32);
                let g = pair(&cpu, &cuda, &randn(&mut rng, n, 0.1), &[n], dg);
                let mut m = pair(&cpu, &cuda, &randn(&mut rng, n, 0.01), &[n], DType::F32);
                let v0: Vec<f32> = randn(&mut rng, n, 0.01).iter().map(|x| x * x).collect();
                let mut v = pair(&cpu, &cuda, &v0, &[n], DType::F32);
                // The compute copy written in the same pass, in both dtypes. Steps 3 and 4
                // take a device multiplier; step 4's is NaN, so it changes nothing.
                let mut w = out(&cpu, &cuda, &[n], dg);
                let after_3 = four_adamw_steps(
                    &cpu,
                    &cuda,
                    [&mut p, &mut m, &mut v],
                    &g,
                    Some(&mut w),
                    0.95,
                );
                let after_4 = [&p.cuda, &m.cuda, &v.cuda, &w.cuda].map(|t| cuda.to_f32(t).unwrap());
                for (a, b) in after_3.iter().zip(&after_4) {
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(a), bits(b), "{name}: a NaN scale must skip the update");
                }
                compare(
                    &format!("adamw value n={n} grad {dg}"),
                    name,
                    &cpu,
                    &cuda,
                    &p,
                );
                compare(
                    &format!("adamw exp_avg n={n} grad {dg}"),
                    name,
                    &cpu,
                    &cuda,
                    &m,
                );
                compare(
                    &format!("adamw exp_avg_sq n={n} grad {dg}"),
                    name,
                    &cpu,
                    &cuda,
                    &v,
                );
                compare(
                    &format!("adamw compute copy n={n} {dg}"),
                    name,
                    &cpu,
                    &cuda,
                    &w,
                );
            }
        }
    }
}

/// Four AdamW steps of `[value, exp_avg, exp_avg_sq]` with gradient `g`, each on the CPU
/// and on `cuda`: steps 3 and 4 take a device multiplier, 0.7 and then NaN (which must
/// change nothing), and the compute copy `w` is written in the same pass when given.
/// Returns `cuda`'s value, moments and copy after step 3.
fn four_adamw_steps(
    cpu: &CpuBackend,
    cuda: &CudaBackend,
    [p, m, v]: [&mut Pair; 3],
    g: &Pair,
    mut w: Option<&mut Pair>,
    beta2: f32,
) -> Vec<Vec<f32>> {
    let scales = [
        pair(cpu, cuda, &[0.7], &[1], DType::F32),
        pair(cpu, cuda, &[f32::NAN], &[1], DType::F32),
    ];
    let mut after_3 = vec![];
    for step in 1..=4 {
        let scale = match step {
            3 => Some(&scales[0]),
            4 => Some(&scales[1]),
            _ => None,
        };
        let hp = AdamWStep {
            lr: 6e-4,
            beta1: 0.9,
            beta2,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 0.5,
        };
        adamw::update(
            cpu,
            &mut p.cpu,
            &g.cpu,
            &mut m.cpu,
            &mut v.cpu,
            &hp,
            scale.map(|s| &s.cpu),
            w.as_deref_mut().map(|w| &mut w.cpu),
        )
        .unwrap();
        adamw::update(
            cuda,
            &mut p.cuda,
            &g.cuda,
            &mut m.cuda,
            &mut v.cuda,
            &hp,
            scale.map(|s| &s.cuda),
            w.as_deref_mut().map(|w| &mut w.cuda),
        )
        .unwrap();
        if step == 3 {
            after_3 = [&p.cuda, &m.cuda, &v.cuda]
                .into_iter()
                .chain(w.as_deref().map(|w| &w.cuda))
                .map(|t| cuda.to_f32(t).unwrap())
                .collect();
        }
    }
    after_3
}

/// The CPU's or the device's tensor of a pair.
fn side(t: &mut Pair, on_cpu: bool) -> &mut Tensor {
    if on_cpu {
        &mut t.cpu
    } else {
        &mut t.cuda
    }
}

/// AdamW over many tensors at once (`update_many`: a few launches of the multi-tensor
/// kernels) gives the CPU's bits for every tensor: sizes off and on the kernels' 8-element
/// groups and 2048-element blocks, more tensors of one kind than a launch takes (32), every
/// dtype combination the kernels have plus a compute copy they cannot write (f32, cast
/// after), tensors with and without weight decay, over three steps: plain, with a device
/// scale, and with a NaN scale that must change nothing.
#[test]
fn adamw_over_many_tensors_matches_the_cpu_bit_for_bit() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(23);
    // (gradient, moments, compute copy)
    let kinds = [
        (DType::F32, DType::F32, Some(DType::Bf16)),
        (DType::Bf16, DType::F32, Some(DType::Bf16)),
        (DType::F32, DType::F32, None),
        (DType::F16, DType::F32, Some(DType::F16)),
        (DType::F32, DType::F32, Some(DType::F16)),
        (DType::F32, DType::Bf16, Some(DType::Bf16)),
        (DType::Bf16, DType::Bf16, None),
        (DType::F32, DType::F32, Some(DType::F32)),
    ];
    let sizes = [1usize, 7, 8, 2048, 2049, 5000, 300];
    for (name, cuda) in cuda_backends() {
        // 40 tensors of the first kind (two launches), 5 of each other kind.
        let mut specs = vec![];
        for i in 0..40 {
            specs.push((kinds[0], sizes[i % sizes.len()], i % 3 != 0));
        }
        for (k, kind) in kinds.iter().enumerate().skip(1) {
            for i in 0..5 {
                specs.push((*kind, sizes[(i + k) % sizes.len()], (i + k) % 2 == 0));
            }
        }
        let mut state: Vec<[Pair; 5]> = specs
            .iter()
            .map(|&((dg, dm, dc), n, _)| {
                let zeros = vec![0.0; n];
                [
                    pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], DType::F32),
                    pair(&cpu, &cuda, &randn(&mut rng, n, 0.1), &[n], dg),
                    pair(&cpu, &cuda, &zeros, &[n], dm),
                    pair(&cpu, &cuda, &zeros, &[n], dm),
                    pair(&cpu, &cuda, &zeros, &[n], dc.unwrap_or(DType::F32)),
                ]
            })
            .collect();
        let scales = [
            pair(&cpu, &cuda, &[0.7], &[1], DType::F32),
            pair(&cpu, &cuda, &[f32::NAN], &[1], DType::F32),
        ];
        for step in 1..=3u64 {
            let scale = match step {
                2 => Some(&scales[0]),
                3 => Some(&scales[1]),
                _ => None,
            };
            let hp = AdamWStep {
                lr: 6e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
                grad_scale: 0.5,
            };
            for on_cpu in [true, false] {
                let be: &dyn Backend = if on_cpu { &cpu } else { &*cuda };
                let mut tensors: Vec<adamw::AdamWTensor<'_>> = state
                    .iter_mut()
                    .zip(&specs)
                    .map(
                        |([p, g, m, v, w], &((_, _, dc), _, decays))| adamw::AdamWTensor {
                            param: side(p, on_cpu),
                            grad: if on_cpu { &g.cpu } else { &g.cuda },
                            m: side(m, on_cpu),
                            v: side(v, on_cpu),
                            compute: dc.map(|_| side(w, on_cpu)),
                            decays,
                        },
                    )
                    .collect();
                let s = scale.map(|s| if on_cpu { &s.cpu } else { &s.cuda });
                adamw::update_many(be, &mut tensors, &hp, s).unwrap();
            }
        }
        let bits = |be: &dyn Backend, t: &Tensor| -> Vec<u32> {
            be.to_f32(t).unwrap().iter().map(|v| v.to_bits()).collect()
        };
        for (i, (ts, &((dg, dm, dc), n, decays))) in state.iter().zip(&specs).enumerate() {
            for (what, t) in ["value", "gradient", "exp_avg", "exp_avg_sq", "copy"]
                .iter()
                .zip(ts)
            {
                if *what == "copy" && dc.is_none() {
                    continue;
                }
                assert_eq!(
                    bits(&cpu, &t.cpu),
                    bits(&*cuda, &t.cuda),
                    "{name}: adamw over many tensors, tensor {i} (n {n}, gradient {dg}, \
                     moments {dm}, copy {dc:?}, decays {decays}): {what}"
                );
            }
        }
    }
}

/// AdamW with bf16 moments gives the CPU's bits: values, both moments (updated in f32,
/// stored rounded) and the bf16 compute copy, over four steps with an f32 or a bf16
/// gradient, with and without the compute copy and a device scale, and a NaN scale that
/// skips the update; bf16 moments beside an f16 gradient are refused on both backends.
#[test]
fn adamw_with_bf16_moments_matches_the_cpu_bit_for_bit() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(17);
    let bits = |be: &dyn Backend, t: &Tensor| -> Vec<u32> {
        be.to_f32(t).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    for (name, cuda) in cuda_backends() {
        for n in [1usize, 257, 3000] {
            for (dg, with_copy) in [(DType::F32, true), (DType::Bf16, true), (DType::F32, false)] {
                let mut p = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], DType::F32);
                let g = pair(&cpu, &cuda, &randn(&mut rng, n, 0.1), &[n], dg);
                let zeros = vec![0.0; n];
                let mut m = pair(&cpu, &cuda, &zeros, &[n], DType::Bf16);
                let mut v = pair(&cpu, &cuda, &zeros, &[n], DType::Bf16);
                let mut w = out(&cpu, &cuda, &[n], DType::Bf16);
                if !with_copy {
                    w = pair(&cpu, &cuda, &zeros, &[n], DType::Bf16);
                }
                four_adamw_steps(
                    &cpu,
                    &cuda,
                    [&mut p, &mut m, &mut v],
                    &g,
                    with_copy.then_some(&mut w),
                    0.999,
                );
                for (what, t) in [
                    ("value", &p),
                    ("exp_avg", &m),
                    ("exp_avg_sq", &v),
                    ("copy", &w),
                ] {
                    assert_eq!(
                        bits(&cpu, &t.cpu),
                        bits(&*cuda, &t.cuda),
                        "{name}: adamw bf16 moments {what}, n {n}, gradient {dg}"
                    );
                }
                assert!(
                    bits(&cpu, &m.cpu).iter().any(|&b| b != 0),
                    "the moments moved"
                );
            }
        }
        // bf16 moments take no f16 gradient, on either backend.
        let mut p = pair(&cpu, &cuda, &[1.0; 4], &[4], DType::F32);
        let g = pair(&cpu, &cuda, &[0.1; 4], &[4], DType::F16);
        let mut m = out(&cpu, &cuda, &[4], DType::Bf16);
        let mut v = out(&cpu, &cuda, &[4], DType::Bf16);
        let hp = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
            grad_scale: 1.0,
        };
        let e = adamw::update(
            &*cuda,
            &mut p.cuda,
            &g.cuda,
            &mut m.cuda,
            &mut v.cuda,
            &hp,
            None,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("bf16 moments"), "{e}");
        let e = adamw::update(
            &cpu, &mut p.cpu, &g.cpu, &mut m.cpu, &mut v.cpu, &hp, None, None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("bf16 moments"), "{e}");
    }
}

/// The 8-bit AdamW update gives the CPU's bits: values, codes, block maxima and the bf16
/// compute copy, over several steps from zero state (so the codes are the kernel's own),
/// with a partial last block, with and without a device scale, and a NaN scale that
/// skips the update.
#[test]
fn adamw8bit_matches_the_cpu_bit_for_bit() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(8);
    let bits = |b: &dyn Backend, t: &Tensor| -> Vec<u32> {
        b.to_f32(t).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    for (name, cuda) in cuda_backends() {
        for n in [300usize, 4096 + 77, 256 * 24] {
            for dg in DTYPES {
                let blocks = n.div_ceil(trainkit::optim::adamw8bit::QUANT_BLOCK);
                let mut p = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], DType::F32);
                let mut m = pair(&cpu, &cuda, &vec![0.0; n], &[n], DType::U8);
                let mut v = pair(&cpu, &cuda, &vec![0.0; n], &[n], DType::U8);
                let mut ma = pair(&cpu, &cuda, &vec![0.0; blocks], &[blocks], DType::F32);
                let mut va = pair(&cpu, &cuda, &vec![0.0; blocks], &[blocks], DType::F32);
                let mut w = out(&cpu, &cuda, &[n], DType::Bf16);
                let scales = [
                    pair(&cpu, &cuda, &[0.7], &[1], DType::F32),
                    pair(&cpu, &cuda, &[f32::NAN], &[1], DType::F32),
                ];
                let mut before_nan = vec![];
                for step in 1..=5u64 {
                    // Gradients of several magnitudes, so blocks use many decades.
                    let g: Vec<f32> = randn(&mut rng, n, 0.1)
                        .iter()
                        .enumerate()
                        .map(|(i, x)| x * 10f32.powi(-((i % 7) as i32)))
                        .collect();
                    let g = pair(&cpu, &cuda, &g, &[n], dg);
                    let scale = match step {
                        3 => Some(&scales[0]),
                        4 => Some(&scales[1]),
                        _ => None,
                    };
                    let hp = AdamWStep {
                        lr: 1e-3,
                        beta1: 0.9,
                        beta2: 0.95,
                        eps: 1e-8,
                        weight_decay: 0.1,
                        step,
                        grad_scale: 0.5,
                    };
                    if step == 4 {
                        before_nan = [&p.cuda, &m.cuda, &ma.cuda, &v.cuda, &va.cuda]
                            .map(|t| bits(cuda.as_ref(), t))
                            .to_vec();
                    }
                    for (b, p, m, ma, v, va, g, w, s) in [
                        (
                            &cpu as &dyn Backend,
                            &mut p.cpu,
                            &mut m.cpu,
                            &mut ma.cpu,
                            &mut v.cpu,
                            &mut va.cpu,
                            &g.cpu,
                            &mut w.cpu,
                            scale.map(|s| &s.cpu),
                        ),
                        (
                            cuda.as_ref() as &dyn Backend,
                            &mut p.cuda,
                            &mut m.cuda,
                            &mut ma.cuda,
                            &mut v.cuda,
                            &mut va.cuda,
                            &g.cuda,
                            &mut w.cuda,
                            scale.map(|s| &s.cuda),
                        ),
                    ] {
                        let moments = QuantizedMoments {
                            m,
                            m_absmax: ma,
                            v,
                            v_absmax: va,
                        };
                        adamw8bit::update(b, p, g, moments, &hp, s, Some(w)).unwrap();
                    }
                    if step == 4 {
                        let after = [&p.cuda, &m.cuda, &ma.cuda, &v.cuda, &va.cuda]
                            .map(|t| bits(cuda.as_ref(), t))
                            .to_vec();
                        assert_eq!(
                            after, before_nan,
                            "{name}: a NaN scale must skip the update"
                        );
                    }
                    for (what, t) in [
                        ("value", &p),
                        ("exp_avg codes", &m),
                        ("exp_avg absmax", &ma),
                        ("exp_avg_sq codes", &v),
                        ("exp_avg_sq absmax", &va),
                        ("compute copy", &w),
                    ] {
                        assert_eq!(
                            bits(cuda.as_ref(), &t.cuda),
                            bits(&cpu, &t.cpu),
                            "{name}: adamw8bit {what}, n={n}, grad {dg}, step {step}"
                        );
                    }
                }
                // The moments spread over the 8-bit map: most of its 256 codes in the
                // larger tensors, and well over a quarter of them in 300 elements (two
                // blocks), however the random draws fall.
                let codes = cuda.to_f32(&m.cuda).unwrap();
                let distinct: std::collections::BTreeSet<u32> =
                    codes.iter().map(|c| *c as u32).collect();
                let least = if n < 1000 { 80 } else { 128 };
                assert!(
                    distinct.len() >= least,
                    "{name}: only {} codes used in {n} elements",
                    distinct.len()
                );
            }
        }
    }
}

/// Two optimizer steps of the tiny GPT-2: losses, gradients and updated values.
fn two_steps<P: Precision + Default>(
    backend: Arc<dyn Backend>,
    policy: impl CheckpointPolicy + 'static,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    two_steps_chunked::<P>(backend, policy, None)
}

/// [`two_steps`] with the fused loss in chunks of `chunk` positions.
fn two_steps_chunked<P: Precision + Default>(
    backend: Arc<dyn Backend>,
    policy: impl CheckpointPolicy + 'static,
    chunk: Option<usize>,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let model = Gpt2::new(tiny_config())
        .unwrap()
        .with_loss(trainkit::ops::LossPath::Fused, chunk)
        .unwrap();
    let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
        .precision(P::default())
        .checkpoint(policy)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (losses, grads(&t), values(&t))
}

fn check_run(
    what: &str,
    got: &(Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>),
    want: &(Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>),
    init: &[Vec<f32>],
    dt: DType,
) {
    for (g, w) in got.0.iter().zip(&want.0) {
        assert!(((g - w) / w).abs() < tol(dt), "{what}: loss {g} vs {w}");
    }
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        let bound = grad_bound(dt);
        let e = rel_err(g, w);
        assert!(e < bound, "{what}: gradient {i} relative error {e:.3e}");
    }
    // Values after two AdamW steps, as updates from the (identical) initial values. AdamW
    // moves an element by about ±lr whatever the size of its gradient, so an element whose
    // gradient is near zero moves by the sign of rounding noise: the key bias of attention,
    // whose exact gradient is 0 (softmax ignores a constant added to every key), or any
    // element whose first gradient happened to be near 0. So no element may differ by more
    // than two steps of lr 6e-4 can move it on both backends (3e-3), and the updates of the
    // whole model must agree in norm within 1% (f32) or 10% (bf16; the emulator, whose
    // GELU epilogue reads the unrounded product where the CPU's GELU reads it rounded to
    // bf16, measured 5.3%). A skipped update or a learning rate off by a fifth fails.
    let (mut err, mut norm) = (0f64, 0f64);
    for (i, ((g, w), w0)) in got.2.iter().zip(&want.2).zip(init).enumerate() {
        for (j, ((g, w), w0)) in g.iter().zip(w).zip(w0).enumerate() {
            assert!(
                (g - w).abs() <= 3e-3,
                "{what}: value {i}[{j}]: {g} vs {w}, from {w0}"
            );
            err += ((g - w) as f64).powi(2);
            norm += ((w - w0) as f64).powi(2);
        }
    }
    let rel = (err / norm).sqrt();
    let bound = if dt == DType::F32 { 1e-2 } else { 1e-1 };
    assert!(
        rel <= bound,
        "{what}: the updates differ by {rel:.3e} in norm (bound {bound:e})"
    );
}

/// The bound on gradients' relative error: bf16's (or f16's) roundings pass through a
/// whole backward. Two 16-bit runs that round in different places (the CUDA products
/// round a residual sum once, from the f32 accumulator, and feed the GELU and its
/// gradient unrounded products; the CPU rounds each part) differ by about the sum of
/// their errors against f32: up to 6.3% on the tiny GPT-2's packed rows, where each alone
/// is within 6% of f32 ([`packed_rows_train_as_on_the_cpu`] holds the CUDA run to the
/// CPU's error against f32).
fn grad_bound(dt: DType) -> f64 {
    if dt == DType::F32 {
        1e-4
    } else {
        8e-2
    }
}

/// The largest relative error of any parameter's gradient in `got` against `want`.
fn worst_grad_error(got: &[Vec<f32>], want: &[Vec<f32>]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| rel_err(g, w))
        .fold(0.0, f64::max)
}

#[test]
fn a_training_step_matches_the_cpu_in_every_precision() {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let want32 = two_steps::<trainkit::Fp32>(cpu.clone(), NoRecompute);
    let want16 = two_steps::<MixedBf16>(cpu.clone(), NoRecompute);
    let wantf16 = two_steps::<MixedFp16>(cpu.clone(), NoRecompute);
    let wantpure = two_steps::<trainkit::PureBf16>(cpu.clone(), NoRecompute);
    // The initial values: the same seed on every backend.
    let model = Gpt2::new(tiny_config()).unwrap();
    let fresh = Trainer::builder(model, cpu, corpus_loader(20_000, 1, 2, 16))
        .build()
        .unwrap();
    let init = values(&fresh);
    for (name, cuda) in cuda_backends() {
        let got = two_steps::<trainkit::Fp32>(cuda.clone(), NoRecompute);
        check_run(&format!("{name} fp32"), &got, &want32, &init, DType::F32);
        let got = two_steps::<MixedBf16>(cuda.clone(), NoRecompute);
        check_run(&format!("{name} bf16"), &got, &want16, &init, DType::Bf16);
        let got = two_steps::<MixedFp16>(cuda.clone(), NoRecompute);
        check_run(&format!("{name} fp16"), &got, &wantf16, &init, DType::F16);
        let got = two_steps::<trainkit::PureBf16>(cuda.clone(), NoRecompute);
        check_run(
            &format!("{name} pure bf16"),
            &got,
            &wantpure,
            &init,
            DType::Bf16,
        );
    }
}

/// With the optimizer offloaded, the update runs on the host's CPU kernels instead of the
/// device's, and the weights cross over and back: two steps end in the same bits as on
/// the device alone, in every precision, after the step and inside backward.
#[test]
fn the_offloaded_optimizer_is_bitwise_the_one_on_the_device() {
    fn run<P: Precision + Default>(
        backend: Arc<dyn Backend>,
        offload: bool,
        in_backward: bool,
    ) -> (Vec<u64>, Vec<Vec<u32>>) {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
            .precision(P::default())
            .options(trainkit::TrainerOptions {
                optimizer_offload: offload,
                optimizer_in_backward: in_backward,
                grad_clip: if in_backward { 0.0 } else { 1.0 },
                ..trainkit::TrainerOptions::default()
            })
            .build()
            .unwrap();
        let losses = (0..2).map(|_| t.step().unwrap().loss.to_bits()).collect();
        (losses, common::update_bits(&t))
    }
    for (name, cuda) in cuda_backends() {
        let be: Arc<dyn Backend> = cuda.clone();
        let same = |what: &str, a: (Vec<u64>, Vec<Vec<u32>>), b: (Vec<u64>, Vec<Vec<u32>>)| {
            assert_eq!(a.0, b.0, "{name} {what}: losses");
            let differ = a.1.iter().zip(&b.1).filter(|(x, y)| x != y).count();
            assert_eq!(differ, 0, "{name} {what}: tensors differ");
        };
        same(
            "fp32",
            run::<trainkit::Fp32>(be.clone(), false, false),
            run::<trainkit::Fp32>(be.clone(), true, false),
        );
        same(
            "bf16",
            run::<MixedBf16>(be.clone(), false, false),
            run::<MixedBf16>(be.clone(), true, false),
        );
        same(
            "bf16 in backward",
            run::<MixedBf16>(be.clone(), false, true),
            run::<MixedBf16>(be.clone(), true, true),
        );
        same(
            "fp16",
            run::<MixedFp16>(be.clone(), false, false),
            run::<MixedFp16>(be.clone(), true, false),
        );
        same(
            "pure bf16",
            run::<trainkit::PureBf16>(be.clone(), false, false),
            run::<trainkit::PureBf16>(be.clone(), true, false),
        );
        // The gradients and weights crossed through page-locked host memory, queued on
        // the copy stream (the emulator runs such a copy only when it is waited for, so a
        // step that read a gradient before its copy ran would differ above); the guard's
        // small records went the waiting way. (A GPU locks buffers of 1 MiB and more
        // only, which this model has none of.)
        if name == "emulator" {
            let moved = cuda.host_transfers();
            assert!(moved.queued > 0 && moved.waited > 0, "{name}: {moved:?}");
            assert!(moved.pinned_buffers > 0, "{name}: {moved:?}");
        }
    }
}

/// Every weight streamed (`StreamAll`), the optimizer on the host writing the streamed
/// weights in place: bitwise the resident run with the optimizer on the host, after
/// backward and inside it, in f32, mixed bf16 and pure bf16 (the emulator lands each
/// queued copy only when it is waited for, and a host update that overwrote weights a
/// queued copy still had to read would change the next step).
#[test]
fn every_weight_streamed_on_cuda_is_bitwise_the_resident_run() {
    fn run<P: Precision + Default>(
        backend: Arc<dyn Backend>,
        stream: bool,
        in_backward: bool,
    ) -> (Vec<u64>, Vec<Vec<u32>>) {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
            .precision(P::default())
            .options(trainkit::TrainerOptions {
                optimizer_offload: true,
                optimizer_in_backward: in_backward,
                grad_clip: if in_backward { 0.0 } else { 1.0 },
                placement: if stream {
                    Box::new(trainkit::StreamAll {
                        ahead: 1,
                        min_bytes: 0,
                    })
                } else {
                    Box::new(trainkit::placement::Resident)
                },
                ..trainkit::TrainerOptions::default()
            })
            .build()
            .unwrap();
        let losses = (0..3).map(|_| t.step().unwrap().loss.to_bits()).collect();
        (losses, common::update_bits(&t))
    }
    for (name, cuda) in cuda_backends() {
        let be: Arc<dyn Backend> = cuda.clone();
        for in_backward in [false, true] {
            let same = |what: &str, a: (Vec<u64>, Vec<Vec<u32>>), b: (Vec<u64>, Vec<Vec<u32>>)| {
                assert_eq!(a.0, b.0, "{name} {what} in backward {in_backward}: losses");
                let differ = a.1.iter().zip(&b.1).filter(|(x, y)| x != y).count();
                assert_eq!(
                    differ, 0,
                    "{name} {what} in backward {in_backward}: tensors"
                );
            };
            same(
                "fp32",
                run::<trainkit::Fp32>(be.clone(), false, in_backward),
                run::<trainkit::Fp32>(be.clone(), true, in_backward),
            );
            same(
                "bf16",
                run::<MixedBf16>(be.clone(), false, in_backward),
                run::<MixedBf16>(be.clone(), true, in_backward),
            );
            same(
                "pure bf16",
                run::<trainkit::PureBf16>(be.clone(), false, in_backward),
                run::<trainkit::PureBf16>(be.clone(), true, in_backward),
            );
        }
    }
}

#[test]
fn the_fused_loss_in_chunks_matches_the_cpu() {
    // 32 positions in chunks of 5: the chunked path (rows copied in and out) on each
    // backend against the CPU's, and recomputation bitwise equal within it.
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let want32 = two_steps_chunked::<trainkit::Fp32>(cpu.clone(), NoRecompute, Some(5));
    let want16 = two_steps_chunked::<MixedBf16>(cpu.clone(), NoRecompute, Some(5));
    let model = Gpt2::new(tiny_config()).unwrap();
    let fresh = Trainer::builder(model, cpu, corpus_loader(20_000, 1, 2, 16))
        .build()
        .unwrap();
    let init = values(&fresh);
    for (name, cuda) in cuda_backends() {
        let got = two_steps_chunked::<trainkit::Fp32>(cuda.clone(), NoRecompute, Some(5));
        check_run(
            &format!("{name} fp32 chunked"),
            &got,
            &want32,
            &init,
            DType::F32,
        );
        let full = two_steps_chunked::<trainkit::Fp32>(cuda.clone(), Full, Some(5));
        assert_eq!(full, got, "{name}: full recomputation, chunked loss");
        let got = two_steps_chunked::<MixedBf16>(cuda.clone(), NoRecompute, Some(5));
        check_run(
            &format!("{name} bf16 chunked"),
            &got,
            &want16,
            &init,
            DType::Bf16,
        );
    }
}

#[test]
fn a_training_step_waits_for_the_gpu_once() {
    for (name, cuda) in own_backends() {
        // Two micro-batches, full recomputation and mixed precision: every path of a step.
        let model = Gpt2::new(tiny_config()).unwrap();
        let backend: Arc<dyn Backend> = cuda.clone();
        let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
            .precision(MixedBf16::default())
            .checkpoint(Full)
            .accumulation(trainkit::Constant { micro_batches: 2 })
            .build()
            .unwrap();
        for step in 1..=3 {
            let before = cuda.host_waits();
            let s = t.step().unwrap();
            let waits = cuda.host_waits() - before;
            assert!(s.loss.is_finite() && s.grad_norm > 0.0, "{name}: {s:?}");
            assert_eq!(
                waits, 1,
                "{name}: step {step} waited for the device {waits} times; only the loss read may"
            );
        }
    }
}

/// `sum_squares_each` gives each tensor's squares as `sum_squares` does, bit for bit, with
/// one wait for the device for all of them.
#[test]
fn each_tensors_squares_come_back_at_once() {
    let mut rng = Rng::new(29);
    for (name, cuda) in own_backends() {
        for dt in [DType::F32, DType::Bf16] {
            let cpu = CpuBackend::new();
            let sizes = [3000usize, 0, 17, 70_000, 256];
            let pairs: Vec<Pair> = sizes
                .iter()
                .map(|&n| pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], dt))
                .collect();
            let xs: Vec<&Tensor> = pairs.iter().map(|p| &p.cuda).collect();
            let before = cuda.host_waits();
            let each = cuda.sum_squares_each(&xs).unwrap();
            assert_eq!(cuda.host_waits() - before, 1, "{name} {dt}: one read back");
            let one: Vec<f64> = xs.iter().map(|x| cuda.sum_squares(x).unwrap()).collect();
            assert_eq!(each, one, "{name} {dt}");
            let on_cpu: Vec<&Tensor> = pairs.iter().map(|p| &p.cpu).collect();
            let cpu_each = cpu.sum_squares_each(&on_cpu).unwrap();
            for (k, (a, b)) in each.iter().zip(&cpu_each).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-12 * b.abs(),
                    "{name} {dt} tensor {k}: {a} {b}"
                );
            }
            assert_eq!(each[1], 0.0);
        }
    }
}

/// With the optimizer inside backward each parameter's guard record stays on the device
/// until backward is done: a step waits for the device a fixed number of times (the
/// records, the losses, the step's record), not once per parameter.
#[test]
fn updates_inside_backward_do_not_wait_for_the_gpu_per_parameter() {
    for (name, cuda) in own_backends() {
        let model = Gpt2::new(tiny_config()).unwrap();
        let backend: Arc<dyn Backend> = cuda.clone();
        let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
            .precision(MixedBf16::default())
            .options(trainkit::TrainerOptions {
                grad_clip: 0.0,
                optimizer_in_backward: true,
                ..trainkit::TrainerOptions::default()
            })
            .build()
            .unwrap();
        let trained = t.params().iter().filter(|p| p.trains()).count();
        assert!(trained > 10, "{name}: {trained} trained parameters");
        for step in 1..=2 {
            let before = cuda.host_waits();
            let s = t.step().unwrap();
            let waits = cuda.host_waits() - before;
            assert!(s.loss.is_finite() && s.grad_norm > 0.0, "{name}: {s:?}");
            assert!(
                waits <= 3,
                "{name}: step {step} waited for the device {waits} times ({trained} parameters)"
            );
        }
    }
}

/// A Llama step of four micro-batches with the loss in chunks of 4 rows uploads only its
/// batch: per micro-batch the token ids, the targets (once, for every chunk) and the
/// embedding backward's three bucket lists; the rotary frequencies travel with their
/// launches. So the page-locked ring never wraps within a step (it keeps its first size),
/// and the step waits for the device once, to read its loss.
#[test]
fn a_step_uploads_only_its_batch_and_waits_once() {
    for (name, cuda) in own_backends() {
        let model = tiny_llama()
            .with_loss(trainkit::ops::LossPath::Fused, Some(4))
            .unwrap();
        let backend: Arc<dyn Backend> = cuda.clone();
        let micro_batches = 4;
        let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
            .precision(MixedBf16::default())
            .checkpoint(trainkit::Selective)
            .accumulation(trainkit::Constant { micro_batches })
            .build()
            .unwrap();
        let first = cuda.upload_stats();
        for step in 1..=3 {
            let (waits, uploads) = (cuda.host_waits(), cuda.upload_stats().uploads);
            let s = t.step().unwrap();
            let waits = cuda.host_waits() - waits;
            let stats = cuda.upload_stats();
            assert!(s.loss.is_finite(), "{name}: {s:?}");
            assert_eq!(waits, 1, "{name}: step {step} waited {waits} times");
            assert_eq!(
                stats.uploads - uploads,
                5 * micro_batches as u64,
                "{name}: step {step}: uploads beyond the batch's"
            );
            assert_eq!(
                stats.ring_bytes, first.ring_bytes,
                "{name}: step {step}: the ring grew"
            );
        }
    }
}

/// `sync_ops` (profiling): every op span waits for the device at both ends, so the op
/// profile times the device's work; the numbers are those of an unsynchronized run.
#[test]
fn sync_ops_waits_at_every_op_and_changes_no_number() {
    let mut own = vec![];
    if emulated().is_some() {
        let plain = CudaBackend::emulated().unwrap();
        let synced = CudaBackend::emulated_with(
            None,
            CudaOptions {
                sync_ops: true,
                ..CudaOptions::default()
            },
        )
        .unwrap();
        own.push(("emulator", Arc::new(plain), Arc::new(synced)));
    }
    if gpu().is_some() {
        let synced = CudaOptions {
            sync_ops: true,
            ..CudaOptions::default()
        };
        own.push((
            "gpu",
            Arc::new(CudaBackend::new(0).unwrap()),
            Arc::new(CudaBackend::with_options(0, synced).unwrap()),
        ));
    }
    for (name, plain, synced) in own {
        let mut runs = vec![];
        for cuda in [&plain, &synced] {
            let backend: Arc<dyn Backend> = cuda.clone();
            let model = Gpt2::new(tiny_config()).unwrap();
            let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
                .precision(MixedBf16::default())
                .observer(trainkit::memory::OpProfile::default())
                .build()
                .unwrap();
            t.step().unwrap();
            let (before, profile) = (cuda.host_waits(), t.observer().clone());
            let s = t.step().unwrap();
            let waits = cuda.host_waits() - before;
            let ops = t.observer().since(&profile);
            let calls: u64 = ops.by_time().iter().map(|(_, o)| o.calls).sum();
            runs.push((s.loss, values(&t), waits, calls));
        }
        let (plain, synced) = (&runs[0], &runs[1]);
        assert_eq!(
            plain.0.to_bits(),
            synced.0.to_bits(),
            "{name}: the loss changed"
        );
        assert!(plain.1 == synced.1, "{name}: the weights changed");
        assert_eq!(plain.2, 1, "{name}: an unsynchronized step waits once");
        assert!(synced.3 > 20, "{name}: {} ops profiled", synced.3);
        assert!(
            synced.2 > 2 * synced.3,
            "{name}: {} waits for {} ops; each op waits at both ends",
            synced.2,
            synced.3
        );
    }
}

/// `device::op_fence` waits for the backend it was made from (one host wait per call), and
/// does nothing once that backend is gone (it holds it weakly).
#[test]
fn an_op_fence_waits_for_its_backend_and_outlives_it() {
    if emulated().is_none() {
        return;
    }
    let cuda = Arc::new(CudaBackend::emulated().unwrap());
    let backend: Arc<dyn Backend> = cuda.clone();
    let fence = trainkit::device::op_fence(&backend);
    let before = cuda.host_waits();
    fence().unwrap();
    fence().unwrap();
    assert_eq!(cuda.host_waits() - before, 2);
    backend.ledger().set_op_fence(Some(fence.clone()));
    drop(backend);
    drop(cuda);
    fence().unwrap();
}

#[test]
fn the_gradient_guard_matches_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(9);
    for (name, cuda) in cuda_backends() {
        for (max_norm, loss_scale, poison) in [
            (1.0f32, 1.0f32, None),
            (0.0, 1.0, None),
            (1e5, 1.0, None),
            (0.5, 512.0, None),
            (1.0, 1.0, Some(f32::NAN)),
            (1.0, 1.0, Some(f32::INFINITY)),
        ] {
            let mut g0 = randn(&mut rng, 5000, 0.3);
            if let Some(bad) = poison {
                g0[4321] = bad;
            }
            let grads = [
                pair(&cpu, &cuda, &g0, &[50, 100], DType::F32),
                pair(&cpu, &cuda, &randn(&mut rng, 77, 2.0), &[77], DType::Bf16),
                pair(&cpu, &cuda, &[], &[0], DType::F32),
            ];
            let l: Vec<f32> = randn(&mut rng, 64, 1.0)
                .iter()
                .map(|x| x.abs() * 3.0)
                .collect();
            let losses = pair(&cpu, &cuda, &l, &[64], DType::F32);
            let mut record = out(&cpu, &cuda, &[3], DType::F32);
            let gc: Vec<&Tensor> = grads.iter().map(|g| &g.cpu).collect();
            let gd: Vec<&Tensor> = grads.iter().map(|g| &g.cuda).collect();
            guard::grad_guard(
                &cpu,
                &mut record.cpu,
                &gc,
                &losses.cpu,
                max_norm,
                loss_scale,
            )
            .unwrap();
            guard::grad_guard(
                &*cuda,
                &mut record.cuda,
                &gd,
                &losses.cuda,
                max_norm,
                loss_scale,
            )
            .unwrap();
            let want = cpu.to_f32(&record.cpu).unwrap();
            let got = cuda.to_f32(&record.cuda).unwrap();
            let what = format!("{name}: max_norm {max_norm}, loss scale {loss_scale}, {poison:?}");
            if poison.is_some() {
                assert!(
                    want[0].is_nan() && got[0].is_nan(),
                    "{what}: {got:?} vs {want:?}"
                );
                continue;
            }
            // Each element on its own: the f64 sums differ only in their order.
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    ((g - w) / w).abs() <= 1e-6,
                    "{what}: element {i}: {got:?} vs {want:?}"
                );
            }
        }
    }
}

#[test]
fn recompute_policies_give_equal_gradients_on_cuda() {
    for (name, cuda) in cuda_backends() {
        let (l0, g0, v0) = two_steps::<trainkit::Fp32>(cuda.clone(), NoRecompute);
        for (policy, run) in [
            ("full", two_steps::<trainkit::Fp32>(cuda.clone(), Full)),
            (
                "selective",
                two_steps::<trainkit::Fp32>(cuda.clone(), Selective),
            ),
        ] {
            assert_eq!(run.0, l0, "{name} {policy}: losses");
            assert_eq!(run.1, g0, "{name} {policy}: gradients");
            assert_eq!(run.2, v0, "{name} {policy}: values");
        }
    }
}

#[test]
fn the_default_run_tracks_the_cpu_for_50_steps_on_a_gpu() {
    // Only on a GPU: the emulator took over 7 minutes for these 50 steps on two cores.
    let Some(gpu) = gpu() else {
        say("default-run check SKIPPED: it needs a GPU (too slow on the emulator)");
        return;
    };
    let backends = [("gpu", gpu)];
    let run = |backend: Arc<dyn Backend>| -> Vec<f64> {
        // The run `trainkit train` makes of the default config.
        let cfg = trainkit::config::RunConfig::default();
        let data = cfg.loaders().unwrap();
        let mut trainer = cfg
            .trainer(
                cfg.build_model().unwrap(),
                backend,
                data.train,
                Box::new(trainkit::PeakTracker::default()),
                None,
            )
            .unwrap();
        (0..50).map(|_| trainer.step().unwrap().loss).collect()
    };
    let want = run(Arc::new(CpuBackend::new()));
    for (name, cuda) in backends {
        let got = run(cuda);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                ((g - w) / w).abs() < 2e-3,
                "{name}: step {}: loss {g} vs the CPU's {w}",
                i + 1
            );
        }
    }
}

#[test]
fn a_full_gpu_is_a_clear_out_of_memory_error() {
    if emulated().is_none() {
        return;
    }
    let gpu = CudaBackend::emulated_with_capacity(Some(1 << 20)).unwrap();
    let _held = gpu
        .zeros(&[100_000], DType::F32, MemoryCategory::Weights, "held")
        .unwrap();
    let err = gpu
        .zeros(&[200_000], DType::F32, MemoryCategory::Activations, "big")
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, trainkit::Error::OutOfMemory { .. }),
        "not an out-of-memory error: {text}"
    );
    for part in [
        "`big`",
        "activations",
        "trainkit holds",
        "weights",
        "smaller batch",
    ] {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }
    // The failed allocation left nothing behind in the ledger.
    assert_eq!(gpu.ledger().snapshot().live.total(), 400_000);
}

#[test]
fn an_allocation_beyond_the_gpu_is_a_clear_out_of_memory_error() {
    let Some(gpu) = gpu() else {
        say("GPU out-of-memory check SKIPPED: it needs a GPU");
        return;
    };
    let total = gpu.device_memory().expect("a GPU reports its memory").total;
    let elements = (total / 4 + (1 << 20)) as usize;
    let err = gpu
        .zeros(
            &[elements],
            DType::F32,
            MemoryCategory::Activations,
            "too_big",
        )
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, trainkit::Error::OutOfMemory { .. }) && text.contains("`too_big`"),
        "not a clear out-of-memory error: {text}"
    );
    // And the GPU still works afterwards.
    let t = gpu
        .upload(
            &[1.0, 2.0],
            &[2],
            DType::F32,
            MemoryCategory::Activations,
            "after",
        )
        .unwrap();
    assert_eq!(gpu.to_f32(&t).unwrap(), vec![1.0, 2.0]);
}

/// The same bits on the CPU and on a CUDA backend.
fn bitwise(what: &str, name: &str, cpu: &CpuBackend, cuda: &CudaBackend, p: &Pair) {
    let want = cpu.to_f32(&p.cpu).unwrap();
    let got = cuda.to_f32(&p.cuda).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&got) == bits(&want),
        "{name}: {what} differs from the CPU"
    );
}

/// Llama's ops (RMSNorm, rotary embeddings, SwiGLU) on CUDA against the CPU: RMSNorm and
/// SwiGLU bit for bit (the CPU's sum order and `exp`), rope to f32 rounding (sinf and cosf
/// against Rust's sin and cos).
#[test]
fn llama_ops_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(11);
    for (name, cuda) in cuda_backends() {
        for dt in DTYPES {
            // RMSNorm over 1 and over 5 blocks of 32 rows (the last part full), over 132
            // (more than one chunk of the weight gradient's second pass), widths off the 16
            // lanes, of several warp rows (256 columns), and not a multiple of 8 (no vector
            // loads).
            for (rows, c) in [(5usize, 24usize), (130, 40), (9, 600), (3, 13), (4200, 16)] {
                let what = format!("rmsnorm {rows}x{c} {dt}");
                let x = pair(&cpu, &cuda, &randn(&mut rng, rows * c, 1.0), &[rows, c], dt);
                let w = pair(&cpu, &cuda, &randn(&mut rng, c, 1.0), &[c], dt);
                let mut y = out(&cpu, &cuda, &[rows, c], dt);
                let mut r = out(&cpu, &cuda, &[rows], DType::F32);
                rmsnorm::forward(&cpu, &mut y.cpu, &mut r.cpu, &x.cpu, &w.cpu, 1e-5).unwrap();
                rmsnorm::forward(&*cuda, &mut y.cuda, &mut r.cuda, &x.cuda, &w.cuda, 1e-5).unwrap();
                bitwise(&what, name, &cpu, &cuda, &y);
                bitwise(&format!("{what} rstd"), name, &cpu, &cuda, &r);
                let d = pair(&cpu, &cuda, &randn(&mut rng, rows * c, 1.0), &[rows, c], dt);
                let mut dx = pair(&cpu, &cuda, &randn(&mut rng, rows * c, 1.0), &[rows, c], dt);
                let mut dw = pair(&cpu, &cuda, &randn(&mut rng, c, 1.0), &[c], dt);
                let (dxc, dwc) = (&mut dx.cpu, &mut dw.cpu);
                rmsnorm::backward(&cpu, dxc, dwc, &d.cpu, &x.cpu, &w.cpu, &r.cpu).unwrap();
                rmsnorm::backward(
                    &*cuda,
                    &mut dx.cuda,
                    &mut dw.cuda,
                    &d.cuda,
                    &x.cuda,
                    &w.cuda,
                    &r.cuda,
                )
                .unwrap();
                bitwise(&format!("{what} dx"), name, &cpu, &cuda, &dx);
                bitwise(&format!("{what} dweight"), name, &cpu, &cuda, &dw);
            }
            // Rope with grouped and multi-query heads; heads of 64 and 48 (16-byte loads,
            // 8 pairs a thread) and of 40 (20 pairs: no vector loads).
            let shapes = [
                (4usize, 2usize, 8usize),
                (3, 1, 6),
                (2, 2, 4),
                (4, 2, 64),
                (3, 1, 48),
            ];
            for (h, kv, hd) in shapes.into_iter().chain([(2, 1, 40)]) {
                let heads = Heads {
                    n_head: h,
                    n_kv_head: kv,
                    head_dim: hd,
                };
                let (b, t, w) = (2, 7, heads.qkv_width());
                let what = format!("rope {heads:?} {dt}");
                let inv: Vec<f32> = (0..hd / 2)
                    .map(|i| 1.0 / 500f32.powf(2.0 * i as f32 / hd as f32))
                    .collect();
                let x = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, b * t * w, 1.0),
                    &[b, t, w],
                    dt,
                );
                let mut y = out(&cpu, &cuda, &[b, t, w], dt);
                rope::forward(&cpu, &mut y.cpu, &x.cpu, &inv, heads).unwrap();
                rope::forward(&*cuda, &mut y.cuda, &x.cuda, &inv, heads).unwrap();
                compare(&what, name, &cpu, &cuda, &y);
                let mut dx = out(&cpu, &cuda, &[b, t, w], dt);
                rope::backward(&cpu, &mut dx.cpu, &x.cpu, &inv, heads).unwrap();
                rope::backward(&*cuda, &mut dx.cuda, &x.cuda, &inv, heads).unwrap();
                compare(&format!("{what} backward"), name, &cpu, &cuda, &dx);
            }
            // SwiGLU, with gates far out in both tails.
            let (rows, f) = (9usize, 37usize);
            let what = format!("swiglu {rows}x{f} {dt}");
            let gu = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, rows * 2 * f, 6.0),
                &[rows, 2 * f],
                dt,
            );
            let mut y = out(&cpu, &cuda, &[rows, f], dt);
            glu::forward(&cpu, Gate::Silu, &mut y.cpu, &gu.cpu).unwrap();
            glu::forward(&*cuda, Gate::Silu, &mut y.cuda, &gu.cuda).unwrap();
            bitwise(&what, name, &cpu, &cuda, &y);
            let d = pair(&cpu, &cuda, &randn(&mut rng, rows * f, 1.0), &[rows, f], dt);
            let mut dgu = out(&cpu, &cuda, &[rows, 2 * f], dt);
            glu::backward(&cpu, Gate::Silu, &mut dgu.cpu, &d.cpu, &gu.cpu).unwrap();
            glu::backward(&*cuda, Gate::Silu, &mut dgu.cuda, &d.cuda, &gu.cuda).unwrap();
            bitwise(&format!("{what} backward"), name, &cpu, &cuda, &dgu);
            // In place over the gate and up values: the same gradients.
            let mut inplace = pair(
                &cpu,
                &cuda,
                &cpu.to_f32(&gu.cpu).unwrap(),
                &[rows, 2 * f],
                dt,
            );
            glu::backward_in_place(&cpu, Gate::Silu, &mut inplace.cpu, &d.cpu).unwrap();
            glu::backward_in_place(&*cuda, Gate::Silu, &mut inplace.cuda, &d.cuda).unwrap();
            bitwise(
                &format!("{what} backward in place"),
                name,
                &cpu,
                &cuda,
                &inplace,
            );
            assert_eq!(
                cpu.to_f32(&inplace.cpu).unwrap(),
                cpu.to_f32(&dgu.cpu).unwrap(),
                "{what}: in place"
            );
        }
    }
}

/// Qwen3's per-head q/k norm and Gemma's GeGLU gate on CUDA against the CPU, bit for bit
/// (the RMS norm's sum order, the tanh GELU's `exp`), in every dtype, with grouped-query
/// heads and more query rows than one block of the gain gradient.
#[test]
fn qk_norm_and_geglu_match_the_cpu() {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(12);
    for (name, cuda) in cuda_backends() {
        for dt in DTYPES {
            for (h, kv, hd, tokens) in [(4usize, 2usize, 16usize, 70usize), (2, 1, 40, 9)] {
                let heads = Heads {
                    n_head: h,
                    n_kv_head: kv,
                    head_dim: hd,
                };
                let w = heads.qkv_width();
                let what = format!("qk_norm {heads:?} x{tokens} {dt}");
                let x = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, tokens * w, 1.0),
                    &[tokens, w],
                    dt,
                );
                let wq = pair(&cpu, &cuda, &randn(&mut rng, hd, 1.0), &[hd], dt);
                let wk = pair(&cpu, &cuda, &randn(&mut rng, hd, 1.0), &[hd], dt);
                let mut y = out(&cpu, &cuda, &[tokens, w], dt);
                let mut r = out(&cpu, &cuda, &[tokens, h + kv], DType::F32);
                qk_norm::forward(
                    &cpu, &mut y.cpu, &mut r.cpu, &x.cpu, &wq.cpu, &wk.cpu, heads, 1e-6,
                )
                .unwrap();
                qk_norm::forward(
                    &*cuda,
                    &mut y.cuda,
                    &mut r.cuda,
                    &x.cuda,
                    &wq.cuda,
                    &wk.cuda,
                    heads,
                    1e-6,
                )
                .unwrap();
                bitwise(&what, name, &cpu, &cuda, &y);
                bitwise(&format!("{what} rstd"), name, &cpu, &cuda, &r);
                let d = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, tokens * w, 1.0),
                    &[tokens, w],
                    dt,
                );
                let mut dx = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, tokens * w, 1.0),
                    &[tokens, w],
                    dt,
                );
                let mut dwq = pair(&cpu, &cuda, &randn(&mut rng, hd, 1.0), &[hd], DType::F32);
                let mut dwk = pair(&cpu, &cuda, &randn(&mut rng, hd, 1.0), &[hd], DType::F32);
                qk_norm::backward(
                    &cpu,
                    &mut dx.cpu,
                    &mut dwq.cpu,
                    &mut dwk.cpu,
                    &d.cpu,
                    &x.cpu,
                    &wq.cpu,
                    &wk.cpu,
                    &r.cpu,
                    heads,
                )
                .unwrap();
                qk_norm::backward(
                    &*cuda,
                    &mut dx.cuda,
                    &mut dwq.cuda,
                    &mut dwk.cuda,
                    &d.cuda,
                    &x.cuda,
                    &wq.cuda,
                    &wk.cuda,
                    &r.cuda,
                    heads,
                )
                .unwrap();
                bitwise(&format!("{what} dx"), name, &cpu, &cuda, &dx);
                bitwise(&format!("{what} dwq"), name, &cpu, &cuda, &dwq);
                bitwise(&format!("{what} dwk"), name, &cpu, &cuda, &dwk);
            }
            // F a multiple of 8: 16-byte accesses (SwiGLU above runs element by element; both
            // gates share the kernels' two paths).
            let (rows, f) = (9usize, 40usize);
            let what = format!("geglu {rows}x{f} {dt}");
            let gu = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, rows * 2 * f, 4.0),
                &[rows, 2 * f],
                dt,
            );
            let mut y = out(&cpu, &cuda, &[rows, f], dt);
            glu::forward(&cpu, Gate::Gelu, &mut y.cpu, &gu.cpu).unwrap();
            glu::forward(&*cuda, Gate::Gelu, &mut y.cuda, &gu.cuda).unwrap();
            bitwise(&what, name, &cpu, &cuda, &y);
            let d = pair(&cpu, &cuda, &randn(&mut rng, rows * f, 1.0), &[rows, f], dt);
            let mut dgu = out(&cpu, &cuda, &[rows, 2 * f], dt);
            glu::backward(&cpu, Gate::Gelu, &mut dgu.cpu, &d.cpu, &gu.cpu).unwrap();
            glu::backward(&*cuda, Gate::Gelu, &mut dgu.cuda, &d.cuda, &gu.cuda).unwrap();
            bitwise(&format!("{what} backward"), name, &cpu, &cuda, &dgu);
        }
    }
}

/// A small Llama: grouped-query attention, rotary embeddings with llama3 scaling, SwiGLU,
/// an untied head, a vocabulary of 200 (its embedding and head padded to 256 rows).
fn tiny_llama() -> trainkit::Llama {
    trainkit::Llama::new(trainkit::LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        vocab_size: 200,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        rope: trainkit::model::Rope {
            theta: 500.0,
            scaling: trainkit::model::RopeScaling::Llama3 {
                factor: 4.0,
                low_freq_factor: 1.0,
                high_freq_factor: 2.0,
                original_max_position_embeddings: 16.0,
            },
        },
    })
    .unwrap()
}

/// Two steps of [`tiny_llama`] with selective recomputation, from the same seed.
fn llama_two_steps<P: Precision + Default>(
    backend: Arc<dyn Backend>,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut t = Trainer::builder(tiny_llama(), backend, corpus_loader(20_000, 1, 2, 16))
        .precision(P::default())
        .checkpoint(trainkit::Selective)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (losses, grads(&t), values(&t))
}

#[test]
fn a_llama_training_step_matches_the_cpu_in_every_precision() {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let want32 = llama_two_steps::<trainkit::Fp32>(cpu.clone());
    let want16 = llama_two_steps::<MixedBf16>(cpu.clone());
    let wantf16 = llama_two_steps::<MixedFp16>(cpu.clone());
    let fresh = Trainer::builder(tiny_llama(), cpu, corpus_loader(20_000, 1, 2, 16))
        .build()
        .unwrap();
    let init = values(&fresh);
    for (name, cuda) in cuda_backends() {
        let got = llama_two_steps::<trainkit::Fp32>(cuda.clone());
        check_run(
            &format!("{name} llama fp32"),
            &got,
            &want32,
            &init,
            DType::F32,
        );
        let got = llama_two_steps::<MixedBf16>(cuda.clone());
        check_run(
            &format!("{name} llama bf16"),
            &got,
            &want16,
            &init,
            DType::Bf16,
        );
        let got = llama_two_steps::<MixedFp16>(cuda.clone());
        check_run(
            &format!("{name} llama fp16"),
            &got,
            &wantf16,
            &init,
            DType::F16,
        );
    }
}

/// A small Qwen2 (q/k/v biases) or Qwen3 (the per-head q/k norm, heads of 16 in a model
/// 32 wide with 4 heads), boxed.
fn tiny_qwen(version: u8) -> Box<dyn trainkit::Model> {
    let base = trainkit::LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: if version == 3 { 16 } else { 8 },
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: version == 3,
        initializer_range: 0.02,
        rope: trainkit::model::Rope {
            theta: 10_000.0,
            scaling: trainkit::model::RopeScaling::Default,
        },
    };
    let config: trainkit::ModelConfig = if version == 3 {
        trainkit::Qwen3Config {
            base,
            attention_bias: false,
        }
        .into()
    } else {
        trainkit::Qwen2Config { base }.into()
    };
    config.build().unwrap()
}

/// Two steps of [`tiny_qwen`] with selective recomputation, from the same seed.
fn qwen_two_steps<P: Precision + Default>(
    version: u8,
    backend: Arc<dyn Backend>,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut t = Trainer::builder(tiny_qwen(version), backend, corpus_loader(20_000, 1, 2, 16))
        .precision(P::default())
        .checkpoint(trainkit::Selective)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (losses, grads(&t), values(&t))
}

#[test]
fn qwen_training_steps_match_the_cpu() {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    for version in [2u8, 3] {
        let want32 = qwen_two_steps::<trainkit::Fp32>(version, cpu.clone());
        let want16 = qwen_two_steps::<MixedBf16>(version, cpu.clone());
        let fresh = Trainer::builder(tiny_qwen(version), cpu.clone(), {
            corpus_loader(20_000, 1, 2, 16)
        })
        .build()
        .unwrap();
        let init = values(&fresh);
        for (name, cuda) in cuda_backends() {
            let got = qwen_two_steps::<trainkit::Fp32>(version, cuda.clone());
            let what = format!("{name} qwen{version} fp32");
            check_run(&what, &got, &want32, &init, DType::F32);
            let got = qwen_two_steps::<MixedBf16>(version, cuda.clone());
            let what = format!("{name} qwen{version} bf16");
            check_run(&what, &got, &want16, &init, DType::Bf16);
        }
    }
}

/// Two steps of the tiny GPT-2 with the activations the policy keeps offloaded (or not):
/// losses, gradients, values, the offloaded peak and the host waits of the second step.
type OffloadRun = (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>, u64, u64);

fn offload_steps<P: Precision + Default>(
    cuda: &Arc<CudaBackend>,
    policy: Box<dyn CheckpointPolicy>,
    offload: bool,
) -> OffloadRun {
    let backend: Arc<dyn Backend> = cuda.clone();
    let model = Gpt2::new(tiny_config()).unwrap();
    let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
        .precision(P::default())
        .checkpoint(policy)
        .options(trainkit::TrainerOptions {
            offload_activations: offload,
            ..trainkit::TrainerOptions::default()
        })
        .build()
        .unwrap();
    let first = t.step().unwrap().loss;
    let before = cuda.host_waits();
    let s = t.step().unwrap();
    let waits = cuda.host_waits() - before;
    (
        vec![first, s.loss],
        grads(&t),
        values(&t),
        s.memory.peak.get(MemoryCategory::Offloaded),
        waits,
    )
}

#[test]
fn offloading_on_cuda_is_bitwise_equal_and_the_host_never_waits_for_it() {
    let policies: Vec<Box<dyn CheckpointPolicy>> = vec![
        Box::new(NoRecompute),
        Box::new(Full),
        Box::new(trainkit::Budget::new(40_000)),
    ];
    for (name, cuda) in own_backends() {
        for policy in &policies {
            let what = format!("{name} {policy:?}");
            // The emulator lands a copy back only when compute waits for it: a kernel that
            // read a fetched activation too early would read the poison of its buffer.
            let kept = offload_steps::<trainkit::Fp32>(&cuda, policy.clone(), false);
            let off = offload_steps::<trainkit::Fp32>(&cuda, policy.clone(), true);
            assert_eq!(off.0, kept.0, "{what} f32: losses");
            assert_eq!(off.1, kept.1, "{what} f32: gradients");
            assert_eq!(off.2, kept.2, "{what} f32: values");
            assert_eq!(kept.3, 0, "{what}");
            assert!(off.3 > 0, "{what}: nothing offloaded");
            assert_eq!(off.4, kept.4, "{what}: offloading made the host wait");
            let kept = offload_steps::<MixedBf16>(&cuda, policy.clone(), false);
            let off = offload_steps::<MixedBf16>(&cuda, policy.clone(), true);
            assert_eq!(off.0, kept.0, "{what} bf16: losses");
            assert_eq!(off.1, kept.1, "{what} bf16: gradients");
            assert_eq!(off.2, kept.2, "{what} bf16: values");
        }
    }
}

/// A trainer of [`tiny_qwen`] (version 2: q/k/v biases) or of the tiny GPT-2 through LoRA
/// on every projection (`B` drawn at random, PEFT's dropout 0.05), with selective
/// recomputation.
fn lora_trainer<P: Precision + Default>(
    gpt2: bool,
    nf4: bool,
    dora: bool,
    backend: Arc<dyn Backend>,
) -> Trainer<P, trainkit::Selective, trainkit::AdamW, trainkit::Constant, trainkit::PeakTracker> {
    lora_trainer_placed(
        gpt2,
        nf4,
        dora,
        backend,
        Box::new(trainkit::placement::Resident),
    )
}

/// [`lora_trainer`] with its weights placed by `placement`.
fn lora_trainer_placed<P: Precision + Default>(
    gpt2: bool,
    nf4: bool,
    dora: bool,
    backend: Arc<dyn Backend>,
    placement: Box<dyn trainkit::WeightPlacement>,
) -> Trainer<P, trainkit::Selective, trainkit::AdamW, trainkit::Constant, trainkit::PeakTracker> {
    let (base, targets): (Box<dyn trainkit::Model>, &[&str]) = if gpt2 {
        (
            Box::new(Gpt2::new(tiny_config()).unwrap()),
            &["c_attn", "c_proj", "c_fc"],
        )
    } else {
        const ALL: [&str; 7] = [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ];
        (tiny_qwen(2), &ALL)
    };
    let lora = trainkit::Lora {
        dropout: 0.05,
        dora,
        ..trainkit::Lora::new(4, 8.0, targets).unwrap()
    };
    let lora = if nf4 { lora.with_nf4_base() } else { lora };
    let model = base.with_adapter(Arc::new(lora)).unwrap();
    let mut t = Trainer::builder(model, backend, corpus_loader(20_000, 1, 2, 16))
        .precision(P::default())
        .checkpoint(trainkit::Selective)
        .options(trainkit::TrainerOptions {
            placement,
            ..trainkit::TrainerOptions::default()
        })
        .build()
        .unwrap();
    // Each B made non-zero (as after some training), so that the A's gradients are more
    // than rounding noise.
    let be = t.backend().clone();
    let mut rng = Rng::new(17);
    for p in t.params_mut() {
        if p.name().contains(".lora_B") {
            let v = randn(&mut rng, p.numel(), 0.1);
            p.set_value(be.as_ref(), &v).unwrap();
        }
    }
    t
}

/// Two steps of [`lora_trainer`]: losses, the adapters' gradients, every value.
fn lora_two_steps<P: Precision + Default>(
    gpt2: bool,
    nf4: bool,
    dora: bool,
    backend: Arc<dyn Backend>,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut t = lora_trainer::<P>(gpt2, nf4, dora, backend);
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    let grads = t
        .params()
        .iter()
        .filter(|p| p.trains())
        .map(|p| t.backend().to_f32(p.grad().unwrap()).unwrap())
        .collect();
    (losses, grads, values(&t))
}

/// Losses, gradients, values, and the second step's host waits, queued and waited
/// transfers and streamed bytes.
type PlacedRun = (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>, [u64; 4]);

/// Two steps of [`lora_trainer_placed`] on `cuda`, the second one's host waits and
/// transfers counted: losses, the adapters' gradients, every value, the host waits, the
/// transfers queued on the copy stream and those waited for, the bytes streamed.
fn placed_steps<P: Precision + Default>(
    cuda: &Arc<CudaBackend>,
    gpt2: bool,
    nf4: bool,
    dora: bool,
    placement: Box<dyn trainkit::WeightPlacement>,
) -> PlacedRun {
    let backend: Arc<dyn Backend> = cuda.clone();
    let mut t = lora_trainer_placed::<P>(gpt2, nf4, dora, backend, placement);
    let first = t.step().unwrap().loss;
    let (waits, transfers) = (cuda.host_waits(), cuda.host_transfers());
    let s = t.step().unwrap();
    let after = cuda.host_transfers();
    let counts = [
        cuda.host_waits() - waits,
        after.queued - transfers.queued,
        after.waited - transfers.waited,
        s.streamed_bytes,
    ];
    let grads = t
        .params()
        .iter()
        .filter(|p| p.trains())
        .map(|p| t.backend().to_f32(p.grad().unwrap()).unwrap())
        .collect();
    (vec![first, s.loss], grads, values(&t), counts)
}

/// A frozen base streamed from page-locked host memory trains bitwise as a resident one
/// on CUDA (LoRA, QLoRA's packed NF4, DoRA; f32 and bf16): every copy is queued on the
/// copy stream, the host never waits for one, and the emulator, which lands a copy only
/// when compute waits for it, proves that every section's weights are awaited before a
/// kernel reads them (too early, it would read the poison of a fresh buffer).
#[test]
fn streamed_weights_on_cuda_are_bitwise_the_resident_run() {
    for (name, cuda) in own_backends() {
        for (gpt2, nf4, dora) in [
            (false, false, false),
            (false, true, false),
            (true, false, true),
            (true, true, false),
        ] {
            let what = format!("{name} gpt2 {gpt2} nf4 {nf4} dora {dora}");
            let stream = || {
                Box::new(trainkit::StreamFrozen {
                    ahead: 1,
                    min_bytes: 0,
                })
            };
            let resident = || Box::new(trainkit::placement::Resident);
            let kept = placed_steps::<trainkit::Fp32>(&cuda, gpt2, nf4, dora, resident());
            let streamed = placed_steps::<trainkit::Fp32>(&cuda, gpt2, nf4, dora, stream());
            assert_eq!(streamed.0, kept.0, "{what} f32: losses");
            assert_eq!(streamed.1, kept.1, "{what} f32: gradients");
            assert_eq!(streamed.2, kept.2, "{what} f32: values");
            let [waits, queued, waited, bytes] = streamed.3;
            assert_eq!(waits, kept.3[0], "{what}: streaming made the host wait");
            assert_eq!(kept.3[3], 0, "{what}");
            assert!(bytes > 0 && queued > kept.3[1], "{what}: {:?}", streamed.3);
            assert_eq!(waited, kept.3[2], "{what}: a copy from pageable memory");
            let kept = placed_steps::<MixedBf16>(&cuda, gpt2, nf4, dora, resident());
            let streamed = placed_steps::<MixedBf16>(&cuda, gpt2, nf4, dora, stream());
            assert_eq!(streamed.0, kept.0, "{what} bf16: losses");
            assert_eq!(streamed.1, kept.1, "{what} bf16: gradients");
            assert_eq!(streamed.2, kept.2, "{what} bf16: values");
        }
    }
}

/// LoRA's nodes (the low-rank products, the column kernels of the fused projections'
/// blocks) train on CUDA as on the CPU, in f32 and bf16.
#[test]
fn lora_training_steps_match_the_cpu() {
    lora_steps_match_the_cpu(false, false);
}

/// DoRA (its column norms, scaling and magnitude gradient in kernels/lora.cu) trains on
/// CUDA as on the CPU, over float and NF4 bases, in f32 and bf16.
#[test]
fn dora_training_steps_match_the_cpu() {
    lora_steps_match_the_cpu(false, true);
    lora_steps_match_the_cpu(true, true);
}

/// NF4 rows dequantized by kernels/nf4.cu are the CPU's bit for bit, in every float
/// dtype, from any element on (blocks cut anywhere, the second block of statistics), in
/// one part and in three.
#[test]
fn nf4_dequantize_matches_the_cpu_bit_for_bit() {
    let cpu = CpuBackend::new();
    let (rows, cols) = (300, 72); // 337.5 absmax blocks: two blocks of statistics
    let mut rng = Rng::new(5);
    let w = randn(&mut rng, rows * cols, 0.05);
    // One part, and three (a fused weight's modules, each quantized on its own).
    let split = DType::Nf4(trainkit::ops::nf4::Parts([
        (cols * 100) as u64,
        (cols * 50) as u64,
    ]));
    for ((name, cuda), packed) in cuda_backends()
        .into_iter()
        .flat_map(|b| [(b.clone(), DType::NF4), (b, split)])
    {
        let wc = cpu
            .upload(&w, &[rows, cols], packed, MemoryCategory::Weights, "w")
            .unwrap();
        let wg = cuda
            .upload(&w, &[rows, cols], packed, MemoryCategory::Weights, "w")
            .unwrap();
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            for (start, n) in [(0, rows * cols), (cols * 7 + 5, cols * 200 + 3)] {
                let mut a = cpu
                    .empty(&[n], dtype, MemoryCategory::Workspace, "a")
                    .unwrap();
                let mut b = cuda
                    .empty(&[n], dtype, MemoryCategory::Workspace, "b")
                    .unwrap();
                trainkit::ops::nf4::dequantize(&cpu, &mut a, &wc, start).unwrap();
                trainkit::ops::nf4::dequantize(cuda.as_ref(), &mut b, &wg, start).unwrap();
                let (a, b) = (cpu.to_f32(&a).unwrap(), cuda.to_f32(&b).unwrap());
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&a) == bits(&b),
                    "{name} {dtype} from {start} ({packed:?})"
                );
            }
        }
    }
}

/// QLoRA (the base projections in NF4, dequantized by kernels/nf4.cu a block of rows at
/// a time) trains on CUDA as on the CPU, in f32 and bf16.
#[test]
fn qlora_training_steps_match_the_cpu() {
    lora_steps_match_the_cpu(true, false);
}

fn lora_steps_match_the_cpu(nf4: bool, dora: bool) {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    for gpt2 in [false, true] {
        let model = if gpt2 { "gpt2" } else { "qwen2" };
        let want32 = lora_two_steps::<trainkit::Fp32>(gpt2, nf4, dora, cpu.clone());
        let want16 = lora_two_steps::<MixedBf16>(gpt2, nf4, dora, cpu.clone());
        let init = values(&lora_trainer::<trainkit::Fp32>(
            gpt2,
            nf4,
            dora,
            cpu.clone(),
        ));
        for (name, cuda) in cuda_backends() {
            let got = lora_two_steps::<trainkit::Fp32>(gpt2, nf4, dora, cuda.clone());
            check_run(
                &format!("{name} lora {model} nf4 {nf4} dora {dora} fp32"),
                &got,
                &want32,
                &init,
                DType::F32,
            );
            let got = lora_two_steps::<MixedBf16>(gpt2, nf4, dora, cuda.clone());
            check_run(
                &format!("{name} lora {model} nf4 {nf4} dora {dora} bf16"),
                &got,
                &want16,
                &init,
                DType::Bf16,
            );
        }
    }
}

/// Rows of several documents (`ops::positions`; the fused attention's are in
/// `flash_attention_matches_the_cpu`): the materialized softmax (bit for bit), rotary and
/// learned position embeddings with their backward, against the CPU.
#[test]
fn document_masking_matches_the_cpu() {
    use trainkit::ops::positions;
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(23);
    for (name, cuda) in cuda_backends() {
        // Row 0: documents of 5, 70, 1, 74 tokens; row 1: 150 and one more token.
        let (b, t) = (2usize, 151usize);
        let starts = [5usize, 75, 76, t + 150];
        let pos = positions::from_document_starts(b, t, |k| starts.contains(&k));
        for (h, kv, hd) in [(2usize, 1usize, 32usize), (1, 1, 16)] {
            let heads = Heads {
                n_head: h,
                n_kv_head: kv,
                head_dim: hd,
            };
            let w = heads.qkv_width();
            for dt in DTYPES {
                let what = format!("documents {heads:?} {dt}");
                let qkv = pair(
                    &cpu,
                    &cuda,
                    &randn(&mut rng, b * t * w, 1.0),
                    &[b, t, w],
                    dt,
                );
                // The materialized softmax over each document's keys: bit for bit.
                let sq = [b, h, t, t];
                let s = pair(&cpu, &cuda, &randn(&mut rng, b * h * t * t, 2.0), &sq, dt);
                let mut p = out(&cpu, &cuda, &sq, dt);
                attention::softmax_in_documents(&cpu, &mut p.cpu, &s.cpu, Some(&pos)).unwrap();
                attention::softmax_in_documents(&*cuda, &mut p.cuda, &s.cuda, Some(&pos)).unwrap();
                bitwise(&format!("softmax {what}"), name, &cpu, &cuda, &p);

                // Rotary embeddings by position in the document.
                let inv: Vec<f32> = (0..hd / 2)
                    .map(|i| 1.0 / 500f32.powf(2.0 * i as f32 / hd as f32))
                    .collect();
                let mut y = out(&cpu, &cuda, &[b, t, w], dt);
                rope::forward_in_documents(&cpu, &mut y.cpu, &qkv.cpu, &inv, heads, Some(&pos))
                    .unwrap();
                rope::forward_in_documents(&*cuda, &mut y.cuda, &qkv.cuda, &inv, heads, Some(&pos))
                    .unwrap();
                compare(&format!("rope {what}"), name, &cpu, &cuda, &y);
                let mut dx = out(&cpu, &cuda, &[b, t, w], dt);
                rope::backward_in_documents(&cpu, &mut dx.cpu, &qkv.cpu, &inv, heads, Some(&pos))
                    .unwrap();
                rope::backward_in_documents(
                    &*cuda,
                    &mut dx.cuda,
                    &qkv.cuda,
                    &inv,
                    heads,
                    Some(&pos),
                )
                .unwrap();
                compare(&format!("rope backward {what}"), name, &cpu, &cuda, &dx);
            }
        }
        // Learned position embeddings by position in the document, and their gradient.
        let (v, cw) = (11usize, 16usize);
        for dt in DTYPES {
            let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
            let wte = pair(&cpu, &cuda, &randn(&mut rng, v * cw, 1.0), &[v, cw], dt);
            let wpe = pair(&cpu, &cuda, &randn(&mut rng, t * cw, 1.0), &[t, cw], dt);
            let mut o = out(&cpu, &cuda, &[b, t, cw], dt);
            embedding::forward_in_documents(
                &cpu,
                &mut o.cpu,
                &tokens,
                &wte.cpu,
                Some(&wpe.cpu),
                Some(&pos),
            )
            .unwrap();
            embedding::forward_in_documents(
                &*cuda,
                &mut o.cuda,
                &tokens,
                &wte.cuda,
                Some(&wpe.cuda),
                Some(&pos),
            )
            .unwrap();
            bitwise(
                &format!("embedding in documents {dt}"),
                name,
                &cpu,
                &cuda,
                &o,
            );
            let dout = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, b * t * cw, 1.0),
                &[b, t, cw],
                dt,
            );
            let mut dwte = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, v * cw, 1.0),
                &[v, cw],
                DType::F32,
            );
            let mut dwpe = pair(
                &cpu,
                &cuda,
                &randn(&mut rng, t * cw, 1.0),
                &[t, cw],
                DType::F32,
            );
            embedding::backward_in_documents(
                &cpu,
                &mut dwte.cpu,
                Some(&mut dwpe.cpu),
                &dout.cpu,
                &tokens,
                Some(&pos),
            )
            .unwrap();
            embedding::backward_in_documents(
                &*cuda,
                &mut dwte.cuda,
                Some(&mut dwpe.cuda),
                &dout.cuda,
                &tokens,
                Some(&pos),
            )
            .unwrap();
            bitwise(
                &format!("embedding dwpe in documents {dt}"),
                name,
                &cpu,
                &cuda,
                &dwpe,
            );
            bitwise(
                &format!("embedding dwte in documents {dt}"),
                name,
                &cpu,
                &cuda,
                &dwte,
            );
        }
    }
}

/// Two steps on packed rows (documents flagged in the mask, as `prepare --chat --pack`
/// writes them): a GPT-2 (learned positions) and a Llama (rotary) on CUDA track the CPU's
/// losses, gradients and weights in f32 and bf16; and in bf16, whose roundings fall in
/// other places on CUDA (fused epilogues), the CUDA gradients are no further from the f32
/// run's than the CPU's bf16 gradients are (within a quarter).
#[test]
fn packed_rows_train_as_on_the_cpu() {
    use trainkit::data::token_flags::{DOCUMENT_START, TRAINED};
    use trainkit::data::{DataLoader, Shard, TokenDataset};
    let mut rng = Rng::new(9);
    let (mut tokens, mut flags) = (Vec::new(), Vec::new());
    for n in [5usize, 20, 7, 10, 22, 32, 1, 31] {
        for i in 0..n {
            // Within both models' vocabularies (the Llama's has 200 ids).
            tokens.push(rng.below(200) as u32);
            flags.push(if i == 0 { DOCUMENT_START } else { TRAINED });
        }
    }
    tokens.push(0);
    flags.push(DOCUMENT_START);
    let shard = Shard::from_tokens_and_flags(tokens, flags).unwrap();
    let data = DataLoader::new(TokenDataset::from_shards(vec![shard]), 2, 32).unwrap();
    let run = |backend: Arc<dyn Backend>, llama: bool, bf16: bool, steps: usize| {
        let model: Box<dyn trainkit::Model> = if llama {
            Box::new(tiny_llama())
        } else {
            Box::new(Gpt2::new(tiny_config()).unwrap())
        };
        let precision: Box<dyn Precision> = if bf16 {
            Box::new(MixedBf16::default())
        } else {
            Box::new(trainkit::Fp32)
        };
        let mut t = Trainer::builder(model, backend, data.clone())
            .precision(precision)
            .build()
            .unwrap();
        let losses: Vec<f64> = (0..steps).map(|_| t.step().unwrap().loss).collect();
        let grads = if steps > 0 { grads(&t) } else { Vec::new() };
        (losses, grads, values(&t))
    };
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    for llama in [false, true] {
        let init = run(cpu.clone(), llama, false, 0).2;
        let f32_run = run(cpu.clone(), llama, false, 2);
        for bf16 in [false, true] {
            let want = if bf16 {
                run(cpu.clone(), llama, bf16, 2)
            } else {
                f32_run.clone()
            };
            for (name, cuda) in cuda_backends() {
                let got = run(cuda.clone(), llama, bf16, 2);
                let dt = if bf16 { DType::Bf16 } else { DType::F32 };
                let what = format!("{name} packed llama={llama}");
                check_run(&what, &got, &want, &init, dt);
                if bf16 {
                    let cpu_error = worst_grad_error(&want.1, &f32_run.1);
                    let cuda_error = worst_grad_error(&got.1, &f32_run.1);
                    assert!(
                        cuda_error <= 1.25 * cpu_error,
                        "{what}: bf16 gradients {cuda_error:.3e} from f32's, the CPU's \
                         {cpu_error:.3e}"
                    );
                }
            }
        }
    }
}

/// Writing f32 updates back into bf16 weights (pure bf16): the widening with the Kahan
/// compensation and the three roundings, bit for bit as on the CPU, stochastic rounding's
/// random bits included.
#[test]
fn update_rounding_matches_the_cpu_bit_for_bit() {
    use trainkit::ops::update_rounding::{self, stream_key, UpdateRounding};
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(17);
    let n = 1000;
    for (name, cuda) in cuda_backends() {
        let w = pair(&cpu, &cuda, &randn(&mut rng, n, 1.0), &[n], DType::Bf16);
        let comp0 = randn(&mut rng, n, 1e-3);
        let comp = pair(&cpu, &cuda, &comp0, &[n], DType::Bf16);
        let mut master = out(&cpu, &cuda, &[n], DType::F32);
        update_rounding::expand(&cpu, &mut master.cpu, &w.cpu, Some(&comp.cpu)).unwrap();
        update_rounding::expand(&*cuda, &mut master.cuda, &w.cuda, Some(&comp.cuda)).unwrap();
        bitwise("update_rounding_expand", name, &cpu, &cuda, &master);
        // An update, some of it far below bf16's resolution, and values that are not finite.
        let mut x = randn(&mut rng, n, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v += 1e-4 * (i as f32).sin();
        }
        x[3] = f32::INFINITY;
        x[4] = f32::MAX;
        let master = pair(&cpu, &cuda, &x, &[n], DType::F32);
        for mode in [
            UpdateRounding::Nearest,
            UpdateRounding::Stochastic,
            UpdateRounding::Kahan,
        ] {
            let key = stream_key(5, 9, 2);
            let mut w = out(&cpu, &cuda, &[n], DType::Bf16);
            let mut c = pair(&cpu, &cuda, &comp0, &[n], DType::Bf16);
            let kahan = mode.compensated();
            update_rounding::round(
                &cpu,
                &mut w.cpu,
                kahan.then_some(&mut c.cpu),
                &master.cpu,
                mode,
                key,
            )
            .unwrap();
            update_rounding::round(
                &*cuda,
                &mut w.cuda,
                kahan.then_some(&mut c.cuda),
                &master.cuda,
                mode,
                key,
            )
            .unwrap();
            bitwise(&format!("update_rounding {mode}"), name, &cpu, &cuda, &w);
            bitwise(
                &format!("update_rounding {mode} compensation"),
                name,
                &cpu,
                &cuda,
                &c,
            );
        }
    }
}

/// Per-kernel timing: off, nothing is recorded; on, every kernel launch and every product
/// is, summed per kernel with its calls counted, and reading the times empties the record.
#[test]
fn kernel_times_count_every_launch_and_product() {
    if emulated().is_none() {
        return;
    }
    // A backend of its own: the shared one runs other tests' launches meanwhile.
    let cuda = CudaBackend::emulated().unwrap();
    let mut rng = Rng::new(5);
    let up = |v: &[f32], shape: &[usize], dt: DType| {
        cuda.upload(v, shape, dt, MemoryCategory::Activations, "t")
            .unwrap()
    };
    let (rows, c) = (4, 32);
    let x = up(&randn(&mut rng, rows * c, 1.0), &[rows, c], DType::Bf16);
    let w = up(&randn(&mut rng, c, 1.0), &[c], DType::Bf16);
    let b = up(&randn(&mut rng, c, 1.0), &[c], DType::Bf16);
    let wt = up(&randn(&mut rng, c * 8, 1.0), &[c, 8], DType::Bf16);
    let zeros = |shape: &[usize], dt: DType| {
        cuda.zeros(shape, dt, MemoryCategory::Activations, "out")
            .unwrap()
    };
    let (mut y, mut st) = (
        zeros(&[rows, c], DType::Bf16),
        zeros(&[rows, 2], DType::F32),
    );
    let mut p = zeros(&[rows, 8], DType::Bf16);
    let norm = |y: &mut Tensor, st: &mut Tensor| {
        layernorm::forward(&cuda, y, st, &x, &w, &b, 1e-5).unwrap();
    };
    norm(&mut y, &mut st);
    assert!(cuda.kernel_times().unwrap().is_empty(), "timing is off");
    cuda.time_kernels(true);
    norm(&mut y, &mut st);
    norm(&mut y, &mut st);
    cuda.matmul(&mut p, &y, &wt, None, false, false, false)
        .unwrap();
    let times = cuda.kernel_times().unwrap();
    let calls = |name: &str| {
        times
            .iter()
            .filter(|t| t.name.starts_with(name))
            .map(|t| t.calls)
            .sum::<u64>()
    };
    assert_eq!(calls("layernorm_bf16"), 2, "{times:?}");
    assert_eq!(calls("cublasLt "), 1, "{times:?}");
    assert!(times.iter().all(|t| t.millis >= 0.0), "{times:?}");
    assert!(cuda.kernel_times().unwrap().is_empty(), "read once");
    cuda.time_kernels(false);
    norm(&mut y, &mut st);
    assert!(
        cuda.kernel_times().unwrap().is_empty(),
        "timing is off again"
    );
}

/// A gradient on the device is summed across ranks through a host copy of it, in f32 and
/// in bf16 (summed in f32, rounded once), as a host tensor is summed in place.
#[test]
fn device_tensors_are_summed_across_ranks_through_host_memory() {
    let Some(cuda) = emulated() else { return };
    let cpu = CpuBackend::new();
    let values: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) * 0.37).collect();
    for dtype in [DType::F32, DType::Bf16] {
        let backends: [&dyn Backend; 2] = [cuda.as_ref(), &cpu];
        for be in backends {
            let mut t = be
                .upload(&values, &[300], dtype, MemoryCategory::Gradients, "g")
                .unwrap();
            let before = be.to_f32(&t).unwrap();
            trainkit::collective::all_reduce_tensor(&common::mirrored::Mirrored, be, &mut t)
                .unwrap();
            let after = be.to_f32(&t).unwrap();
            let want: Vec<f32> = before.iter().map(|v| dtype.round(2.0 * v)).collect();
            assert_eq!(after, want, "{} {dtype}", be.name());
            assert_eq!(t.dtype(), dtype);
        }
    }
}

/// Rank 1 of two, receiving `payload` from rank 0 in every broadcast.
#[derive(Debug)]
struct Receiving {
    payload: Vec<u8>,
}

impl trainkit::collective::Collective for Receiving {
    fn describe(&self) -> String {
        "rank 1 of 2, receiving".into()
    }
    fn rank(&self) -> usize {
        1
    }
    fn world(&self) -> usize {
        2
    }
    fn local_rank(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _: &mut [f32]) -> trainkit::Result<()> {
        unreachable!("not used here")
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> trainkit::Result<()> {
        unreachable!("not used here")
    }
    fn reduce_scatter_sum(&self, _: &[f32], _: &mut [f32]) -> trainkit::Result<()> {
        unreachable!("not used here")
    }
    fn all_gather(&self, _: &[f32], _: &mut [f32]) -> trainkit::Result<()> {
        unreachable!("not used here")
    }
    fn broadcast(&self, bytes: &mut [u8], root: usize) -> trainkit::Result<()> {
        assert_eq!(root, 0);
        bytes.copy_from_slice(&self.payload);
        Ok(())
    }
    fn barrier(&self) -> trainkit::Result<()> {
        Ok(())
    }
}

/// Weights on the device are received from their owner (ZeRO-1) through a host copy, in
/// f32 and bf16, as a host tensor receives them in place.
#[test]
fn device_tensors_receive_a_broadcast_through_host_memory() {
    let Some(cuda) = emulated() else { return };
    let cpu = CpuBackend::new();
    let values: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) * 0.37).collect();
    for dtype in [DType::F32, DType::Bf16] {
        let payload: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
        };
        let rank1 = Receiving { payload };
        let backends: [&dyn Backend; 2] = [cuda.as_ref(), &cpu];
        for be in backends {
            let mut t = be
                .zeros(&[300], dtype, MemoryCategory::Weights, "w")
                .unwrap();
            trainkit::collective::broadcast_tensor(&rank1, be, &mut t, 0).unwrap();
            let want: Vec<f32> = values.iter().map(|v| dtype.round(*v)).collect();
            assert_eq!(be.to_f32(&t).unwrap(), want, "{} {dtype}", be.name());
        }
    }
}
