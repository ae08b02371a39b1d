//! `AccumulationSchedule`: how many micro-batches make each optimizer step.

use crate::error::{Error, Result};
use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// Where training stands when a step's micro-batch count is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccumulationContext {
    /// The optimizer step about to run (0-based).
    pub step: u64,
    /// Tokens trained on before this step.
    pub tokens_seen: u64,
    /// Tokens in one micro-batch (rows × sequence length).
    pub tokens_per_micro_batch: u64,
}

/// Chooses the number of micro-batches whose gradients are accumulated into one
/// optimizer step (the global batch is that many micro-batches).
#[typetag::serde(tag = "kind")]
pub trait AccumulationSchedule: DynClone + Debug + Send + Sync {
    /// Micro-batches for the step described by `ctx` (at least 1).
    fn micro_batches(&self, ctx: &AccumulationContext) -> Result<usize>;
}

dyn_clone::clone_trait_object!(AccumulationSchedule);

impl AccumulationSchedule for Box<dyn AccumulationSchedule> {
    fn micro_batches(&self, ctx: &AccumulationContext) -> Result<usize> {
        (**self).micro_batches(ctx)
    }
    #[doc(hidden)]
    fn typetag_name(&self) -> &'static str {
        (**self).typetag_name()
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// The same number of micro-batches every step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Constant {
    /// Micro-batches per step.
    pub micro_batches: usize,
}

impl Constant {
    /// `k` micro-batches per step.
    pub fn new(k: usize) -> Self {
        Constant { micro_batches: k }
    }
}

impl Default for Constant {
    fn default() -> Self {
        Constant { micro_batches: 1 }
    }
}

#[typetag::serde(name = "constant")]
impl AccumulationSchedule for Constant {
    fn micro_batches(&self, _ctx: &AccumulationContext) -> Result<usize> {
        if self.micro_batches == 0 {
            return Err(Error::config(
                "accumulation.micro_batches",
                "must be at least 1",
            ));
        }
        Ok(self.micro_batches)
    }
}

/// A global batch given in tokens (llm.c's `-d`): micro-batches = tokens / tokens per
/// micro-batch, which must divide exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensPerStep {
    /// Tokens per optimizer step.
    pub tokens: u64,
}

#[typetag::serde(name = "tokens_per_step")]
impl AccumulationSchedule for TokensPerStep {
    fn micro_batches(&self, ctx: &AccumulationContext) -> Result<usize> {
        divide(
            "accumulation.tokens",
            self.tokens,
            ctx.tokens_per_micro_batch,
        )
    }
}

fn divide(field: &str, tokens: u64, per_micro: u64) -> Result<usize> {
    if per_micro == 0 || tokens == 0 || tokens % per_micro != 0 {
        return Err(Error::config(
            field,
            format!(
                "{tokens} tokens per step is not a positive multiple of the {per_micro} tokens \
                 of a micro-batch (batch size × sequence length); use a multiple of {per_micro}"
            ),
        ));
    }
    Ok((tokens / per_micro) as usize)
}

/// A global batch that grows linearly from `start_tokens` to `end_tokens` over the first
/// `ramp_tokens` tokens of training, then stays at `end_tokens` (as DeepSeek-V3 ramped its
/// batch). Each step's batch is rounded down to whole micro-batches, at least one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ramp {
    /// Tokens per step at the start of training.
    pub start_tokens: u64,
    /// Tokens per step once the ramp is over.
    pub end_tokens: u64,
    /// Tokens of training over which the batch grows.
    pub ramp_tokens: u64,
}

#[typetag::serde(name = "ramp")]
impl AccumulationSchedule for Ramp {
    fn micro_batches(&self, ctx: &AccumulationContext) -> Result<usize> {
        if ctx.tokens_per_micro_batch == 0 {
            return Err(Error::config(
                "accumulation",
                "a micro-batch must hold at least one token",
            ));
        }
        if self.start_tokens == 0 || self.end_tokens < self.start_tokens {
            return Err(Error::config(
                "accumulation.start_tokens",
                format!(
                    "need 0 < start_tokens <= end_tokens, got {} and {}",
                    self.start_tokens, self.end_tokens
                ),
            ));
        }
        let frac = if self.ramp_tokens == 0 {
            1.0
        } else {
            (ctx.tokens_seen as f64 / self.ramp_tokens as f64).min(1.0)
        };
        let tokens = self.start_tokens as f64 + frac * (self.end_tokens - self.start_tokens) as f64;
        let k = (tokens / ctx.tokens_per_micro_batch as f64).floor() as usize;
        Ok(k.max(1))
    }
}
