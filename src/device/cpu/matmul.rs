//! Matrix multiplication through the `gemm` crate (f32 with f32 accumulation).

use super::{ensure, read, write};
use crate::error::Result;
use crate::tensor::Tensor;
use gemm::Parallelism;

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
    let par = if parallel && m * n * k >= 1 << 18 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    gemm::gemm(
        m, n, k, dst, 1, dst_rs, accumulate, a, a_cs, a_rs, b, b_cs, b_rs, 1.0, scale, false,
        false, false, par,
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
