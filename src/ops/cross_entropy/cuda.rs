//! Cross-entropy per row, optionally writing the gradient over the logits; the losses
//! stay on the device.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/cross_entropy.cu`, listed once in
//! [`KERNELS`].

use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/cross_entropy.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "cross_entropy.cu",
    source: include_str!("../../../kernels/cross_entropy.cu"),
    kernels: &[
        "cross_entropy_f32",
        "cross_entropy_bf16",
        "cross_entropy_f16",
    ],
};
inventory::submit!(KERNELS);

/// The rows of `logits` against targets `start..` of `all` (checked by the caller). The
/// whole list is uploaded once and kept while the calls ask for the same list (the chunks
/// of one loss), each chunk reading its rows of it.
pub(crate) fn forward(
    be: &CudaBackend,
    logits: &mut Tensor,
    all: &[u32],
    start: usize,
    vocab: usize,
    grad_scale: Option<f32>,
    losses: &mut Tensor,
) -> Result<()> {
    let (rows, vp) = logits.rows_cols();
    if rows == 0 {
        return Ok(());
    }
    let kept = be.kept_u32(all, "cross_entropy.targets")?;
    let targets = ptr(&kept)? + 4 * start as u64;
    // One block of BLOCK (the kernel's TK_CE_LANES) threads per row, with few enough rows
    // in flight that each row's second and third readings come from the L2 cache.
    be.launch(
        &format!("cross_entropy_{}", logits.dtype()),
        be.grid_cached_rows(rows, vp * logits.dtype().size()),
        BLOCK,
        Args::new()
            .ptr(ptr(logits)?)
            .ptr(ptr(losses)?)
            .ptr(targets)
            .i64(rows)
            .i64(vp)
            .i64(vocab)
            .f32(grad_scale.unwrap_or(0.0))
            .i32(grad_scale.is_some() as i32),
    )
}

/// The kernels of `kernels/cross_entropy.cu` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::tensor::DType;
    use crate::Rng;

    #[test]
    fn cross_entropy_matches_the_cpu() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        // Rows of 700 logits, of which the first 611 are the vocabulary (element by
        // element: 700 is no multiple of 8), and of 5000 with a vocabulary of 4999 (16-byte
        // accesses: three trips of 2048 columns, the last one partial, its last chunk of 8
        // part padding).
        for (rows, vp, vocab) in [(23usize, 700usize, 611usize), (5, 5000, 4999)] {
            let logits_in = random(rows * vp, 3.0, 50);
            let mut rng = Rng::new(51);
            let mut targets: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
            // A target in the last, partial chunk.
            targets[0] = vocab as u32 - 1;
            for d in DTYPES {
                for grad_scale in [None, Some(0.25f32)] {
                    // The losses are added to what is there: start from earlier values.
                    let before = random(rows, 2.0, 52);
                    let mut logits_cpu = upload(&be, &logits_in, &[rows, vp], d);
                    let mut losses_cpu = upload(&be, &before, &[rows], DType::F32);
                    crate::ops::cross_entropy::forward(
                        &be,
                        &mut logits_cpu,
                        &targets,
                        vocab,
                        grad_scale,
                        &mut losses_cpu,
                    )
                    .unwrap();
                    let want = be.to_f32(&losses_cpu).unwrap();
                    let mut logits = Buf::new(&logits_in, d);
                    let mut losses = before.clone();
                    let a = Args::new()
                        .buf(&mut logits)
                        .ptr(&mut losses)
                        .ptr(&mut targets)
                        .arg(rows as i64)
                        .arg(vp as i64)
                        .arg(vocab as i64)
                        .arg(grad_scale.unwrap_or(1.0))
                        .arg(grad_scale.is_some() as i32);
                    launch(emu, &format!("cross_entropy_{}", suffix(d)), 2, 256, 0, a).unwrap();
                    // logf against the host's ln may differ in the last bits of a loss.
                    for (row, (got, want)) in losses.iter().zip(&want).enumerate() {
                        assert!(
                            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                            "{d:?} row {row}: loss {got} against {want}"
                        );
                    }
                    let logits_want = be.to_f32(&logits_cpu).unwrap();
                    assert_bitwise("logits", &logits.values(), &logits_want);
                }
            }
        }
    }
}
