//! A model as data: sections of op nodes over named activations, with parameters reached
//! by handles.

use crate::checkpoint::Tags;
use crate::ops::Heads;
use crate::ops::{AttentionPath, CausalAttention, FlashAttention, Op};
use std::fmt::Debug;
use std::sync::Arc;

/// An activation of a section: its name, its ledger label and the tags a checkpoint
/// policy matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    /// The name within its layer, e.g. `qkv` (what [`crate::ActivationSite::name`] says).
    pub name: &'static str,
    /// The ledger label, e.g. `h.3.qkv`.
    pub label: String,
    /// What kind of tensor it is.
    pub tags: Tags,
}

impl Value {
    /// A value named `name` in its layer, labelled `label` in the ledger, with `tags`.
    pub fn new(name: &'static str, label: impl Into<String>, tags: Tags) -> Self {
        Value {
            name,
            label: label.into(),
            tags,
        }
    }
}

/// One op of a section: which values it reads and writes, and which parameters it uses
/// (indices into the model's parameter list, in the order the op documents).
#[derive(Debug)]
pub struct Node {
    /// The op.
    pub op: Box<dyn Op>,
    /// Values read, by index into [`Section::values`].
    pub inputs: Vec<usize>,
    /// Values written.
    pub outputs: Vec<usize>,
    /// Parameter handles.
    pub params: Vec<usize>,
}

/// A run of nodes over its own values: the embedding, one transformer layer, or the head.
///
/// Value 0 is the section's input (the previous section's output; nothing for the
/// embedding); [`Section::output`] is handed to the next section.
#[derive(Debug, Default)]
pub struct Section {
    /// Every value, in the order forward creates them (the input first).
    pub values: Vec<Value>,
    /// The nodes, in forward order.
    pub nodes: Vec<Node>,
    /// The value handed to the next section.
    pub output: usize,
}

impl Section {
    /// A section whose input is a value named `name`.
    pub fn new(input: Value) -> Self {
        Section {
            values: vec![input],
            nodes: Vec::new(),
            output: 0,
        }
    }

    /// Adds a value; returns its index.
    pub fn value(&mut self, name: &'static str, label: impl Into<String>, tags: Tags) -> usize {
        self.values.push(Value::new(name, label, tags));
        self.values.len() - 1
    }

    /// Adds a node.
    pub fn node(
        &mut self,
        op: impl Op + 'static,
        inputs: &[usize],
        outputs: &[usize],
        params: &[usize],
    ) {
        self.nodes.push(Node {
            op: Box::new(op),
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            params: params.to_vec(),
        });
    }

    /// The node producing value `v` (none for the input).
    pub(crate) fn producer(&self, v: usize) -> Option<usize> {
        self.nodes.iter().position(|n| n.outputs.contains(&v))
    }

    /// After which node forward is done with value `v`: its last reader, or its producer
    /// when nothing reads it.
    pub(crate) fn settle_after(&self, v: usize) -> Option<usize> {
        let last_reader = self.nodes.iter().rposition(|n| n.inputs.contains(&v));
        last_reader.or_else(|| self.producer(v))
    }

    /// Whether some node's backward reads value `v`.
    pub(crate) fn saved(&self, v: usize) -> bool {
        self.first_saver(v).is_some()
    }

    /// The first node (in forward order) whose backward reads `v`: backward's last reader.
    pub(crate) fn first_saver(&self, v: usize) -> Option<usize> {
        self.nodes.iter().position(|n| n.reads_in_backward(v))
    }
}

impl Node {
    /// Whether this node's backward reads value `v` (as a saved input or output).
    fn reads_in_backward(&self, v: usize) -> bool {
        let s = self.op.saves();
        self.inputs
            .iter()
            .enumerate()
            .any(|(i, &x)| x == v && s.input(i))
            || self
                .outputs
                .iter()
                .enumerate()
                .any(|(i, &x)| x == v && s.output(i))
    }
}

/// A whole model's graph: the embedding, the layers and the head (final norm and
/// classifier, whose output the loss reads).
#[derive(Debug, Default)]
pub struct Graph {
    /// Produces layer 0's input from the batch's tokens.
    pub embedding: Section,
    /// The transformer layers.
    pub layers: Vec<Section>,
    /// From the last layer's output to the logits.
    pub head: Section,
}

impl Graph {
    /// Every section, in forward order: the embedding, the layers, the head.
    pub fn sections(&self) -> impl Iterator<Item = &Section> {
        std::iter::once(&self.embedding)
            .chain(self.layers.iter())
            .chain(std::iter::once(&self.head))
    }

    /// Every section, in forward order: the embedding, the layers, the head.
    pub fn sections_mut(&mut self) -> impl Iterator<Item = &mut Section> {
        std::iter::once(&mut self.embedding)
            .chain(self.layers.iter_mut())
            .chain(std::iter::once(&mut self.head))
    }

    /// Replaces, in every section, each node's op for which `o` gives a replacement
    /// (which reads and writes the same values and uses the same parameters). Returns how
    /// many nodes it replaced.
    pub fn apply(&mut self, o: &dyn OpOverride) -> usize {
        let mut replaced = 0;
        for section in self.sections_mut() {
            for node in &mut section.nodes {
                if let Some(op) = o.replace(node.op.as_ref()) {
                    node.op = op;
                    replaced += 1;
                }
            }
        }
        replaced
    }
}

/// A public hook on a model family's graph: replaces some of its op nodes with ops of
/// your own (a fused kernel, a variant of a norm) without retyping the model. Given each
/// node's op, [`OpOverride::replace`] returns the op to run instead, or `None` to keep it;
/// the replacement must read and write the same values and use the same parameters, in
/// the same order. Find an op's settings with [`downcast`](crate::ops::downcast):
///
/// ```
/// use trainkit::model::OpOverride;
/// use trainkit::ops::{downcast, Op, RmsNorm};
///
/// /// Every RMS norm of the model with a larger epsilon.
/// #[derive(Debug)]
/// struct WiderEps;
///
/// impl OpOverride for WiderEps {
///     fn replace(&self, op: &dyn Op) -> Option<Box<dyn Op>> {
///         let norm = downcast::<RmsNorm>(op)?;
///         Some(Box::new(RmsNorm { eps: norm.eps * 10.0 }))
///     }
/// }
/// ```
///
/// Models keep their overrides ([`crate::Llama::with_override`],
/// [`crate::Gpt2::with_override`]) and apply them whenever they rebuild their graph
/// (a clone, another attention or loss path).
pub trait OpOverride: Debug + Send + Sync {
    /// The op to run instead of `op`, or `None` to keep `op`.
    fn replace(&self, op: &dyn Op) -> Option<Box<dyn Op>>;
}

/// `graph` with every override of `overrides` applied, in order.
pub(crate) fn overridden(mut graph: Graph, overrides: &[Arc<dyn OpOverride>]) -> Graph {
    for o in overrides {
        graph.apply(o.as_ref());
    }
    graph
}

/// Adds to `s` the value of a layer's attention statistics for `path`, labelled in
/// `scope` (e.g. `h.3`): the fused attention's log-sum-exp `attn_lse` (`[B, H, T]` f32,
/// tagged softmax statistics) or the materialized probabilities `attn_probs`
/// (`[B, H, T, T]`, tagged quadratic); both tagged attention.
pub(crate) fn attention_stats(s: &mut Section, path: AttentionPath, scope: &str) -> usize {
    match path {
        AttentionPath::Fused => s.value(
            "attn_lse",
            format!("{scope}.attn_lse"),
            Tags::ATTENTION | Tags::SOFTMAX_STATS,
        ),
        AttentionPath::Materialized => s.value(
            "attn_probs",
            format!("{scope}.attn_probs"),
            Tags::ATTENTION | Tags::QUADRATIC,
        ),
    }
}

/// Adds to `s` the causal attention node of `path` over `qkv`, writing `stats` (from
/// [`attention_stats`]) and the output `out`.
pub(crate) fn attention_node(
    s: &mut Section,
    path: AttentionPath,
    heads: Heads,
    qkv: usize,
    stats: usize,
    out: usize,
) {
    match path {
        AttentionPath::Fused => s.node(FlashAttention { heads }, &[qkv], &[stats, out], &[]),
        AttentionPath::Materialized => {
            s.node(CausalAttention { heads }, &[qkv], &[stats, out], &[])
        }
    }
}
