//! Causal attention on the CPU in three materialized steps (scores, softmax, values), the
//! reference of `kernels/attention.cu`.
//!
//! The products run over row blocks of the causal triangle ([`block_area`] entries, which
//! the family's FLOP counts follow); the softmax sums in the 16 interleaved lanes of `simd`.

use super::{square_side, Dims};
use crate::device::cpu::matmul::gemm_raw;
use crate::device::cpu::product::Product;
use crate::device::cpu::simd::{self, simd_fn};
use crate::device::cpu::{read, write, Blas, SendPtr};
use crate::error::Result;
use crate::ops::Heads;
use crate::tensor::Tensor;
use rayon::prelude::*;

fn zero_upper(m: &mut [f32], t: usize) {
    for i in 0..t {
        m[i * t + i + 1..(i + 1) * t].fill(0.0);
    }
}

/// Query rows per block of the causal products: block `i` needs keys `0 .. (i+1)·ROWS`
/// only, which skips most of the upper triangle. Fixed, so results do not depend on it.
const ROWS: usize = 64;

/// `(first row, rows)` of each block of a `t`-row causal matrix.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(ROWS)).map(move |i| (i * ROWS, ROWS.min(t - i * ROWS)))
}

/// Entries of a `t`-row causal matrix the blocked products compute: `Σ rows·(i0 + rows)`
/// over the row blocks, the triangle in whole blocks (a little more than `t(t+1)/2`). The
/// products that run down from the diagonal (`Σ rows·(t - i0)`) cover the same count.
pub(super) fn block_area(t: usize) -> u64 {
    blocks(t)
        .map(|(i0, rows)| (rows * (i0 + rows)) as u64)
        .sum()
}

pub(crate) fn scores(
    blas: Option<&Blas>,
    scores: &mut Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    if d.t == 0 {
        return Ok(());
    }
    let q = read(qkv);
    let scale = 1.0 / (d.hs() as f32).sqrt();
    let (t, w) = (d.t, d.w);
    write(scores, false, |s| {
        s.par_chunks_mut(t * t).enumerate().for_each(|(bh, s)| {
            let (bi, hi) = (bh / d.h(), bh % d.h());
            let row0 = bi * t * w;
            for (i0, rows) in blocks(t) {
                // SAFETY: rows i0.. of q, keys 0..i0+rows of k, inside `q`; `s` is [T, T].
                unsafe {
                    gemm_raw(
                        blas,
                        Product {
                            m: rows,
                            n: i0 + rows,
                            k: d.hs(),
                            dst: s.as_mut_ptr().add(i0 * t),
                            dst_rs: t as isize,
                            accumulate: false,
                            a: q.as_ptr().add(row0 + heads.q_col(hi) + i0 * w),
                            a_rs: w as isize,
                            a_cs: 1,
                            b: q.as_ptr().add(row0 + heads.k_col(hi)),
                            b_rs: 1,
                            b_cs: w as isize,
                            scale,
                        },
                        None,
                        false,
                    );
                }
            }
            zero_upper(s, t);
        })
    });
    Ok(())
}

/// Runs `f(bi, kv, first_head)` for every batch row and key/value head in parallel: the
/// tasks of a grouped backward, each owning the key (or value) columns of its head and
/// the query columns of the query heads sharing it.
fn per_kv_head(d: &Dims, f: impl Fn(usize, usize, usize) + Sync + Send) {
    let kv = d.heads.n_kv_head;
    let group = d.heads.group();
    (0..d.b * kv)
        .into_par_iter()
        .for_each(|task| f(task / kv, task % kv, (task % kv) * group));
}

pub(crate) fn scores_backward(
    blas: Option<&Blas>,
    dqkv: &mut Tensor,
    dscores: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    if d.t == 0 {
        return Ok(());
    }
    let q = read(qkv);
    let ds = read(dscores);
    let scale = 1.0 / (d.hs() as f32).sqrt();
    let (t, w, h) = (d.t, d.w, d.h());
    write(dqkv, true, |dq| {
        let out = SendPtr(dq.as_mut_ptr());
        per_kv_head(&d, |bi, _, first| {
            let row0 = bi * t * w;
            for (g, hi) in (first..first + heads.group()).enumerate() {
                let bh = bi * h + hi;
                // Scores above the diagonal are constant, so their gradient is ignored.
                let mut s = ds[bh * t * t..(bh + 1) * t * t].to_vec();
                zero_upper(&mut s, t);
                for (i0, rows) in blocks(t) {
                    // SAFETY: each (bi, kv head) task writes the q columns of its query
                    // heads and its own k columns of dqkv, rows i0..i0+rows of each.
                    unsafe {
                        // dQ[i] = scale · Σ_{j <= i} dS[i, j] · K[j]
                        gemm_raw(
                            blas,
                            Product {
                                m: rows,
                                n: d.hs(),
                                k: i0 + rows,
                                dst: out.get().add(row0 + heads.q_col(hi) + i0 * w),
                                dst_rs: w as isize,
                                accumulate: false,
                                a: s.as_ptr().add(i0 * t),
                                a_rs: t as isize,
                                a_cs: 1,
                                b: q.as_ptr().add(row0 + heads.k_col(hi)),
                                b_rs: w as isize,
                                b_cs: 1,
                                scale,
                            },
                            None,
                            false,
                        );
                        // dK[j] (+)= scale · Σ_{i >= j} dS[i, j] · Q[i], summed over the
                        // query heads of the group in order.
                        gemm_raw(
                            blas,
                            Product {
                                m: rows,
                                n: d.hs(),
                                k: t - i0,
                                dst: out.get().add(row0 + heads.k_col(hi) + i0 * w),
                                dst_rs: w as isize,
                                accumulate: g > 0,
                                a: s.as_ptr().add(i0 * t + i0),
                                a_rs: 1,
                                a_cs: t as isize,
                                b: q.as_ptr().add(row0 + heads.q_col(hi) + i0 * w),
                                b_rs: w as isize,
                                b_cs: 1,
                                scale,
                            },
                            None,
                            false,
                        );
                    }
                }
            }
        })
    });
    Ok(())
}

pub(crate) fn softmax(
    probs: &mut Tensor,
    scores: &Tensor,
    positions: Option<&[u32]>,
) -> Result<()> {
    let t = square_side(scores);
    if t == 0 {
        return Ok(());
    }
    let heads = scores.shape()[1].max(1);
    let s = read(scores);
    write(probs, false, |p| {
        p.par_chunks_mut(t * t)
            .zip(s.par_chunks(t * t))
            .enumerate()
            .for_each(|(k, (p, s))| match positions {
                None => softmax_block(p, s, t),
                Some(pos) => {
                    let b = k / heads;
                    softmax_block_in_documents(p, s, t, &pos[b * t..(b + 1) * t])
                }
            })
    });
    Ok(())
}

pub(crate) fn softmax_backward(
    dscores: &mut Tensor,
    dprobs: &Tensor,
    probs: &Tensor,
) -> Result<()> {
    let t = square_side(probs);
    if t == 0 {
        return Ok(());
    }
    let p = read(probs);
    let dp = read(dprobs);
    write(dscores, false, |ds| {
        ds.par_chunks_mut(t * t)
            .zip(p.par_chunks(t * t).zip(dp.par_chunks(t * t)))
            .for_each(|(ds, (p, dp))| softmax_backward_block(ds, p, dp, t))
    });
    Ok(())
}

pub(crate) fn values(
    blas: Option<&Blas>,
    out: &mut Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    if d.t == 0 {
        return Ok(());
    }
    let q = read(qkv);
    let p = read(probs);
    let (t, w, c) = (d.t, d.w, d.c);
    write(out, false, |o| {
        let optr = SendPtr(o.as_mut_ptr());
        (0..d.b * d.h()).into_par_iter().for_each(|bh| {
            let (bi, hi) = (bh / d.h(), bh % d.h());
            for (i0, rows) in blocks(t) {
                // SAFETY: each (bi, hi) writes its own head columns of out.
                unsafe {
                    gemm_raw(
                        blas,
                        Product {
                            m: rows,
                            n: d.hs(),
                            k: i0 + rows,
                            dst: optr.get().add((bi * t + i0) * c + heads.q_col(hi)),
                            dst_rs: c as isize,
                            accumulate: false,
                            a: p.as_ptr().add(bh * t * t + i0 * t),
                            a_rs: t as isize,
                            a_cs: 1,
                            b: q.as_ptr().add(bi * t * w + heads.v_col(hi)),
                            b_rs: w as isize,
                            b_cs: 1,
                            scale: 1.0,
                        },
                        None,
                        false,
                    );
                }
            }
        })
    });
    Ok(())
}

pub(crate) fn values_backward(
    blas: Option<&Blas>,
    dprobs: &mut Tensor,
    dqkv: &mut Tensor,
    dout: &Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = Dims::of(qkv, heads);
    if d.t == 0 {
        return Ok(());
    }
    let q = read(qkv);
    let p = read(probs);
    let g = read(dout);
    let (t, w, c, h) = (d.t, d.w, d.c, d.h());
    write(dprobs, false, |dp| {
        dp.par_chunks_mut(t * t).enumerate().for_each(|(bh, dp)| {
            let (bi, hi) = (bh / h, bh % h);
            for (i0, rows) in blocks(t) {
                // SAFETY: dout rows i0.. and v rows 0..i0+rows of (bi, hi) lie inside
                // their buffers.
                unsafe {
                    // dP = dout · Vᵀ
                    gemm_raw(
                        blas,
                        Product {
                            m: rows,
                            n: i0 + rows,
                            k: d.hs(),
                            dst: dp.as_mut_ptr().add(i0 * t),
                            dst_rs: t as isize,
                            accumulate: false,
                            a: g.as_ptr().add((bi * t + i0) * c + heads.q_col(hi)),
                            a_rs: c as isize,
                            a_cs: 1,
                            b: q.as_ptr().add(bi * t * w + heads.v_col(hi)),
                            b_rs: 1,
                            b_cs: w as isize,
                            scale: 1.0,
                        },
                        None,
                        false,
                    );
                }
            }
            zero_upper(dp, t);
        })
    });
    write(dqkv, true, |dq| {
        let out = SendPtr(dq.as_mut_ptr());
        per_kv_head(&d, |bi, _, first| {
            for (gi, hi) in (first..first + heads.group()).enumerate() {
                let bh = bi * h + hi;
                for (j0, rows) in blocks(t) {
                    // SAFETY: each (bi, kv head) task writes its own v columns of dqkv.
                    unsafe {
                        // dV[j] (+)= Σ_{i >= j} P[i, j] · dout[i], summed over the query
                        // heads of the group in order.
                        gemm_raw(
                            blas,
                            Product {
                                m: rows,
                                n: d.hs(),
                                k: t - j0,
                                dst: out.get().add((bi * t + j0) * w + heads.v_col(hi)),
                                dst_rs: w as isize,
                                accumulate: gi > 0,
                                a: p.as_ptr().add(bh * t * t + j0 * t + j0),
                                a_rs: 1,
                                a_cs: t as isize,
                                b: g.as_ptr().add((bi * t + j0) * c + heads.q_col(hi)),
                                b_rs: c as isize,
                                b_cs: 1,
                                scale: 1.0,
                            },
                            None,
                            false,
                        );
                    }
                }
            }
        })
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_area_covers_the_triangle_in_whole_blocks() {
        // One block: the full square.
        assert_eq!(block_area(10), 100);
        // Two blocks of 64: 64·64 + 64·128.
        assert_eq!(block_area(128), 12288);
        // 64 + 6 rows: 64·64 + 6·70.
        assert_eq!(block_area(70), 4516);
        assert_eq!(block_area(0), 0);
        // Going down from the diagonal covers as many entries.
        for t in [1, 63, 64, 65, 200, 1024] {
            let down: u64 = blocks(t).map(|(i0, rows)| (rows * (t - i0)) as u64).sum();
            assert_eq!(down, block_area(t), "t = {t}");
        }
    }
}

simd_fn! {
    /// Causal softmax of one `[T, T]` block of scores.
    fn softmax_block(p: &mut [f32], s: &[f32], t: usize) {
        for i in 0..t {
            let row = &s[i * t..i * t + i + 1];
            let (out, above) = p[i * t..(i + 1) * t].split_at_mut(i + 1);
            let max = simd::max(row);
            for (o, v) in out.iter_mut().zip(row) {
                *o = simd::exp(v - max);
            }
            let inv = 1.0 / simd::sum(out);
            for o in out.iter_mut() {
                *o *= inv;
            }
            above.fill(0.0);
        }
    }
}

simd_fn! {
    /// [`softmax_block`] with row `i` over keys `i − pos[i] ..= i` only (its document's),
    /// 0 elsewhere. The maximum and the sum run over the whole causal prefix with the
    /// masked entries left out (as the GPU's lanes do), so they add up in the same order.
    fn softmax_block_in_documents(p: &mut [f32], s: &[f32], t: usize, pos: &[u32]) {
        for i in 0..t {
            let first = i - pos[i] as usize;
            let row = &s[i * t..i * t + i + 1];
            let (out, above) = p[i * t..(i + 1) * t].split_at_mut(i + 1);
            let max = simd::max(&row[first..]);
            for (o, v) in out.iter_mut().zip(row) {
                *o = simd::exp(v - max);
            }
            out[..first].fill(0.0);
            let inv = 1.0 / simd::sum(out);
            for o in out.iter_mut() {
                *o *= inv;
            }
            above.fill(0.0);
        }
    }
}

simd_fn! {
    /// Backward of [`softmax_block`] on one `[T, T]` block.
    fn softmax_backward_block(ds: &mut [f32], p: &[f32], dp: &[f32], t: usize) {
        for i in 0..t {
            let (pr, dr) = (&p[i * t..i * t + i + 1], &dp[i * t..i * t + i + 1]);
            let dot = simd::dot(pr, dr);
            let (out, above) = ds[i * t..(i + 1) * t].split_at_mut(i + 1);
            for j in 0..=i {
                out[j] = pr[j] * (dr[j] - dot);
            }
            above.fill(0.0);
        }
    }
}

/// The CPU twin of `kernels/attention.cu`'s decode kernels ([`super::decode::decode`]),
/// on checked operands: the same loops in the same order.
pub(crate) fn decode(out: &mut Tensor, qkv: &Tensor, kv: &Tensor, heads: Heads, start: usize) {
    let (q, kv) = (read(qkv), read(kv));
    let (hd, n_head, n_kv) = (heads.head_dim, heads.n_head, heads.n_kv_head);
    let n = q.len() / heads.qkv_width();
    let keys = start + n;
    let (qkv_w, kv_w, group) = (heads.qkv_width(), 2 * heads.kv_width(), heads.group());
    let scale = 1.0 / (hd as f32).sqrt();
    write(out, false, |o| {
        o.par_chunks_mut(hd).enumerate().for_each(|(row, o)| {
            let (h, i) = (row % n_head, row / n_head);
            let g = h / group;
            let mut p: Vec<f32> = (0..keys)
                .map(|j| {
                    if j > start + i {
                        return f32::NEG_INFINITY;
                    }
                    let (qr, kr) = (i * qkv_w + h * hd, j * kv_w + g * hd);
                    let mut acc = 0.0f32;
                    for d in 0..hd {
                        acc += q[qr + d] * kv[kr + d];
                    }
                    acc * scale
                })
                .collect();
            let m = p
                .iter()
                .fold(f32::NEG_INFINITY, |m, &s| if s > m { s } else { m });
            let mut sum = 0.0f32;
            for s in p.iter_mut() {
                let e = if *s == f32::NEG_INFINITY {
                    0.0
                } else {
                    simd::exp(*s - m)
                };
                *s = e;
                sum += e;
            }
            let inv = 1.0 / sum;
            for s in p.iter_mut() {
                *s *= inv;
            }
            for (d, o) in o.iter_mut().enumerate() {
                let v = n_kv * hd + g * hd + d;
                let mut acc = 0.0f32;
                for (j, pj) in p.iter().enumerate() {
                    acc += pj * kv[j * kv_w + v];
                }
                *o = acc;
            }
        })
    });
}
