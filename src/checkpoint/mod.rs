//! `CheckpointPolicy`: which activations stay in memory for backward, which wait in host
//! memory and which are recomputed, and the shipped policies (none, full, selective and
//! byte-budget recomputation).

mod budget;

pub use budget::Budget;

use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// What kind of tensor an activation is: the tags a [`CheckpointPolicy`] matches, so that
/// one policy applies to every model (GPT-2, Llama, a user's own) unchanged.
///
/// A set of flags: `Tags::ATTENTION | Tags::QUADRATIC` is the attention probabilities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tags(u32);

impl Tags {
    /// No tag.
    pub const NONE: Tags = Tags(0);
    /// A layer's input (the residual stream entering it): the checkpoint of full
    /// recomputation, from which the whole layer can be rerun.
    pub const LAYER_INPUT: Tags = Tags(1);
    /// Grows with the square of the sequence length (materialized attention scores and
    /// probabilities).
    pub const QUADRATIC: Tags = Tags(1 << 1);
    /// Part of the attention block (its input norm, projections, probabilities, output).
    pub const ATTENTION: Tags = Tags(1 << 2);
    /// Part of the MLP block (its input norm, its wide hidden activations).
    pub const MLP: Tags = Tags(1 << 3);
    /// A normalization's statistics (mean and reciprocal standard deviation, f32).
    pub const NORM_STATS: Tags = Tags(1 << 4);
    /// A normalization's output.
    pub const NORM_OUT: Tags = Tags(1 << 5);
    /// The output of a linear projection.
    pub const PROJECTION: Tags = Tags(1 << 6);
    /// The residual stream inside a layer (after its attention block).
    pub const RESIDUAL: Tags = Tags(1 << 7);
    /// The MLP's wide hidden activations (`[B, T, ffn]`: before and after its activation
    /// function).
    pub const WIDE: Tags = Tags(1 << 8);
    /// A softmax's per-row statistics (the fused attention's log-sum-exp, f32, linear in
    /// the sequence length).
    pub const SOFTMAX_STATS: Tags = Tags(1 << 9);
    /// A low-rank adapter's intermediate (`[B, T, r]`, LoRA's `s · x Aᵀ`).
    pub const LOW_RANK: Tags = Tags(1 << 10);

    /// These tags and those of `other` (`|` in a constant).
    pub const fn with(self, other: Tags) -> Tags {
        Tags(self.0 | other.0)
    }

    /// Whether every tag of `other` is set.
    pub fn contains(self, other: Tags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any tag of `other` is set.
    pub fn intersects(self, other: Tags) -> bool {
        self.0 & other.0 != 0
    }

    /// The names of the tags set, e.g. `["attention", "quadratic"]`.
    pub fn names(self) -> Vec<&'static str> {
        const NAMES: [(Tags, &str); 11] = [
            (Tags::LAYER_INPUT, "layer_input"),
            (Tags::QUADRATIC, "quadratic"),
            (Tags::ATTENTION, "attention"),
            (Tags::MLP, "mlp"),
            (Tags::NORM_STATS, "norm_stats"),
            (Tags::NORM_OUT, "norm_out"),
            (Tags::PROJECTION, "projection"),
            (Tags::RESIDUAL, "residual"),
            (Tags::WIDE, "wide"),
            (Tags::SOFTMAX_STATS, "softmax_stats"),
            (Tags::LOW_RANK, "low_rank"),
        ];
        NAMES
            .iter()
            .filter(|(t, _)| self.contains(*t))
            .map(|(_, n)| *n)
            .collect()
    }
}

impl std::ops::BitOr for Tags {
    type Output = Tags;
    fn bitor(self, rhs: Tags) -> Tags {
        self.with(rhs)
    }
}

/// One activation offered to the stash: where it comes from, what it is and how big.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationSite {
    /// Layer index, `0..n_layer`.
    pub layer: usize,
    /// Number of layers in the model.
    pub n_layer: usize,
    /// The activation's name within its layer, e.g. `qkv` or `attn_probs` (the tensor's
    /// label is `h.{layer}.{name}`).
    pub name: &'static str,
    /// What kind of tensor it is; policies match these.
    pub tags: Tags,
    /// Exact bytes of the tensor.
    pub bytes: u64,
}

impl ActivationSite {
    /// Whether the activation carries every tag of `tags`.
    pub fn is(&self, tags: Tags) -> bool {
        self.tags.contains(tags)
    }
}

/// What happens to an activation after forward produced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Retention {
    /// Kept in memory until backward uses it.
    Keep,
    /// Freed at once and recomputed in backward from what was kept.
    Recompute,
    /// Moved to host memory once forward is done with it (counted under
    /// [`crate::MemoryCategory::Offloaded`], not in the device's peak) and brought back
    /// before its backward: the bytes of [`Retention::Keep`] at the cost of two copies.
    Offload,
}

/// An activation with what dropping it would cost: what [`CheckpointPolicy::plan`] sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SiteCost {
    /// The activation.
    pub site: ActivationSite,
    /// Floating-point operations of rerunning what produces it, as the ledger counts them:
    /// the node that produced it, or for a layer's input the whole layer before it (the
    /// embedding's ops for layer 0).
    pub recompute_flops: u64,
}

impl SiteCost {
    /// Recompute FLOPs saved per byte kept: what a byte of memory buys. A site of zero
    /// bytes is worth keeping whatever it costs.
    pub fn flops_per_byte(&self) -> f64 {
        if self.site.bytes == 0 {
            f64::INFINITY
        } else {
            self.recompute_flops as f64 / self.site.bytes as f64
        }
    }
}

/// Decides, for every activation forward produces, whether it is kept, offloaded or
/// recomputed.
///
/// Backward recomputes a dropped activation by running the smallest forward segment that
/// produces it from what was kept; a dropped layer input is recomputed by running the
/// layers from the nearest kept input before it (the embedding if none). An offloaded one
/// is copied back. So any policy is correct, and gradients are bitwise equal to keeping
/// everything on the CPU in f32.
///
/// A policy decides one site at a time ([`CheckpointPolicy::retain`]), or, when it needs
/// the whole picture (a byte budget shared by every layer), all at once
/// ([`CheckpointPolicy::plan`]).
#[typetag::serde(tag = "kind")]
pub trait CheckpointPolicy: DynClone + Debug + Send + Sync {
    /// Keep, offload or recompute the activation at `site`.
    fn retain(&self, site: &ActivationSite) -> Retention;

    /// Decides every activation of a forward pass at once, before the first layer runs:
    /// `sites` lists each activation backward reads, layer by layer in forward order, with
    /// its exact bytes and the FLOPs of recomputing it. Returns one [`Retention`] per site,
    /// in that order, or `None` (the default) to be asked site by site through
    /// [`CheckpointPolicy::retain`]. The executor calls it once per forward pass, so
    /// the plan follows the batch's shape.
    fn plan(&self, sites: &[SiteCost]) -> Option<Vec<Retention>> {
        let _ = sites;
        None
    }
}

dyn_clone::clone_trait_object!(CheckpointPolicy);

impl<'a> CheckpointPolicy for Box<dyn CheckpointPolicy + 'a> {
    fn retain(&self, site: &ActivationSite) -> Retention {
        (**self).retain(site)
    }
    fn plan(&self, sites: &[SiteCost]) -> Option<Vec<Retention>> {
        (**self).plan(sites)
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
        if site.is(Tags::LAYER_INPUT) {
            Retention::Keep
        } else {
            Retention::Recompute
        }
    }
}

/// Selective recomputation: drops what grows with the square of the sequence length (the
/// materialized attention probabilities, recomputed from `qkv` in backward); keeps the
/// rest. With the fused attention no such tensor exists (its log-sum-exp is linear in T
/// and kept), so selective keeps everything, as no recomputation does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selective;

#[typetag::serde(name = "selective")]
impl CheckpointPolicy for Selective {
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.is(Tags::QUADRATIC) {
            Retention::Recompute
        } else {
            Retention::Keep
        }
    }
}

/// The shipped recompute policies without a setting, from the least recomputation (and
/// the most memory) to the most: [`NoRecompute`], [`Selective`], [`Full`]. Autofit tries
/// them in this order.
pub fn by_cost() -> Vec<Box<dyn CheckpointPolicy>> {
    vec![Box::new(NoRecompute), Box::new(Selective), Box::new(Full)]
}

/// The shipped policy `name` names: `none`, `selective` or `full` (its config `kind`), or
/// `budget:SIZE` for a [`Budget`] of `SIZE` bytes (`budget:2GiB`, `budget:0`): the
/// spelling of `--recompute`.
pub fn named(name: &str) -> crate::error::Result<Box<dyn CheckpointPolicy>> {
    if let Some(size) = name.strip_prefix("budget") {
        let size = size.strip_prefix(':').filter(|s| !s.trim().is_empty());
        let Some(size) = size else {
            return Err(crate::error::Error::config(
                "recompute",
                format!("`{name}` needs a size: write budget:SIZE, e.g. budget:2GiB or budget:0"),
            ));
        };
        return Ok(Box::new(Budget::parse(size)?));
    }
    by_cost()
        .into_iter()
        .find(|p| p.typetag_name() == name)
        .ok_or_else(|| {
            crate::error::Error::config(
                "recompute",
                format!(
                    "`{name}` is not a recompute policy; use none, full, selective or \
                     budget:SIZE (e.g. budget:2GiB)"
                ),
            )
        })
}
