//! Rotary position embedding in Hugging Face's rotate-half layout (Llama), applied to the
//! queries and keys of a fused `[B, T, (H + 2·KV)·D]` projection (see [`Heads`]): in each
//! query and key head, element `i` and element `i + D/2` are rotated together by the angle
//! `t · inv_freq[i]` of the token's position `t` (`0..T` in each row of the batch, or its
//! position in its document where the batch gives positions); the values are copied as
//! they are.

use crate::device::cpu::{read, write};
use crate::ops::Heads;

use crate::tensor::Tensor;
use rayon::prelude::*;

/// Rotates each pair by `+angle` (forward) or `−angle` (backward: the transpose), on
/// checked operands.
fn rotate(
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
    sign: f32,
) {
    let (t, w) = match *x.shape() {
        [_, t, w] => (t, w),
        _ => return,
    };
    if w == 0 {
        return;
    }
    let (d, half) = (heads.head_dim, heads.head_dim / 2);
    let rotated = heads.q_width() + heads.kv_width();
    // The sine and cosine of every position's angles, once per call (every row of the
    // batch at position p turns by the same angles); positions reach past T where a row
    // continues a sequence (incremental decoding).
    let span = positions.map_or(t, |p| p.iter().max().map_or(0, |&m| m as usize + 1));
    let table: Vec<(f32, f32)> = (0..span)
        .flat_map(|pos| {
            inv_freq.iter().map(move |&f| {
                let angle = pos as f32 * f;
                (sign * angle.sin(), angle.cos())
            })
        })
        .collect();
    let x = read(x);
    write(out, false, |o| {
        o.par_chunks_mut(w)
            .zip(x.par_chunks(w))
            .enumerate()
            .for_each(|(row, (o, x))| {
                let pos = positions.map_or(row % t, |p| p[row] as usize);
                let angles = &table[pos * half..(pos + 1) * half];
                for h in (0..rotated).step_by(d) {
                    let (o1, o2) = o[h..h + d].split_at_mut(half);
                    let (x1, x2) = x[h..h + d].split_at(half);
                    for i in 0..half {
                        let (s, c) = angles[i];
                        o1[i] = x1[i] * c - x2[i] * s;
                        o2[i] = x2[i] * c + x1[i] * s;
                    }
                }
                o[rotated..].copy_from_slice(&x[rotated..]);
            })
    });
}

/// The forward, on checked operands.
pub(crate) fn forward(
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
) {
    rotate(out, x, inv_freq, heads, positions, 1.0)
}

/// The backward (the rotation by the opposite angles), on checked operands.
pub(crate) fn backward(
    dx: &mut Tensor,
    dout: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
) {
    rotate(dx, dout, inv_freq, heads, positions, -1.0)
}

#[cfg(test)]
mod tests {
    use crate::device::{Backend, CpuBackend};
    use crate::memory::MemoryCategory;
    use crate::model::{Rope, RopeScaling};
    use crate::ops::rope;
    use crate::ops::Heads;
    use crate::tensor::DType;

    #[test]
    fn forward_is_hugging_faces_rotate_half_and_backward_its_transpose() {
        let be = CpuBackend::new();
        let heads = Heads {
            n_head: 3,
            n_kv_head: 1,
            head_dim: 8,
        };
        let (b, t, d, w) = (2, 5, heads.head_dim, heads.qkv_width());
        let inv = Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        }
        .inv_freq(d);
        let n = b * t * w;
        let xs: Vec<f32> = (0..n).map(|i| ((i * 37) % 23) as f32 * 0.1 - 1.1).collect();
        let ds: Vec<f32> = (0..n).map(|i| ((i * 11) % 17) as f32 * 0.1 - 0.8).collect();
        let up = |v: &[f32]| {
            be.upload(v, &[b, t, w], DType::F32, MemoryCategory::Workspace, "t")
                .unwrap()
        };
        let (x, dd) = (up(&xs), up(&ds));
        let mut y = up(&vec![0.0; n]);
        rope::forward(&be, &mut y, &x, &inv, heads).unwrap();
        let mut dx = up(&vec![0.0; n]);
        rope::backward(&be, &mut dx, &dd, &inv, heads).unwrap();
        let (y, dx) = (be.to_f32(&y).unwrap(), be.to_f32(&dx).unwrap());
        // q·cos + rotate_half(q)·sin, rotate_half(q) = [−q2, q1], in f64, on the 3 query
        // heads and the key head; the value head is copied.
        let rotated = 4 * d;
        for row in 0..b * t {
            let pos = (row % t) as f64;
            for j in 0..w {
                let base = row * w + j / d * d;
                let want = if j < rotated {
                    let (e, i) = (j % d, j % (d / 2));
                    let angle = pos * inv[i] as f64;
                    let rot = if e < d / 2 {
                        -xs[base + e + d / 2]
                    } else {
                        xs[base + e - d / 2]
                    };
                    xs[base + e] as f64 * angle.cos() + rot as f64 * angle.sin()
                } else {
                    xs[row * w + j] as f64
                };
                assert!(
                    (y[row * w + j] as f64 - want).abs() < 1e-5,
                    "row {row} column {j}"
                );
            }
        }
        // <rope(x), d> = <x, rope_backward(d)>: backward is the transpose.
        let lhs: f64 = y.iter().zip(&ds).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = xs.iter().zip(&dx).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!(
            (lhs - rhs).abs() < 1e-4 * lhs.abs().max(1.0),
            "{lhs} vs {rhs}"
        );
    }
}
