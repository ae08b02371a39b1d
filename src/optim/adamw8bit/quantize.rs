//! Block-wise 8-bit quantization with a dynamic (non-linear) code, after Dettmers' dynamic
//! tree quantization as used by 8-bit optimizers: a value is stored as one byte, the index
//! of the nearest of 256 code values in [-1, 1] (signed) or [0, 1] (unsigned), times one
//! f32 absolute maximum per block of [`QUANT_BLOCK`] elements.
//!
//! The code spends its bytes on seven decades of magnitude: the decade
//! `[10^(d−7), 10^(d−6))` (d = 0 … 6) holds the midpoints of `n_d` equal steps from 0.1 to 1
//! times `10^(d−6)`, with `n_d = 2^d` in the signed code (127 positive values, their
//! negatives, 0 and 1) and `n_d = 2^(d+1)` in the unsigned one (254 values, 0 and 1). So
//! the relative precision is about 1% near the block's maximum and values down to a
//! millionth of it keep one significant digit, where a linear code would round them to 0.
//!
//! Every value is computed from integers with the same few f32 operations in
//! [`code_value`] and in `kernels/adamw8bit.cu`, each correctly rounded, so both twins
//! build the same table bit for bit; [`quantize`] is a fixed binary search, also spelled
//! the same in both.

/// Elements per quantization block (one absolute maximum each).
pub const QUANT_BLOCK: usize = 256;

/// The powers of ten of the seven decades, as f32 literals (the kernel spells the same).
const DECADES: [f32; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];

/// The `j`-th of the `n` values of decade `d`: the midpoint of the `j`-th of `n` equal
/// steps between 0.1 and 1, times the decade's power of ten.
fn decade_value(d: u32, j: u32, n: u32) -> f32 {
    DECADES[d as usize] * (0.1f32 + 0.9f32 * ((2 * j + 1) as f32 / (2 * n) as f32))
}

/// `floor(log2(x))` for `x >= 1`.
fn log2_floor(x: u32) -> u32 {
    31 - x.leading_zeros()
}

/// The value of code `index`, in ascending order of index: signed codes are the 127
/// negative values (most negative first), 0 (index 127), the 127 positive values and 1
/// (index 255); unsigned codes are 0, the 254 positive values and 1.
pub fn code_value(signed: bool, index: u8) -> f32 {
    let i = index as u32;
    if i == 255 {
        return 1.0;
    }
    if signed {
        if i == 127 {
            return 0.0;
        }
        // The positive rank r: decade d = floor(log2(r + 1)) holds ranks 2^d − 1 … 2^(d+1) − 2.
        let (r, sign) = if i > 127 {
            (i - 128, 1.0)
        } else {
            (126 - i, -1.0)
        };
        let d = log2_floor(r + 1);
        sign * decade_value(d, r + 1 - (1 << d), 1 << d)
    } else {
        if i == 0 {
            return 0.0;
        }
        // Rank r = i − 1: decade d = floor(log2(r + 2)) − 1 holds ranks 2^(d+1) − 2 … 2^(d+2) − 3.
        let r = i - 1;
        let d = log2_floor(r + 2) - 1;
        decade_value(d, r + 2 - (2 << d), 2 << d)
    }
}

/// The 256 values of the signed (`true`) or unsigned code, ascending.
pub fn code_table(signed: bool) -> [f32; 256] {
    std::array::from_fn(|i| code_value(signed, i as u8))
}

/// The index of the code value nearest to `x` (a value already divided by its block's
/// absolute maximum): ties go to the lower value, and in the unsigned code a positive
/// value never rounds to 0 (a second moment of 0 would turn the next update into
/// `m / eps`). NaN gives index 0.
#[inline]
pub fn quantize(table: &[f32; 256], signed: bool, x: f32) -> u8 {
    let mut lo = 0usize;
    for step in [128, 64, 32, 16, 8, 4, 2, 1] {
        if table[lo + step] <= x {
            lo += step;
        }
    }
    if lo < 255 && table[lo + 1] - x < x - table[lo] {
        lo += 1;
    }
    if !signed && lo == 0 && x > 0.0 {
        lo = 1;
    }
    lo as u8
}

/// The index of 0 in the signed (`true`) or unsigned code.
pub const fn zero_code(signed: bool) -> u8 {
    if signed {
        127
    } else {
        0
    }
}

/// Quantizes `values` (one block) into `codes` with their absolute maximum, which it
/// returns; a block of zeros gets the zero code and an absolute maximum of 0.
pub fn quantize_block(table: &[f32; 256], signed: bool, values: &[f32], codes: &mut [u8]) -> f32 {
    let absmax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
    for (c, v) in codes.iter_mut().zip(values) {
        *c = if absmax == 0.0 {
            zero_code(signed)
        } else {
            quantize(table, signed, v / absmax)
        };
    }
    absmax
}

/// The values of one block: `table[code] · absmax`.
pub fn dequantize_block(table: &[f32; 256], codes: &[u8], absmax: f32, out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(codes) {
        *o = table[*c as usize] * absmax;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn the_codes_are_ascending_with_zero_and_one() {
        for signed in [true, false] {
            let t = code_table(signed);
            assert!(t.windows(2).all(|w| w[0] < w[1]), "signed={signed}");
            assert_eq!(t[zero_code(signed) as usize], 0.0);
            assert_eq!(t[255], 1.0);
            assert!(t[1] > 0.0 || signed);
            // The smallest magnitude is in the lowest decade.
            let smallest = t.iter().filter(|v| **v > 0.0).fold(1f32, |a, b| a.min(*b));
            assert!((1e-7..1e-6).contains(&smallest), "{smallest}");
        }
        let s = code_table(true);
        for i in 0..127 {
            assert_eq!(
                s[i],
                -s[254 - i],
                "the negative codes mirror the positive ones"
            );
        }
        assert_eq!(s[0], -s[254]);
    }

    #[test]
    fn quantize_picks_the_nearest_code() {
        let mut rng = Rng::new(3);
        for signed in [true, false] {
            let t = code_table(signed);
            for k in 0..20_000 {
                let u = rng.uniform() as f32;
                // Values over every decade, and exact codes.
                let mag = if k % 3 == 0 { u } else { 10f32.powf(-7.0 * u) };
                let x = if signed && k % 2 == 1 { -mag } else { mag };
                let x = if k % 97 == 0 { t[k % 256] } else { x };
                if !signed && x < 0.0 {
                    continue;
                }
                let q = quantize(&t, signed, x) as usize;
                let best = t
                    .iter()
                    .map(|c| (c - x).abs())
                    .fold(f32::INFINITY, f32::min);
                let floor_to_smallest = !signed && q == 1 && x > 0.0 && x < t[1];
                assert!(
                    (t[q] - x).abs() == best || floor_to_smallest,
                    "x={x} got code {q} = {} (best distance {best})",
                    t[q]
                );
            }
        }
    }

    /// Round trip of random blocks: above a tenth of the block's maximum a value comes back
    /// within half a code step (0.71% of the maximum for the signed code, 0.36% for the
    /// unsigned one), and within 30% of itself down to 1e-4 of the maximum.
    #[test]
    fn round_trip_error_is_within_half_a_code_step() {
        let mut rng = Rng::new(11);
        for signed in [true, false] {
            let t = code_table(signed);
            let top_step = if signed { 0.9 / 64.0 } else { 0.9 / 128.0 };
            for block in 0..50 {
                let scale = 10f32.powi(block % 9 - 6);
                let values: Vec<f32> = (0..QUANT_BLOCK)
                    .map(|_| {
                        let v = rng.normal() as f32 * scale;
                        if signed {
                            v
                        } else {
                            v * v
                        }
                    })
                    .collect();
                let mut codes = vec![0u8; QUANT_BLOCK];
                let absmax = quantize_block(&t, signed, &values, &mut codes);
                let mut back = vec![0f32; QUANT_BLOCK];
                dequantize_block(&t, &codes, absmax, &mut back);
                for (v, b) in values.iter().zip(&back) {
                    let err = (v - b).abs();
                    let rel = v.abs() / absmax;
                    if rel >= 0.1 {
                        assert!(
                            err <= (top_step / 2.0 + 1e-6) * absmax,
                            "{v} -> {b} (absmax {absmax})"
                        );
                    }
                    if rel >= 1e-4 {
                        assert!(err <= 0.3 * v.abs(), "{v} -> {b} (absmax {absmax})");
                    }
                }
                // The maximum comes back exactly when positive (1 is a code, -1 is not).
                let back_max = back.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert!((back_max - absmax).abs() <= top_step * absmax);
                let positive_max = values.contains(&absmax);
                let back_top = back.iter().fold(0f32, |a, v| a.max(*v));
                assert_eq!(back_top == absmax, positive_max);
            }
        }
        let mut codes = [9u8; 4];
        assert_eq!(
            quantize_block(&code_table(true), true, &[0.0; 4], &mut codes),
            0.0
        );
        assert_eq!(codes, [127; 4]);
    }
}
