//! Stochastic gradient descent with momentum and decoupled weight decay.

use super::{GradScale, Optimizer, Param};
use crate::device::Backend;
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::DType;
use serde::{Deserialize, Serialize};

/// SGD: `buf = momentum · buf + g`, `p = p · (1 - lr · wd) - lr · buf` (no state without
/// momentum). Weight decay applies to tensors of rank >= 2 only, as in [`super::AdamW`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sgd {
    /// Base learning rate.
    pub lr: f32,
    /// Momentum factor (0 = plain SGD).
    pub momentum: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            lr: 1e-2,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }
}

#[typetag::serde(name = "sgd")]
impl Optimizer for Sgd {
    fn learning_rate(&self) -> f32 {
        self.lr
    }

    fn step(
        &mut self,
        backend: &dyn Backend,
        params: &mut [Param],
        lr: f32,
        grad_scale: GradScale<'_>,
        _step: u64,
    ) -> Result<()> {
        // Built from host-valued ops: one wait for the device per step.
        let Some(grad_scale) = grad_scale.read(backend)? else {
            return Ok(());
        };
        for p in params.iter_mut().filter(|p| p.trains()) {
            let wd = if p.decays() { self.weight_decay } else { 0.0 };
            let name = p.name().to_string();
            let shape = p.shape().to_vec();
            let (value, grad, state) = p.update_parts()?;
            if wd != 0.0 {
                backend.scale(value, 1.0 - lr * wd)?;
            }
            if self.momentum == 0.0 {
                backend.axpy(value, -lr * grad_scale, grad)?;
                continue;
            }
            if state.is_empty() {
                state.push(backend.zeros(
                    &shape,
                    DType::F32,
                    MemoryCategory::OptimizerState,
                    &format!("{name}.momentum"),
                )?);
            }
            backend.scale(&mut state[0], self.momentum)?;
            backend.axpy(&mut state[0], grad_scale, grad)?;
            backend.axpy(value, -lr, &state[0])?;
        }
        Ok(())
    }

    fn state_bytes_per_param(&self) -> usize {
        if self.momentum == 0.0 {
            0
        } else {
            4
        }
    }
}
