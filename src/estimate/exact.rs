//! The exact model of trainkit's own training memory: byte for byte what the ledger will
//! record for a GPT-2 step under a given precision, checkpoint policy and optimizer.
//!
//! Model state is a sum over the parameters. Activations are computed by replaying the
//! order in which [`crate::Gpt2`] allocates and frees its buffers (forward through the
//! stash, the loss, backward with any recomputation the policy asks for) on sizes alone:
//! no tensor is created, so a 1.5B-parameter model at a long context is predicted in
//! microseconds. The policy is asked about every activation exactly as in training, so a
//! user's own `CheckpointPolicy` is predicted as exactly as the shipped ones.

use crate::checkpoint::{ActivationKind as K, ActivationSite, CheckpointPolicy, Retention};
use crate::error::{Error, Result};
use crate::memory::{CategoryBytes, MemoryCategory, Phase};
use crate::model::gpt2_graph::{
    Node, FCPROJ_W, FC_W, LN1_W, LN2_W, NODES, PER_LAYER, PROJ_W, QKV_W, WPE, WTE,
};
use crate::model::Gpt2Config;
use crate::optim::{Optimizer, StepRecord};
use crate::precision::Precision;
use crate::tensor::DType;

/// What the activations of one micro-batch do over its forward and backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationProfile {
    /// The most activation bytes live at once.
    pub peak: u64,
    /// The phase in which that peak is reached (the first, if several tie).
    pub peak_phase: Option<Phase>,
    /// Bytes the policy kept for backward over the forward pass.
    pub kept_bytes: u64,
    /// Bytes the policy freed after forward, to be recomputed.
    pub dropped_bytes: u64,
    /// Bytes recomputed during backward.
    pub recomputed_bytes: u64,
}

/// trainkit's memory for one training setup, as the ledger will measure it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPrediction {
    /// Each category's own peak within any optimizer step: model state once every
    /// gradient and optimizer slot exists, activations at their peak, and the step's
    /// workspace (its per-position losses and its 3-element record, live for the whole
    /// step; the CPU backend allocates no other workspace).
    pub peak: CategoryBytes,
    /// The peak of the total in a step after the first (all model state live).
    pub peak_total: u64,
    /// The peak of the total over the first micro-batch of the first step, while
    /// gradients appear one by one during the first backward (no optimizer state yet).
    pub first_micro_batch_peak_total: u64,
    /// The activation profile of a micro-batch.
    pub activations: ActivationProfile,
}

impl MemoryPrediction {
    /// The peak of the total in the first step of `micro_batches` micro-batches:
    /// gradients appear during the first backward, optimizer state only at the update.
    pub fn first_step_peak_total(&self, micro_batches: usize) -> u64 {
        let p = &self.peak;
        let before_optimizer = p.get(MemoryCategory::Weights)
            + p.get(MemoryCategory::MasterWeights)
            + p.get(MemoryCategory::Gradients)
            + p.get(MemoryCategory::Workspace);
        let mut peak = self
            .first_micro_batch_peak_total
            .max(before_optimizer + p.get(MemoryCategory::OptimizerState));
        if micro_batches > 1 {
            peak = peak.max(before_optimizer + self.activations.peak);
        }
        peak
    }

    /// Weights, master weights, gradients and optimizer state: what a step keeps between
    /// steps.
    pub fn model_state_bytes(&self) -> u64 {
        self.peak.total()
            - self.peak.get(MemoryCategory::Activations)
            - self.peak.get(MemoryCategory::Workspace)
    }
}

/// The shape of a micro-batch: rows and tokens per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MicroBatch {
    /// Rows (sequences).
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

/// Predicts trainkit's memory for a GPT-2 step, exactly as the ledger will record it.
///
/// Fails with a configuration error if the shape is invalid or the sequence is longer
/// than the model's context.
pub fn predict_gpt2(
    config: &Gpt2Config,
    micro: MicroBatch,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
    optimizer: &dyn Optimizer,
) -> Result<MemoryPrediction> {
    config.validate()?;
    if micro.batch_size == 0 || micro.seq_len == 0 {
        return Err(Error::config(
            "batch_size",
            "batch size and sequence length must be at least 1",
        ));
    }
    if micro.seq_len > config.n_positions {
        return Err(Error::config(
            "seq_len",
            format!(
                "{} exceeds the model's context of {}; use at most {}",
                micro.seq_len, config.n_positions, config.n_positions
            ),
        ));
    }
    let numels: Vec<u64> = config
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .collect();
    let n: u64 = numels.iter().sum();
    let compute = precision.compute_dtype();
    let grad_size = precision.grad_dtype().size() as u64;
    let weights = n * compute.size() as u64;
    let master = if precision.master_weights() { 4 * n } else { 0 };
    let gradients = n * grad_size;
    let optimizer_state = n * optimizer.state_bytes_per_param() as u64;
    // The trainer's per-position losses and step record (f32), held for the whole step.
    let workspace = 4 * (micro.batch_size * micro.seq_len + StepRecord::LEN) as u64;

    // First step: gradients appear one by one during the first backward.
    let mut first = Replay::new(config, micro, compute, checkpoint);
    first.grads = Some(GradTrack {
        numels: &numels,
        bytes_per_elem: grad_size,
        allocated: vec![false; numels.len()],
        live: 0,
    });
    first.base = weights + master + workspace;
    first.run();

    // Later steps: every gradient and optimizer slot is live throughout.
    let mut later = Replay::new(config, micro, compute, checkpoint);
    later.base = weights + master + gradients + optimizer_state + workspace;
    later.run();

    let mut peak = CategoryBytes::default();
    *peak.get_mut(MemoryCategory::Weights) = weights;
    *peak.get_mut(MemoryCategory::MasterWeights) = master;
    *peak.get_mut(MemoryCategory::Gradients) = gradients;
    *peak.get_mut(MemoryCategory::OptimizerState) = optimizer_state;
    *peak.get_mut(MemoryCategory::Activations) = later.profile.peak;
    *peak.get_mut(MemoryCategory::Workspace) = workspace;
    Ok(MemoryPrediction {
        peak,
        peak_total: later.peak_total.max(later.base),
        first_micro_batch_peak_total: first.peak_total,
        activations: later.profile,
    })
}

/// Gradient buffers of the first step, allocated on first use as `Param::grad_mut` does.
struct GradTrack<'a> {
    numels: &'a [u64],
    bytes_per_elem: u64,
    allocated: Vec<bool>,
    live: u64,
}

/// Bytes of each stash slot of one layer; `None` where the slot is empty.
type Stash = [Option<u64>; K::ALL.len()];

/// A replay of one micro-batch's allocations on sizes alone.
struct Replay<'a> {
    n_layer: usize,
    checkpoint: &'a dyn CheckpointPolicy,
    /// `[B, T, C]` in the compute dtype.
    btc: u64,
    /// `[B, H, T, T]` in the compute dtype.
    bhtt: u64,
    /// `[B·T, 2]` f32 layer-norm statistics.
    stats: u64,
    /// `[B·T, V]` logits in the compute dtype.
    logits: u64,
    /// Bytes of model state live throughout (everything but first-step gradients).
    base: u64,
    grads: Option<GradTrack<'a>>,
    live: u64,
    peak_total: u64,
    phase: Phase,
    profile: ActivationProfile,
}

impl<'a> Replay<'a> {
    fn new(
        config: &Gpt2Config,
        micro: MicroBatch,
        compute: DType,
        checkpoint: &'a dyn CheckpointPolicy,
    ) -> Self {
        let (b, t) = (micro.batch_size as u64, micro.seq_len as u64);
        let (c, h, v) = (
            config.n_embd as u64,
            config.n_head as u64,
            config.vocab_size as u64,
        );
        let d = compute.size() as u64;
        Replay {
            n_layer: config.n_layer,
            checkpoint,
            btc: b * t * c * d,
            bhtt: b * h * t * t * d,
            stats: b * t * 2 * 4,
            logits: b * t * v * d,
            base: 0,
            grads: None,
            live: 0,
            peak_total: 0,
            phase: Phase::Embedding,
            profile: ActivationProfile::default(),
        }
    }

    fn alloc(&mut self, bytes: u64) -> u64 {
        self.live += bytes;
        if self.live > self.profile.peak {
            self.profile.peak = self.live;
            self.profile.peak_phase = Some(self.phase);
        }
        self.note_total();
        bytes
    }

    fn free(&mut self, bytes: u64) {
        self.live -= bytes;
    }

    fn note_total(&mut self) {
        let grads = self.grads.as_ref().map_or(0, |g| g.live);
        self.peak_total = self.peak_total.max(self.base + grads + self.live);
    }

    /// The gradient of parameter `index` is touched: allocated on first use.
    fn grad(&mut self, index: usize) {
        if let Some(g) = self.grads.as_mut() {
            if !g.allocated[index] {
                g.allocated[index] = true;
                g.live += g.numels[index] * g.bytes_per_elem;
                self.note_total();
            }
        }
    }

    /// A linear layer's weight and bias gradients, in the order backward touches them.
    fn linear_grads(&mut self, layer: usize, w: usize) {
        let i = 2 + PER_LAYER * layer + w;
        self.grad(i);
        self.grad(i + 1);
    }

    /// A layer norm's gradients: bias first, then weight, as `norm_backward` does.
    fn norm_grads(&mut self, w_index: usize) {
        self.grad(w_index + 1);
        self.grad(w_index);
    }

    fn settle(&mut self, stash: &mut Stash, layer: usize, kind: K) {
        let Some(bytes) = stash[kind.index()] else {
            return;
        };
        let site = ActivationSite {
            layer,
            n_layer: self.n_layer,
            kind,
            bytes,
        };
        match self.checkpoint.retain(&site) {
            Retention::Keep => self.profile.kept_bytes += bytes,
            Retention::Recompute => {
                self.profile.dropped_bytes += bytes;
                stash[kind.index()] = None;
                self.free(bytes);
            }
        }
    }

    /// Runs `node`: allocates its outputs, keeps those whose slot is empty, frees the
    /// rest. Returns the bytes newly stored.
    fn run_node(&mut self, stash: &mut Stash, node: Node) -> u64 {
        let (btc, stats) = (self.btc, self.stats);
        let outputs: Vec<(K, u64)> = match node {
            Node::Ln1 => vec![(K::Ln1Out, btc), (K::Ln1Stats, stats)],
            Node::Ln2 => vec![(K::Ln2Out, btc), (K::Ln2Stats, stats)],
            Node::Qkv => vec![(K::Qkv, 3 * btc)],
            Node::Probs => {
                // The scores are a transient of the softmax.
                let scores = self.alloc(self.bhtt);
                let probs = self.alloc(self.bhtt);
                self.free(scores);
                let mut stored = 0;
                if stash[K::AttnProbs.index()].is_none() {
                    stash[K::AttnProbs.index()] = Some(probs);
                    stored = probs;
                } else {
                    self.free(probs);
                }
                return stored;
            }
            Node::AttnOut | Node::Residual => {
                let kind = if node == Node::AttnOut {
                    K::AttnOut
                } else {
                    K::Residual
                };
                vec![(kind, btc)]
            }
            Node::Fc => vec![(K::FcOut, 4 * btc)],
            Node::Gelu => vec![(K::GeluOut, 4 * btc)],
        };
        for &(_, bytes) in &outputs {
            self.alloc(bytes);
        }
        let mut stored = 0;
        for (kind, bytes) in outputs {
            if stash[kind.index()].is_none() {
                stash[kind.index()] = Some(bytes);
                stored += bytes;
            } else {
                self.free(bytes);
            }
        }
        stored
    }

    fn ensure(&mut self, stash: &mut Stash, kind: K) {
        if stash[kind.index()].is_some() {
            return;
        }
        // A dropped layer input is restored by `restore_input` before backward starts.
        let Some(node) = Node::producing(kind) else {
            return;
        };
        for &dep in node.inputs() {
            self.ensure(stash, dep);
        }
        self.profile.recomputed_bytes += self.run_node(stash, node);
    }

    fn take(&mut self, stash: &mut Stash, kind: K) -> u64 {
        stash[kind.index()].take().unwrap_or(0)
    }

    fn forward_layer(&mut self, stash: &mut Stash, layer: usize) -> u64 {
        for node in NODES {
            match node {
                // The model runs the MLP's product and GELU as one op: both outputs exist
                // before the policy settles the product's input.
                Node::Fc => {
                    self.run_node(stash, Node::Fc);
                    self.run_node(stash, Node::Gelu);
                }
                Node::Gelu => {}
                _ => {
                    self.run_node(stash, node);
                }
            }
            for &kind in node.settles() {
                self.settle(stash, layer, kind);
            }
        }
        let out = self.alloc(self.btc);
        self.settle(stash, layer, K::Residual);
        self.settle(stash, layer, K::GeluOut);
        out
    }

    /// Final norm, classifier, loss and their backward. Frees the last layer's output
    /// and returns the gradient of it.
    fn head(&mut self, x: u64) -> u64 {
        let ln_out = self.alloc(self.btc);
        let st = self.alloc(self.stats);
        let logits = self.alloc(self.logits);
        let dln = self.alloc(self.btc);
        self.grad(WTE);
        self.free(logits);
        self.free(ln_out);
        let dx = self.alloc(self.btc);
        let lnf = 2 + PER_LAYER * self.n_layer;
        self.norm_grads(lnf);
        self.free(dln);
        self.free(st);
        self.free(x);
        dx
    }

    fn restore_input(&mut self, stashes: &mut [Stash], l: usize) {
        let input = K::LayerInput.index();
        if stashes[l][input].is_some() {
            return;
        }
        let start = match (0..l).rev().find(|&j| stashes[j][input].is_some()) {
            Some(j) => j,
            None => {
                let x = self.alloc(self.btc);
                self.profile.recomputed_bytes += x;
                stashes[0][input] = Some(x);
                0
            }
        };
        for i in start..l {
            self.ensure(&mut stashes[i], K::Residual);
            self.ensure(&mut stashes[i], K::GeluOut);
            let out = self.alloc(self.btc);
            self.profile.recomputed_bytes += out;
            stashes[i + 1][input] = Some(out);
        }
    }

    fn backward_layer(&mut self, stash: &mut Stash, l: usize) {
        let btc = self.btc;
        // MLP output projection.
        self.ensure(stash, K::GeluOut);
        let dgelu = self.alloc(4 * btc);
        let gelu_out = self.take(stash, K::GeluOut);
        self.linear_grads(l, FCPROJ_W);
        self.free(gelu_out);
        // GELU.
        self.ensure(stash, K::FcOut);
        let dfc = self.alloc(4 * btc);
        let fc_out = self.take(stash, K::FcOut);
        self.free(fc_out);
        self.free(dgelu);
        // MLP input projection.
        self.ensure(stash, K::Ln2Out);
        let dln2 = self.alloc(btc);
        let ln2_out = self.take(stash, K::Ln2Out);
        self.linear_grads(l, FC_W);
        self.free(ln2_out);
        self.free(dfc);
        // Second layer norm.
        self.ensure(stash, K::Residual);
        self.ensure(stash, K::Ln2Stats);
        let residual = self.take(stash, K::Residual);
        let ln2_stats = self.take(stash, K::Ln2Stats);
        self.norm_grads(2 + PER_LAYER * l + LN2_W);
        self.free(residual + ln2_stats + dln2);
        // Attention output projection.
        self.ensure(stash, K::AttnOut);
        let datt = self.alloc(btc);
        let attn_out = self.take(stash, K::AttnOut);
        self.linear_grads(l, PROJ_W);
        self.free(attn_out);
        // Attention: values, softmax, scores.
        self.ensure(stash, K::Qkv);
        self.ensure(stash, K::AttnProbs);
        let dqkv = self.alloc(3 * btc);
        let dprobs = self.alloc(self.bhtt);
        self.free(datt);
        let dscores = self.alloc(self.bhtt);
        self.free(dprobs);
        self.free(dscores);
        let probs = self.take(stash, K::AttnProbs);
        let qkv = self.take(stash, K::Qkv);
        self.free(probs + qkv);
        // QKV projection.
        self.ensure(stash, K::Ln1Out);
        let dln1 = self.alloc(btc);
        let ln1_out = self.take(stash, K::Ln1Out);
        self.linear_grads(l, QKV_W);
        self.free(ln1_out + dqkv);
        // First layer norm.
        self.ensure(stash, K::Ln1Stats);
        let x = self.take(stash, K::LayerInput);
        let ln1_stats = self.take(stash, K::Ln1Stats);
        self.norm_grads(2 + PER_LAYER * l + LN1_W);
        let rest: u64 = stash.iter_mut().filter_map(|s| s.take()).sum();
        self.free(x + ln1_stats + dln1 + rest);
    }

    fn run(&mut self) {
        let n_layer = self.n_layer;
        let mut stashes: Vec<Stash> = vec![[None; K::ALL.len()]; n_layer];
        self.phase = Phase::Embedding;
        let mut x = self.alloc(self.btc);
        for (l, stash) in stashes.iter_mut().enumerate() {
            self.phase = Phase::Forward(l);
            stash[K::LayerInput.index()] = Some(x);
            x = self.forward_layer(stash, l);
        }
        self.phase = Phase::Loss;
        let dx = self.head(x);
        for l in (0..n_layer).rev() {
            self.phase = Phase::Backward(l);
            self.restore_input(&mut stashes, l);
            let mut stash = std::mem::replace(&mut stashes[l], [None; K::ALL.len()]);
            self.backward_layer(&mut stash, l);
        }
        self.phase = Phase::EmbeddingBackward;
        self.grad(WPE);
        self.grad(WTE);
        self.free(dx);
    }
}
