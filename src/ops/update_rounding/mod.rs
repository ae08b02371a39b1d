//! Writing an f32 update back into bf16 weights that keep no f32 master copy (pure bf16,
//! `--master-weights none`): the numeric core of the update rounding, on its own.
//!
//! A pure-bf16 parameter is widened into an f32 buffer ([`expand`]: the weight, plus its
//! Kahan compensation when it has one), any optimizer updates that buffer as it would a
//! master copy, and [`round`] writes the result back:
//!
//! - [`UpdateRounding::Nearest`]: round to nearest even, what a plain bf16 update does (an
//!   update smaller than half a bf16 gap is lost: training stalls once updates get small);
//! - [`UpdateRounding::Stochastic`]: up with probability equal to the distance from the
//!   bf16 below, so the expected weight is the f32 result (llm.c, torchao's
//!   `bf16_stochastic_round`); the random bits of element `i` are a counter-based hash of
//!   [`stream_key`]`(seed, step, parameter)` and `i`, so a resumed run and the CPU and the
//!   GPU draw the same bits;
//! - [`UpdateRounding::Kahan`]: round to nearest and keep the rounding error in a bf16
//!   compensation buffer (2 bytes per parameter), which the next [`expand`] adds back, so
//!   updates too small for bf16 accumulate until they count (optimi's Kahan summation);
//!   where the weight is not finite its compensation is 0.
//!
//! The family: the kernel calls with their operand checks, the CPU twin (`cpu.rs`) and the
//! CUDA launches (`cuda.rs`, over `kernels/update_rounding.cu`), bit for bit equal.

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::device::cpu::{ensure, ensure_f32};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// How an f32 update is written back into bf16 weights without a master copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpdateRounding {
    /// Round to nearest even.
    #[default]
    Nearest,
    /// Round up or down at random, unbiased.
    Stochastic,
    /// Round to nearest, keeping the error in a bf16 compensation buffer.
    Kahan,
}

impl UpdateRounding {
    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            UpdateRounding::Nearest => "nearest",
            UpdateRounding::Stochastic => "stochastic",
            UpdateRounding::Kahan => "kahan",
        }
    }

    /// The rounding named `name`; an error naming `field` and the allowed values otherwise.
    pub fn parse(field: &str, name: &str) -> Result<Self> {
        match name {
            "nearest" => Ok(UpdateRounding::Nearest),
            "stochastic" => Ok(UpdateRounding::Stochastic),
            "kahan" => Ok(UpdateRounding::Kahan),
            other => Err(Error::config(
                field,
                format!("`{other}` is not an update rounding; use nearest, stochastic or kahan"),
            )),
        }
    }

    /// Whether it keeps a compensation buffer (2 bytes per parameter).
    pub fn compensated(self) -> bool {
        self == UpdateRounding::Kahan
    }
}

impl std::fmt::Display for UpdateRounding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The key of the random stream of one parameter's stochastic rounding at one step: a
/// hash of the run's seed, the step and the parameter's index, so every (seed, step,
/// parameter, element) has its own bits, reproducibly.
pub fn stream_key(seed: u64, step: u64, parameter: u64) -> u64 {
    crate::rng::stream_key(seed, step, parameter)
}

/// `master = w + comp` in f32 (`comp` `None`: `w` alone): the buffer an optimizer updates
/// in place of a master copy. `w` and `comp` are bf16, `master` f32, all of one length.
pub fn expand(
    be: &(impl Backend + ?Sized),
    master: &mut Tensor,
    w: &Tensor,
    comp: Option<&Tensor>,
) -> Result<()> {
    be.run(&mut Expand { master, w, comp })
}

/// Writes `master` back into `w` with `mode` (and, for [`UpdateRounding::Kahan`], the
/// rounding error into `comp`, which it needs); `key` is [`stream_key`]'s for stochastic
/// rounding (ignored otherwise).
pub fn round(
    be: &(impl Backend + ?Sized),
    w: &mut Tensor,
    comp: Option<&mut Tensor>,
    master: &Tensor,
    mode: UpdateRounding,
    key: u64,
) -> Result<()> {
    be.run(&mut Round {
        w,
        comp,
        master,
        mode,
        key,
    })
}

/// Checks the operands: `master` f32, `w` (and `comp`) bf16, all of one length.
fn check(op: &'static str, master: &Tensor, w: &Tensor, comp: Option<&Tensor>) -> Result<()> {
    ensure_f32(master, op)?;
    for t in std::iter::once(w).chain(comp) {
        ensure(t.dtype() == DType::Bf16, op, || {
            format!(
                "`{}` is {}; update rounding writes bf16 weights (pure bf16 precision)",
                t.label(),
                t.dtype()
            )
        })?;
        ensure(t.numel() == master.numel(), op, || {
            format!(
                "`{}` has {} elements, `{}` {}",
                t.label(),
                t.numel(),
                master.label(),
                master.numel()
            )
        })?;
    }
    Ok(())
}

/// The call of [`expand`].
struct Expand<'a> {
    master: &'a mut Tensor,
    w: &'a Tensor,
    comp: Option<&'a Tensor>,
}

impl OpKernel for Expand<'_> {
    fn name(&self) -> &'static str {
        "update_rounding_expand"
    }

    fn label(&self) -> &str {
        self.master.label()
    }

    fn check(&self) -> Result<()> {
        check(self.name(), self.master, self.w, self.comp)
    }

    fn flops(&self) -> u64 {
        if self.comp.is_some() {
            self.w.numel() as u64
        } else {
            0
        }
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::expand(self.master, self.w, self.comp);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::expand(be, self.master, self.w, self.comp)
    }
}

/// The call of [`round`].
struct Round<'a> {
    w: &'a mut Tensor,
    comp: Option<&'a mut Tensor>,
    master: &'a Tensor,
    mode: UpdateRounding,
    key: u64,
}

impl OpKernel for Round<'_> {
    fn name(&self) -> &'static str {
        "update_rounding_round"
    }

    fn label(&self) -> &str {
        self.w.label()
    }

    fn check(&self) -> Result<()> {
        check(self.name(), self.master, self.w, self.comp.as_deref())?;
        ensure(
            !self.mode.compensated() || self.comp.is_some(),
            self.name(),
            || "Kahan rounding needs the parameter's compensation buffer".to_string(),
        )
    }

    fn flops(&self) -> u64 {
        if self.mode.compensated() {
            self.w.numel() as u64
        } else {
            0
        }
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let comp = self.comp.as_deref_mut();
        cpu::round(self.w, comp, self.master, self.mode, self.key);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let comp = self.comp.as_deref_mut();
        cuda::round(be, self.w, comp, self.master, self.mode, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryCategory;
    use half::bf16;

    fn tensor(be: &CpuBackend, v: &[f32], dtype: DType) -> Tensor {
        be.upload(v, &[v.len()], dtype, MemoryCategory::Weights, "t")
            .unwrap()
    }

    /// Stochastic rounding is unbiased (the mean of many roundings of one value is within
    /// four standard errors of it), lands only on the two neighbouring bf16 values, and
    /// draws the same bits for the same key and others for another.
    #[test]
    fn stochastic_rounding_is_unbiased_and_reproducible() {
        let be = CpuBackend::new();
        let lo = bf16::from_f32(1.0);
        let gap = bf16::from_bits(lo.to_bits() + 1).to_f32() - 1.0;
        for frac in [0.1f32, 0.5, 0.77] {
            let x = 1.0 + frac * gap;
            let n = 100_000;
            let master = tensor(&be, &vec![x; n], DType::F32);
            let mut w = tensor(&be, &vec![0.0; n], DType::Bf16);
            let key = stream_key(7, 3, 1);
            round(&be, &mut w, None, &master, UpdateRounding::Stochastic, key).unwrap();
            let got = be.to_f32(&w).unwrap();
            assert!(got.iter().all(|&v| v == 1.0 || v == 1.0 + gap));
            let mean = got.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let se = gap as f64 * (frac as f64 * (1.0 - frac as f64) / n as f64).sqrt();
            assert!(
                (mean - x as f64).abs() < 4.0 * se,
                "frac {frac}: mean {mean} against {x} (standard error {se:.2e})"
            );
            let mut again = tensor(&be, &vec![0.0; n], DType::Bf16);
            round(
                &be,
                &mut again,
                None,
                &master,
                UpdateRounding::Stochastic,
                key,
            )
            .unwrap();
            assert_eq!(be.to_f32(&again).unwrap(), got);
            let other = stream_key(7, 4, 1);
            round(
                &be,
                &mut again,
                None,
                &master,
                UpdateRounding::Stochastic,
                other,
            )
            .unwrap();
            assert_ne!(be.to_f32(&again).unwrap(), got);
            // Nearest rounds every one down.
            round(&be, &mut again, None, &master, UpdateRounding::Nearest, key).unwrap();
            let nearest = if frac < 0.5 { 1.0 } else { 1.0 + gap };
            assert!(be.to_f32(&again).unwrap().iter().all(|&v| v == nearest) || frac == 0.5);
        }
    }

    /// Many updates each far below half a bf16 gap: nearest rounding loses every one,
    /// Kahan's compensated sum ends where f32 accumulation does, and stochastic rounding
    /// near it.
    #[test]
    fn kahan_keeps_updates_too_small_for_bf16() {
        let be = CpuBackend::new();
        let (start, step, steps) = (1.0f32, 1e-4f32, 1000);
        let mut want = start;
        for _ in 0..steps {
            want += step;
        }
        let n = 64;
        let ones = tensor(&be, &vec![1.0; n], DType::F32);
        let run = |mode: UpdateRounding| {
            let mut w = tensor(&be, &vec![start; n], DType::Bf16);
            let mut comp = tensor(&be, &vec![0.0; n], DType::Bf16);
            let mut master = tensor(&be, &vec![0.0; n], DType::F32);
            for s in 0..steps {
                let c = mode.compensated().then_some(&comp);
                expand(&be, &mut master, &w, c).unwrap();
                be.axpy(&mut master, step, &ones).unwrap();
                let c = mode.compensated().then_some(&mut comp);
                round(&be, &mut w, c, &master, mode, stream_key(1, s, 0)).unwrap();
            }
            be.to_f32(&w).unwrap()
        };
        assert!(run(UpdateRounding::Nearest).iter().all(|&v| v == start));
        let kahan = run(UpdateRounding::Kahan);
        let gap = 2f32.powi(-7);
        assert!(
            kahan.iter().all(|&v| (v - want).abs() <= gap),
            "{kahan:?} {want}"
        );
        let sr = run(UpdateRounding::Stochastic);
        let mean = sr.iter().sum::<f32>() / sr.len() as f32;
        assert!((mean - want).abs() < 0.02, "{mean} {want}");
    }

    #[test]
    fn names_round_trip_and_bad_operands_are_named() {
        for m in [
            UpdateRounding::Nearest,
            UpdateRounding::Stochastic,
            UpdateRounding::Kahan,
        ] {
            assert_eq!(UpdateRounding::parse("x", m.name()).unwrap(), m);
        }
        let e = UpdateRounding::parse("--update-rounding", "up").unwrap_err();
        assert!(
            e.to_string().contains("nearest, stochastic or kahan"),
            "{e}"
        );
        let be = CpuBackend::new();
        let master = tensor(&be, &[1.0; 4], DType::F32);
        let mut w32 = tensor(&be, &[0.0; 4], DType::F32);
        let e = round(&be, &mut w32, None, &master, UpdateRounding::Nearest, 0).unwrap_err();
        assert!(e.to_string().contains("pure bf16"), "{e}");
        let mut w = tensor(&be, &[0.0; 4], DType::Bf16);
        let e = round(&be, &mut w, None, &master, UpdateRounding::Kahan, 0).unwrap_err();
        assert!(e.to_string().contains("compensation"), "{e}");
    }
}
