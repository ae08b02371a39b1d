//! Matrix multiplication through the `gemm` crate (f32 with f32 accumulation), or through
//! a loaded CBLAS library ([`Blas`]).

use super::blas::Blas;
use super::{ensure, gelu, read, write, SendPtr};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

/// One product `dst (+)= scale · op(a) · op(b)` on raw row-major buffers: `op(a)` is
/// `[m, k]` with element `(i, p)` at `a[i·a_rs + p·a_cs]`, `op(b)` is `[k, n]` with
/// element `(p, j)` at `b[p·b_rs + j·b_cs]`, and `dst` is `[m, n]` with row stride
/// `dst_rs` and column stride 1.
#[derive(Clone, Copy, Debug)]
pub(super) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst: *mut f32,
    pub dst_rs: isize,
    pub accumulate: bool,
    pub a: *const f32,
    pub a_rs: isize,
    pub a_cs: isize,
    pub b: *const f32,
    pub b_rs: isize,
    pub b_cs: isize,
    pub scale: f32,
}

// SAFETY: a `Product` only describes memory; whoever runs it guarantees the pointers are
// valid and that products running at once write disjoint `dst` regions.
unsafe impl Send for Product {}
unsafe impl Sync for Product {}

impl Product {
    /// The `[rows, cols]` tile of this product whose first element is `(i0, j0)`.
    ///
    /// # Safety
    /// The tile must lie inside the product.
    unsafe fn tile(&self, i0: usize, j0: usize, rows: usize, cols: usize) -> Product {
        Product {
            m: rows,
            n: cols,
            dst: self.dst.offset(i0 as isize * self.dst_rs).add(j0),
            a: self.a.offset(i0 as isize * self.a_rs),
            b: self.b.offset(j0 as isize * self.b_cs),
            ..*self
        }
    }
}

/// What a product does around each of its tiles, while the tile is in cache.
#[derive(Clone, Copy, Default)]
pub(super) struct Epilogue<'a> {
    /// `n` values: without `accumulate`, `dst = bias + product` (each tile's rows are set
    /// to the bias just before its product).
    pub bias: Option<&'a [f32]>,
    /// Called with `(first row, first column, rows, columns)` of each finished tile.
    pub after: Option<&'a (dyn Fn(usize, usize, usize, usize) + Sync)>,
}

/// Runs `p` and its epilogue. Safe to call from many threads on disjoint `dst` regions.
/// Each tile runs on `blas` when given (and able to express the strides), else on the
/// `gemm` crate.
///
/// # Safety
/// The pointers must cover the described matrices.
pub(super) unsafe fn gemm_raw(
    blas: Option<&Blas>,
    p: Product,
    epilogue: Epilogue<'_>,
    parallel: bool,
) {
    let Product { m, n, k, .. } = p;
    if m == 0 || n == 0 {
        return;
    }
    let bias = epilogue.bias.filter(|_| !p.accumulate);
    let after = |i0, j0, rows, cols| {
        if let Some(after) = epilogue.after {
            after(i0, j0, rows, cols);
        }
    };
    if k == 0 {
        if !p.accumulate {
            set_rows(p.dst, p.dst_rs, m, n, bias);
        }
        after(0, 0, m, n);
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
                after(i0, j0, rows, cols);
            });
            return;
        }
    }
    if bias.is_some() {
        set_rows(p.dst, p.dst_rs, m, n, bias);
    }
    gemm_serial(blas, &p);
    after(0, 0, m, n);
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
    let (m, n, k) = dims(out, a, b, bias, trans_a, trans_b)?;
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
                Epilogue {
                    bias: biasv.as_deref(),
                    after: None,
                },
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

/// Whether [`matmul_bias_gelu`] takes these operands: all f32, `out` with `pre`'s rows and
/// columns.
pub(super) fn gelu_fusable(
    out: &Tensor,
    pre: &Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: &Tensor,
) -> bool {
    [out, pre, a, b, bias]
        .iter()
        .all(|t| matches!(t.storage(), Storage::F32(_)))
        && out.rows_cols() == pre.rows_cols()
}

/// `pre = a·b + bias` and `out = gelu(pre)` with each tile's GELU run right after its
/// product, while the tile is in cache: bitwise equal to [`matmul`] then the GELU op.
/// The operands must be [`gelu_fusable`].
pub(super) fn matmul_bias_gelu(
    blas: Option<&Blas>,
    out: &mut Tensor,
    pre: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: &Tensor,
) -> Result<()> {
    let (m, n, k) = dims(pre, a, b, Some(bias), false, false)?;
    let (Storage::F32(o), Storage::F32(pv)) = (out.storage_mut(), pre.storage_mut()) else {
        return Err(crate::error::Error::Backend {
            backend: "cpu",
            message: "the fused GELU product takes f32 host tensors only".to_string(),
        });
    };
    let (av, bv, biasv) = (read(a), read(b), read(bias));
    let (optr, pptr) = (SendPtr(o.as_mut_ptr()), SendPtr(pv.as_mut_ptr()));
    let gelu_tile = |i0: usize, j0: usize, rows: usize, cols: usize| {
        for i in i0..i0 + rows {
            // SAFETY: the tile lies inside both `[m, n]` buffers and no other tile
            // touches it; its product has finished.
            unsafe {
                let at = i * n + j0;
                let x = std::slice::from_raw_parts(pptr.get().add(at), cols);
                let y = std::slice::from_raw_parts_mut(optr.get().add(at), cols);
                gelu::forward_chunk(y, x);
            }
        }
    };
    // SAFETY: the shapes were checked above; the buffers cover them.
    unsafe {
        gemm_raw(
            blas,
            Product {
                m,
                n,
                k,
                dst: pptr.get(),
                dst_rs: n as isize,
                accumulate: false,
                a: av.as_ptr(),
                a_rs: k as isize,
                a_cs: 1,
                b: bv.as_ptr(),
                b_rs: n as isize,
                b_cs: 1,
                scale: 1.0,
            },
            Epilogue {
                bias: Some(&biasv),
                after: Some(&gelu_tile),
            },
            true,
        );
    }
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

#[cfg(test)]
mod fused_gelu_tests {
    use crate::{Backend, CpuBackend, DType, MemoryCategory, Rng};

    /// The fused product and GELU against `matmul` then `gelu`, bitwise, in shapes the
    /// product runs whole and in tiles; bf16 takes the two-op path.
    #[test]
    fn the_fused_gelu_product_equals_the_two_ops() {
        let be = CpuBackend::new();
        let mut rng = Rng::new(11);
        for (m, n, k) in [(3, 5, 7), (600, 520, 40), (4100, 20, 64)] {
            for dtype in [DType::F32, DType::Bf16] {
                let mut up = |shape: &[usize]| {
                    let data: Vec<f32> = (0..shape.iter().product())
                        .map(|_| rng.normal() as f32)
                        .collect();
                    be.upload(&data, shape, dtype, MemoryCategory::Activations, "t")
                        .unwrap()
                };
                let (a, b, bias) = (up(&[m, k]), up(&[k, n]), up(&[n]));
                let mut outs = vec![];
                for fused in [true, false] {
                    let mut pre = up(&[m, n]);
                    let mut out = up(&[m, n]);
                    if fused {
                        be.matmul_bias_gelu(&mut out, &mut pre, &a, &b, &bias)
                            .unwrap();
                    } else {
                        be.matmul(&mut pre, &a, &b, Some(&bias), false, false, false)
                            .unwrap();
                        be.gelu(&mut out, &pre).unwrap();
                    }
                    outs.push((be.to_f32(&pre).unwrap(), be.to_f32(&out).unwrap()));
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&outs[0].0),
                    bits(&outs[1].0),
                    "pre {m}x{n}x{k} {dtype:?}"
                );
                assert_eq!(
                    bits(&outs[0].1),
                    bits(&outs[1].1),
                    "out {m}x{n}x{k} {dtype:?}"
                );
                // The product really ran: GELU of a non-trivial product is not all zeros.
                assert!(outs[0].1.iter().any(|v| *v != 0.0));
            }
        }
    }
}
