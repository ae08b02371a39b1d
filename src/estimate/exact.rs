//! The exact model of trainkit's own training memory: byte for byte what the ledger will
//! record for a training step under a given model, precision, checkpoint policy and
//! optimizer.
//!
//! The prediction is the real trainer run for two steps on the [`MetaBackend`], whose
//! tensors have shapes and ledger bytes but no elements: the same model code, the same
//! checkpoint policy (the user's own too), the same optimizer and precision, so nothing
//! has to be kept in step with training by hand, and a model of billions of parameters is
//! predicted without allocating its weights.

use crate::accumulate::{AccumulationSchedule, Constant, Ramp};
use crate::checkpoint::CheckpointPolicy;
use crate::collective::{Collective, Rehearsal};
use crate::data::DataLoader;
use crate::device::{Backend, MetaBackend};
use crate::error::{Error, Result};
use crate::memory::{CategoryBytes, MemoryCategory, MemoryEvent, MemoryObserver, Phase};
use crate::model::{Gpt2, Gpt2Config, Model, Shape};
use crate::optim::Optimizer;
use crate::precision::Precision;
use crate::trainer::{Trainer, TrainerOptions};
use serde::Serialize;
use std::sync::Arc;

/// What the activations of one micro-batch do over its forward and backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationProfile {
    /// The most activation bytes live at once.
    pub peak: u64,
    /// The phase in which that peak is reached (the first, if several tie).
    pub peak_phase: Option<Phase>,
    /// Bytes the policy kept for backward over the forward pass.
    pub kept_bytes: u64,
    /// Bytes the policy freed after forward, to be recomputed.
    pub dropped_bytes: u64,
    /// Bytes recomputed during backward.
    pub recomputed_bytes: u64,
    /// Bytes offloaded to host memory after forward (and fetched back in backward).
    pub offloaded_bytes: u64,
}

/// trainkit's memory for one training setup, as the ledger will measure it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPrediction {
    /// Each category's own peak within any optimizer step: model state once every
    /// gradient and optimizer slot exists, activations at their peak, and the step's
    /// workspace (its per-position losses and its 3-element record, live for the whole
    /// step; the CPU backend allocates no other workspace).
    pub peak: CategoryBytes,
    /// The peak of the total in a step after the first (all model state live).
    pub peak_total: u64,
    /// The peak of the total over the first micro-batch of the first step, while
    /// gradients appear one by one during the first backward (no optimizer state yet).
    pub first_micro_batch_peak_total: u64,
    /// The peak of the total in the first step's optimizer phase, while the optimizer
    /// creates its state (one parameter after another; under pure bf16 beside one
    /// parameter's transient f32 copy).
    pub first_update_peak_total: u64,
    /// What lives between steps, per category: the model state (weights, master weights
    /// or the Kahan compensation, gradients unless the optimizer runs inside backward,
    /// optimizer state), without the transients of a step.
    pub kept: CategoryBytes,
    /// The activation profile of a micro-batch.
    pub activations: ActivationProfile,
    /// Bytes of streamed weights copied from host memory to the device in a step
    /// ([`crate::TrainerOptions::placement`]; 0 when every weight is resident): what the
    /// host link carries beside the step's FLOPs ([`MemoryPrediction::hiding_flop_rate`]).
    pub streamed_bytes_per_step: u64,
    /// Floating-point operations a step's ops execute (recomputation included): what the
    /// streamed copies hide behind.
    pub flops_per_step: u64,
}

/// The host link the streamed-weights lines assume when none is named: PCIe 4.0 x16's
/// ~25 GB/s per direction (a 4090's or an A100 PCIe's).
pub const HOST_LINK_BYTES_PER_S: f64 = 25e9;

impl MemoryPrediction {
    /// The peak of the total in the first step of `micro_batches` micro-batches:
    /// gradients appear during the first backward, optimizer state only at the update.
    pub fn first_step_peak_total(&self, micro_batches: usize) -> u64 {
        let p = &self.peak;
        let mut peak = self
            .first_micro_batch_peak_total
            .max(self.first_update_peak_total);
        if micro_batches > 1 {
            // Later micro-batches: every gradient exists, no optimizer state yet, and
            // the master weights without any transient copy of an update.
            let gradients_kept = p.get(MemoryCategory::Weights)
                + self.kept.get(MemoryCategory::MasterWeights)
                + p.get(MemoryCategory::Gradients)
                + p.get(MemoryCategory::Workspace);
            peak = peak.max(gradients_kept + self.activations.peak);
        }
        peak
    }

    /// The host memory a step holds at its peak: the master weights and optimizer state
    /// of an offloaded optimizer (with one parameter's gradient and compute weights
    /// while it updates) and offloaded activations, [`MemoryCategory::Offloaded`]; and
    /// streamed weights, [`MemoryCategory::Streamed`].
    pub fn host_bytes(&self) -> u64 {
        self.peak.host()
    }

    /// The device speed (FLOP/s) below which a step's compute takes longer than copying
    /// its streamed weights over a link of `link_bytes_per_s`, so that the copies can hide
    /// behind it; `None` when nothing streams.
    pub fn hiding_flop_rate(&self, link_bytes_per_s: f64) -> Option<f64> {
        (self.streamed_bytes_per_step > 0).then(|| {
            self.flops_per_step as f64 / (self.streamed_bytes_per_step as f64 / link_bytes_per_s)
        })
    }

    /// Weights, master weights, gradients and optimizer state: what a step keeps between
    /// steps.
    pub fn model_state_bytes(&self) -> u64 {
        self.peak.total()
            - self.peak.get(MemoryCategory::Activations)
            - self.peak.get(MemoryCategory::Workspace)
    }
}

/// The shape of a micro-batch: rows and tokens per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MicroBatch {
    /// Rows (sequences).
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

/// Predicts trainkit's memory for a GPT-2 step, exactly as the ledger will record it
/// (see [`predict`]).
///
/// Fails with a configuration error if the shape is invalid or the sequence is longer
/// than the model's context.
pub fn predict_gpt2(
    config: &Gpt2Config,
    micro: MicroBatch,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
) -> Result<MemoryPrediction> {
    let model = Gpt2::new(config.clone())?;
    predict(Box::new(model), micro, precision, checkpoint, optimizer)
}

/// Predicts trainkit's memory for a step of the model `shape` describes
/// ([`crate::model::build`], with a context of the micro-batch's length where the model
/// has no position table: [`Shape::for_length`]), exactly as the ledger will record it
/// (see [`predict`]).
pub fn predict_shape(
    shape: &Shape,
    micro: MicroBatch,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
) -> Result<MemoryPrediction> {
    predict(
        crate::model::build(&shape.for_length(micro.seq_len))?,
        micro,
        precision,
        checkpoint,
        optimizer,
    )
}

/// Predicts trainkit's memory for a step of `model`, exactly as the ledger will record it
/// on the CPU: two optimizer steps of one micro-batch each run on the [`MetaBackend`].
///
/// Fails with a configuration error if the micro-batch is empty or longer than the
/// model's context.
pub fn predict(
    model: Box<dyn Model>,
    micro: MicroBatch,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
) -> Result<MemoryPrediction> {
    let options = TrainerOptions::default();
    predict_with(model, micro, precision, checkpoint, optimizer, &options)
}

/// [`predict`] for a trainer with `options` (the optimizer inside backward, say).
pub fn predict_with(
    model: Box<dyn Model>,
    micro: MicroBatch,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
    options: &TrainerOptions,
) -> Result<MemoryPrediction> {
    let one = Rehearsal::new(0, 1)?;
    predict_rank(model, micro, precision, checkpoint, optimizer, options, one)
}

/// [`predict_with`] for rank `rank.rank()` of a data-parallel job of `rank.world()` ranks
/// ([`Trainer::join`]): under ZeRO-1 ([`TrainerOptions::zero_stage`]) the share of the
/// optimizer state and master weights that rank keeps, under ZeRO-2 of the gradients
/// too. What a rank's ledger shows.
pub fn predict_rank(
    model: Box<dyn Model>,
    micro: MicroBatch,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
    options: &TrainerOptions,
    rank: Rehearsal,
) -> Result<MemoryPrediction> {
    let (b, t) = (micro.batch_size, micro.seq_len);
    if b == 0 || t == 0 {
        return Err(Error::config(
            "batch_size",
            "batch size and sequence length must be at least 1",
        ));
    }
    let tokens = b
        .checked_mul(t)
        .and_then(|n| n.checked_add(1))
        .ok_or_else(|| Error::config("batch_size", "batch size × sequence length overflows"))?;
    let data = DataLoader::new(vec![0u32; tokens], b, t)?;
    let backend: Arc<dyn Backend> = Arc::new(MetaBackend::new());
    // Separate accumulation costs memory from a step's second micro-batch on (each
    // gradient computed apart beside the running sum): a third step of two micro-batches
    // gives the peaks; the per-step work stays the second step's, one micro-batch.
    let per_micro = (tokens - 1) as u64 * rank.world() as u64;
    let schedule: Box<dyn AccumulationSchedule> = if options.separate_accumulation {
        Box::new(Ramp {
            start_tokens: per_micro,
            end_tokens: 2 * per_micro,
            ramp_tokens: 2 * per_micro,
        })
    } else {
        Box::new(Constant::new(1))
    };
    let mut trainer = Trainer::new(
        model,
        backend,
        data,
        dyn_clone::clone_box(precision),
        dyn_clone::clone_box(checkpoint),
        dyn_clone::clone_box(optimizer),
        schedule,
        PredictionObserver::default(),
        options.clone(),
    )?;
    trainer.join(Arc::new(rank))?;
    trainer.step()?;
    let later = trainer.step()?;
    let memory = if options.separate_accumulation {
        trainer.step()?.memory
    } else {
        later.memory
    };
    let kept = trainer.backend().ledger().snapshot().live;
    let observed = trainer.observer();
    Ok(MemoryPrediction {
        peak: memory.peak,
        peak_total: memory.peak_total,
        first_micro_batch_peak_total: observed.first_micro_batch_peak_total,
        first_update_peak_total: observed.first_update_peak_total,
        kept,
        activations: ActivationProfile {
            peak: later.memory.peak.get(MemoryCategory::Activations),
            peak_phase: observed.activation_peak_phase,
            kept_bytes: later.stash.kept_bytes,
            dropped_bytes: later.stash.dropped_bytes,
            recomputed_bytes: later.stash.recomputed_bytes,
            offloaded_bytes: later.stash.offloaded_bytes,
        },
        streamed_bytes_per_step: later.streamed_bytes,
        flops_per_step: later.hardware_flops,
    })
}

/// Follows the meta run's events for what a step's own peaks do not say: the total's peak
/// over the first micro-batch of the first step, and the phase in which activations peak
/// in a later step.
#[derive(Clone, Debug, Default, Serialize)]
struct PredictionObserver {
    #[serde(skip)]
    live: CategoryBytes,
    #[serde(skip)]
    phases: Vec<Phase>,
    #[serde(skip)]
    steps_done: u64,
    #[serde(skip)]
    first_micro_batch_peak_total: u64,
    #[serde(skip)]
    first_update_peak_total: u64,
    #[serde(skip)]
    activation_peak: u64,
    #[serde(skip)]
    activation_peak_phase: Option<Phase>,
}

#[typetag::serialize(name = "prediction")]
impl MemoryObserver for PredictionObserver {
    fn on_event(&mut self, event: &MemoryEvent) {
        match event {
            MemoryEvent::Alloc {
                category, bytes, ..
            } => {
                *self.live.get_mut(*category) += bytes;
                if self.steps_done == 0 && self.phases.first() == Some(&Phase::MicroBatch(0)) {
                    self.first_micro_batch_peak_total =
                        self.first_micro_batch_peak_total.max(self.live.total());
                }
                if self.steps_done == 0 && self.phases.first() == Some(&Phase::Optimizer) {
                    self.first_update_peak_total =
                        self.first_update_peak_total.max(self.live.total());
                }
                let activations = self.live.get(MemoryCategory::Activations);
                if self.steps_done == 1 && activations > self.activation_peak {
                    self.activation_peak = activations;
                    self.activation_peak_phase = self.phases.last().copied();
                }
            }
            MemoryEvent::Free {
                category, bytes, ..
            } => {
                let live = self.live.get_mut(*category);
                *live = live.saturating_sub(*bytes);
            }
            MemoryEvent::PhaseBegin { phase, .. } => self.phases.push(*phase),
            MemoryEvent::PhaseEnd { .. } => {
                self.phases.pop();
            }
            MemoryEvent::StepEnd { .. } => self.steps_done += 1,
            MemoryEvent::Op { .. } => {}
        }
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Full;
    use crate::optim::AdamW;
    use crate::precision::MixedBf16;

    /// A 20B-parameter GPT-2 would need 80 GB for its master weights alone, more than
    /// the machines that run the tests have: the prediction allocates none of it.
    #[test]
    fn a_model_larger_than_host_memory_is_predicted_without_its_weights() {
        let config = Gpt2Config {
            n_layer: 44,
            n_head: 48,
            n_embd: 6144,
            n_positions: 2048,
            vocab_size: 50257,
            layer_norm_epsilon: 1e-5,
        };
        let n = config.num_params() as u64;
        assert!(n > 20_000_000_000, "{n}");
        // The embedding holds the vocabulary padded to 50304 rows.
        let n = n + (50304 - 50257) * 6144;
        let micro = MicroBatch {
            batch_size: 1,
            seq_len: 2048,
        };
        let p = predict_gpt2(
            &config,
            micro,
            &MixedBf16 { fp32_grads: true },
            &Full,
            &AdamW::default(),
        )
        .unwrap();
        assert_eq!(p.peak.get(MemoryCategory::Weights), 2 * n);
        assert_eq!(p.peak.get(MemoryCategory::MasterWeights), 4 * n);
        assert_eq!(p.peak.get(MemoryCategory::Gradients), 4 * n);
        assert_eq!(p.peak.get(MemoryCategory::OptimizerState), 8 * n);
        // Full recomputation keeps each layer's input, [B, T, C] in bf16.
        assert!(p.activations.kept_bytes >= 44 * 2048 * 6144 * 2);
        assert!(p.peak_total > 18 * n);
    }
}
