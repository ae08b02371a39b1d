//! The memory formulas of the Ultra-Scale Playbook (Hugging Face, 2025) for one GPU
//! training a transformer with AdamW: parameters, model state and activations.
//!
//! These are the playbook's closed forms, not trainkit's own ledger: they count what a
//! typical mixed-precision setup holds, in decimal bytes, and leave out workspace,
//! allocator fragmentation and the logits of the loss.

use crate::checkpoint::{ActivationSite, CheckpointPolicy, Retention, Tags};
use crate::error::{Error, Result};
use crate::memory::{CategoryBytes, MemoryCategory};
use crate::optim::Optimizer;
use crate::precision::Precision;
use crate::tensor::DType;
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

/// Bytes per parameter by category (weights, master weights, gradients, optimizer
/// state) as the playbook counts them for `precision` and `optimizer`: the compute
/// weights, an f32 master copy when the precision keeps one (or pure bf16's 2-byte Kahan
/// compensation), gradients in the compute
/// dtype plus an f32 accumulation buffer when they accumulate in f32 apart from bf16
/// compute (the playbook's 20 bytes of mixed precision), and the optimizer's state for the
/// tensor it updates ([`Optimizer::state_bytes_for`]).
pub fn bytes_per_param(precision: &dyn Precision, optimizer: &dyn Optimizer) -> CategoryBytes {
    let compute = precision.compute_dtype().size() as u64;
    let kahan = precision.update_rounding().is_some_and(|r| r.compensated());
    let master = match (precision.master_weights(), kahan) {
        (true, _) => 4,
        // Pure bf16's Kahan compensation, in the master weights' place.
        (false, true) => 2,
        (false, false) => 0,
    };
    let f32_grads = precision.grad_dtype() == DType::F32 && precision.compute_dtype() != DType::F32;
    let grads = compute + if f32_grads { 4 } else { 0 };
    let mut out = CategoryBytes::default();
    *out.get_mut(MemoryCategory::Weights) = compute;
    *out.get_mut(MemoryCategory::MasterWeights) = master;
    *out.get_mut(MemoryCategory::Gradients) = grads;
    // The optimizer updates the master copy, or without one the compute weights.
    let value = if precision.master_weights() {
        DType::F32
    } else {
        precision.compute_dtype()
    };
    *out.get_mut(MemoryCategory::OptimizerState) = optimizer.state_bytes_for(value) as u64;
    out
}

/// Model-state bytes of `params` parameters by category (weights, master weights,
/// gradients, optimizer state), the playbook's `bytes per parameter × N`
/// ([`bytes_per_param`]).
pub fn model_state_bytes(
    params: u64,
    precision: &dyn Precision,
    optimizer: &dyn Optimizer,
) -> Result<CategoryBytes> {
    let mut out = bytes_per_param(precision, optimizer);
    for bytes in out.0.iter_mut() {
        *bytes = mul(*bytes, params, "params")?;
    }
    Ok(out)
}

/// One activation of the playbook's GPT-style layer (Korthikanti et al., 2022, the
/// playbook's source), in 16-bit bytes: `per_token_h · h + per_token_as · a · s` per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaybookActivation {
    /// Its name.
    pub name: &'static str,
    /// The tags a checkpoint policy matches, as trainkit's own GPT-2 tags its activations.
    pub tags: Tags,
    /// Bytes per token per unit of width `h`.
    pub per_token_h: u64,
    /// Bytes per token per head per token of context (`a · s`): the quadratic terms.
    pub per_token_as: u64,
}

/// The activations a GPT-style layer keeps for backward in the playbook's count:
/// `34h + 5·a·s` bytes per token at 16 bits (dropout masks included, 1 byte each).
pub const PLAYBOOK_LAYER: [PlaybookActivation; 14] = {
    const fn act(name: &'static str, tags: Tags, h: u64, a_s: u64) -> PlaybookActivation {
        PlaybookActivation {
            name,
            tags,
            per_token_h: h,
            per_token_as: a_s,
        }
    }
    let (attn, mlp) = (Tags::ATTENTION, Tags::MLP);
    [
        act("input", Tags::LAYER_INPUT, 2, 0),
        act("ln1_out", attn.with(Tags::NORM_OUT), 2, 0),
        act("q_and_k", attn.with(Tags::PROJECTION), 4, 0),
        act("v", attn.with(Tags::PROJECTION), 2, 0),
        act("attn_probs", attn.with(Tags::QUADRATIC), 0, 2),
        act("attn_dropout_mask", attn.with(Tags::QUADRATIC), 0, 1),
        act("attn_dropout_out", attn.with(Tags::QUADRATIC), 0, 2),
        act("attn_out", attn, 2, 0),
        act("attn_proj_dropout_mask", attn, 1, 0),
        act("residual", Tags::RESIDUAL, 2, 0),
        act("ln2_out", mlp.with(Tags::NORM_OUT), 2, 0),
        act("fc_out", mlp.with(Tags::WIDE).with(Tags::PROJECTION), 8, 0),
        act("gelu_out", mlp.with(Tags::WIDE), 8, 0),
        act("mlp_dropout_mask", mlp, 1, 0),
    ]
};

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
    /// Activation bytes `policy` keeps for backward, by the playbook's count of a
    /// GPT-style layer ([`PLAYBOOK_LAYER`]): the policy is asked about each of its
    /// activations in every layer, as in training. For the shipped policies this is
    /// `L·s·b·(34h + 5·a·s)` with no recomputation, `L·s·b·34h` with selective
    /// recomputation and `L·s·b·2h` (each layer's input) with full recomputation, at 16
    /// bits; f32 activations double every term (the playbook's own convention; its 1-byte
    /// dropout masks would not double, but trainkit has no dropout).
    pub fn bytes(&self, policy: &dyn CheckpointPolicy, precision: &dyn Precision) -> Result<u64> {
        let what = "activations";
        let (h, a, s) = (self.hidden, self.heads, self.seq_len);
        let tokens = mul(s, self.micro_batch, what)?;
        let scale = precision.compute_dtype().size() as u64;
        let n_layer = usize::try_from(self.layers).unwrap_or(usize::MAX);
        let mut total = 0u64;
        for layer in 0..self.layers {
            for act in &PLAYBOOK_LAYER {
                let per_token = add(
                    mul(act.per_token_h, h, what)?,
                    mul(mul(act.per_token_as, a, what)?, s, what)?,
                    what,
                )?;
                let bytes = mul(mul(tokens, per_token, what)?, scale, what)? / 2;
                let site = ActivationSite {
                    layer: usize::try_from(layer).unwrap_or(usize::MAX),
                    n_layer,
                    name: act.name,
                    tags: act.tags,
                    bytes,
                };
                if policy.retain(&site) == Retention::Keep {
                    total = add(total, bytes, what)?;
                }
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{by_cost, Full, NoRecompute, Selective};
    use crate::optim::AdamW;
    use crate::precision::{Fp32, MixedBf16};

    const GB: u64 = 1_000_000_000;

    fn state_total(params: u64, precision: &dyn Precision) -> u64 {
        model_state_bytes(params, precision, &AdamW::default())
            .unwrap()
            .total()
    }

    #[test]
    fn the_playbook_table_of_model_state_is_exact() {
        let bf16 = MixedBf16 { fp32_grads: false };
        let bf16_f32 = MixedBf16 { fp32_grads: true };
        for (billions, plain, with_f32_grads) in [
            (1, 16, 20),
            (7, 112, 140),
            (70, 1120, 1400),
            (405, 6480, 8100),
        ] {
            let n = billions * GB;
            assert_eq!(state_total(n, &bf16), plain * GB, "{billions}B");
            assert_eq!(state_total(n, &Fp32), plain * GB);
            assert_eq!(
                state_total(n, &bf16_f32),
                with_f32_grads * GB,
                "{billions}B"
            );
        }
    }

    #[test]
    fn bytes_per_param_by_category() {
        let per = |p: &dyn Precision| {
            let b = bytes_per_param(p, &AdamW::default());
            [
                MemoryCategory::Weights,
                MemoryCategory::MasterWeights,
                MemoryCategory::Gradients,
                MemoryCategory::OptimizerState,
                MemoryCategory::Activations,
            ]
            .map(|c| b.get(c))
        };
        assert_eq!(per(&Fp32), [4, 0, 4, 8, 0]);
        assert_eq!(per(&MixedBf16 { fp32_grads: false }), [2, 4, 2, 8, 0]);
        assert_eq!(per(&MixedBf16 { fp32_grads: true }), [2, 4, 6, 8, 0]);
        use crate::ops::update_rounding::UpdateRounding;
        use crate::precision::PureBf16;
        for (rounding, master) in [
            (UpdateRounding::Nearest, 0),
            (UpdateRounding::Stochastic, 0),
            (UpdateRounding::Kahan, 2),
        ] {
            // AdamW's moments follow the bf16 weights.
            assert_eq!(per(&PureBf16 { rounding }), [2, master, 2, 4, 0]);
        }
    }

    #[test]
    fn the_playbook_parameter_formula() {
        // GPT-2 small without its 1024×768 position embedding.
        assert_eq!(playbook_params(12, 768, 50257).unwrap(), 123_653_376);
        assert!(playbook_params(u64::MAX, 1 << 20, 1).is_err());
    }

    #[test]
    fn the_layer_sums_to_the_playbook_terms() {
        let h: u64 = PLAYBOOK_LAYER.iter().map(|a| a.per_token_h).sum();
        let a_s: u64 = PLAYBOOK_LAYER.iter().map(|a| a.per_token_as).sum();
        assert_eq!((h, a_s), (34, 5));
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
        let bf16 = MixedBf16 { fp32_grads: false };
        let lsb = 32 * 4096 * 2;
        assert_eq!(
            shape.bytes(&NoRecompute, &bf16).unwrap(),
            lsb * (34 * 4096 + 5 * 32 * 4096)
        );
        assert_eq!(shape.bytes(&Selective, &bf16).unwrap(), lsb * 34 * 4096);
        assert_eq!(shape.bytes(&Full, &bf16).unwrap(), lsb * 2 * 4096);
        for r in by_cost() {
            assert_eq!(
                shape.bytes(r.as_ref(), &Fp32).unwrap(),
                2 * shape.bytes(r.as_ref(), &bf16).unwrap()
            );
        }
        let huge = ActivationShape {
            seq_len: u64::MAX / 2,
            ..shape
        };
        assert!(huge.bytes(&NoRecompute, &bf16).is_err());
    }

    /// A policy of its own is asked about every activation of every layer.
    #[test]
    fn a_users_policy_is_counted_as_it_decides() {
        #[derive(Clone, Debug, Serialize, Deserialize)]
        struct KeepFirstLayerOnly;
        #[typetag::serde(name = "keep_first_layer_only_formula_test")]
        impl CheckpointPolicy for KeepFirstLayerOnly {
            fn retain(&self, site: &ActivationSite) -> Retention {
                if site.layer == 0 {
                    Retention::Keep
                } else {
                    Retention::Recompute
                }
            }
        }
        let shape = ActivationShape {
            layers: 4,
            hidden: 64,
            heads: 4,
            seq_len: 32,
            micro_batch: 1,
        };
        let bf16 = MixedBf16 { fp32_grads: false };
        let all = shape.bytes(&NoRecompute, &bf16).unwrap();
        assert_eq!(shape.bytes(&KeepFirstLayerOnly, &bf16).unwrap(), all / 4);
    }

    #[test]
    fn names_are_those_of_the_train_flags_and_policy_kinds() {
        for r in by_cost() {
            let name = r.typetag_name();
            assert_eq!(crate::checkpoint::named(name).unwrap().typetag_name(), name);
        }
        assert!(crate::checkpoint::named("no_recompute").is_err());
        assert_eq!(
            crate::precision::named("bf16", true).unwrap().grad_dtype(),
            DType::F32
        );
        assert_eq!(
            crate::precision::named("fp32", true)
                .unwrap()
                .typetag_name(),
            "fp32"
        );
        assert_eq!(
            crate::precision::named("fp16", false)
                .unwrap()
                .typetag_name(),
            "mixed_fp16"
        );
        assert!(crate::precision::named("f16", false).is_err());
        assert_eq!(
            crate::precision::named("bf16", false)
                .unwrap()
                .typetag_name(),
            "mixed_bf16"
        );
    }
}
