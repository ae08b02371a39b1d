//! Defaults of a run that starts from a trained model (`--init-from`): the learning rate,
//! warmup, schedule and AdamW settings of the fine-tuning recipes users know
//! (transformers' `TrainingArguments`, TRL's SFT and PEFT's LoRA examples), in place of the
//! pretraining demo's (lr 2e-3, 25 warmup steps, β₂ 0.95, weight decay 0.1).

use super::{overrides::set_optimizer_field, Overrides, RunConfig};
use crate::error::Result;
use crate::optim::LrSchedule;

/// The settings a fine-tuning run gets unless a flag or a config file says otherwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FineTuning {
    /// Base learning rate: 2e-5 for a full fine-tune, 2e-4 for LoRA and QLoRA.
    pub lr: f32,
    /// Warmup as a fraction of the run's steps (rounded up): 0.03, TRL's and the QLoRA
    /// recipes' `warmup_ratio`.
    pub warmup_ratio: f64,
    /// Where the cosine decay ends, as a fraction of the base rate: 0, as transformers'
    /// `cosine` schedule.
    pub min_lr_ratio: f32,
    /// AdamW's second-moment decay: 0.999 (`TrainingArguments.adam_beta2`).
    pub beta2: f32,
    /// Decoupled weight decay: 0 (`TrainingArguments.weight_decay`).
    pub weight_decay: f32,
}

impl FineTuning {
    /// The defaults of a full fine-tune (`adapter` false) or of a LoRA/QLoRA run.
    pub fn new(adapter: bool) -> Self {
        FineTuning {
            lr: if adapter { 2e-4 } else { 2e-5 },
            warmup_ratio: 0.03,
            min_lr_ratio: 0.0,
            beta2: 0.999,
            weight_decay: 0.0,
        }
    }

    /// Warmup steps of a run of `steps` steps: the ratio, rounded up.
    pub fn warmup_steps(&self, steps: u64) -> u64 {
        (steps as f64 * self.warmup_ratio).ceil() as u64
    }
}

impl RunConfig {
    /// Lays [`FineTuning`]'s defaults (for this run's adapter, or a full fine-tune) over
    /// the settings `flags` leave unset: `--lr`, `--warmup-steps`, `--lr-schedule`,
    /// `--weight-decay`, and β₂ (no flag) where the optimizer has these settings. Returns
    /// a line saying what was set, for the run's first lines.
    pub fn apply_fine_tuning_defaults(&mut self, flags: &Overrides) -> Result<String> {
        let d = FineTuning::new(self.adapter.is_some());
        let steps = self.training.steps;
        let warmup = flags.warmup_steps.unwrap_or_else(|| d.warmup_steps(steps));
        // `--lr-schedule` was checked by [`Overrides::apply`]; only its kind is kept.
        self.training.lr_schedule = match self.training.lr_schedule {
            LrSchedule::Constant { .. } if flags.lr_schedule.is_some() => LrSchedule::Constant {
                warmup_steps: warmup,
            },
            _ => LrSchedule::Cosine {
                warmup_steps: warmup,
                decay_steps: 0,
                min_lr_ratio: d.min_lr_ratio,
            },
        };
        let mut set = Vec::new();
        let fields = [
            ("learning rate", flags.lr.is_none(), d.lr),
            ("weight_decay", flags.weight_decay.is_none(), d.weight_decay),
            ("beta2", true, d.beta2),
        ];
        for (field, unset, value) in fields {
            if !unset {
                continue;
            }
            let key = if field == "learning rate" {
                "lr"
            } else {
                field
            };
            if let Ok(o) = set_optimizer_field(self.optimizer.as_ref(), key, key, value) {
                self.optimizer = o;
                set.push(match key {
                    "lr" => format!("{field} {value:e}"),
                    _ => format!("{field} {value}"),
                });
            }
        }
        if flags.warmup_steps.is_none() {
            set.push(format!(
                "warmup {warmup} steps ({}% of {steps})",
                d.warmup_ratio * 100.0
            ));
        }
        if matches!(self.training.lr_schedule, LrSchedule::Cosine { .. }) {
            set.push(format!("cosine decay to {}×", d.min_lr_ratio));
        }
        self.validate()?;
        Ok(format!(
            "fine-tuning defaults ({}): {} (flags or a --config file override them)",
            if self.adapter.is_some() {
                "an adapter"
            } else {
                "a full fine-tune"
            },
            set.join(", ")
        ))
    }

    /// A warning when the warmup is longer than the run: the learning rate then never
    /// reaches the optimizer's base rate.
    pub fn warmup_warning(&self) -> Option<String> {
        let steps = self.training.steps;
        let warmup = self.training.lr_schedule.warmup_steps();
        if steps == 0 || warmup <= steps {
            return None;
        }
        let base = self.optimizer.learning_rate();
        let peak = self.training.lr_schedule.lr(base, steps - 1, steps);
        Some(format!(
            "the warmup ({warmup} steps) is longer than the run ({steps} steps): the \
             learning rate peaks at {peak:.3e} on the last step, never at the base {base:.3e}; \
             lower --warmup-steps (e.g. {}) or raise --steps",
            FineTuning::new(self.adapter.is_some()).warmup_steps(steps)
        ))
    }
}
