//! Layer normalization and its backward (dx per row; the parameter gradients in two
//! passes over blocks of [`ROW_BLOCK`] rows).
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/layernorm.cu`, listed once in [`KERNELS`].

use crate::device::cpu::ensure_f32;
use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK, ROW_BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/layernorm.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "layernorm.cu",
    source: include_str!("../../../kernels/layernorm.cu"),
    kernels: &[
        "layernorm_f32",
        "layernorm_bf16",
        "layernorm_backward_dx_f32",
        "layernorm_backward_dx_bf16",
        "layernorm_backward_params_f32",
        "layernorm_backward_params_bf16",
        "layernorm_backward_params_finish_f32",
        "layernorm_backward_params_finish_bf16",
        "layernorm_f16",
        "layernorm_backward_dx_f16",
        "layernorm_backward_params_f16",
        "layernorm_backward_params_finish_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    stats: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    ensure_dtype(out, x.dtype(), "layernorm")?;
    if rows * c == 0 {
        return Ok(());
    }
    let dt = x.dtype();
    let weight = be.as_dtype(weight, dt)?;
    let bias = be.as_dtype(bias, dt)?;
    be.launch(
        &format!("layernorm_{dt}"),
        be.grid_warp_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(stats)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&weight)?)
            .ptr(ptr(&bias)?)
            .i64(rows)
            .i64(c)
            .f32(eps),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    be: &CudaBackend,
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dbias: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    stats: &Tensor,
) -> Result<()> {
    let (rows, c) = x.rows_cols();
    // The kernels read the statistics as f32.
    ensure_f32(stats, "layernorm_backward")?;
    ensure_dtype(dbias, dweight.dtype(), "layernorm_backward")?;
    if rows * c == 0 {
        return Ok(());
    }
    let dt = x.dtype();
    let dx_dt = dx.dtype();
    ensure_dtype(dx, dt, "layernorm_backward")?;
    let dout = be.as_dtype(dout, dt)?;
    let weight = be.as_dtype(weight, dt)?;
    be.launch(
        &format!("layernorm_backward_dx_{dx_dt}"),
        be.grid_warp_rows(rows),
        BLOCK,
        Args::new()
            .ptr(ptr(dx)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&weight)?)
            .ptr(ptr(stats)?)
            .i64(rows)
            .i64(c),
    )?;
    let blocks = rows.div_ceil(ROW_BLOCK);
    let partial = be.scratch(blocks * 2 * c * 4, "layernorm_backward.partial")?;
    be.launch(
        &format!("layernorm_backward_params_{dt}"),
        be.grid(blocks * c.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(&partial)?)
            .ptr(ptr(&dout)?)
            .ptr(ptr(x)?)
            .ptr(ptr(stats)?)
            .i64(rows)
            .i64(c),
    )?;
    be.launch(
        &format!("layernorm_backward_params_finish_{}", dweight.dtype()),
        be.grid_columns(2 * c),
        BLOCK,
        Args::new()
            .ptr(ptr(dweight)?)
            .ptr(ptr(dbias)?)
            .ptr(ptr(&partial)?)
            .i64(blocks)
            .i64(c),
    )
}

/// The kernels of `kernels/layernorm.cu` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::cuda::KernelEmulator;
    use crate::device::{Backend, CpuBackend};
    use crate::ops::layernorm;
    use crate::tensor::DType;

    /// Inputs of the layer-norm tests: x, weight, bias, dout and the starting dx, dweight,
    /// dbias (the backward accumulates), `[rows, c]` or `[c]`.
    struct LayerNormCase {
        rows: usize,
        c: usize,
        eps: f32,
        x: Vec<f32>,
        w: Vec<f32>,
        b: Vec<f32>,
        dout: Vec<f32>,
        dx: Vec<f32>,
        dw: Vec<f32>,
        db: Vec<f32>,
    }

    impl LayerNormCase {
        /// out, stats, dx, dweight, dbias from the CPU backend.
        fn on_cpu(&self, dtype: DType) -> Vec<Vec<f32>> {
            let be = CpuBackend::new();
            let (rows, c) = (self.rows, self.c);
            let x = upload(&be, &self.x, &[rows, c], dtype);
            let w = upload(&be, &self.w, &[c], dtype);
            let b = upload(&be, &self.b, &[c], dtype);
            let mut out = zeros(&be, &[rows, c], dtype);
            let mut stats = zeros(&be, &[rows, 2], DType::F32);
            layernorm::forward(&be, &mut out, &mut stats, &x, &w, &b, self.eps).unwrap();
            let dout = upload(&be, &self.dout, &[rows, c], dtype);
            let mut dx = upload(&be, &self.dx, &[rows, c], dtype);
            let mut dw = upload(&be, &self.dw, &[c], dtype);
            let mut db = upload(&be, &self.db, &[c], dtype);
            layernorm::backward(&be, &mut dx, &mut dw, &mut db, &dout, &x, &w, &stats).unwrap();
            [&out, &stats, &dx, &dw, &db]
                .iter()
                .map(|t| be.to_f32(t).unwrap())
                .collect()
        }

        /// The same from the four kernels, storage `T` (converted by `conv`, read back by
        /// `back`): the forward on 3 blocks of 64 threads (6 warps), the backward on
        /// other grids.
        fn emulated<T: 'static + Copy>(
            &self,
            emu: &KernelEmulator,
            suffix: &str,
            conv: fn(&[f32]) -> Vec<T>,
            back: fn(&[T]) -> Vec<f32>,
        ) -> Vec<Vec<f32>> {
            let (rows, c) = (self.rows as i64, self.c as i64);
            let blocks = self
                .rows
                .div_ceil(crate::device::cpu::elementwise::ROW_BLOCK);
            let (mut x, mut w, mut b) = (conv(&self.x), conv(&self.w), conv(&self.b));
            let (mut dout, mut dx) = (conv(&self.dout), conv(&self.dx));
            let (mut dw, mut db) = (conv(&self.dw), conv(&self.db));
            let mut out = conv(&vec![0.0; self.rows * self.c]);
            let mut stats = vec![f32::NAN; self.rows * 2];
            let a = Args::new()
                .ptr(&mut out)
                .ptr(&mut stats)
                .ptr(&mut x)
                .ptr(&mut w)
                .ptr(&mut b)
                .arg(rows)
                .arg(c)
                .arg(self.eps);
            launch(emu, &format!("layernorm_{suffix}"), 3, 64, 0, a).unwrap();
            let a = Args::new()
                .ptr(&mut dx)
                .ptr(&mut dout)
                .ptr(&mut x)
                .ptr(&mut w)
                .ptr(&mut stats)
                .arg(rows)
                .arg(c);
            launch(emu, &format!("layernorm_backward_dx_{suffix}"), 2, 96, 0, a).unwrap();
            let mut partial = vec![f32::NAN; blocks * 2 * self.c];
            let a = Args::new()
                .ptr(&mut partial)
                .ptr(&mut dout)
                .ptr(&mut x)
                .ptr(&mut stats)
                .arg(rows)
                .arg(c);
            launch(
                emu,
                &format!("layernorm_backward_params_{suffix}"),
                2,
                64,
                0,
                a,
            )
            .unwrap();
            let a = Args::new()
                .ptr(&mut dw)
                .ptr(&mut db)
                .ptr(&mut partial)
                .arg(blocks as i64)
                .arg(c);
            let finish = format!("layernorm_backward_params_finish_{suffix}");
            launch(emu, &finish, 1, 64, 0, a).unwrap();
            vec![back(&out), stats, back(&dx), back(&dw), back(&db)]
        }
    }

    #[test]
    fn layernorm_matches_the_cpu_bit_for_bit() {
        let Some(emu) = emulator() else { return };
        // 300 rows (ten blocks of 32 for the parameter gradients, the last part full) of
        // 100 columns (not a multiple of 16 nor of 8: no vector loads): 50 rows per
        // warp in the forward; 20 rows of 600 columns: three warp rows of 256 in the forward
        // and dx, the last part full, with 16-byte loads; 4,200 rows of 16 columns: 132 blocks, more
        // than one chunk of the parameter gradients' second pass.
        for (rows, c) in [(300usize, 100usize), (20, 600), (4200, 16)] {
            let case = LayerNormCase {
                rows,
                c,
                eps: 1e-5,
                x: random(rows * c, 1.5, 4).iter().map(|v| v + 0.3).collect(),
                w: random(c, 1.0, 5),
                b: random(c, 0.5, 6),
                dout: random(rows * c, 1.0, 7),
                dx: random(rows * c, 0.1, 8),
                dw: random(c, 0.1, 9),
                db: random(c, 0.1, 10),
            };
            for dtype in DTYPES {
                let want = case.on_cpu(dtype);
                let got = match dtype {
                    DType::U8 | DType::Nf4(_) => {
                        unreachable!("the kernels under test take f32, bf16 or f16")
                    }
                    DType::F32 => case.emulated(emu, "f32", |v| v.to_vec(), |v| v.to_vec()),
                    DType::Bf16 => case.emulated(emu, "bf16", to_bf16, widen),
                    DType::F16 => case.emulated(emu, "f16", to_f16, widen_f16),
                };
                for (name, (g, w)) in ["out", "stats", "dx", "dweight", "dbias"]
                    .iter()
                    .zip(got.iter().zip(&want))
                {
                    assert_bitwise(&format!("layernorm {rows}x{c} {dtype:?} {name}"), g, w);
                }
            }
        }
    }
}
