//! A run config in the words of a run's first lines: its setup (precision, recompute,
//! optimizer, micro-batch) and its learning-rate course.

use super::RunConfig;
use crate::error::{Error, Result};
use crate::optim::LrSchedule;

/// The `kind` a policy is saved under (`custom` when it has none).
pub fn policy_kind<T: serde::Serialize + ?Sized>(policy: &T) -> Result<String> {
    let v = serde_json::to_value(policy).map_err(|e| Error::Serde(e.to_string()))?;
    Ok(v.get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("custom")
        .to_string())
}

/// `x` as a person writes it: `2e-5`, `0.999`, `0`.
fn number(x: f32) -> String {
    if x != 0.0 && x.abs() < 1e-3 {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

impl RunConfig {
    /// The policies and the micro-batch in one line: `precision mixed_bf16; recompute
    /// selective; optimizer adamw inside backward; 8 micro-batch rows × 1024 tokens`.
    pub fn setup_line(&self) -> Result<String> {
        let t = &self.training;
        Ok(format!(
            "precision {}{}; recompute {}{}; optimizer {}{}{}; {} micro-batch rows × {} tokens",
            policy_kind(&self.precision)?,
            match self.precision.update_rounding() {
                Some(r) => format!(" (no master copy, {r} update rounding)"),
                None => String::new(),
            },
            crate::estimate::policy_name(self.checkpoint.as_ref()),
            if t.offload_activations {
                ", kept activations offloaded to host memory"
            } else {
                ""
            },
            policy_kind(&self.optimizer)?,
            match (t.optimizer_in_backward, self.optimizer_offload) {
                (true, true) =>
                    " inside backward, on the host (master weights and state in host memory)",
                (true, false) => " inside backward",
                (false, true) => " on the host (master weights and state in host memory)",
                (false, false) => "",
            },
            match self.placement.typetag_name() {
                "resident" => String::new(),
                kind @ ("stream_frozen" | "stream_all") => format!(
                    "; {} weights streamed from host memory, {} section{} ahead",
                    if kind == "stream_all" {
                        "all"
                    } else {
                        "frozen"
                    },
                    self.placement.ahead(),
                    if self.placement.ahead() == 1 { "" } else { "s" }
                ),
                other => format!("; weights placed by `{other}`"),
            },
            t.batch_size,
            t.seq_len
        ))
    }

    /// The learning rate's course and the optimizer's settings, in one line:
    /// `learning rate 0.0002, warmup 3 steps, cosine to 0× at step 100; adamw beta1 0.9,
    /// ...`.
    pub fn schedule_line(&self) -> Result<String> {
        let t = &self.training;
        let base = self.optimizer.learning_rate();
        let course = match t.lr_schedule {
            LrSchedule::Constant { .. } => "then constant".to_string(),
            LrSchedule::Cosine {
                decay_steps,
                min_lr_ratio,
                ..
            } => format!(
                "cosine to {min_lr_ratio}× at step {}",
                if decay_steps == 0 {
                    t.steps
                } else {
                    decay_steps
                }
            ),
        };
        let settings =
            serde_json::to_value(&self.optimizer).map_err(|e| Error::Serde(e.to_string()))?;
        let named: Vec<String> = ["beta1", "beta2", "eps", "weight_decay", "momentum"]
            .iter()
            .filter_map(|k| {
                Some(format!(
                    "{k} {}",
                    number(settings.get(*k)?.as_f64()? as f32)
                ))
            })
            .collect();
        Ok(format!(
            "learning rate {}, warmup {} steps, {course}; {} {}",
            number(base),
            t.lr_schedule.warmup_steps(),
            policy_kind(&self.optimizer)?,
            named.join(", ")
        ))
    }
}
