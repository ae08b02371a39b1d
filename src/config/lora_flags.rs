//! The LoRA flags of `trainkit train` and `trainkit memory` (`--lora-rank`,
//! `--lora-alpha`, `--lora-targets`, `--lora-dropout`, `--modules-to-save`, `--qlora`,
//! `--use-dora`) and the one rule that makes a [`Lora`] of them.

use crate::adapter::{default_targets, BaseWeights, Lora};
use crate::error::{Error, Result};

/// The LoRA flags as given (of `trainkit train`, and of `trainkit memory` for an
/// adapter's exact figures); `None` (or false) where a flag is absent.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct LoraFlags {
    /// Train a LoRA adapter of this rank on a frozen model (8, 16 and 32 are common).
    #[arg(long = "lora-rank", value_name = "R")]
    pub rank: Option<usize>,
    /// LoRA's α: the update is scaled by α / rank (default 2 · rank).
    #[arg(long = "lora-alpha", value_name = "A")]
    pub alpha: Option<f64>,
    /// The projections LoRA adapts, by Hugging Face module name, comma-separated:
    /// q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (GPT-2: c_attn,
    /// c_proj, c_fc), or all-linear (default: q_proj,v_proj; GPT-2: c_attn).
    #[arg(long = "lora-targets", value_name = "LIST", value_delimiter = ',')]
    pub targets: Option<Vec<String>>,
    /// LoRA's dropout in training (PEFT's lora_dropout; its recipes use 0.05): each
    /// element of an update's input is zeroed with this probability, the rest scaled by
    /// 1/(1 − P); none in evaluation, sampling and merging (default 0; with --adapter, the
    /// adapter's).
    #[arg(long = "lora-dropout", value_name = "P")]
    pub dropout: Option<f64>,
    /// Base modules trained whole beside the LoRA and saved with it (PEFT's
    /// modules_to_save), comma-separated: each matches every module whose name ends with
    /// it, e.g. lm_head (an untied head), norm; not the projections LoRA adapts.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub modules_to_save: Option<Vec<String>>,
    /// QLoRA: store the frozen base projections in NF4 (4.127 bits per weight, quantized
    /// as bitsandbytes does when the weights load); needs --lora-rank (or, in training,
    /// --adapter).
    #[arg(long)]
    pub qlora: bool,
    /// DoRA (PEFT's use_dora): each adapted projection's output features rescaled by a
    /// trained magnitude over the norm of their row of W + (α/r)·B·A, starting at the base
    /// rows' norms (with --adapter, the adapter's setting).
    #[arg(long)]
    pub use_dora: bool,
}

impl LoraFlags {
    /// Whether no LoRA flag is given.
    pub fn is_empty(&self) -> bool {
        *self == LoraFlags::default()
    }

    /// The LoRA these flags describe, laid over `current` (a config's LoRA, which a flag
    /// that is absent leaves as it is); `None` when no flag is given. A rank starts a
    /// LoRA: α defaults to twice the rank and the targets to PEFT's for a model of these
    /// projection `modules` ([`default_targets`]; see
    /// [`crate::model::AnyFamily::projection_modules`]). Every error names the flag.
    pub fn lora(&self, current: Option<&Lora>, modules: &[String]) -> Result<Option<Lora>> {
        if self.is_empty() {
            return Ok(None);
        }
        let rank = self.rank.or(current.map(|l| l.rank)).ok_or_else(|| {
            Error::config(
                "--lora-rank",
                "--lora-alpha, --lora-targets, --lora-dropout, --modules-to-save, --qlora and \
                 --use-dora describe a LoRA: give its rank too (--lora-rank 8 is common)",
            )
        })?;
        let alpha = self
            .alpha
            .or(current
                .filter(|l| self.rank.is_none_or(|r| r == l.rank))
                .map(|l| l.alpha))
            .unwrap_or(2.0 * rank as f64);
        let targets = match (&self.targets, current) {
            (Some(t), _) => t.clone(),
            (None, Some(l)) => l.targets.clone(),
            (None, None) => default_targets(modules),
        };
        let lora = Lora {
            rank,
            alpha,
            targets,
            rslora: current.is_some_and(|l| l.rslora),
            dropout: self.dropout.or(current.map(|l| l.dropout)).unwrap_or(0.0),
            dora: self.use_dora || current.is_some_and(|l| l.dora),
            modules_to_save: self
                .modules_to_save
                .clone()
                .or(current.map(|l| l.modules_to_save.clone()))
                .unwrap_or_default(),
            base: if self.qlora {
                BaseWeights::Nf4
            } else {
                current.map(|l| l.base).unwrap_or_default()
            },
        };
        lora.validate().map_err(|e| {
            let flag = lora_flag(&e);
            e.for_field(flag)
        })?;
        Ok(Some(lora))
    }
}

/// The command-line flag of the LoRA setting an error names (`adapter.dropout` is
/// `--lora-dropout`, ...); `--lora-targets` for the targets and any other error.
pub fn lora_flag(e: &Error) -> &'static str {
    match e {
        Error::Config { field, .. } => match field.as_str() {
            "adapter.rank" => "--lora-rank",
            "adapter.alpha" => "--lora-alpha",
            "adapter.dropout" => "--lora-dropout",
            "adapter.modules_to_save" => "--modules-to-save",
            _ => "--lora-targets",
        },
        _ => "--lora-targets",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_starts_a_lora_with_peft_defaults_and_other_flags_need_one() {
        let module = |m: &str| format!("model.layers.0.self_attn.{m}");
        let llama: Vec<String> = ["q_proj", "k_proj", "v_proj", "o_proj"]
            .map(module)
            .to_vec();
        let gpt2 = vec!["transformer.h.0.attn.c_attn".to_string()];
        let none = LoraFlags::default();
        assert_eq!(none.lora(None, &llama).unwrap(), None);
        let rank = LoraFlags {
            rank: Some(8),
            ..LoraFlags::default()
        };
        let l = rank.lora(None, &llama).unwrap().unwrap();
        assert_eq!((l.rank, l.alpha), (8, 16.0));
        assert_eq!(l.targets, ["q_proj", "v_proj"]);
        assert_eq!(rank.lora(None, &gpt2).unwrap().unwrap().targets, ["c_attn"]);
        // Alone, α changes the config's LoRA, and needs one.
        let alpha = LoraFlags {
            alpha: Some(4.0),
            ..LoraFlags::default()
        };
        let over = alpha.lora(Some(&l), &llama).unwrap().unwrap();
        assert_eq!((over.rank, over.alpha, &over.targets), (8, 4.0, &l.targets));
        let err = alpha.lora(None, &llama).unwrap_err().to_string();
        assert!(err.contains("--lora-rank"), "{err}");
        // A bad value is refused by its flag.
        let bad = LoraFlags {
            rank: Some(8),
            dropout: Some(1.5),
            ..LoraFlags::default()
        };
        let err = bad.lora(None, &llama).unwrap_err().to_string();
        assert!(err.contains("--lora-dropout"), "{err}");
    }
}
