//! Autofit: the micro-batch size, accumulation steps and recompute policy that fit a
//! memory budget, chosen with the exact memory model.

use super::exact::{predict, MemoryPrediction, MicroBatch};
use crate::checkpoint::{by_cost, CheckpointPolicy, Full, NoRecompute};
use crate::error::{Error, Result};
use crate::memory::{format_bytes, MemoryCategory};
use crate::model::Architecture;
use crate::ops::{AttentionPath, LossPath};
use crate::optim::Optimizer;
use crate::precision::{MixedBf16, Precision};

/// What autofit is asked to fit.
#[derive(Clone, Copy, Debug)]
pub struct FitRequest<'a> {
    /// The model.
    pub model: Architecture,
    /// Tokens per row.
    pub seq_len: usize,
    /// Rows per optimizer step: micro-batch size × accumulation steps.
    pub global_batch: usize,
    /// Bytes the run may use at its peak.
    pub budget: u64,
    /// The precision, kept as given.
    pub precision: &'a dyn Precision,
    /// The optimizer, kept as given.
    pub optimizer: &'a dyn Optimizer,
    /// How the model computes attention (the run's `training.attention`).
    pub attention: AttentionPath,
    /// How the model computes the loss (the run's `training.loss`; the fused loss's
    /// chunk chosen from the vocabulary).
    pub loss: LossPath,
}

/// The exact memory of one micro-batch of `req`'s model, on its attention and loss paths.
fn predict_request(
    req: &FitRequest<'_>,
    micro: MicroBatch,
    precision: &dyn Precision,
    recompute: &dyn CheckpointPolicy,
) -> Result<MemoryPrediction> {
    let model = crate::model::build_with(&req.model, micro.seq_len, req.attention, req.loss)?;
    predict(model, micro, precision, recompute, req.optimizer)
}

/// One setup autofit considered.
#[derive(Clone, Debug)]
pub struct FitCandidate {
    /// Rows per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
    /// The recompute policy.
    pub recompute: Box<dyn CheckpointPolicy>,
    /// Its exact memory.
    pub prediction: MemoryPrediction,
    /// The peak over any step (the first step included).
    pub peak: u64,
}

/// Autofit's choice, with what it tried.
#[derive(Clone, Debug)]
pub struct FitPlan {
    /// The chosen setup.
    pub choice: FitCandidate,
    /// The budget it fits.
    pub budget: u64,
    /// For each policy, the largest micro-batch that fits (or `None`), in the order of
    /// [`by_cost`].
    pub per_policy: Vec<(Box<dyn CheckpointPolicy>, Option<FitCandidate>)>,
    /// The setup without accumulation nor recomputation, for the explanation.
    pub unconstrained: FitCandidate,
}

impl FitPlan {
    /// Lines explaining the choice.
    pub fn explain(&self) -> Vec<String> {
        let c = &self.choice;
        let mut lines = vec![format!(
            "autofit: micro-batch {} × {}, recompute {}: peak {} of a {} budget",
            c.micro_batch,
            micro_batches(c.micro_batches),
            c.recompute.typetag_name(),
            format_bytes(c.peak),
            format_bytes(self.budget)
        )];
        let u = &self.unconstrained;
        if u.peak > self.budget {
            lines.push(format!(
                "  the whole batch of {} rows at once without recompute would need {}",
                u.micro_batch,
                format_bytes(u.peak)
            ));
        }
        for (policy, best) in &self.per_policy {
            lines.push(match best {
                Some(b) => format!(
                    "  recompute {:<9} largest micro-batch that fits: {} ({}, peak {}, activations {})",
                    policy.typetag_name(),
                    b.micro_batch,
                    micro_batches(b.micro_batches),
                    format_bytes(b.peak),
                    format_bytes(b.prediction.activations.peak)
                ),
                None => format!(
                    "  recompute {:<9} does not fit even with micro-batch 1",
                    policy.typetag_name()
                ),
            });
        }
        lines.push(
            "  rule: the least recomputation first, then the fewest micro-batches".to_string(),
        );
        lines
    }
}

/// `1 micro-batch`, `4 micro-batches`.
fn micro_batches(n: usize) -> String {
    if n == 1 {
        "1 micro-batch".to_string()
    } else {
        format!("{n} micro-batches")
    }
}

fn candidate(
    req: &FitRequest<'_>,
    micro_batch: usize,
    recompute: &(dyn CheckpointPolicy + 'static),
) -> Result<FitCandidate> {
    let prediction = predict_request(
        req,
        MicroBatch {
            batch_size: micro_batch,
            seq_len: req.seq_len,
        },
        req.precision,
        recompute,
    )?;
    let micro_batches = req.global_batch / micro_batch;
    Ok(FitCandidate {
        micro_batch,
        micro_batches,
        recompute: dyn_clone::clone_box(recompute),
        peak: prediction
            .peak_total
            .max(prediction.first_step_peak_total(micro_batches)),
        prediction,
    })
}

/// Chooses the micro-batch size (a divisor of the global batch), the accumulation steps
/// and the recompute policy that fit `req.budget`: the least recomputation first, then
/// the fewest micro-batches.
///
/// When nothing fits, the error says what would: the budget needed, and where it helps,
/// mixed precision or the longest sequence that fits.
pub fn autofit(req: &FitRequest<'_>) -> Result<FitPlan> {
    if req.global_batch == 0 {
        return Err(Error::config("global_batch", "must be at least 1 row"));
    }
    let divisors: Vec<usize> = (1..=req.global_batch)
        .rev()
        .filter(|d| req.global_batch % d == 0)
        .collect();
    let mut per_policy = Vec::new();
    for recompute in by_cost() {
        // Memory grows with the micro-batch: find the largest divisor that fits.
        let mut best = None;
        for &m in &divisors {
            let c = candidate(req, m, recompute.as_ref())?;
            if c.peak <= req.budget {
                best = Some(c);
                break;
            }
        }
        per_policy.push((recompute, best));
    }
    let unconstrained = candidate(req, req.global_batch, &NoRecompute)?;
    match per_policy.iter().find_map(|(_, b)| b.clone()) {
        Some(choice) => Ok(FitPlan {
            choice,
            budget: req.budget,
            per_policy,
            unconstrained,
        }),
        None => Err(Error::OutOfMemory {
            message: what_would_fit(req)?,
        }),
    }
}

/// The message of a run that cannot fit: what it needs and what would fit.
fn what_would_fit(req: &FitRequest<'_>) -> Result<String> {
    let least = candidate(req, 1, &Full)?;
    let state = least.prediction.model_state_bytes();
    let mut msg = format!(
        "nothing fits {}: even micro-batch 1 with full recompute peaks at {} (model state {}, \
         activations {})",
        format_bytes(req.budget),
        format_bytes(least.peak),
        format_bytes(state),
        format_bytes(least.prediction.peak.get(MemoryCategory::Activations))
    );
    let mut fixes = vec![format!("a budget of at least {}", format_bytes(least.peak))];
    if req.precision.compute_dtype() != crate::tensor::DType::Bf16 {
        let mixed = MixedBf16 { fp32_grads: false };
        let p = predict_request(
            req,
            MicroBatch {
                batch_size: 1,
                seq_len: req.seq_len,
            },
            &mixed,
            &Full,
        )?;
        let peak = p.peak_total.max(p.first_step_peak_total(req.global_batch));
        if peak <= req.budget {
            fixes.push(format!(
                "--precision bf16 (bf16 gradients: peak {})",
                format_bytes(peak)
            ));
        }
    }
    if state < req.budget {
        // The longest sequence that fits with micro-batch 1 and full recompute.
        let (mut lo, mut hi) = (0usize, req.seq_len);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            let shorter = FitRequest {
                seq_len: mid,
                ..*req
            };
            if candidate(&shorter, 1, &Full)?.peak <= req.budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if lo > 0 {
            fixes.push(format!("--seq-len {lo} or shorter"));
        }
    } else {
        msg.push_str("; the model state alone exceeds the budget, whatever the batch");
        fixes.push("a smaller model".to_string());
    }
    msg.push_str(&format!("; what would fit: {}", fixes.join(", or ")));
    Ok(msg)
}
