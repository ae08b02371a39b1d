//! GPT-2's layer as a graph of forward nodes over stash entries, and its parameter
//! layout: shared by the model and by the exact memory model that replays it.

use crate::checkpoint::ActivationKind as K;

// Parameter layout: wte, wpe, then 12 per layer, then ln_f.
pub(crate) const WTE: usize = 0;
pub(crate) const WPE: usize = 1;
pub(crate) const LN1_W: usize = 0;
pub(crate) const QKV_W: usize = 2;
pub(crate) const QKV_B: usize = 3;
pub(crate) const PROJ_W: usize = 4;
pub(crate) const PROJ_B: usize = 5;
pub(crate) const LN2_W: usize = 6;
pub(crate) const FC_W: usize = 8;
pub(crate) const FC_B: usize = 9;
pub(crate) const FCPROJ_W: usize = 10;
pub(crate) const FCPROJ_B: usize = 11;
pub(crate) const PER_LAYER: usize = 12;

/// The steps of a layer's forward, each producing stash entries from earlier ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Node {
    Ln1,
    Qkv,
    Probs,
    AttnOut,
    Residual,
    Ln2,
    Fc,
    Gelu,
}

/// The nodes in the order a layer's forward runs them.
pub(crate) const NODES: [Node; 8] = [
    Node::Ln1,
    Node::Qkv,
    Node::Probs,
    Node::AttnOut,
    Node::Residual,
    Node::Ln2,
    Node::Fc,
    Node::Gelu,
];

impl Node {
    /// The node that produces `kind` (`None` for the layer input).
    pub(crate) fn producing(kind: K) -> Option<Node> {
        Some(match kind {
            K::LayerInput => return None,
            K::Ln1Stats | K::Ln1Out => Node::Ln1,
            K::Qkv => Node::Qkv,
            K::AttnProbs => Node::Probs,
            K::AttnOut => Node::AttnOut,
            K::Residual => Node::Residual,
            K::Ln2Stats | K::Ln2Out => Node::Ln2,
            K::FcOut => Node::Fc,
            K::GeluOut => Node::Gelu,
        })
    }

    /// Stash entries the node reads.
    pub(crate) fn inputs(self) -> &'static [K] {
        match self {
            Node::Ln1 => &[K::LayerInput],
            Node::Qkv => &[K::Ln1Out],
            Node::Probs => &[K::Qkv],
            Node::AttnOut => &[K::AttnProbs, K::Qkv],
            Node::Residual => &[K::LayerInput, K::AttnOut],
            Node::Ln2 => &[K::Residual],
            Node::Fc => &[K::Ln2Out],
            Node::Gelu => &[K::FcOut],
        }
    }

    /// Stash entries forward no longer needs once this node has run.
    pub(crate) fn settles(self) -> &'static [K] {
        match self {
            Node::Ln1 => &[K::Ln1Stats],
            Node::Qkv => &[K::Ln1Out],
            Node::Probs => &[],
            Node::AttnOut => &[K::AttnProbs, K::Qkv],
            Node::Residual => &[K::LayerInput, K::AttnOut],
            Node::Ln2 => &[K::Ln2Stats],
            Node::Fc => &[K::Ln2Out],
            Node::Gelu => &[K::FcOut],
        }
    }
}
