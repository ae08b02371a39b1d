//! Causal multi-head attention in three materialized steps: scores, softmax, values.
//!
//! `qkv` is `[B, T, (H + 2·KV)·D]` (see [`Heads`]): queries, then keys, then values, head
//! after head; query head `h` reads key and value head `h / (H / KV)`. Scores and
//! probabilities are `[B, H, T, T]` with zeros above the diagonal; the output is
//! `[B, T, H·D]`.

use super::blas::Blas;
use super::matmul::{gemm_raw, Product};
use super::simd::{self, simd_fn};
use super::{ensure, ensure_shape, read, write, SendPtr};
use crate::device::Heads;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// The dimensions of an attention op: batch, sequence, the heads, and the widths of a
/// `qkv` row (`w`) and an output row (`c`).
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) heads: Heads,
    pub(crate) w: usize,
    pub(crate) c: usize,
}

impl Dims {
    /// The dimensions of a checked `qkv` with `heads`, read without checking (zeros where
    /// the shape does not fit).
    pub(crate) fn of(qkv: &Tensor, heads: Heads) -> Dims {
        let (b, t) = match *qkv.shape() {
            [b, t, _] => (b, t),
            _ => (0, 0),
        };
        Dims {
            b,
            t,
            heads,
            w: heads.qkv_width(),
            c: heads.q_width(),
        }
    }

    /// Query heads.
    pub(crate) fn h(&self) -> usize {
        self.heads.n_head
    }

    /// Head width.
    pub(crate) fn hs(&self) -> usize {
        self.heads.head_dim
    }
}

/// Checks a `[B, T, (H + 2·KV)·D]` `qkv` with valid `heads`, and returns its dimensions.
pub(crate) fn dims(qkv: &Tensor, heads: Heads, op: &'static str) -> Result<Dims> {
    heads.check(op)?;
    let [_, _, w] = *qkv.shape() else {
        return Err(Error::shape(
            op,
            format!(
                "`{}` must be [B, T, (H + 2·KV)·D], it is {:?}",
                qkv.label(),
                qkv.shape()
            ),
        ));
    };
    ensure(w == heads.qkv_width(), op, || {
        format!(
            "`{}` has rows of {w}; {} query and {} key/value heads of {} need (H + 2·KV)·D \
             = {}",
            qkv.label(),
            heads.n_head,
            heads.n_kv_head,
            heads.head_dim,
            heads.qkv_width()
        )
    })?;
    Ok(Dims::of(qkv, heads))
}

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
fn block_area(t: usize) -> u64 {
    blocks(t)
        .map(|(i0, rows)| (rows * (i0 + rows)) as u64)
        .sum()
}

/// Floating-point operations of each attention op with these operands, as the kernels
/// here execute them: products over whole row blocks of the causal triangle (2 per
/// multiply-add, plus 1 per output for the score scaling), 5 per causal entry for the
/// softmax (max, subtract, exp, sum, normalise) and 4 for its backward. Zero for shapes
/// the ops refuse.
pub(crate) struct AttentionFlops {
    pub scores: u64,
    pub scores_backward: u64,
    pub values: u64,
    pub values_backward: u64,
}

impl AttentionFlops {
    pub(crate) fn new(qkv: &Tensor, heads: Heads) -> AttentionFlops {
        let Ok(d) = dims(qkv, heads, "attention") else {
            return AttentionFlops {
                scores: 0,
                scores_backward: 0,
                values: 0,
                values_backward: 0,
            };
        };
        let area = block_area(d.t);
        let (bh, hs, t) = ((d.b * d.h()) as u64, d.hs() as u64, d.t as u64);
        AttentionFlops {
            // S = scale · Q·Kᵀ on the blocks.
            scores: bh * area * (2 * hs + 1),
            // dQ = scale · dS·K and dK = scale · dSᵀ·Q.
            scores_backward: bh * hs * (4 * area + 2 * t),
            // O = P·V.
            values: bh * 2 * hs * area,
            // dP = dO·Vᵀ and dV = Pᵀ·dO.
            values_backward: bh * 4 * hs * area,
        }
    }
}

/// Floating-point operations of the causal softmax (`per_entry` 5) or its backward (4)
/// over `[B, H, T, T]` `probs`: the triangle `j <= i` only. Zero for other shapes.
pub(crate) fn softmax_flops(probs: &Tensor, per_entry: u64) -> u64 {
    match *probs.shape() {
        [b, h, t, t2] if t == t2 => (b * h) as u64 * (t * (t + 1) / 2) as u64 * per_entry,
        _ => 0,
    }
}

/// Checks `attention_scores`' operands (the contract every backend shares).
pub(crate) fn check_scores(scores: &Tensor, qkv: &Tensor, heads: Heads) -> Result<()> {
    let d = dims(qkv, heads, "attention_scores")?;
    ensure_shape(scores, &[d.b, d.h(), d.t, d.t], "attention_scores")
}

/// Checks `attention_scores_backward`'s operands (the contract every backend shares).
pub(crate) fn check_scores_backward(
    dqkv: &Tensor,
    dscores: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = dims(qkv, heads, "attention_scores_backward")?;
    ensure_shape(dqkv, qkv.shape(), "attention_scores_backward")?;
    ensure_shape(
        dscores,
        &[d.b, d.h(), d.t, d.t],
        "attention_scores_backward",
    )
}

/// Checks `softmax_causal`'s operands (the contract every backend shares).
pub(crate) fn check_softmax(probs: &Tensor, scores: &Tensor) -> Result<()> {
    square_rows(scores, "softmax_causal")?;
    ensure_shape(probs, scores.shape(), "softmax_causal")
}

/// Checks `softmax_causal_backward`'s operands (the contract every backend shares).
pub(crate) fn check_softmax_backward(
    dscores: &Tensor,
    dprobs: &Tensor,
    probs: &Tensor,
) -> Result<()> {
    square_rows(probs, "softmax_causal_backward")?;
    ensure_shape(dscores, probs.shape(), "softmax_causal_backward")?;
    ensure_shape(dprobs, probs.shape(), "softmax_causal_backward")
}

/// Checks `attention_values`' operands (the contract every backend shares).
pub(crate) fn check_values(out: &Tensor, probs: &Tensor, qkv: &Tensor, heads: Heads) -> Result<()> {
    let d = dims(qkv, heads, "attention_values")?;
    ensure_shape(out, &[d.b, d.t, d.c], "attention_values")?;
    ensure_shape(probs, &[d.b, d.h(), d.t, d.t], "attention_values")
}

/// Checks `attention_values_backward`'s operands (the contract every backend shares).
pub(crate) fn check_values_backward(
    dprobs: &Tensor,
    dqkv: &Tensor,
    dout: &Tensor,
    probs: &Tensor,
    qkv: &Tensor,
    heads: Heads,
) -> Result<()> {
    let d = dims(qkv, heads, "attention_values_backward")?;
    ensure_shape(dout, &[d.b, d.t, d.c], "attention_values_backward")?;
    ensure_shape(probs, &[d.b, d.h(), d.t, d.t], "attention_values_backward")?;
    ensure_shape(dprobs, probs.shape(), "attention_values_backward")?;
    ensure_shape(dqkv, qkv.shape(), "attention_values_backward")
}

/// `T` of checked `[B, H, T, T]` scores or probabilities.
pub(crate) fn square_side(t: &Tensor) -> usize {
    t.shape().last().copied().unwrap_or(0)
}

pub(super) fn scores(
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

pub(super) fn scores_backward(
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

pub(crate) fn square_rows(t: &Tensor, op: &'static str) -> Result<usize> {
    let s = t.shape();
    ensure(s.len() == 4 && s[2] == s[3], op, || {
        format!("`{}` must be [B, H, T, T], it is {s:?}", t.label())
    })?;
    Ok(s[3])
}

pub(super) fn softmax(probs: &mut Tensor, scores: &Tensor) -> Result<()> {
    let t = square_side(scores);
    if t == 0 {
        return Ok(());
    }
    let s = read(scores);
    write(probs, false, |p| {
        p.par_chunks_mut(t * t)
            .zip(s.par_chunks(t * t))
            .for_each(|(p, s)| softmax_block(p, s, t))
    });
    Ok(())
}

pub(super) fn softmax_backward(
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

pub(super) fn values(
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

pub(super) fn values_backward(
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

    #[test]
    fn attention_flops_follow_the_blocks() {
        let be = crate::CpuBackend::new();
        use crate::Backend;
        // B 2, T 70, C 8, 2 heads of 4.
        let qkv = be
            .zeros(
                &[2, 70, 24],
                crate::DType::F32,
                crate::MemoryCategory::Activations,
                "qkv",
            )
            .unwrap();
        let f = AttentionFlops::new(&qkv, Heads::mha(2, 8));
        assert_eq!(f.scores, 4 * 4516 * 9);
        assert_eq!(f.values, 4 * 2 * 4 * 4516);
        assert_eq!(f.values_backward, 2 * f.values);
        assert_eq!(f.scores_backward, 4 * 4 * (4 * 4516 + 140));
        // Heads that do not divide the width: the op refuses, nothing is counted.
        assert_eq!(AttentionFlops::new(&qkv, Heads::mha(3, 8)).scores, 0);
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
