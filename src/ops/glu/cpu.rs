//! Gated linear units on the CPU over a fused `[.., 2F]` projection whose first `F`
//! columns are the gate and last `F` the up projection: `out = act(gate) · up` into
//! `[.., F]`. SwiGLU's `σ(g) = 1/(1 + e^(−g))` and the tanh GELU (of
//! [`crate::ops::gelu`]'s CPU twin) use `simd::exp`, the CUDA twin's `tk_exp`, so the rows
//! vectorize and the kernels agree bit for bit. Each gate has its two row functions; the
//! rows are walked once for both.

use super::Gate;
use crate::device::cpu::simd::{self, simd_fn};
use crate::device::cpu::{read, write};
use crate::ops::gelu::cpu::{gelu, gelu_grad};
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
    fn silu_row(o: &mut [f32], g: &[f32], u: &[f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g * sigmoid(g) * u;
        }
    }
}

simd_fn! {
    fn silu_backward_row(dg: &mut [f32], du: &mut [f32], d: &[f32], g: &[f32], u: &[f32]) {
        for i in 0..d.len() {
            let s = sigmoid(g[i]);
            dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            du[i] = d[i] * g[i] * s;
        }
    }
}

simd_fn! {
    fn gelu_row(o: &mut [f32], g: &[f32], u: &[f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = gelu(g) * u;
        }
    }
}

simd_fn! {
    fn gelu_backward_row(dg: &mut [f32], du: &mut [f32], d: &[f32], g: &[f32], u: &[f32]) {
        for i in 0..d.len() {
            dg[i] = d[i] * u[i] * gelu_grad(g[i]);
            du[i] = d[i] * gelu(g[i]);
        }
    }
}

simd_fn! {
    fn silu_backward_row_in_place(g: &mut [f32], u: &mut [f32], d: &[f32]) {
        for i in 0..d.len() {
            let (gi, ui) = (g[i], u[i]);
            let s = sigmoid(gi);
            g[i] = d[i] * ui * s * (1.0 + gi * (1.0 - s));
            u[i] = d[i] * gi * s;
        }
    }
}

simd_fn! {
    fn gelu_backward_row_in_place(g: &mut [f32], u: &mut [f32], d: &[f32]) {
        for i in 0..d.len() {
            let (gi, ui) = (g[i], u[i]);
            g[i] = d[i] * ui * gelu_grad(gi);
            u[i] = d[i] * gelu(gi);
        }
    }
}

/// The forward, on checked operands.
pub(crate) fn forward(gate: Gate, out: &mut Tensor, gate_up: &Tensor) {
    let row = match gate {
        Gate::Silu => silu_row,
        Gate::Gelu => gelu_row,
    };
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
                    row(o, g, u);
                }
            })
    });
}

/// The backward, on checked operands, overwriting `dgate_up` with the gate's gradient
/// `dout·up·act'(g)` and the up projection's `dout·act(g)`, side by side.
pub(crate) fn backward(gate: Gate, dgate_up: &mut Tensor, dout: &Tensor, gate_up: &Tensor) {
    let row = match gate {
        Gate::Silu => silu_backward_row,
        Gate::Gelu => gelu_backward_row,
    };
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
                    row(dg, du, d, g, u);
                }
            })
    });
}

/// [`backward`] in place: `gate_up`'s gate and up halves become their gradients, with
/// the same arithmetic.
pub(crate) fn backward_in_place(gate: Gate, gate_up: &mut Tensor, dout: &Tensor) {
    let row = match gate {
        Gate::Silu => silu_backward_row_in_place,
        Gate::Gelu => gelu_backward_row_in_place,
    };
    let f = dout.rows_cols().1;
    if f == 0 {
        return;
    }
    let d = read(dout);
    write(gate_up, true, |o| {
        o.par_chunks_mut(ROWS * 2 * f)
            .zip(d.par_chunks(ROWS * f))
            .for_each(|(o, d)| {
                for (o, d) in o.chunks_mut(2 * f).zip(d.chunks(f)) {
                    let (g, u) = o.split_at_mut(f);
                    row(g, u, d);
                }
            })
    });
}

#[cfg(test)]
mod tests {
    use super::Gate;
    use crate::device::{Backend, CpuBackend};
    use crate::memory::MemoryCategory;
    use crate::ops::glu;
    use crate::tensor::DType;

    /// The tanh GELU in f64.
    fn gelu64(x: f64) -> f64 {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
    }

    #[test]
    fn the_backward_in_place_is_the_backward_bitwise() {
        let be = CpuBackend::new();
        let (rows, f) = (37, 24);
        let gus: Vec<f32> = (0..2 * rows * f)
            .map(|i| ((i * 13) % 29) as f32 * 0.23 - 3.0)
            .collect();
        let ds: Vec<f32> = (0..rows * f)
            .map(|i| ((i * 5) % 9) as f32 * 0.2 - 0.8)
            .collect();
        for dt in [DType::F32, DType::Bf16] {
            for gate in [Gate::Silu, Gate::Gelu] {
                let up = |v: &[f32], cols: usize| {
                    be.upload(v, &[rows, cols], dt, MemoryCategory::Workspace, "t")
                        .unwrap()
                };
                let (gu, d) = (up(&gus, 2 * f), up(&ds, f));
                let mut want = up(&vec![0.0; 2 * rows * f], 2 * f);
                glu::backward(&be, gate, &mut want, &d, &gu).unwrap();
                let mut got = up(&gus, 2 * f);
                glu::backward_in_place(&be, gate, &mut got, &d).unwrap();
                let bits = |t: &crate::tensor::Tensor| -> Vec<u32> {
                    be.to_f32(t).unwrap().iter().map(|x| x.to_bits()).collect()
                };
                assert_eq!(bits(&got), bits(&want), "{gate:?} {dt}");
            }
        }
    }

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
        for gate in [Gate::Silu, Gate::Gelu] {
            let act = |g: f64, u: f64| match gate {
                Gate::Silu => g / (1.0 + (-g).exp()) * u,
                Gate::Gelu => gelu64(g) * u,
            };
            let (gu, d) = (up(&gus, 2 * f), up(&ds, f));
            let mut dgu = up(&vec![0.0; 2 * n], 2 * f);
            glu::backward(&be, gate, &mut dgu, &d, &gu).unwrap();
            let dgu = be.to_f32(&dgu).unwrap();
            let mut out = up(&vec![0.0; n], f);
            glu::forward(&be, gate, &mut out, &gu).unwrap();
            let out = be.to_f32(&out).unwrap();
            let h = 1e-3;
            for r in 0..rows {
                for i in 0..f {
                    let (g, u) = (gus[r * 2 * f + i] as f64, gus[r * 2 * f + f + i] as f64);
                    let dd = ds[r * f + i] as f64;
                    let ng = (act(g + h, u) - act(g - h, u)) / (2.0 * h) * dd;
                    let nu = (act(g, u + h) - act(g, u - h)) / (2.0 * h) * dd;
                    let (ag, au) = (dgu[r * 2 * f + i] as f64, dgu[r * 2 * f + f + i] as f64);
                    let what = format!("{gate:?} [{r}, {i}]");
                    assert!((ag - ng).abs() < 1e-4 * (1.0 + ng.abs()), "dgate {what}");
                    assert!((au - nu).abs() < 1e-4 * (1.0 + nu.abs()), "dup {what}");
                    assert!(
                        (out[r * f + i] as f64 - act(g, u)).abs() < 1e-5,
                        "out {what}"
                    );
                }
            }
        }
    }
}
