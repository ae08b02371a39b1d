//! Fused causal attention on the GPU: the forward pass (the output and each query row's
//! log-sum-exp) and its backward, tile by tile in shared memory, without a `[T, T]` buffer.
//!
//! CPU twin: `cpu.rs` beside this file. The operand checks are the calls' in `mod.rs`,
//! which `Backend::run` has run before these launches; only dtypes are checked here. Kernels:
//! `kernels/flash_attention.cu`, listed once in [`KERNELS`].

use crate::device::cuda::backend::ensure_dtype;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::{Error, Result};
use crate::ops::attention::Dims;
use crate::ops::Heads;
use crate::tensor::{DType, Tensor};

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
inventory::submit!(KERNELS);

/// The tensor-core kernels of `kernels/flash_attention_mma.cu` (FlashAttention-2's form),
/// which [`forward`] and [`backward`] run where [`mma_head`] allows.
pub(crate) const MMA_KERNELS: KernelFile = KernelFile {
    name: "flash_attention_mma.cu",
    source: include_str!("../../../kernels/flash_attention_mma.cu"),
    kernels: &[
        "flash_attention_mma_plan",
        "flash_attention_mma_backward_prep_bf16",
        "flash_attention_mma_backward_dq_bf16",
        "flash_attention_mma_forward_d64_wide_bf16",
        "flash_attention_mma_backward_d64_wide_bf16",
        "flash_attention_mma_forward_d64_narrow_bf16",
        "flash_attention_mma_backward_d64_narrow_bf16",
        "flash_attention_mma_forward_d80_wide_bf16",
        "flash_attention_mma_backward_d80_wide_bf16",
        "flash_attention_mma_forward_d80_narrow_bf16",
        "flash_attention_mma_backward_d80_narrow_bf16",
        "flash_attention_mma_forward_d96_wide_bf16",
        "flash_attention_mma_backward_d96_wide_bf16",
        "flash_attention_mma_forward_d96_narrow_bf16",
        "flash_attention_mma_backward_d96_narrow_bf16",
        "flash_attention_mma_forward_d128_wide_bf16",
        "flash_attention_mma_backward_d128_wide_bf16",
        "flash_attention_mma_forward_d128_narrow_bf16",
        "flash_attention_mma_backward_d128_narrow_bf16",
        "flash_attention_mma_backward_prep_f16",
        "flash_attention_mma_backward_dq_f16",
        "flash_attention_mma_forward_d64_wide_f16",
        "flash_attention_mma_backward_d64_wide_f16",
        "flash_attention_mma_forward_d64_narrow_f16",
        "flash_attention_mma_backward_d64_narrow_f16",
        "flash_attention_mma_forward_d80_wide_f16",
        "flash_attention_mma_backward_d80_wide_f16",
        "flash_attention_mma_forward_d80_narrow_f16",
        "flash_attention_mma_backward_d80_narrow_f16",
        "flash_attention_mma_forward_d96_wide_f16",
        "flash_attention_mma_backward_d96_wide_f16",
        "flash_attention_mma_forward_d96_narrow_f16",
        "flash_attention_mma_backward_d96_narrow_f16",
        "flash_attention_mma_forward_d128_wide_f16",
        "flash_attention_mma_backward_d128_wide_f16",
        "flash_attention_mma_forward_d128_narrow_f16",
        "flash_attention_mma_backward_d128_narrow_f16",
    ],
};
inventory::submit!(MMA_KERNELS);

/// Head sizes the tensor-core kernels are built for.
const MMA_HEADS: [usize; 4] = [64, 80, 96, 128];
/// Threads of a tensor-core forward block (`FA2_THREADS`; a backward block has a warp per
/// 16 keys).
const MMA_THREADS: u32 = 128;

/// How the tensor-core kernels of one head size split their work and what shared memory a
/// block takes (`Fa2Fwd` and `Fa2Bwd` in `kernels/flash_attention_mma.cu`, whose
/// `flash_attention_mma_plan` reports them for the test that holds the two together).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MmaPlan {
    /// The kernels' tiling, in their names: `wide` or `narrow`
    /// ([`CudaOptions::narrow_attention`](crate::device::cuda::CudaOptions)).
    tiling: &'static str,
    /// Query rows of a forward block (four warps of one or two 16-row tiles).
    forward_rows: usize,
    /// Dynamic shared memory of a forward block, bytes.
    forward_shared: u32,
    /// Keys of a backward block: a warp's 16 each.
    backward_keys: usize,
    /// Dynamic shared memory of a backward block, bytes.
    backward_shared: u32,
}

impl MmaPlan {
    /// The plan for heads of `hd` columns (one of [`MMA_HEADS`]) in the wide tiling (the
    /// default) or the narrow one.
    fn of(hd: usize, narrow: bool) -> MmaPlan {
        // Shared rows hold whole groups of eight 16-byte chunks.
        let sd = hd.div_ceil(64) * 64;
        // (forward rows, forward keys a step; backward keys, queries a step, buffers)
        let (forward_rows, forward_keys, keys, queries, buffers) = match (narrow, hd <= 64) {
            (false, true) => (128, 64, 128, 64, 2),
            (false, false) => (128, 32, 64, 32, 2),
            (true, true) => (64, 64, 64, 64, 1),
            (true, false) => (64, 64, 64, 16, 1),
        };
        let forward_shared = (forward_rows + 2 * forward_keys) * sd * 2;
        // K and V, the buffers of Q and dO, dSᵀ, the buffers of three statistics a query.
        let backward_shared = (2 * keys * sd + 2 * buffers * queries * sd + keys * queries) * 2
            + buffers * queries * 12;
        MmaPlan {
            tiling: if narrow { "narrow" } else { "wide" },
            forward_rows,
            forward_shared: forward_shared as u32,
            backward_keys: keys,
            backward_shared: backward_shared as u32,
        }
    }

    /// The plan `be` runs heads of `hd` columns with.
    fn on(be: &CudaBackend, hd: usize) -> MmaPlan {
        MmaPlan::of(hd, be.options().narrow_attention)
    }
}

/// The head size whose tensor-core kernels run this call, or `None` for the tiled
/// kernels: bf16 or f16, a head of 64, 80, 96 or 128 columns, a device of compute
/// capability 8.0 or later, every buffer 16-byte aligned, sizes within 32-bit indexing,
/// the shared memory its blocks take ([`MmaPlan`]) within what the device allows, and
/// [`CudaOptions::tiled_attention`](crate::device::cuda::CudaOptions) off.
fn mma_head(be: &CudaBackend, d: &Dims, tensors: &[&Tensor]) -> Result<Option<usize>> {
    let hd = d.hs();
    if be.options().tiled_attention
        || !matches!(tensors[0].dtype(), DType::Bf16 | DType::F16)
        || !MMA_HEADS.contains(&hd)
        || be.compute_capability().0 < 8
        || d.b * d.t * d.w >= i32::MAX as usize
    {
        return Ok(None);
    }
    let plan = MmaPlan::on(be, hd);
    if plan.forward_shared.max(plan.backward_shared) > be.max_shared_bytes() {
        return Ok(None);
    }
    for t in tensors {
        if ptr(t)? % 16 != 0 {
            return Ok(None);
        }
    }
    Ok(Some(hd))
}

/// Threads of a tiled block (`FA_THREADS`: four warps).
const THREADS: u32 = 128;
/// Rows of a block's tile (`FA_BQ`, and the tensor-core kernels' `FA2_BM` and `FA2_BN`):
/// query rows (forward, dQ) or key rows (dK, dV).
const TILE: usize = 64;
/// Output columns of a forward block (`FA_FWD_OC`).
const FORWARD_COLS: usize = 128;
/// Output columns of a backward block (`FA_BWD_OC`).
const BACKWARD_COLS: usize = 64;

/// The most blocks a grid's x dimension holds (`gridDim.x` stops at 2³¹ − 1).
const MAX_GRID_X: usize = (1 << 31) - 1;

/// Blocks of a launch: one per (batch row, head of `heads`, `rows`-row tile of the
/// sequence, chunk of `cols` columns of a head), at most [`MAX_GRID_X`]. The tensor-core
/// kernels take whole heads: `cols` is the head size.
fn blocks(d: &Dims, heads: usize, (rows, cols): (usize, usize), op: &'static str) -> Result<u32> {
    let n = d.b * heads * d.t.div_ceil(rows) * d.hs().div_ceil(cols);
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
    if let Some(hd) = mma_head(be, &d, &[out, qkv])? {
        let plan = MmaPlan::on(be, hd);
        return be.launch_shared(
            &format!(
                "flash_attention_mma_forward_d{hd}_{}_{}",
                plan.tiling,
                qkv.dtype()
            ),
            blocks(&d, heads.n_head, (plan.forward_rows, hd), OP)?,
            MMA_THREADS,
            plan.forward_shared,
            Args::new()
                .ptr(ptr(out)?)
                .ptr(ptr(lse)?)
                .ptr(ptr(qkv)?)
                .i32(d.b as i32)
                .i32(d.t as i32)
                .i32(heads.n_head as i32)
                .i32(heads.n_kv_head as i32)
                .f32(scale(&d))
                .ptr(pos.ptr()?),
        );
    }
    be.launch(
        &format!("flash_attention_forward_{}", qkv.dtype()),
        blocks(&d, heads.n_head, (TILE, FORWARD_COLS), OP)?,
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
    if let Some(hd) = mma_head(be, &d, &[dqkv, &dout, &out, qkv])? {
        return mma_backward(be, hd, &d, dqkv, &dout, &out, lse, qkv, &delta, positions);
    }
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
        blocks(&d, heads.n_kv_head, (TILE, BACKWARD_COLS), OP)?,
        THREADS,
        args()?,
    )?;
    be.launch(
        &format!("flash_attention_backward_dq_{dt}"),
        blocks(&d, heads.n_head, (TILE, BACKWARD_COLS), OP)?,
        THREADS,
        args()?,
    )
}

/// The tensor-core backward: `delta` and the zeroed f32 dQ accumulators (`[B, T, H·D]`, a
/// workspace), dK, dV and the dQ sums over key tiles, then dQ scaled and rounded into
/// `dqkv`.
#[allow(clippy::too_many_arguments)]
fn mma_backward(
    be: &CudaBackend,
    hd: usize,
    d: &Dims,
    dqkv: &mut Tensor,
    dout: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    qkv: &Tensor,
    delta: &Tensor,
    positions: Option<&[u32]>,
) -> Result<()> {
    const OP: &str = "flash_attention_backward";
    let dt = qkv.dtype();
    let heads = d.heads;
    let rows = d.b * d.t * heads.n_head;
    let dq = be.scratch(rows * hd * 4, "flash_attention_backward.dq")?;
    let dims = |a: Args| a.i32(d.b as i32).i32(d.t as i32).i32(heads.n_head as i32);
    be.launch(
        &format!("flash_attention_mma_backward_prep_{dt}"),
        be.grid_rows(rows),
        BLOCK,
        dims(
            Args::new()
                .ptr(ptr(delta)?)
                .ptr(ptr(&dq)?)
                .ptr(ptr(dout)?)
                .ptr(ptr(out)?),
        )
        .i32(hd as i32),
    )?;
    let pos = be.positions(positions)?;
    let plan = MmaPlan::on(be, hd);
    be.launch_shared(
        &format!("flash_attention_mma_backward_d{hd}_{}_{dt}", plan.tiling),
        blocks(d, heads.n_kv_head, (plan.backward_keys, hd), OP)?,
        2 * plan.backward_keys as u32,
        plan.backward_shared,
        dims(
            Args::new()
                .ptr(ptr(&dq)?)
                .ptr(ptr(dqkv)?)
                .ptr(ptr(dout)?)
                .ptr(ptr(lse)?)
                .ptr(ptr(delta)?)
                .ptr(ptr(qkv)?),
        )
        .i32(heads.n_kv_head as i32)
        .f32(scale(d))
        .ptr(pos.ptr()?),
    )?;
    let per_row = d.b * d.t * heads.n_head * hd / 8;
    be.launch(
        &format!("flash_attention_mma_backward_dq_{dt}"),
        be.grid(per_row),
        BLOCK,
        dims(Args::new().ptr(ptr(dqkv)?).ptr(ptr(&dq)?))
            .i32(heads.n_kv_head as i32)
            .i32(hd as i32)
            .f32(scale(d)),
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
            blocks(&dims(MAX_GRID_X), 1, (TILE, 64), "fa").unwrap() as usize,
            MAX_GRID_X
        );
        let e = blocks(&dims(MAX_GRID_X + 1), 1, (TILE, 64), "fa")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("2147483647") && e.contains("smaller batch"),
            "{e}"
        );
    }
    use crate::memory::MemoryCategory;
    use crate::ops::attention;

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

    /// The 32 values `flash_attention_mma_plan` writes, zeroed.
    fn plan_output(be: &CudaBackend) -> Tensor {
        let cat = MemoryCategory::Workspace;
        be.upload(&[0.0; 32], &[32], DType::F32, cat, "plan")
            .unwrap()
    }

    /// `flash_attention_mma_plan`'s arguments: `out` and its length.
    fn plan_args(out: &Tensor) -> Args {
        Args::new().ptr(ptr(out).unwrap()).i32(32)
    }

    /// The backend's copy of each head size's plan (rows a forward block, shared memory of
    /// each direction) is the kernels' own, as `flash_attention_mma_plan` reports it.
    #[test]
    fn the_tensor_core_plan_is_the_kernels_own() {
        let Some(be) = emulated() else { return };
        let out = plan_output(&be);
        be.launch("flash_attention_mma_plan", 1, 32, plan_args(&out))
            .unwrap();
        let got: Vec<u32> = be
            .to_f32(&out)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        for (k, hd) in MMA_HEADS.into_iter().enumerate() {
            for (j, narrow) in [false, true].into_iter().enumerate() {
                let plan = MmaPlan::of(hd, narrow);
                let want = [
                    plan.forward_rows as u32,
                    plan.forward_shared,
                    plan.backward_keys as u32,
                    plan.backward_shared,
                ];
                let at = 8 * k + 4 * j;
                assert_eq!(got[at..at + 4], want, "head {hd}, {}", plan.tiling);
                // Within what every card of compute capability 8.0 or later allows.
                let most = plan.forward_shared.max(plan.backward_shared);
                assert!(most <= 99 << 10, "head {hd}, {}", plan.tiling);
            }
        }
    }

    /// A launch that asks for more shared memory than a block of the device may have is
    /// an error naming the kernel and the limit, not a launch that fails on the device.
    #[test]
    fn a_launch_past_the_shared_memory_limit_is_refused_by_name() {
        let Some(be) = emulated() else { return };
        let out = plan_output(&be);
        let over = be.max_shared_bytes() + 1;
        let args = || plan_args(&out);
        let e = be
            .launch_shared("flash_attention_mma_plan", 1, 32, over, args())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("flash_attention_mma_plan") && e.contains(&format!("at most {}", over - 1)),
            "{e}"
        );
        let most = be.max_shared_bytes();
        be.launch_shared("flash_attention_mma_plan", 1, 32, most, args())
            .unwrap();
    }

    const SHAPES: &[(usize, usize, usize, usize, usize)] = &[
        (2, 70, 2, 2, 16),
        (1, 67, 4, 2, 64),
        (1, 33, 4, 1, 128),
        (2, 19, 4, 1, 20),
        (1, 40, 2, 1, 32),
        (1, 21, 2, 2, 144),
    ];

    /// The tensor-core kernels, in both tilings, against the tiled ones (the same inputs, on
    /// the emulator): output, log-sum-exp and every block of dqkv, for each head size they
    /// are built for, grouped heads, lengths that end inside a tile, and rows of several
    /// documents.
    #[test]
    fn tensor_core_kernels_match_the_tiled_ones() {
        let Some(wide) = emulated() else { return };
        let with = |options| CudaBackend::emulated_with(None, options).unwrap();
        let tiled = with(crate::device::cuda::CudaOptions {
            tiled_attention: true,
            ..Default::default()
        });
        let narrow = with(crate::device::cuda::CudaOptions {
            narrow_attention: true,
            ..Default::default()
        });
        // (B, T, H, KV, D, documents)
        let cases: &[(usize, usize, usize, usize, usize, bool)] = &[
            (2, 130, 4, 2, 64, false),
            (1, 150, 2, 1, 64, true),
            (1, 70, 2, 1, 80, false),
            (1, 81, 3, 3, 96, true),
            (1, 100, 2, 1, 128, false),
            (1, 90, 2, 2, 128, true),
            // Several forward tiles of 128 rows, the last cut short.
            (1, 300, 2, 1, 128, true),
            (1, 260, 2, 2, 64, false),
        ];
        for &(b, t, h, kv, hd, docs) in cases {
            let heads = Heads {
                n_head: h,
                n_kv_head: kv,
                head_dim: hd,
            };
            let (w, c) = (heads.qkv_width(), heads.q_width());
            // Documents of 5, 60, 1 and the rest tokens in row 0; the others one document.
            let pos = docs.then(|| {
                crate::ops::positions::from_document_starts(b, t, |k| [5, 65, 66].contains(&k))
            });
            let cat = MemoryCategory::Activations;
            let d = Dims { b, t, heads, w, c };
            for dt in [DType::Bf16, DType::F16] {
                let run = |be: &CudaBackend| {
                    let up = |v: &[f32], s: &[usize], dt| be.upload(v, s, dt, cat, "x").unwrap();
                    let nan = |s: &[usize], dt| up(&vec![f32::NAN; s.iter().product()], s, dt);
                    let qkv = up(&values(b * t * w, 3, 2.0), &[b, t, w], dt);
                    let dout = up(&values(b * t * c, 4, 1.0), &[b, t, c], dt);
                    let mut out = nan(&[b, t, c], dt);
                    let mut lse = nan(&[b, h, t], DType::F32);
                    forward(be, &mut out, &mut lse, &qkv, heads, pos.as_deref()).unwrap();
                    let mut dqkv = nan(&[b, t, w], dt);
                    backward(
                        be,
                        &mut dqkv,
                        &dout,
                        &out,
                        &lse,
                        &qkv,
                        heads,
                        pos.as_deref(),
                    )
                    .unwrap();
                    let get = |x: &Tensor| be.to_f32(x).unwrap();
                    (get(&out), get(&lse), get(&dqkv))
                };
                let (want_out, want_lse, want_dqkv) = run(&tiled);
                // Both tilings against the one reference.
                for fast in [&wide, &narrow] {
                    let tiling = MmaPlan::on(fast, hd).tiling;
                    let what =
                        format!("{dt} {tiling} B={b} T={t} H={h} KV={kv} D={hd} documents={docs}");
                    let probe = fast.upload(&[0.0; 8], &[8], dt, cat, "p").unwrap();
                    assert_eq!(mma_head(fast, &d, &[&probe]).unwrap(), Some(hd), "{what}");
                    assert_eq!(mma_head(&tiled, &d, &[&probe]).unwrap(), None, "{what}");
                    let (out, lse, dqkv) = run(fast);
                    let e = rel_err(&out, &want_out);
                    assert!(e <= 1e-2, "{what}: out relative error {e:.3e}");
                    let e = rel_err(&lse, &want_lse);
                    assert!(e <= 1e-3, "{what}: lse relative error {e:.3e}");
                    // Each block (queries, keys, values) on its own scale.
                    let blocks = [("dq", 0, c), ("dk", c, c + kv * hd), ("dv", c + kv * hd, w)];
                    for (name, lo, hi) in blocks {
                        let pick = |x: &[f32]| {
                            x.chunks(w)
                                .flat_map(|r| r[lo..hi].to_vec())
                                .collect::<Vec<_>>()
                        };
                        let e = rel_err(&pick(&dqkv), &pick(&want_dqkv));
                        assert!(e <= 2e-2, "{what}: {name} relative error {e:.3e}");
                    }
                }
            }
        }
    }

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
