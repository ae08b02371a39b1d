//! Streamed weights during a pass ([`crate::placement`]): which section reads which
//! streamed parameters, and when their copies on the device are made and freed.
//!
//! A pass runs its sections in a known order, its schedule: the embedding, every layer,
//! the head (forward, loss and the head's backward), then the layers in reverse and the
//! embedding again for backward. Entering position `i` of the schedule stages the
//! streamed weights of positions `i ..= i + ahead` (those already on the device stay), so
//! a backend that copies on its own stream moves the next sections' weights while this
//! one computes; leaving position `i` frees those no position up to `i + ahead` reads. A
//! section run out of turn (a layer recomputed to restore a dropped input) stages its
//! weights on demand and frees them after, unless the window holds them.

use super::graph::Graph;
use super::Param;
use crate::device::Backend;
use crate::error::Result;

/// The streamed weights of one pass, position by position.
#[derive(Debug, Default)]
pub(super) struct Staging {
    /// The sections the pass runs, in order: 0 is the embedding, `1 + l` layer `l`, and
    /// `n_layer + 1` the head.
    schedule: Vec<usize>,
    /// The streamed parameters each section reads (empty when nothing streams).
    reads: Vec<Vec<usize>>,
    /// Positions staged ahead of the one running.
    ahead: usize,
    /// Bytes copied to the device so far.
    bytes: u64,
}

impl Staging {
    /// The staging of a pass over `graph` running `schedule` (section indices as
    /// [`Staging::training`] and [`Staging::forward`] make them), `ahead` positions ahead.
    fn new(graph: &Graph, params: &[Param], schedule: Vec<usize>, ahead: usize) -> Self {
        let streams = params.iter().any(Param::streamed);
        let reads = graph
            .sections()
            .map(|sec| {
                let mut read: Vec<usize> = Vec::new();
                if streams {
                    for &p in sec.nodes.iter().flat_map(|n| &n.params) {
                        if params.get(p).is_some_and(Param::streamed) && !read.contains(&p) {
                            read.push(p);
                        }
                    }
                }
                read
            })
            .collect();
        Staging {
            schedule,
            reads,
            ahead,
            bytes: 0,
        }
    }

    /// A training pass: the embedding, the layers, the head, the layers in reverse, the
    /// embedding.
    pub(super) fn training(graph: &Graph, params: &[Param], ahead: usize) -> Self {
        let n = graph.layers.len();
        let schedule = (0..=n + 1).chain((0..=n).rev()).collect();
        Self::new(graph, params, schedule, ahead)
    }

    /// A forward pass: the embedding, the layers, the head.
    pub(super) fn forward(graph: &Graph, params: &[Param], ahead: usize) -> Self {
        let n = graph.layers.len();
        Self::new(graph, params, (0..=n + 1).collect(), ahead)
    }

    /// The section of layer `l`.
    pub(super) fn layer(l: usize) -> usize {
        1 + l
    }

    /// Whether the pass streams anything.
    fn idle(&self) -> bool {
        self.reads.iter().all(Vec::is_empty)
    }

    /// The streamed parameters the sections at positions `from..=to` read.
    fn window(&self, from: usize, to: usize) -> impl Iterator<Item = usize> + '_ {
        let to = to.min(self.schedule.len().saturating_sub(1));
        self.schedule
            .get(from..=to)
            .unwrap_or(&[])
            .iter()
            .flat_map(|&s| self.reads[s].iter().copied())
    }

    /// Enters position `i`: stages the weights of positions `i ..= i + ahead`.
    pub(super) fn enter(
        &mut self,
        params: &mut [Param],
        backend: &dyn Backend,
        i: usize,
    ) -> Result<()> {
        if self.idle() {
            return Ok(());
        }
        let wanted: Vec<usize> = self.window(i, i + self.ahead).collect();
        for p in wanted {
            self.bytes += params[p].stage(backend)?;
        }
        Ok(())
    }

    /// Leaves position `i`: frees the weights its section read that no position up to
    /// `i + ahead` reads.
    pub(super) fn leave(&self, params: &mut [Param], i: usize) {
        if let Some(&s) = self.schedule.get(i) {
            self.release(params, s, i + 1, i + self.ahead);
        }
    }

    /// Frees the weights section `s` read that no position in `from..=to` reads.
    fn release(&self, params: &mut [Param], s: usize, from: usize, to: usize) {
        for &p in &self.reads[s] {
            if !self.window(from, to).any(|q| q == p) {
                params[p].unstage();
            }
        }
    }

    /// Stages section `s`'s weights out of turn (a recomputation).
    pub(super) fn borrow(
        &mut self,
        params: &mut [Param],
        backend: &dyn Backend,
        s: usize,
    ) -> Result<()> {
        for &p in &self.reads[s] {
            self.bytes += params[p].stage(backend)?;
        }
        Ok(())
    }

    /// Frees what [`Staging::borrow`] staged for section `s`, except the weights of the
    /// window of position `i`.
    pub(super) fn give_back(&self, params: &mut [Param], s: usize, i: usize) {
        self.release(params, s, i, i + self.ahead);
    }

    /// Frees every staged weight (the pass is over, or failed).
    pub(super) fn finish(&self, params: &mut [Param]) {
        for &p in self.reads.iter().flatten() {
            params[p].unstage();
        }
    }

    /// Bytes copied to the device so far.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }
}
