//! The flags that choose a run's policies (`--precision`, `--recompute`, `--optimizer`,
//! the offloads, streamed weights, the loss and attention paths), shared by `trainkit train` and `trainkit
//! memory`, and the one rule that lays them over a [`RunConfig`].

use super::{set, RunConfig};
use crate::error::Result;

/// The policy flags as given; `None` where a flag is absent (the config's policy stays).
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct PolicyFlags {
    /// fp32, bf16 (bf16 compute with f32 master weights) or fp16 (fp16 compute with f32
    /// master weights and gradients, and a dynamic loss scale); `trainkit memory` assumes
    /// bf16 without it.
    #[arg(long)]
    pub precision: Option<String>,
    /// f32 (the default: an f32 master copy of bf16 weights) or none (pure bf16: bf16
    /// weights and gradients, the update rounded back into the weights; with --precision
    /// bf16).
    #[arg(long)]
    pub master_weights: Option<String>,
    /// How a pure-bf16 update is written back into the weights: nearest (the default),
    /// stochastic (unbiased) or kahan (the rounding error kept, +2 bytes per parameter).
    #[arg(long)]
    pub update_rounding: Option<String>,
    /// Activation recomputation: none, full, selective, or budget:SIZE (keep the
    /// activations that save the most recompute per byte up to SIZE, e.g. budget:2GiB).
    #[arg(long)]
    pub recompute: Option<String>,
    /// Move the activations the recompute policy keeps to host memory after forward and
    /// bring them back for backward (under --recompute full, each layer's input).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub offload_activations: Option<bool>,
    /// Keep weights in page-locked host memory and copy each layer's to the device one
    /// layer ahead of its use, freeing it after; training is bitwise the same. frozen (the
    /// default: the base of LoRA and QLoRA, `[placement] kind = "stream_frozen"`), all
    /// (every weight, updated on the host: with --optimizer-offload; `"stream_all"`) or
    /// none.
    #[arg(long, value_name = "WHICH", num_args = 0..=1, default_missing_value = "frozen")]
    pub stream_weights: Option<String>,
    /// adamw, adamw8bit (AdamW with 8-bit moments, about 2 bytes of state per parameter
    /// instead of 8) or sgd; settings the config's optimizer shares with it are kept.
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Update each parameter inside backward as soon as its gradient is complete and free
    /// the gradient (gradient memory of about one layer); needs one micro-batch per step
    /// and no clipping (--grad-accum 1 --grad-clip 0).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub optimizer_in_backward: Option<bool>,
    /// Keep the f32 master weights and the optimizer state in host memory and run the
    /// update on the CPU's threads (the device keeps the compute weights and gradients);
    /// the update is bitwise the one without.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub optimizer_offload: Option<bool>,
    /// How the loss is computed: fused (the classifier product and the cross-entropy in
    /// chunks of positions, the default) or materialized (the logits of every position).
    #[arg(long)]
    pub loss: Option<String>,
    /// Positions per chunk of the fused loss (default: chosen from the vocabulary).
    #[arg(long)]
    pub loss_chunk: Option<usize>,
    /// How attention is computed: fused (tiles with an online softmax, no [B, H, T, T]
    /// tensor; the default) or materialized (the probabilities kept for backward).
    #[arg(long)]
    pub attention: Option<String>,
}

impl PolicyFlags {
    /// Whether any flag that picks the precision is given (`--precision`,
    /// `--master-weights`, `--update-rounding`).
    pub fn sets_precision(&self) -> bool {
        self.precision.is_some() || self.master_weights.is_some() || self.update_rounding.is_some()
    }

    /// Lays the flags over `cfg`'s policies (not validated: [`super::Overrides::apply`]
    /// validates the whole). Every error names its flag.
    pub fn apply(&self, cfg: &mut RunConfig) -> Result<()> {
        let t = &mut cfg.training;
        set(&mut t.optimizer_in_backward, self.optimizer_in_backward);
        set(&mut t.offload_activations, self.offload_activations);
        set(&mut cfg.optimizer_offload, self.optimizer_offload);
        if let Some(which) = &self.stream_weights {
            let placement = crate::placement::named(which)?;
            // The config's own settings (its `ahead`) stay when it names the same kind.
            if placement.typetag_name() != cfg.placement.typetag_name() {
                cfg.placement = placement;
            }
        }
        if let Some(p) = &self.precision {
            cfg.precision =
                crate::precision::named(p, false).map_err(|e| e.for_field("--precision"))?;
        }
        if self.master_weights.is_some() || self.update_rounding.is_some() {
            cfg.precision = crate::precision::with_master_weights(
                std::mem::replace(&mut cfg.precision, Box::new(crate::precision::Fp32)),
                self.master_weights.as_deref(),
                self.update_rounding.as_deref(),
            )?;
        }
        if let Some(r) = &self.recompute {
            cfg.checkpoint = crate::checkpoint::named(r).map_err(|e| e.for_field("--recompute"))?;
        }
        if let Some(l) = &self.loss {
            cfg.training.loss = crate::ops::LossPath::parse("--loss", l)?;
        }
        if let Some(c) = self.loss_chunk {
            crate::ops::LinearCrossEntropy::new("--loss-chunk", Some(c))?;
            cfg.training.loss_chunk = Some(c);
        }
        if let Some(a) = &self.attention {
            cfg.training.attention = crate::ops::AttentionPath::parse("--attention", a)?;
        }
        if let Some(name) = &self.optimizer {
            cfg.optimizer = crate::optim::switch_to(name, cfg.optimizer.as_ref())
                .map_err(|e| e.for_field("--optimizer"))?;
        }
        Ok(())
    }
}
