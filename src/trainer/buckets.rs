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
//! share plus what backward has not yet bucketed. Each gradient is summed to its owner
//! alone (a reduce, not an all-reduce: half the traffic by a ring's count): in host
//! memory a bucket's values are laid out in runs by owner, one reduce per run.
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
        jobs: Option<Sender<(Vec<f32>, Segments)>>,
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
            let (jobs, inbox) = channel::<(Vec<f32>, Segments)>();
            let (outbox, done) = channel();
            let thread = std::thread::spawn(move || {
                for (mut bucket, segments) in inbox {
                    let summed = sum(collective.as_ref(), &mut bucket, &segments).map(|()| bucket);
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
        // Whether its sum needs no values in the host bucket.
        let apart = match &self.summer {
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
        if !apart {
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
        let mut open = std::mem::take(&mut self.open);
        let mut done = Vec::new();
        // ZeRO-2: the host values in runs by owner, each run reduced to its owner alone.
        let segments = match &self.owners {
            Some(owners) if !open.host.is_empty() => by_owner(&mut open, owners, params),
            _ => Vec::new(),
        };
        // With `early` the older bucket is awaited: on the device before this one is
        // queued, so that compute waits for its sums and not for this bucket's; elsewhere
        // after this one is sent, so that its sums run while this rank waits.
        let inline = matches!(self.summer, Summer::Inline { .. });
        if self.early && inline && !self.in_flight.is_empty() {
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
                        .and_then(|jobs| jobs.send((open.values, segments)).ok())
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
                    sum(collective.as_ref(), &mut values, &segments)?;
                    done.push_back(values);
                }
            }
        }
        self.in_flight.push_back(sent);
        if self.early && !inline && self.in_flight.len() > 1 {
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
        // (A rehearsal's buckets hold no host values.)
        if !sent.host.is_empty() {
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

/// Runs of a bucket's values (owner, values) that are reduced to their owner alone;
/// empty: the whole bucket is all-reduced.
type Segments = Vec<(usize, usize)>;

/// Sums `values` across the ranks of `c`: each run of `segments` to its owner, or (none)
/// all of them on every rank.
fn sum(c: &dyn Collective, values: &mut [f32], segments: &[(usize, usize)]) -> Result<()> {
    if segments.is_empty() {
        return c.all_reduce_sum(values);
    }
    let mut at = 0;
    for &(root, n) in segments {
        let run = values.get_mut(at..at + n).ok_or_else(stopped)?;
        c.reduce_sum(run, root)?;
        at += n;
    }
    Ok(())
}

/// Orders the open bucket's host members and their values by owner (model order within
/// an owner: the same on every rank) and returns the runs, one per owner present.
fn by_owner(open: &mut Open, owners: &[usize], params: &[Param]) -> Segments {
    let mut starts = Vec::with_capacity(open.host.len());
    let mut at = 0;
    for &i in &open.host {
        starts.push(at);
        at += params[i].numel();
    }
    let mut order: Vec<usize> = (0..open.host.len()).collect();
    order.sort_by_key(|&k| owners[open.host[k]]);
    let mut values = Vec::with_capacity(open.values.len());
    let mut host = Vec::with_capacity(open.host.len());
    let mut segments: Segments = Vec::new();
    for k in order {
        let i = open.host[k];
        let n = params[i].numel();
        values.extend_from_slice(&open.values[starts[k]..starts[k] + n]);
        host.push(i);
        match segments.last_mut() {
            Some((owner, len)) if *owner == owners[i] => *len += n,
            _ => segments.push((owners[i], n)),
        }
    }
    open.values = values;
    open.host = host;
    segments
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuBackend;
    use crate::precision::Fp32;
    use crate::tensor::DType;
    use std::sync::Mutex;

    /// Rank 0 of two whose peer holds the same values: every sum doubles; each call is
    /// written down as (root, values), `None` for an all-reduce.
    #[derive(Debug, Default)]
    struct Recording(Mutex<Vec<(Option<usize>, usize)>>);

    impl Collective for Recording {
        fn describe(&self) -> String {
            "recording".into()
        }
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            2
        }
        fn local_rank(&self) -> usize {
            0
        }
        fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()> {
            self.0.lock().unwrap().push((None, values.len()));
            values.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }
        fn reduce_sum(&self, values: &mut [f32], root: usize) -> Result<()> {
            self.0.lock().unwrap().push((Some(root), values.len()));
            values.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }
        fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<()> {
            unreachable!()
        }
        fn reduce_scatter_sum(&self, _: &[f32], _: &mut [f32]) -> Result<()> {
            unreachable!()
        }
        fn all_gather(&self, _: &[f32], _: &mut [f32]) -> Result<()> {
            unreachable!()
        }
        fn broadcast(&self, _: &mut [u8], _: usize) -> Result<()> {
            unreachable!()
        }
        fn barrier(&self) -> Result<()> {
            Ok(())
        }
    }

    /// Parameters of 2, 3 and 4 values whose gradients are 1, 2, 3, …
    fn params(be: &dyn Backend) -> Vec<Param> {
        let mut next = 1.0;
        [2usize, 3, 4]
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let mut p = Param::new(be, &format!("p{k}"), &[n], &vec![0.0; n], &Fp32).unwrap();
                let g: Vec<f32> = (0..n).map(|j| next + j as f32).collect();
                next += n as f32;
                let g = be
                    .upload(&g, &[n], DType::F32, MemoryCategory::Gradients, "g")
                    .unwrap();
                be.cast(p.grad_mut(be).unwrap(), &g).unwrap();
                p
            })
            .collect()
    }

    fn grad(be: &dyn Backend, p: &Param) -> Option<Vec<f32>> {
        p.grad().map(|g| be.to_f32(g).unwrap())
    }

    /// ZeRO-2 on the host: one bucket of three gradients owned by ranks 1, 0 and 1 is
    /// laid out by owner and each run reduced to its owner alone; rank 0 keeps the sum of
    /// its own gradient and frees the others.
    #[test]
    fn zero_2_reduces_each_owners_run_to_it() {
        let be = CpuBackend::new();
        let mut ps = params(&be);
        let c = Arc::new(Recording::default());
        let owners = [1, 0, 1];
        let b = Buckets::start(c.clone(), 1 << 20, 3, Some(&owners), (true, false));
        let done = b.finish(&be, &mut ps).unwrap();
        assert_eq!(done, vec![0, 1, 2], "in the order they were complete");
        assert_eq!(*c.0.lock().unwrap(), vec![(Some(0), 3), (Some(1), 6)]);
        assert_eq!(grad(&be, &ps[1]), Some(vec![6.0, 8.0, 10.0]));
        assert!(ps[0].grad().is_none() && ps[2].grad().is_none());
    }

    /// DDP: the bucket is all-reduced whole; with `early` and buckets of one gradient,
    /// each bucket's members come back as the next bucket is sent, the last at finish.
    #[test]
    fn early_buckets_come_back_one_behind() {
        let be = CpuBackend::new();
        let mut ps = params(&be);
        let c = Arc::new(Recording::default());
        let mut b = Buckets::start(c.clone(), 4, 3, None, (true, true));
        let back: Vec<Vec<usize>> = (0..3).map(|i| b.ready(&be, &mut ps, i).unwrap()).collect();
        assert_eq!(back, vec![vec![], vec![0], vec![1]]);
        assert_eq!(grad(&be, &ps[0]), Some(vec![2.0, 4.0]));
        assert_eq!(b.finish(&be, &mut ps).unwrap(), vec![2]);
        assert_eq!(*c.0.lock().unwrap(), vec![(None, 2), (None, 3), (None, 4)]);
        assert_eq!(grad(&be, &ps[2]), Some(vec![12.0, 14.0, 16.0, 18.0]));
        // The meta backend's rehearsal returns the same members at the same calls.
        let mut ps = params(&be);
        let mut b = Buckets::start(c, 4, 3, None, (false, true));
        let rehearsed: Vec<Vec<usize>> =
            (0..3).map(|i| b.ready(&be, &mut ps, i).unwrap()).collect();
        assert_eq!(rehearsed, back);
        assert_eq!(b.finish(&be, &mut ps).unwrap(), vec![2]);
    }
}
