//! The core loop: one optimizer step over accumulated micro-batches, generic over the five
//! policy traits.

use crate::accumulate::{AccumulationContext, AccumulationSchedule, Constant};
use crate::checkpoint::{CheckpointPolicy, NoRecompute};
use crate::collective::{Collective, Single};
use crate::data::DataLoader;
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::{CategoryBytes, MemoryObserver, PeakTracker};
use crate::model::{Batch, Model, ModelDir, Param, Pass, StashStats};
use crate::optim::{AdamW, LrSchedule, Optimizer};
use crate::placement::{self, WeightPlacement};
use crate::precision::{Fp32, Precision};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;

mod buckets;
mod gather;
mod generation;
mod offload;
mod persist;
mod sample;
mod step;
mod update;

pub use generation::GenerationConfig;
pub use persist::checkpoint_ranks;
pub use sample::SamplingOptions;
pub use update::update_params;

/// The mean loss of [`Trainer::evaluate_once`] and what it covered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean cross-entropy per counted position (NaN when none trains).
    pub loss: f64,
    /// Positions counted (those a loss mask or padding leaves out are not).
    pub counted: usize,
    /// Batches read.
    pub batches: usize,
}

/// Settings of the loop, and where its weights live ([`TrainerOptions::placement`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerOptions {
    /// Global-norm gradient clipping threshold (0 = off).
    pub grad_clip: f32,
    /// Learning-rate schedule, relative to the optimizer's base rate.
    pub lr_schedule: LrSchedule,
    /// Steps of the whole run (cosine schedules decay over them).
    pub total_steps: u64,
    /// Seed of parameter initialization.
    pub seed: u64,
    /// After this many consecutive steps whose loss or gradient norm was not finite
    /// (each skipped, the weights untouched), [`Trainer::step`] fails with
    /// [`Error::Diverged`] (0 = never).
    pub max_bad_steps: u64,
    /// The device's peak FLOP/s in the compute dtype, for MFU and HFU in [`StepStats`]
    /// (see [`crate::estimate::peak_flops`]); `None` leaves them unset.
    pub peak_flops: Option<f64>,
    /// Runs the optimizer inside backward: each parameter is updated as soon as its
    /// gradient is complete, and the gradient freed, so gradient memory is about one
    /// layer's rather than the model's. Needs one micro-batch per step and no global-norm
    /// clipping (`grad_clip = 0`). A parameter whose gradient (or the step's loss) is not
    /// finite keeps its values, and the step counts as skipped.
    pub optimizer_in_backward: bool,
    /// Offloads every activation the checkpoint policy keeps to host memory after forward
    /// and fetches it back before its backward ([`crate::Retention::Offload`]): the device
    /// holds about one layer's kept activations instead of every layer's, the host holds
    /// the rest (the ledger's [`crate::memory::MemoryCategory::Offloaded`]). The policy must keep
    /// something: one that recomputes every activation is refused by [`Trainer::new`].
    pub offload_activations: bool,
    /// Keeps the optimizer's side of every parameter that trains in host memory
    /// ([`Backend::host`]): the f32 master weights, a Kahan compensation and the optimizer
    /// state, counted under
    /// [`crate::memory::MemoryCategory::Offloaded`]. The device holds the compute
    /// weights and the gradients; each parameter's gradient is copied to the host, updated
    /// there on the CPU's threads, and its new compute weights copied back (inside
    /// backward with [`TrainerOptions::optimizer_in_backward`], else after it). The update
    /// is bitwise the one without offload. A backend without host memory is refused by
    /// [`Trainer::new`].
    pub optimizer_offload: bool,
    /// ZeRO stage of a data-parallel job ([`Trainer::join`] with more than one rank):
    /// 0, every rank keeps the whole optimizer side (DDP); 1, each trained parameter's
    /// update is owned by one rank, which alone keeps its f32 master weights, optimizer
    /// state and compensation, updates it from the summed gradient and sends the new
    /// weights to the other ranks: optimizer memory divided by the ranks, the update
    /// bitwise that of stage 0; 2, as 1 and each rank also keeps only the gradients of
    /// the parameters it updates: every micro-batch's gradients are summed in buckets as
    /// backward completes them ([`TrainerOptions::bucket_bytes`], which must be above 0)
    /// and the others' freed at once, so gradient memory is divided by the ranks too.
    /// Ignored by one process alone.
    pub zero_stage: u8,
    /// Computes each micro-batch's gradients apart and adds them to the running sum of the
    /// step's earlier micro-batches once complete (as PyTorch's autograd accumulates
    /// `.grad`, and as data-parallel ranks sum), instead of accumulating into the running
    /// sum inside backward's products. Costs the gradient of one parameter beside the
    /// sum while backward computes it and one addition per micro-batch; buys
    /// reproducibility across layouts: one process accumulating 2 micro-batches this way
    /// takes bitwise the step of 2 ranks of one micro-batch each. Refused with ZeRO-2,
    /// whose sums are made across the ranks micro-batch by micro-batch.
    pub separate_accumulation: bool,
    /// Bytes of gradients (as f32) per bucket of a data-parallel job: each bucket is
    /// summed across the ranks on a thread of its own as soon as backward has completed
    /// its gradients, while backward goes on (25 MiB, PyTorch DDP's default); 0 sums each
    /// gradient after backward instead. The sums are the same either way.
    pub bucket_bytes: usize,
    /// Where each weight lives between the sections that read it
    /// ([`crate::placement`]): on the device ([`crate::placement::Resident`], the
    /// default), or streamed from page-locked host memory ahead of its readers
    /// ([`crate::placement::StreamFrozen`]). Training is bitwise the same either way.
    pub placement: Box<dyn WeightPlacement>,
}

/// The default [`TrainerOptions::bucket_bytes`]: 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The ZeRO stages [`TrainerOptions::zero_stage`] takes.
pub const ZERO_STAGES: [u8; 3] = [0, 1, 2];

impl Default for TrainerOptions {
    fn default() -> Self {
        TrainerOptions {
            grad_clip: 1.0,
            lr_schedule: LrSchedule::default(),
            total_steps: 0,
            seed: 1337,
            max_bad_steps: 10,
            peak_flops: None,
            optimizer_in_backward: false,
            offload_activations: false,
            optimizer_offload: false,
            zero_stage: 0,
            separate_accumulation: false,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            placement: crate::placement::resident(),
        }
    }
}

/// The error of a step that would accumulate `k` micro-batches with the optimizer inside
/// backward.
fn in_backward_accumulates(step: u64, k: usize) -> Error {
    Error::config(
        "optimizer_in_backward",
        format!(
            "step {step} accumulates {k} micro-batches, but updating each parameter inside \
             backward (--optimizer-in-backward, training.optimizer_in_backward) needs its \
             whole gradient from one; use one micro-batch per step (--grad-accum 1) or drop \
             --optimizer-in-backward"
        ),
    )
}

/// Peak memory of one step, from the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMemory {
    /// Each category's own maximum during the step.
    pub peak: CategoryBytes,
    /// The maximum of the total during the step.
    pub peak_total: u64,
    /// The breakdown at the moment the total peaked.
    pub at_peak: CategoryBytes,
    /// The device's own numbers at the end of the step (GPU pool and free memory), beside
    /// the ledger's; `None` on the CPU.
    #[serde(default)]
    pub device: Option<crate::device::cuda::GpuMemory>,
}

/// What one optimizer step did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// The step just completed (1-based).
    pub step: u64,
    /// Mean cross-entropy over the step's trained positions (nats): the summed loss of
    /// every position whose target is not masked out, divided by their number over all
    /// the step's micro-batches.
    pub loss: f64,
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Tokens in the step (micro-batches × rows × sequence length).
    pub tokens: u64,
    /// Micro-batches accumulated.
    pub micro_batches: usize,
    /// Wall time of the step.
    pub seconds: f64,
    /// Throughput, every position counted.
    pub tokens_per_s: f64,
    /// Positions of the step whose target trained (all of them without a loss mask).
    #[serde(default)]
    pub trained_tokens: u64,
    /// Throughput, trained positions only.
    #[serde(default)]
    pub trained_tokens_per_s: f64,
    /// Whether the update was skipped because the loss or gradients were not finite.
    pub skipped: bool,
    /// The factor the step's loss was multiplied by before backward (1 without loss
    /// scaling; under [`crate::MixedFp16`], the dynamic scale of this step).
    #[serde(default = "one")]
    pub loss_scale: f32,
    /// Peak bytes per category during the step.
    pub memory: StepMemory,
    /// The model's FLOPs for the step's tokens by llm.c's count, `6N + 6·L·h·T` per
    /// token: what MFU divides by.
    pub model_flops: f64,
    /// Floating-point operations the backend's ops executed during the step, recomputed
    /// forward work included: what HFU divides by.
    pub hardware_flops: u64,
    /// Model FLOPs utilisation: `model_flops / seconds / peak`, when the peak is known.
    pub mfu: Option<f64>,
    /// Hardware FLOPs utilisation: `hardware_flops / seconds / peak`, when the peak is
    /// known.
    pub hfu: Option<f64>,
    /// Activation bytes the checkpoint policy kept, dropped and recomputed (summed over
    /// micro-batches).
    #[serde(skip)]
    pub stash: StashStats,
    /// Bytes of streamed weights copied from host memory to the device during the step
    /// (summed over micro-batches; 0 when every weight is resident,
    /// [`TrainerOptions::placement`]).
    #[serde(default)]
    pub streamed_bytes: u64,
}

fn one() -> f32 {
    1.0
}

/// Trains a model: the loop of forward, backward, accumulation, clipping and update,
/// generic over the five policies.
///
/// Built in code with concrete policy types (`Trainer<MixedBf16, Selective, AdamW,
/// Constant, PeakTracker>`), or from a config file with boxed ones
/// (`Trainer<Box<dyn Precision>, ...>`); both run this one loop.
pub struct Trainer<P, C, O, A, M> {
    model: Box<dyn Model>,
    backend: Arc<dyn Backend>,
    params: Vec<Param>,
    precision: P,
    checkpoint: C,
    optimizer: O,
    accumulation: A,
    observer: M,
    data: DataLoader,
    options: TrainerOptions,
    step: u64,
    tokens_seen: u64,
    skipped_steps: u64,
    /// Skipped steps in a row, up to the last one.
    bad_streak: u64,
    /// The run's random stream after initialisation, saved and restored with the state.
    rng: Rng,
    /// What a saved adapter records about its base model.
    adapter_base: Option<String>,
    /// The directory whose weights the parameters hold as read, unchanged since (the
    /// trainer was built from it and nothing has updated or replaced a parameter):
    /// [`Trainer::resume_from`] that directory does not read them again.
    weights_from: Option<PathBuf>,
    /// The ranks of a data-parallel job ([`Single`] alone).
    collective: Arc<dyn Collective>,
    /// Under ZeRO-1, the rank that updates each parameter (by index; empty otherwise).
    owners: Vec<usize>,
}

/// Assembles a [`Trainer`]; each policy setter changes the builder's type.
pub struct TrainerBuilder<P, C, O, A, M> {
    model: Box<dyn Model>,
    backend: Arc<dyn Backend>,
    data: DataLoader,
    precision: P,
    checkpoint: C,
    optimizer: O,
    accumulation: A,
    observer: M,
    options: TrainerOptions,
    collective: Arc<dyn Collective>,
    weights: Option<ModelDir>,
}

impl Trainer<Fp32, NoRecompute, AdamW, Constant, PeakTracker> {
    /// Starts a trainer for `model` on `backend` reading `data`, with the defaults:
    /// `Fp32`, `NoRecompute`, `AdamW::default()`, `Constant(1)`, `PeakTracker`.
    pub fn builder(
        model: impl Model + 'static,
        backend: Arc<dyn Backend>,
        data: DataLoader,
    ) -> TrainerBuilder<Fp32, NoRecompute, AdamW, Constant, PeakTracker> {
        TrainerBuilder {
            model: Box::new(model),
            backend,
            data,
            precision: Fp32,
            checkpoint: NoRecompute,
            optimizer: AdamW::default(),
            accumulation: Constant::new(1),
            observer: PeakTracker::new(),
            options: TrainerOptions::default(),
            collective: Arc::new(Single),
            weights: None,
        }
    }
}

impl<P, C, O, A, M> TrainerBuilder<P, C, O, A, M>
where
    P: Precision,
    C: CheckpointPolicy,
    O: Optimizer,
    A: AccumulationSchedule,
    M: MemoryObserver,
{
    /// Sets the precision policy.
    pub fn precision<P2: Precision>(self, precision: P2) -> TrainerBuilder<P2, C, O, A, M> {
        TrainerBuilder {
            model: self.model,
            backend: self.backend,
            data: self.data,
            precision,
            checkpoint: self.checkpoint,
            optimizer: self.optimizer,
            accumulation: self.accumulation,
            observer: self.observer,
            options: self.options,
            collective: self.collective,
            weights: self.weights,
        }
    }

    /// Sets the activation checkpointing policy.
    pub fn checkpoint<C2: CheckpointPolicy>(
        self,
        checkpoint: C2,
    ) -> TrainerBuilder<P, C2, O, A, M> {
        TrainerBuilder {
            model: self.model,
            backend: self.backend,
            data: self.data,
            precision: self.precision,
            checkpoint,
            optimizer: self.optimizer,
            accumulation: self.accumulation,
            observer: self.observer,
            options: self.options,
            collective: self.collective,
            weights: self.weights,
        }
    }

    /// Sets the optimizer.
    pub fn optimizer<O2: Optimizer>(self, optimizer: O2) -> TrainerBuilder<P, C, O2, A, M> {
        TrainerBuilder {
            model: self.model,
            backend: self.backend,
            data: self.data,
            precision: self.precision,
            checkpoint: self.checkpoint,
            optimizer,
            accumulation: self.accumulation,
            observer: self.observer,
            options: self.options,
            collective: self.collective,
            weights: self.weights,
        }
    }

    /// Sets the gradient accumulation schedule.
    pub fn accumulation<A2: AccumulationSchedule>(
        self,
        accumulation: A2,
    ) -> TrainerBuilder<P, C, O, A2, M> {
        TrainerBuilder {
            model: self.model,
            backend: self.backend,
            data: self.data,
            precision: self.precision,
            checkpoint: self.checkpoint,
            optimizer: self.optimizer,
            accumulation,
            observer: self.observer,
            options: self.options,
            collective: self.collective,
            weights: self.weights,
        }
    }

    /// Sets the memory observer.
    pub fn observer<M2: MemoryObserver>(self, observer: M2) -> TrainerBuilder<P, C, O, A, M2> {
        TrainerBuilder {
            model: self.model,
            backend: self.backend,
            data: self.data,
            precision: self.precision,
            checkpoint: self.checkpoint,
            optimizer: self.optimizer,
            accumulation: self.accumulation,
            observer,
            options: self.options,
            collective: self.collective,
            weights: self.weights,
        }
    }

    /// Sets the loop's options (clipping, schedule, seed).
    pub fn options(mut self, options: TrainerOptions) -> Self {
        self.options = options;
        self
    }

    /// Sets where the weights live ([`TrainerOptions::placement`]): `StreamFrozen` keeps
    /// the frozen base in host memory and streams it to the device ahead of its readers.
    pub fn placement(mut self, placement: impl WeightPlacement + 'static) -> Self {
        self.options.placement = Box::new(placement);
        self
    }

    /// Trains as one rank of a data-parallel job over `collective` (the default is
    /// [`Single`], one process alone): each rank reads its share of every global batch,
    /// the gradients are summed across ranks before the update and the loss is divided by
    /// the trained positions of the whole global step, so N ranks of `k` micro-batches
    /// each take the step one process accumulating `N·k` would.
    pub fn collective(mut self, collective: Arc<dyn Collective>) -> Self {
        self.collective = collective;
        self
    }

    /// Starts the parameters from `model`'s weights (a base model to fine-tune, a saved
    /// model to sample from or evaluate) instead of drawing them: what
    /// [`Trainer::load_weights`] after [`TrainerBuilder::build`] does, without drawing the
    /// random values it would overwrite (minutes of a large model's start) and without a
    /// second copy of them in memory. Every parameter must be there with its shape but
    /// the low-rank updates of an adapter, which the directory of a base model lacks: they
    /// draw their initialisation as they would after a model drawn whole (the seed's
    /// stream moves past the weights read), so the run is the one `load_weights` starts.
    pub fn init_from(mut self, model: ModelDir) -> Self {
        self.weights = Some(model);
        self
    }

    /// Creates the parameters and returns the trainer.
    pub fn build(self) -> Result<Trainer<P, C, O, A, M>> {
        let collective = self.collective;
        let mut trainer = Trainer::create(
            self.model,
            self.backend,
            self.data,
            self.precision,
            self.checkpoint,
            self.optimizer,
            self.accumulation,
            self.observer,
            self.options,
            self.weights,
        )?;
        trainer.join(collective)?;
        Ok(trainer)
    }
}

impl<P, C, O, A, M> Trainer<P, C, O, A, M>
where
    P: Precision,
    C: CheckpointPolicy,
    O: Optimizer,
    A: AccumulationSchedule,
    M: MemoryObserver,
{
    /// A trainer with freshly initialised parameters (seeded by `options.seed`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Box<dyn Model>,
        backend: Arc<dyn Backend>,
        data: DataLoader,
        precision: P,
        checkpoint: C,
        optimizer: O,
        accumulation: A,
        observer: M,
        options: TrainerOptions,
    ) -> Result<Self> {
        Self::create(
            model,
            backend,
            data,
            precision,
            checkpoint,
            optimizer,
            accumulation,
            observer,
            options,
            None,
        )
    }

    /// [`Trainer::new`] with the parameters read from `weights` where given
    /// ([`TrainerBuilder::init_from`]).
    #[allow(clippy::too_many_arguments)]
    fn create(
        model: Box<dyn Model>,
        backend: Arc<dyn Backend>,
        data: DataLoader,
        precision: P,
        checkpoint: C,
        optimizer: O,
        accumulation: A,
        observer: M,
        options: TrainerOptions,
        weights: Option<ModelDir>,
    ) -> Result<Self> {
        if data.seq_len() > model.max_seq_len() {
            return Err(Error::config(
                "seq_len",
                format!(
                    "{} exceeds the model's context of {}; use at most {}",
                    data.seq_len(),
                    model.max_seq_len(),
                    model.max_seq_len()
                ),
            ));
        }
        if !(options.grad_clip >= 0.0 && options.grad_clip.is_finite()) {
            return Err(Error::config(
                "grad_clip",
                format!(
                    "{} is not a finite value >= 0 (0 turns clipping off)",
                    options.grad_clip
                ),
            ));
        }
        if options.optimizer_in_backward && options.grad_clip > 0.0 {
            return Err(Error::config(
                "optimizer_in_backward",
                format!(
                    "updating each parameter inside backward cannot clip by the global norm \
                     (grad_clip = {}), which needs every gradient at once; set grad_clip = 0 \
                     (--grad-clip 0) or drop --optimizer-in-backward",
                    options.grad_clip
                ),
            ));
        }
        if !ZERO_STAGES.contains(&options.zero_stage) {
            return Err(Error::config(
                "zero_stage",
                format!(
                    "ZeRO stage {} is not built; use 0 (every rank keeps the optimizer \
                     state, as DDP), 1 (the optimizer state and master weights sharded \
                     across the ranks) or 2 (the gradients sharded too)",
                    options.zero_stage
                ),
            ));
        }
        precision.validate()?;
        if options.optimizer_in_backward {
            // The first step's accumulation, refused here rather than at the step; a
            // schedule that grows later is refused at the step that grows.
            let k = accumulation.micro_batches(&AccumulationContext {
                step: 0,
                tokens_seen: 0,
                tokens_per_micro_batch: (data.batch_size() * data.seq_len()) as u64,
            })?;
            if k > 1 {
                return Err(in_backward_accumulates(1, k));
            }
        }
        if options.offload_activations {
            offload::check(model.as_ref(), &data, &precision, &checkpoint)?;
        }
        let host = if options.optimizer_offload {
            Some(backend.host().ok_or_else(|| {
                Error::config(
                    "optimizer_offload",
                    format!(
                        "the {} backend has no host memory to offload the optimizer to \
                         (Backend::host); drop --optimizer-offload (optimizer.offload)",
                        backend.name()
                    ),
                )
            })?)
        } else {
            None
        };
        backend.ledger().set_recording(true);
        let mut rng = Rng::new(options.seed);
        let specs = model.init_params();
        let streamed = placement::streamed(
            options.placement.as_ref(),
            &specs,
            precision.compute_dtype(),
        );
        let stream = if streamed.iter().any(|&s| s) {
            let home = backend.host().ok_or_else(|| {
                let name = specs
                    .iter()
                    .zip(&streamed)
                    .find(|(_, &s)| s)
                    .map_or("", |(p, _)| p.name.as_str());
                crate::param::no_host_to_stream(backend.as_ref(), name)
            })?;
            Some(home)
        } else {
            None
        };
        // The weights read (by the model's names), or none: every parameter drawn.
        let weights_from = weights.as_ref().map(|dir| dir.path.clone());
        let mut loaded = match weights {
            Some(dir) => Some(model.import_tensors(dir.tensors)?),
            None => None,
        };
        let held = loaded.as_ref().map_or(0, |t| t.len());
        // The parameters the directory lacks and that draw their values (adapters').
        let mut fresh = Vec::new();
        let mut params = Vec::with_capacity(specs.len());
        for (p, &s) in specs.iter().zip(&streamed) {
            let values = match loaded.as_mut() {
                Some(tensors) => {
                    persist::file_values(tensors, held, &p.name, &p.shape, &mut fresh)?
                }
                None => None,
            };
            let stream = stream.as_ref().filter(|_| s);
            params.push(Param::init_loaded(
                backend.as_ref(),
                host.as_ref(),
                stream,
                p,
                values.as_deref(),
                &mut rng,
                &precision,
            )?);
        }
        // What the model does not read goes now, not with the trainer's start.
        let read = loaded.is_some();
        drop(loaded);
        let mut trainer = Trainer {
            model,
            backend,
            params,
            precision,
            checkpoint,
            optimizer,
            accumulation,
            observer,
            data,
            options,
            step: 0,
            tokens_seen: 0,
            skipped_steps: 0,
            bad_streak: 0,
            rng,
            adapter_base: None,
            weights_from,
            collective: Arc::new(Single),
            owners: Vec::new(),
        };
        // DoRA's magnitudes start from the base weights, those read or drawn; a directory's
        // own magnitudes are kept.
        trainer.init_magnitudes(read.then_some(&fresh[..]))?;
        trainer.flush_events();
        Ok(trainer)
    }

    /// Sets DoRA's magnitudes (those named in `only`, or all) to the norms of their rows
    /// of `W + s·B·A`, as PEFT starts them: the adapted model then equals the base model.
    pub(crate) fn init_magnitudes(&mut self, only: Option<&[String]>) -> Result<()> {
        let be = self.backend.as_ref();
        for m in self.model.magnitudes() {
            let name = self.params[m.param].name().to_string();
            if only.is_some_and(|o| !o.contains(&name)) {
                continue;
            }
            // A streamed base weight is brought to the device for the norm alone.
            self.params[m.weight].stage(be)?;
            let n = crate::ops::lora::dora::weight_norm(
                be,
                self.params[m.weight].weight(),
                self.params[m.a].weight(),
                self.params[m.b].weight(),
                m.scale,
                m.block,
                &name,
            );
            self.params[m.weight].unstage();
            let values = be.to_f32(&n?)?;
            self.params[m.param].set_value(be, &values)?;
        }
        Ok(())
    }

    /// Makes this trainer one rank of `collective`'s job (what
    /// [`TrainerBuilder::collective`] does; call it on every rank, before the first
    /// step); fails when the settings cannot run data-parallel yet or when the ranks'
    /// models differ.
    pub fn join(&mut self, collective: Arc<dyn Collective>) -> Result<()> {
        let world = collective.world();
        if world > 1 {
            if let Some(p) = self.params.iter().find(|p| p.streamed() && p.trains()) {
                return Err(Error::config(
                    "placement",
                    format!(
                        "`{}` trains and is streamed from host memory, which data-parallel \
                         training does not do yet; stream the frozen weights alone \
                         (--stream-weights frozen) or keep the weights resident",
                        p.name()
                    ),
                ));
            }
            if self.options.zero_stage >= 2 && self.options.separate_accumulation {
                return Err(Error::config(
                    "separate_accumulation",
                    "ZeRO-2 sums each micro-batch's gradients across the ranks as backward \
                     completes them, into the owner's running sum; drop \
                     --separate-accumulation or use --zero 1",
                ));
            }
            if self.options.zero_stage >= 2 && self.options.bucket_bytes == 0 {
                return Err(Error::config(
                    "bucket_bytes",
                    "ZeRO-2 sums each gradient in a bucket as soon as backward completes it \
                     and frees those another rank updates; give the buckets a size \
                     (--bucket-size, bucket_bytes > 0) or use --zero 1",
                ));
            }
            // Every rank must hold the same model: compare the parameter counts.
            let numel: usize = self.params.iter().map(Param::numel).sum();
            let mut sum = [numel as f64];
            collective.all_reduce_sum_f64(&mut sum)?;
            if sum[0] != (numel * world) as f64 {
                return Err(Error::config(
                    "model",
                    format!(
                        "rank {} holds {numel} parameters but the {world} ranks hold {} in \
                         all: every rank must train the same model (give every rank the \
                         same flags and config)",
                        collective.rank(),
                        sum[0]
                    ),
                ));
            }
        }
        self.collective = collective;
        if world > 1 && self.options.zero_stage >= 1 {
            self.shard_updates()?;
        }
        Ok(())
    }

    /// ZeRO-1: gives each trained parameter's update to one rank, in model order to the
    /// rank that owns the fewest elements so far (the same on every rank), and frees the
    /// optimizer side of the parameters this rank does not own.
    fn shard_updates(&mut self) -> Result<()> {
        let (rank, world) = (self.collective.rank(), self.collective.world());
        self.owners = zero_owners(self.params.iter().map(|p| (p.numel(), p.trains())), world);
        for (p, &owner) in self.params.iter_mut().zip(&self.owners) {
            if owner != rank {
                p.hand_over();
            }
        }
        self.flush_events();
        Ok(())
    }

    /// Under ZeRO-2, whether this rank keeps each parameter's gradient (those it
    /// updates); `None` where every rank keeps every gradient.
    pub(crate) fn kept_grads(&self) -> Option<Vec<bool>> {
        let rank = self.collective.rank();
        (self.options.zero_stage >= 2 && !self.owners.is_empty())
            .then(|| self.owners.iter().map(|&o| o == rank).collect())
    }

    /// The rank that updates parameter `i`: its owner under ZeRO-1, else this one.
    pub(crate) fn owner_of(&self, i: usize) -> usize {
        self.owners
            .get(i)
            .copied()
            .unwrap_or_else(|| self.collective.rank())
    }

    /// The ranks this trainer trains with ([`TrainerBuilder::collective`]).
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.collective
    }

    fn flush_events(&mut self) {
        for e in self.backend.ledger().drain_events() {
            self.observer.on_event(&e);
        }
    }

    /// Mean loss over `batches` batches of `data`, without touching gradients: the sum
    /// over every counted position (a masked target counts for nothing) divided by their
    /// number, so batches with few trained positions weigh as little as they hold; NaN when
    /// no position of them trains.
    pub fn evaluate(&mut self, data: &mut DataLoader, batches: usize) -> Result<f64> {
        let mut sum = 0.0;
        let mut n = 0usize;
        for _ in 0..batches {
            let batch = data.next_batch();
            sum += self.loss_on(&batch)?;
            n += batch.counted();
        }
        self.flush_events();
        // No trained position (a loss mask that leaves every one of them out): no loss.
        Ok(if n == 0 { f64::NAN } else { sum / n as f64 })
    }

    /// The mean loss over every position of `data` once ([`DataLoader::each_once`]: no
    /// position twice, none left out, the loader's own position untouched), or over its
    /// first `max_batches` batches of that pass; with the positions it counted. NaN when
    /// none trains.
    pub fn evaluate_once(
        &mut self,
        data: &DataLoader,
        max_batches: Option<usize>,
    ) -> Result<Evaluation> {
        let (mut sum, mut counted, mut batches) = (0.0, 0usize, 0usize);
        for batch in data.each_once().take(max_batches.unwrap_or(usize::MAX)) {
            sum += self.loss_on(&batch)?;
            counted += batch.counted();
            batches += 1;
        }
        self.flush_events();
        Ok(Evaluation {
            loss: if counted == 0 {
                f64::NAN
            } else {
                sum / counted as f64
            },
            counted,
            batches,
        })
    }

    /// Sum of per-position losses on one batch (forward only).
    pub fn loss_on(&mut self, batch: &Batch) -> Result<f64> {
        let (model, mut pass) = self.forward_pass(None);
        model.loss(&mut pass, batch)
    }

    /// Sum of per-position losses on one batch as training computes it when the batch is
    /// micro-batch `micro` (from 0) of step `step` (from 1): with the random draws of that
    /// micro-batch (LoRA dropout's masks), forward only. Without random ops it is
    /// [`Trainer::loss_on`].
    pub fn training_loss_on(&mut self, batch: &Batch, step: u64, micro: usize) -> Result<f64> {
        let key = step::micro_batch_key(self.options.seed, step, micro);
        let (model, mut pass) = self.forward_pass(Some(key));
        model.loss(&mut pass, batch)
    }

    /// The model and a forward-only pass over the parameters (nothing offloaded, no
    /// optimizer step inside it), its random draws keyed by `rng_key` (`None`:
    /// evaluation, which draws nothing).
    fn forward_pass(&mut self, rng_key: Option<u64>) -> (&dyn Model, Pass<'_>) {
        let pass = Pass {
            backend: self.backend.as_ref(),
            params: &mut self.params,
            checkpoint: &self.checkpoint,
            dtype: self.precision.compute_dtype(),
            offload: false,
            grad_ready: None,
            rng_key,
            stream_ahead: self.options.placement.ahead(),
        };
        (self.model.as_ref(), pass)
    }

    /// The parameters, in the model's order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// Mutable parameters (to load weights, or to inject faults in tests).
    pub fn params_mut(&mut self) -> &mut [Param] {
        self.weights_from = None;
        &mut self.params
    }

    /// The backend training runs on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The model.
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// The memory observer.
    pub fn observer(&self) -> &M {
        &self.observer
    }

    /// The precision policy.
    pub fn precision(&self) -> &P {
        &self.precision
    }

    /// The checkpoint policy.
    pub fn checkpoint(&self) -> &C {
        &self.checkpoint
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &O {
        &self.optimizer
    }

    /// The accumulation schedule.
    pub fn accumulation(&self) -> &A {
        &self.accumulation
    }

    /// The training data.
    pub fn data(&self) -> &DataLoader {
        &self.data
    }

    /// Optimizer steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Tokens trained on.
    pub fn tokens_seen(&self) -> u64 {
        self.tokens_seen
    }

    /// Consecutive skipped steps up to now.
    pub fn bad_streak(&self) -> u64 {
        self.bad_streak
    }

    /// Steps whose update was skipped because of non-finite values.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Values (f32) of the parameter named `name`, if it exists.
    pub fn param_values(&self, name: &str) -> Result<Option<Vec<f32>>> {
        match self.params.iter().find(|p| p.name() == name) {
            Some(p) => Ok(Some(self.backend.to_f32(p.value())?)),
            None => Ok(None),
        }
    }
}

/// ZeRO's owners: each trained parameter's update given to one rank, the largest
/// parameters first (model order among equals), each to the rank that owns the fewest
/// trained elements so far (ties to the lowest rank): the longest-processing-time rule,
/// the same on every rank. The heaviest rank then holds at most the lightest's share plus
/// the smallest parameter it was given, or the largest parameter alone: Llama 3.1 8B's
/// 525M-element embedding and head each sit on a rank of their own, and the layers fill
/// the others to within a layer's projection of the mean (given in model order, the head
/// came last, on top of a full share). Frozen parameters, which no rank updates, are
/// given to rank 0. `params` are each parameter's (elements, whether it trains), in model
/// order.
pub fn zero_owners(params: impl IntoIterator<Item = (usize, bool)>, world: usize) -> Vec<usize> {
    let params: Vec<(usize, bool)> = params.into_iter().collect();
    let mut largest_first: Vec<usize> = (0..params.len()).filter(|&i| params[i].1).collect();
    // Stable: parameters of one size keep their model order.
    largest_first.sort_by_key(|&i| std::cmp::Reverse(params[i].0));
    let mut load = vec![0usize; world.max(1)];
    let mut owners = vec![0usize; params.len()];
    for i in largest_first {
        let owner = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[owner] += params[i].0;
        owners[i] = owner;
    }
    owners
}

/// The rank of a ZeRO job of `world` ranks that owns the most trained elements of
/// `params` ([`zero_owners`]; the lowest such rank): the one whose master weights,
/// optimizer state and (ZeRO-2) gradients weigh most, so the one a memory budget must
/// fit. Rank 0 takes the largest parameter (an embedding or an untied head); where that
/// parameter is less than an even share, the ranks that fill up on the layers can end a
/// few elements heavier.
pub fn heaviest_rank(params: &[crate::param::ParamInit], world: usize) -> usize {
    let owners = zero_owners(params.iter().map(|p| (p.numel(), p.trains)), world);
    let mut load = vec![0usize; world.max(1)];
    for (p, &o) in params.iter().zip(&owners) {
        if p.trains {
            load[o] += p.numel();
        }
    }
    (0..load.len())
        .max_by_key(|&r| (load[r], std::cmp::Reverse(r)))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::param::{Init, ParamInit};

    fn param(n: usize, trains: bool) -> ParamInit {
        ParamInit {
            name: format!("p{n}"),
            shape: vec![n],
            init: Init::Constant(0.0),
            trains,
            dtype: None,
        }
    }

    #[test]
    fn zero_owners_balance_and_the_heaviest_rank_is_found() {
        // An embedding first, three small layers, an untied head last: the head and the
        // embedding go first, each to a rank of its own, the layers to the lighter.
        let ps = [10, 3, 3, 3, 12].map(|n| param(n, true));
        let owners = zero_owners(ps.iter().map(|p| (p.numel(), p.trains)), 2);
        assert_eq!(owners, [1, 1, 0, 1, 0]);
        assert_eq!(heaviest_rank(&ps, 2), 1, "16 elements against 15");
        // Frozen, the head weighs nothing on either rank, and goes to rank 0.
        let mut frozen = ps.clone();
        frozen[4] = param(12, false);
        let owners = zero_owners(frozen.iter().map(|p| (p.numel(), p.trains)), 2);
        assert_eq!(owners, [0, 1, 1, 1, 0]);
        assert_eq!(heaviest_rank(&frozen, 2), 0);
        assert_eq!(heaviest_rank(&ps, 1), 0);
        // Ties go to the lowest rank.
        assert_eq!(heaviest_rank(&[param(4, true), param(4, true)], 2), 0);
    }

    /// Llama 3.1 8B's parameters over 2 to 16 ranks: every rank within the smallest
    /// parameter it holds of the lightest (the rule's bound), and at 8 ranks the heaviest
    /// within 0.5% of an even share (in model order it held 18%, not 12.5%).
    #[test]
    fn zero_owners_share_llama_8b_evenly() {
        let (h, kv, ffn, vocab) = (4096, 1024, 14336, 128256);
        let mut sizes = vec![vocab * h];
        for _ in 0..32 {
            sizes.extend([
                h,
                h * h,
                kv * h,
                kv * h,
                h * h,
                h,
                ffn * h,
                ffn * h,
                h * ffn,
            ]);
        }
        sizes.extend([h, vocab * h]);
        let total: usize = sizes.iter().sum();
        for world in [2, 3, 4, 8, 16] {
            let owners = zero_owners(sizes.iter().map(|&n| (n, true)), world);
            let mut load = vec![0usize; world];
            let mut smallest = vec![usize::MAX; world];
            for (&n, &o) in sizes.iter().zip(&owners) {
                load[o] += n;
                smallest[o] = smallest[o].min(n);
            }
            let lightest = *load.iter().min().unwrap();
            for r in 0..world {
                assert!(
                    load[r] <= lightest + smallest[r],
                    "{world} ranks: rank {r} holds {} against the lightest's {lightest}",
                    load[r]
                );
            }
            if world == 8 {
                let heaviest = *load.iter().max().unwrap();
                assert!(heaviest * 8 * 1000 <= total * 1005, "{heaviest} of {total}");
            }
        }
    }
}
