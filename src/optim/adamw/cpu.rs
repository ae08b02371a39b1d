//! The AdamW update, PyTorch semantics, on the CPU: the reference of `kernels/adamw.cu`.

use super::AdamWStep;
use crate::device::cpu::simd::simd_fn;
use crate::device::cpu::{read, CHUNK};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};
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
    let g = read(grad);
    let (Storage::F32(p), Storage::F32(mv), Storage::F32(vv)) =
        (param.storage_mut(), m.storage_mut(), v.storage_mut())
    else {
        return Err(crate::error::Error::Backend {
            backend: "cpu",
            message: "a tensor of another backend was passed to the CPU backend: keep a \
                      model's tensors on one device"
                .to_string(),
        });
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    let AdamWStep {
        beta1,
        beta2,
        eps,
        grad_scale,
        ..
    } = *hp;
    let grad_scale = grad_scale * device_scale;
    p.par_chunks_mut(CHUNK)
        .zip(mv.par_chunks_mut(CHUNK))
        .zip(vv.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)))
        .for_each(|((p, m), (v, g))| {
            update_chunk(
                p,
                m,
                v,
                g,
                &Coefficients {
                    beta1,
                    beta2,
                    eps,
                    grad_scale,
                    step_size,
                    bc2_sqrt,
                    decay,
                },
            )
        });
    Ok(())
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
