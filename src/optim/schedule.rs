//! Learning-rate schedules.

use serde::{Deserialize, Serialize};

/// How the learning rate changes over optimizer steps, relative to the optimizer's base.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum LrSchedule {
    /// Linear warmup over `warmup_steps`, then the base rate (exactly, every step).
    Constant {
        /// Steps of linear warmup (0 = none).
        #[serde(default)]
        warmup_steps: u64,
    },
    /// Linear warmup, then cosine decay to `min_lr_ratio · base` at `decay_steps`
    /// (the run's step count when 0), constant after.
    Cosine {
        /// Steps of linear warmup.
        #[serde(default)]
        warmup_steps: u64,
        /// Step at which the decay ends (0: the run's last step).
        #[serde(default)]
        decay_steps: u64,
        /// Final learning rate as a fraction of the base.
        #[serde(default)]
        min_lr_ratio: f32,
    },
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule::Constant { warmup_steps: 0 }
    }
}

impl LrSchedule {
    /// Steps of linear warmup.
    pub fn warmup_steps(&self) -> u64 {
        match *self {
            LrSchedule::Constant { warmup_steps } | LrSchedule::Cosine { warmup_steps, .. } => {
                warmup_steps
            }
        }
    }

    /// Learning rate of optimizer step `step` (0-based) for a base rate `base` in a run of
    /// `total_steps` steps. Warmup follows llm.c: `base · (step + 1) / warmup_steps`.
    pub fn lr(&self, base: f32, step: u64, total_steps: u64) -> f32 {
        match *self {
            LrSchedule::Constant { warmup_steps } => {
                if step < warmup_steps {
                    base * (step + 1) as f32 / warmup_steps as f32
                } else {
                    base
                }
            }
            LrSchedule::Cosine {
                warmup_steps,
                decay_steps,
                min_lr_ratio,
            } => {
                if step < warmup_steps {
                    return base * (step + 1) as f32 / warmup_steps as f32;
                }
                let end = if decay_steps == 0 {
                    total_steps
                } else {
                    decay_steps
                };
                let min = base * min_lr_ratio;
                if step >= end || end <= warmup_steps {
                    return min;
                }
                let ratio = (step - warmup_steps) as f64 / (end - warmup_steps) as f64;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                min + (coeff as f32) * (base - min)
            }
        }
    }
}
