//! `LossScale`: the dynamic loss scale of fp16 training (PyTorch GradScaler's semantics,
//! Megatron-LM's hysteresis and minimum scale).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The settings of a dynamic loss scale; [`LossScaleState`] is where it stands.
///
/// Each step multiplies the loss by the state's scale. After the step's gradients are
/// checked, [`LossScale::next`]:
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

    /// The state of the first step.
    pub fn initial(&self) -> LossScaleState {
        LossScaleState {
            scale: self.init_scale,
            growth_tracker: 0,
            hysteresis_left: self.hysteresis,
        }
    }

    /// The state after a step whose gradients were all finite (`finite`) or not.
    pub fn next(&self, mut s: LossScaleState, finite: bool) -> LossScaleState {
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
        s
    }
}

impl LossScaleState {
    /// Fails unless the state can be resumed from (a finite scale > 0).
    pub fn check(&self) -> Result<()> {
        if self.scale.is_finite() && self.scale > 0.0 {
            Ok(())
        } else {
            Err(Error::data(
                "trainer state",
                format!(
                    "the saved loss scale {} is not a finite scale > 0; the checkpoint is damaged",
                    self.scale
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loss scale's settings and where it stands.
    struct Scaler {
        settings: LossScale,
        state: LossScaleState,
    }

    impl Scaler {
        fn new(settings: LossScale) -> Scaler {
            let state = settings.initial();
            Scaler { settings, state }
        }
        fn update(&mut self, finite: bool) {
            self.state = self.settings.next(self.state, finite);
        }
        fn current(&self) -> f32 {
            self.state.scale
        }
        fn state(&self) -> LossScaleState {
            self.state
        }
    }

    fn run(scale: &mut Scaler, steps: &[bool]) -> Vec<f32> {
        steps
            .iter()
            .map(|&finite| {
                scale.update(finite);
                scale.current()
            })
            .collect()
    }

    #[test]
    fn gradscaler_defaults_grow_after_2000_finite_steps_and_halve_on_each_overflow() {
        let mut s = Scaler::new(LossScale::default());
        assert_eq!(s.current(), 65536.0);
        let scales = run(&mut s, &vec![true; 1999]);
        assert!(scales.iter().all(|&x| x == 65536.0));
        s.update(true);
        assert_eq!(s.current(), 131072.0);
        assert_eq!(s.state().growth_tracker, 0);
        // Two overflows halve twice; the count of finite steps starts over.
        assert_eq!(
            run(&mut s, &[true, false, false]),
            [131072.0, 65536.0, 32768.0]
        );
        assert_eq!(s.state().growth_tracker, 0);
        run(&mut s, &vec![true; 1999]);
        assert_eq!(s.current(), 32768.0);
        s.update(true);
        assert_eq!(s.current(), 65536.0);
    }

    #[test]
    fn hysteresis_and_the_minimum_follow_megatron() {
        let mut s = Scaler::new(LossScale {
            init_scale: 8.0,
            growth_interval: 3,
            hysteresis: 2,
            min_scale: 2.0,
            ..LossScale::default()
        });
        // The first overflow spends the hysteresis, the second backs off and refills it.
        assert_eq!(
            run(&mut s, &[false, false, false, false, false, false]),
            [8.0, 4.0, 4.0, 2.0, 2.0, 2.0]
        );
        // Growth refills the hysteresis too.
        assert_eq!(run(&mut s, &[true, true, true]), [2.0, 2.0, 4.0]);
        assert_eq!(s.state().hysteresis_left, 2);
        assert_eq!(run(&mut s, &[false, true, false]), [4.0, 4.0, 2.0]);
    }

    #[test]
    fn unit_factors_keep_a_static_scale_and_growth_stops_before_f32_overflows() {
        let mut s = Scaler::new(LossScale {
            init_scale: 1024.0,
            growth_factor: 1.0,
            backoff_factor: 1.0,
            growth_interval: 1,
            ..LossScale::default()
        });
        assert_eq!(run(&mut s, &[true, false, true, false]), [1024.0; 4]);
        let mut s = Scaler::new(LossScale {
            init_scale: f32::MAX,
            growth_interval: 1,
            ..LossScale::default()
        });
        s.update(true);
        assert_eq!(s.current(), f32::MAX);
    }

    #[test]
    fn bad_settings_name_the_field_and_a_saved_state_round_trips() {
        for (bad, field) in [
            (
                LossScale {
                    init_scale: 0.0,
                    ..LossScale::default()
                },
                "init_scale",
            ),
            (
                LossScale {
                    init_scale: f32::INFINITY,
                    ..LossScale::default()
                },
                "init_scale",
            ),
            (
                LossScale {
                    growth_factor: 0.5,
                    ..LossScale::default()
                },
                "growth_factor",
            ),
            (
                LossScale {
                    backoff_factor: 1.5,
                    ..LossScale::default()
                },
                "backoff_factor",
            ),
            (
                LossScale {
                    backoff_factor: 0.0,
                    ..LossScale::default()
                },
                "backoff_factor",
            ),
            (
                LossScale {
                    growth_interval: 0,
                    ..LossScale::default()
                },
                "growth_interval",
            ),
            (
                LossScale {
                    hysteresis: 0,
                    ..LossScale::default()
                },
                "hysteresis",
            ),
            (
                LossScale {
                    min_scale: 1e9,
                    ..LossScale::default()
                },
                "min_scale",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
        LossScale::default().validate().unwrap();
        let mut s = Scaler::new(LossScale::default());
        run(&mut s, &[false, true, true]);
        let saved = s.state();
        saved.check().unwrap();
        let json = serde_json::to_value(saved).unwrap();
        assert_eq!(
            serde_json::from_value::<LossScaleState>(json).unwrap(),
            saved
        );
        for scale in [f32::NAN, 0.0, f32::INFINITY] {
            assert!(LossScaleState { scale, ..saved }.check().is_err());
        }
    }
}
