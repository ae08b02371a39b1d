//! Fused causal attention on the GPU: the forward pass (the output and each query row's
//! log-sum-exp) and its backward, tile by tile in shared memory, without a `[T, T]` buffer.
//!
//! CPU twin: `cpu.rs` beside this file. The operand checks are the calls' in `mod.rs`,
//! which `Backend::run` has run before these launches; only dtypes are checked here. Kernels:
//! `kernels/flash_attention.cu`, listed once in [`KERNELS`].

use crate::device::cuda::backend::ensure_dtype;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::device::Heads;
use crate::error::{Error, Result};
use crate::ops::attention::Dims;
use crate::tensor::Tensor;

/// The kernels of `kernels/flash_attention.cu`, named once: the backend launches these
/// names, NVRTC and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "flash_attention.cu",
    source: include_str!("../../../kernels/flash_attention.cu"),
    kernels: &[
        "flash_attention_forward_f32",
        "flash_attention_forward_bf16",
        "flash_attention_backward_delta_f32",
        "flash_attention_backward_delta_bf16",
        "flash_attention_backward_dkv_f32",
        "flash_attention_backward_dkv_bf16",
        "flash_attention_backward_dq_f32",
        "flash_attention_backward_dq_bf16",
        "flash_attention_forward_f16",
        "flash_attention_backward_delta_f16",
        "flash_attention_backward_dkv_f16",
        "flash_attention_backward_dq_f16",
    ],
};

/// Threads of a tiled block (`FA_THREADS`: four warps).
const THREADS: u32 = 128;
/// Rows of a block's tile (`FA_BQ`): query rows (forward, dQ) or key rows (dK, dV).
const TILE: usize = 64;
/// Output columns of a forward block (`FA_FWD_OC`).
const FORWARD_COLS: usize = 128;
/// Output columns of a backward block (`FA_BWD_OC`).
const BACKWARD_COLS: usize = 64;

/// The most blocks a grid's x dimension holds (`gridDim.x` stops at 2³¹ − 1).
const MAX_GRID_X: usize = (1 << 31) - 1;

/// Blocks of a launch: one per (batch row, head of `heads`, 64-row tile of the sequence,
/// chunk of `cols` columns of a head), at most [`MAX_GRID_X`].
fn blocks(d: &Dims, heads: usize, cols: usize, op: &'static str) -> Result<u32> {
    let n = d.b * heads * d.t.div_ceil(TILE) * d.hs().div_ceil(cols);
    match u32::try_from(n) {
        Ok(blocks) if n <= MAX_GRID_X => Ok(blocks),
        _ => Err(Error::shape(
            op,
            format!(
                "{n} blocks do not fit in a grid (at most {MAX_GRID_X}); use a smaller batch \
                 or context"
            ),
        )),
    }
}

fn scale(d: &Dims) -> f32 {
    1.0 / (d.hs() as f32).sqrt()
}

/// `out = softmax(scale · q · kᵀ, causal) · v` per query head, and `lse[b, h, i]` the natural
/// log of the row's sum of `exp(scale · q_i · k_j)`, `j ≤ i`.
pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    lse: &mut Tensor,
    qkv: &Tensor,
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    const OP: &str = "flash_attention";
    ensure_dtype(out, qkv.dtype(), OP)?;
    let d = Dims::of(qkv, heads);
    if out.numel() == 0 {
        return Ok(());
    }
    let pos = be.positions(positions)?;
    be.launch(
        &format!("flash_attention_forward_{}", qkv.dtype()),
        blocks(&d, heads.n_head, FORWARD_COLS, OP)?,
        THREADS,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(lse)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
            .f32(scale(&d))
            .ptr(pos.ptr()?),
    )
}

/// Overwrites all of `dqkv` (queries, keys and values) with the gradient of `forward`'s
/// output, given its gradient `dout`, the output `out` and the `lse` the forward pass wrote.
/// Three launches: `delta_i = dout_i · out_i` (an f32 workspace `[B, H, T]`), dK and dV
/// over key tiles, dQ over query tiles.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    be: &CudaBackend,
    dqkv: &mut Tensor,
    dout: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    qkv: &Tensor,
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    const OP: &str = "flash_attention_backward";
    let d = Dims::of(qkv, heads);
    let dt = qkv.dtype();
    ensure_dtype(dqkv, dt, OP)?;
    if qkv.numel() == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, dt)?;
    let out = be.as_dtype(out, dt)?;
    let rows = d.b * d.t * heads.n_head;
    let delta = be.scratch(rows * 4, "flash_attention_backward.delta")?;
    be.launch(
        &format!("flash_attention_backward_delta_{dt}"),
        be.grid_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(&delta)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(&out)?)
            .i64(d.b)
            .i64(d.t)
            .i64(heads.n_head)
            .i64(heads.head_dim),
    )?;
    let pos = be.positions(positions)?;
    let args = || -> Result<Args> {
        Ok(Args::new()
            .ptr(ptr(dqkv)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(lse)?)
            .ptr(ptr(&delta)?)
            .ptr(ptr(qkv)?)
            .i64(d.b)
            .i64(d.t)
            .i64(heads.n_head)
            .i64(heads.n_kv_head)
            .i64(heads.head_dim)
            .f32(scale(&d))
            .ptr(pos.ptr()?))
    };
    be.launch(
        &format!("flash_attention_backward_dkv_{dt}"),
        blocks(&d, heads.n_kv_head, BACKWARD_COLS, OP)?,
        THREADS,
        args()?,
    )?;
    be.launch(
        &format!("flash_attention_backward_dq_{dt}"),
        blocks(&d, heads.n_head, BACKWARD_COLS, OP)?,
        THREADS,
        args()?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Backend;

    /// A launch beyond `gridDim.x`'s 2³¹ − 1 blocks is an error naming the limit, not a
    /// launch that fails on the device; one just inside it is counted.
    #[test]
    fn grids_stop_at_the_x_dimensions_limit() {
        let heads = Heads {
            n_head: 1,
            n_kv_head: 1,
            head_dim: 64,
        };
        let dims = |b: usize| Dims {
            b,
            t: TILE,
            heads,
            w: heads.qkv_width(),
            c: heads.q_width(),
        };
        assert_eq!(
            blocks(&dims(MAX_GRID_X), 1, 64, "fa").unwrap() as usize,
            MAX_GRID_X
        );
        let e = blocks(&dims(MAX_GRID_X + 1), 1, 64, "fa")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("2147483647") && e.contains("smaller batch"),
            "{e}"
        );
    }
    use crate::memory::MemoryCategory;
    use crate::ops::attention;
    use crate::tensor::DType;

    /// The emulated backend, or `None` where the emulator cannot be built (a failure when
    /// `TRAINKIT_REQUIRE_EMULATOR` is set).
    fn emulated() -> Option<CudaBackend> {
        match CudaBackend::emulated() {
            Ok(be) => Some(be),
            Err(e) if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() => {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}")
            }
            Err(_) => None,
        }
    }

    /// Deterministic values in `[-amp, amp)`.
    fn values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
            })
            .collect()
    }

    /// Max |got − want| over max |want|.
    fn rel_err(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(1e-30f64, |m, w| m.max(w.abs() as f64));
        got.iter().zip(want).fold(0.0, |e, (g, w)| {
            if g.is_finite() {
                e.max((*g as f64 - *w as f64).abs() / scale)
            } else {
                f64::INFINITY
            }
        })
    }

    /// Fused against materialized on the same backend, forward and backward, and the
    /// log-sum-exp against a direct computation in f64.
    fn compare(be: &CudaBackend, shape: (usize, usize, usize, usize, usize), dt: DType) {
        let (b, t, h, kv, hd) = shape;
        let heads = Heads {
            n_head: h,
            n_kv_head: kv,
            head_dim: hd,
        };
        let (w, c) = (heads.qkv_width(), heads.q_width());
        let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
        let cat = MemoryCategory::Activations;
        let up = |v: &[f32], s: &[usize], dt: DType| be.upload(v, s, dt, cat, "x").unwrap();
        let nan = |s: &[usize], dt: DType| up(&vec![f32::NAN; s.iter().product()], s, dt);
        let qkv = up(&values(b * t * w, 1, 1.5), &[b, t, w], dt);
        let dout = up(&values(b * t * c, 2, 1.0), &[b, t, c], dt);

        // Materialized.
        let sq = [b, h, t, t];
        let (mut scores, mut probs) = (nan(&sq, dt), nan(&sq, dt));
        let mut want_out = nan(&[b, t, c], dt);
        attention::scores(be, &mut scores, &qkv, heads).unwrap();
        attention::softmax(be, &mut probs, &scores).unwrap();
        attention::values(be, &mut want_out, &probs, &qkv, heads).unwrap();
        let (mut dprobs, mut dscores) = (nan(&sq, dt), nan(&sq, dt));
        let mut want_dqkv = nan(&[b, t, w], dt);
        attention::values_backward(be, &mut dprobs, &mut want_dqkv, &dout, &probs, &qkv, heads)
            .unwrap();
        attention::softmax_backward(be, &mut dscores, &dprobs, &probs).unwrap();
        attention::scores_backward(be, &mut want_dqkv, &dscores, &qkv, heads).unwrap();

        // Fused.
        let mut out = nan(&[b, t, c], dt);
        let mut lse = nan(&[b, h, t], DType::F32);
        forward(be, &mut out, &mut lse, &qkv, heads, None).unwrap();
        let mut dqkv = nan(&[b, t, w], dt);
        backward(be, &mut dqkv, &dout, &out, &lse, &qkv, heads, None).unwrap();

        let what = format!("{dt} B={b} T={t} H={h} KV={kv} D={hd}");
        let get = |x: &Tensor| be.to_f32(x).unwrap();
        let e = rel_err(&get(&out), &get(&want_out));
        assert!(e <= tol, "{what}: out relative error {e:.3e}");
        let e = rel_err(&get(&dqkv), &get(&want_dqkv));
        assert!(e <= tol, "{what}: dqkv relative error {e:.3e}");

        let x = get(&qkv);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut want_lse = vec![0f32; b * h * t];
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..t {
                    let q = &x[(bi * t + i) * w + heads.q_col(hi)..][..hd];
                    let dots: Vec<f64> = (0..=i)
                        .map(|j| {
                            let k = &x[(bi * t + j) * w + heads.k_col(hi)..][..hd];
                            scale
                                * q.iter()
                                    .zip(k)
                                    .map(|(a, b)| *a as f64 * *b as f64)
                                    .sum::<f64>()
                        })
                        .collect();
                    let m = dots.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = dots.iter().map(|s| (s - m).exp()).sum();
                    want_lse[(bi * h + hi) * t + i] = (m + sum.ln()) as f32;
                }
            }
        }
        let e = rel_err(&get(&lse), &want_lse);
        assert!(e <= tol, "{what}: lse relative error {e:.3e}");
    }

    const SHAPES: &[(usize, usize, usize, usize, usize)] = &[
        (2, 70, 2, 2, 16),
        (1, 67, 4, 2, 64),
        (1, 33, 4, 1, 128),
        (2, 19, 4, 1, 20),
        (1, 40, 2, 1, 32),
        (1, 21, 2, 2, 144),
    ];

    #[test]
    fn flash_attention_matches_the_materialized_path_f32() {
        let Some(be) = emulated() else { return };
        for &s in SHAPES {
            compare(&be, s, DType::F32);
        }
    }

    #[test]
    fn flash_attention_matches_the_materialized_path_bf16() {
        let Some(be) = emulated() else { return };
        for &s in SHAPES {
            compare(&be, s, DType::Bf16);
        }
    }
}
