//! GELU with the tanh approximation (GPT-2's `gelu_new`).

use crate::device::cpu::simd::{self, simd_fn};
use crate::device::cpu::{read, write, CHUNK};
use crate::tensor::Tensor;
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;

/// GELU of one value: `0.5·x·(1 + tanh(u))`, computed as `x·σ(2u)`, the same function
/// with one exponential and one division.
#[inline]
pub(crate) fn gelu(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
    x / (1.0 + simd::exp(-2.0 * u))
}

/// Derivative of [`gelu`] at `x`: with `s = σ(2u)`, `s + 2·x·s·(1 − s)·u'(x)`.
#[inline]
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let x2 = x * x;
    let u = SQRT_2_OVER_PI * (x + COEF * x2 * x);
    let s = 1.0 / (1.0 + simd::exp(-2.0 * u));
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x2);
    s + 2.0 * x * s * (1.0 - s) * du
}

pub(crate) fn forward(out: &mut Tensor, x: &Tensor) {
    let x = read(x);
    write(out, false, |o| {
        o.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| forward_chunk(o, x))
    });
}

pub(crate) fn backward(dx: &mut Tensor, x: &Tensor, dout: &Tensor) {
    let x = read(x);
    let d = read(dout);
    write(dx, false, |o| {
        o.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(d.par_chunks(CHUNK)))
            .for_each(|(o, (x, d))| backward_chunk(o, x, d))
    });
}

/// `d = gelu'(x) · d` in place: the values [`backward`] writes for `dout = d`.
pub(crate) fn backward_in_place(d: &mut Tensor, x: &Tensor) {
    let x = read(x);
    write(d, true, |o| {
        o.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| backward_in_place_chunk(o, x))
    });
}

simd_fn! {
    fn backward_in_place_chunk(o: &mut [f32], x: &[f32]) {
        for (o, x) in o.iter_mut().zip(x) {
            *o *= gelu_grad(*x);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's tanh form and its derivative, in f64.
    fn reference(x: f64) -> (f64, f64) {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let c = COEF as f64;
        let t = (k * (x + c * x * x * x)).tanh();
        let dt = (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x);
        (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * dt)
    }

    #[test]
    fn matches_the_tanh_form() {
        let (mut worst_y, mut worst_dy) = (0f64, 0f64);
        let mut x = -20.0f32;
        while x < 20.0 {
            let (y, dy) = reference(x as f64);
            let tol = 1.0 + (x as f64).abs();
            worst_y = worst_y.max((gelu(x) as f64 - y).abs() / tol);
            worst_dy = worst_dy.max((gelu_grad(x) as f64 - dy).abs() / tol);
            x += 0.001;
        }
        assert!(worst_y < 3e-7, "gelu error {worst_y}");
        assert!(worst_dy < 6e-7, "gelu_grad error {worst_dy}");
        assert_eq!(gelu(0.0), 0.0);
        assert_eq!(gelu_grad(0.0), 0.5);
        assert!(gelu(-100.0).abs() < 1e-30 && gelu(100.0) == 100.0);
    }
}
