//! GeGLU's gate on the CPU over a fused `[.., 2F]` projection: `out = gelu(gate) · up`
//! with the tanh GELU of [`crate::ops::gelu`]'s CPU twin (one `simd::exp`, the CUDA
//! twin's `tk_exp`), so the rows vectorize and the kernels agree bit for bit.

use crate::device::cpu::simd::simd_fn;
use crate::device::cpu::{read, write};
use crate::ops::gelu::cpu::{gelu, gelu_grad};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Rows per parallel block.
const ROWS: usize = 32;

simd_fn! {
    fn forward_row(o: &mut [f32], g: &[f32], u: &[f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = gelu(g) * u;
        }
    }
}

simd_fn! {
    fn backward_row(dg: &mut [f32], du: &mut [f32], d: &[f32], g: &[f32], u: &[f32]) {
        for i in 0..d.len() {
            dg[i] = d[i] * u[i] * gelu_grad(g[i]);
            du[i] = d[i] * gelu(g[i]);
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
/// `dgate = dout·up·gelu'(g)`, `dup = dout·gelu(g)`.
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
