//! What a run config gives the rest of the library: its data as loaders, its trainer and
//! the trainer's options, the global batch, and the request autofit and the memory report
//! answer.

use super::RunConfig;
use crate::accumulate::{AccumulationContext, AccumulationSchedule};
use crate::checkpoint::CheckpointPolicy;
use crate::data::{DataLoader, TokenizerKind};
use crate::device::Backend;
use crate::error::Result;
use crate::estimate::{FitRequest, Techniques};
use crate::memory::MemoryObserver;
use crate::model::{Model, ModelDir};
use crate::optim::Optimizer;
use crate::precision::Precision;
use crate::trainer::{Trainer, TrainerOptions};
use std::sync::Arc;

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
            zero_stage: t.zero_stage,
            separate_accumulation: t.separate_accumulation,
            bucket_bytes: usize::try_from(t.bucket_bytes).unwrap_or(usize::MAX),
            placement: cfg.placement.clone(),
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
    /// adapter, `global_batch` rows per step within `budget` bytes, with `techniques`; in
    /// a data-parallel job (the launcher's world, [`crate::collective::launched_world`])
    /// one rank's, with the run's ZeRO stage.
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
            placement: cfg.placement.as_ref(),
            adapter: cfg.adapter.as_deref(),
            world: crate::collective::launched_world().map_or(1, |(n, _)| n),
            zero_stage: t.zero_stage,
            separate_accumulation: t.separate_accumulation,
            bucket_bytes: usize::try_from(t.bucket_bytes).unwrap_or(usize::MAX),
            ..FitRequest::new(
                cfg.model.shape(),
                t.seq_len,
                global_batch,
                budget,
                cfg.precision.as_ref(),
                cfg.optimizer.as_ref(),
            )
        }
    }
}

/// A trainer of a run config's boxed policies ([`RunConfig::trainer`]).
pub type ConfigTrainer = Trainer<
    Box<dyn Precision>,
    Box<dyn CheckpointPolicy>,
    Box<dyn Optimizer>,
    Box<dyn AccumulationSchedule>,
    Box<dyn MemoryObserver>,
>;

/// A run's data as loaders ([`RunConfig::loaders`]), with what the corpus says about
/// itself.
#[derive(Debug)]
pub struct RunData {
    /// The training batches: shuffled with the run's seed where the data config says so,
    /// documents separated where they are masked.
    pub train: DataLoader,
    /// The held-out batches, in order.
    pub val: DataLoader,
    /// Whether the data is rows with a loss mask (`trainkit prepare --chat`).
    pub chat: bool,
    /// The lowest loss any model can reach, when known (the built-in corpus).
    pub entropy_floor: Option<f64>,
    /// The tokenizer behind the ids.
    pub tokenizer: TokenizerKind,
    /// Where the tokens came from, for messages.
    pub description: String,
}

impl RunConfig {
    /// The run's training and validation loaders: `[data]` read for `[model]`'s
    /// vocabulary, in micro-batches of `training.batch_size` rows of `training.seq_len`
    /// tokens.
    pub fn loaders(&self) -> Result<RunData> {
        let t = &self.training;
        let corpus = self.data.load(t.seq_len + 1, self.model.vocab_size())?;
        let chat = corpus.train.shards().iter().any(|s| s.row_len().is_some());
        let train = DataLoader::new(corpus.train, t.batch_size, t.seq_len)?
            .shuffled(corpus.shuffle.then_some(t.seed))
            .separated_by(corpus.separator);
        let val =
            DataLoader::new(corpus.val, t.batch_size, t.seq_len)?.separated_by(corpus.separator);
        Ok(RunData {
            train,
            val,
            chat,
            entropy_floor: corpus.entropy_floor,
            tokenizer: corpus.tokenizer,
            description: corpus.description,
        })
    }

    /// The trainer of this run's `model` (its own, [`RunConfig::build_model`], or one
    /// with ops of your own) on `backend`, reading `data`: the config's five policies
    /// with `observer` in place of its own, and its loop settings
    /// ([`TrainerOptions::from`]) with `peak_flops` for MFU. Weights are freshly
    /// initialised: load a model directory or resume after, or start from one with
    /// [`RunConfig::trainer_from`].
    pub fn trainer(
        &self,
        model: Box<dyn Model>,
        backend: Arc<dyn Backend>,
        data: DataLoader,
        observer: Box<dyn MemoryObserver>,
        peak_flops: Option<f64>,
    ) -> Result<ConfigTrainer> {
        self.trainer_from(model, backend, data, observer, peak_flops, None)
    }

    /// [`RunConfig::trainer`] with the weights of `weights` where given (the model
    /// directory `training.init_from` names, read): the parameters start from them, none
    /// drawn but the adapter's updates ([`crate::trainer::TrainerBuilder::init_from`]).
    pub fn trainer_from(
        &self,
        model: Box<dyn Model>,
        backend: Arc<dyn Backend>,
        data: DataLoader,
        observer: Box<dyn MemoryObserver>,
        peak_flops: Option<f64>,
        weights: Option<ModelDir>,
    ) -> Result<ConfigTrainer> {
        let builder = Trainer::builder(model, backend, data)
            .precision(self.precision.clone())
            .checkpoint(self.checkpoint.clone())
            .optimizer(self.optimizer.clone())
            .accumulation(self.accumulation.clone())
            .observer(observer)
            .options(TrainerOptions {
                peak_flops,
                ..TrainerOptions::from(self)
            });
        match weights {
            Some(w) => builder.init_from(w),
            None => builder,
        }
        .build()
    }
}
