//! SwiGLU's gate (Llama's MLP) over a fused `[.., 2F]` projection whose first `F` columns
//! are the gate and last `F` the up projection: `out = silu(gate) · up`, with
//! `silu(g) = g·σ(g)`, into `[.., F]`. `σ(g) = 1/(1 + e^(−g))` with `simd::exp` (the CUDA
//! twin's `tk_exp`), so the rows vectorize and the kernels agree bit for bit.

use crate::device::cpu::simd::{self, simd_fn};
use crate::device::cpu::{read, write};

use crate::tensor::Tensor;
use rayon::prelude::*;

/// Rows per parallel block.
const ROWS: usize = 32;

/// `σ(g)`.
#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + simd::exp(-g))
}

simd_fn! {
    fn forward_row(o: &mut [f32], g: &[f32], u: &[f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g * sigmoid(g) * u;
        }
    }
}

simd_fn! {
    fn backward_row(dg: &mut [f32], du: &mut [f32], d: &[f32], g: &[f32], u: &[f32]) {
        for i in 0..d.len() {
            let s = sigmoid(g[i]);
            dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            du[i] = d[i] * g[i] * s;
        }
    }
}

/// The forward, on checked operands.
pub(crate) fn forward(out: &mut Tensor, gate_up: &Tensor) {
    let f = out.rows_cols().1;
    if f == 0 {
        return;
    }
    let gu = read(gate_up);
    write(out, false, |o| {
        o.par_chunks_mut(ROWS * f)
            .zip(gu.par_chunks(ROWS * 2 * f))
            .for_each(|(o, gu)| {
                for (o, gu) in o.chunks_mut(f).zip(gu.chunks(2 * f)) {
                    let (g, u) = gu.split_at(f);
                    forward_row(o, g, u);
                }
            })
    });
}

/// The backward, on checked operands, overwriting `dgate_up`:
/// `dgate = dout·up·σ(g)·(1 + g·(1 − σ(g)))`, `dup = dout·silu(g)`.
pub(crate) fn backward(dgate_up: &mut Tensor, dout: &Tensor, gate_up: &Tensor) {
    let f = dout.rows_cols().1;
    if f == 0 {
        return;
    }
    let (d, gu) = (read(dout), read(gate_up));
    write(dgate_up, false, |o| {
        o.par_chunks_mut(ROWS * 2 * f)
            .zip(d.par_chunks(ROWS * f).zip(gu.par_chunks(ROWS * 2 * f)))
            .for_each(|(o, (d, gu))| {
                for (o, (d, gu)) in o.chunks_mut(2 * f).zip(d.chunks(f).zip(gu.chunks(2 * f))) {
                    let (g, u) = gu.split_at(f);
                    let (dg, du) = o.split_at_mut(f);
                    backward_row(dg, du, d, g, u);
                }
            })
    });
}

#[cfg(test)]
mod tests {
    use crate::device::{Backend, CpuBackend};
    use crate::memory::MemoryCategory;
    use crate::ops::swiglu;
    use crate::tensor::DType;

    #[test]
    fn backward_matches_finite_differences() {
        let be = CpuBackend::new();
        let (rows, f) = (5, 8);
        let n = rows * f;
        let gus: Vec<f32> = (0..2 * n)
            .map(|i| ((i * 13) % 29) as f32 * 0.23 - 3.0)
            .collect();
        let ds: Vec<f32> = (0..n).map(|i| ((i * 5) % 9) as f32 * 0.2 - 0.8).collect();
        let up = |v: &[f32], cols: usize| {
            be.upload(v, &[rows, cols], DType::F32, MemoryCategory::Workspace, "t")
                .unwrap()
        };
        let (gu, d) = (up(&gus, 2 * f), up(&ds, f));
        let mut dgu = up(&vec![0.0; 2 * n], 2 * f);
        swiglu::backward(&be, &mut dgu, &d, &gu).unwrap();
        let dgu = be.to_f32(&dgu).unwrap();
        let mut out = up(&vec![0.0; n], f);
        swiglu::forward(&be, &mut out, &gu).unwrap();
        let out = be.to_f32(&out).unwrap();
        let silu_mul = |g: f64, u: f64| g / (1.0 + (-g).exp()) * u;
        let h = 1e-3;
        for r in 0..rows {
            for i in 0..f {
                let (g, u) = (gus[r * 2 * f + i] as f64, gus[r * 2 * f + f + i] as f64);
                let dd = ds[r * f + i] as f64;
                let ng = (silu_mul(g + h, u) - silu_mul(g - h, u)) / (2.0 * h) * dd;
                let nu = (silu_mul(g, u + h) - silu_mul(g, u - h)) / (2.0 * h) * dd;
                let (ag, au) = (dgu[r * 2 * f + i] as f64, dgu[r * 2 * f + f + i] as f64);
                assert!((ag - ng).abs() < 1e-4 * (1.0 + ng.abs()), "dgate[{r}, {i}]");
                assert!((au - nu).abs() < 1e-4 * (1.0 + nu.abs()), "dup[{r}, {i}]");
                assert!((out[r * f + i] as f64 - silu_mul(g, u)).abs() < 1e-5);
            }
        }
    }
}
