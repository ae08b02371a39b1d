//! Vectorized inner loops: runtime dispatch to AVX-512 or AVX2 code paths, and fast
//! `exp` the compiler can vectorize.
//!
//! The same Rust source is compiled once per instruction set and the widest the CPU
//! supports runs. Rust never contracts `a * b + c` into a fused multiply-add on its own, so
//! every path rounds identically and results do not depend on the CPU's features.

/// Defines `fn $name(args)` whose body is compiled for AVX-512, for AVX2 + FMA and for the
/// baseline, dispatching at run time to the widest available.
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn inner($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,bmi2")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    inner($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,bmi2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    inner($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the features were detected above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("bmi2")
                {
                    // SAFETY: the features were detected above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            inner($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 · 2²³: adding and subtracting it rounds an f32 to the nearest integer (even on ties).
const ROUNDER: f32 = 12_582_912.0;

/// `eˣ` with a relative error of a few ulp, branch-free so loops over it vectorize.
/// Inputs are clamped to `[-87, 88]` (outputs from about 1.6e-38 to 1.7e38).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let big = x * LOG2E + ROUNDER;
    let n = big - ROUNDER;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor polynomial of degree 7 on |r| <= ln2/2.
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // `big`'s low mantissa bits hold `n` (offset by ROUNDER's own bits): building 2ⁿ from
    // them stays in integer lanes, where `n as i32` (a saturating cast) would not vectorize.
    let scale = f32::from_bits(
        big.to_bits()
            .wrapping_sub(ROUNDER.to_bits())
            .wrapping_add(127)
            << 23,
    );
    p * scale
}

/// Lanes of the partial sums in [`sum`] and [`dot`]: wide enough to fill an AVX-512
/// register, and a fixed order of additions whatever the CPU.
const LANES: usize = 16;

/// Sum of `x` in f32, accumulated in 16 interleaved lanes (vectorizable, deterministic).
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += c[i];
        }
    }
    for (i, v) in rest.iter().enumerate() {
        acc[i] += v;
    }
    reduce(acc)
}

/// `Σ a·b` in f32, accumulated in 16 interleaved lanes.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let full = n / LANES * LANES;
    for (ca, cb) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    for i in full..n {
        acc[i - full] += a[i] * b[i];
    }
    reduce(acc)
}

/// Maximum of `x` (−∞ for an empty slice).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    for (i, v) in rest.iter().enumerate() {
        acc[i] = if *v > acc[i] { *v } else { acc[i] };
    }
    acc.iter()
        .fold(f32::NEG_INFINITY, |m, v| if *v > m { *v } else { m })
}

/// The sum of `N` partial sums (`N` a power of two) pairwise, in a fixed order:
/// `a[i] += a[i + w]` for `w = N/2, ..., 1` (the order the kernels' shuffles and block
/// reductions add in).
#[inline(always)]
pub(crate) fn reduce<const N: usize>(acc: [f32; N]) -> f32 {
    let mut a = acc;
    let mut width = N / 2;
    while width > 0 {
        for i in 0..width {
            a[i] += a[i + width];
        }
        width /= 2;
    }
    a[0]
}

/// Slots of the row sums in [`warp_reduce`]: the CUDA warp-per-row kernels' 32 lanes of 8
/// consecutive elements (common.cuh's warp rows). Element `i` of a row adds into slot
/// `i % ROW_SLOTS`, in order of `i`.
pub(crate) const ROW_SLOTS: usize = 256;

/// The sum of [`ROW_SLOTS`] partial sums in the order of the warp-per-row kernels: each
/// lane's 8 slots pairwise at distances 4, 2, 1, then the 32 lanes at 16, 8, 4, 2, 1.
#[inline(always)]
pub(crate) fn warp_reduce(acc: &[f32; ROW_SLOTS]) -> f32 {
    let mut lanes = [0f32; 32];
    for (l, a) in lanes.iter_mut().zip(acc.chunks_exact(8)) {
        *l = reduce([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
    }
    reduce(lanes)
}

/// `Σ f(x_i)` over a row in the slot order of the warp-per-row kernels: element `i` into
/// slot `i % ROW_SLOTS` in order of `i`, then [`warp_reduce`].
#[inline(always)]
fn row_reduce(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; ROW_SLOTS];
    for chunk in x.chunks(ROW_SLOTS) {
        for (a, v) in acc.iter_mut().zip(chunk) {
            *a += f(*v);
        }
    }
    warp_reduce(&acc)
}

/// Sum of a row `x` in the warp-per-row kernels' order ([`ROW_SLOTS`]).
#[inline(always)]
pub(crate) fn row_sum(x: &[f32]) -> f32 {
    row_reduce(x, |v| v)
}

/// `Σ (x - mean)²` over a row in the warp-per-row kernels' order.
#[inline(always)]
pub(crate) fn row_sum_sq_dev(x: &[f32], mean: f32) -> f32 {
    row_reduce(x, |v| {
        let d = v - mean;
        d * d
    })
}

/// `Σ x²` over a row in the warp-per-row kernels' order.
#[inline(always)]
pub(crate) fn row_sum_sq(x: &[f32]) -> f32 {
    row_reduce(x, |v| v * v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -80.0f32;
        while x < 80.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.01;
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-200.0) >= 0.0 && exp(-200.0) < 1e-37);
    }
}
