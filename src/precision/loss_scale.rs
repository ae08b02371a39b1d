//! `LossScale`: the dynamic loss scale of fp16 training (PyTorch GradScaler's semantics,
//! Megatron-LM's hysteresis and minimum scale).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The settings of a dynamic loss scale, and its state while training.
///
/// Each step multiplies the loss by [`LossScale::current`]. After the step's gradients are
/// checked, [`LossScale::update`]:
/// - when every gradient was finite, counts the step; after `growth_interval` such steps in
///   a row the scale is multiplied by `growth_factor`;
/// - when any was inf or NaN (the step's update is skipped by the trainer), resets that
///   count and spends one unit of hysteresis; when none is left, the scale is multiplied by
///   `backoff_factor` (never below `min_scale`) and the hysteresis is refilled.
///
/// The defaults are GradScaler's (`init_scale` 65536, growth ×2 every 2000 steps, backoff
/// ×0.5, hysteresis 1, no minimum); Megatron-LM's fp16 runs use `hysteresis = 2`,
/// `min_scale = 1`. `growth_factor = backoff_factor = 1` keeps a static scale.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScale {
    /// The scale of the first step.
    pub init_scale: f32,
    /// Factor the scale grows by after `growth_interval` finite steps in a row (≥ 1).
    pub growth_factor: f32,
    /// Factor the scale shrinks by on an overflow (in (0, 1]).
    pub backoff_factor: f32,
    /// Finite steps in a row before the scale grows (≥ 1).
    pub growth_interval: u32,
    /// Overflowing steps (counted since the last growth or backoff) before the scale
    /// shrinks; 1 shrinks on every one (≥ 1).
    pub hysteresis: u32,
    /// The smallest scale a backoff may reach (0: no minimum).
    pub min_scale: f32,
    /// The running state; `None` until the first update (the scale is then `init_scale`).
    #[serde(skip)]
    state: Option<LossScaleState>,
}

/// What a [`LossScale`] changes while training: the scale and its two counters, saved in
/// the trainer state.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossScaleState {
    /// The current scale.
    pub scale: f32,
    /// Finite steps in a row since the last change of the scale.
    pub growth_tracker: u32,
    /// Overflows still allowed before the next backoff.
    pub hysteresis_left: u32,
}

impl Default for LossScale {
    fn default() -> Self {
        LossScale {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: 0.0,
            state: None,
        }
    }
}

impl LossScale {
    /// Fails, naming the setting and the range it takes, unless every setting is valid.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: String| Err(Error::config(field, why));
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(
                "precision.init_scale",
                format!(
                    "{} is not a finite scale > 0 (GradScaler's default is 65536)",
                    self.init_scale
                ),
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor >= 1.0) {
            return bad(
                "precision.growth_factor",
                format!(
                    "{} is not a finite factor >= 1 (the default is 2)",
                    self.growth_factor
                ),
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor <= 1.0) {
            return bad(
                "precision.backoff_factor",
                format!(
                    "{} is not a factor in (0, 1] (the default is 0.5)",
                    self.backoff_factor
                ),
            );
        }
        if self.growth_interval == 0 {
            return bad(
                "precision.growth_interval",
                "0 steps is not an interval; use 1 or more (the default is 2000)".to_string(),
            );
        }
        if self.hysteresis == 0 {
            return bad(
                "precision.hysteresis",
                "0 is not a hysteresis; use 1 (back off on every overflow) or more".to_string(),
            );
        }
        if !(self.min_scale.is_finite()
            && self.min_scale >= 0.0
            && self.min_scale <= self.init_scale)
        {
            return bad(
                "precision.min_scale",
                format!(
                    "{} is not a scale in [0, init_scale = {}] (0: no minimum)",
                    self.min_scale, self.init_scale
                ),
            );
        }
        Ok(())
    }

    /// The state now: the initial one before any update.
    pub fn state(&self) -> LossScaleState {
        self.state.unwrap_or(LossScaleState {
            scale: self.init_scale,
            growth_tracker: 0,
            hysteresis_left: self.hysteresis,
        })
    }

    /// The scale the next step multiplies its loss by.
    pub fn current(&self) -> f32 {
        self.state().scale
    }

    /// Advances the state after a step whose gradients were all finite (`finite`) or not.
    pub fn update(&mut self, finite: bool) {
        let mut s = self.state();
        if finite {
            s.growth_tracker += 1;
            if s.growth_tracker >= self.growth_interval {
                let grown = s.scale * self.growth_factor;
                // GradScaler keeps the scale when growing would overflow f32.
                if grown.is_finite() {
                    s.scale = grown;
                }
                s.growth_tracker = 0;
                s.hysteresis_left = self.hysteresis;
            }
        } else {
            s.growth_tracker = 0;
            s.hysteresis_left = s.hysteresis_left.saturating_sub(1);
            if s.hysteresis_left == 0 {
                s.scale = (s.scale * self.backoff_factor).max(self.min_scale);
                s.hysteresis_left = self.hysteresis;
            }
        }
        self.state = Some(s);
    }

    /// Restores a saved state (a resume).
    pub fn restore(&mut self, state: LossScaleState) -> Result<()> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(Error::data(
                "trainer state",
                format!(
                    "the saved loss scale {} is not a finite scale > 0; the checkpoint is damaged",
                    state.scale
                ),
            ));
        }
        self.state = Some(state);
        Ok(())
    }
}
