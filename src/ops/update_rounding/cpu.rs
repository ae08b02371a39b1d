//! The CPU twin of `kernels/update_rounding.cu`, bit for bit.

use super::UpdateRounding;
use crate::device::cpu::{read, write};
use crate::rng::counter_bits;
use crate::tensor::{Storage, Tensor};
use half::bf16;
use rayon::prelude::*;

/// `x` rounded to bf16 stochastically with the random bits of element `i` of stream `key`:
/// up with probability equal to its distance from the bf16 below (in units of the gap),
/// so the expected result is `x`. Not-finite values round to nearest.
pub(crate) fn stochastic(x: f32, key: u64, i: u64) -> bf16 {
    if !x.is_finite() {
        return bf16::from_f32(x);
    }
    let h = counter_bits(key, i);
    let bits = x.to_bits().wrapping_add((h >> 48) as u32);
    bf16::from_bits((bits >> 16) as u16)
}

/// The bf16 elements of a checked host tensor.
fn bf16s(t: &Tensor) -> &[bf16] {
    match t.storage() {
        Storage::Bf16(v) => v,
        _ => &[],
    }
}

/// The bf16 elements of a checked host tensor, to overwrite.
fn bf16s_mut(t: &mut Tensor) -> &mut [bf16] {
    match t.storage_mut() {
        Storage::Bf16(v) => v,
        _ => &mut [],
    }
}

pub(crate) fn expand(master: &mut Tensor, w: &Tensor, comp: Option<&Tensor>) {
    let (w, comp) = (bf16s(w), comp.map(bf16s));
    write(master, false, |m| {
        m.par_iter_mut().enumerate().for_each(|(i, m)| {
            let mut v = w[i].to_f32();
            if let Some(c) = comp {
                v += c[i].to_f32();
            }
            *m = v;
        })
    });
}

pub(crate) fn round(
    w: &mut Tensor,
    comp: Option<&mut Tensor>,
    master: &Tensor,
    mode: UpdateRounding,
    key: u64,
) {
    let m = read(master);
    let w = bf16s_mut(w);
    let r = |i: usize, x: f32| match mode {
        UpdateRounding::Stochastic => stochastic(x, key, i as u64),
        _ => bf16::from_f32(x),
    };
    match comp {
        Some(c) if mode == UpdateRounding::Kahan => {
            let c = bf16s_mut(c);
            w.par_iter_mut()
                .zip(c.par_iter_mut())
                .enumerate()
                .for_each(|(i, (w, c))| {
                    *w = r(i, m[i]);
                    let d = m[i] - w.to_f32();
                    *c = bf16::from_f32(if d.is_finite() { d } else { 0.0 });
                });
        }
        _ => w
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, w)| *w = r(i, m[i])),
    }
}
