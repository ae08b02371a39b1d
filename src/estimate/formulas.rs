//! The memory formulas of the Ultra-Scale Playbook (Hugging Face, 2025) for one GPU
//! training a transformer with AdamW: parameters, model state and activations.
//!
//! These are the playbook's closed forms, not trainkit's own ledger: they count what a
//! typical mixed-precision setup holds, in decimal bytes, and leave out workspace,
//! allocator fragmentation and the logits of the loss.

use crate::checkpoint::{CheckpointPolicy, Full, NoRecompute, Selective};
use crate::error::{Error, Result};
use crate::memory::{CategoryBytes, MemoryCategory};
use crate::precision::{Fp32, MixedBf16, Precision};
use serde::{Deserialize, Serialize};

/// `a·b` or an error naming `what` when it does not fit in 64 bits.
pub(crate) fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| too_large(what))
}

/// `a + b` or an error naming `what` when it does not fit in 64 bits.
pub(crate) fn add(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| too_large(what))
}

fn too_large(what: &str) -> Error {
    Error::config(
        what,
        "the estimate does not fit in 64 bits; use smaller dimensions",
    )
}

/// Parameters of a GPT-style transformer by the playbook's formula
/// `N = h·v + L·(12h² + 13h) + 2h`: tied token embeddings, four `h×h` attention matrices
/// and two `h×4h` MLP matrices with biases and two LayerNorms per layer, and a final
/// LayerNorm. Position embeddings are not counted.
pub fn playbook_params(layers: u64, hidden: u64, vocab: u64) -> Result<u64> {
    let what = "params";
    let h2 = mul(hidden, hidden, what)?;
    let per_layer = add(mul(12, h2, what)?, mul(13, hidden, what)?, what)?;
    let total = add(
        mul(hidden, vocab, what)?,
        mul(layers, per_layer, what)?,
        what,
    )?;
    add(total, mul(2, hidden, what)?, what)
}

/// How training holds its model state: the precision of the weights, gradients and
/// master copy (the optimizer is AdamW, whose two f32 moments take 8 bytes per parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum TrainingPrecision {
    /// Everything in f32: weights 4, gradients 4, optimizer state 8 bytes per parameter
    /// (16), no master copy. Activations are f32.
    Fp32,
    /// bf16 weights and gradients with an f32 master copy: weights 2, gradients 2, master
    /// weights 4, optimizer state 8 bytes per parameter (16). With `fp32_grads`, gradients
    /// are also accumulated in f32, 4 more bytes per parameter counted under gradients
    /// (20). Activations are bf16.
    MixedBf16 {
        /// Accumulate gradients in an extra f32 buffer.
        fp32_grads: bool,
    },
}

impl TrainingPrecision {
    /// The spelling of `trainkit train --precision`: `fp32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            TrainingPrecision::Fp32 => "fp32",
            TrainingPrecision::MixedBf16 { .. } => "bf16",
        }
    }

    /// The precision a `--precision` value names (`fp32` or `bf16`); `fp32_grads` adds the
    /// f32 gradient buffer to bf16 and changes nothing for fp32, whose gradients are f32.
    pub fn parse(name: &str, fp32_grads: bool) -> Result<Self> {
        match name {
            "fp32" => Ok(TrainingPrecision::Fp32),
            "bf16" => Ok(TrainingPrecision::MixedBf16 { fp32_grads }),
            other => Err(Error::config(
                "precision",
                format!("`{other}` is not a precision; use fp32 or bf16"),
            )),
        }
    }

    /// Bytes per parameter in each model-state category (weights, master weights,
    /// gradients, optimizer state; activations and workspace are 0).
    pub fn bytes_per_param(self) -> CategoryBytes {
        let (weights, master, grads) = match self {
            TrainingPrecision::Fp32 => (4, 0, 4),
            TrainingPrecision::MixedBf16 { fp32_grads } => (2, 4, if fp32_grads { 6 } else { 2 }),
        };
        let mut out = CategoryBytes::default();
        *out.get_mut(MemoryCategory::Weights) = weights;
        *out.get_mut(MemoryCategory::MasterWeights) = master;
        *out.get_mut(MemoryCategory::Gradients) = grads;
        *out.get_mut(MemoryCategory::OptimizerState) = 8;
        out
    }

    /// Bytes of one activation element: 4 in f32, 2 in bf16.
    pub fn activation_bytes(self) -> u64 {
        match self {
            TrainingPrecision::Fp32 => 4,
            TrainingPrecision::MixedBf16 { .. } => 2,
        }
    }

    /// trainkit's precision policy closest to this choice ([`Fp32`] or [`MixedBf16`]).
    pub fn policy(self) -> Box<dyn Precision> {
        match self {
            TrainingPrecision::Fp32 => Box::new(Fp32),
            TrainingPrecision::MixedBf16 { fp32_grads } => Box::new(MixedBf16 { fp32_grads }),
        }
    }
}

impl std::fmt::Display for TrainingPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrainingPrecision::Fp32 => f.write_str("fp32"),
            TrainingPrecision::MixedBf16 { fp32_grads: false } => f.write_str("bf16 mixed"),
            TrainingPrecision::MixedBf16 { fp32_grads: true } => {
                f.write_str("bf16 mixed, f32 gradient accumulation")
            }
        }
    }
}

/// Model-state bytes of `params` parameters by category (weights, master weights,
/// gradients, optimizer state), the playbook's `bytes per parameter × N`.
pub fn model_state_bytes(params: u64, precision: TrainingPrecision) -> Result<CategoryBytes> {
    let mut out = precision.bytes_per_param();
    for bytes in out.0.iter_mut() {
        *bytes = mul(*bytes, params, "params")?;
    }
    Ok(out)
}

/// Which activations a layer keeps for backward, by the names of trainkit's checkpoint
/// policies (`kind = "none"`, `"selective"`, `"full"`). Ordered from the least
/// recomputation to the most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep everything ([`NoRecompute`]): `L·s·b·(34h + 5·a·s)` bytes at 16 bits.
    None,
    /// Drop the attention scores and probabilities and recompute them ([`Selective`]):
    /// the quadratic `5·a·s` term goes, `L·s·b·34h` stays.
    Selective,
    /// Keep only each layer's input and recompute the layer ([`Full`]): `L·s·b·2h`.
    Full,
}

impl Recompute {
    /// Every policy, from most to least memory.
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    /// The spelling of `trainkit train --recompute` and of the checkpoint `kind`.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }

    /// The policy a `--recompute` value names (`none`, `selective` or `full`).
    pub fn parse(name: &str) -> Result<Self> {
        Recompute::ALL
            .into_iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                Error::config(
                    "recompute",
                    format!("`{name}` is not a recompute policy; use none, full or selective"),
                )
            })
    }

    /// trainkit's checkpoint policy of the same name.
    pub fn policy(self) -> Box<dyn CheckpointPolicy> {
        match self {
            Recompute::None => Box::new(NoRecompute),
            Recompute::Selective => Box::new(Selective),
            Recompute::Full => Box::new(Full),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The dimensions activation memory depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivationShape {
    /// Transformer layers `L`.
    pub layers: u64,
    /// Width of the residual stream `h`.
    pub hidden: u64,
    /// Attention (query) heads `a`.
    pub heads: u64,
    /// Tokens per sequence `s`.
    pub seq_len: u64,
    /// Sequences per micro-batch `b`.
    pub micro_batch: u64,
}

impl ActivationShape {
    /// Activation bytes the policy keeps for backward, by the playbook's formula for a
    /// GPT-style layer in 16-bit activations: `L·s·b·(34h + 5·a·s)` with no recomputation,
    /// `L·s·b·34h` with selective recomputation, `L·s·b·2h` (each layer's input) with full
    /// recomputation. f32 activations double every term (the playbook's own convention;
    /// its 1-byte dropout masks would not double, but trainkit has no dropout).
    pub fn bytes(&self, recompute: Recompute, precision: TrainingPrecision) -> Result<u64> {
        let what = "activations";
        let (l, h, a, s, b) = (
            self.layers,
            self.hidden,
            self.heads,
            self.seq_len,
            self.micro_batch,
        );
        let per_token = match recompute {
            Recompute::None => add(mul(34, h, what)?, mul(mul(5, a, what)?, s, what)?, what)?,
            Recompute::Selective => mul(34, h, what)?,
            Recompute::Full => mul(2, h, what)?,
        };
        let tokens = mul(mul(l, s, what)?, b, what)?;
        let bytes16 = mul(tokens, per_token, what)?;
        mul(bytes16, precision.activation_bytes() / 2, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn state_total(params: u64, precision: TrainingPrecision) -> u64 {
        model_state_bytes(params, precision).unwrap().total()
    }

    #[test]
    fn the_playbook_table_of_model_state_is_exact() {
        let bf16 = TrainingPrecision::MixedBf16 { fp32_grads: false };
        let bf16_f32 = TrainingPrecision::MixedBf16 { fp32_grads: true };
        for (billions, plain, with_f32_grads) in [
            (1, 16, 20),
            (7, 112, 140),
            (70, 1120, 1400),
            (405, 6480, 8100),
        ] {
            let n = billions * GB;
            assert_eq!(state_total(n, bf16), plain * GB, "{billions}B");
            assert_eq!(state_total(n, TrainingPrecision::Fp32), plain * GB);
            assert_eq!(state_total(n, bf16_f32), with_f32_grads * GB, "{billions}B");
        }
    }

    #[test]
    fn bytes_per_param_by_category() {
        let per = |p: TrainingPrecision| {
            let b = p.bytes_per_param();
            [
                MemoryCategory::Weights,
                MemoryCategory::MasterWeights,
                MemoryCategory::Gradients,
                MemoryCategory::OptimizerState,
                MemoryCategory::Activations,
            ]
            .map(|c| b.get(c))
        };
        assert_eq!(per(TrainingPrecision::Fp32), [4, 0, 4, 8, 0]);
        assert_eq!(
            per(TrainingPrecision::MixedBf16 { fp32_grads: false }),
            [2, 4, 2, 8, 0]
        );
        assert_eq!(
            per(TrainingPrecision::MixedBf16 { fp32_grads: true }),
            [2, 4, 6, 8, 0]
        );
    }

    #[test]
    fn the_playbook_parameter_formula() {
        // GPT-2 small without its 1024×768 position embedding.
        assert_eq!(playbook_params(12, 768, 50257).unwrap(), 123_653_376);
        assert!(playbook_params(u64::MAX, 1 << 20, 1).is_err());
    }

    #[test]
    fn activations_per_policy() {
        let shape = ActivationShape {
            layers: 32,
            hidden: 4096,
            heads: 32,
            seq_len: 4096,
            micro_batch: 2,
        };
        let bf16 = TrainingPrecision::MixedBf16 { fp32_grads: false };
        let lsb = 32 * 4096 * 2;
        assert_eq!(
            shape.bytes(Recompute::None, bf16).unwrap(),
            lsb * (34 * 4096 + 5 * 32 * 4096)
        );
        assert_eq!(
            shape.bytes(Recompute::Selective, bf16).unwrap(),
            lsb * 34 * 4096
        );
        assert_eq!(shape.bytes(Recompute::Full, bf16).unwrap(), lsb * 2 * 4096);
        for r in Recompute::ALL {
            assert_eq!(
                shape.bytes(r, TrainingPrecision::Fp32).unwrap(),
                2 * shape.bytes(r, bf16).unwrap()
            );
        }
        let huge = ActivationShape {
            seq_len: u64::MAX / 2,
            ..shape
        };
        assert!(huge.bytes(Recompute::None, bf16).is_err());
    }

    #[test]
    fn names_are_those_of_the_train_flags_and_policy_kinds() {
        for r in Recompute::ALL {
            assert_eq!(Recompute::parse(r.name()).unwrap(), r);
            assert_eq!(r.policy().typetag_name(), r.name());
        }
        assert!(Recompute::parse("no_recompute").is_err());
        assert_eq!(
            TrainingPrecision::parse("bf16", true).unwrap(),
            TrainingPrecision::MixedBf16 { fp32_grads: true }
        );
        assert_eq!(
            TrainingPrecision::parse("fp32", true).unwrap(),
            TrainingPrecision::Fp32
        );
        assert!(TrainingPrecision::parse("fp16", false).is_err());
        assert_eq!(
            TrainingPrecision::MixedBf16 { fp32_grads: false }
                .policy()
                .typetag_name(),
            "mixed_bf16"
        );
    }
}
