//! Optimizers, learning-rate schedules and gradient clipping.

pub mod adamw;
pub mod adamw8bit;
mod clip;
pub mod guard;
mod schedule;
mod sgd;

pub use crate::model::Param;
pub use adamw::{AdamW, AdamWStep};
pub use adamw8bit::{AdamW8bit, QuantizedMoments};
pub use clip::{clip_coefficient, global_grad_norm};
pub use guard::{GradScale, StepRecord};
pub use schedule::LrSchedule;
pub use sgd::Sgd;

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use dyn_clone::DynClone;
use std::fmt::Debug;

/// One optimizer state tensor a parameter needs ([`Optimizer::state_slots`]): the trainer
/// allocates it, zeroed, before the parameter's first update, labelled
/// `{parameter}.{name}` in the memory ledger and saved in checkpoints in slot order.
#[derive(Clone, Debug, PartialEq)]
pub struct StateSlot {
    /// The slot's name after the parameter's (`exp_avg`, `momentum`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
}

impl StateSlot {
    /// A slot named `name` of `shape` and `dtype`.
    pub fn new(name: &str, shape: &[usize], dtype: DType) -> Self {
        StateSlot {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype,
        }
    }
}

/// One trainable parameter as an optimizer updates it: what the trainer hands
/// [`Optimizer::update`]. Frozen parameters never appear; the state slots are allocated.
pub struct ParamUpdate<'a> {
    /// The parameter's name.
    pub name: &'a str,
    /// The f32 values to update (master weights, or the weights themselves when they are
    /// f32; pure bf16's widened copy).
    pub values: &'a mut Tensor,
    /// The compute weights to overwrite with the updated values rounded to their dtype,
    /// when the optimizer asked for them ([`Optimizer::writes_compute`]) and they are
    /// kept apart from `values`; the optimizer must write them when it gets them.
    pub compute: Option<&'a mut Tensor>,
    /// The accumulated gradient (multiply it by the step's [`GradScale`]).
    pub grad: &'a Tensor,
    /// The state slots [`Optimizer::state_slots`] declared (or those a resumed run
    /// loaded), in order.
    pub state: &'a mut [Tensor],
    /// Whether weight decay applies: matrices and embeddings (rank >= 2), not biases,
    /// norm gains or DoRA magnitudes.
    pub decays: bool,
}

/// Updates parameters from their gradients.
///
/// An optimizer value holds hyper-parameters. The trainer decides what trains and calls
/// [`Optimizer::update`] with those parameters alone; their state (moments, momentum)
/// lives in each [`Param`]'s state slots, which the trainer allocates as
/// [`Optimizer::state_slots`] declares before a parameter's first update (so optimizer
/// memory appears at step 1, as in PyTorch). [`crate::trainer::update_params`] runs one
/// update of a set of parameters the way the trainer does.
#[typetag::serde(tag = "kind")]
pub trait Optimizer: DynClone + Debug + Send + Sync {
    /// The base learning rate (schedules scale from it).
    fn learning_rate(&self) -> f32;

    /// The state tensors a parameter of `shape`, whose values are kept in `kept`
    /// ([`Param::kept_dtype`]), needs; none by default.
    fn state_slots(&self, shape: &[usize], kept: DType) -> Vec<StateSlot> {
        let _ = (shape, kept);
        Vec::new()
    }

    /// Whether [`Optimizer::update`] writes the compute weights in the same pass as the
    /// values ([`ParamUpdate::compute`]), as the fused AdamW kernel does; when false, the
    /// default, the trainer rounds the values into them after the update.
    fn writes_compute(&self) -> bool {
        false
    }

    /// One update of `params`, every one of which trains. `lr` is this step's learning
    /// rate, `grad_scale` multiplies every gradient (clipping and loss-scale removal; it
    /// lives on the device, and when it is not finite the update must be skipped, see
    /// [`GradScale`]), and `step` is 1-based. The trainer calls it with every parameter
    /// at once, or with one at a time (pure bf16, the optimizer offloaded or inside
    /// backward): the result must not depend on how they are grouped.
    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
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
    fn state_slots(&self, shape: &[usize], kept: DType) -> Vec<StateSlot> {
        (**self).state_slots(shape, kept)
    }
    fn writes_compute(&self) -> bool {
        (**self).writes_compute()
    }
    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
        lr: f32,
        grad_scale: GradScale<'_>,
        step: u64,
    ) -> Result<()> {
        (**self).update(backend, params, lr, grad_scale, step)
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

/// The error of a parameter whose state slots are not the layout `optimizer` keeps
/// (`want`): a checkpoint written by another optimizer.
pub(crate) fn state_layout(optimizer: &str, param: &str, got: usize, want: &str) -> Error {
    Error::Backend {
        backend: "optimizer",
        message: format!(
            "`{param}` has {got} optimizer state tensors; {optimizer} keeps {want}. Resume \
             with the optimizer the checkpoint was trained with"
        ),
    }
}
