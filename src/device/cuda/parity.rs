//! What the parity tests of the kernels share: trainkit's kernels on the emulator (built
//! once per test process, skipped without a C++ compiler unless
//! `TRAINKIT_REQUIRE_EMULATOR` is set), launches with raw arguments, buffers of every
//! float dtype, and the comparisons. Each family's test, in its own `cuda.rs`, holds its
//! kernels to its CPU twin with these.

use super::emulator::KernelEmulator;
use crate::device::{Backend, CpuBackend};
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};
use crate::Rng;
use half::bf16;
use std::any::Any;
use std::ffi::c_void;

/// trainkit's kernels, built once per test process.
pub(crate) fn emulator() -> Option<&'static KernelEmulator> {
    super::emulator::trainkit_emulator()
}

/// Kernel arguments, each boxed at a fixed address as `params` needs.
#[derive(Default)]
pub(crate) struct Args(Vec<Box<dyn Any>>);

impl Args {
    pub(crate) fn new() -> Self {
        Self::default()
    }
    pub(crate) fn arg<T: 'static>(mut self, v: T) -> Self {
        self.0.push(Box::new(v));
        self
    }
    pub(crate) fn ptr<T: 'static>(self, v: &mut [T]) -> Self {
        self.arg(v.as_mut_ptr())
    }
    pub(crate) fn params(&mut self) -> Vec<*mut c_void> {
        self.0
            .iter_mut()
            .map(|b| &mut **b as *mut dyn Any as *mut c_void)
            .collect()
    }
}

impl Args {
    pub(crate) fn buf(self, b: &mut Buf) -> Self {
        self.arg(b.ptr())
    }
}

/// A 1-D launch.
pub(crate) fn launch(
    emu: &KernelEmulator,
    kernel: &str,
    grid: u32,
    block: u32,
    shared: u32,
    mut args: Args,
) -> Result<()> {
    let mut params = args.params();
    // SAFETY: every test passes the kernel's argument types, with buffers large enough
    // for the launch.
    unsafe { emu.launch(kernel, (grid, 1, 1), (block, 1, 1), shared, &mut params) }
}

/// A device buffer of any float dtype, as the kernels see it.
pub(crate) enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<half::f16>),
}

impl Buf {
    pub(crate) fn new(v: &[f32], dtype: DType) -> Buf {
        match dtype {
            DType::U8 | DType::Nf4(_) => {
                unreachable!("the kernels under test take f32, bf16 or f16")
            }
            DType::F32 => Buf::F32(v.to_vec()),
            DType::Bf16 => Buf::Bf16(to_bf16(v)),
            DType::F16 => Buf::F16(to_f16(v)),
        }
    }
    pub(crate) fn ptr(&mut self) -> *mut c_void {
        match self {
            Buf::F32(v) => v.as_mut_ptr().cast(),
            Buf::Bf16(v) => v.as_mut_ptr().cast(),
            Buf::F16(v) => v.as_mut_ptr().cast(),
        }
    }
    pub(crate) fn values(&self) -> Vec<f32> {
        match self {
            Buf::F32(v) => v.clone(),
            Buf::Bf16(v) => widen(v),
            Buf::F16(v) => widen_f16(v),
        }
    }
}

pub(crate) const DTYPES: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

pub(crate) fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 | DType::Nf4(_) => {
            unreachable!("the kernels under test take f32, bf16 or f16")
        }
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
    }
}

/// Whether kernels exist for this mix of dtypes: bf16 and f16 never meet in one.
pub(crate) fn instantiated(dtypes: &[DType]) -> bool {
    !(dtypes.contains(&DType::Bf16) && dtypes.contains(&DType::F16))
}

pub(crate) fn random(n: usize, scale: f64, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

pub(crate) fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub(crate) fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

pub(crate) fn to_f16(v: &[f32]) -> Vec<half::f16> {
    v.iter().map(|&x| half::f16::from_f32(x)).collect()
}

pub(crate) fn widen_f16(v: &[half::f16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

pub(crate) fn upload(be: &CpuBackend, v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    be.upload(v, shape, dtype, MemoryCategory::Activations, "t")
        .unwrap()
}

pub(crate) fn zeros(be: &CpuBackend, shape: &[usize], dtype: DType) -> Tensor {
    be.zeros(shape, dtype, MemoryCategory::Activations, "t")
        .unwrap()
}

/// Equal bit for bit (any NaN equals any NaN).
pub(crate) fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}[{i}]: emulated {g:e} ({:#010x}), cpu {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// Equal up to `tol` relative to the largest magnitude of `want`.
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: emulated {g:e}, cpu {w:e}"
        );
    }
}
