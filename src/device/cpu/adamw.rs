//! The AdamW update, PyTorch semantics.

use super::{ensure, ensure_f32, read, CHUNK};
use crate::device::AdamWStep;
use crate::error::Result;
use crate::tensor::{Storage, Tensor};
use rayon::prelude::*;

pub(super) fn adamw(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    hp: &AdamWStep,
) -> Result<()> {
    for t in [&*param, &*m, &*v] {
        ensure_f32(t, "adamw")?;
    }
    let n = param.numel();
    ensure(
        grad.numel() == n && m.numel() == n && v.numel() == n,
        "adamw",
        || {
            format!(
                "`{}`: gradient and moments must have {n} elements",
                param.label()
            )
        },
    )?;
    let g = read(grad);
    let (Storage::F32(p), Storage::F32(mv), Storage::F32(vv)) =
        (param.storage_mut(), m.storage_mut(), v.storage_mut())
    else {
        unreachable!("checked f32 above")
    };
    let AdamWStep {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        grad_scale,
    } = *hp;
    // Bias corrections in f64, as PyTorch computes them on the host.
    let exponent = step.min(i32::MAX as u64) as i32;
    let bc1 = 1.0 - (beta1 as f64).powi(exponent);
    let bc2 = 1.0 - (beta2 as f64).powi(exponent);
    let step_size = (lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = 1.0 - lr * weight_decay;
    p.par_chunks_mut(CHUNK)
        .zip(mv.par_chunks_mut(CHUNK))
        .zip(vv.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)))
        .for_each(|((p, m), (v, g))| {
            for i in 0..p.len() {
                let gi = g[i] * grad_scale;
                m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
                v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                p[i] = p[i] * decay - step_size * m[i] / denom;
            }
        });
    Ok(())
}
