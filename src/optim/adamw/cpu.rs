//! The AdamW update, PyTorch semantics, on the CPU: the reference of `kernels/adamw.cu`.

use super::AdamWStep;
use crate::device::cpu::simd::simd_fn;
use crate::device::cpu::{read, CHUNK};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// The update, on checked operands (the compute copy is the caller's).
pub(crate) fn update(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
) -> Result<()> {
    let device_scale = match scale {
        Some(s) => read(s).first().copied().unwrap_or(1.0),
        None => 1.0,
    };
    if !device_scale.is_finite() {
        return Ok(());
    }
    // A bf16 or f16 gradient is widened chunk by chunk inside the pass, not as a whole
    // f32 copy first: the update streams each byte of state once.
    let widened;
    let g = match grad.storage() {
        Storage::F32(v) => Grad::F32(v),
        Storage::Bf16(v) => Grad::Bf16(v),
        Storage::F16(v) => Grad::F16(v),
        _ => {
            widened = read(grad);
            Grad::F32(&widened)
        }
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    let AdamWStep {
        beta1,
        beta2,
        eps,
        grad_scale,
        ..
    } = *hp;
    let k = Coefficients {
        beta1,
        beta2,
        eps,
        grad_scale: grad_scale * device_scale,
        step_size,
        bc2_sqrt,
        decay,
    };
    match (param.storage_mut(), m.storage_mut(), v.storage_mut()) {
        (Storage::F32(p), Storage::F32(mv), Storage::F32(vv)) => {
            p.par_chunks_mut(CHUNK)
                .zip(mv.par_chunks_mut(CHUNK))
                .zip(vv.par_chunks_mut(CHUNK))
                .enumerate()
                .for_each(|(i, ((p, m), v))| {
                    let mut buf = Vec::new();
                    let g = grad_chunk(g, i * CHUNK..i * CHUNK + p.len(), &mut buf);
                    update_chunk(p, m, v, g, &k);
                });
        }
        // Moments in bf16: widened per chunk, updated, rounded to nearest even, and the
        // update reads them as rounded (the kernel's order).
        (Storage::F32(p), Storage::Bf16(mv), Storage::Bf16(vv)) => {
            p.par_chunks_mut(CHUNK)
                .zip(mv.par_chunks_mut(CHUNK))
                .zip(vv.par_chunks_mut(CHUNK))
                .enumerate()
                .for_each(|(i, ((p, m16), v16))| {
                    let mut buf = Vec::new();
                    let g = grad_chunk(g, i * CHUNK..i * CHUNK + p.len(), &mut buf);
                    let (mut m, mut v) = (vec![0f32; p.len()], vec![0f32; p.len()]);
                    m16.convert_to_f32_slice(&mut m);
                    v16.convert_to_f32_slice(&mut v);
                    update_chunk_rounded(p, &mut m, &mut v, g, &k);
                    m16.convert_from_f32_slice(&m);
                    v16.convert_from_f32_slice(&v);
                });
        }
        _ => {
            return Err(crate::error::Error::Backend {
                backend: "cpu",
                message: "a tensor of another backend was passed to the CPU backend: keep a \
                          model's tensors on one device"
                    .to_string(),
            })
        }
    }
    Ok(())
}

/// Elements `range` of the gradient `g`, widened into `buf` unless it is f32.
fn grad_chunk<'a>(g: Grad<'a>, range: std::ops::Range<usize>, buf: &'a mut Vec<f32>) -> &'a [f32] {
    match g {
        Grad::F32(g) => &g[range],
        Grad::Bf16(g) => {
            buf.resize(range.len(), 0.0);
            g[range].convert_to_f32_slice(buf);
            buf
        }
        Grad::F16(g) => {
            buf.resize(range.len(), 0.0);
            g[range].convert_to_f32_slice(buf);
            buf
        }
    }
}

/// The gradient's elements as stored.
#[derive(Clone, Copy)]
enum Grad<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

/// Per-step constants of the update.
struct Coefficients {
    beta1: f32,
    beta2: f32,
    eps: f32,
    grad_scale: f32,
    step_size: f32,
    bc2_sqrt: f32,
    decay: f32,
}

simd_fn! {
    fn update_chunk_rounded(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], k: &Coefficients) {
        for i in 0..p.len() {
            let gi = g[i] * k.grad_scale;
            m[i] = half::bf16::from_f32(k.beta1 * m[i] + (1.0 - k.beta1) * gi).to_f32();
            v[i] = half::bf16::from_f32(k.beta2 * v[i] + (1.0 - k.beta2) * gi * gi).to_f32();
            let denom = v[i].sqrt() / k.bc2_sqrt + k.eps;
            p[i] = p[i] * k.decay - k.step_size * m[i] / denom;
        }
    }
}

simd_fn! {
    fn update_chunk(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], k: &Coefficients) {
        for i in 0..p.len() {
            let gi = g[i] * k.grad_scale;
            m[i] = k.beta1 * m[i] + (1.0 - k.beta1) * gi;
            v[i] = k.beta2 * v[i] + (1.0 - k.beta2) * gi * gi;
            let denom = v[i].sqrt() / k.bc2_sqrt + k.eps;
            p[i] = p[i] * k.decay - k.step_size * m[i] / denom;
        }
    }
}
