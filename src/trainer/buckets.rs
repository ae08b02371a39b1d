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
//!
//! For the update inside backward the buckets also say when each sum is complete
//! ([`Buckets::start`]'s `early`): when a bucket closes, the one closed before it is
//! awaited and its members are returned, to be updated while backward goes on (one
//! bucket in flight beside the compute). Which bucket a gradient joins and when it is
//! returned depend only on the model and the bucket size, never on the engine or the
//! timing, so the meta backend's rehearsal (which sums nothing) frees and allocates in
//! the same order as the ranks do.

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
    /// Nowhere: a backend that holds no values (the meta backend's rehearsal), whose
    /// buckets only free what a rank does not keep, where the ranks free it.
    Rehearsed,
}

/// The bucket being filled.
#[derive(Default)]
struct Open {
    /// Its parameters, in the order they joined.
    members: Vec<usize>,
    /// Their values.
    count: usize,
    /// Those whose values are read into `values`, to be summed in host memory.
    host: Vec<usize>,
    values: Vec<f32>,
    /// Those on the device, summed in place together (one NCCL group).
    device: Vec<usize>,
}

/// A bucket whose sums were started.
struct Sent {
    members: Vec<usize>,
    /// The members summed in host memory, whose sums come back (none: nothing was sent).
    host: Vec<usize>,
}

/// One step's buckets and the thread that sums them.
pub(super) struct Buckets {
    /// Values a bucket holds before it is sent.
    cap: usize,
    open: Open,
    /// The buckets sent, oldest first.
    in_flight: VecDeque<Sent>,
    /// Whether a bucket is awaited as soon as the next one is sent (the update inside
    /// backward), rather than after backward.
    early: bool,
    /// Whether each parameter's gradient has joined a bucket.
    taken: Vec<bool>,
    /// Whether this rank keeps each parameter's summed gradient (ZeRO-2: only those it
    /// updates; every one otherwise).
    keep: Vec<bool>,
    /// ZeRO-2: the rank that updates each parameter, to which a gradient on the device is
    /// reduced (not all-reduced) where the engine sums device memory.
    owners: Option<Vec<usize>>,
    summer: Summer,
}

impl Buckets {
    /// Buckets of `bytes` (of f32 values; at least one value) for `params` parameters,
    /// summed across the ranks of `collective` on a thread of their own, in place on the
    /// device where the engine sums device memory, or not at all where the backend holds
    /// no values (`holds_data` false). Under ZeRO-2 `owners` gives the rank that updates
    /// each parameter: this rank keeps only its own parameters' sums (every one without).
    /// With `early`, [`Buckets::ready`] returns each bucket's members once its sums are
    /// written (as the bucket after it closes); else every sum is written by
    /// [`Buckets::finish`].
    pub(super) fn start(
        collective: Arc<dyn Collective>,
        bytes: usize,
        params: usize,
        owners: Option<&[usize]>,
        (holds_data, early): (bool, bool),
    ) -> Self {
        let rank = collective.rank();
        let keep = owners.map_or_else(
            || vec![true; params],
            |o| o.iter().map(|&r| r == rank).collect(),
        );
        let summer = if !holds_data {
            Summer::Rehearsed
        } else if collective.sums_on_device() {
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
            open: Open::default(),
            in_flight: VecDeque::new(),
            early,
            taken: vec![false; keep.len()],
            keep,
            owners: owners.map(<[usize]>::to_vec),
            summer,
        }
    }

    /// Parameter `i`'s gradient is complete: into the open bucket (zeros where this rank
    /// computed none), which is sent once full, or summed in place on the device; freed
    /// here when this rank does not keep it. Frozen parameters are left out. Returns the
    /// parameters whose sums this call completed (only with `early`: the members of the
    /// bucket sent before the one this call closed, in order).
    pub(super) fn ready(
        &mut self,
        be: &dyn Backend,
        params: &mut [Param],
        i: usize,
    ) -> Result<Vec<usize>> {
        let p = &mut params[i];
        if self.taken[i] || !p.trains() {
            return Ok(Vec::new());
        }
        self.taken[i] = true;
        self.open.members.push(i);
        self.open.count += p.numel();
        self.join(be, p, i)?;
        if self.open.count >= self.cap {
            return self.close(be, params);
        }
        Ok(Vec::new())
    }

    /// Starts parameter `i`'s sum in the open bucket: on the device where the engine sums
    /// device memory, else its values read into the bucket's; freed if not kept.
    fn join(&mut self, be: &dyn Backend, p: &mut Param, i: usize) -> Result<()> {
        let on_device = match &self.summer {
            Summer::Rehearsed => true,
            // A gradient on the device, where the engine sums device memory, stays there.
            Summer::Inline { collective, .. }
                if matches!(p.grad_mut(be)?.storage(), Storage::Device(_)) =>
            {
                match &self.owners {
                    // DDP and ZeRO-1: summed with the bucket's others, in one group.
                    None => {
                        self.open.device.push(i);
                        return Ok(());
                    }
                    // ZeRO-2: reduced to its owner at once (the free waits for the sum
                    // that reads it, on the device).
                    Some(owners) => {
                        let reduced = collective.reduce_device(p.grad_mut(be)?, owners[i])?;
                        if reduced && !self.keep[i] {
                            collective.settle_device()?;
                        }
                        reduced
                    }
                }
            }
            _ => false,
        };
        if !on_device {
            match p.grad() {
                Some(g) => read_into(be, g, &mut self.open.values)?,
                None => self
                    .open
                    .values
                    .resize(self.open.values.len() + p.numel(), 0.0),
            }
            self.open.host.push(i);
        }
        if !self.keep[i] {
            p.drop_grad();
        }
        Ok(())
    }

    /// Sends the open bucket, if it holds anything; with `early`, awaits the one sent
    /// before it and returns its members.
    fn close(&mut self, be: &dyn Backend, params: &mut [Param]) -> Result<Vec<usize>> {
        if self.open.members.is_empty() {
            return Ok(Vec::new());
        }
        let open = std::mem::take(&mut self.open);
        let mut done = Vec::new();
        // On the device the older sums are awaited first, so that compute waits for them
        // and not for this bucket's.
        if self.early && matches!(self.summer, Summer::Inline { .. }) && !self.in_flight.is_empty()
        {
            done = self.complete_oldest(be, params)?;
        }
        let sent = Sent {
            members: open.members,
            host: open.host,
        };
        match &mut self.summer {
            Summer::Rehearsed => {}
            Summer::Thread { jobs, .. } => {
                if !sent.host.is_empty() {
                    jobs.as_ref()
                        .and_then(|jobs| jobs.send(open.values).ok())
                        .ok_or_else(stopped)?;
                }
            }
            Summer::Inline { collective, done } => {
                let members = open.device;
                if !members.is_empty() {
                    collective.group(&mut || {
                        for &i in &members {
                            let name = params[i].name().to_string();
                            let g = params[i].grad_if_any_mut().ok_or_else(|| missing(&name))?;
                            if !collective.all_reduce_device(g)? {
                                return Err(missing(&name));
                            }
                        }
                        Ok(())
                    })?;
                }
                if !sent.host.is_empty() {
                    let mut values = open.values;
                    collective.all_reduce_sum(&mut values)?;
                    done.push_back(values);
                }
            }
        }
        self.in_flight.push_back(sent);
        if self.early && !matches!(self.summer, Summer::Inline { .. }) && self.in_flight.len() > 1 {
            done = self.complete_oldest(be, params)?;
        }
        Ok(done)
    }

    /// Awaits the oldest bucket sent, writes the sums this rank keeps into their
    /// gradients and returns its members.
    fn complete_oldest(&mut self, be: &dyn Backend, params: &mut [Param]) -> Result<Vec<usize>> {
        let Some(sent) = self.in_flight.pop_front() else {
            return Ok(Vec::new());
        };
        if let Summer::Inline { collective, .. } = &self.summer {
            // What reads the gradients next waits for their sums (on the device).
            collective.settle_device()?;
        }
        if !sent.host.is_empty() && !matches!(self.summer, Summer::Rehearsed) {
            let sums = self.next_sums()?;
            let mut at = 0;
            for &i in &sent.host {
                let n = params[i].numel();
                let values = sums.get(at..at + n).ok_or_else(stopped)?;
                if self.keep[i] {
                    write_back(be, params[i].grad_mut(be)?, values)?;
                }
                at += n;
            }
        }
        Ok(sent.members)
    }

    /// The sums of the next bucket sent.
    fn next_sums(&mut self) -> Result<Vec<f32>> {
        match &mut self.summer {
            Summer::Thread { done, .. } => done.recv().map_err(|_| stopped())?,
            Summer::Inline { done, .. } => done.pop_front().ok_or_else(stopped),
            Summer::Rehearsed => Err(stopped()),
        }
    }

    /// After backward: the gradients no hook reported (in model order), the last bucket
    /// sent, and every sum written into its gradient. Returns the parameters whose sums
    /// this call completed, in order (with `early`, those [`Buckets::ready`] did not
    /// return; else every one).
    pub(super) fn finish(mut self, be: &dyn Backend, params: &mut [Param]) -> Result<Vec<usize>> {
        let mut done = Vec::new();
        for i in 0..params.len() {
            done.extend(self.ready(be, params, i)?);
        }
        done.extend(self.close(be, params)?);
        while !self.in_flight.is_empty() {
            done.extend(self.complete_oldest(be, params)?);
        }
        match &mut self.summer {
            Summer::Thread { jobs, thread, .. } => {
                *jobs = None;
                if let Some(t) = thread.take() {
                    t.join().map_err(|_| stopped())?;
                }
            }
            // What reads the gradients next (the guard, the update, the next micro-batch's
            // backward) waits for their sums.
            Summer::Inline { collective, .. } => collective.settle_device()?,
            Summer::Rehearsed => {}
        }
        Ok(done)
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
