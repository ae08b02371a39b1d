//! The offloaded optimizer's host thread: each parameter's update runs there while the
//! trainer goes on with backward (or, after backward, with the next parameter's copies).
//!
//! The trainer's thread starts an update ([`Param::start_host_update`]: the gradient
//! copied to host memory), hands it over, and finishes the one before it
//! ([`Param::finish_host_update`]: the compute weights refreshed and copied back): one
//! update is in flight at a time, so the host holds at most two parameters' copies, and
//! every buffer is allocated and freed on the trainer's thread in the same order on every
//! run, so the ledger (and the meta backend's prediction of it) does not depend on how the
//! threads interleave. The host thread only runs the optimizer's step, whose arithmetic is
//! the same whichever thread runs it: the update is bitwise the one without offload.

use super::update::step_optimizer;
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::model::Param;
use crate::optim::{GradScale, Optimizer};
use crate::param::HostUpdate;
use crate::tensor::Tensor;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::{Scope, ScopedJoinHandle};

/// One step's host thread and the update in flight on it.
pub(super) struct HostWorker<'scope> {
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
    pub(super) fn spawn<'env, O: Optimizer>(
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
    pub(super) fn submit(
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
    pub(super) fn finish(&mut self, backend: &dyn Backend, params: &mut [Param]) -> Result<()> {
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
    pub(super) fn close(mut self, backend: &dyn Backend, params: &mut [Param]) -> Result<()> {
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
