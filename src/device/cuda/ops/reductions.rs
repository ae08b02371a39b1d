//! Reductions: the sum of squares (one tensor, or all gradients with one read back),
//! accumulated in f64 in two passes. The step's gradient guard launches the `grad_guard`
//! kernel of the same file over these partial sums (`src/optim/guard/cuda.rs`).
//!
//! CPU twin: `src/device/cpu/elementwise.rs` (`sum_squares`). Kernels: `kernels/reductions.cu`,
//! listed once in [`KERNELS`].

use super::super::backend::{ptr, CudaBackend, BLOCK};
use super::super::gpu::Args;
use super::super::kernels::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/reductions.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "reductions.cu",
    source: include_str!("../../../../kernels/reductions.cu"),
    kernels: &[
        "sum_squares_partial_f32",
        "sum_squares_partial_bf16",
        "sum_squares_finish",
        "grad_guard",
        "sum_squares_partial_f16",
        "sum_squares_multi_f32",
        "sum_squares_multi_bf16",
        "sum_squares_multi_f16",
    ],
};
inventory::submit!(KERNELS);

/// Tensors per `sum_squares_multi_*` launch (`TK_SQUARES_TENSORS` in kernels/reductions.cu).
const MULTI_TENSORS: usize = 32;

/// The kernels' `SquaresTable` for `entries` (pointer, elements, first slot, grid; at most
/// [`MULTI_TENSORS`]), as the launch passes it by value: four 8-byte fields per tensor,
/// then the count.
fn squares_table(entries: &[[u64; 4]]) -> Vec<u8> {
    let mut b = Vec::with_capacity(MULTI_TENSORS * 32 + 8);
    for i in 0..MULTI_TENSORS {
        for field in entries.get(i).copied().unwrap_or([0; 4]) {
            b.extend(field.to_le_bytes());
        }
    }
    b.extend((entries.len() as u64).to_le_bytes());
    b
}

/// The f64 partial sums of squares of every tensor of `xs` in one workspace buffer (one
/// per block of each tensor's grid, the tensors' one after another), and each tensor's
/// grid (0 for an empty one): how many partials it left.
pub(crate) fn square_partials(
    be: &CudaBackend,
    xs: &[&Tensor],
    label: &str,
) -> Result<(Tensor, Vec<u32>)> {
    let grids: Vec<u32> = xs
        .iter()
        .map(|x| {
            if x.numel() == 0 {
                0
            } else {
                be.grid(x.numel())
            }
        })
        .collect();
    let slots: usize = grids.iter().map(|&g| g as usize).sum();
    let partial = be.scratch(slots.max(1) * 8, label)?;
    let base = ptr(&partial)?;
    // Each tensor's partials at its slots, in the order of `xs`; the tensors of one dtype
    // MULTI_TENSORS to a launch, each block as its own tensor's launch would run it.
    let mut groups: Vec<(String, Vec<[u64; 4]>)> = Vec::new();
    let mut at = 0u64;
    for (x, &grid) in xs.iter().zip(&grids) {
        if grid == 0 {
            continue;
        }
        let kernel = format!("sum_squares_multi_{}", x.dtype());
        let entry = [ptr(x)?, x.numel() as u64, at, u64::from(grid)];
        match groups.iter_mut().find(|(k, _)| *k == kernel) {
            Some((_, entries)) => entries.push(entry),
            None => groups.push((kernel, vec![entry])),
        }
        at += u64::from(grid);
    }
    for (kernel, entries) in &groups {
        for part in entries.chunks(MULTI_TENSORS) {
            let blocks: u64 = part.iter().map(|e| e[3]).sum();
            let blocks = u32::try_from(blocks).map_err(|_| {
                crate::error::Error::config(
                    "sum_squares",
                    format!("{blocks} blocks do not fit one launch"),
                )
            })?;
            be.launch(
                kernel,
                blocks,
                BLOCK,
                Args::new().ptr(base).bytes(&squares_table(part)),
            )?;
        }
    }
    Ok((partial, grids))
}

pub(crate) fn sum_squares(be: &CudaBackend, x: &Tensor) -> Result<f64> {
    let n = x.numel();
    if n == 0 {
        return Ok(0.0);
    }
    let grid = be.grid(n);
    let partial = be.scratch(grid as usize * 8, "sum_squares.partial")?;
    let total = be.scratch(8, "sum_squares.total")?;
    be.launch(
        &format!("sum_squares_partial_{}", x.dtype()),
        grid,
        BLOCK,
        Args::new().ptr(ptr(&partial)?).ptr(ptr(x)?).i64(n),
    )?;
    be.launch(
        "sum_squares_finish",
        1,
        32,
        Args::new()
            .ptr(ptr(&total)?)
            .ptr(ptr(&partial)?)
            .i64(grid as usize),
    )?;
    let mut bytes = [0u8; 8];
    be.gpu.download(&mut bytes, ptr(&total)?)?;
    Ok(f64::from_le_bytes(bytes))
}

pub(crate) fn sum_squares_each(be: &CudaBackend, xs: &[&Tensor]) -> Result<Vec<f64>> {
    // One partial per block of every tensor in one buffer, each tensor's partials summed
    // by the finishing kernel `sum_squares` runs, and one read back of all the totals.
    let (partial, grids) = square_partials(be, xs, "sum_squares.partial")?;
    let totals = be.scratch(xs.len().max(1) * 8, "sum_squares.totals")?;
    let (mut slot, out, base) = (0u64, ptr(&totals)?, ptr(&partial)?);
    for (k, &grid) in grids.iter().enumerate() {
        let grid = u64::from(grid);
        be.launch(
            "sum_squares_finish",
            1,
            32,
            Args::new()
                .ptr(out + 8 * k as u64)
                .ptr(base + 8 * slot)
                .i64(grid as usize),
        )?;
        slot += grid;
    }
    let mut bytes = vec![0u8; xs.len() * 8];
    if !bytes.is_empty() {
        be.gpu.download(&mut bytes, out)?;
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect())
}

pub(crate) fn sum_squares_all(be: &CudaBackend, xs: &[&Tensor]) -> Result<f64> {
    // One partial per block of every tensor in one buffer, one finishing sum over all
    // of them, and one read back.
    let (partial, grids) = square_partials(be, xs, "sum_squares.partial")?;
    let slots: usize = grids.iter().map(|&g| g as usize).sum();
    if slots == 0 {
        return Ok(0.0);
    }
    let total = be.scratch(8, "sum_squares.total")?;
    be.launch(
        "sum_squares_finish",
        1,
        32,
        Args::new().ptr(ptr(&total)?).ptr(ptr(&partial)?).i64(slots),
    )?;
    let mut bytes = [0u8; 8];
    be.gpu.download(&mut bytes, ptr(&total)?)?;
    Ok(f64::from_le_bytes(bytes))
}
