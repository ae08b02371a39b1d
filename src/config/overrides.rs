//! Command-line settings laid over a run config.

use super::{DataConfig, RunConfig};
use crate::accumulate::{AccumulationSchedule, Constant};
use crate::data::TokenizerKind;
use crate::error::{Error, Result};
use crate::optim::{LrSchedule, Optimizer};

use std::path::PathBuf;

/// Settings that override a [`RunConfig`] (the `trainkit train` flags); `None` leaves the
/// config's value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overrides {
    /// Training data: an llm.c token file, a glob or directory of shards, or a text file.
    pub data: Option<PathBuf>,
    /// Validation data (a token file, glob or directory) for token-file data.
    pub val_data: Option<PathBuf>,
    /// Shuffle the training batches (`Some(true)`), or not.
    pub shuffle: Option<bool>,
    /// Tokenizer for text data (and the one token files were made with).
    pub tokenizer: Option<TokenizerKind>,
    /// Model directory to start from.
    pub init_from: Option<PathBuf>,
    /// Where to save.
    pub out: Option<PathBuf>,
    /// Optimizer steps, counted from the start of training.
    pub steps: Option<u64>,
    /// Rows per micro-batch.
    pub batch_size: Option<usize>,
    /// Tokens per row.
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step (a constant schedule).
    pub grad_accum: Option<usize>,
    /// Base learning rate.
    pub lr: Option<f32>,
    /// `constant` or `cosine`.
    pub lr_schedule: Option<String>,
    /// Warmup steps of the schedule.
    pub warmup_steps: Option<u64>,
    /// The optimizer's weight decay.
    pub weight_decay: Option<f32>,
    /// `adamw`, `adamw8bit` or `sgd` (settings the two share are kept).
    pub optimizer: Option<String>,
    /// Clipping threshold (0 = off).
    pub grad_clip: Option<f32>,
    /// Run the optimizer inside backward.
    pub optimizer_in_backward: Option<bool>,
    /// `fp32` or `bf16`.
    pub precision: Option<String>,
    /// `none`, `full` or `selective`.
    pub recompute: Option<String>,
    /// Initialisation seed.
    pub seed: Option<u64>,
    /// Layers (a model from scratch).
    pub n_layer: Option<usize>,
    /// Heads.
    pub n_head: Option<usize>,
    /// Width.
    pub n_embd: Option<usize>,
    /// Vocabulary.
    pub vocab_size: Option<usize>,
    /// Context length (rows of the position embedding).
    pub n_positions: Option<usize>,
    /// Evaluate every N steps.
    pub eval_every: Option<u64>,
    /// Save every N steps.
    pub save_every: Option<u64>,
    /// JSON-lines log file.
    pub log_json: Option<PathBuf>,
}

impl Overrides {
    /// Lays the settings over `cfg`, then validates it.
    pub fn apply(&self, cfg: &mut RunConfig) -> Result<()> {
        if let Some(path) = &self.data {
            cfg.data = DataConfig::from_path(path, self.tokenizer.clone());
        } else if let Some(kind) = self.tokenizer.clone() {
            match &mut cfg.data {
                DataConfig::Text { tokenizer, .. } | DataConfig::Tokens { tokenizer, .. } => {
                    *tokenizer = kind
                }
                DataConfig::Builtin { .. } => {
                    return Err(Error::config(
                        "--tokenizer",
                        "the built-in corpus is byte tokens; --tokenizer applies to --data \
                         files",
                    ))
                }
            }
        }
        if let Some(path) = &self.val_data {
            match &mut cfg.data {
                DataConfig::Tokens { val, .. } => *val = Some(path.clone()),
                _ => {
                    return Err(Error::config(
                        "--val-data",
                        "applies to token-file data (--data FILE.bin, a glob or a directory); \
                         text data holds out its last tenth",
                    ))
                }
            }
        }
        if let Some(on) = self.shuffle {
            match &mut cfg.data {
                DataConfig::Tokens { shuffle, .. } | DataConfig::Text { shuffle, .. } => {
                    *shuffle = on
                }
                DataConfig::Builtin { .. } if !on => {}
                DataConfig::Builtin { .. } => {
                    return Err(Error::config(
                        "--shuffle",
                        "applies to --data files; the built-in corpus is generated in order",
                    ))
                }
            }
        }
        let t = &mut cfg.training;
        set(&mut t.init_from, self.init_from.clone().map(Some));
        set(&mut t.steps, self.steps);
        set(&mut t.batch_size, self.batch_size);
        set(&mut t.seq_len, self.seq_len);
        set(&mut t.grad_clip, self.grad_clip);
        set(&mut t.optimizer_in_backward, self.optimizer_in_backward);
        set(&mut t.seed, self.seed);
        set(&mut t.eval_every, self.eval_every);
        set(&mut cfg.output.out, self.out.clone().map(Some));
        set(&mut cfg.output.save_every, self.save_every);
        set(&mut cfg.output.log_json, self.log_json.clone().map(Some));
        let m = &mut cfg.model;
        set(&mut m.n_layer, self.n_layer);
        set(&mut m.n_head, self.n_head);
        set(&mut m.n_embd, self.n_embd);
        set(&mut m.vocab_size, self.vocab_size);
        set(&mut m.n_positions, self.n_positions);
        if let Some(k) = self.grad_accum {
            if k == 0 {
                return Err(Error::config("--grad-accum", "must be at least 1"));
            }
            cfg.accumulation = Box::new(Constant::new(k)) as Box<dyn AccumulationSchedule>;
        }
        if let Some(p) = &self.precision {
            cfg.precision =
                crate::precision::named(p, false).map_err(|e| e.for_field("--precision"))?;
        }
        if let Some(r) = &self.recompute {
            cfg.checkpoint = crate::checkpoint::named(r).map_err(|e| e.for_field("--recompute"))?;
        }
        let warmup_now = match cfg.training.lr_schedule {
            LrSchedule::Constant { warmup_steps } | LrSchedule::Cosine { warmup_steps, .. } => {
                warmup_steps
            }
        };
        let warmup = self.warmup_steps.unwrap_or(warmup_now);
        if let Some(s) = &self.lr_schedule {
            cfg.training.lr_schedule = match s.as_str() {
                "constant" => LrSchedule::Constant {
                    warmup_steps: warmup,
                },
                "cosine" => match cfg.training.lr_schedule {
                    LrSchedule::Cosine {
                        decay_steps,
                        min_lr_ratio,
                        ..
                    } => LrSchedule::Cosine {
                        warmup_steps: warmup,
                        decay_steps,
                        min_lr_ratio,
                    },
                    LrSchedule::Constant { .. } => LrSchedule::Cosine {
                        warmup_steps: warmup,
                        decay_steps: 0,
                        min_lr_ratio: 0.1,
                    },
                },
                other => {
                    return Err(Error::config(
                        "--lr-schedule",
                        format!("`{other}` is not a schedule; use constant or cosine"),
                    ))
                }
            };
        } else if self.warmup_steps.is_some() {
            match &mut cfg.training.lr_schedule {
                LrSchedule::Constant { warmup_steps } | LrSchedule::Cosine { warmup_steps, .. } => {
                    *warmup_steps = warmup
                }
            }
        }
        if let Some(name) = &self.optimizer {
            cfg.optimizer = crate::optim::switch_to(name, cfg.optimizer.as_ref())
                .map_err(|e| e.for_field("--optimizer"))?;
        }
        if let Some(lr) = self.lr {
            if !(lr > 0.0 && lr.is_finite()) {
                return Err(Error::config(
                    "--lr",
                    format!("{lr} must be a positive number"),
                ));
            }
            cfg.optimizer = set_optimizer_field(&cfg.optimizer, "lr", "--lr", lr)?;
        }
        if let Some(wd) = self.weight_decay {
            if !(wd >= 0.0 && wd.is_finite()) {
                return Err(Error::config(
                    "--weight-decay",
                    format!("{wd} must be a number >= 0"),
                ));
            }
            cfg.optimizer =
                set_optimizer_field(&cfg.optimizer, "weight_decay", "--weight-decay", wd)?;
        }
        cfg.validate()
    }
}

fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *slot = v;
    }
}

/// Sets `field` of any optimizer through its serialized form, so an optimizer from
/// another crate takes `--lr` the moment it has an `lr` field.
fn set_optimizer_field(
    opt: &dyn Optimizer,
    field: &str,
    flag: &str,
    value: f32,
) -> Result<Box<dyn Optimizer>> {
    let mut v = serde_json::to_value(opt).map_err(|e| Error::Serde(e.to_string()))?;
    let kind = v
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("?")
        .to_string();
    match v.get_mut(field) {
        Some(slot) => *slot = serde_json::json!(value),
        None => {
            return Err(Error::config(
                flag,
                format!("the `{kind}` optimizer has no `{field}` setting"),
            ))
        }
    }
    serde_json::from_value(v).map_err(|e| Error::Serde(e.to_string()))
}
