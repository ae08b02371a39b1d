//! AdamW with PyTorch's semantics.

use super::{Optimizer, Param};
use crate::device::{AdamWStep, Backend};
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::tensor::DType;
use serde::{Deserialize, Serialize};

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
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl AdamW {
    fn validate(&self) -> Result<()> {
        let checks = [
            ("optimizer.lr", self.lr >= 0.0 && self.lr.is_finite(), "a finite value >= 0"),
            ("optimizer.beta1", (0.0..1.0).contains(&self.beta1), "a value in [0, 1)"),
            ("optimizer.beta2", (0.0..1.0).contains(&self.beta2), "a value in [0, 1)"),
            ("optimizer.eps", self.eps > 0.0 && self.eps.is_finite(), "a finite value > 0"),
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

#[typetag::serde(name = "adamw")]
impl Optimizer for AdamW {
    fn learning_rate(&self) -> f32 {
        self.lr
    }

    fn step(
        &mut self,
        backend: &dyn Backend,
        params: &mut [Param],
        lr: f32,
        grad_scale: f32,
        step: u64,
    ) -> Result<()> {
        self.validate()?;
        for p in params.iter_mut() {
            let decay = if p.decays() { self.weight_decay } else { 0.0 };
            let name = p.name().to_string();
            let shape = p.shape().to_vec();
            let (value, grad, state) = p.update_parts()?;
            if state.is_empty() {
                state.push(backend.zeros(&shape, DType::F32, MemoryCategory::OptimizerState, &format!("{name}.exp_avg"))?);
                state.push(backend.zeros(&shape, DType::F32, MemoryCategory::OptimizerState, &format!("{name}.exp_avg_sq"))?);
            }
            let (m, v) = state.split_at_mut(1);
            backend.adamw(
                value,
                grad,
                &mut m[0],
                &mut v[0],
                &AdamWStep {
                    lr,
                    beta1: self.beta1,
                    beta2: self.beta2,
                    eps: self.eps,
                    weight_decay: decay,
                    step,
                    grad_scale,
                },
            )?;
        }
        Ok(())
    }

    fn state_bytes_per_param(&self) -> usize {
        8
    }
}
