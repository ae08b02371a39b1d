//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), written
//! outside trainkit as a downstream crate would: one user kernel with its CUDA C source and
//! its CPU twin, run through `Backend::custom`, and an `Optimizer` that config files name
//! `kind = "lion"`.
//!
//! Per element, with `g` the gradient times the step's multiplier (clipping and loss-scale
//! removal) and `m` the one state tensor:
//!
//! ```text
//! c = β1·m + (1 − β1)·g
//! p = p·(1 − lr·wd) − lr·sign(c)
//! m = β2·m + (1 − β2)·g
//! ```
//!
//! as lucidrains/lion-pytorch computes it. Weight decay applies to tensors of rank >= 2
//! only, as trainkit's AdamW does; a multiplier that is not finite skips the update.

use serde::{Deserialize, Serialize};
use trainkit::device::CustomKernel;
use trainkit::optim::{GradScale, ParamUpdate, StateSlot};
use trainkit::{Backend, DType, Error, Optimizer, Result};

/// The Lion update of one parameter tensor: outputs `param` and `m` (f32), inputs the
/// gradient and the one-element gradient multiplier, scalars `lr`, `beta1`, `beta2` and
/// `decay = 1 − lr·wd`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LionUpdate;

impl LionUpdate {
    /// The CUDA C source (trainkit prepends its common header: `i64`, `TK_FOR_EACH`).
    pub const SOURCE: &'static str = r#"
// sign(c) as torch.sign: 0 for 0 (and for NaN, which the multiplier check keeps out).
__device__ __forceinline__ float lion_sign(float c) {
    return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
}

extern "C" __global__ void lion_update(float* param, float* m, const float* grad,
                                       const float* scale, float lr, float beta1,
                                       float beta2, float decay, i64 n) {
    const float s = scale[0];
    if (!isfinite(s)) return;
    TK_FOR_EACH(i, n) {
        const float g = grad[i] * s;
        const float c = beta1 * m[i] + (1.0f - beta1) * g;
        param[i] = param[i] * decay - lr * lion_sign(c);
        m[i] = beta2 * m[i] + (1.0f - beta2) * g;
    }
}
"#;
}

/// `torch.sign` of an f32.
fn sign(c: f32) -> f32 {
    if c > 0.0 {
        1.0
    } else if c < 0.0 {
        -1.0
    } else {
        0.0
    }
}

impl CustomKernel for LionUpdate {
    fn name(&self) -> &'static str {
        "lion_update"
    }

    fn source(&self) -> &'static str {
        Self::SOURCE
    }

    fn cpu(
        &self,
        outputs: &mut [&mut [f32]],
        inputs: &[&[f32]],
        scalars: &[f32],
        n: usize,
    ) -> Result<()> {
        let [param, m] = outputs else {
            return Err(Error::config("lion", "the update writes param and m"));
        };
        let (&[grad, scale], &[lr, beta1, beta2, decay]) = (inputs, scalars) else {
            return Err(Error::config(
                "lion",
                "the update reads grad, scale and 4 scalars",
            ));
        };
        let s = scale[0];
        if !s.is_finite() {
            return Ok(());
        }
        for i in 0..n {
            // The kernel's operations, in its order.
            let g = grad[i] * s;
            let c = beta1 * m[i] + (1.0 - beta1) * g;
            param[i] = param[i] * decay - lr * sign(c);
            m[i] = beta2 * m[i] + (1.0 - beta2) * g;
        }
        Ok(())
    }

    fn flops_per_element(&self) -> u64 {
        11
    }
}

/// Lion with decoupled weight decay; defaults as lion-pytorch's (`lr` 1e-4, betas
/// (0.9, 0.99), no weight decay). Use a learning rate 3–10× smaller than AdamW's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Lion {
    /// Base learning rate.
    pub lr: f32,
    /// Interpolation between momentum and gradient for the update's sign.
    pub beta1: f32,
    /// Momentum decay.
    pub beta2: f32,
    /// Decoupled weight decay for matrices and embeddings.
    pub weight_decay: f32,
}

impl Default for Lion {
    fn default() -> Self {
        Lion {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
        }
    }
}

impl Lion {
    fn validate(&self) -> Result<()> {
        let checks = [
            (
                "optimizer.lr",
                self.lr >= 0.0 && self.lr.is_finite(),
                "a finite value >= 0",
            ),
            (
                "optimizer.beta1",
                (0.0..=1.0).contains(&self.beta1),
                "a value in [0, 1]",
            ),
            (
                "optimizer.beta2",
                (0.0..=1.0).contains(&self.beta2),
                "a value in [0, 1]",
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
        Ok(())
    }
}

#[typetag::serde(name = "lion")]
impl Optimizer for Lion {
    fn learning_rate(&self) -> f32 {
        self.lr
    }

    /// One f32 momentum tensor per parameter (the trainer allocates it, zeroed).
    fn state_slots(&self, shape: &[usize], _kept: DType) -> Vec<StateSlot> {
        vec![StateSlot::new("exp_avg", shape, DType::F32)]
    }

    /// Every parameter handed here trains: the trainer filters, allocates the state and
    /// writes the compute weights afterwards.
    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
        lr: f32,
        grad_scale: GradScale<'_>,
        _step: u64,
    ) -> Result<()> {
        self.validate()?;
        for p in params.iter_mut() {
            let wd = if p.decays { self.weight_decay } else { 0.0 };
            // The multiplier stays on the device: the kernel reads it (no wait here).
            backend.custom(
                &LionUpdate,
                &mut [&mut *p.values, &mut p.state[0]],
                &[p.grad, grad_scale.tensor()],
                &[lr, self.beta1, self.beta2, 1.0 - lr * wd],
            )?;
        }
        Ok(())
    }

    fn state_bytes_per_param(&self) -> usize {
        4
    }
}
