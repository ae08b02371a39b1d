//! GELU (tanh approximation) and its backward.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/gelu.cu`, listed once in [`KERNELS`].

use crate::device::cuda::backend::{ensure_dtype, ptr, CudaBackend, BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/gelu.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "gelu.cu",
    source: include_str!("../../../kernels/gelu.cu"),
    kernels: &[
        "gelu_f32",
        "gelu_bf16",
        "gelu_backward_f32",
        "gelu_backward_bf16",
        "gelu_f16",
        "gelu_backward_f16",
        "gelu_backward_inplace_f32",
        "gelu_backward_inplace_bf16",
        "gelu_backward_inplace_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(be: &CudaBackend, out: &mut Tensor, x: &Tensor) -> Result<()> {
    let n = x.numel();
    ensure_dtype(out, x.dtype(), "gelu")?;
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("gelu_{}", x.dtype()),
        be.grid(n.div_ceil(8)),
        BLOCK,
        Args::new().ptr(ptr(out)?).ptr(ptr(x)?).i64(n),
    )
}

pub(crate) fn backward(be: &CudaBackend, dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()> {
    let n = x.numel();
    ensure_dtype(dx, x.dtype(), "gelu_backward")?;
    if n == 0 {
        return Ok(());
    }
    let dout = be.as_dtype(dout, x.dtype())?;
    be.launch(
        &format!("gelu_backward_{}", x.dtype()),
        be.grid(n.div_ceil(8)),
        BLOCK,
        Args::new()
            .ptr(ptr(dx)?)
            .ptr(ptr(x)?)
            .ptr(ptr(&dout)?)
            .i64(n),
    )
}

/// `d = gelu'(x) · d` in place.
pub(crate) fn backward_in_place(be: &CudaBackend, d: &mut Tensor, x: &Tensor) -> Result<()> {
    let n = x.numel();
    ensure_dtype(d, x.dtype(), "gelu_backward_in_place")?;
    if n == 0 {
        return Ok(());
    }
    be.launch(
        &format!("gelu_backward_inplace_{}", x.dtype()),
        be.grid(n.div_ceil(8)),
        BLOCK,
        Args::new().ptr(ptr(d)?).ptr(ptr(x)?).i64(n),
    )
}

/// The kernels of `kernels/gelu.cu` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::ops::gelu;

    fn gelu_inputs() -> Vec<f32> {
        let mut x = random(600, 2.5, 1);
        x.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            1e-40,
            10.0,
            -10.0,
            50.0,
            -50.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        x
    }

    #[test]
    fn gelu_matches_the_cpu_bit_for_bit() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        let xs = gelu_inputs();
        let dout = random(xs.len(), 1.0, 2);
        let n = xs.len();
        for dtype in DTYPES {
            let x = upload(&be, &xs, &[n], dtype);
            let d = upload(&be, &dout, &[n], dtype);
            let mut out = zeros(&be, &[n], dtype);
            gelu::forward(&be, &mut out, &x).unwrap();
            let want = be.to_f32(&out).unwrap();
            let mut dx = zeros(&be, &[n], dtype);
            gelu::backward(&be, &mut dx, &x, &d).unwrap();
            let want_dx = be.to_f32(&dx).unwrap();
            // One block of 32 threads, 8 elements each: the grid-stride loops go round
            // three times over 614 elements, the last 6 one by one.
            let t = suffix(dtype);
            let (mut x, mut d) = (Buf::new(&xs, dtype), Buf::new(&dout, dtype));
            let mut out = Buf::new(&vec![0.0; n], dtype);
            let mut dx = Buf::new(&vec![0.0; n], dtype);
            let a = Args::new().buf(&mut out).buf(&mut x).arg(n as i64);
            launch(emu, &format!("gelu_{t}"), 1, 32, 0, a).unwrap();
            let a = Args::new()
                .buf(&mut dx)
                .buf(&mut x)
                .buf(&mut d)
                .arg(n as i64);
            launch(emu, &format!("gelu_backward_{t}"), 1, 32, 0, a).unwrap();
            let (got, got_dx) = (out.values(), dx.values());
            assert_bitwise(&format!("gelu {dtype:?}"), &got, &want);
            assert_bitwise(&format!("gelu_backward {dtype:?}"), &got_dx, &want_dx);
            // In place: the gradient's buffer holds dout and takes dx, as on the CPU.
            let mut in_place = upload(&be, &dout, &[n], dtype);
            let x_cpu = upload(&be, &xs, &[n], dtype);
            gelu::cpu::backward_in_place(&mut in_place, &x_cpu);
            let want_in_place = be.to_f32(&in_place).unwrap();
            assert_bitwise("cpu in place", &want_in_place, &want_dx);
            let mut g = Buf::new(&dout, dtype);
            let a = Args::new().buf(&mut g).buf(&mut x).arg(n as i64);
            launch(emu, &format!("gelu_backward_inplace_{t}"), 1, 32, 0, a).unwrap();
            assert_bitwise(
                &format!("gelu_backward_inplace {dtype:?}"),
                &g.values(),
                &want_dx,
            );
        }
    }
}
