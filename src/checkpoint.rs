//! `CheckpointPolicy`: which activations stay in memory for backward and which are
//! recomputed, and the shipped policies (none, full and selective recomputation).

use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// The activations a transformer layer saves for its backward pass.
///
/// These are exactly the tensors backward reads. Attention scores (before the softmax) are
/// not among them: the softmax backward needs only its output, so scores are a transient
/// of the forward pass under every policy and exist again only while probabilities are
/// being recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationKind {
    /// The layer's input (the residual stream), `[B, T, C]`: the checkpoint of full
    /// recomputation. Layer 0's input is the embedding output.
    LayerInput,
    /// Mean and reciprocal standard deviation of the first layer norm, `[B·T, 2]` f32.
    Ln1Stats,
    /// Output of the first layer norm, `[B, T, C]`.
    Ln1Out,
    /// Query, key and value projections, `[B, T, 3C]`.
    Qkv,
    /// Attention probabilities (softmax of the causal scores), `[B, H, T, T]`.
    AttnProbs,
    /// Attention output before its projection, `[B, T, C]`.
    AttnOut,
    /// Residual stream after the attention block, `[B, T, C]`.
    Residual,
    /// Statistics of the second layer norm, `[B·T, 2]` f32.
    Ln2Stats,
    /// Output of the second layer norm, `[B, T, C]`.
    Ln2Out,
    /// Output of the first MLP projection (GELU's input), `[B, T, 4C]`.
    FcOut,
    /// GELU output, `[B, T, 4C]`.
    GeluOut,
}

impl ActivationKind {
    /// Every kind, in the order a layer's forward produces them.
    pub const ALL: [ActivationKind; 11] = [
        ActivationKind::LayerInput,
        ActivationKind::Ln1Stats,
        ActivationKind::Ln1Out,
        ActivationKind::Qkv,
        ActivationKind::AttnProbs,
        ActivationKind::AttnOut,
        ActivationKind::Residual,
        ActivationKind::Ln2Stats,
        ActivationKind::Ln2Out,
        ActivationKind::FcOut,
        ActivationKind::GeluOut,
    ];

    /// Position in [`ActivationKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short snake_case name, used in tensor labels (`h.3.qkv`).
    pub fn name(self) -> &'static str {
        match self {
            ActivationKind::LayerInput => "input",
            ActivationKind::Ln1Stats => "ln1_stats",
            ActivationKind::Ln1Out => "ln1_out",
            ActivationKind::Qkv => "qkv",
            ActivationKind::AttnProbs => "attn_probs",
            ActivationKind::AttnOut => "attn_out",
            ActivationKind::Residual => "residual",
            ActivationKind::Ln2Stats => "ln2_stats",
            ActivationKind::Ln2Out => "ln2_out",
            ActivationKind::FcOut => "fc_out",
            ActivationKind::GeluOut => "gelu_out",
        }
    }

    /// Whether the tensor grows with the square of the sequence length.
    pub fn is_quadratic(self) -> bool {
        self == ActivationKind::AttnProbs
    }
}

/// One activation offered to the stash: where it comes from and how big it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivationSite {
    /// Layer index, `0..n_layer`.
    pub layer: usize,
    /// Number of layers in the model.
    pub n_layer: usize,
    /// Which activation.
    pub kind: ActivationKind,
    /// Exact bytes of the tensor.
    pub bytes: u64,
}

/// What happens to an activation after forward produced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Retention {
    /// Kept in memory until backward uses it.
    Keep,
    /// Freed at once and recomputed in backward from what was kept.
    Recompute,
}

/// Decides, for every activation forward produces, whether it is kept or recomputed.
///
/// Backward recomputes a dropped activation by running the smallest forward segment that
/// produces it from what was kept; a dropped layer input is recomputed by running the
/// layers from the nearest kept input before it (the embedding if none). So any policy is
/// correct, and gradients are bitwise equal to keeping everything on the CPU in f32.
#[typetag::serde(tag = "kind")]
pub trait CheckpointPolicy: DynClone + Debug + Send + Sync {
    /// Keep or recompute the activation at `site`.
    fn retain(&self, site: &ActivationSite) -> Retention;
}

dyn_clone::clone_trait_object!(CheckpointPolicy);

impl<'a> CheckpointPolicy for Box<dyn CheckpointPolicy + 'a> {
    fn retain(&self, site: &ActivationSite) -> Retention {
        (**self).retain(site)
    }
    #[doc(hidden)]
    fn typetag_name(&self) -> &'static str {
        (**self).typetag_name()
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// Keeps every activation: no recomputation, the most memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoRecompute;

#[typetag::serde(name = "none")]
impl CheckpointPolicy for NoRecompute {
    fn retain(&self, _site: &ActivationSite) -> Retention {
        Retention::Keep
    }
}

/// Full recomputation: keeps only each layer's input and reruns the layer's forward in
/// backward (about one extra forward pass of compute).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Full;

#[typetag::serde(name = "full")]
impl CheckpointPolicy for Full {
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.kind == ActivationKind::LayerInput {
            Retention::Keep
        } else {
            Retention::Recompute
        }
    }
}

/// Selective recomputation: drops the attention probabilities (the terms quadratic in the
/// sequence length) and recomputes scores and softmax from `qkv` in backward; keeps the
/// rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selective;

#[typetag::serde(name = "selective")]
impl CheckpointPolicy for Selective {
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.kind.is_quadratic() {
            Retention::Recompute
        } else {
            Retention::Keep
        }
    }
}
