//! Rotary position embedding of the queries and keys of a fused projection, forward and
//! backward (the same kernel turning the other way).
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/rope.cu`, listed once in [`KERNELS`].

use crate::device::cpu::ensure;
use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::ops::Heads;
use crate::tensor::Tensor;

/// The most frequencies the kernel takes (`TK_ROPE_MAX_PAIRS` in kernels/rope.cu): heads
/// up to 512 wide.
const MAX_PAIRS: usize = 256;

/// The kernels of `kernels/rope.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "rope.cu",
    source: include_str!("../../../kernels/rope.cu"),
    kernels: &["rope_f32", "rope_bf16", "rope_f16"],
};
inventory::submit!(KERNELS);

/// Turns the query and key heads of `x` into `out` by `sign` times each angle.
#[allow(clippy::too_many_arguments)]
fn rotate(
    be: &CudaBackend,
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
    sign: f32,
    op: &'static str,
) -> Result<()> {
    let (t, w) = match *x.shape() {
        [_, t, w] => (t, w),
        _ => (0, 0),
    };
    let dt = x.dtype();
    ensure_dtype(out, dt, op)?;
    let rows = x.numel().checked_div(w).unwrap_or(0);
    if rows * w == 0 {
        return Ok(());
    }
    // The frequencies (D/2 values) travel with the launch, by value: nothing is uploaded.
    let mut freq = [0f32; MAX_PAIRS];
    ensure(inv_freq.len() <= MAX_PAIRS, op, || {
        format!(
            "{} rotary frequencies (heads {} wide); the CUDA kernel takes at most {MAX_PAIRS} \
             (heads up to {} wide)",
            inv_freq.len(),
            2 * inv_freq.len(),
            2 * MAX_PAIRS
        )
    })?;
    freq[..inv_freq.len()].copy_from_slice(inv_freq);
    let bytes: Vec<u8> = freq.iter().flat_map(|f| f.to_le_bytes()).collect();
    let pos = be.positions(positions)?;
    // A thread per row and 8 pairs of a head (all of the row's heads), then per row and 8
    // value columns.
    let rotated = heads.q_width() + heads.kv_width();
    let per_row = (heads.head_dim / 2)
        .div_ceil(8)
        .max(w.saturating_sub(rotated).div_ceil(8));
    be.launch(
        &format!("rope_{dt}"),
        be.grid(rows * per_row),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(x)?)
            .bytes(&bytes)
            .i64(rows)
            .i64(t)
            .i64(w)
            .i64(rotated)
            .i64(heads.head_dim)
            .f32(sign)
            .ptr(pos.ptr()?),
    )
}

pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    rotate(be, out, x, inv_freq, heads, positions, 1.0, "rope")
}

pub(crate) fn backward(
    be: &CudaBackend,
    dx: &mut Tensor,
    dout: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    rotate(
        be,
        dx,
        dout,
        inv_freq,
        heads,
        positions,
        -1.0,
        "rope_backward",
    )
}
