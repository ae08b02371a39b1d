//! GELU with the tanh approximation (GPT-2's `gelu_new`).

use super::simd::{self, simd_fn};
use super::{ensure, read, write, CHUNK};
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;

/// GELU of one value.
#[inline]
pub(crate) fn gelu(x: f32) -> f32 {
    let cube = COEF * x * x * x;
    0.5 * x * (1.0 + simd::tanh(SQRT_2_OVER_PI * (x + cube)))
}

/// Derivative of [`gelu`] at `x`.
#[inline]
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let cube = COEF * x * x * x;
    let arg = SQRT_2_OVER_PI * (x + cube);
    let t = simd::tanh(arg);
    let sech2 = 1.0 - t * t;
    0.5 * (1.0 + t) + 0.5 * x * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x * x)
}

fn check(out: &Tensor, x: &Tensor, op: &'static str) -> Result<()> {
    ensure(out.numel() == x.numel(), op, || {
        format!(
            "`{}` {:?} and `{}` {:?} differ in size",
            out.label(),
            out.shape(),
            x.label(),
            x.shape()
        )
    })
}

pub(super) fn forward(out: &mut Tensor, x: &Tensor) -> Result<()> {
    check(out, x, "gelu")?;
    let x = read(x);
    write(out, false, |o| {
        o.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| forward_chunk(o, x))
    });
    Ok(())
}

pub(super) fn backward(dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()> {
    check(dx, x, "gelu_backward")?;
    check(dx, dout, "gelu_backward")?;
    let x = read(x);
    let d = read(dout);
    write(dx, false, |o| {
        o.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(d.par_chunks(CHUNK)))
            .for_each(|(o, (x, d))| backward_chunk(o, x, d))
    });
    Ok(())
}

simd_fn! {
    fn forward_chunk(o: &mut [f32], x: &[f32]) {
        for (o, x) in o.iter_mut().zip(x) {
            *o = gelu(*x);
        }
    }
}

simd_fn! {
    fn backward_chunk(o: &mut [f32], x: &[f32], d: &[f32]) {
        for ((o, x), d) in o.iter_mut().zip(x).zip(d) {
            *o = gelu_grad(*x) * d;
        }
    }
}
