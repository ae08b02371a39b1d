//! AdamW with PyTorch's semantics.
//!
//! The optimizer ([`AdamW`]) and its kernel: one fused update of a parameter
//! ([`update`], an [`OpKernel`] call with its operand checks and FLOP count), the CPU twin
//! (`cpu.rs`) and the CUDA launch (`cuda.rs`, over `kernels/adamw.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{state_layout, GradScale, Optimizer, ParamUpdate, StateSlot};
use crate::device::cpu::elementwise::{cast, same_len};
use crate::device::cpu::{each, ensure, ensure_f32};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// Floating-point operations per element of an update.
const FLOPS: u64 = 15;

/// Hyper-parameters of one fused AdamW update (PyTorch semantics).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the bias-corrected root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay (0 for tensors that take none).
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
    /// Multiplies the gradient before use (global-norm clipping, loss-scale removal).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The per-step constants of the update, computed on the host as PyTorch does (bias
    /// corrections in f64): `(step_size, bc2_sqrt, decay)` with
    /// `step_size = lr / (1 − beta1^step)`, `bc2_sqrt = sqrt(1 − beta2^step)` and
    /// `decay = 1 − lr · weight_decay`. Every backend uses these exact values.
    pub fn constants(&self) -> (f32, f32, f32) {
        let exponent = self.step.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - (self.beta1 as f64).powi(exponent);
        let bc2 = 1.0 - (self.beta2 as f64).powi(exponent);
        let step_size = (self.lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = 1.0 - self.lr * self.weight_decay;
        (step_size, bc2_sqrt, decay)
    }
}

/// One AdamW update of `param` (f32) from `grad`, with moments `m` and `v` (f32).
/// With `scale` (a one-element f32 tensor, see [`GradScale`]), the
/// gradient is also multiplied by its value, read on the device; when that value is
/// not finite nothing is written: the update is skipped. With `compute` (as many
/// elements as `param`), the updated values are also written there, rounded to its
/// dtype (the compute weights of mixed precision), in the same pass on a GPU.
#[allow(clippy::too_many_arguments)]
pub fn update(
    be: &dyn Backend,
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
    compute: Option<&mut Tensor>,
) -> Result<()> {
    be.run(&mut Update {
        param,
        grad,
        m,
        v,
        hp,
        scale,
        compute,
    })
}

/// The call of [`update`].
struct Update<'a> {
    param: &'a mut Tensor,
    grad: &'a Tensor,
    m: &'a mut Tensor,
    v: &'a mut Tensor,
    hp: &'a AdamWStep,
    scale: Option<&'a Tensor>,
    compute: Option<&'a mut Tensor>,
}

impl OpKernel for Update<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn label(&self) -> &str {
        self.param.label()
    }

    fn check(&self) -> Result<()> {
        check_update(
            self.param,
            self.grad,
            self.m,
            self.v,
            self.scale,
            self.compute.as_deref(),
        )
    }

    fn flops(&self) -> u64 {
        each(self.param.numel(), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::update(self.param, self.grad, self.m, self.v, self.hp, self.scale)?;
        if let Some(c) = self.compute.as_deref_mut() {
            cast(c, self.param);
        }
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::update(
            be,
            self.param,
            self.grad,
            self.m,
            self.v,
            self.hp,
            self.scale,
            self.compute.as_deref_mut(),
        )
    }
}

/// One parameter tensor of [`update_many`]: its f32 value, gradient, moments, optional
/// compute copy, and whether it takes the weight decay.
#[derive(Debug)]
pub struct AdamWTensor<'a> {
    /// The f32 value the update writes (a master copy, or f32 weights).
    pub param: &'a mut Tensor,
    /// Its gradient.
    pub grad: &'a Tensor,
    /// The first moment.
    pub m: &'a mut Tensor,
    /// The second moment.
    pub v: &'a mut Tensor,
    /// The compute weights written beside the value, rounded to their dtype.
    pub compute: Option<&'a mut Tensor>,
    /// Whether [`AdamWStep::weight_decay`] applies (else the tensor takes none).
    pub decays: bool,
}

/// [`update`] of many tensors: each exactly as [`update`] would update it, with
/// `hp.weight_decay` for the tensors that decay and none for the others. On a GPU the
/// tensors of the same dtypes share a launch (up to 32 a launch), instead of one launch
/// each.
pub fn update_many(
    be: &dyn Backend,
    tensors: &mut [AdamWTensor<'_>],
    hp: &AdamWStep,
    scale: Option<&Tensor>,
) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    be.run(&mut UpdateMany { tensors, hp, scale })
}

/// The call of [`update_many`].
struct UpdateMany<'a, 'b> {
    tensors: &'a mut [AdamWTensor<'b>],
    hp: &'a AdamWStep,
    scale: Option<&'a Tensor>,
}

impl UpdateMany<'_, '_> {
    /// The hyper-parameters of tensor `t`: its weight decay or none.
    fn step_of(hp: &AdamWStep, t: &AdamWTensor<'_>) -> AdamWStep {
        AdamWStep {
            weight_decay: if t.decays { hp.weight_decay } else { 0.0 },
            ..*hp
        }
    }
}

impl OpKernel for UpdateMany<'_, '_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn label(&self) -> &str {
        self.tensors[0].param.label()
    }

    fn check(&self) -> Result<()> {
        self.tensors.iter().try_for_each(|t| {
            check_update(t.param, t.grad, t.m, t.v, self.scale, t.compute.as_deref())
        })
    }

    fn flops(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| each(t.param.numel(), FLOPS))
            .sum()
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        for t in self.tensors.iter_mut() {
            let hp = Self::step_of(self.hp, t);
            cpu::update(t.param, t.grad, t.m, t.v, &hp, self.scale)?;
            if let Some(c) = t.compute.as_deref_mut() {
                cast(c, t.param);
            }
        }
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::update_many(be, self.tensors, self.hp, self.scale)
    }
}

/// Checks one update's operands: [`check`], the scale, and the compute copy's length and
/// dtype.
fn check_update(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    scale: Option<&Tensor>,
    compute: Option<&Tensor>,
) -> Result<()> {
    check(param, grad, m, v)?;
    if let Some(s) = scale {
        check_scale(s)?;
    }
    if let Some(c) = compute {
        same_len(c, param, "adamw")?;
        ensure(
            m.dtype() == DType::F32 || c.dtype() != DType::F16,
            "adamw",
            || {
                format!(
                    "`{}`: bf16 moments with fp16 compute weights are not supported; keep f32 \
                 moments with fp16",
                    param.label()
                )
            },
        )?;
    }
    Ok(())
}

/// Checks AdamW's operands (the contract every backend shares): an f32 value, both
/// moments f32 or both bf16 (then with an f32 or bf16 gradient), all four the same size.
fn check(param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
    ensure_f32(param, "adamw")?;
    let moments = m.dtype();
    ensure(
        matches!(moments, DType::F32 | DType::Bf16) && v.dtype() == moments,
        "adamw",
        || {
            format!(
                "`{}`: the moments must be both f32 or both bf16, not {} and {}",
                param.label(),
                m.dtype(),
                v.dtype()
            )
        },
    )?;
    ensure(
        moments == DType::F32 || matches!(grad.dtype(), DType::F32 | DType::Bf16),
        "adamw",
        || {
            format!(
                "`{}`: bf16 moments take an f32 or bf16 gradient, not {} (keep f32 moments \
                 with fp16)",
                param.label(),
                grad.dtype()
            )
        },
    )?;
    let n = param.numel();
    ensure(
        grad.numel() == n && m.numel() == n && v.numel() == n,
        "adamw",
        || {
            format!(
                "`{}`: gradient and moments must have {n} elements",
                param.label()
            )
        },
    )?;
    Ok(())
}

/// Checks AdamW's device scale: f32, at least one element.
pub(crate) fn check_scale(scale: &Tensor) -> Result<()> {
    ensure(
        scale.dtype() == DType::F32 && scale.numel() >= 1,
        "adamw",
        || {
            format!(
                "the gradient scale `{}` must be f32 with at least one element",
                scale.label()
            )
        },
    )
}

/// Adam with decoupled weight decay (`torch.optim.AdamW`): bias-corrected moments, eps
/// added outside the square root, and weight decay applied only to tensors of rank >= 2.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamW {
    /// Base learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Numerical floor added to the root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay for matrices and embeddings.
    pub weight_decay: f32,
    /// The dtype of the two moments. `None` (the default) follows the tensor the update
    /// writes, as `torch.optim.AdamW`'s `zeros_like(p)` does: f32 (8 bytes per parameter)
    /// beside an f32 master copy or f32 weights, bf16 (4 bytes) for pure bf16's bf16
    /// weights. `Some(F32)` or `Some(Bf16)` fixes it (`state_dtype = "f32"` or `"bf16"` in
    /// a config). A bf16 moment is updated in f32 and stored rounded to nearest even.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dtype: Option<DType>,
}

impl AdamW {
    /// The dtype of the moments of a parameter kept in `value` ([`crate::Param::kept_dtype`]: its
    /// master copy's, or without one its weights'): [`AdamW::state_dtype`] when set, else
    /// bf16 for bf16 values and f32 for every other.
    pub fn moment_dtype(&self, value: DType) -> DType {
        self.state_dtype.unwrap_or(match value {
            DType::Bf16 => DType::Bf16,
            _ => DType::F32,
        })
    }
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            state_dtype: None,
        }
    }
}

impl AdamW {
    pub(crate) fn validate(&self) -> Result<()> {
        let checks = [
            (
                "optimizer.lr",
                self.lr >= 0.0 && self.lr.is_finite(),
                "a finite value >= 0",
            ),
            (
                "optimizer.beta1",
                (0.0..1.0).contains(&self.beta1),
                "a value in [0, 1)",
            ),
            (
                "optimizer.beta2",
                (0.0..1.0).contains(&self.beta2),
                "a value in [0, 1)",
            ),
            (
                "optimizer.eps",
                self.eps > 0.0 && self.eps.is_finite(),
                "a finite value > 0",
            ),
            (
                "optimizer.weight_decay",
                self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
                "a finite value >= 0",
            ),
        ];
        for (field, ok, valid) in checks {
            if !ok {
                return Err(Error::config(field, format!("must be {valid}")));
            }
        }
        if let Some(d) = self
            .state_dtype
            .filter(|d| !matches!(d, DType::F32 | DType::Bf16))
        {
            return Err(Error::config(
                "optimizer.state_dtype",
                format!("must be f32 or bf16 (or left out to follow the weights), not {d}"),
            ));
        }
        Ok(())
    }
}

#[typetag::serde(name = "adamw")]
impl Optimizer for AdamW {
    fn learning_rate(&self) -> f32 {
        self.lr
    }

    fn state_slots(&self, shape: &[usize], kept: DType) -> Vec<StateSlot> {
        let moments = self.moment_dtype(kept);
        vec![
            StateSlot::new("exp_avg", shape, moments),
            StateSlot::new("exp_avg_sq", shape, moments),
        ]
    }

    fn writes_compute(&self) -> bool {
        true
    }

    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
        lr: f32,
        grad_scale: GradScale<'_>,
        step: u64,
    ) -> Result<()> {
        self.validate()?;
        // One update of them all (a few launches on a GPU).
        let mut tensors = Vec::with_capacity(params.len());
        for p in params.iter_mut() {
            let [m, v] = &mut *p.state else {
                return Err(state_layout(
                    "adamw",
                    p.name,
                    p.state.len(),
                    "2 (the moments)",
                ));
            };
            tensors.push(AdamWTensor {
                param: &mut *p.values,
                grad: p.grad,
                m,
                v,
                compute: p.compute.as_deref_mut(),
                decays: p.decays,
            });
        }
        update_many(
            backend,
            &mut tensors,
            &AdamWStep {
                lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
                step,
                grad_scale: 1.0,
            },
            Some(grad_scale.tensor()),
        )
    }

    fn state_bytes_per_param(&self) -> usize {
        self.state_bytes_for(DType::F32)
    }

    fn state_bytes_for(&self, value: DType) -> usize {
        2 * self.moment_dtype(value).size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryCategory;
    use crate::optim::Param;
    use crate::trainer::update_params;

    use crate::device::CpuBackend;
    use crate::precision::Fp32;

    fn param(be: &dyn Backend, name: &str, shape: &[usize], init: &[f32], grad: &[f32]) -> Param {
        let mut p = Param::new(be, name, shape, init, &Fp32).unwrap();
        let g = be
            .upload(grad, shape, DType::F32, MemoryCategory::Gradients, name)
            .unwrap();
        be.cast(p.grad_mut(be).unwrap(), &g).unwrap();
        p
    }

    /// A gradient multiplier, as the trainer's step record holds it.
    fn scale(be: &dyn Backend, value: f32) -> crate::tensor::Tensor {
        be.upload(
            &[value],
            &[1],
            DType::F32,
            MemoryCategory::Workspace,
            "scale",
        )
        .unwrap()
    }

    /// With a constant gradient g the bias-corrected moments are exactly g and g², so
    /// each step is `p ← p·(1 - lr·wd) - lr·g / (|g| + eps)`, and after n steps
    /// `p_n = p_0·aⁿ - c·(1 - aⁿ) / (1 - a)` with `a = 1 - lr·wd`, `c = lr·g / (|g| + eps)`.
    #[test]
    fn constant_gradient_matches_the_closed_form() {
        let be = CpuBackend::new();
        let opt = AdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamW::default()
        };
        let init = [0.5f32, -1.0, 2.0, 0.0, 1.5, -0.25];
        let g = [0.3f32, -0.2, 1e-3, 4.0, -0.7, 0.05];
        // A matrix (decays) and a bias (does not), with the same values.
        let mut params = vec![
            param(&be, "w", &[2, 3], &init, &g),
            param(&be, "b", &[6], &init, &g),
        ];
        let mut opt_mut = opt;
        let n = 7;
        let one = scale(&be, 1.0);
        for step in 1..=n {
            let s = GradScale::new(&one).unwrap();
            update_params(&be, &mut opt_mut, &mut params, opt.lr, s, step, 0).unwrap();
        }
        assert_eq!(
            params[0].state().len(),
            2,
            "moments created lazily, two per parameter"
        );
        for (p, wd) in params.iter().zip([0.1f64, 0.0]) {
            let got = be.to_f32(p.value()).unwrap();
            for i in 0..init.len() {
                let (lr, gi) = (opt.lr as f64, g[i] as f64);
                let a = 1.0 - lr * wd;
                let c = lr * gi / (gi.abs() + opt.eps as f64);
                let an = a.powi(n as i32);
                let want = if wd == 0.0 {
                    init[i] as f64 - c * n as f64
                } else {
                    init[i] as f64 * an - c * (1.0 - an) / (1.0 - a)
                };
                assert!(
                    (got[i] as f64 - want).abs() < 2e-6,
                    "{}[{i}]: {} vs closed form {want}",
                    p.name(),
                    got[i]
                );
            }
        }
    }

    /// Varying gradients against the recurrence of `torch.optim.AdamW`, in f64.
    #[test]
    fn varying_gradients_match_pytorch_recurrence() {
        let be = CpuBackend::new();
        let mut opt = AdamW::default();
        let init = [0.1f32, -0.2, 0.3, 0.4];
        let mut p_ref: Vec<f64> = init.iter().map(|v| *v as f64).collect();
        let (mut m, mut v) = (vec![0f64; 4], vec![0f64; 4]);
        let mut params = vec![param(&be, "w", &[2, 2], &init, &[0.0; 4])];
        for step in 1..=5u64 {
            let g: Vec<f32> = (0..4)
                .map(|i| ((step as f32) * 0.7 + i as f32).sin())
                .collect();
            let gt = be
                .upload(&g, &[2, 2], DType::F32, MemoryCategory::Gradients, "g")
                .unwrap();
            be.cast(params[0].grad_mut(&be).unwrap(), &gt).unwrap();
            let lr = 1e-3 * step as f32;
            let clip = 0.5;
            let s = scale(&be, clip);
            update_params(
                &be,
                &mut opt,
                &mut params,
                lr,
                GradScale::new(&s).unwrap(),
                step,
                0,
            )
            .unwrap();
            let (b1, b2, eps, wd) = (0.9f64, 0.95f64, 1e-8f64, 0.1f64);
            for i in 0..4 {
                let gi = g[i] as f64 * clip as f64;
                p_ref[i] *= 1.0 - lr as f64 * wd;
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let bc1 = 1.0 - b1.powi(step as i32);
                let bc2 = 1.0 - b2.powi(step as i32);
                p_ref[i] -= lr as f64 / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + eps);
            }
        }
        let got = be.to_f32(params[0].value()).unwrap();
        for i in 0..4 {
            assert!(
                (got[i] as f64 - p_ref[i]).abs() < 1e-6,
                "{i}: {} vs {}",
                got[i],
                p_ref[i]
            );
        }
    }

    /// A multiplier that is not finite (the step's loss or norm was not) skips the whole
    /// update: values and moments stay bitwise as they were.
    #[test]
    fn a_non_finite_scale_leaves_values_and_moments_untouched() {
        let be = CpuBackend::new();
        let mut opt = AdamW::default();
        let init = [0.1f32, -0.2, 0.3, 0.4];
        let mut params = vec![param(&be, "w", &[2, 2], &init, &[0.5, -0.5, 1.0, 2.0])];
        let one = scale(&be, 1.0);
        update_params(
            &be,
            &mut opt,
            &mut params,
            1e-2,
            GradScale::new(&one).unwrap(),
            1,
            0,
        )
        .unwrap();
        let before = be.to_f32(params[0].value()).unwrap();
        let moments: Vec<Vec<f32>> = params[0]
            .state()
            .iter()
            .map(|m| be.to_f32(m).unwrap())
            .collect();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let s = scale(&be, bad);
            update_params(
                &be,
                &mut opt,
                &mut params,
                1e-2,
                GradScale::new(&s).unwrap(),
                2,
                0,
            )
            .unwrap();
            let after = be.to_f32(params[0].value()).unwrap();
            assert_eq!(
                after.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                before.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{bad}"
            );
            for (m, want) in params[0].state().iter().zip(&moments) {
                assert_eq!(&be.to_f32(m).unwrap(), want, "{bad}");
            }
        }
        assert_ne!(before, init, "the finite step moved the values");
    }
}
