//! The fused AdamW update (PyTorch semantics), reading the step's gradient multiplier on
//! the device and writing the bf16 or f16 compute copy in the same pass.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/adamw.cu`, listed once in
//! [`KERNELS`].

use super::{AdamWStep, AdamWTensor};
use crate::device::cuda::ops::elementwise::launch_cast;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// The kernels of `kernels/adamw.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "adamw.cu",
    source: include_str!("../../../kernels/adamw.cu"),
    kernels: &[
        "adamw_f32_bf16",
        "adamw_f32_f16",
        "adamw_bf16_bf16",
        "adamw_f16_f16",
        "adamw_f32_bf16_bf16m",
        "adamw_bf16_bf16_bf16m",
        "adamw_multi_f32_bf16",
        "adamw_multi_f32_f16",
        "adamw_multi_bf16_bf16",
        "adamw_multi_f16_f16",
        "adamw_multi_f32_bf16_bf16m",
        "adamw_multi_bf16_bf16_bf16m",
    ],
};
inventory::submit!(KERNELS);

/// The kernel suffix `{G}_{C}` for a gradient of dtype `grad` and the device pointer of the
/// compute copy the kernel writes in its pass (0 for none), or, for a copy no kernel
/// writes (f32, or a 16-bit dtype other than a 16-bit gradient's), the copy to cast after.
pub(crate) fn compute_copy(
    grad: DType,
    compute: Option<&mut Tensor>,
) -> Result<(String, u64, Option<&mut Tensor>)> {
    let half = |d: DType| matches!(d, DType::Bf16 | DType::F16);
    Ok(match compute {
        Some(c) if half(c.dtype()) && (grad == DType::F32 || grad == c.dtype()) => {
            (format!("{grad}_{}", c.dtype()), ptr(c)?, None)
        }
        other => {
            let c = if half(grad) { grad } else { DType::Bf16 };
            (format!("{grad}_{c}"), 0, other)
        }
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    be: &CudaBackend,
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
    compute: Option<&mut Tensor>,
) -> Result<()> {
    let n = param.numel();
    let scale = match scale {
        Some(s) => ptr(s)?,
        None => 0,
    };
    if n == 0 {
        return Ok(());
    }
    // The kernel writes a 16-bit compute copy in its pass; another is cast after.
    let (suffix, fused, after) = compute_copy(grad.dtype(), compute)?;
    // bf16 moments (with an f32 or bf16 gradient: the shared check).
    let moments = if m.dtype() == DType::Bf16 {
        "_bf16m"
    } else {
        ""
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    be.launch(
        &format!("adamw_{suffix}{moments}"),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(param)?)
            .ptr(ptr(grad)?)
            .ptr(ptr(m)?)
            .ptr(ptr(v)?)
            .ptr(scale)
            .ptr(fused)
            .i64(n)
            .f32(hp.beta1)
            .f32(hp.beta2)
            .f32(hp.eps)
            .f32(hp.grad_scale)
            .f32(step_size)
            .f32(bc2_sqrt)
            .f32(decay),
    )?;
    match after {
        Some(c) => launch_cast(be, c, param),
        None => Ok(()),
    }
}

/// Tensors a launch of `adamw_multi_*` takes (the kernels' TK_ADAMW_TENSORS).
const MULTI_TENSORS: usize = 32;
/// Elements a block of `adamw_multi_*` updates (the kernels' TK_ADAMW_CHUNK).
const MULTI_CHUNK: usize = 2048;

/// One tensor of an `adamw_multi_*` launch: the kernels' `AdamWTensor`.
struct Entry {
    /// Device pointers: value, gradient, moments, compute copy (0 for none).
    ptrs: [u64; 5],
    n: usize,
    decay: f32,
}

/// The kernels' `AdamWTable` for `entries` (at most [`MULTI_TENSORS`]), as the launch
/// passes it by value: per tensor five pointers, `n` (i64), its decay factor (f32) and 4
/// unused bytes; then the count (i64).
fn table(entries: &[Entry]) -> Vec<u8> {
    let mut b = Vec::with_capacity(MULTI_TENSORS * 56 + 8);
    for i in 0..MULTI_TENSORS {
        match entries.get(i) {
            Some(e) => {
                for p in e.ptrs {
                    b.extend(p.to_le_bytes());
                }
                b.extend((e.n as i64).to_le_bytes());
                b.extend(e.decay.to_bits().to_le_bytes());
                b.extend(0u32.to_le_bytes());
            }
            None => b.extend([0u8; 56]),
        }
    }
    b.extend((entries.len() as i64).to_le_bytes());
    b
}

/// [`update`] of many tensors, those of the same dtypes [`MULTI_TENSORS`] to a launch of
/// `adamw_multi_*` (each element updated as `adamw_*` updates it); a tensor whose compute
/// copy no kernel writes in its pass goes through [`update`] and its cast.
pub(crate) fn update_many(
    be: &CudaBackend,
    tensors: &mut [AdamWTensor<'_>],
    hp: &AdamWStep,
    scale: Option<&Tensor>,
) -> Result<()> {
    let scale_ptr = match scale {
        Some(s) => ptr(s)?,
        None => 0,
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    let no_decay = AdamWStep {
        weight_decay: 0.0,
        ..*hp
    };
    let no_decay_factor = no_decay.constants().2;
    // The kernel of each group and its tensors, in the order first met.
    let mut groups: Vec<(String, Vec<Entry>)> = Vec::new();
    for t in tensors.iter_mut() {
        let n = t.param.numel();
        if n == 0 {
            continue;
        }
        let moments = if t.m.dtype() == DType::Bf16 {
            "_bf16m"
        } else {
            ""
        };
        let (suffix, fused, after) = compute_copy(t.grad.dtype(), t.compute.as_deref_mut())?;
        if after.is_some() {
            let hp = if t.decays { *hp } else { no_decay };
            update(
                be,
                t.param,
                t.grad,
                t.m,
                t.v,
                &hp,
                scale,
                t.compute.as_deref_mut(),
            )?;
            continue;
        }
        let entry = Entry {
            ptrs: [ptr(t.param)?, ptr(t.grad)?, ptr(t.m)?, ptr(t.v)?, fused],
            n,
            decay: if t.decays { decay } else { no_decay_factor },
        };
        let kernel = format!("adamw_multi_{suffix}{moments}");
        match groups.iter_mut().find(|(k, _)| *k == kernel) {
            Some((_, entries)) => entries.push(entry),
            None => groups.push((kernel, vec![entry])),
        }
    }
    for (kernel, entries) in &groups {
        for part in entries.chunks(MULTI_TENSORS) {
            let blocks: usize = part.iter().map(|e| e.n.div_ceil(MULTI_CHUNK)).sum();
            let grid = u32::try_from(blocks).map_err(|_| crate::error::Error::Backend {
                backend: "cuda",
                message: format!(
                    "adamw: {blocks} blocks of {MULTI_CHUNK} elements are more than one \
                         launch takes"
                ),
            })?;
            be.launch(
                kernel,
                grid,
                BLOCK,
                Args::new()
                    .bytes(&table(part))
                    .ptr(scale_ptr)
                    .f32(hp.beta1)
                    .f32(hp.beta2)
                    .f32(hp.eps)
                    .f32(hp.grad_scale)
                    .f32(step_size)
                    .f32(bc2_sqrt),
            )?;
        }
    }
    Ok(())
}

/// The kernels of `kernels/adamw.cu` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::tensor::DType;

    #[test]
    fn adamw_matches_the_cpu_bit_for_bit() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        let n = 777usize;
        let (ps, gs, ms) = (random(n, 1.0, 60), random(n, 0.1, 61), random(n, 0.01, 62));
        let vs: Vec<f32> = random(n, 1e-3, 63).iter().map(|v| v.abs()).collect();
        let hp = crate::optim::AdamWStep {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 7,
            grad_scale: 0.5,
        };
        // The host's constants, as every backend computes them.
        let (step_size, bc2_sqrt, decay) = hp.constants();
        let kernels = [
            (DType::F32, DType::Bf16),
            (DType::F32, DType::F16),
            (DType::Bf16, DType::Bf16),
            (DType::F16, DType::F16),
        ];
        for (g, c) in kernels {
            let mut p_cpu = upload(&be, &ps, &[n], DType::F32);
            let mut m_cpu = upload(&be, &ms, &[n], DType::F32);
            let mut v_cpu = upload(&be, &vs, &[n], DType::F32);
            let grad = upload(&be, &gs, &[n], g);
            // The device scale multiplies hp.grad_scale; 1 leaves it as it is.
            let one = upload(&be, &[1.0], &[1], DType::F32);
            crate::optim::adamw::update(
                &be,
                &mut p_cpu,
                &grad,
                &mut m_cpu,
                &mut v_cpu,
                &hp,
                Some(&one),
                None,
            )
            .unwrap();
            let want_p = be.to_f32(&p_cpu).unwrap();
            // With and without the bf16 compute copy, with and without the device scale,
            // and with a NaN scale, which must leave everything untouched.
            for (with_copy, scale) in [
                (true, Some(1.0f32)),
                (false, None),
                (true, Some(f32::NAN)),
                (false, Some(f32::INFINITY)),
            ] {
                let skipped = scale.is_some_and(|s| !s.is_finite());
                let (mut p, mut m, mut v) = (ps.clone(), ms.clone(), vs.clone());
                let mut grad_buf = Buf::new(&gs, g);
                let mut compute = Buf::new(&vec![f32::NAN; n], c);
                let copy = if with_copy {
                    compute.ptr()
                } else {
                    std::ptr::null_mut()
                };
                let mut scale_buf = [scale.unwrap_or(f32::NAN)];
                let scale_ptr = if scale.is_some() {
                    scale_buf.as_mut_ptr()
                } else {
                    std::ptr::null_mut()
                };
                let a = Args::new()
                    .ptr(&mut p)
                    .buf(&mut grad_buf)
                    .ptr(&mut m)
                    .ptr(&mut v)
                    .arg(scale_ptr)
                    .arg(copy)
                    .arg(n as i64)
                    .arg(hp.beta1)
                    .arg(hp.beta2)
                    .arg(hp.eps)
                    .arg(hp.grad_scale)
                    .arg(step_size)
                    .arg(bc2_sqrt)
                    .arg(decay);
                let k = format!("adamw_{}_{}", suffix(g), suffix(c));
                launch(emu, &k, 2, 128, 0, a).unwrap();
                if skipped {
                    assert_bitwise("skipped param", &p, &ps);
                    assert_bitwise("skipped m", &m, &ms);
                    assert_bitwise("skipped v", &v, &vs);
                    assert!(compute.values().iter().all(|x| x.is_nan()));
                    continue;
                }
                assert_bitwise("param", &p, &want_p);
                assert_bitwise("m", &m, &be.to_f32(&m_cpu).unwrap());
                assert_bitwise("v", &v, &be.to_f32(&v_cpu).unwrap());
                if with_copy {
                    let want: Vec<f32> = want_p.iter().map(|&x| c.round(x)).collect();
                    assert_bitwise(&format!("{k} compute copy"), &compute.values(), &want);
                } else {
                    assert!(compute.values().iter().all(|x| x.is_nan()));
                }
            }
        }
    }
}
