//! Kernels written outside trainkit: a [`CustomKernel`] carries its CUDA C source and its
//! CPU twin, and [`Backend::custom`](super::Backend::custom) runs it on any backend.
//!
//! The CPU backend runs the twin; the CUDA backend compiles the source through trainkit's
//! NVRTC path and disk cache (with `kernels/common.cuh` prepended, as for trainkit's own
//! kernels) the first time the kernel is used, and launches it; the CUDA emulator builds the
//! same source for the host. The meta backend computes nothing. On every backend
//! [`Backend::custom`](super::Backend::custom) checks the operands (`check`) and records
//! the ledger span first.
//!
//! The launch shape is element-wise: one grid-stride loop over `n` elements, where `n` is
//! the element count of the first output. The kernel's CUDA signature is fixed by the call:
//!
//! ```text
//! extern "C" __global__ void <name>(float* out_0, ..., float* out_k,
//!                                   const float* in_0, ..., const float* in_j,
//!                                   float s_0, ..., float s_m, i64 n)
//! ```
//!
//! with one pointer per output, one per input and one `float` per scalar, in the order
//! [`Backend::custom`](super::Backend::custom) receives them. Every tensor reaches the
//! kernel as f32: a bf16 input is widened into a workspace copy first, and a bf16 output
//! is widened before the kernel and rounded (to nearest even) after it. Outputs are read
//! and written (the kernel may update them in place); every output has `n` elements, and
//! inputs may have any length (a one-element input is a device scalar, such as the step's
//! gradient multiplier, [`crate::optim::GradScale`]): the kernel must index each within
//! its length, as the CPU twin's slices are.

use super::cpu::{each, ensure_float, read, write, CpuBackend};
use super::cuda::kernels::kernel_files;
use super::cuda::CudaBackend;
use super::OpKernel;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::fmt::Debug;

/// An element-wise kernel defined outside trainkit: a name, its CUDA C source and its CPU
/// twin (see the [module documentation](self) for the launch convention).
///
/// Keep the two twins in step: write the same operations in the same order (NVRTC runs
/// with `--fmad=false`, so `a * b + c` rounds twice on the GPU as in Rust; use `fmaf`
/// only where the CPU twin uses `mul_add`), and the CUDA backend then gives the CPU's
/// results bit for bit.
pub trait CustomKernel: Debug + Send + Sync {
    /// The `extern "C"` name of the kernel in [`CustomKernel::source`]: a C identifier,
    /// not one of trainkit's own kernel names. It also names the op in the ledger.
    fn name(&self) -> &'static str;

    /// The CUDA C source defining the kernel. trainkit prepends `kernels/common.cuh`,
    /// which includes `cuda_bf16.h` and defines `i64`, `bf16`, `load` / `store` and the
    /// grid-stride loop `TK_FOR_EACH(i, n)`.
    fn source(&self) -> &'static str;

    /// The CPU twin: the kernel's work on host slices. `outputs[k]` holds output k's
    /// current values (f32, `n` elements each) and receives its new ones; `inputs[k]` and
    /// `scalars` are what the kernel gets.
    fn cpu(
        &self,
        outputs: &mut [&mut [f32]],
        inputs: &[&[f32]],
        scalars: &[f32],
        n: usize,
    ) -> Result<()>;

    /// Floating-point operations per element, for the ledger's op span (0 by default).
    fn flops_per_element(&self) -> u64 {
        0
    }
}

fn custom_error(kernel: &str, message: String) -> Error {
    Error::Shape {
        op: "custom",
        message: format!("kernel `{kernel}`: {message}"),
    }
}

/// Checks a [`CustomKernel`] call, the contract every backend shares: a usable name, at
/// least one output, and every output with as many elements as the first. Returns `n`.
pub(crate) fn check(
    kernel: &dyn CustomKernel,
    outputs: &[&mut Tensor],
    _inputs: &[&Tensor],
) -> Result<usize> {
    let name = kernel.name();
    let identifier = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !identifier {
        return Err(custom_error(
            name,
            "the name must be a C identifier (letters, digits and `_`, not starting with a \
             digit), the `extern \"C\"` name of the kernel in its source"
                .to_string(),
        ));
    }
    if let Some(file) = kernel_files().iter().find(|f| f.kernels.contains(&name)) {
        return Err(custom_error(
            name,
            format!(
                "trainkit has a kernel of that name (in kernels/{}): give yours another",
                file.name
            ),
        ));
    }
    let Some(first) = outputs.first() else {
        return Err(custom_error(
            name,
            "it needs at least one output: the launch runs over the first output's elements"
                .to_string(),
        ));
    };
    let n = first.numel();
    for t in outputs {
        if t.numel() != n {
            return Err(custom_error(
                name,
                format!(
                    "every output must have {n} elements, as `{}` {:?} has; `{}` has shape {:?}",
                    first.label(),
                    first.shape(),
                    t.label(),
                    t.shape()
                ),
            ));
        }
    }
    Ok(n)
}

/// Runs the CPU twin on host copies of checked operands (`check`): `read` gives a
/// tensor's elements as f32, `write` stores f32 values into an output (rounded to its
/// dtype).
pub(crate) fn run_on_host(
    kernel: &dyn CustomKernel,
    outputs: &mut [&mut Tensor],
    inputs: &[&Tensor],
    scalars: &[f32],
    read: &dyn Fn(&Tensor) -> Result<Vec<f32>>,
    write: &dyn Fn(&mut Tensor, &[f32]) -> Result<()>,
) -> Result<()> {
    let n = outputs.first().map_or(0, |t| t.numel());
    let mut outs: Vec<Vec<f32>> = outputs.iter().map(|t| read(t)).collect::<Result<_>>()?;
    let ins: Vec<Vec<f32>> = inputs.iter().map(|t| read(t)).collect::<Result<_>>()?;
    {
        let mut out_slices: Vec<&mut [f32]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
        let in_slices: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        kernel.cpu(&mut out_slices, &in_slices, scalars, n)?;
    }
    for (t, v) in outputs.iter_mut().zip(&outs) {
        write(t, v)?;
    }
    Ok(())
}

/// One call of a [`CustomKernel`] through the kernel door ([`Backend::run`]): the
/// operands' check, the FLOPs of [`CustomKernel::flops_per_element`], the CPU twin on
/// host copies, or the CUDA source compiled and launched element-wise.
///
/// [`Backend::run`]: super::Backend::run
pub(crate) struct Call<'a, 'o> {
    pub(crate) kernel: &'a dyn CustomKernel,
    pub(crate) outputs: &'a mut [&'o mut Tensor],
    pub(crate) inputs: &'a [&'a Tensor],
    pub(crate) scalars: &'a [f32],
}

impl OpKernel for Call<'_, '_> {
    fn name(&self) -> &'static str {
        self.kernel.name()
    }

    fn label(&self) -> &str {
        self.outputs.first().map_or("", |t| t.label())
    }

    fn check(&self) -> Result<()> {
        let name = self.kernel.name();
        ensure_float(name, self.inputs)?;
        for t in self.outputs.iter() {
            ensure_float(name, &[t])?;
        }
        check(self.kernel, self.outputs, self.inputs).map(drop)
    }

    fn flops(&self) -> u64 {
        let n = self.outputs.first().map_or(0, |t| t.numel());
        each(n, self.kernel.flops_per_element())
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        run_on_host(
            self.kernel,
            self.outputs,
            self.inputs,
            self.scalars,
            &|t| Ok(read(t).into_owned()),
            &|t, v| {
                write(t, false, |out| out.copy_from_slice(v));
                Ok(())
            },
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        super::cuda::ops::custom::custom(be, self.kernel, self.outputs, self.inputs, self.scalars)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Backend, CpuBackend, MetaBackend};
    use crate::memory::MemoryCategory;
    use crate::tensor::DType;

    /// `y = a·x + y` over f32, with `a` a scalar.
    #[derive(Debug)]
    struct Axpy(&'static str);

    impl CustomKernel for Axpy {
        fn name(&self) -> &'static str {
            self.0
        }
        fn source(&self) -> &'static str {
            "extern \"C\" __global__ void axpy_test(float* y, const float* x, float a, i64 n) {\n\
             \x20   TK_FOR_EACH(i, n) { y[i] = a * x[i] + y[i]; }\n}\n"
        }
        fn cpu(
            &self,
            outputs: &mut [&mut [f32]],
            inputs: &[&[f32]],
            scalars: &[f32],
            n: usize,
        ) -> Result<()> {
            for i in 0..n {
                outputs[0][i] += scalars[0] * inputs[0][i];
            }
            Ok(())
        }
    }

    #[test]
    fn the_cpu_runs_the_twin_and_rounds_bf16_outputs() {
        let be = CpuBackend::new();
        let up = |v: &[f32], dt| {
            be.upload(v, &[v.len()], dt, MemoryCategory::Activations, "t")
                .unwrap()
        };
        let mut y = up(&[1.0, 2.0, 3.0], DType::F32);
        let mut yb = up(&[1.0, 2.0, 3.0], DType::Bf16);
        let x = up(&[0.5, 0.25, 1.0 / 3.0], DType::Bf16);
        for out in [&mut y, &mut yb] {
            be.custom(&Axpy("axpy_test"), &mut [out], &[&x], &[2.0])
                .unwrap();
        }
        let want = [
            2.0,
            2.5,
            3.0 + 2.0 * half::bf16::from_f32(1.0 / 3.0).to_f32(),
        ];
        assert_eq!(be.to_f32(&y).unwrap(), want);
        let rounded: Vec<f32> = want
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(be.to_f32(&yb).unwrap(), rounded);
    }

    #[test]
    fn bad_calls_are_clear_errors_on_every_backend() {
        let cpu = CpuBackend::new();
        let meta = MetaBackend::new();
        for be in [&cpu as &dyn Backend, &meta] {
            let t = |n: usize| {
                be.zeros(&[n], DType::F32, MemoryCategory::Activations, "y")
                    .unwrap()
            };
            let (mut a, mut b) = (t(3), t(4));
            let err = |k: &Axpy, outs: &mut [&mut Tensor]| {
                be.custom(k, outs, &[], &[]).unwrap_err().to_string()
            };
            let e = err(&Axpy("2bad"), &mut [&mut a]);
            assert!(e.contains("C identifier"), "{e}");
            let e = err(&Axpy("gelu_f32"), &mut [&mut a]);
            assert!(e.contains("gelu.cu") && e.contains("another"), "{e}");
            let e = err(&Axpy("axpy_test"), &mut []);
            assert!(e.contains("at least one output"), "{e}");
            let e = err(&Axpy("axpy_test"), &mut [&mut a, &mut b]);
            assert!(e.contains("3 elements"), "{e}");
        }
        let mut y = meta
            .zeros(&[3], DType::F32, MemoryCategory::Activations, "y")
            .unwrap();
        let x = meta
            .zeros(&[3], DType::F32, MemoryCategory::Activations, "x")
            .unwrap();
        meta.custom(&Axpy("axpy_test"), &mut [&mut y], &[&x], &[1.0])
            .unwrap();
    }
}
