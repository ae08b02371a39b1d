//! Matrix multiplication through the `gemm` crate (f32 with f32 accumulation).

use super::{ensure, read, write, SendPtr};
use crate::error::Result;
use crate::tensor::Tensor;
use gemm::Parallelism;
use rayon::prelude::*;

/// `dst (+)= op(a) · op(b)` on raw row-major buffers.
///
/// `a` is stored `[ar, ac]`, `b` is stored `[br, bc]`; `dst` is `[m, n]` with row stride
/// `dst_rs`. Safe to call from many threads on disjoint `dst` regions.
///
/// # Safety
/// The pointers must cover the described matrices.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    a: *const f32,
    a_rs: isize,
    a_cs: isize,
    b: *const f32,
    b_rs: isize,
    b_cs: isize,
    scale: f32,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::slice::from_raw_parts_mut(dst.offset(i as isize * dst_rs), n).fill(0.0);
            }
        }
        return;
    }
    if parallel && m * n * k >= PARALLEL_WORK {
        // Split the output into fixed blocks, each a single-threaded product: blocks do
        // not depend on the thread count, so neither do the results.
        let (dst, a, b) = (SendPtr(dst), SendPtr(a as *mut f32), SendPtr(b as *mut f32));
        if m >= 2 * BLOCK && m >= n {
            (0..m.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
                let (i0, rows) = (blk * BLOCK, BLOCK.min(m - blk * BLOCK));
                gemm_serial(
                    rows,
                    n,
                    k,
                    dst.get().offset(i0 as isize * dst_rs),
                    dst_rs,
                    accumulate,
                    a.get().offset(i0 as isize * a_rs),
                    a_rs,
                    a_cs,
                    b.get(),
                    b_rs,
                    b_cs,
                    scale,
                );
            });
            return;
        }
        if n >= 2 * BLOCK {
            (0..n.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
                let (j0, cols) = (blk * BLOCK, BLOCK.min(n - blk * BLOCK));
                gemm_serial(
                    m,
                    cols,
                    k,
                    dst.get().add(j0),
                    dst_rs,
                    accumulate,
                    a.get(),
                    a_rs,
                    a_cs,
                    b.get().offset(j0 as isize * b_cs),
                    b_rs,
                    b_cs,
                    scale,
                );
            });
            return;
        }
    }
    gemm_serial(
        m, n, k, dst, dst_rs, accumulate, a, a_rs, a_cs, b, b_rs, b_cs, scale,
    );
}

/// Rows (or columns) of the output per parallel block.
const BLOCK: usize = 256;
/// Multiply-adds above which a product is split across threads.
const PARALLEL_WORK: usize = 1 << 20;

/// One single-threaded `gemm` call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_serial(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    a: *const f32,
    a_rs: isize,
    a_cs: isize,
    b: *const f32,
    b_rs: isize,
    b_cs: isize,
    scale: f32,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs,
        accumulate,
        a,
        a_cs,
        a_rs,
        b,
        b_cs,
        b_rs,
        1.0,
        scale,
        false,
        false,
        false,
        Parallelism::None,
    );
}

pub(super) fn matmul(
    out: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<()> {
    let (ar, ac) = a.rows_cols();
    let (br, bc) = b.rows_cols();
    let (m, k) = if trans_a { (ac, ar) } else { (ar, ac) };
    let (kb, n) = if trans_b { (bc, br) } else { (br, bc) };
    ensure(k == kb, "matmul", || {
        format!(
            "inner dimensions differ: `{}` {:?}{} and `{}` {:?}{}",
            a.label(),
            a.shape(),
            if trans_a { "ᵀ" } else { "" },
            b.label(),
            b.shape(),
            if trans_b { "ᵀ" } else { "" }
        )
    })?;
    ensure(out.rows_cols() == (m, n), "matmul", || {
        format!(
            "`{}` is {:?}, the product is [{m}, {n}]",
            out.label(),
            out.shape()
        )
    })?;
    if let Some(bias) = bias {
        ensure(bias.numel() == n, "matmul", || {
            format!(
                "bias `{}` has {} elements, expected {n}",
                bias.label(),
                bias.numel()
            )
        })?;
    }
    let av = read(a);
    let bv = read(b);
    let biasv = bias.map(read);
    let (a_rs, a_cs) = if trans_a {
        (1, ac as isize)
    } else {
        (ac as isize, 1)
    };
    let (b_rs, b_cs) = if trans_b {
        (1, bc as isize)
    } else {
        (bc as isize, 1)
    };
    write(out, accumulate, |o| {
        let mut acc = accumulate;
        if let (Some(bias), false) = (&biasv, accumulate) {
            for row in o.chunks_exact_mut(n) {
                row.copy_from_slice(bias);
            }
            acc = true;
        }
        // SAFETY: the shapes were checked above; `o`, `av`, `bv` cover them.
        unsafe {
            gemm_raw(
                m,
                n,
                k,
                o.as_mut_ptr(),
                n as isize,
                acc,
                av.as_ptr(),
                a_rs,
                a_cs,
                bv.as_ptr(),
                b_rs,
                b_cs,
                1.0,
                true,
            );
        }
        if let (Some(bias), true) = (&biasv, accumulate) {
            for row in o.chunks_exact_mut(n) {
                for (r, b) in row.iter_mut().zip(bias.iter()) {
                    *r += b;
                }
            }
        }
    });
    Ok(())
}
