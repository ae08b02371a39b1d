//! RMS normalization on the CPU, the reference of `kernels/rmsnorm.cu`.
//!
//! A row's sums run in the slots of the CUDA twin's warp per row (`simd::ROW_SLOTS`,
//! `kernels/rmsnorm.cu` adds in the same order), and the weight gradient is summed per
//! block of `ROW_BLOCK` rows, then block after block, so results are bitwise reproducible.

use crate::device::cpu::elementwise::ROW_BLOCK;
use crate::device::cpu::simd::{self, simd_fn, ROW_SLOTS};
use crate::device::cpu::{read, write};
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// The forward, on checked operands.
pub(crate) fn forward(
    out: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let (xv, w) = (read(x), read(weight));
    let mut r = vec![0f32; rows];
    write(out, false, |o| {
        o.par_chunks_mut(c)
            .zip(xv.par_chunks(c))
            .zip(r.par_iter_mut())
            .for_each(|((o, x), r)| forward_row(o, r, x, &w, eps))
    });
    write(rstd, false, |o| o.copy_from_slice(&r));
    Ok(())
}

/// The backward, on checked operands: `dx += rstd·(w·dy − x·rstd²·mean(w·dy·x))` per row,
/// `dweight += Σ_rows dy·x·rstd`.
pub(crate) fn backward(
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<()> {
    let (_, c) = x.rows_cols();
    if c == 0 {
        return Ok(());
    }
    let (xv, dv, w, r) = (read(x), read(dout), read(weight), read(rstd));
    // One pass over fixed blocks of rows: each row's input gradient, and the block's
    // partial sum of the weight gradient, later summed in block order.
    let partial: Vec<Vec<f32>> = write(dx, true, |o| {
        o.par_chunks_mut(ROW_BLOCK * c)
            .enumerate()
            .map(|(blk, o)| {
                let mut dw = vec![0f32; c];
                for (i, o) in o.chunks_mut(c).enumerate() {
                    let row = blk * ROW_BLOCK + i;
                    let (x, d) = (&xv[row * c..(row + 1) * c], &dv[row * c..(row + 1) * c]);
                    weight_grad_row(&mut dw, x, d, r[row]);
                    input_grad_row(o, x, d, &w, r[row]);
                }
                dw
            })
            .collect()
    });
    write(dweight, true, |g| {
        for p in &partial {
            for (g, p) in g.iter_mut().zip(p) {
                *g += p;
            }
        }
    });
    Ok(())
}

simd_fn! {
    fn forward_row(o: &mut [f32], r: &mut f32, x: &[f32], w: &[f32], eps: f32) {
        let c = x.len();
        // The sum of the CUDA kernel's warp per row, in its slot order.
        let rstd = 1.0 / (simd::row_sum_sq(x) / c as f32 + eps).sqrt();
        for i in 0..c {
            o[i] = x[i] * rstd * w[i];
        }
        *r = rstd;
    }
}

simd_fn! {
    /// Adds one row's terms to the weight gradient's partial sum.
    pub(crate) fn weight_grad_row(dw: &mut [f32], x: &[f32], d: &[f32], rstd: f32) {
        for (dw, (x, d)) in dw.iter_mut().zip(x.iter().zip(d)) {
            *dw += x * rstd * d;
        }
    }
}

simd_fn! {
    pub(crate) fn input_grad_row(o: &mut [f32], x: &[f32], d: &[f32], w: &[f32], rstd: f32) {
        let c = x.len();
        // The slots of the CUDA kernel's warp per row, summed in its order.
        let mut acc = [0f32; ROW_SLOTS];
        for (xc, (dc, wc)) in x
            .chunks(ROW_SLOTS)
            .zip(d.chunks(ROW_SLOTS).zip(w.chunks(ROW_SLOTS)))
        {
            for i in 0..xc.len() {
                acc[i] += wc[i] * dc[i] * xc[i];
            }
        }
        let k = simd::warp_reduce(&acc) / c as f32 * rstd * rstd;
        for i in 0..c {
            o[i] += rstd * (w[i] * d[i] - x[i] * k);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::device::{Backend, CpuBackend};
    use crate::memory::MemoryCategory;
    use crate::ops::rmsnorm;
    use crate::tensor::DType;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    #[test]
    fn backward_matches_finite_differences() {
        let be = CpuBackend::new();
        let (rows, c, eps) = (5, 24, 1e-5f32);
        let (xs, ws, ds) = (values(rows * c, 1), values(c, 2), values(rows * c, 3));
        let up = |v: &[f32], shape: &[usize]| {
            be.upload(v, shape, DType::F32, MemoryCategory::Workspace, "t")
                .unwrap()
        };
        let (x, w, d) = (up(&xs, &[rows, c]), up(&ws, &[c]), up(&ds, &[rows, c]));
        let mut out = up(&vec![0.0; rows * c], &[rows, c]);
        let mut rstd = up(&vec![0.0; rows], &[rows]);
        rmsnorm::forward(&be, &mut out, &mut rstd, &x, &w, eps).unwrap();
        let mut dx = up(&vec![0.0; rows * c], &[rows, c]);
        let mut dw = up(&vec![0.0; c], &[c]);
        rmsnorm::backward(&be, &mut dx, &mut dw, &d, &x, &w, &rstd).unwrap();
        let (dx, dw) = (be.to_f32(&dx).unwrap(), be.to_f32(&dw).unwrap());
        // L = Σ d · rmsnorm(x, w), in f64.
        let loss = |xs: &[f32], ws: &[f32]| -> f64 {
            let mut l = 0f64;
            for r in 0..rows {
                let row = &xs[r * c..(r + 1) * c];
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
                let rs = 1.0 / (ms + eps as f64).sqrt();
                for i in 0..c {
                    l += ds[r * c + i] as f64 * row[i] as f64 * rs * ws[i] as f64;
                }
            }
            l
        };
        let h = 1e-3f32;
        for i in [0, 7, 50, rows * c - 1] {
            let (mut p, mut m) = (xs.clone(), xs.clone());
            p[i] += h;
            m[i] -= h;
            let num = (loss(&p, &ws) - loss(&m, &ws)) / (2.0 * h as f64);
            assert!(
                (dx[i] as f64 - num).abs() < 1e-3 * (1.0 + num.abs()),
                "dx[{i}] {} vs {num}",
                dx[i]
            );
        }
        for i in [0, 11, c - 1] {
            let (mut p, mut m) = (ws.clone(), ws.clone());
            p[i] += h;
            m[i] -= h;
            let num = (loss(&xs, &p) - loss(&xs, &m)) / (2.0 * h as f64);
            assert!(
                (dw[i] as f64 - num).abs() < 1e-3 * (1.0 + num.abs()),
                "dw[{i}] {} vs {num}",
                dw[i]
            );
        }
    }
}
