//! The 8-bit AdamW update on the CPU, the reference of `kernels/adamw8bit.cu`: moments
//! stored block-wise quantized (`src/device/cpu/quantize.rs`), dequantized, updated in f32
//! as the AdamW update (`src/optim/adamw/cpu.rs`) does, and requantized, in one pass over
//! each block.

use super::quantize::{code_table, quantize, zero_code, QUANT_BLOCK};
use super::QuantizedMoments;
use crate::device::cpu::read;
use crate::error::{Error, Result};
use crate::optim::adamw::AdamWStep;
use crate::tensor::{Storage, Tensor};
use rayon::prelude::*;

/// Quantization blocks per parallel task.
const BLOCKS_PER_TASK: usize = 64;

/// The per-step constants of the update.
#[derive(Clone, Copy)]
struct Coefficients {
    beta1: f32,
    beta2: f32,
    eps: f32,
    grad_scale: f32,
    step_size: f32,
    bc2_sqrt: f32,
    decay: f32,
}

fn host_error() -> Error {
    Error::Backend {
        backend: "cpu",
        message: "a tensor of another backend was passed to the CPU backend: keep a \
                  model's tensors on one device"
            .to_string(),
    }
}

/// The update, on checked operands (the compute copy is the caller's).
pub(crate) fn update(
    param: &mut Tensor,
    grad: &Tensor,
    moments: QuantizedMoments<'_>,
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
    let QuantizedMoments {
        m,
        m_absmax,
        v,
        v_absmax,
    } = moments;
    let (Storage::F32(p), Storage::U8(qm), Storage::F32(am), Storage::U8(qv), Storage::F32(av)) = (
        param.storage_mut(),
        m.storage_mut(),
        m_absmax.storage_mut(),
        v.storage_mut(),
        v_absmax.storage_mut(),
    ) else {
        return Err(host_error());
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    let k = Coefficients {
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        grad_scale: hp.grad_scale * device_scale,
        step_size,
        bc2_sqrt,
        decay,
    };
    let (signed, unsigned) = (code_table(true), code_table(false));
    let task = QUANT_BLOCK * BLOCKS_PER_TASK;
    p.par_chunks_mut(task)
        .zip(g.par_chunks(task))
        .zip(qm.par_chunks_mut(task).zip(qv.par_chunks_mut(task)))
        .zip(
            am.par_chunks_mut(BLOCKS_PER_TASK)
                .zip(av.par_chunks_mut(BLOCKS_PER_TASK)),
        )
        .for_each(|(((p, g), (qm, qv)), (am, av))| {
            let blocks = p
                .chunks_mut(QUANT_BLOCK)
                .zip(g.chunks(QUANT_BLOCK))
                .zip(qm.chunks_mut(QUANT_BLOCK).zip(qv.chunks_mut(QUANT_BLOCK)))
                .zip(am.iter_mut().zip(av.iter_mut()));
            for (((p, g), (qm, qv)), (am, av)) in blocks {
                update_block(p, g, qm, am, qv, av, &k, &signed, &unsigned);
            }
        });
    Ok(())
}

/// One block: dequantize both moments, update them and the values in f32, requantize the
/// moments with their new absolute maxima.
#[allow(clippy::too_many_arguments)]
fn update_block(
    p: &mut [f32],
    g: &[f32],
    qm: &mut [u8],
    am: &mut f32,
    qv: &mut [u8],
    av: &mut f32,
    k: &Coefficients,
    signed: &[f32; 256],
    unsigned: &[f32; 256],
) {
    let mut m = [0f32; QUANT_BLOCK];
    let mut v = [0f32; QUANT_BLOCK];
    let (mut m_max, mut v_max) = (0f32, 0f32);
    for i in 0..p.len() {
        let gi = g[i] * k.grad_scale;
        let mi = k.beta1 * (signed[qm[i] as usize] * *am) + (1.0 - k.beta1) * gi;
        let vi = k.beta2 * (unsigned[qv[i] as usize] * *av) + (1.0 - k.beta2) * gi * gi;
        let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
        p[i] = p[i] * k.decay - k.step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
        m_max = m_max.max(mi.abs());
        v_max = v_max.max(vi.abs());
    }
    for i in 0..p.len() {
        qm[i] = if m_max == 0.0 {
            zero_code(true)
        } else {
            quantize(signed, true, m[i] / m_max)
        };
        qv[i] = if v_max == 0.0 {
            zero_code(false)
        } else {
            quantize(unsigned, false, v[i] / v_max)
        };
    }
    *am = m_max;
    *av = v_max;
}
