//! Layer normalization over the last dimension, statistics in f32.

use crate::device::cpu::elementwise::ROW_BLOCK;
use crate::device::cpu::simd::{self, simd_fn, ROW_SLOTS};
use crate::device::cpu::{read, write};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};
use rayon::prelude::*;

pub(crate) fn forward(
    out: &mut Tensor,
    stats: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
) -> Result<()> {
    let (_, c) = x.rows_cols();
    let xv = read(x);
    let w = read(weight);
    let b = read(bias);
    let Storage::F32(st) = stats.storage_mut() else {
        return Err(crate::error::Error::Backend {
            backend: "cpu",
            message: "a tensor of another backend was passed to the CPU backend: keep a \
                      model's tensors on one device"
                .to_string(),
        });
    };
    write(out, false, |o| {
        o.par_chunks_mut(c)
            .zip(xv.par_chunks(c))
            .zip(st.par_chunks_mut(2))
            .for_each(|((o, x), st)| forward_row(o, st, x, &w, &b, eps))
    });
    Ok(())
}

pub(crate) fn backward(
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dbias: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    stats: &Tensor,
) -> Result<()> {
    let (_, c) = x.rows_cols();
    let xv = read(x);
    let dv = read(dout);
    let w = read(weight);
    let st = read(stats);
    // One pass over fixed blocks of rows: each row's input gradient, and the block's
    // partial sums of the parameter gradients, later summed in block order.
    let partial: Vec<(Vec<f32>, Vec<f32>)> = write(dx, true, |o| {
        o.par_chunks_mut((ROW_BLOCK * c).max(1))
            .enumerate()
            .map(|(blk, o)| {
                let mut dw = vec![0f32; c];
                let mut db = vec![0f32; c];
                for (i, o) in o.chunks_mut(c).enumerate() {
                    let r = blk * ROW_BLOCK + i;
                    let (x, d) = (&xv[r * c..(r + 1) * c], &dv[r * c..(r + 1) * c]);
                    let st = &st[2 * r..2 * r + 2];
                    param_grad_row(&mut dw, &mut db, x, d, st);
                    input_grad_row(o, x, d, &w, st);
                }
                (dw, db)
            })
            .collect()
    });
    write(dweight, true, |dw| {
        for (p, _) in &partial {
            for (a, v) in dw.iter_mut().zip(p) {
                *a += v;
            }
        }
    });
    write(dbias, true, |db| {
        for (_, p) in &partial {
            for (a, v) in db.iter_mut().zip(p) {
                *a += v;
            }
        }
    });
    Ok(())
}

simd_fn! {
    fn forward_row(o: &mut [f32], st: &mut [f32], x: &[f32], w: &[f32], b: &[f32], eps: f32) {
        let c = x.len();
        // The sums of the CUDA kernel's warp per row, in its slot order.
        let mean = simd::row_sum(x) / c as f32;
        let var = simd::row_sum_sq_dev(x, mean) / c as f32;
        let rstd = 1.0 / (var + eps).sqrt();
        for i in 0..c {
            o[i] = (x[i] - mean) * rstd * w[i] + b[i];
        }
        st[0] = mean;
        st[1] = rstd;
    }
}

simd_fn! {
    /// Adds one row's terms to the parameter gradients' partial sums.
    fn param_grad_row(dw: &mut [f32], db: &mut [f32], x: &[f32], d: &[f32], st: &[f32]) {
        let (mean, rstd) = (st[0], st[1]);
        for ((dw, db), (x, d)) in dw.iter_mut().zip(db.iter_mut()).zip(x.iter().zip(d)) {
            let norm = (x - mean) * rstd;
            *dw += norm * d;
            *db += d;
        }
    }
}

simd_fn! {
    fn input_grad_row(o: &mut [f32], x: &[f32], d: &[f32], w: &[f32], st: &[f32]) {
        let c = x.len();
        let (mean, rstd) = (st[0], st[1]);
        // The slots of the CUDA kernel's warp per row, summed in its order.
        let mut acc_dn = [0f32; ROW_SLOTS];
        let mut acc_dnn = [0f32; ROW_SLOTS];
        for (xc, (dc, wc)) in x
            .chunks(ROW_SLOTS)
            .zip(d.chunks(ROW_SLOTS).zip(w.chunks(ROW_SLOTS)))
        {
            for i in 0..xc.len() {
                let norm = (xc[i] - mean) * rstd;
                let dn = wc[i] * dc[i];
                acc_dn[i] += dn;
                acc_dnn[i] += dn * norm;
            }
        }
        let mean_dn = simd::warp_reduce(&acc_dn) / c as f32;
        let mean_dn_n = simd::warp_reduce(&acc_dnn) / c as f32;
        for i in 0..c {
            let norm = (x[i] - mean) * rstd;
            let dn = w[i] * d[i];
            o[i] += rstd * (dn - mean_dn - norm * mean_dn_n);
        }
    }
}
