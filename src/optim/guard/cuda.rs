//! The step's gradient guard on the GPU: one partial sum of squares per block of every
//! gradient (`sum_squares_partial_*`), then one block that adds them and the losses and
//! writes the record, all in f64; nothing is read back.
//!
//! CPU twin: `cpu.rs` beside this file. Kernel: `grad_guard` in `kernels/reductions.cu`,
//! listed in that file's `KERNELS` (`src/device/cuda/ops/reductions.rs`).

use crate::device::cuda::ops::reductions::square_partials;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend};
use crate::error::Result;
use crate::tensor::Tensor;

pub(crate) fn grad_guard(
    be: &CudaBackend,
    record: &mut Tensor,
    grads: &[&Tensor],
    losses: &Tensor,
    max_norm: f32,
    loss_scale: f32,
) -> Result<()> {
    // One partial per block of every gradient in one buffer, then one block that adds
    // them and the losses and writes the record: nothing is read back.
    let (partial, grids) = square_partials(be, grads, "grad_guard.partial")?;
    let slots: usize = grids.iter().map(|&g| g as usize).sum();
    be.launch(
        "grad_guard",
        1,
        32,
        Args::new()
            .ptr(ptr(record)?)
            .ptr(ptr(&partial)?)
            .i64(slots)
            .ptr(ptr(losses)?)
            .i64(losses.numel())
            .f32(max_norm)
            .f32(loss_scale),
    )
}

/// The kernels of `kernels/reductions.cu (the guard's)` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::tensor::{DType, Tensor};

    #[test]
    fn grad_guard_matches_the_cpu() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        let grads = [
            random(3000, 0.5, 70),
            random(17, 4.0, 71),
            random(1025, 0.01, 72),
        ];
        let losses: Vec<f32> = random(300, 1.0, 73).iter().map(|l| l.abs() * 5.0).collect();
        // Clipping on and off, a loss scale, and non-finite gradients and losses.
        let cases = [
            (1.0f32, 1.0f32, None),
            (0.0, 1.0, None),
            (1e6, 1.0, None),
            (1.0, 1024.0, None),
            (1.0, 1.0, Some((0usize, f32::NAN))),
            (1.0, 1.0, Some((1, f32::INFINITY))),
            (1.0, 1.0, Some((3, f32::NAN))),
        ];
        for (max_norm, loss_scale, poison) in cases {
            let mut gs = grads.clone();
            let mut ls = losses.clone();
            match poison {
                Some((3, v)) => ls[7] = v,
                Some((i, v)) => gs[i][5] = v,
                None => {}
            }
            let tensors: Vec<Tensor> = gs
                .iter()
                .map(|g| upload(&be, g, &[g.len()], DType::F32))
                .collect();
            let refs: Vec<&Tensor> = tensors.iter().collect();
            let loss_t = upload(&be, &ls, &[ls.len()], DType::F32);
            let mut record = zeros(&be, &[3], DType::F32);
            crate::optim::guard::grad_guard(&be, &mut record, &refs, &loss_t, max_norm, loss_scale)
                .unwrap();
            let want = be.to_f32(&record).unwrap();
            // The device: one partial per block of every gradient, then the guard.
            let blocks = 3u32;
            let mut partial = vec![f64::NAN; blocks as usize * gs.len()];
            for (i, g) in gs.iter_mut().enumerate() {
                let n = g.len() as i64;
                let at = partial[i * blocks as usize..].as_mut_ptr();
                let a = Args::new().arg(at).ptr(g).arg(n);
                launch(emu, "sum_squares_partial_f32", blocks, 256, 0, a).unwrap();
            }
            let mut got = [f32::NAN; 3];
            let a = Args::new()
                .ptr(&mut got)
                .ptr(&mut partial)
                .arg(blocks as i64 * gs.len() as i64)
                .ptr(&mut ls)
                .arg(ls.len() as i64)
                .arg(max_norm)
                .arg(loss_scale);
            launch(emu, "grad_guard", 1, 32, 0, a).unwrap();
            let what = format!("max_norm {max_norm}, loss scale {loss_scale}, {poison:?}");
            if poison.is_some() {
                assert!(
                    got[0].is_nan() && want[0].is_nan(),
                    "{what}: {got:?} {want:?}"
                );
                continue;
            }
            // The f64 sums differ only in their order: equal once rounded to f32, but for
            // a rare last bit.
            for (i, name) in ["scale", "norm", "loss"].iter().enumerate() {
                let rel = ((got[i] - want[i]) / want[i]).abs();
                assert!(
                    rel <= 2.0 * f32::EPSILON,
                    "{what}: {name} {} against {}",
                    got[i],
                    want[i]
                );
            }
            if max_norm == 0.0 || max_norm == 1e6 {
                assert_eq!(got[0], 1.0 / loss_scale, "{what}: no clipping");
            }
        }
    }
}
