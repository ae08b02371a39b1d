//! Element-wise ops, casts and reductions.

use super::simd::simd_fn;
use super::{ensure, read, write, CHUNK};
use crate::error::Result;
use crate::tensor::{DType, Storage, Tensor};
use half::bf16;
use rayon::prelude::*;

/// Fails unless `a` and `b` have as many elements (the check of the element-wise ops).
pub(crate) fn same_len(a: &Tensor, b: &Tensor, op: &'static str) -> Result<()> {
    ensure(a.numel() == b.numel(), op, || {
        format!(
            "`{}` {:?} and `{}` {:?} differ in size",
            a.label(),
            a.shape(),
            b.label(),
            b.shape()
        )
    })
}

/// Checks `upload`'s operands: `shape` holds `data.len()` elements.
pub(crate) fn check_upload(data: &[f32], shape: &[usize], dtype: DType, label: &str) -> Result<()> {
    let numel: usize = shape.iter().product();
    ensure(data.len() == numel, "upload", || {
        format!(
            "`{label}`: shape {shape:?} holds {numel} elements but {} were given",
            data.len()
        )
    })?;
    if dtype == DType::U8 {
        let bad = data.iter().position(|x| DType::U8.round(*x) != *x);
        ensure(bad.is_none(), "upload", || {
            let i = bad.unwrap_or(0);
            format!(
                "`{label}` is u8, but element {i} is {}: u8 holds integers 0 to 255",
                data[i]
            )
        })?;
    }
    Ok(())
}

/// Checks `bias_backward`'s operands: `dbias` has one element per column of `dout`.
pub(crate) fn check_bias_backward(dbias: &Tensor, dout: &Tensor) -> Result<()> {
    let (_, cols) = dout.rows_cols();
    ensure(dbias.numel() == cols, "bias_backward", || {
        format!(
            "`{}` has {} elements, `{}` has {cols} columns",
            dbias.label(),
            dbias.numel(),
            dout.label()
        )
    })
}

/// Checks `copy_rows`'s operands: the same width, and the rows named exist in both.
pub(crate) fn check_copy_rows(
    dst: &Tensor,
    dst_row: usize,
    src: &Tensor,
    src_row: usize,
    rows: usize,
) -> Result<()> {
    let ((dr, dc), (sr, sc)) = (dst.rows_cols(), src.rows_cols());
    ensure(dc == sc, "copy_rows", || {
        format!(
            "`{}` {:?} and `{}` {:?} differ in width",
            dst.label(),
            dst.shape(),
            src.label(),
            src.shape()
        )
    })?;
    let fits = |row: usize, have: usize| row.checked_add(rows).is_some_and(|end| end <= have);
    ensure(fits(dst_row, dr) && fits(src_row, sr), "copy_rows", || {
        format!(
            "rows {src_row}..+{rows} of `{}` ({sr} rows) into rows {dst_row}..+{rows} of `{}` \
             ({dr} rows) run past the end",
            src.label(),
            dst.label()
        )
    })
}

/// Rows of `src` into rows of `dst` (see `Backend::copy_rows`): `cast` on the rows, or
/// `axpy` with `alpha = 1` when accumulating, so the CUDA backend runs those kernels.
pub(crate) fn copy_rows(
    dst: &mut Tensor,
    dst_row: usize,
    src: &Tensor,
    src_row: usize,
    rows: usize,
    accumulate: bool,
) {
    let cols = src.rows_cols().1;
    let (d0, s0, n) = (dst_row * cols, src_row * cols, rows * cols);
    match (dst.storage_mut(), src.storage(), accumulate) {
        (Storage::F32(d), Storage::F32(s), false) => d[d0..d0 + n].copy_from_slice(&s[s0..s0 + n]),
        (Storage::Bf16(d), Storage::Bf16(s), false) => {
            d[d0..d0 + n].copy_from_slice(&s[s0..s0 + n])
        }
        (Storage::F32(d), Storage::F32(s), true) => {
            axpy_chunk(&mut d[d0..d0 + n], 1.0, &s[s0..s0 + n])
        }
        (Storage::F32(d), Storage::Bf16(s), acc) => {
            for (d, s) in d[d0..d0 + n].iter_mut().zip(&s[s0..s0 + n]) {
                *d = if acc { *d + s.to_f32() } else { s.to_f32() };
            }
        }
        (Storage::Bf16(d), Storage::F32(s), acc) => {
            for (d, s) in d[d0..d0 + n].iter_mut().zip(&s[s0..s0 + n]) {
                *d = bf16::from_f32(if acc { d.to_f32() + s } else { *s });
            }
        }
        (Storage::Bf16(d), Storage::Bf16(s), true) => {
            for (d, s) in d[d0..d0 + n].iter_mut().zip(&s[s0..s0 + n]) {
                *d = bf16::from_f32(d.to_f32() + s.to_f32());
            }
        }
        _ => {
            let s = read(src)[s0..s0 + n].to_vec();
            write(dst, true, |d| {
                for (d, s) in d[d0..d0 + n].iter_mut().zip(&s) {
                    *d = if accumulate { *d + s } else { *s };
                }
            });
        }
    }
}

pub(crate) fn cast(dst: &mut Tensor, src: &Tensor) {
    match (dst.storage_mut(), src.storage()) {
        (Storage::F32(d), Storage::F32(s)) => d.copy_from_slice(s),
        (Storage::Bf16(d), Storage::Bf16(s)) => d.copy_from_slice(s),
        (Storage::Bf16(d), Storage::F32(s)) => d
            .par_chunks_mut(CHUNK)
            .zip(s.par_chunks(CHUNK))
            .for_each(|(d, s)| {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = bf16::from_f32(*s);
                }
            }),
        (Storage::F32(d), Storage::Bf16(s)) => d
            .par_chunks_mut(CHUNK)
            .zip(s.par_chunks(CHUNK))
            .for_each(|(d, s)| {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = s.to_f32();
                }
            }),
        _ => {
            let s = read(src).into_owned();
            write(dst, false, |d| d.copy_from_slice(&s));
        }
    }
}

pub(crate) fn fill(t: &mut Tensor, value: f32) {
    match t.storage_mut() {
        Storage::F32(v) => v.fill(value),
        Storage::Bf16(v) => v.fill(bf16::from_f32(value)),
        Storage::F16(_)
        | Storage::U8(_)
        | Storage::Nf4 { .. }
        | Storage::Device(_)
        | Storage::Meta { .. } => write(t, false, |v| v.fill(value)),
    }
}

pub(crate) fn add(out: &mut Tensor, a: &Tensor, b: &Tensor) {
    let (a, b) = (read(a), read(b));
    write(out, false, |o| {
        o.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
            .for_each(|(o, (a, b))| add_chunk(o, a, b))
    });
}

pub(crate) fn axpy(y: &mut Tensor, alpha: f32, x: &Tensor) {
    let x = read(x);
    write(y, true, |y| {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| axpy_chunk(y, alpha, x))
    });
}

pub(crate) fn scale(x: &mut Tensor, alpha: f32) {
    write(x, true, |x| {
        x.par_chunks_mut(CHUNK).for_each(|x| scale_chunk(x, alpha))
    })
}

pub(crate) fn sum_squares(x: &Tensor) -> f64 {
    let x = read(x);
    let partial: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>())
        .collect();
    partial.iter().sum()
}

/// Rows per block of a column reduction (the norms' parameter gradients, the bias
/// gradient); blocks are summed in order, so results do not depend on the thread count.
/// The CUDA kernels sum the same blocks (`TK_GRAD_ROW_BLOCK` in kernels/common.cuh): 32
/// rows, so that a GPU has enough blocks to read the rows at full bandwidth.
pub(crate) const ROW_BLOCK: usize = 32;

/// Column sums of a `[rows, cols]` matrix in f32, in a fixed order.
pub(crate) fn column_sums(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let partial: Vec<Vec<f32>> = x[..rows * cols]
        .par_chunks(ROW_BLOCK * cols)
        .map(|block| {
            let mut acc = vec![0f32; cols];
            add_rows(&mut acc, block);
            acc
        })
        .collect();
    let mut total = vec![0f32; cols];
    for p in &partial {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

pub(crate) fn bias_backward(dbias: &mut Tensor, dout: &Tensor) {
    let (rows, cols) = dout.rows_cols();
    let sums = column_sums(&read(dout), rows, cols);
    write(dbias, true, |d| {
        for (d, s) in d.iter_mut().zip(&sums) {
            *d += s;
        }
    });
}

simd_fn! {
    fn add_chunk(o: &mut [f32], a: &[f32], b: &[f32]) {
        for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
    }
}

simd_fn! {
    fn axpy_chunk(y: &mut [f32], alpha: f32, x: &[f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y += alpha * x;
        }
    }
}

simd_fn! {
    fn scale_chunk(x: &mut [f32], alpha: f32) {
        for v in x {
            *v *= alpha;
        }
    }
}

simd_fn! {
    /// `acc += Σ rows of block` (rows of `acc.len()` columns, added in order).
    fn add_rows(acc: &mut [f32], block: &[f32]) {
        for row in block.chunks_exact(acc.len()) {
            for (a, v) in acc.iter_mut().zip(row) {
                *a += v;
            }
        }
    }
}
