//! The dequantizing product: `out (+)= a · op(W) (+ b)` for an NF4 `W`, a block of `W`'s
//! rows at a time.
//!
//! `W` is stored `[rows, cols]`. Each block of rows is dequantized into a buffer of at
//! most [`CHUNK_ELEMENTS`] elements of `a`'s dtype and multiplied at once by the backend's
//! `matmul` (cuBLASLt on the GPU), so the product keeps the tensor cores' speed while no
//! full dequantized weight ever exists:
//! - `op(W) = Wᵀ` (a Hugging Face `nn.Linear`, `[out, in]`): a block of rows is a block of
//!   output columns, `out[:, r0..r1] = a · W[r0..r1]ᵀ`, added into its columns;
//! - `op(W) = W` (GPT-2's `Conv1D`, `[in, out]`, or the input's gradient of an
//!   `nn.Linear`): a block of rows is a block of the inner dimension, `out += a[:, r0..r1]
//!   · W[r0..r1]`.
//!
//! A weight of at most [`CHUNK_ELEMENTS`] elements is one block: one dequantization and
//! the same single product as a float weight.

use crate::device::Backend;
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::ops::linear::product::with_width;
use crate::ops::lora::{add_cols, take_cols};
use crate::tensor::Tensor;

/// Elements of the largest block of an NF4 weight dequantized at once: 8 Mi (16 MiB in
/// bf16). A 4096 × 14336 projection of Llama 3.1 8B is dequantized in 7 blocks.
pub const CHUNK_ELEMENTS: usize = 1 << 23;

/// `out (+)= a · op(W) (+ bias)` (with `accumulate`, added to `out`), where `W` is NF4
/// `[rows, cols]` and `op(W)` is `Wᵀ` when `transposed`: the product [`crate::Backend::matmul`]
/// computes for a float weight, with `W` dequantized to `a`'s dtype a block of rows at a
/// time.
pub fn matmul(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    a: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    transposed: bool,
    accumulate: bool,
) -> Result<()> {
    matmul_in_blocks(be, out, a, w, bias, transposed, accumulate, CHUNK_ELEMENTS)
}

/// [`matmul`] with blocks of at most `max_elements` dequantized elements (at least one
/// row): what the tests use to hold many small blocks to the one-block product.
#[allow(clippy::too_many_arguments)]
pub fn matmul_in_blocks(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    a: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    transposed: bool,
    accumulate: bool,
    max_elements: usize,
) -> Result<()> {
    let (rows, cols) = w.rows_cols();
    let block = (max_elements / cols.max(1)).clamp(1, rows.max(1));
    let dequantized = |r0: usize, n: usize| -> Result<Tensor> {
        let mut t = be.empty(
            &[n, cols],
            a.dtype(),
            MemoryCategory::Workspace,
            &format!("{}.dequantized", w.label()),
        )?;
        super::dequantize(be, &mut t, w, r0 * cols)?;
        Ok(t)
    };
    if block >= rows {
        let wd = dequantized(0, rows)?;
        return be.matmul(out, a, &wd, bias, false, transposed, accumulate);
    }
    if transposed {
        if !accumulate {
            be.fill(out, 0.0)?;
        }
        for r0 in (0..rows).step_by(block) {
            let n = block.min(rows - r0);
            let wd = dequantized(r0, n)?;
            let b = match bias {
                Some(b) => {
                    let mut part =
                        be.empty(&[n], b.dtype(), MemoryCategory::Workspace, b.label())?;
                    take_cols(be, &mut part, b, r0)?;
                    Some(part)
                }
                None => None,
            };
            let mut part = be.empty(
                &with_width(out.shape(), n),
                out.dtype(),
                MemoryCategory::Workspace,
                &format!("{}.block", out.label()),
            )?;
            be.matmul(&mut part, a, &wd, b.as_ref(), false, true, false)?;
            drop(wd);
            add_cols(be, out, r0, &part)?;
        }
    } else {
        for r0 in (0..rows).step_by(block) {
            let n = block.min(rows - r0);
            let wd = dequantized(r0, n)?;
            let mut cols_of_a = be.empty(
                &with_width(a.shape(), n),
                a.dtype(),
                MemoryCategory::Workspace,
                &format!("{}.block", a.label()),
            )?;
            take_cols(be, &mut cols_of_a, a, r0)?;
            let first = r0 == 0;
            be.matmul(
                out,
                &cols_of_a,
                &wd,
                bias.filter(|_| first),
                false,
                false,
                accumulate || !first,
            )?;
        }
    }
    Ok(())
}
