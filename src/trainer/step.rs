//! One optimizer step, in the order it runs: plan it (micro-batches, scales, learning
//! rate), run the micro-batches' forward and backward (updating each parameter inside
//! backward when asked), apply the update (the device-side guard and the optimizer), keep
//! the books (loss scale, skipped steps, divergence), and report.

use super::buckets::Buckets;
use super::update::{InBackward, Updater};
use super::{in_backward_accumulates, StepMemory, StepStats, Trainer};
use crate::accumulate::{AccumulationContext, AccumulationSchedule};
use crate::checkpoint::CheckpointPolicy;
use crate::collective::{all_reduce_tensor, broadcast_tensor, Collective};
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::{MemoryCategory, MemoryObserver, Phase};
use crate::model::{Batch, Param, Pass, PassStats};
use crate::optim::{guard, Optimizer, StepRecord};
use crate::precision::Precision;
use crate::tensor::{DType, Tensor};
use std::sync::Arc;
use std::time::Instant;

/// What a step is, decided before it runs.
struct Plan {
    /// Micro-batches (of each rank).
    k: usize,
    /// Ranks taking the step together (1 alone).
    world: usize,
    /// Tokens of one micro-batch.
    tokens_per_micro: u64,
    /// Positions of the whole step (every rank's) whose target is trained (not masked
    /// out): what the summed loss and the gradients are divided by.
    counted: u64,
    /// The precision's loss scale.
    loss_scale: f32,
    /// What the per-position losses are multiplied by before backward.
    grad_scale: f32,
    /// The scheduled learning rate.
    lr: f32,
    /// Whether each parameter is updated as soon as its gradient is complete.
    in_backward: bool,
}

impl Plan {
    /// Tokens of the whole step.
    fn tokens(&self) -> u64 {
        self.tokens_per_micro * (self.k * self.world) as u64
    }
}

/// The step's device buffers: the per-position losses and the guard's record, read once.
struct Buffers {
    losses: Tensor,
    record: Tensor,
}

impl<P, C, O, A, M> Trainer<P, C, O, A, M>
where
    P: Precision,
    C: CheckpointPolicy,
    O: Optimizer,
    A: AccumulationSchedule,
    M: MemoryObserver,
{
    /// Runs one optimizer step: the schedule's micro-batches of forward and backward,
    /// clipping, a finite check, the update, and the refresh of compute weights.
    pub fn step(&mut self) -> Result<StepStats> {
        let start = Instant::now();
        self.weights_from = None;
        let backend = Arc::clone(&self.backend);
        let be = backend.as_ref();
        be.ledger().reset_peaks();
        be.reset_device_peak();
        let (plan, batches) = self.plan()?;
        for p in &mut self.params {
            p.zero_grad(be)?;
        }
        let rows = self.data.batch_size() * self.data.seq_len();
        let mut buffers = Buffers {
            losses: be.zeros(
                &[rows],
                DType::F32,
                MemoryCategory::Workspace,
                "step.losses",
            )?,
            record: be.zeros(
                &[StepRecord::LEN],
                DType::F32,
                MemoryCategory::Workspace,
                "step.record",
            )?,
        };
        let mut inside = InBackward::new(self.params.len());
        let mut buckets = self.buckets(be);
        let pass =
            self.micro_batches(be, &plan, batches, &mut buffers, &mut inside, &mut buckets)?;
        self.sum_across_ranks(be, &mut buffers, buckets)?;
        let record = self.update(be, &plan, buffers, &mut inside)?;
        // Inside backward each parameter's own guard decided its update: the owners'
        // weights go out whatever the step's record says.
        if record.finite() || plan.in_backward {
            self.receive_updates(be)?;
        }
        self.keep_books(&plan, &record)?;
        Ok(self.report(be, &plan, &record, pass, start))
    }

    /// The step's plan (scales and learning rate) and its micro-batches, read up front:
    /// the loss and gradients are divided by the trained positions of all of them, so
    /// accumulating k micro-batches gives the update of one batch k times as large, masks
    /// or not (a mean of micro-batch means would weigh a position of a sparsely trained
    /// micro-batch more). With N ranks, the loader's next N·k micro-batches are the global
    /// step's and rank r reads the r-th k of them (passing over the others' unread): the
    /// ranks together read what one process accumulating N·k would, and divide by the
    /// trained positions of all of them.
    fn plan(&mut self) -> Result<(Plan, Vec<Batch>)> {
        let tokens_per_micro = (self.data.batch_size() * self.data.seq_len()) as u64;
        let (rank, world) = (self.collective.rank(), self.collective.world());
        let k = self.accumulation.micro_batches(&AccumulationContext {
            step: self.step,
            tokens_seen: self.tokens_seen,
            tokens_per_micro_batch: tokens_per_micro * world as u64,
        })?;
        if k == 0 {
            return Err(Error::config(
                "accumulation",
                "a step needs at least one micro-batch",
            ));
        }
        let in_backward = self.options.optimizer_in_backward;
        if in_backward && k > 1 {
            return Err(in_backward_accumulates(self.step + 1, k));
        }
        let loss_scale = self.precision.loss_scale();
        let mut batches = Vec::with_capacity(k);
        for r in 0..world {
            for _ in 0..k {
                if r == rank {
                    batches.push(self.data.next_batch());
                } else {
                    self.data.skip_batch();
                }
            }
        }
        let mut counted = [batches.iter().map(|b| b.counted() as f64).sum::<f64>()];
        self.collective.all_reduce_sum_f64(&mut counted)?;
        let counted = counted[0] as u64;
        if counted == 0 {
            log::warn!(
                "step {}: every target of its {k} micro-batches is masked out; no position \
                 trains, so the update moves only what decays",
                self.step + 1
            );
        }
        let plan = Plan {
            k,
            world,
            tokens_per_micro,
            counted,
            loss_scale,
            grad_scale: loss_scale / counted.max(1) as f32,
            lr: self.options.lr_schedule.lr(
                self.optimizer.learning_rate(),
                self.step,
                self.options.total_steps,
            ),
            in_backward,
        };
        Ok((plan, batches))
    }

    /// Forward and backward of each micro-batch, gradients accumulated; inside backward,
    /// each parameter's own guard (its norm, the loss's finiteness) decides its update.
    fn micro_batches(
        &mut self,
        be: &dyn Backend,
        plan: &Plan,
        batches: Vec<Batch>,
        buffers: &mut Buffers,
        inside: &mut InBackward,
        buckets: &mut Option<Buckets>,
    ) -> Result<PassStats> {
        let ledger = be.ledger().clone();
        let host = self.host_for_offload()?;
        let (step, seed) = (self.step + 1, self.options.seed);
        let first = self.collective.rank() * plan.k;
        // ZeRO-2: the owners of the updates, whose gradients each rank keeps.
        let sharded_grads = self.kept_grads().is_some().then(|| self.owners.clone());
        let collective = Arc::clone(&self.collective);
        let c = collective.as_ref();
        let Trainer {
            model,
            params,
            precision,
            checkpoint,
            optimizer,
            observer,
            data: _,
            options,
            ..
        } = self;
        std::thread::scope(|scope| {
            // The updates inside backward (offloaded, on a host thread).
            let mut updater = plan.in_backward.then(|| {
                let host = host.as_deref();
                Updater::start(scope, be, host, optimizer, (plan.lr, step, seed))
            });
            let mut totals = PassStats::default();
            for (j, batch) in batches.into_iter().enumerate() {
                ledger.phase_begin(Phase::MicroBatch(j));
                let record = &mut buffers.record;
                let inside = &mut *inside;
                let updater_now = &mut updater;
                // The last micro-batch completes each gradient: into a bucket.
                let last = j + 1 == plan.k;
                let mut bucket = buckets.as_mut().filter(|_| last);
                // ZeRO-2: every micro-batch's, each rank keeping its share.
                let mut sharded = sharded_grads.as_deref().map(|owners| {
                    Buckets::start(
                        Arc::clone(&collective),
                        options.bucket_bytes,
                        owners.len(),
                        Some(owners),
                        (be.holds_data(), plan.in_backward),
                    )
                });
                // Inside backward with several ranks: every rank's losses, summed before
                // the first update reads them.
                let mut summed_losses: Option<Tensor> = None;
                let sums = bucket.is_some() || sharded.is_some();
                // Separate accumulation: the running sum taken out, this micro-batch's
                // gradients computed apart and added to it as each is complete.
                let mut stash: Option<Vec<Option<Tensor>>> = (options.separate_accumulation
                    && j > 0)
                    .then(|| params.iter_mut().map(Param::take_grad).collect());
                let folds = stash.is_some();
                let mut update = |ps: &mut [Param], i: usize, losses: &Tensor| -> Result<()> {
                    if let Some(sum) = stash.as_mut().and_then(|s| s[i].take()) {
                        ps[i].fold_grad(be, sum)?;
                    }
                    // The losses are summed before the first bucket goes to the
                    // communication thread, whose collectives no other may cross.
                    let losses = if updater_now.is_some() {
                        summed(c, be, losses, &mut summed_losses)?
                    } else {
                        losses
                    };
                    let complete = match (bucket.as_deref_mut(), sharded.as_mut()) {
                        (Some(b), _) | (None, Some(b)) => b.ready(be, ps, i)?,
                        (None, None) => vec![i],
                    };
                    if let Some(u) = updater_now.as_mut() {
                        for i in complete {
                            u.update_ready(be, ps, i, losses, record, plan.loss_scale, inside)?;
                        }
                    }
                    Ok(())
                };
                let mut pass = Pass {
                    backend: be,
                    params,
                    checkpoint: &*checkpoint,
                    dtype: precision.compute_dtype(),
                    offload: options.offload_activations,
                    grad_ready: if plan.in_backward || sums || folds {
                        Some(&mut update)
                    } else {
                        None
                    },
                    // Numbered in the global step, as one process accumulating every
                    // rank's micro-batches would number them.
                    rng_key: Some(micro_batch_key(seed, step, first + j)),
                    stream_ahead: options.placement.ahead(),
                };
                let s = model.forward_backward(
                    &mut pass,
                    &batch,
                    plan.grad_scale,
                    &mut buffers.losses,
                )?;
                // The sums no hook reported.
                for (p, sum) in params.iter_mut().zip(stash.into_iter().flatten()) {
                    if let Some(sum) = sum {
                        p.fold_grad(be, sum)?;
                    }
                }
                // The sums still in flight, and (inside backward) their updates.
                let mut complete = Vec::new();
                if let Some(sharded) = sharded {
                    complete = sharded.finish(be, params)?;
                }
                if last && plan.in_backward {
                    if let Some(b) = buckets.take() {
                        complete = b.finish(be, params)?;
                    }
                }
                // Inside backward the losses are every rank's from here on (summed now if
                // no hook did).
                if let Some(u) = updater.as_mut() {
                    let losses = summed(c, be, &buffers.losses, &mut summed_losses)?;
                    for i in complete {
                        let (record, loss_scale) = (&mut buffers.record, plan.loss_scale);
                        u.update_ready(be, params, i, losses, record, loss_scale, inside)?;
                    }
                }
                if let Some(losses) = summed_losses {
                    buffers.losses = losses;
                }
                let stash = &mut totals.stash;
                stash.kept_bytes += s.stash.kept_bytes;
                stash.dropped_bytes += s.stash.dropped_bytes;
                stash.recomputed_bytes += s.stash.recomputed_bytes;
                stash.offloaded_bytes += s.stash.offloaded_bytes;
                totals.streamed_bytes += s.streamed_bytes;
                if j + 1 == plan.k {
                    // The last update in flight is back before the micro-batch ends.
                    if let Some(u) = updater.take() {
                        u.close(be, params)?;
                    }
                }
                ledger.phase_end(Phase::MicroBatch(j));
                for e in ledger.drain_events() {
                    observer.on_event(&e);
                }
            }
            Ok(totals)
        })
    }

    /// With more than one rank, every gradient and the per-position losses summed across
    /// the ranks, so that the guard, the clipping and the update see the global step's
    /// (the same on every rank, which keeps the weights in step).
    fn sum_across_ranks(
        &mut self,
        be: &dyn Backend,
        buffers: &mut Buffers,
        buckets: Option<Buckets>,
    ) -> Result<()> {
        let c = self.collective.as_ref();
        // Inside backward the gradients were summed and spent, and the losses summed
        // before the first update.
        if c.world() == 1 || self.options.optimizer_in_backward {
            return Ok(());
        }
        match buckets {
            // The buckets backward filled, and what it left.
            Some(b) => {
                b.finish(be, &mut self.params)?;
            }
            // ZeRO-2: summed micro-batch by micro-batch already.
            None if self.kept_grads().is_some() => {}
            // Every trained parameter, in the same order on every rank (one a rank's
            // micro-batches left without a gradient sums zeros).
            None => {
                for p in self.params.iter_mut().filter(|p| p.trains()) {
                    all_reduce_tensor(c, be, p.grad_mut(be)?)?;
                }
            }
        }
        all_reduce_tensor(c, be, &mut buffers.losses)
    }

    /// The step's gradient buckets ([`TrainerOptions::bucket_bytes`]) in a data-parallel
    /// job; `None` sums each gradient after backward. Inside backward the gradients are
    /// always summed as they are complete (a bucket size of 0 gives each its own).
    fn buckets(&self, be: &dyn Backend) -> Option<Buckets> {
        let c = &self.collective;
        let (bytes, early) = (
            self.options.bucket_bytes,
            self.options.optimizer_in_backward,
        );
        (c.world() > 1 && (bytes > 0 || early) && self.kept_grads().is_none()).then(|| {
            let params = self.params.len();
            Buckets::start(Arc::clone(c), bytes, params, None, (be.holds_data(), early))
        })
    }

    /// Under ZeRO-1, each trained parameter's updated compute weights sent by the rank
    /// that owns its update to the others ([`Trainer::join`]), in model order on every
    /// rank. A no-op otherwise.
    fn receive_updates(&mut self, be: &dyn Backend) -> Result<()> {
        if self.owners.is_empty() {
            return Ok(());
        }
        let c = self.collective.as_ref();
        for (p, &owner) in self.params.iter_mut().zip(&self.owners) {
            if p.trains() {
                broadcast_tensor(c, be, p.weight_mut(), owner)?;
            }
        }
        Ok(())
    }

    /// The host memory of an offloaded optimizer ([`Backend::host`]), `None` without
    /// offload.
    fn host_for_offload(&self) -> Result<Option<Arc<dyn Backend>>> {
        if !self.options.optimizer_offload {
            return Ok(None);
        }
        self.backend.host().map(Some).ok_or_else(|| Error::Backend {
            backend: self.backend.name(),
            message: "the backend lost its host memory".to_string(),
        })
    }

    /// The optimizer phase: unless the parameters were updated inside backward, the
    /// norm, the clipping multiplier and the skip decision are made on the device and the
    /// optimizer applies them there (AdamW skips a non-finite step in its kernel). Ends
    /// with the step's one read: the loss for logging, the norm and the skip decision.
    fn update(
        &mut self,
        be: &dyn Backend,
        plan: &Plan,
        buffers: Buffers,
        inside: &mut InBackward,
    ) -> Result<StepRecord> {
        let ledger = be.ledger().clone();
        let Buffers { losses, mut record } = buffers;
        ledger.phase_begin(Phase::Optimizer);
        if !plan.in_backward {
            match self.kept_grads() {
                Some(keep) => {
                    drop(record);
                    record = self.sharded_record(be, plan, &keep, &losses)?;
                }
                None => {
                    let grads: Vec<&Tensor> = self.params.iter().filter_map(|p| p.grad()).collect();
                    guard::grad_guard(
                        be,
                        &mut record,
                        &grads,
                        &losses,
                        self.options.grad_clip,
                        plan.loss_scale,
                    )?;
                }
            }
            let (step, seed) = (self.step + 1, self.options.seed);
            let host = self.host_for_offload()?;
            let (params, optimizer) = (&mut self.params, &mut self.optimizer);
            std::thread::scope(|scope| {
                // Every parameter at once on the device (pure bf16: one at a time);
                // offloaded, one after another through the host thread.
                let host = host.as_deref();
                let mut u = Updater::start(scope, be, host, optimizer, (plan.lr, step, seed));
                u.update(be, params, None, &record)?;
                u.close(be, params)
            })?;
        }
        let mut r = StepRecord::read(be, &record)?;
        if plan.in_backward {
            inside.settle(be)?;
            // ZeRO: each rank holds the figures of what it updated.
            if plan.world > 1 && !self.owners.is_empty() {
                inside.sum_across(self.collective.as_ref())?;
            }
            let loss_sum: f64 = be.to_f32(&losses)?.iter().map(|&l| l as f64).sum();
            r = StepRecord {
                scale: if inside.all_finite() && loss_sum.is_finite() {
                    1.0 / plan.loss_scale
                } else {
                    f32::NAN
                },
                grad_norm: inside.norm_squares().sqrt() as f32,
                loss_sum: loss_sum as f32,
            };
        }
        drop((record, losses));
        ledger.phase_end(Phase::Optimizer);
        Ok(r)
    }

    /// ZeRO-2's guard: each rank holds its share of the gradients (`keep`), so the ranks
    /// sum their squares parameter by parameter and add them in model order, as one
    /// process's guard adds every gradient's; the record is the one [`guard::grad_guard`]
    /// would write from every gradient.
    fn sharded_record(
        &self,
        be: &dyn Backend,
        plan: &Plan,
        keep: &[bool],
        losses: &Tensor,
    ) -> Result<Tensor> {
        let mut squares = vec![0f64; self.params.len()];
        // Every kept gradient's squares at once (one read back on a GPU).
        let (at, grads): (Vec<usize>, Vec<&Tensor>) = self
            .params
            .iter()
            .zip(keep)
            .enumerate()
            .filter_map(|(i, (p, &keep))| p.grad().filter(|_| keep).map(|g| (i, g)))
            .unzip();
        for (i, sq) in at.into_iter().zip(be.sum_squares_each(&grads)?) {
            squares[i] = sq;
        }
        self.collective.all_reduce_sum_f64(&mut squares)?;
        guard::record_from_squares(
            be,
            squares.iter().sum(),
            losses,
            self.options.grad_clip,
            plan.loss_scale,
            "step.record",
        )
    }

    /// The books after the update: the loss scale answers an overflow, a non-finite step
    /// counts as skipped (and towards divergence), the counters move on; too many bad
    /// steps in a row end training with [`Error::Diverged`].
    fn keep_books(&mut self, plan: &Plan, r: &StepRecord) -> Result<()> {
        let loss = r.loss_sum as f64 / plan.counted.max(1) as f64;
        let grad_norm = r.grad_norm as f64;
        let finite = r.finite();
        // An overflow of the scaled gradients with a finite loss is the loss scale's to
        // answer (it shrinks), not a sign of divergence.
        let overflow = !finite && loss.is_finite() && self.precision.overflow_expected();
        self.precision.update_loss_scale(finite);
        if finite {
            self.bad_streak = 0;
        } else if overflow {
            self.skipped_steps += 1;
            log::info!(
                "step {}: gradients overflowed at loss scale {}; update skipped, loss scale \
                 now {}",
                self.step + 1,
                plan.loss_scale,
                self.precision.loss_scale()
            );
        } else {
            self.skipped_steps += 1;
            self.bad_streak += 1;
            log::warn!(
                "step {}: loss {loss} or gradient norm {grad_norm} is not finite; update skipped",
                self.step + 1
            );
        }
        self.step += 1;
        self.tokens_seen += plan.tokens();
        let max_bad = self.options.max_bad_steps;
        if max_bad > 0 && self.bad_streak >= max_bad {
            self.flush_events();
            return Err(Error::Diverged {
                message: format!(
                    "{} steps in a row up to step {} had a non-finite loss or gradient norm \
                     (last: loss {loss}, gradient norm {grad_norm}); their updates were \
                     skipped, so the weights are those of step {}. Lower the learning rate, \
                     clip gradients, or raise max_bad_steps",
                    self.bad_streak,
                    self.step,
                    self.step - self.bad_streak
                ),
            });
        }
        Ok(())
    }

    /// The step's statistics: loss, norm, throughput, memory and FLOP utilisation.
    fn report(
        &mut self,
        be: &dyn Backend,
        plan: &Plan,
        r: &StepRecord,
        pass: PassStats,
        start: Instant,
    ) -> StepStats {
        let ledger = be.ledger().clone();
        ledger.step_end(self.step, None);
        self.flush_events();
        let snap = ledger.snapshot();
        let seconds = start.elapsed().as_secs_f64();
        let tokens = plan.tokens();
        let model_flops = self.model.flops_per_token(self.data.seq_len()) * tokens as f64;
        let utilisation = |flops: f64| {
            self.options
                .peak_flops
                .filter(|p| *p > 0.0)
                .map(|peak| flops / seconds.max(1e-12) / peak)
        };
        StepStats {
            step: self.step,
            loss: r.loss_sum as f64 / plan.counted.max(1) as f64,
            trained_tokens: plan.counted,
            trained_tokens_per_s: plan.counted as f64 / seconds.max(1e-12),
            grad_norm: r.grad_norm as f64,
            lr: plan.lr,
            tokens,
            micro_batches: plan.k,
            seconds,
            tokens_per_s: tokens as f64 / seconds.max(1e-12),
            skipped: !r.finite(),
            loss_scale: plan.loss_scale,
            memory: StepMemory {
                peak: snap.peak,
                peak_total: snap.peak_total,
                at_peak: snap.at_peak,
                device: be.device_memory(),
            },
            model_flops,
            hardware_flops: snap.flops,
            mfu: utilisation(model_flops),
            hfu: utilisation(snap.flops as f64),
            stash: pass.stash,
            streamed_bytes: pass.streamed_bytes,
        }
    }
}

/// The random key of micro-batch `j` of step `step` in a run seeded `seed`
/// ([`Pass::rng_key`]): its own for every micro-batch, the same when a resumed run
/// replays the step, and apart from the keys of the update rounding.
pub(crate) fn micro_batch_key(seed: u64, step: u64, j: usize) -> u64 {
    const DROPOUT: u64 = 0x6c6f_7261_5f64_726f; // "lora_dro"
    crate::rng::stream_key(seed ^ DROPOUT, step, j as u64)
}

/// The step's per-position `losses` as the update inside backward reads them: with more
/// than one rank, a copy summed across the ranks (made once, into `slot`, before the
/// first update), so that every rank's guard sees the global step's.
fn summed<'a>(
    c: &dyn Collective,
    be: &dyn Backend,
    losses: &'a Tensor,
    slot: &'a mut Option<Tensor>,
) -> Result<&'a Tensor> {
    if c.world() == 1 {
        return Ok(losses);
    }
    let all = match slot.take() {
        Some(all) => all,
        None => {
            let mut all = be.copy(losses, MemoryCategory::Workspace, "step.losses.summed")?;
            all_reduce_tensor(c, be, &mut all)?;
            all
        }
    };
    Ok(slot.insert(all))
}
