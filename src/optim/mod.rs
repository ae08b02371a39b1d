//! Optimizers, learning-rate schedules and gradient clipping.

pub mod adamw;
pub mod adamw8bit;
mod clip;
pub mod guard;
mod schedule;
mod sgd;

pub use crate::model::{Param, UpdateParts};
pub use adamw::{AdamW, AdamWStep};
pub use adamw8bit::{AdamW8bit, QuantizedMoments};
pub use clip::{clip_coefficient, global_grad_norm};
pub use guard::{GradScale, StepRecord};
pub use schedule::LrSchedule;
pub use sgd::Sgd;

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::tensor::DType;
use dyn_clone::DynClone;
use std::fmt::Debug;

/// Updates parameters from their gradients.
///
/// An optimizer value holds hyper-parameters; its per-parameter state (moments, momentum)
/// lives in each [`Param`]'s state slots, which the optimizer creates lazily on its first
/// step (so optimizer memory appears at step 1, as in PyTorch).
#[typetag::serde(tag = "kind")]
pub trait Optimizer: DynClone + Debug + Send + Sync {
    /// The base learning rate (schedules scale from it).
    fn learning_rate(&self) -> f32;

    /// One update of every parameter that trains ([`Param::trains`]: a frozen one, which
    /// an [`crate::adapter::Adapter`] leaves without gradient, is skipped and gets no
    /// state). `lr` is this step's learning rate, `grad_scale`
    /// multiplies every gradient (clipping and loss-scale removal; it lives on the device,
    /// and when it is not finite the update must be skipped, see [`GradScale`]), and
    /// `step` is 1-based.
    fn step(
        &mut self,
        backend: &dyn Backend,
        params: &mut [Param],
        lr: f32,
        grad_scale: GradScale<'_>,
        step: u64,
    ) -> Result<()>;

    /// Bytes of optimizer state per parameter element (8 for Adam's two f32 moments), for
    /// a parameter updated in f32 (an f32 master copy or f32 weights).
    fn state_bytes_per_param(&self) -> usize;

    /// Bytes of optimizer state per parameter element for a parameter whose updated value
    /// (its master copy, or without one its weights) is `value`: what
    /// [`Optimizer::state_bytes_per_param`] says unless the state follows the weights'
    /// dtype (AdamW's moments are bf16 beside pure bf16's bf16 weights).
    fn state_bytes_for(&self, value: DType) -> usize {
        let _ = value;
        self.state_bytes_per_param()
    }
}

dyn_clone::clone_trait_object!(Optimizer);

/// The optimizer kinds [`named`] knows, as `--optimizer` takes them.
pub const OPTIMIZER_NAMES: [&str; 3] = ["adamw", "adamw8bit", "sgd"];

/// The optimizer an `--optimizer` value names, with its default settings: `adamw`
/// ([`AdamW`]), `adamw8bit` ([`AdamW8bit`]) or `sgd` ([`Sgd`]).
pub fn named(name: &str) -> Result<Box<dyn Optimizer>> {
    match name {
        "adamw" => Ok(Box::new(AdamW::default())),
        "adamw8bit" => Ok(Box::new(AdamW8bit::default())),
        "sgd" => Ok(Box::new(Sgd::default())),
        other => Err(Error::config(
            "optimizer",
            format!(
                "`{other}` is not an optimizer; use {}",
                OPTIMIZER_NAMES.join(", ")
            ),
        )),
    }
}

/// The optimizer `name` names ([`named`]), taking from `current` every setting the two
/// share (switching `adamw` to `adamw8bit` keeps lr, betas, eps and weight decay;
/// switching to `sgd` keeps lr and weight decay). `current` itself when it is already of
/// that kind.
pub fn switch_to(name: &str, current: &(dyn Optimizer + 'static)) -> Result<Box<dyn Optimizer>> {
    let fresh = named(name)?;
    let json = |o: &dyn Optimizer| serde_json::to_value(o).map_err(|e| Error::Serde(e.to_string()));
    let (old, mut new) = (json(current)?, json(fresh.as_ref())?);
    if old.get("kind") == new.get("kind") {
        return Ok(dyn_clone::clone_box(current));
    }
    if let (Some(old), Some(new)) = (old.as_object(), new.as_object_mut()) {
        for (key, value) in new.iter_mut() {
            if key != "kind" {
                if let Some(v) = old.get(key) {
                    *value = v.clone();
                }
            }
        }
    }
    serde_json::from_value(new).map_err(|e| Error::Serde(e.to_string()))
}

impl<'a> Optimizer for Box<dyn Optimizer + 'a> {
    fn learning_rate(&self) -> f32 {
        (**self).learning_rate()
    }
    fn step(
        &mut self,
        backend: &dyn Backend,
        params: &mut [Param],
        lr: f32,
        grad_scale: GradScale<'_>,
        step: u64,
    ) -> Result<()> {
        (**self).step(backend, params, lr, grad_scale, step)
    }
    fn state_bytes_per_param(&self) -> usize {
        (**self).state_bytes_per_param()
    }
    fn state_bytes_for(&self, value: DType) -> usize {
        (**self).state_bytes_for(value)
    }
    #[doc(hidden)]
    fn typetag_name(&self) -> &'static str {
        (**self).typetag_name()
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}
