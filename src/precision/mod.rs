//! `Precision`: which dtypes hold weights, activations and gradients, and loss scaling.

mod loss_scale;

pub use loss_scale::{LossScale, LossScaleState};

use crate::error::{Error, Result};
use crate::ops::update_rounding::UpdateRounding;
use crate::tensor::DType;
use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// Chooses the dtypes of training.
///
/// The trainer asks it the compute dtype (weights read by forward and backward, and
/// activations), whether a separate f32 master copy of the weights exists, and the dtype
/// gradients accumulate in. The loss-scale hooks let a precision scale the loss before
/// backward and react to non-finite gradients (identity for f32 and bf16).
#[typetag::serde(tag = "kind")]
pub trait Precision: DynClone + Debug + Send + Sync {
    /// Dtype of the weights used in forward and backward, and of activations.
    fn compute_dtype(&self) -> DType;

    /// Whether an f32 master copy of the weights is kept apart from the compute weights.
    /// When false, the compute weights are f32 and the optimizer updates them in place.
    fn master_weights(&self) -> bool;

    /// Dtype gradients are accumulated in across micro-batches.
    fn grad_dtype(&self) -> DType;

    /// How an update is written back into weights narrower than f32 that have no master
    /// copy ([`PureBf16`]); `None` for the others, whose optimizer updates f32 values
    /// (the master copy, or f32 weights). A precision without master weights must compute
    /// in f32 or say this.
    fn update_rounding(&self) -> Option<UpdateRounding> {
        None
    }

    /// Factor the loss is multiplied by before backward (1 without loss scaling).
    fn loss_scale(&self) -> f32 {
        1.0
    }

    /// Called after each step's gradients are checked; `finite` is false when any was not.
    fn update_loss_scale(&mut self, finite: bool) {
        let _ = finite;
    }

    /// Fails, naming the setting and its valid range, when the precision's settings cannot
    /// work; [`crate::Trainer::new`] calls it before the first step.
    fn validate(&self) -> Result<()> {
        Ok(())
    }

    /// Whether a step skipped for non-finite gradients under this precision is the loss
    /// scale's doing (an overflow the scale answers by shrinking) rather than a sign of
    /// divergence. The trainer does not count such steps towards
    /// [`crate::TrainerOptions::max_bad_steps`]. False by default.
    fn overflow_expected(&self) -> bool {
        false
    }

    /// The state a resume must restore beside the configuration (a dynamic loss scale and
    /// its counters), saved in the trainer state; `None` when there is none.
    fn state(&self) -> Option<serde_json::Value> {
        None
    }

    /// Restores what [`Precision::state`] returned.
    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

dyn_clone::clone_trait_object!(Precision);

impl<'a> Precision for Box<dyn Precision + 'a> {
    fn compute_dtype(&self) -> DType {
        (**self).compute_dtype()
    }
    fn master_weights(&self) -> bool {
        (**self).master_weights()
    }
    fn grad_dtype(&self) -> DType {
        (**self).grad_dtype()
    }
    fn update_rounding(&self) -> Option<UpdateRounding> {
        (**self).update_rounding()
    }
    fn loss_scale(&self) -> f32 {
        (**self).loss_scale()
    }
    fn update_loss_scale(&mut self, finite: bool) {
        (**self).update_loss_scale(finite)
    }
    fn validate(&self) -> Result<()> {
        (**self).validate()
    }
    fn overflow_expected(&self) -> bool {
        (**self).overflow_expected()
    }
    fn state(&self) -> Option<serde_json::Value> {
        (**self).state()
    }
    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        (**self).load_state(state)
    }
    #[doc(hidden)]
    fn typetag_name(&self) -> &'static str {
        (**self).typetag_name()
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// Everything in f32: weights, activations, gradients, optimizer state (16 bytes per
/// parameter with Adam).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp32;

#[typetag::serde(name = "fp32")]
impl Precision for Fp32 {
    fn compute_dtype(&self) -> DType {
        DType::F32
    }
    fn master_weights(&self) -> bool {
        false
    }
    fn grad_dtype(&self) -> DType {
        DType::F32
    }
}

/// bf16 compute with f32 master weights: weights are cast to bf16 for forward and
/// backward, activations are bf16, matmuls accumulate in f32, norms, softmax and the loss
/// are computed in f32, gradients accumulate in f32 (`fp32_grads`) or bf16, and the
/// optimizer updates the f32 master copy, which is then cast back to bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixedBf16 {
    /// Accumulate gradients in f32 (true) or bf16 (false).
    #[serde(default = "default_true")]
    pub fp32_grads: bool,
}

fn default_true() -> bool {
    true
}

impl Default for MixedBf16 {
    fn default() -> Self {
        MixedBf16 { fp32_grads: true }
    }
}

#[typetag::serde(name = "mixed_bf16")]
impl Precision for MixedBf16 {
    fn compute_dtype(&self) -> DType {
        DType::Bf16
    }
    fn master_weights(&self) -> bool {
        true
    }
    fn grad_dtype(&self) -> DType {
        if self.fp32_grads {
            DType::F32
        } else {
            DType::Bf16
        }
    }
}

/// bf16 weights without an f32 master copy ("pure bf16", torchtune's full fine-tunes):
/// weights, activations and gradients in bf16, and only the optimizer state in f32 (or 8
/// bits). Each parameter's update is computed in f32, in a transient buffer the weights
/// are widened into one parameter at a time, and written back as `rounding` says:
/// to nearest (torchtune's; updates below half a bf16 step are lost), stochastically
/// (unbiased), or Kahan-compensated (the rounding error kept in a bf16 buffer per
/// parameter, `{name}.kahan`: +2 bytes per parameter, saved in checkpoints). See
/// [`crate::ops::update_rounding`].
///
/// Per parameter it keeps 2 bytes of weights and 2 of gradient where mixed bf16 keeps 2,
/// 4 and 4 (f32 gradients) or 2: 6 to 8 bytes less per parameter, 48 to 64 GB for an 8B
/// model. In a config: `precision = { kind = "pure_bf16", rounding = "kahan" }`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PureBf16 {
    /// How updates are written back into the bf16 weights.
    #[serde(default)]
    pub rounding: UpdateRounding,
}

#[typetag::serde(name = "pure_bf16")]
impl Precision for PureBf16 {
    fn compute_dtype(&self) -> DType {
        DType::Bf16
    }
    fn master_weights(&self) -> bool {
        false
    }
    fn grad_dtype(&self) -> DType {
        DType::Bf16
    }
    fn update_rounding(&self) -> Option<UpdateRounding> {
        Some(self.rounding)
    }
}

/// `precision` with the master-weight choice of `--master-weights` (`f32`, or `none` for
/// [`PureBf16`]) and the rounding of `--update-rounding` applied; errors name the flag
/// and what would work: no master copy needs bf16 compute (fp32 weights are their own
/// f32 values; fp16 needs f32 master weights for its loss scale), and an update rounding
/// needs weights without a master copy.
pub fn with_master_weights(
    precision: Box<dyn Precision>,
    master: Option<&str>,
    rounding: Option<&str>,
) -> Result<Box<dyn Precision>> {
    let rounding = rounding
        .map(|r| UpdateRounding::parse("--update-rounding", r))
        .transpose()?;
    let pure = precision.update_rounding().is_some();
    let rounding_needs_pure = |precision: &dyn Precision| {
        Error::config(
            "--update-rounding",
            match precision.compute_dtype() {
                DType::F32 => {
                    "fp32 updates its f32 weights exactly, there is nothing to round: \
                               the update rounding is for bf16 weights without a master copy \
                               (--precision bf16 --master-weights none)"
                }
                _ => {
                    "the update is rounded only where the weights have no f32 master copy: \
                      add --master-weights none"
                }
            },
        )
    };
    match (master, rounding) {
        (None, None) => Ok(precision),
        (None, Some(rounding)) if pure => Ok(Box::new(PureBf16 { rounding })),
        (None | Some("f32"), Some(_)) => Err(rounding_needs_pure(precision.as_ref())),
        // `--master-weights f32` over a pure-bf16 config: mixed bf16.
        (Some("f32"), None) if pure => Ok(Box::new(MixedBf16::default())),
        (Some("f32"), None) => Ok(precision),
        (Some("none"), _) => match precision.compute_dtype() {
            DType::Bf16 => Ok(Box::new(PureBf16 {
                rounding: rounding.or(precision.update_rounding()).unwrap_or_default(),
            })),
            DType::F32 => Err(Error::config(
                "--master-weights",
                "fp32 keeps no master copy (its weights are f32): `none` needs --precision bf16",
            )),
            other => Err(Error::config(
                "--master-weights",
                format!(
                    "{other} weights need an f32 master copy (for the loss scale, and a 5-bit \
                     exponent); `none` needs --precision bf16"
                ),
            )),
        },
        (Some(other), _) => Err(Error::config(
            "--master-weights",
            format!("`{other}` is not a master-weight choice; use f32 or none"),
        )),
    }
}

/// The precision a `--precision` value names: `fp32` ([`Fp32`]), `bf16`
/// ([`MixedBf16`], with f32 gradient accumulation when `fp32_grads`) or `fp16`
/// ([`MixedFp16`] with GradScaler's defaults; its gradients are always f32).
pub fn named(name: &str, fp32_grads: bool) -> Result<Box<dyn Precision>> {
    match name {
        "fp32" => Ok(Box::new(Fp32)),
        "bf16" => Ok(Box::new(MixedBf16 { fp32_grads })),
        "fp16" => Ok(Box::new(MixedFp16::default())),
        other => Err(Error::config(
            "precision",
            format!("`{other}` is not a precision; use fp32, bf16 or fp16"),
        )),
    }
}

/// A short description: `fp32`, `bf16 mixed`, `bf16 mixed, f32 gradient accumulation`, or
/// the policy's `kind` for others.
pub fn describe(precision: &dyn Precision) -> String {
    use crate::tensor::DType;
    match (
        precision.compute_dtype(),
        precision.master_weights(),
        precision.grad_dtype(),
    ) {
        (DType::F32, false, _) => "fp32".to_string(),
        (DType::Bf16, true, DType::Bf16) => "bf16 mixed".to_string(),
        (DType::Bf16, true, DType::F32) => "bf16 mixed, f32 gradient accumulation".to_string(),
        (DType::Bf16, false, _) => match precision.update_rounding() {
            Some(r) => format!("bf16 pure (no master copy), {r} update rounding"),
            None => precision.typetag_name().to_string(),
        },
        (DType::F16, true, DType::F32) => {
            format!("fp16 mixed, dynamic loss scale {}", precision.loss_scale())
        }
        _ => precision.typetag_name().to_string(),
    }
}

/// fp16 compute with f32 master weights and gradients, and a dynamic loss scale.
///
/// Weights are cast to fp16 for forward and backward and activations are fp16, as under
/// [`MixedBf16`]; matmuls accumulate in f32, norms, softmax and the loss are computed in
/// f32, and gradients accumulate in f32. fp16 keeps 10 bits of mantissa (bf16 keeps 7) but
/// only 5 of exponent: its largest value is 65504 and values below 2⁻²⁴ flush to zero, so
/// the loss is multiplied by a scale before backward to lift small gradients out of the
/// underflow range, and the gradients are divided by it before clipping and the update.
///
/// The scale follows [`LossScale`]: PyTorch GradScaler's semantics by default (start at
/// 65536, ×2 after 2000 steps in a row with finite gradients, ×0.5 and the step skipped
/// when any gradient is inf or NaN), with Megatron-LM's hysteresis and minimum scale as
/// options. The scale and its counters are part of the trainer state, so a resume is
/// exact, and each step's scale is logged (`loss_scale` in `--log-json`).
///
/// In a config, the loss scale's settings sit beside the kind:
/// `precision = { kind = "mixed_fp16", init_scale = 65536, hysteresis = 2, min_scale = 1 }`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MixedFp16 {
    /// The loss scale's settings.
    pub scale: LossScale,
    /// Where the scale stands; `None` before the first step (the initial state).
    #[serde(skip)]
    state: Option<LossScaleState>,
}

impl MixedFp16 {
    /// fp16 mixed precision with these loss-scale settings.
    pub fn new(scale: LossScale) -> MixedFp16 {
        MixedFp16 { scale, state: None }
    }

    /// Where the loss scale stands: the scale of the next step and its counters.
    pub fn scale_state(&self) -> LossScaleState {
        self.state.unwrap_or_else(|| self.scale.initial())
    }
}

#[typetag::serde(name = "mixed_fp16")]
impl Precision for MixedFp16 {
    fn compute_dtype(&self) -> DType {
        DType::F16
    }
    fn master_weights(&self) -> bool {
        true
    }
    fn grad_dtype(&self) -> DType {
        DType::F32
    }
    fn loss_scale(&self) -> f32 {
        self.scale_state().scale
    }
    fn update_loss_scale(&mut self, finite: bool) {
        self.state = Some(self.scale.next(self.scale_state(), finite));
    }
    fn validate(&self) -> Result<()> {
        self.scale.validate()
    }
    fn overflow_expected(&self) -> bool {
        // Below a scale of 1 the scaling no longer explains an overflow.
        self.loss_scale() > 1.0
    }
    fn state(&self) -> Option<serde_json::Value> {
        serde_json::to_value(self.scale_state()).ok()
    }
    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let s: LossScaleState = serde_json::from_value(state.clone()).map_err(|e| {
            Error::data(
                "trainer state",
                format!("`precision_state` is not a loss-scale state ({e}); was the checkpoint saved with --precision fp16?"),
            )
        })?;
        s.check()?;
        self.state = Some(s);
        Ok(())
    }
}
