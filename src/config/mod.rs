//! Run configuration: one TOML (or JSON) document for a whole run, with every policy as a
//! table carrying a `kind`.

use crate::accumulate::{AccumulationSchedule, Constant};
use crate::adapter::Adapter;
use crate::checkpoint::{CheckpointPolicy, NoRecompute};
use crate::error::{Error, Result};
use crate::memory::{MemoryObserver, PeakTracker};
use crate::model::{Model, ModelConfig};
use crate::ops::{AttentionPath, LossPath};
use crate::optim::{AdamW, LrSchedule, Optimizer};
use crate::placement::WeightPlacement;
use crate::precision::{Fp32, Precision};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;

mod data;
mod derived;
mod describe;
mod finetune;
mod lora_flags;
mod overrides;
mod policy_flags;
mod resolve;

use crate::model::set;
pub use crate::model::ShapeFlags;
pub use data::{Corpus, DataConfig, DocumentFlags};
pub use derived::{ConfigTrainer, RunData};
pub use describe::policy_kind;
pub use finetune::FineTuning;
pub use lora_flags::{lora_flag, LoraFlags};
pub use overrides::Overrides;
pub use policy_flags::PolicyFlags;
pub use resolve::{Resolved, RunFlags};

/// Settings of the loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    /// Optimizer steps to run.
    pub steps: u64,
    /// Rows per micro-batch.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Seed of initialization.
    pub seed: u64,
    /// Global-norm clipping threshold (0 = off).
    pub grad_clip: f32,
    /// Learning-rate schedule.
    pub lr_schedule: LrSchedule,
    /// Evaluate on held-out data every this many steps (0 = only at the end).
    pub eval_every: u64,
    /// Batches per periodic evaluation: the first ones of the validation data, the same
    /// each time (the final evaluation reads all of it once, as `trainkit eval` does).
    pub eval_batches: usize,
    /// Start from the weights of this model directory instead of a random
    /// initialisation.
    pub init_from: Option<PathBuf>,
    /// Stop (saving the last good state) after this many consecutive steps with a
    /// non-finite loss or gradient norm (0 = never).
    pub max_bad_steps: u64,
    /// Update each parameter inside backward as soon as its gradient is complete, and
    /// free the gradient (see [`crate::TrainerOptions::optimizer_in_backward`]); needs one
    /// micro-batch per step and `grad_clip = 0`.
    pub optimizer_in_backward: bool,
    /// Move the activations the checkpoint policy keeps to host memory after forward and
    /// bring them back for backward (see
    /// [`crate::TrainerOptions::offload_activations`]); the policy must keep something.
    pub offload_activations: bool,
    /// ZeRO stage of a data-parallel job (see [`crate::TrainerOptions::zero_stage`]): 0
    /// (every rank keeps the whole optimizer state, as DDP), 1 (the optimizer state and
    /// master weights sharded across the ranks) or 2 (the gradients sharded too); one
    /// process alone ignores it.
    pub zero_stage: u8,
    /// Each micro-batch's gradients computed apart and added to the step's running sum
    /// (see [`crate::TrainerOptions::separate_accumulation`]).
    pub separate_accumulation: bool,
    /// Bytes of gradients per bucket summed across ranks while backward runs (see
    /// [`crate::TrainerOptions::bucket_bytes`]; 0: each gradient after backward).
    pub bucket_bytes: u64,
    /// How the head computes the loss: `fused` (the classifier product and the
    /// cross-entropy in chunks of positions, no `[tokens, vocab]` logits; the default) or
    /// `materialized` (the logits of every position, the reference).
    pub loss: LossPath,
    /// Positions per chunk of the fused loss; unset chooses from the vocabulary (chunk
    /// logits of about 32 MiB, at least 256 positions).
    pub loss_chunk: Option<usize>,
    /// How attention is computed: `fused` (tiles with an online softmax, no `[B, H, T, T]`
    /// tensor; the default) or `materialized` (the probabilities kept for backward, the
    /// reference).
    pub attention: AttentionPath,
    /// Let the GPU's f32 matrix products run on TF32 tensor cores (Hugging Face's `tf32`,
    /// PyTorch's `allow_tf32`): their inputs keep about 10 mantissa bits, their sums f32.
    /// The products of `fp32` training run several times faster; mixed precision's
    /// products are bf16 or fp16 already. No effect on the CPU.
    pub tf32: bool,
}

/// Where a run writes: checkpoints and the JSON-lines log.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    /// Model and trainer state are saved here (at the end, and every `save_every`
    /// steps); nothing is saved when unset.
    pub out: Option<PathBuf>,
    /// Save every this many steps (0 = only at the end).
    pub save_every: u64,
    /// One JSON object per optimizer step is appended to this file.
    pub log_json: Option<PathBuf>,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        TrainingConfig {
            steps: 500,
            batch_size: 16,
            seq_len: 128,
            seed: 1337,
            grad_clip: 1.0,
            lr_schedule: LrSchedule::Cosine {
                warmup_steps: 25,
                decay_steps: 0,
                min_lr_ratio: 0.1,
            },
            eval_every: 100,
            eval_batches: 4,
            init_from: None,
            max_bad_steps: 10,
            optimizer_in_backward: false,
            offload_activations: false,
            zero_stage: 0,
            separate_accumulation: false,
            bucket_bytes: crate::trainer::DEFAULT_BUCKET_BYTES as u64,
            loss: LossPath::Fused,
            loss_chunk: None,
            attention: AttentionPath::Fused,
            tf32: false,
        }
    }
}

/// A whole run: model, data, loop settings and the five policies.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The model's family and shape (`arch = "gpt2"`, the default, `"llama"`, `"qwen2"` or
    /// `"qwen3"`).
    #[serde(default)]
    pub model: ModelConfig,
    /// Training data.
    #[serde(default)]
    pub data: DataConfig,
    /// Loop settings.
    #[serde(default)]
    pub training: TrainingConfig,
    /// Checkpoints and logs.
    #[serde(default)]
    pub output: OutputConfig,
    /// Precision policy (`kind = "fp32"`, `"mixed_bf16"` or `"mixed_fp16"`).
    #[serde(default = "default_precision")]
    pub precision: Box<dyn Precision>,
    /// Checkpoint policy (`kind = "none"`, `"full"`, `"selective"` or `"budget"` with
    /// `bytes`).
    #[serde(default = "default_checkpoint")]
    pub checkpoint: Box<dyn CheckpointPolicy>,
    /// Optimizer (`kind = "adamw"`, `"adamw8bit"` or `"sgd"`).
    #[serde(default = "default_optimizer")]
    pub optimizer: Box<dyn Optimizer>,
    /// `[optimizer] offload = true`: the optimizer's side of the parameters (master
    /// weights, optimizer state) in host memory, the update on the CPU (see
    /// [`crate::TrainerOptions::optimizer_offload`]). Read from and written to the
    /// `[optimizer]` table by [`RunConfig::from_toml`] and [`RunConfig::to_toml`], beside
    /// the optimizer's own settings.
    #[serde(skip)]
    pub optimizer_offload: bool,
    /// Accumulation schedule (`kind = "constant"`, `"tokens_per_step"` or `"ramp"`).
    #[serde(default = "default_accumulation")]
    pub accumulation: Box<dyn AccumulationSchedule>,
    /// Memory observer (`kind = "peak_tracker"`, `"log"`, `"timeline"` or `"observers"`).
    #[serde(default = "default_observer")]
    pub observer: Box<dyn MemoryObserver>,
    /// Which parameters train (`kind = "lora"` with `rank`, `alpha`, `targets`; unset:
    /// every parameter, [`crate::adapter::FullFineTune`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<Box<dyn Adapter>>,
    /// Where the weights live (`kind = "resident"`, the default, or `"stream_frozen"`
    /// with `ahead`: the frozen base streamed from host memory, see
    /// [`crate::TrainerOptions::placement`]).
    #[serde(
        default = "crate::placement::resident",
        skip_serializing_if = "is_resident"
    )]
    pub placement: Box<dyn WeightPlacement>,
}

/// Whether `placement` is the default, [`crate::placement::Resident`] (left out of a
/// written config).
#[allow(clippy::borrowed_box)] // serde's `skip_serializing_if` passes the field itself
fn is_resident(placement: &Box<dyn WeightPlacement>) -> bool {
    crate::placement::is_resident(placement.as_ref())
}

/// `text` without the `offload` key of its `[optimizer]` table (which the optimizer's own
/// settings do not hold), and that key's value (false when absent). `text` itself when it
/// has none, so that parse errors point into the file as written.
fn take_offload(text: &str) -> Result<(String, bool)> {
    let Ok(mut table) = text.parse::<toml::Table>() else {
        // Not TOML: the full parse reports where.
        return Ok((text.to_string(), false));
    };
    let Some(toml::Value::Table(optimizer)) = table.get_mut("optimizer") else {
        return Ok((text.to_string(), false));
    };
    let Some(value) = optimizer.remove("offload") else {
        return Ok((text.to_string(), false));
    };
    let toml::Value::Boolean(offload) = value else {
        return Err(Error::config(
            "optimizer.offload",
            format!("must be true or false, not {value}"),
        ));
    };
    let text = toml::to_string(&table).map_err(|e| Error::Serde(format!("config: {e}")))?;
    Ok((text, offload))
}

fn default_precision() -> Box<dyn Precision> {
    Box::new(Fp32)
}
fn default_checkpoint() -> Box<dyn CheckpointPolicy> {
    Box::new(NoRecompute)
}
fn default_optimizer() -> Box<dyn Optimizer> {
    Box::new(AdamW {
        lr: 2e-3,
        ..AdamW::default()
    })
}
fn default_accumulation() -> Box<dyn AccumulationSchedule> {
    Box::new(Constant::new(1))
}
fn default_observer() -> Box<dyn MemoryObserver> {
    Box::new(PeakTracker::new())
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            model: ModelConfig::default(),
            data: DataConfig::default(),
            training: TrainingConfig::default(),
            output: OutputConfig::default(),
            precision: default_precision(),
            checkpoint: default_checkpoint(),
            optimizer: default_optimizer(),
            optimizer_offload: false,
            accumulation: default_accumulation(),
            observer: default_observer(),
            adapter: None,
            placement: crate::placement::resident(),
        }
    }
}

impl RunConfig {
    /// Parses a TOML document and validates it.
    pub fn from_toml(text: &str) -> Result<Self> {
        let (text, offload) = take_offload(text)?;
        let text = text.as_str();
        let mut cfg: RunConfig = toml::from_str(text).map_err(|e| {
            let message = e.message().trim().replace('\n', "; ");
            match e.span() {
                Some(span) => {
                    let before = &text[..span.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
                    let column = before.len() - line_start + 1;
                    let source = text[line_start..].lines().next().unwrap_or("").trim();
                    Error::Serde(format!(
                        "config: line {line}, column {column} (`{source}`): {message}"
                    ))
                }
                None => Error::Serde(format!("config: {message}")),
            }
        })?;
        cfg.optimizer_offload = offload;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_toml(&text).map_err(|e| match e {
            Error::Serde(m) => Error::Serde(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The config as TOML.
    pub fn to_toml(&self) -> Result<String> {
        let err = |e: &dyn std::fmt::Display| Error::Serde(format!("config: {e}"));
        if !self.optimizer_offload {
            return toml::to_string_pretty(self).map_err(|e| err(&e));
        }
        let mut table = toml::Table::try_from(self).map_err(|e| err(&e))?;
        if let Some(toml::Value::Table(o)) = table.get_mut("optimizer") {
            o.insert("offload".to_string(), toml::Value::Boolean(true));
        }
        toml::to_string_pretty(&table).map_err(|e| err(&e))
    }

    /// The model this run trains: `[model]` with `[training]`'s attention, loss path and
    /// chunk.
    pub fn build_model(&self) -> Result<Box<dyn Model>> {
        let t = &self.training;
        let model = self.model.build_with(t.attention, t.loss, t.loss_chunk)?;
        match &self.adapter {
            Some(a) => model.with_adapter(Arc::from(a.clone())),
            None => Ok(model),
        }
    }

    /// Checks values that parse but cannot run.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let t = &self.training;
        if t.batch_size == 0 {
            return Err(Error::config("training.batch_size", "must be at least 1"));
        }
        if t.seq_len == 0 || t.seq_len > self.model.context() {
            return Err(Error::config(
                "training.seq_len",
                format!(
                    "{} must be between 1 and the model's context {}; raise it \
                     (model.n_positions or model.max_position_embeddings, --n-positions) or \
                     shorten the sequences",
                    t.seq_len,
                    self.model.context()
                ),
            ));
        }
        if !(t.grad_clip >= 0.0 && t.grad_clip.is_finite()) {
            return Err(Error::config(
                "training.grad_clip",
                "must be a finite value >= 0 (0 turns clipping off)",
            ));
        }
        if t.eval_batches == 0 {
            return Err(Error::config("training.eval_batches", "must be at least 1"));
        }
        if !crate::trainer::ZERO_STAGES.contains(&t.zero_stage) {
            return Err(Error::config(
                "training.zero_stage (--zero)",
                format!(
                    "stage {} is not built; use 0 (DDP: every rank keeps the whole \
                     optimizer state), 1 (the optimizer state and master weights sharded \
                     across the ranks) or 2 (the gradients sharded too)",
                    t.zero_stage
                ),
            ));
        }
        crate::ops::LinearCrossEntropy::new("training.loss_chunk", t.loss_chunk)?;
        self.data.validate(self.model.vocab_size())
    }
}
