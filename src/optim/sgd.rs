//! Stochastic gradient descent with momentum and decoupled weight decay.

use super::{state_layout, GradScale, Optimizer, ParamUpdate, StateSlot};
use crate::device::Backend;
use crate::error::Result;
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

    fn state_slots(&self, shape: &[usize], _kept: DType) -> Vec<StateSlot> {
        if self.momentum == 0.0 {
            return Vec::new();
        }
        vec![StateSlot::new("momentum", shape, DType::F32)]
    }

    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
        lr: f32,
        grad_scale: GradScale<'_>,
        _step: u64,
    ) -> Result<()> {
        // Built from host-valued ops: one wait for the device per step.
        let Some(grad_scale) = grad_scale.read(backend)? else {
            return Ok(());
        };
        for p in params.iter_mut() {
            let wd = if p.decays { self.weight_decay } else { 0.0 };
            if wd != 0.0 {
                backend.scale(p.values, 1.0 - lr * wd)?;
            }
            match &mut *p.state {
                _ if self.momentum == 0.0 => backend.axpy(p.values, -lr * grad_scale, p.grad)?,
                [buf] => {
                    backend.scale(buf, self.momentum)?;
                    backend.axpy(buf, grad_scale, p.grad)?;
                    backend.axpy(p.values, -lr, buf)?;
                }
                other => {
                    return Err(state_layout(
                        "sgd",
                        p.name,
                        other.len(),
                        "1 (the momentum) with momentum, none without",
                    ))
                }
            }
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
