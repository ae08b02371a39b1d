//! The one executor: runs any model's [`Graph`] forward, offers every activation
//! backward needs to the [`CheckpointPolicy`], runs backward in reverse, and recomputes
//! what the policy dropped from the node that produced it (the smallest segment).
//!
//! Forward runs each layer's nodes in order. Once forward is done with a value (after its
//! last reader), the value is freed if no backward reads it, else offered to the policy:
//! kept, or freed to be recomputed. The loss reads the head's output (the logits), writes
//! their gradient over them, and backward walks the head, the layers and the embedding in
//! reverse. Before a node's backward, every value it reads is made present: a dropped one
//! by rerunning its producer for that output alone (and, recursively, what that needs); a
//! dropped layer input by rerunning the layers from the nearest kept input before it (or
//! the embedding). A node's gradient for an input is written when it is the input's first
//! reader in backward order and accumulated by later ones.
//!
//! Before the first layer runs, the policy may plan the whole pass
//! ([`CheckpointPolicy::plan`]): the layers are run once on a [`MetaBackend`] (shapes and
//! FLOPs, no data) to list every activation backward reads with its bytes and the FLOPs
//! of recomputing it. An activation the policy offloads ([`Retention::Offload`]; with
//! [`Pass::offload`], every one it keeps) is moved to host memory when forward is done
//! with it and fetched back when backward reaches its layer; the layer before it is
//! fetched at the same time, so a backend that copies on its own stream overlaps that
//! copy with this layer's backward.
//!
//! A head may instead end in a node that computes the loss itself
//! ([`crate::ops::FusedLoss`], the classifier fused with the cross-entropy): the executor
//! then hands it the targets where it would run the cross-entropy, and backward starts
//! from the gradient of that node's input, which the loss wrote; no logits reach the
//! executor.

use super::graph::{Graph, Node, Section};
use super::staging::Staging;
use super::{Batch, KvCache, Param, Pass, PassStats};
use crate::checkpoint::{ActivationSite, CheckpointPolicy, Retention, SiteCost};
use crate::device::{Backend, MetaBackend};
use crate::error::{Error, Result};
use crate::memory::{MemoryCategory, Phase};
use crate::ops::{cross_entropy, missing, BackwardCx, ForwardCx, GradIn, ParamGrad, Saved};
use crate::tensor::{DType, Tensor};
use std::cell::RefCell;

/// Bytes the checkpoint policy kept, offloaded and dropped during forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StashStats {
    /// Activation bytes kept on the device for backward.
    pub kept_bytes: u64,
    /// Activation bytes freed after forward, to be recomputed in backward.
    pub dropped_bytes: u64,
    /// Activation bytes recomputed in backward.
    pub recomputed_bytes: u64,
    /// Activation bytes moved to host memory after forward, and fetched back in backward.
    pub offloaded_bytes: u64,
}

/// Forward, loss and backward of `graph` on `batch`: gradients accumulate into the
/// parameters, the loss gradient scaled by `grad_scale`; each position's loss is added to
/// `losses`.
pub fn forward_backward(
    graph: &Graph,
    pass: &mut Pass<'_>,
    batch: &Batch,
    vocab: usize,
    grad_scale: f32,
    losses: &mut Tensor,
) -> Result<PassStats> {
    let mut staging = Staging::training(graph, pass.params, pass.stream_ahead);
    let result = train_pass(graph, pass, batch, vocab, grad_scale, losses, &mut staging);
    staging.finish(pass.params);
    let mut stats = result?;
    stats.streamed_bytes = staging.bytes();
    Ok(stats)
}

/// [`forward_backward`] with its streamed weights staged by `staging`
/// ([`Staging::training`]'s schedule: the embedding at position 0, layer `l` forward at
/// `1 + l`, the head at `n + 1`, layer `l` backward at `2n + 1 - l`, the embedding's
/// backward at `2n + 2`).
#[allow(clippy::too_many_arguments)]
fn train_pass(
    graph: &Graph,
    pass: &mut Pass<'_>,
    batch: &Batch,
    vocab: usize,
    grad_scale: f32,
    losses: &mut Tensor,
    staging: &mut Staging,
) -> Result<PassStats> {
    let ledger = pass.backend.ledger().clone();
    let backend = pass.backend;
    let n = graph.layers.len();
    let mut run = Run::with(graph, pass.backend, pass.checkpoint, pass.dtype, batch);
    run.offload = pass.offload;
    run.rng_key = pass.rng_key;
    run.plan(pass.params)?;
    let mut layers: Vec<State> = graph.layers.iter().map(State::new).collect();

    ledger.phase_begin(Phase::Embedding);
    staging.enter(pass.params, backend, 0)?;
    let (mut x, mut embedding) = run.embed_with_shapes(pass.params)?;
    staging.leave(pass.params, 0);
    ledger.phase_end(Phase::Embedding);

    for (l, (sec, st)) in graph.layers.iter().zip(&mut layers).enumerate() {
        ledger.phase_begin(Phase::Forward(l));
        staging.enter(pass.params, backend, 1 + l)?;
        st.put_input(x);
        x = run.layer_forward(pass.params, sec, st, l)?;
        staging.leave(pass.params, 1 + l);
        ledger.phase_end(Phase::Forward(l));
    }

    ledger.phase_begin(Phase::Loss);
    staging.enter(pass.params, backend, n + 1)?;
    let (mut head, dlogits) = run.head_loss(pass.params, x, vocab, Some(grad_scale), losses)?;
    let losses: &Tensor = losses;
    let mut ready = pass.grad_ready.as_deref_mut().map(|hook| Ready {
        remaining: uses(graph, pass.params.len()),
        hook,
        losses,
    });
    let dx = run.backward(pass.params, &graph.head, &mut head, dlogits, &mut ready)?;
    let mut dx = dx.ok_or_else(|| missing("the gradient of the last layer's output"))?;
    staging.leave(pass.params, n + 1);
    ledger.phase_end(Phase::Loss);

    for l in (0..n).rev() {
        let at = 2 * n + 1 - l;
        ledger.phase_begin(Phase::Backward(l));
        staging.enter(pass.params, backend, at)?;
        run.fetch_layer(&mut layers[l])?;
        if l > 0 {
            run.fetch_layer(&mut layers[l - 1])?;
        }
        run.restore_input(pass.params, &mut layers, l, staging, at)?;
        let mut st = std::mem::take(&mut layers[l]);
        dx = run
            .backward(pass.params, &graph.layers[l], &mut st, Some(dx), &mut ready)?
            .ok_or_else(|| missing(&format!("the gradient of layer {l}'s input")))?;
        staging.leave(pass.params, at);
        ledger.phase_end(Phase::Backward(l));
    }

    ledger.phase_begin(Phase::EmbeddingBackward);
    staging.enter(pass.params, backend, 2 * n + 2)?;
    run.backward(
        pass.params,
        &graph.embedding,
        &mut embedding,
        Some(dx),
        &mut ready,
    )?;
    staging.leave(pass.params, 2 * n + 2);
    ledger.phase_end(Phase::EmbeddingBackward);
    Ok(PassStats {
        stash: run.stats,
        streamed_bytes: 0,
    })
}

/// The optimizer step inside backward: how many nodes still to run backward read each
/// parameter, the hook to call when that reaches zero, and the step's losses.
struct Ready<'h, 'l> {
    remaining: Vec<usize>,
    hook: &'h mut super::GradReady<'h>,
    losses: &'l Tensor,
}

/// How many nodes of `graph` read each of `n` parameters (each node's backward once).
fn uses(graph: &Graph, n: usize) -> Vec<usize> {
    let mut count = vec![0; n];
    for node in graph.sections().flat_map(|s| &s.nodes) {
        for &p in &node.params {
            if let Some(c) = count.get_mut(p) {
                *c += 1;
            }
        }
    }
    count
}

/// Forward and loss only: the sum of the per-position losses.
pub fn loss(graph: &Graph, pass: &mut Pass<'_>, batch: &Batch, vocab: usize) -> Result<f64> {
    let mut staging = Staging::forward(graph, pass.params, pass.stream_ahead);
    let result = forward_loss(graph, pass, batch, vocab, &mut staging);
    staging.finish(pass.params);
    result
}

/// [`loss`] with its streamed weights staged by `staging` ([`Staging::forward`]).
fn forward_loss(
    graph: &Graph,
    pass: &mut Pass<'_>,
    batch: &Batch,
    vocab: usize,
    staging: &mut Staging,
) -> Result<f64> {
    let mut run = Run::with(graph, pass.backend, pass.checkpoint, pass.dtype, batch);
    run.rng_key = pass.rng_key;
    let x = run.forward_layers(pass.params, staging)?;
    let mut losses = pass.backend.zeros(
        &[batch.tokens()],
        DType::F32,
        MemoryCategory::Workspace,
        "eval.losses",
    )?;
    let head = graph.layers.len() + 1;
    staging.enter(pass.params, pass.backend, head)?;
    run.head_loss(pass.params, x, vocab, None, &mut losses)?;
    staging.leave(pass.params, head);
    let losses = pass.backend.to_f32(&losses)?;
    Ok(losses.iter().map(|&l| l as f64).sum())
}

/// Forward only: the head's output (the logits, `[rows, vocab]`) as f32.
pub fn logits(graph: &Graph, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
    let run = Run::with(graph, pass.backend, pass.checkpoint, pass.dtype, batch);
    head_logits(&run, graph, pass, Rows::All)
}

/// Forward only, the head on the last position of each of `batch`'s rows: the logits
/// `[batch_size, vocab]` (f32) that sampling the next token reads, as [`logits`] gives
/// them for those rows, without the head's product and its `[rows, vocab]` output for
/// every other position (Hugging Face's `logits_to_keep = 1`).
pub fn last_logits(graph: &Graph, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
    let run = Run::with(graph, pass.backend, pass.checkpoint, pass.dtype, batch);
    head_logits(&run, graph, pass, Rows::Last)
}

/// Forward only over `tokens`, continuing the sequence `cache` holds (incremental
/// decoding): the new tokens run every op on their own rows at their positions in the
/// sequence, and each attention node ([`crate::ops::Op::attention_heads`]) appends their
/// keys and values to its cache and attends over every position so far. The logits
/// `[tokens.len(), vocab]` (row-major f32) of the new tokens, as [`logits`] gives them
/// for those rows of the whole sequence.
pub fn logits_cached(
    graph: &Graph,
    pass: &mut Pass<'_>,
    tokens: &[u32],
    cache: &mut KvCache,
) -> Result<Vec<f32>> {
    cached(graph, pass, tokens, cache, Rows::All)
}

/// [`logits_cached`] with the head on the last new token alone: its logits `[vocab]`.
pub fn last_logits_cached(
    graph: &Graph,
    pass: &mut Pass<'_>,
    tokens: &[u32],
    cache: &mut KvCache,
) -> Result<Vec<f32>> {
    cached(graph, pass, tokens, cache, Rows::Last)
}

/// Which positions a forward-only pass runs the head on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rows {
    /// Every position.
    All,
    /// The last of each batch row.
    Last,
}

fn cached(
    graph: &Graph,
    pass: &mut Pass<'_>,
    tokens: &[u32],
    cache: &mut KvCache,
    rows: Rows,
) -> Result<Vec<f32>> {
    let n = tokens.len();
    cache.check_room(n)?;
    let start = cache.len();
    let batch = Batch {
        positions: Some((start..start + n).map(|p| p as u32).collect()),
        ..Batch::row(tokens)
    };
    let logits = {
        let mut run = Run::with(graph, pass.backend, pass.checkpoint, pass.dtype, &batch);
        run.cache = Some(RefCell::new(&mut *cache));
        head_logits(&run, graph, pass, rows)?
    };
    cache.advance(n);
    Ok(logits)
}

/// The head's output of `run`'s batch at `rows`: every layer forward, then the head (the
/// classifier of a fused loss without the loss).
fn head_logits(run: &Run<'_>, graph: &Graph, pass: &mut Pass<'_>, rows: Rows) -> Result<Vec<f32>> {
    let mut staging = Staging::forward(graph, pass.params, pass.stream_ahead);
    let result = staged_head_logits(run, graph, pass, &mut staging, rows);
    staging.finish(pass.params);
    result
}

/// The last position of each of the `[b, t]` batch's rows of `x` (`[b·t, width]` or
/// `[b, t, width]`): `[b, width]` or `[b, 1, width]`.
fn last_positions(be: &dyn Backend, x: &Tensor, [b, t]: [usize; 2]) -> Result<Tensor> {
    let mut shape = x.shape().to_vec();
    match shape.len() {
        2 => shape[0] = b,
        3 => shape[1] = 1,
        _ => return Err(missing("a hidden state of two or three dimensions")),
    }
    let mut out = be.empty(&shape, x.dtype(), MemoryCategory::Activations, "head.last")?;
    for row in 0..b {
        be.copy_rows(&mut out, row, x, row * t + t - 1, 1, false)?;
    }
    Ok(out)
}

/// [`head_logits`] with its streamed weights staged by `staging` ([`Staging::forward`]).
fn staged_head_logits(
    run: &Run<'_>,
    graph: &Graph,
    pass: &mut Pass<'_>,
    staging: &mut Staging,
    rows: Rows,
) -> Result<Vec<f32>> {
    let x = run.forward_layers(pass.params, staging)?;
    // The last positions: the head runs on one row of each batch row.
    let last = match rows {
        Rows::All => None,
        Rows::Last => {
            let [b, t] = run.batch;
            let pick = |v: &[u32]| (0..b).map(|r| v[r * t + t - 1]).collect::<Vec<u32>>();
            Some(Batch {
                batch_size: b,
                seq_len: 1,
                inputs: pick(run.tokens),
                targets: pick(run.targets),
                positions: run.positions.map(pick),
            })
        }
    };
    match &last {
        None => run_head(run, graph, pass, staging, x),
        Some(batch) => {
            let x = last_positions(pass.backend, &x, run.batch)?;
            let tail = Run::with(graph, pass.backend, run.policy, run.dtype, batch);
            run_head(&tail, graph, pass, staging, x)
        }
    }
}

/// The head of `run`'s graph on `x`, the last layer's output: its logits as f32.
fn run_head(
    run: &Run<'_>,
    graph: &Graph,
    pass: &mut Pass<'_>,
    staging: &mut Staging,
    x: Tensor,
) -> Result<Vec<f32>> {
    staging.enter(pass.params, pass.backend, graph.layers.len() + 1)?;
    let mut st = State::new(&graph.head);
    st.put_input(x);
    run.forward_all(pass.params, &graph.head, &mut st)?;
    let out = st.stash[graph.head.output]
        .as_ref()
        .ok_or_else(|| missing("the logits"))?;
    if let Some(node) = fused_loss(&graph.head) {
        let op = node.op.as_loss().ok_or_else(|| missing("a fused loss"))?;
        let inputs = node
            .inputs
            .iter()
            .map(|&v| {
                st.stash[v]
                    .as_ref()
                    .ok_or_else(|| missing("the loss's input"))
            })
            .collect::<Result<Vec<_>>>()?;
        let weights: Vec<&Tensor> = node
            .params
            .iter()
            .map(|&p| pass.params[p].weight())
            .collect();
        let logits = op.logits(pass.backend, &inputs, &weights)?;
        return pass.backend.to_f32(&logits);
    }
    pass.backend.to_f32(out)
}

/// The values of one section during a pass, with their shapes once known.
#[derive(Debug, Default)]
struct State {
    stash: Vec<Option<Tensor>>,
    /// Values offloaded to host memory, waiting for backward.
    host: Vec<Option<Tensor>>,
    shapes: Vec<Option<(Vec<usize>, DType)>>,
}

impl State {
    fn new(sec: &Section) -> Self {
        State {
            stash: (0..sec.values.len()).map(|_| None).collect(),
            host: (0..sec.values.len()).map(|_| None).collect(),
            shapes: vec![None; sec.values.len()],
        }
    }

    /// Whether value `v` is on the device or waiting in host memory.
    fn holds(&self, v: usize) -> bool {
        self.stash[v].is_some() || self.host[v].is_some()
    }

    fn put_input(&mut self, x: Tensor) {
        self.shapes[0] = Some((x.shape().to_vec(), x.dtype()));
        self.stash[0] = Some(x);
    }

    /// The inputs `node` needs to compute its `wanted` outputs, given those present
    /// ([`crate::ops::Op::inputs_needed`]).
    fn inputs_needed(&self, node: &Node, wanted: &[bool]) -> u32 {
        let present: Vec<bool> = node
            .outputs
            .iter()
            .map(|&v| self.stash[v].is_some())
            .collect();
        node.op.inputs_needed(wanted, &present)
    }
}

/// One pass's settings and counters.
struct Run<'r> {
    graph: &'r Graph,
    backend: &'r dyn Backend,
    policy: &'r dyn CheckpointPolicy,
    dtype: DType,
    tokens: &'r [u32],
    positions: Option<&'r [u32]>,
    targets: &'r [u32],
    batch: [usize; 2],
    stats: StashStats,
    /// Offload what the policy keeps ([`Pass::offload`]).
    offload: bool,
    /// The policy's plan, by layer and value, where it made one.
    plan: Vec<Vec<Option<Retention>>>,
    /// The pass's random key ([`Pass::rng_key`]).
    rng_key: Option<u64>,
    /// Incremental decoding's key/value cache ([`logits_cached`]), which attention nodes
    /// read and append to instead of running their forward.
    cache: Option<RefCell<&'r mut KvCache>>,
}

impl<'r> Run<'r> {
    fn with(
        graph: &'r Graph,
        backend: &'r dyn Backend,
        policy: &'r dyn CheckpointPolicy,
        dtype: DType,
        batch: &'r Batch,
    ) -> Self {
        Run {
            graph,
            backend,
            policy,
            dtype,
            tokens: &batch.inputs,
            positions: batch.positions.as_deref(),
            targets: &batch.targets,
            batch: [batch.batch_size, batch.seq_len],
            stats: StashStats::default(),
            offload: false,
            plan: Vec::new(),
            rng_key: None,
            cache: None,
        }
    }

    /// The random key of `node` of `sec` ([`ForwardCx::rng_key`]): the pass's key mixed
    /// with the FNV-1a hash of the node's first output's name, so a recomputation and the
    /// backward of the node draw what its forward drew.
    fn node_key(&self, sec: &Section, node: &Node) -> Option<u64> {
        let key = self.rng_key?;
        let label = node
            .outputs
            .first()
            .map_or("", |&v| sec.values[v].label.as_str());
        Some(crate::rng::mix64(key ^ crate::rng::name_hash(label)))
    }

    /// Asks the policy for a plan of the whole pass ([`CheckpointPolicy::plan`]): runs the
    /// embedding and the layers on a [`MetaBackend`] to list the activations backward
    /// reads, in the order forward settles them, with their bytes and recompute FLOPs.
    fn plan(&mut self, params: &[Param]) -> Result<()> {
        let meta = MetaBackend::new();
        let probe = Run {
            graph: self.graph,
            backend: &meta,
            policy: self.policy,
            dtype: self.dtype,
            tokens: self.tokens,
            positions: self.positions,
            targets: self.targets,
            batch: self.batch,
            stats: StashStats::default(),
            offload: false,
            plan: Vec::new(),
            rng_key: self.rng_key,
            cache: None,
        };
        let flops = || meta.ledger().flops();
        let before = flops();
        let mut x = probe.embed(params)?;
        let mut input_flops = flops() - before;
        let n_layer = self.graph.layers.len();
        let mut sites = Vec::new();
        let mut at = Vec::with_capacity(n_layer);
        for (l, sec) in self.graph.layers.iter().enumerate() {
            let mut st = State::new(sec);
            st.put_input(x);
            let mut node_flops = vec![0u64; sec.nodes.len()];
            let mut index = vec![None; sec.values.len()];
            for n in 0..sec.nodes.len() {
                let before = flops();
                let wanted = vec![true; sec.nodes[n].outputs.len()];
                probe.run_node(params, sec, &mut st, n, wanted)?;
                node_flops[n] = flops() - before;
                for (v, slot) in index.iter_mut().enumerate() {
                    if v == sec.output || sec.settle_after(v) != Some(n) {
                        continue;
                    }
                    let Some(t) = st.stash[v].take() else {
                        continue;
                    };
                    if !sec.saved(v) {
                        continue;
                    }
                    let recompute_flops = match sec.producer(v) {
                        Some(p) => node_flops[p],
                        None => input_flops,
                    };
                    *slot = Some(sites.len());
                    sites.push(SiteCost {
                        site: ActivationSite {
                            layer: l,
                            n_layer,
                            name: sec.values[v].name,
                            tags: sec.values[v].tags,
                            bytes: t.bytes(),
                        },
                        recompute_flops,
                    });
                }
            }
            input_flops = node_flops.iter().sum();
            x = st.stash[sec.output]
                .take()
                .ok_or_else(|| missing("a layer's output"))?;
            at.push(index);
        }
        let Some(plan) = self.policy.plan(&sites) else {
            return Ok(());
        };
        if plan.len() != sites.len() {
            return Err(Error::config(
                "checkpoint",
                format!(
                    "the `{}` policy planned {} activations, but the pass has {}; return one \
                     Retention per site, in the order given",
                    self.policy.typetag_name(),
                    plan.len(),
                    sites.len()
                ),
            ));
        }
        self.plan = at
            .into_iter()
            .map(|index| index.into_iter().map(|i| i.map(|i| plan[i])).collect())
            .collect();
        Ok(())
    }

    /// Brings every value of a layer that waits in host memory back to the device.
    fn fetch_layer(&self, st: &mut State) -> Result<()> {
        for v in 0..st.host.len() {
            self.fetch(st, v)?;
        }
        Ok(())
    }

    /// Brings value `v` back from host memory, if it waits there.
    fn fetch(&self, st: &mut State, v: usize) -> Result<()> {
        if let Some(t) = st.host[v].take() {
            st.stash[v] = Some(self.backend.fetch(t, MemoryCategory::Activations)?);
        }
        Ok(())
    }

    /// Runs node `n` for the `wanted` outputs; stores what it computed in empty slots and
    /// frees the rest. Returns the bytes newly stored.
    fn run_node(
        &self,
        params: &[Param],
        sec: &Section,
        st: &mut State,
        n: usize,
        wanted: Vec<bool>,
    ) -> Result<u64> {
        let node = &sec.nodes[n];
        let needed = st.inputs_needed(node, &wanted);
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for (i, &v) in node.inputs.iter().enumerate() {
            if needed >> i & 1 == 1 {
                let t = st.stash[v]
                    .as_ref()
                    .ok_or_else(|| missing(&sec.values[v].label))?;
                inputs.push(Some(t));
            } else {
                inputs.push(None);
            }
        }
        let weights: Vec<&Tensor> = node.params.iter().map(|&p| params[p].weight()).collect();
        let known: Option<Vec<_>> = node.outputs.iter().map(|&v| st.shapes[v].clone()).collect();
        let shapes = match known {
            Some(shapes) => shapes,
            None => {
                let all: Option<Vec<&Tensor>> = inputs.iter().copied().collect();
                let all = all.ok_or_else(|| missing("an input to infer shapes from"))?;
                node.op
                    .output_shapes(&all, &weights, self.dtype, self.batch)?
            }
        };
        let mut cx = ForwardCx {
            backend: self.backend,
            inputs,
            weights,
            tokens: self.tokens,
            positions: self.positions,
            rng_key: self.node_key(sec, node),
            present: node.outputs.iter().map(|&v| st.stash[v].as_ref()).collect(),
            wanted,
            outputs: (0..node.outputs.len()).map(|_| None).collect(),
            labels: node
                .outputs
                .iter()
                .map(|&v| sec.values[v].label.clone())
                .collect(),
            shapes,
        };
        match (&self.cache, node.op.attention_heads()) {
            (Some(cache), Some(heads)) => {
                let last = node.outputs.len() - 1;
                let mut out = cx.alloc(last)?;
                let qkv = cx.input(0)?;
                let name = &cx.labels[last];
                cache
                    .borrow_mut()
                    .attend(self.backend, name, &mut out, qkv, heads)?;
                cx.outputs[last] = Some(out);
            }
            _ => node.op.forward(&mut cx)?,
        }
        let outputs = std::mem::take(&mut cx.outputs);
        let shapes = std::mem::take(&mut cx.shapes);
        drop(cx);
        let mut stored = 0;
        for ((t, &v), shape) in outputs.into_iter().zip(&node.outputs).zip(shapes) {
            st.shapes[v].get_or_insert(shape);
            if let Some(t) = t {
                if st.stash[v].is_none() {
                    stored += t.bytes();
                    st.stash[v] = Some(t);
                }
            }
        }
        Ok(stored)
    }

    /// Every node of `sec`, keeping everything (forward-only passes and the head).
    fn forward_all(&self, params: &[Param], sec: &Section, st: &mut State) -> Result<()> {
        for n in 0..sec.nodes.len() {
            let wanted = vec![true; sec.nodes[n].outputs.len()];
            self.run_node(params, sec, st, n, wanted)?;
        }
        Ok(())
    }

    /// The embedding section: layer 0's input.
    fn embed(&self, params: &[Param]) -> Result<Tensor> {
        self.embed_with_shapes(params).map(|(x, _)| x)
    }

    /// The embedding section: layer 0's input, and a state holding no values but the
    /// shapes of the section's values (what its backward needs to build gradients, when
    /// the section has more than one node).
    fn embed_with_shapes(&self, params: &[Param]) -> Result<(Tensor, State)> {
        let sec = &self.graph.embedding;
        let mut st = State::new(sec);
        self.forward_all(params, sec, &mut st)?;
        let x = st.stash[sec.output]
            .take()
            .ok_or_else(|| missing("the embedding's output"))?;
        let shapes = std::mem::take(&mut st.shapes);
        drop(st);
        let mut kept = State::new(sec);
        kept.shapes = shapes;
        Ok((x, kept))
    }

    /// Embedding and every layer, forward only, their streamed weights staged by
    /// `staging` ([`Staging::forward`]): the last layer's output.
    fn forward_layers(&self, params: &mut [Param], staging: &mut Staging) -> Result<Tensor> {
        staging.enter(params, self.backend, 0)?;
        let mut x = self.embed(params)?;
        staging.leave(params, 0);
        for (l, sec) in self.graph.layers.iter().enumerate() {
            staging.enter(params, self.backend, Staging::layer(l))?;
            let mut st = State::new(sec);
            st.put_input(x);
            self.forward_all(params, sec, &mut st)?;
            x = st.stash[sec.output]
                .take()
                .ok_or_else(|| missing("a layer's output"))?;
            staging.leave(params, Staging::layer(l));
        }
        Ok(x)
    }

    /// Forward of layer `l` with its input in `st`; each value is settled once forward is
    /// done with it. Returns the layer's output.
    fn layer_forward(
        &mut self,
        params: &[Param],
        sec: &Section,
        st: &mut State,
        l: usize,
    ) -> Result<Tensor> {
        for n in 0..sec.nodes.len() {
            let wanted = vec![true; sec.nodes[n].outputs.len()];
            self.run_node(params, sec, st, n, wanted)?;
            for v in 0..sec.values.len() {
                if v != sec.output && sec.settle_after(v) == Some(n) {
                    self.settle(sec, st, l, v)?;
                }
            }
        }
        st.stash[sec.output]
            .take()
            .ok_or_else(|| missing("a layer's output"))
    }

    /// Forward is done with value `v` of layer `l`: freed if backward never reads it,
    /// else kept, offloaded or dropped as the policy (or its plan) says.
    fn settle(&mut self, sec: &Section, st: &mut State, l: usize, v: usize) -> Result<()> {
        let Some(t) = &st.stash[v] else {
            return Ok(());
        };
        if !sec.saved(v) {
            st.stash[v] = None;
            return Ok(());
        }
        let value = &sec.values[v];
        let site = ActivationSite {
            layer: l,
            n_layer: self.graph.layers.len(),
            name: value.name,
            tags: value.tags,
            bytes: t.bytes(),
        };
        let planned = self.plan.get(l).and_then(|p| p.get(v).copied().flatten());
        let retention = match planned.unwrap_or_else(|| self.policy.retain(&site)) {
            Retention::Keep if self.offload => Retention::Offload,
            r => r,
        };
        match retention {
            Retention::Keep => self.stats.kept_bytes += site.bytes,
            Retention::Recompute => {
                self.stats.dropped_bytes += site.bytes;
                st.stash[v] = None;
            }
            Retention::Offload => {
                if let Some(t) = st.stash[v].take() {
                    self.stats.offloaded_bytes += site.bytes;
                    st.host[v] = Some(self.backend.offload(t)?);
                }
            }
        }
        Ok(())
    }

    /// Makes value `v` present, recomputing it (and what it needs) if dropped.
    fn ensure(&mut self, params: &[Param], sec: &Section, st: &mut State, v: usize) -> Result<()> {
        self.fetch(st, v)?;
        if st.stash[v].is_some() {
            return Ok(());
        }
        let n = sec
            .producer(v)
            .ok_or_else(|| missing(&sec.values[v].label))?;
        let node = &sec.nodes[n];
        let wanted: Vec<bool> = node.outputs.iter().map(|&o| o == v).collect();
        let needed = st.inputs_needed(node, &wanted);
        for (i, &input) in node.inputs.iter().enumerate() {
            if needed >> i & 1 == 1 {
                self.ensure(params, sec, st, input)?;
            }
        }
        self.stats.recomputed_bytes += self.run_node(params, sec, st, n, wanted)?;
        Ok(())
    }

    /// Makes layer `l`'s input present: if the policy dropped it, reruns the layers from
    /// the nearest kept input before it (or the embedding), keeping what they produce for
    /// their own backward.
    fn restore_input(
        &mut self,
        params: &mut [Param],
        layers: &mut [State],
        l: usize,
        staging: &mut Staging,
        at: usize,
    ) -> Result<()> {
        self.fetch(&mut layers[l], 0)?;
        if layers[l].stash[0].is_some() {
            return Ok(());
        }
        let start = match (0..l).rev().find(|&j| layers[j].holds(0)) {
            Some(j) => j,
            None => {
                staging.borrow(params, self.backend, 0)?;
                let x = self.embed(params)?;
                staging.give_back(params, 0, at);
                self.stats.recomputed_bytes += x.bytes();
                layers[0].stash[0] = Some(x);
                0
            }
        };
        for i in start..l {
            let sec = &self.graph.layers[i];
            staging.borrow(params, self.backend, Staging::layer(i))?;
            self.ensure(params, sec, &mut layers[i], sec.output)?;
            staging.give_back(params, Staging::layer(i), at);
            let x = layers[i].stash[sec.output]
                .take()
                .ok_or_else(|| missing("a layer's output"))?;
            layers[i + 1].stash[0] = Some(x);
        }
        Ok(())
    }

    /// Final norm, classifier and loss; consumes the last layer's output and adds the
    /// per-position losses to `losses`. With `grad_scale`, returns the head's values and
    /// the gradient of the logits (written over them), for the head's backward. A head
    /// ending in a fused loss node ([`crate::ops::FusedLoss`]) runs its other nodes, then
    /// the loss, which writes the gradient of its input: that is returned instead, as the
    /// gradient of the head's output (the fused loss's input).
    fn head_loss(
        &mut self,
        params: &mut [Param],
        x: Tensor,
        vocab: usize,
        grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<(State, Option<Tensor>)> {
        let sec = &self.graph.head;
        let mut st = State::new(sec);
        st.put_input(x);
        if let Some(node) = fused_loss(sec) {
            for n in 0..sec.nodes.len() - 1 {
                let wanted = vec![true; sec.nodes[n].outputs.len()];
                self.run_node(params, sec, &mut st, n, wanted)?;
            }
            let dx = self.fused_loss(params, sec, &mut st, node, vocab, grad_scale, losses)?;
            return Ok((st, dx));
        }
        self.forward_all(params, sec, &mut st)?;
        let logits = st.stash[sec.output]
            .as_mut()
            .ok_or_else(|| missing("the logits"))?;
        cross_entropy::forward(
            self.backend,
            logits,
            self.targets,
            vocab,
            grad_scale,
            losses,
        )?;
        if grad_scale.is_none() {
            return Ok((st, None));
        }
        let dlogits = st.stash[sec.output].take();
        Ok((st, dlogits))
    }

    /// Runs the head's fused loss `node`; returns the gradient of its input (with
    /// `grad_scale`). Its inputs that no backward reads are freed.
    #[allow(clippy::too_many_arguments)]
    fn fused_loss(
        &self,
        params: &mut [Param],
        sec: &Section,
        st: &mut State,
        node: &Node,
        vocab: usize,
        grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<Option<Tensor>> {
        let op = node.op.as_loss().ok_or_else(|| missing("a fused loss"))?;
        let mut grads_in = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            let (shape, dtype) = st.shapes[v]
                .clone()
                .ok_or_else(|| missing(&sec.values[v].label))?;
            grads_in.push(GradIn {
                tensor: None,
                shape,
                dtype,
                label: grad_label(&sec.values[v].label),
            });
        }
        let inputs = node
            .inputs
            .iter()
            .map(|&v| {
                st.stash[v]
                    .as_ref()
                    .ok_or_else(|| missing(&sec.values[v].label))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut cx = crate::ops::LossCx {
            backend: self.backend,
            inputs,
            params: params_mut(params, &node.params)?,
            targets: self.targets,
            vocab,
            grad_scale,
            losses,
            grads_in,
        };
        op.loss(&mut cx)?;
        let mut grads_in = cx.grads_in;
        for &v in &node.inputs {
            if !sec.saved(v) {
                st.stash[v] = None;
            }
        }
        if grad_scale.is_none() {
            return Ok(None);
        }
        Ok(grads_in.first_mut().and_then(|g| g.tensor.take()))
    }

    /// Backward of `sec` from the gradient of its output; frees its values as it goes and
    /// returns the gradient of its input.
    fn backward(
        &mut self,
        params: &mut [Param],
        sec: &Section,
        st: &mut State,
        dout: Option<Tensor>,
        ready: &mut Option<Ready<'_, '_>>,
    ) -> Result<Option<Tensor>> {
        let mut grads: Vec<Option<Tensor>> = (0..sec.values.len()).map(|_| None).collect();
        grads[sec.output] = dout;
        for n in (0..sec.nodes.len()).rev() {
            let node = &sec.nodes[n];
            let saves = node.op.saves();
            for (i, &v) in node.inputs.iter().enumerate() {
                if saves.input(i) {
                    self.ensure(params, sec, st, v)?;
                }
            }
            for (i, &v) in node.outputs.iter().enumerate() {
                if saves.output(i) {
                    self.ensure(params, sec, st, v)?;
                }
            }
            // A value whose last reader in backward is this node is handed over.
            let mut take = |v: usize, saved: bool| -> Option<Tensor> {
                if saved && sec.first_saver(v) == Some(n) {
                    st.stash[v].take()
                } else {
                    None
                }
            };
            let owned_in: Vec<Option<Tensor>> = node
                .inputs
                .iter()
                .enumerate()
                .map(|(i, &v)| take(v, saves.input(i)))
                .collect();
            let owned_out: Vec<Option<Tensor>> = node
                .outputs
                .iter()
                .enumerate()
                .map(|(i, &v)| take(v, saves.output(i)))
                .collect();
            let stash = &st.stash;
            let hand = |owned: Option<Tensor>, v: usize, saved: bool| match owned {
                Some(t) => Saved::Owned(t),
                None if saved => stash[v].as_ref().map_or(Saved::None, Saved::Borrowed),
                None => Saved::None,
            };
            let inputs: Vec<Saved<'_>> = owned_in
                .into_iter()
                .zip(&node.inputs)
                .enumerate()
                .map(|(i, (t, &v))| hand(t, v, saves.input(i)))
                .collect();
            let outputs: Vec<Saved<'_>> = owned_out
                .into_iter()
                .zip(&node.outputs)
                .enumerate()
                .map(|(i, (t, &v))| hand(t, v, saves.output(i)))
                .collect();
            let mut grads_in = Vec::with_capacity(node.inputs.len());
            for &v in &node.inputs {
                let (shape, dtype) = st.shapes[v]
                    .clone()
                    .ok_or_else(|| missing(&sec.values[v].label))?;
                grads_in.push(GradIn {
                    tensor: grads[v].take(),
                    shape,
                    dtype,
                    label: grad_label(&sec.values[v].label),
                });
            }
            let mut cx = BackwardCx {
                backend: self.backend,
                inputs,
                outputs,
                params: params_mut(params, &node.params)?,
                tokens: self.tokens,
                positions: self.positions,
                rng_key: self.node_key(sec, node),
                grads_out: node.outputs.iter().map(|&v| grads[v].take()).collect(),
                grad_labels_out: node
                    .outputs
                    .iter()
                    .map(|&v| grad_label(&sec.values[v].label))
                    .collect(),
                grads_in,
            };
            node.op.backward(&mut cx)?;
            let BackwardCx {
                inputs,
                outputs,
                params: views,
                grads_out,
                grads_in,
                ..
            } = cx;
            drop((inputs, outputs, grads_out));
            for (g, &v) in grads_in.into_iter().zip(&node.inputs) {
                grads[v] = g.tensor;
            }
            // A frozen parameter's gradient, where an op could not skip it, goes at once.
            drop(views);
            if let Some(ready) = ready.as_mut() {
                for &p in &node.params {
                    let left = &mut ready.remaining[p];
                    *left = left.saturating_sub(1);
                    if *left == 0 && params[p].trains() {
                        (ready.hook)(params, p, ready.losses)?;
                    }
                }
            }
        }
        for t in st.stash.iter_mut().chain(&mut st.host) {
            *t = None;
        }
        Ok(grads[0].take())
    }
}

/// The head's last node when it computes the loss itself ([`crate::ops::FusedLoss`]).
fn fused_loss(sec: &Section) -> Option<&Node> {
    sec.nodes.last().filter(|n| n.op.as_loss().is_some())
}

/// The label of a value's gradient: `h.3.d_qkv` for `h.3.qkv`.
fn grad_label(label: &str) -> String {
    match label.rsplit_once('.') {
        Some((scope, name)) => format!("{scope}.d_{name}"),
        None => format!("d_{label}"),
    }
}

/// The parameters at `indices` as a node's backward sees them ([`ParamGrad`]), in that
/// order.
fn params_mut<'p>(params: &'p mut [Param], indices: &[usize]) -> Result<Vec<ParamGrad<'p>>> {
    let mut found: Vec<Option<ParamGrad<'p>>> = indices.iter().map(|_| None).collect();
    for (i, p) in params.iter_mut().enumerate() {
        if let Some(k) = indices.iter().position(|&j| j == i) {
            found[k] = Some(p.for_backward());
        }
    }
    found
        .into_iter()
        .zip(indices)
        .map(|(p, i)| p.ok_or_else(|| missing(&format!("parameter {i}"))))
        .collect()
}
