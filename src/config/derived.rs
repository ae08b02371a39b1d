//! What a run config gives the rest of the library: the trainer's options, the global
//! batch, and the request autofit and the memory report answer.

use super::RunConfig;
use crate::accumulate::AccumulationContext;
use crate::error::Result;
use crate::estimate::{FitRequest, Techniques};
use crate::trainer::TrainerOptions;

impl From<&RunConfig> for TrainerOptions {
    /// The loop settings of `cfg` (`peak_flops` unset: the device decides it).
    fn from(cfg: &RunConfig) -> Self {
        let t = &cfg.training;
        TrainerOptions {
            grad_clip: t.grad_clip,
            lr_schedule: t.lr_schedule,
            total_steps: t.steps,
            seed: t.seed,
            max_bad_steps: t.max_bad_steps,
            peak_flops: None,
            optimizer_in_backward: t.optimizer_in_backward,
            offload_activations: t.offload_activations,
            optimizer_offload: cfg.optimizer_offload,
        }
    }
}

impl RunConfig {
    /// Rows per optimizer step: micro-batch rows × the first step's micro-batches.
    pub fn global_batch(&self) -> Result<usize> {
        let t = &self.training;
        let k = self.accumulation.micro_batches(&AccumulationContext {
            step: 0,
            tokens_seen: 0,
            tokens_per_micro_batch: (t.batch_size * t.seq_len) as u64,
        })?;
        Ok(t.batch_size * k)
    }
}

impl<'a> FitRequest<'a> {
    /// The request of the run `cfg` describes: its model, sequence length, policies and
    /// adapter, `global_batch` rows per step within `budget` bytes, with `techniques`.
    pub fn for_run(
        cfg: &'a RunConfig,
        global_batch: usize,
        budget: u64,
        techniques: Techniques,
    ) -> FitRequest<'a> {
        let t = &cfg.training;
        FitRequest {
            recompute: cfg.checkpoint.as_ref(),
            attention: t.attention,
            loss: t.loss,
            loss_chunk: t.loss_chunk,
            techniques,
            grad_clip: t.grad_clip,
            optimizer_in_backward: t.optimizer_in_backward,
            offload_activations: t.offload_activations,
            optimizer_offload: cfg.optimizer_offload,
            adapter: cfg.adapter.as_deref(),
            ..FitRequest::new(
                cfg.model.architecture(),
                t.seq_len,
                global_batch,
                budget,
                cfg.precision.as_ref(),
                cfg.optimizer.as_ref(),
            )
        }
    }
}
