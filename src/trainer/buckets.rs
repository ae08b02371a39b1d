//! Gradients summed across ranks in buckets while backward runs, as DDP does: each
//! trained parameter's gradient joins the open bucket as soon as backward completes it
//! (in the same order on every rank: the order is the model graph's), and a bucket of
//! [`crate::TrainerOptions::bucket_bytes`] goes to a communication thread to be summed
//! while backward goes on. After backward the last bucket is sent, the sums come back in
//! order and are written into the gradients: the same sums as one all-reduce per
//! gradient (a bf16 gradient widened, summed in f32 and rounded once).
//!
//! The buckets are host buffers of f32 outside the ledger, as the MPI library's own
//! buffers are; a gradient on the device is read into one and written back through a
//! host copy.
//!
//! With an engine that sums device memory (NCCL, [`Collective::sums_on_device`]) a
//! gradient on the device is instead summed in place (in its own dtype, as DDP's buckets
//! are) on the device's communication stream, after the backward work that completed it
//! and beside the backward work that follows, and nothing is copied; compute waits for
//! the sums (on the device) only after backward, or before freeing a gradient. The rest
//! (host gradients) is summed on the calling thread, so that every rank queues its
//! collectives in the same order.
//!
//! Under ZeRO-2 a rank keeps only the gradients of the parameters it updates: the others
//! are freed as soon as they are in a bucket (or their sum is queued: the free is ordered
//! after it), and their sums are not written back, so gradient memory is this rank's
//! share plus what backward has not yet bucketed.

use crate::collective::{host_of, Collective};
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::model::Param;
use crate::tensor::{Storage, Tensor};
use half::{bf16, f16};
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Where full buckets are summed.
enum Summer {
    /// On a thread of their own, while backward goes on (engines of host memory: MPI).
    Thread {
        jobs: Option<Sender<Vec<f32>>>,
        done: Receiver<Result<Vec<f32>>>,
        thread: Option<JoinHandle<()>>,
    },
    /// On the calling thread, in order with the gradients summed on the device (NCCL).
    Inline {
        collective: Arc<dyn Collective>,
        done: VecDeque<Vec<f32>>,
    },
}

/// One step's buckets and the thread that sums them.
pub(super) struct Buckets {
    /// Values a bucket holds before it is sent.
    cap: usize,
    /// The open bucket.
    open: Vec<f32>,
    /// The parameters in it, in order.
    members: Vec<usize>,
    /// The parameters of each bucket sent, in the order sent.
    in_flight: Vec<Vec<usize>>,
    /// Whether each parameter's gradient has joined a bucket.
    taken: Vec<bool>,
    /// Whether this rank keeps each parameter's summed gradient (ZeRO-2: only those it
    /// updates; every one otherwise).
    keep: Vec<bool>,
    /// ZeRO-2: the rank that updates each parameter, to which a gradient on the device is
    /// reduced (not all-reduced) where the engine sums device memory.
    owners: Option<Vec<usize>>,
    /// Gradients on the device waiting to be summed together (one NCCL group per bucket
    /// of `cap` values), and their values.
    grouped: Vec<usize>,
    grouped_values: usize,
    summer: Summer,
}

impl Buckets {
    /// Buckets of `bytes` (of f32 values) for `params` parameters, summed across the
    /// ranks of `collective` on a thread of their own (or in place on the device, where
    /// the engine sums device memory). Under ZeRO-2 `owners` gives the rank that updates
    /// each parameter: this rank keeps only its own parameters' sums (every one without).
    pub(super) fn start(
        collective: Arc<dyn Collective>,
        bytes: usize,
        params: usize,
        owners: Option<&[usize]>,
    ) -> Self {
        let rank = collective.rank();
        let keep = owners.map_or_else(
            || vec![true; params],
            |o| o.iter().map(|&r| r == rank).collect(),
        );
        let summer = if collective.sums_on_device() {
            Summer::Inline {
                collective,
                done: VecDeque::new(),
            }
        } else {
            let (jobs, inbox) = channel::<Vec<f32>>();
            let (outbox, done) = channel();
            let thread = std::thread::spawn(move || {
                for mut bucket in inbox {
                    let summed = collective.all_reduce_sum(&mut bucket).map(|()| bucket);
                    if outbox.send(summed).is_err() {
                        return;
                    }
                }
            });
            Summer::Thread {
                jobs: Some(jobs),
                done,
                thread: Some(thread),
            }
        };
        Buckets {
            cap: (bytes / 4).max(1),
            open: Vec::new(),
            members: Vec::new(),
            in_flight: Vec::new(),
            taken: vec![false; keep.len()],
            keep,
            owners: owners.map(<[usize]>::to_vec),
            grouped: Vec::new(),
            grouped_values: 0,
            summer,
        }
    }

    /// Parameter `i`'s gradient is complete: into the open bucket (zeros where this rank
    /// computed none), which is sent once full, or summed in place on the device; freed
    /// here when this rank does not keep it. Frozen parameters are left out.
    pub(super) fn ready(&mut self, be: &dyn Backend, params: &mut [Param], i: usize) -> Result<()> {
        let p = &mut params[i];
        if self.taken[i] || !p.trains() {
            return Ok(());
        }
        self.taken[i] = true;
        // A gradient on the device, where the engine sums device memory, stays there.
        if let Summer::Inline { collective, .. } = &self.summer {
            if let Storage::Device(_) = p.grad_mut(be)?.storage() {
                match &self.owners {
                    // DDP and ZeRO-1: summed a bucket at a time, in one group.
                    None => {
                        self.grouped.push(i);
                        self.grouped_values += p.numel();
                        if self.grouped_values >= self.cap {
                            self.sum_grouped(params)?;
                        }
                        return Ok(());
                    }
                    // ZeRO-2: reduced to its owner at once, and freed where not kept.
                    Some(owners) => {
                        if collective.reduce_device(p.grad_mut(be)?, owners[i])? {
                            if !self.keep[i] {
                                // The free waits for the sum that reads it (on the device).
                                collective.settle_device()?;
                                p.drop_grad();
                            }
                            return Ok(());
                        }
                    }
                }
            }
        }
        match p.grad() {
            Some(g) => read_into(be, g, &mut self.open)?,
            None => self.open.resize(self.open.len() + p.numel(), 0.0),
        }
        if !self.keep[i] {
            p.drop_grad();
        }
        self.members.push(i);
        if self.open.len() >= self.cap {
            self.send()?;
        }
        Ok(())
    }

    /// Sums the gradients waiting on the device, in place, queued together as one group.
    fn sum_grouped(&mut self, params: &mut [Param]) -> Result<()> {
        let Summer::Inline { collective, .. } = &self.summer else {
            return Ok(());
        };
        if self.grouped.is_empty() {
            return Ok(());
        }
        let members = std::mem::take(&mut self.grouped);
        self.grouped_values = 0;
        collective.group(&mut || {
            for &i in &members {
                let name = params[i].name().to_string();
                let g = params[i].grad_if_any_mut().ok_or_else(|| missing(&name))?;
                if !collective.all_reduce_device(g)? {
                    return Err(missing(&name));
                }
            }
            Ok(())
        })
    }

    /// Sends the open bucket, if it holds anything.
    fn send(&mut self) -> Result<()> {
        if self.members.is_empty() {
            return Ok(());
        }
        let mut bucket = std::mem::take(&mut self.open);
        match &mut self.summer {
            Summer::Thread { jobs, .. } => {
                jobs.as_ref()
                    .and_then(|jobs| jobs.send(bucket).ok())
                    .ok_or_else(stopped)?;
            }
            Summer::Inline { collective, done } => {
                collective.all_reduce_sum(&mut bucket)?;
                done.push_back(bucket);
            }
        }
        self.in_flight.push(std::mem::take(&mut self.members));
        Ok(())
    }

    /// The sums of the next bucket sent.
    fn next_sums(&mut self) -> Result<Vec<f32>> {
        match &mut self.summer {
            Summer::Thread { done, .. } => done.recv().map_err(|_| stopped())?,
            Summer::Inline { done, .. } => done.pop_front().ok_or_else(stopped),
        }
    }

    /// After backward: the gradients no hook reported (in model order), the last bucket
    /// sent, and every sum written into its gradient.
    pub(super) fn finish(mut self, be: &dyn Backend, params: &mut [Param]) -> Result<()> {
        for i in 0..params.len() {
            self.ready(be, params, i)?;
        }
        self.sum_grouped(params)?;
        self.send()?;
        if let Summer::Thread { jobs, .. } = &mut self.summer {
            *jobs = None;
        }
        for members in std::mem::take(&mut self.in_flight) {
            let sums = self.next_sums()?;
            let mut at = 0;
            for i in members {
                let n = params[i].numel();
                let values = sums.get(at..at + n).ok_or_else(stopped)?;
                if self.keep[i] {
                    write_back(be, params[i].grad_mut(be)?, values)?;
                }
                at += n;
            }
        }
        match &mut self.summer {
            Summer::Thread { thread, .. } => {
                if let Some(t) = thread.take() {
                    t.join().map_err(|_| stopped())?;
                }
            }
            // What reads the gradients next (the guard, the update, the next micro-batch's
            // backward) waits for their sums.
            Summer::Inline { collective, .. } => collective.settle_device()?,
        }
        Ok(())
    }
}

/// Appends `g`'s values, as f32, to `out`.
fn read_into(be: &dyn Backend, g: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    match g.storage() {
        Storage::F32(v) => out.extend_from_slice(v),
        Storage::Bf16(v) => out.extend(v.iter().map(|x| x.to_f32())),
        Storage::F16(v) => out.extend(v.iter().map(|x| x.to_f32())),
        _ => out.extend(be.to_f32(g)?),
    }
    Ok(())
}

/// Writes `values` into gradient `g`, rounded once to its dtype.
fn write_back(be: &dyn Backend, g: &mut Tensor, values: &[f32]) -> Result<()> {
    match g.storage_mut() {
        Storage::F32(v) => v.copy_from_slice(values),
        Storage::Bf16(v) => v
            .iter_mut()
            .zip(values)
            .for_each(|(x, &s)| *x = bf16::from_f32(s)),
        Storage::F16(v) => v
            .iter_mut()
            .zip(values)
            .for_each(|(x, &s)| *x = f16::from_f32(s)),
        _ => {
            let staged = host_of(be, g)?.upload(
                values,
                g.shape(),
                g.dtype(),
                MemoryCategory::Workspace,
                &format!("{}.all_reduce", g.label()),
            )?;
            be.transfer(g, &staged)?;
        }
    }
    Ok(())
}

/// The error of a gradient that was on the device when bucketed and is not any more.
fn missing(name: &str) -> Error {
    Error::Backend {
        backend: "collective",
        message: format!("{name}: its gradient left the device before it was summed"),
    }
}

/// The error of a communication thread that is gone.
fn stopped() -> Error {
    Error::Backend {
        backend: "collective",
        message: "the thread summing gradient buckets across ranks stopped".to_string(),
    }
}

/// ZeRO-2's gradients of one micro-batch: summed in [`Buckets`] as backward completes
/// them, each rank keeping the sums of the parameters it updates and freeing the others
/// as soon as they are bucketed. On a backend that holds no values (the meta backend's
/// prediction) nothing is summed, and the same gradients are freed at the same points.
pub(super) struct ShardedGrads {
    keep: Vec<bool>,
    buckets: Option<Buckets>,
}

impl ShardedGrads {
    /// One micro-batch's sums across `collective`, in buckets of `bytes`, keeping the
    /// gradients of the parameters of which this rank is the owner in `owners`.
    pub(super) fn start(
        be: &dyn Backend,
        collective: &Arc<dyn Collective>,
        bytes: usize,
        owners: &[usize],
    ) -> Self {
        let rank = collective.rank();
        ShardedGrads {
            keep: owners.iter().map(|&r| r == rank).collect(),
            buckets: be
                .holds_data()
                .then(|| Buckets::start(Arc::clone(collective), bytes, owners.len(), Some(owners))),
        }
    }

    /// Parameter `i`'s gradient is complete ([`Buckets::ready`]).
    pub(super) fn ready(&mut self, be: &dyn Backend, params: &mut [Param], i: usize) -> Result<()> {
        match self.buckets.as_mut() {
            Some(b) => b.ready(be, params, i),
            None => {
                if !self.keep[i] {
                    params[i].drop_grad();
                }
                Ok(())
            }
        }
    }

    /// After the micro-batch's backward: every sum this rank keeps written into its
    /// gradient, every other gradient freed ([`Buckets::finish`]).
    pub(super) fn finish(self, be: &dyn Backend, params: &mut [Param]) -> Result<()> {
        match self.buckets {
            Some(b) => b.finish(be, params),
            None => {
                for (p, &keep) in params.iter_mut().zip(&self.keep) {
                    if !keep {
                        p.drop_grad();
                    }
                }
                Ok(())
            }
        }
    }
}
