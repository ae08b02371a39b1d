//! The memory techniques autofit chooses among, in its cost order.

use crate::error::{Error, Result};

/// A way to give up time (or, for the last ones, numerical precision) for memory, as
/// autofit names it. The order of the variants is autofit's cost order, cheapest in time
/// first; `docs/memory.md` ("Autofit's cost order") gives the reasons.
///
/// 1. [`Technique::Accumulation`]: the same global batch in more, smaller micro-batches.
///    The same FLOPs; smaller products use the device a little less well.
///    - [`Technique::Zero1`] (a data-parallel job only): each rank keeps the optimizer
///      side of its share of the parameters and sends their new weights to the others;
///      bitwise the same training, one all-gather's bytes a step more.
///    - [`Technique::Zero2`] (a data-parallel job only): each rank keeps only its share of
///      the gradients too; bitwise DDP with one micro-batch a step, the gradients summed
///      every micro-batch when accumulating.
/// 2. [`Technique::Selective`]: recompute the materialized attention probabilities, one
///    `QKᵀ` and softmax per layer. With the fused attention there is nothing to drop.
/// 3. [`Technique::Adamw8bit`]: AdamW's moments in 8 bits. No extra FLOPs; the update
///    quantizes each block, a pass over the state that moves fewer bytes than f32 moments.
///    The moments are approximate.
/// 4. [`Technique::OptimizerInBackward`]: each parameter updated as soon as its gradient
///    is complete. The same work, plus one finite check read back per parameter; needs
///    one micro-batch per step and no global-norm clipping.
/// 5. [`Technique::Budget`]: recompute the activations that are cheapest to recompute per
///    byte, keeping as many bytes as fit: between no recomputation and full.
/// 6. [`Technique::Full`]: keep each layer's input only, and rerun every layer's forward
///    in backward (about a third more FLOPs on a large model).
/// 7. [`Technique::Offload`]: move what full recomputation keeps (each layer's input) to
///    host memory and back: two copies over the host link per layer and micro-batch,
///    which can overlap with compute but need not. Autofit offloads only under the policy
///    that keeps the least it may choose: moving every activation over the link twice
///    costs more time than recomputing them.
/// 8. [`Technique::OptimizerOffload`]: the f32 master weights and the optimizer state in
///    host memory, the update on the CPU ([`crate::TrainerOptions::optimizer_offload`]); the
///    device keeps the compute weights and gradients. The update is bitwise the one on the
///    device, but every step each parameter's gradient crosses to the host and its compute
///    weights come back (2 + 2 bytes per parameter in bf16 over PCIe), and the host's AdamW
///    streams the master weights and state (about 16 bytes read and 12 written per
///    parameter with f32 moments): on a large model at small batches that takes longer than
///    the GPU's forward and backward.
/// 9. [`Technique::StreamWeights`]: the frozen base (of a LoRA or QLoRA run) in page-locked
///    host memory, copied to the device a section ahead of its readers
///    ([`crate::placement::StreamFrozen`]), or, with the optimizer on the host, every weight
///    ([`crate::placement::StreamAll`]): the same arithmetic, but every step copies the
///    weights over the host link twice, which hides behind the compute only when the step
///    computes longer than the copies take.
/// 10. [`Technique::Bf16`]: bf16 compute with f32 master weights when the run is fp32.
///     Faster on a GPU, but it changes the arithmetic of every product and activation the
///     run was configured to do in f32, so autofit takes it last of those that train the
///     same weights.
/// 11. [`Technique::PureBf16`]: bf16 weights and gradients without an f32 master copy
///     ([`crate::PureBf16`]), each update rounded back stochastically: 4 to 6 bytes per
///     parameter less than mixed bf16, and one parameter's f32 copy at a time. Each update
///     is rounded to 8 significant bits, unbiased but noisier than an f32 master copy's, so
///     autofit uses it only when it is named (`--autofit-techniques all,pure-bf16`).
/// 12. [`Technique::Lora`]: train a LoRA adapter (rank 8, α 16, every projection) on the
///     frozen model instead of every weight. It changes what is trained, so autofit uses
///     it only when it is named (`--autofit-techniques all,lora`): [`Techniques::ALL`]
///     leaves it out.
/// 13. [`Technique::Qlora`]: LoRA over a base whose projections are stored in NF4 (the
///     run's own LoRA, or the one above): dequantizing each weight in every product costs
///     time and the base's precision. Named like LoRA (`all,qlora`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Technique {
    /// More micro-batches of fewer rows for the same global batch.
    Accumulation,
    /// ZeRO-1 across the ranks of a data-parallel job
    /// ([`crate::TrainerOptions::zero_stage`] 1).
    Zero1,
    /// ZeRO-2 across the ranks of a data-parallel job
    /// ([`crate::TrainerOptions::zero_stage`] 2).
    Zero2,
    /// Selective recomputation ([`crate::Selective`]).
    Selective,
    /// AdamW with 8-bit moments ([`crate::AdamW8bit`]), its settings carried over.
    Adamw8bit,
    /// The optimizer step inside backward
    /// ([`crate::TrainerOptions::optimizer_in_backward`]).
    OptimizerInBackward,
    /// A byte budget of kept activations ([`crate::checkpoint::Budget`]), the largest that
    /// fits.
    Budget,
    /// Full recomputation ([`crate::Full`]).
    Full,
    /// Activation offloading ([`crate::TrainerOptions::offload_activations`]).
    Offload,
    /// Master weights and optimizer state in host memory, the update on the CPU
    /// ([`crate::TrainerOptions::optimizer_offload`]).
    OptimizerOffload,
    /// Weights streamed from host memory: the frozen base
    /// ([`crate::placement::StreamFrozen`]), or every weight with the optimizer on the host
    /// ([`crate::placement::StreamAll`]).
    StreamWeights,
    /// bf16 compute with f32 master weights and bf16 gradients ([`crate::MixedBf16`]) in
    /// place of fp32.
    Bf16,
    /// bf16 weights and gradients without an f32 master copy, updates rounded
    /// stochastically ([`crate::PureBf16`]).
    PureBf16,
    /// A LoRA adapter on the frozen model ([`crate::Lora`], rank 8, α 16, `all-linear`).
    Lora,
    /// LoRA over an NF4 base ([`crate::adapter::BaseWeights::Nf4`]).
    Qlora,
}

impl Technique {
    /// Every technique, in autofit's cost order.
    pub const ALL: [Technique; 15] = [
        Technique::Accumulation,
        Technique::Zero1,
        Technique::Zero2,
        Technique::Selective,
        Technique::Adamw8bit,
        Technique::OptimizerInBackward,
        Technique::Budget,
        Technique::Full,
        Technique::Offload,
        Technique::OptimizerOffload,
        Technique::StreamWeights,
        Technique::Bf16,
        Technique::PureBf16,
        Technique::Lora,
        Technique::Qlora,
    ];

    /// The name `--autofit-techniques` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Technique::Accumulation => "accumulation",
            Technique::Zero1 => "zero-1",
            Technique::Zero2 => "zero-2",
            Technique::Selective => "selective",
            Technique::Adamw8bit => "adamw8bit",
            Technique::OptimizerInBackward => "optimizer-in-backward",
            Technique::Budget => "budget",
            Technique::Full => "full",
            Technique::Offload => "offload",
            Technique::OptimizerOffload => "optimizer-offload",
            Technique::StreamWeights => "stream-weights",
            Technique::Bf16 => "bf16",
            Technique::PureBf16 => "pure-bf16",
            Technique::Lora => "lora",
            Technique::Qlora => "qlora",
        }
    }

    /// The technique called `name` ([`Technique::name`]).
    pub fn parse(name: &str) -> Result<Technique> {
        Technique::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                Error::config(
                    "autofit_techniques",
                    format!(
                        "`{name}` is not a technique autofit knows; use all, or a comma-separated \
                         list of {}, pure-bf16, lora, qlora",
                        Techniques::ALL
                    ),
                )
            })
    }

    /// Whether the technique is a recompute policy (selective, budget, full).
    pub fn is_recompute(self) -> bool {
        matches!(
            self,
            Technique::Selective | Technique::Budget | Technique::Full
        )
    }

    fn bit(self) -> u16 {
        1 << self as u16
    }
}

impl std::fmt::Display for Technique {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`Technique`]s.
///
/// Sets compare by cost: one that uses a more expensive technique costs more than any set
/// of cheaper ones alone, and between two sets with the same most expensive technique
/// the next one decides ([`Techniques::cost`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Techniques(u16);

impl Techniques {
    /// No technique.
    pub const NONE: Techniques = Techniques(0);
    /// Every technique that trains the same weights with the run's arithmetic for the
    /// update (`--autofit-techniques all`, and autofit's default): all but
    /// [`Technique::PureBf16`], [`Technique::Lora`] and [`Technique::Qlora`], which
    /// autofit uses only when they are named.
    pub const ALL: Techniques = Techniques((1 << (Technique::Bf16 as u16 + 1)) - 1);
    /// Micro-batch and accumulation with the recompute policies that take no setting
    /// (selective and full): autofit's choices before it knew the others.
    pub const BATCH_AND_RECOMPUTE: Techniques = Techniques(
        1 << Technique::Accumulation as u16
            | 1 << Technique::Selective as u16
            | 1 << Technique::Full as u16,
    );

    /// Whether `t` is in the set.
    pub fn contains(self, t: Technique) -> bool {
        self.0 & t.bit() != 0
    }

    /// The set with `t`.
    pub fn with(self, t: Technique) -> Techniques {
        Techniques(self.0 | t.bit())
    }

    /// The set without `t`.
    pub fn without(self, t: Technique) -> Techniques {
        Techniques(self.0 & !t.bit())
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The techniques in the set, in cost order.
    pub fn iter(self) -> impl Iterator<Item = Technique> {
        Technique::ALL
            .into_iter()
            .filter(move |t| self.contains(*t))
    }

    /// The set's cost: the sum of 2^rank over its techniques, so that any set using a
    /// technique costs more than every set of the cheaper ones.
    pub fn cost(self) -> u16 {
        self.0
    }

    /// Parses `none`, or a comma-separated list of names ([`Technique::name`]) and `all`
    /// ([`Techniques::ALL`]): `all,qlora` is every technique that trains the same weights,
    /// and QLoRA.
    pub fn parse(list: &str) -> Result<Techniques> {
        if matches!(list.trim(), "none" | "") {
            return Ok(Techniques::NONE);
        }
        list.split(',')
            .map(str::trim)
            .try_fold(Techniques::NONE, |set, n| {
                Ok(if n == "all" {
                    Techniques(set.0 | Techniques::ALL.0)
                } else {
                    set.with(Technique::parse(n)?)
                })
            })
    }
}

impl FromIterator<Technique> for Techniques {
    fn from_iter<I: IntoIterator<Item = Technique>>(iter: I) -> Self {
        iter.into_iter().fold(Techniques::NONE, Techniques::with)
    }
}

/// `full, offload`, or `none`.
impl std::fmt::Display for Techniques {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.iter().map(Technique::name).collect();
        f.write_str(&names.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_more_expensive_technique_outweighs_every_cheaper_one() {
        let cheaper: Techniques = Technique::ALL[..5].iter().copied().collect();
        let full = Techniques::NONE.with(Technique::Full);
        assert!(cheaper.cost() < full.cost());
        assert!(full.cost() < full.with(Technique::Selective).cost());
        assert_eq!(Techniques::ALL.iter().count(), 12);
        assert!(Techniques::ALL.contains(Technique::OptimizerOffload));
        let offload = Techniques::NONE.with(Technique::OptimizerOffload);
        let cheaper: Techniques = Technique::ALL[..7].iter().copied().collect();
        assert!(cheaper.cost() < offload.cost());
        assert!(offload.cost() < Techniques::NONE.with(Technique::Bf16).cost());
    }

    #[test]
    fn lists_parse_and_print() {
        assert_eq!(Techniques::parse("all").unwrap(), Techniques::ALL);
        let set = Techniques::parse("full, accumulation,selective").unwrap();
        assert_eq!(set, Techniques::BATCH_AND_RECOMPUTE);
        assert_eq!(set.to_string(), "accumulation, selective, full");
        assert_eq!(Techniques::parse("none").unwrap().to_string(), "none");
        let with_qlora = Techniques::parse("all, qlora").unwrap();
        assert!(with_qlora.contains(Technique::Qlora) && !with_qlora.contains(Technique::Lora));
        assert!(!Techniques::ALL.contains(Technique::Lora));
        assert_eq!(
            Technique::parse("optimizer-offload").unwrap(),
            Technique::OptimizerOffload
        );
        let e = Techniques::parse("full,fast").unwrap_err().to_string();
        assert!(
            e.contains("`fast`") && e.contains("optimizer-in-backward"),
            "{e}"
        );
    }
}
