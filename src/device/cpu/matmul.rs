//! Matrix multiplication through the `gemm` crate (f32 with f32 accumulation), or through
//! a loaded CBLAS library ([`Blas`]).

use super::blas::Blas;
use super::product::Product;
use super::{ensure, read, write};
use crate::error::Result;
use crate::tensor::Tensor;
use gemm::Parallelism;
use rayon::prelude::*;

/// Runs `p`. With `bias` (`n` values) and not `accumulate`, `dst = bias + product`: each
/// tile's rows are set to the bias just before its product, while the tile is in cache.
/// Safe to call from many threads on disjoint `dst` regions. Each tile runs on `blas`
/// when given (and able to express the strides), else on the `gemm` crate.
///
/// # Safety
/// The pointers must cover the described matrices.
pub(crate) unsafe fn gemm_raw(
    blas: Option<&Blas>,
    p: Product,
    bias: Option<&[f32]>,
    parallel: bool,
) {
    let Product { m, n, k, .. } = p;
    if m == 0 || n == 0 {
        return;
    }
    let bias = bias.filter(|_| !p.accumulate);
    if k == 0 {
        if !p.accumulate {
            set_rows(p.dst, p.dst_rs, m, n, bias);
        }
        return;
    }
    let p = Product {
        accumulate: p.accumulate || bias.is_some(),
        ..p
    };
    if parallel && m * n * k >= PARALLEL_WORK {
        // Split the output into fixed tiles, each a single-threaded product. Tiles depend
        // only on the shape, never on the thread count, so neither do the results.
        let (tile_m, tile_n) = tiles(m, n, p.a_cs != 1);
        let (tiles_m, tiles_n) = (m.div_ceil(tile_m), n.div_ceil(tile_n));
        if tiles_m * tiles_n > 1 {
            (0..tiles_m * tiles_n).into_par_iter().for_each(|t| {
                let (i0, j0) = ((t / tiles_n) * tile_m, (t % tiles_n) * tile_n);
                let (rows, cols) = (tile_m.min(m - i0), tile_n.min(n - j0));
                let tile = p.tile(i0, j0, rows, cols);
                if let Some(bias) = bias {
                    set_rows(
                        tile.dst,
                        tile.dst_rs,
                        rows,
                        cols,
                        Some(&bias[j0..j0 + cols]),
                    );
                }
                gemm_serial(blas, &tile);
            });
            return;
        }
    }
    if bias.is_some() {
        set_rows(p.dst, p.dst_rs, m, n, bias);
    }
    gemm_serial(blas, &p);
}

/// Sets each of the `m` rows (`n` long, `rs` apart) at `dst` to `bias`, or to zeros.
///
/// # Safety
/// `dst` must cover the rows.
unsafe fn set_rows(dst: *mut f32, rs: isize, m: usize, n: usize, bias: Option<&[f32]>) {
    for i in 0..m {
        let row = std::slice::from_raw_parts_mut(dst.offset(i as isize * rs), n);
        match bias {
            Some(bias) => row.copy_from_slice(bias),
            None => row.fill(0.0),
        }
    }
}

/// Longest side of an output tile in a parallel product.
const TILE: usize = 256;
/// Outputs with at least this many rows (or columns) are split along that side alone.
const LONG_SIDE: usize = 8 * TILE;
/// Multiply-adds above which a product is split across threads.
const PARALLEL_WORK: usize = 1 << 20;

/// The output tile of a parallel `[m, n]` product: whole rows (or columns) in strips of
/// [`TILE`] when one side is long, else both sides cut into near-equal parts of at most
/// [`TILE`], rounded up to 16 (a `[384, 384]` output becomes four `[192, 192]` tiles
/// rather than one).
///
/// When `a`'s reduction axis is strided (`op(a) = aᵀ`, as in a weight gradient `xᵀ·dy`),
/// every tile repacks its rows of `a` for the whole reduction, so such products are cut
/// along `m` alone, in at least two parts.
fn tiles(m: usize, n: usize, a_strided: bool) -> (usize, usize) {
    let even = |len: usize| len.div_ceil(len.div_ceil(TILE)).next_multiple_of(16);
    if a_strided {
        (even(m).min((m / 2).next_multiple_of(16)).max(16), n)
    } else if m >= LONG_SIDE && m >= n {
        (TILE, n)
    } else if n >= LONG_SIDE {
        (m, TILE)
    } else {
        (even(m), even(n))
    }
}

/// One single-threaded product: `blas` when given and able to express the strides, else
/// the `gemm` crate.
unsafe fn gemm_serial(blas: Option<&Blas>, p: &Product) {
    if blas.is_some_and(|blas| blas.sgemm(p)) {
        return;
    }
    gemm::gemm(
        p.m,
        p.n,
        p.k,
        p.dst,
        1,
        p.dst_rs,
        p.accumulate,
        p.a,
        p.a_cs,
        p.a_rs,
        p.b,
        p.b_cs,
        p.b_rs,
        1.0,
        p.scale,
        false,
        false,
        false,
        Parallelism::None,
    );
}

/// Floating-point operations of a `[m, n]` product over `k`: a multiply and an add per
/// term (2·m·n·k), plus one add per output element for a bias.
pub(crate) fn product_flops(m: usize, n: usize, k: usize, bias: bool) -> u64 {
    let (m, n, k) = (m as u64, n as u64, k as u64);
    let mn = m.saturating_mul(n);
    mn.saturating_mul(k)
        .saturating_mul(2)
        .saturating_add(if bias { mn } else { 0 })
}

/// Floating-point operations of [`matmul`] with these operands (meaningful once the
/// shapes have been accepted).
pub(crate) fn flops(out: &Tensor, a: &Tensor, bias: bool, trans_a: bool) -> u64 {
    let (m, n) = out.rows_cols();
    let (ar, ac) = a.rows_cols();
    product_flops(m, n, if trans_a { ar } else { ac }, bias)
}

/// `(m, n, k)` of the product `op(a)·op(b)`, read from the operands without checking
/// that they agree.
pub(crate) fn shape(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> (usize, usize, usize) {
    let (ar, ac) = a.rows_cols();
    let (br, bc) = b.rows_cols();
    let (m, k) = if trans_a { (ac, ar) } else { (ar, ac) };
    let n = if trans_b { br } else { bc };
    (m, n, k)
}

/// Checks the operands of a product `out (+)= op(a)·op(b) (+ bias)` (the contract every
/// backend's `matmul` shares) and returns `(m, n, k)`.
pub(crate) fn dims(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    trans_a: bool,
    trans_b: bool,
) -> Result<(usize, usize, usize)> {
    let (m, n, k) = shape(a, b, trans_a, trans_b);
    let (br, bc) = b.rows_cols();
    let kb = if trans_b { bc } else { br };
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
    Ok((m, n, k))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    blas: Option<&Blas>,
    out: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<()> {
    let (m, n, k) = shape(a, b, trans_a, trans_b);
    let (_, ac) = a.rows_cols();
    let (_, bc) = b.rows_cols();
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
        // SAFETY: the shapes were checked above; `o`, `av`, `bv` cover them.
        unsafe {
            gemm_raw(
                blas,
                Product {
                    m,
                    n,
                    k,
                    dst: o.as_mut_ptr(),
                    dst_rs: n as isize,
                    accumulate,
                    a: av.as_ptr(),
                    a_rs,
                    a_cs,
                    b: bv.as_ptr(),
                    b_rs,
                    b_cs,
                    scale: 1.0,
                },
                biasv.as_deref(),
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

#[cfg(test)]
mod tests {
    use super::{product_flops, tiles};

    #[test]
    fn product_flops_are_two_per_multiply_add() {
        assert_eq!(product_flops(2, 3, 4, false), 48);
        // The bias adds one per output element.
        assert_eq!(product_flops(2, 3, 4, true), 54);
        assert_eq!(product_flops(0, 3, 4, true), 0);
        // GPT-2 small's QKV projection on 8 × 1024 tokens.
        assert_eq!(
            product_flops(8 * 1024, 3 * 768, 768, false),
            2 * 8192 * 2304 * 768
        );
        assert_eq!(product_flops(usize::MAX, 2, 2, false), u64::MAX);
    }

    #[test]
    fn tiles_follow_the_shape() {
        // Activations: long row strips, whole rows.
        assert_eq!(tiles(4096, 1152, false), (256, 1152));
        // Wide outputs: column strips.
        assert_eq!(tiles(384, 4096, false), (384, 256));
        // Weight-sized outputs: both sides cut into near-equal parts.
        assert_eq!(tiles(384, 384, false), (192, 192));
        assert_eq!(tiles(384, 1152, false), (192, 240));
        // A strided reduction: row strips only, at least two.
        assert_eq!(tiles(384, 1152, true), (192, 1152));
        assert_eq!(tiles(1536, 384, true), (256, 384));
        assert_eq!(tiles(256, 384, true), (128, 384));
    }
}
