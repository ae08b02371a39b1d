//! The update: the one path by which an optimizer changes the weights. It decides what
//! trains (frozen parameters never reach an optimizer), allocates the optimizer's state
//! slots, makes pure bf16's f32 copies and rounds them back, and runs the update where
//! the run asks: over every parameter at once, one parameter at a time (pure bf16), on
//! the host thread of an offloaded optimizer, or inside backward as each gradient is
//! complete. [`Updater`] is that choice, made once per step; [`update_params`] is one
//! update on the device, as the trainer runs it.

use crate::collective::Collective;
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::model::Param;
use crate::optim::{guard, GradScale, Optimizer, StepRecord};
use crate::param::HostUpdate;
use crate::tensor::{DType, Tensor};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::{Scope, ScopedJoinHandle};

/// One update of `params` by `optimizer` at `step` (1-based) and learning rate `lr`, as
/// the trainer runs it: parameters that do not train, or that another rank updates
/// ([`Param::updated_here`]), are skipped; each trainable one gets
/// the state slots the optimizer declares ([`Optimizer::state_slots`]) before its first
/// update; the optimizer updates them together ([`Optimizer::update`]), except pure
/// bf16's, which are widened to f32, updated and rounded back one at a time (one f32 copy
/// exists at once; stochastic rounding keyed by `seed`, `step` and the parameter's
/// name); then the compute weights are refreshed from the master copies the optimizer did
/// not write itself.
pub fn update_params<O: Optimizer + ?Sized>(
    backend: &dyn Backend,
    optimizer: &mut O,
    params: &mut [Param],
    lr: f32,
    grad_scale: GradScale<'_>,
    step: u64,
    seed: u64,
) -> Result<()> {
    if params.iter().any(|p| p.update_rounding().is_some()) {
        for p in params.iter_mut() {
            let one = std::slice::from_mut(p);
            step_optimizer(backend, optimizer, one, lr, grad_scale, step)?;
            refresh(backend, one, step, seed)?;
        }
        return Ok(());
    }
    step_optimizer(backend, optimizer, params, lr, grad_scale, step)?;
    refresh(backend, params, step, seed)
}

/// The optimizer's update of the trainable `params` on `backend` (the device, or the host
/// thread's memory), their values made ready ([`Param::begin_update`]) and their state
/// slots allocated first; the compute weights are left to [`refresh`].
pub(super) fn step_optimizer<O: Optimizer + ?Sized>(
    backend: &dyn Backend,
    optimizer: &mut O,
    params: &mut [Param],
    lr: f32,
    grad_scale: GradScale<'_>,
    step: u64,
) -> Result<()> {
    let fused = optimizer.writes_compute();
    let mut updates = Vec::with_capacity(params.len());
    for p in params.iter_mut().filter(|p| p.updated_here()) {
        p.begin_update(backend)?;
        // Asked once, before the parameter's first update (a resumed run loads its state).
        let slots = if p.state().is_empty() {
            optimizer.state_slots(p.shape(), p.kept_dtype())
        } else {
            Vec::new()
        };
        updates.push(p.for_update(backend, &slots, fused)?);
    }
    if updates.is_empty() {
        return Ok(());
    }
    optimizer.update(backend, &mut updates, lr, grad_scale, step)
}

/// The compute weights of the trainable `params` after their update: copied from the
/// master weights unless the optimizer wrote them, or pure bf16's rounding.
fn refresh(backend: &dyn Backend, params: &mut [Param], step: u64, seed: u64) -> Result<()> {
    for p in params.iter_mut().filter(|p| p.updated_here()) {
        // The stochastic rounding's stream, for pure bf16 alone (its name hashed).
        let key = match p.update_rounding() {
            Some(_) => p.rounding_key(seed, step),
            None => 0,
        };
        p.refresh_after_step(backend, key)?;
    }
    Ok(())
}

/// What the updates made inside backward add up to: each parameter's squared gradient
/// norm and whether every gradient was finite. Each update's record stays on the device
/// (a row of `records`) until backward is done, so the host never waits for the device
/// inside backward: [`InBackward::settle`] reads them all at once. With more than one
/// rank, each rank holds the figures of the parameters it updated;
/// [`InBackward::sum_across`] gives every rank the step's.
pub(super) struct InBackward {
    /// Each parameter's squared gradient norm (loss scale removed), zero where this rank
    /// did not update it (read by [`InBackward::settle`]).
    squares: Vec<f64>,
    /// The guard's record of each parameter this rank updated, in its row of
    /// [`StepRecord::LEN`]; the rows of the others stay zero (a finite record of norm 0,
    /// what they add). Allocated at the first update.
    records: Option<Tensor>,
    /// The parameters in the order their gradients were complete (the same on every
    /// rank), each once.
    order: Vec<usize>,
    seen: Vec<bool>,
    /// How many updated gradients (with the losses) were not finite.
    non_finite: f64,
}

impl InBackward {
    /// Nothing updated yet, of `params` parameters.
    pub(super) fn new(params: usize) -> Self {
        InBackward {
            squares: vec![0.0; params],
            records: None,
            order: Vec::new(),
            seen: vec![false; params],
            non_finite: 0.0,
        }
    }

    /// Keeps `record`, parameter `i`'s guard record, in its row of the records (a copy on
    /// the device: the host does not wait for it).
    fn keep(&mut self, device: &dyn Backend, i: usize, record: &Tensor) -> Result<()> {
        let records = match &mut self.records {
            Some(t) => t,
            None => {
                let shape = [self.squares.len(), StepRecord::LEN];
                let (f32, space) = (DType::F32, MemoryCategory::Workspace);
                self.records
                    .insert(device.zeros(&shape, f32, space, "step.records")?)
            }
        };
        device.copy_rows(records, i, record, 0, 1, false)
    }

    /// Reads the records the updates left (one wait for the device, after backward) into
    /// the squared norms and the count of non-finite gradients, and frees them.
    pub(super) fn settle(&mut self, device: &dyn Backend) -> Result<()> {
        let Some(records) = self.records.take() else {
            return Ok(());
        };
        let values = device.to_f32(&records)?;
        for (i, row) in values.chunks_exact(StepRecord::LEN).enumerate() {
            let r = StepRecord::from_values(row);
            self.squares[i] = (r.grad_norm as f64).powi(2);
            if !r.finite() {
                self.non_finite += 1.0;
            }
        }
        Ok(())
    }

    /// The sum of the squares of the updated gradients' norms, added in the order the
    /// gradients were complete.
    pub(super) fn norm_squares(&self) -> f64 {
        self.order.iter().fold(0.0, |s, &i| s + self.squares[i])
    }

    /// Whether every updated gradient, and the losses, were finite.
    pub(super) fn all_finite(&self) -> bool {
        self.non_finite == 0.0
    }

    /// Every rank's figures summed (each parameter is updated by one rank, and a sum of
    /// it and zeros is exact), so that every rank reports the step's norm and makes the
    /// same skip decision.
    pub(super) fn sum_across(&mut self, c: &dyn Collective) -> Result<()> {
        let mut values = self.squares.clone();
        values.push(self.non_finite);
        c.all_reduce_sum_f64(&mut values)?;
        self.non_finite = values.pop().unwrap_or(0.0);
        self.squares = values;
        Ok(())
    }
}

/// Where one step's updates run: on the device through [`update_params`], or on the host
/// thread of an offloaded optimizer ([`HostWorker`]).
pub(super) struct Updater<'scope, 'env, O: Optimizer> {
    on: On<'scope, 'env, O>,
    lr: f32,
    step: u64,
    seed: u64,
}

/// The two places an update runs.
enum On<'scope, 'env, O> {
    Device(&'env mut O),
    Host(HostWorker<'scope>),
}

impl<'scope, 'env, O: Optimizer> Updater<'scope, 'env, O> {
    /// The updates of step `step` (1-based) at learning rate `lr` in a run seeded `seed`:
    /// on `device`, or with `host` (the device's host memory, [`Backend::host`]) on a host
    /// thread of `scope`.
    pub(super) fn start(
        scope: &'scope Scope<'scope, 'env>,
        device: &'env dyn Backend,
        host: Option<&'env dyn Backend>,
        optimizer: &'env mut O,
        (lr, step, seed): (f32, u64, u64),
    ) -> Self {
        let on = match host {
            Some(h) => On::Host(HostWorker::spawn(
                scope, device, h, optimizer, lr, step, seed,
            )),
            None => On::Device(optimizer),
        };
        Updater { on, lr, step, seed }
    }

    /// Updates parameter `only`, or every parameter, of `params` with the guard's
    /// `record` (its multiplier and skip decision): those that do not train are skipped.
    /// On the host thread each parameter's update is in flight while the next one's
    /// copies start; [`Updater::close`] waits for the last.
    pub(super) fn update(
        &mut self,
        device: &dyn Backend,
        params: &mut [Param],
        only: Option<usize>,
        record: &Tensor,
    ) -> Result<()> {
        let range = match only {
            Some(i) => i..i + 1,
            None => 0..params.len(),
        };
        match &mut self.on {
            On::Device(optimizer) => update_params(
                device,
                &mut **optimizer,
                &mut params[range],
                self.lr,
                GradScale::new(record)?,
                self.step,
                self.seed,
            ),
            On::Host(worker) => {
                for i in range {
                    if params[i].updated_here() {
                        worker.submit(device, params, i, record)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The update inside backward of parameter `i`, whose gradient is complete (summed
    /// across the ranks, where there are several): its own guard into `record` (its
    /// norm, and whether it and the step's `losses` are finite, the loss scale removed:
    /// no clipping, which needs every gradient at once), the update, and its gradient
    /// freed. `inside` adds up the norms and the finiteness for the step's record. A
    /// parameter without a gradient (it trains nothing this pass) is left alone; one
    /// another rank updates (ZeRO) only has its gradient freed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn update_ready(
        &mut self,
        device: &dyn Backend,
        params: &mut [Param],
        i: usize,
        losses: &Tensor,
        record: &mut Tensor,
        loss_scale: f32,
        inside: &mut InBackward,
    ) -> Result<()> {
        if !std::mem::replace(&mut inside.seen[i], true) {
            inside.order.push(i);
        }
        if !params[i].updated_here() {
            params[i].drop_grad();
            return Ok(());
        }
        let Some(grad) = params[i].grad() else {
            return Ok(());
        };
        guard::grad_guard(device, record, &[grad], losses, 0.0, loss_scale)?;
        inside.keep(device, i, record)?;
        self.update(device, params, Some(i), record)?;
        params[i].drop_grad();
        Ok(())
    }

    /// Finishes the update in flight on the host thread, if any, and ends the thread.
    pub(super) fn close(self, device: &dyn Backend, params: &mut [Param]) -> Result<()> {
        match self.on {
            On::Device(_) => Ok(()),
            On::Host(worker) => worker.close(device, params),
        }
    }
}

/// One step's host thread, where an offloaded optimizer's updates run, and the update in
/// flight on it: each parameter's update runs there while the trainer goes on with
/// backward (or, after backward, with the next parameter's copies).
///
/// The trainer's thread starts an update (`Param::start_host_update`: the gradient copied
/// to host memory), hands it over, and finishes the one before it
/// (`Param::finish_host_update`: the compute weights refreshed and copied back): one
/// update is in flight at a time, so the host holds at most two parameters' copies, and
/// every buffer the trainer's thread handles is allocated and freed in the same order on
/// every run, so the ledger (and the meta backend's prediction of it) does not depend on
/// how the threads interleave. The host thread runs only [`step_optimizer`], whose
/// arithmetic is the same whichever thread runs it: the update is bitwise the one without
/// offload.
struct HostWorker<'scope> {
    jobs: Option<Sender<(usize, HostUpdate)>>,
    done: Receiver<(usize, HostUpdate, Result<()>)>,
    thread: Option<ScopedJoinHandle<'scope, ()>>,
    in_flight: Option<usize>,
    step: u64,
    seed: u64,
}

impl<'scope> HostWorker<'scope> {
    /// Starts the host thread of step `step` (1-based) at learning rate `lr`, running
    /// `optimizer` on `host` memory, the host memory of `device` (whose queued copies it
    /// waits for); `seed` keys pure bf16's stochastic rounding.
    fn spawn<'env, O: Optimizer>(
        scope: &'scope Scope<'scope, 'env>,
        device: &'env dyn Backend,
        host: &'env dyn Backend,
        optimizer: &'env mut O,
        lr: f32,
        step: u64,
        seed: u64,
    ) -> Self {
        let (jobs, inbox) = channel::<(usize, HostUpdate)>();
        let (outbox, done) = channel();
        let thread = scope.spawn(move || {
            for (i, mut job) in inbox {
                let result = job
                    .settle(device)
                    .and_then(|()| GradScale::new(&job.record))
                    .and_then(|scale| {
                        let param = std::slice::from_mut(&mut job.param);
                        step_optimizer(host, optimizer, param, lr, scale, step)
                    });
                if outbox.send((i, job, result)).is_err() {
                    return;
                }
            }
        });
        HostWorker {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            in_flight: None,
            step,
            seed,
        }
    }

    /// Starts parameter `i`'s update (its gradient must be complete; `record` holds the
    /// guard's decision for it), after finishing the update in flight.
    fn submit(
        &mut self,
        backend: &dyn Backend,
        params: &mut [Param],
        i: usize,
        record: &Tensor,
    ) -> Result<()> {
        let job = params[i].start_host_update(backend, record)?;
        self.finish(backend, params)?;
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send((i, job)).ok())
            .ok_or_else(stopped)?;
        self.in_flight = Some(i);
        Ok(())
    }

    /// Waits for the update in flight, if any, and puts it back into its parameter.
    fn finish(&mut self, backend: &dyn Backend, params: &mut [Param]) -> Result<()> {
        let Some(i) = self.in_flight.take() else {
            return Ok(());
        };
        let (j, job, stepped) = self.done.recv().map_err(|_| stopped())?;
        debug_assert_eq!(i, j);
        let p = &mut params[j];
        let key = p.rounding_key(self.seed, self.step);
        let finished = p.finish_host_update(backend, job, key);
        stepped.and(finished)
    }

    /// Finishes the update in flight and ends the thread.
    fn close(mut self, backend: &dyn Backend, params: &mut [Param]) -> Result<()> {
        let finished = self.finish(backend, params);
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            if let Err(panic) = t.join() {
                std::panic::resume_unwind(panic);
            }
        }
        finished
    }
}

/// The error of a host thread that is gone (it panicked, and the panic is raised when the
/// step's scope ends).
fn stopped() -> Error {
    Error::Backend {
        backend: "optimizer",
        message: "the host thread of the offloaded optimizer stopped".to_string(),
    }
}
