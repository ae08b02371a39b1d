//! Command-line settings laid over a run config.

use super::{set, DataConfig, DocumentFlags, LoraFlags, PolicyFlags, RunConfig, ShapeFlags};
use crate::accumulate::{AccumulationSchedule, Constant};
use crate::data::TokenizerKind;
use crate::error::{Error, Result};
use crate::optim::{LrSchedule, Optimizer};

use std::path::PathBuf;

/// Settings that override a [`RunConfig`]: the flags of `trainkit train` (parsed by clap
/// from these fields); `None` leaves the config's value.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct Overrides {
    /// Training data: an llm.c token file (from `trainkit prepare`), a glob of shards
    /// (quote it: 'data/fineweb_train_*.bin'), a directory of shards, or a UTF-8 text file
    /// tokenized on the fly.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Validation data for token files (a file, glob or directory); by default the `_val`
    /// shards beside --data.
    #[arg(long)]
    pub val_data: Option<PathBuf>,
    /// Visit shards and batches in a random order drawn from --seed, new every epoch.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub shuffle: Option<bool>,
    /// `--document-mask` and `--separator-id`.
    #[command(flatten)]
    pub documents: DocumentFlags,
    /// Tokenizer of the data: gpt2, bytes, or a Hugging Face tokenizer.json (or a model
    /// directory that holds one), copied into --out with its tokenizer_config.json and
    /// chat_template.jinja (default: --init-from's tokenizer.json when it has one, else
    /// bytes for text files and gpt2 for token files).
    #[arg(long)]
    pub tokenizer: Option<TokenizerKind>,
    /// Start from the weights of a model directory (trainkit's or transformers'
    /// save_pretrained), or of a Hugging Face model id (org/name, org/name@revision) in
    /// the local Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub),
    /// downloaded into it when missing; the model's shape comes from it.
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Save the model and trainer state here (at the end and every --save-every steps); a
    /// LoRA run saves its adapter (PEFT's adapter_config.json and
    /// adapter_model.safetensors), not a copy of the base.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Optimizer steps, counted from the start of training (a resumed run stops there).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Passes over the training data instead of --steps (fractions allowed; Hugging
    /// Face's num_train_epochs): the steps are E × the data's micro-batches a pass ÷
    /// (--grad-accum × ranks), rounded up, counted from the start of training.
    #[arg(long, value_name = "E", conflicts_with = "steps")]
    pub epochs: Option<f64>,
    /// Rows per micro-batch.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Tokens per row.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Base learning rate.
    #[arg(long)]
    pub lr: Option<f32>,
    /// constant or cosine.
    #[arg(long)]
    pub lr_schedule: Option<String>,
    /// Steps of linear learning-rate warmup.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Decoupled weight decay of the optimizer.
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Global gradient-norm clipping threshold (0 = off).
    #[arg(long)]
    pub grad_clip: Option<f32>,
    /// ZeRO stage under mpirun: 0 (every rank keeps the whole optimizer state, as DDP),
    /// 1 (each rank keeps and updates its share of the optimizer state and master
    /// weights, then sends the updated weights to the others; bitwise the same training)
    /// or 2 (as 1, and each rank keeps only its share of the gradients: every
    /// micro-batch's are summed in buckets during backward and the others' freed).
    #[arg(long, value_name = "STAGE")]
    pub zero: Option<u8>,
    /// Compute each micro-batch's gradients apart and add them to the step's running sum
    /// once complete, as PyTorch accumulates and data-parallel ranks sum: one process
    /// accumulating 2 micro-batches then takes bitwise the step of 2 ranks.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub separate_accumulation: Option<bool>,
    /// On a GPU, let f32 matrix products run on TF32 tensor cores (their inputs rounded
    /// to about 10 mantissa bits, as PyTorch's allow_tf32 and Hugging Face's --tf32):
    /// `fp32` training's products several times faster. Off by default.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub tf32: Option<bool>,
    /// Under mpirun: gradients summed across the ranks in buckets of SIZE (25MiB by
    /// default; 512KiB, 1GB, bytes) while backward goes on; 0 sums each gradient after
    /// backward. The sums are the same.
    #[arg(long, value_name = "SIZE")]
    pub bucket_size: Option<String>,
    /// Initialisation seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Evaluate on held-out data every N steps (0 = only at the end).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Save every N steps (0 = only at the end); needs --out.
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Append one JSON object per optimizer step to this file.
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// The policy flags (`--precision`, `--recompute`, `--optimizer`, ...).
    #[command(flatten)]
    pub policy: PolicyFlags,
    /// The shape flags of a model from scratch (`--model`, `--arch`, `--n-layer`, ...).
    #[command(flatten)]
    pub shape: ShapeFlags,
    /// The LoRA flags.
    #[command(flatten)]
    pub lora: LoraFlags,
}

impl Overrides {
    /// Lays the LoRA flags over `cfg.adapter` ([`LoraFlags::lora`]). Errors name the
    /// flag.
    fn apply_lora(&self, cfg: &mut RunConfig) -> Result<()> {
        let current = cfg.adapter.as_ref().and_then(|a| a.as_lora());
        let modules = cfg.model.family().projection_modules();
        if let Some(lora) = self.lora.lora(current, &modules)? {
            cfg.adapter = Some(Box::new(lora));
        }
        Ok(())
    }
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
        self.documents.apply(&mut cfg.data)?;
        let t = &mut cfg.training;
        set(&mut t.init_from, self.init_from.clone().map(Some));
        set(&mut t.steps, self.steps);
        set(&mut t.batch_size, self.batch_size);
        set(&mut t.seq_len, self.seq_len);
        set(&mut t.grad_clip, self.grad_clip);
        set(&mut t.seed, self.seed);
        set(&mut t.zero_stage, self.zero);
        set(&mut t.separate_accumulation, self.separate_accumulation);
        set(&mut t.tf32, self.tf32);
        if let Some(size) = self.bucket_size.as_deref().map(str::trim) {
            // 0 turns the buckets off; any other size is a size.
            t.bucket_bytes = match size {
                "0" => 0,
                size => crate::estimate::parse_bytes(size).map_err(|e| match e {
                    Error::Config { message, .. } => Error::config(
                        "--bucket-size",
                        format!("{message} (or 0: each gradient after backward)"),
                    ),
                    other => other,
                })?,
            };
        }
        set(&mut t.eval_every, self.eval_every);
        set(&mut cfg.output.out, self.out.clone().map(Some));
        set(&mut cfg.output.save_every, self.save_every);
        set(&mut cfg.output.log_json, self.log_json.clone().map(Some));
        cfg.model.reshape(&self.shape)?;
        self.apply_lora(cfg)?;
        self.policy.apply(cfg)?;
        if let Some(k) = self.grad_accum {
            if k == 0 {
                return Err(Error::config("--grad-accum", "must be at least 1"));
            }
            cfg.accumulation = Box::new(Constant::new(k)) as Box<dyn AccumulationSchedule>;
        }
        let warmup = self
            .warmup_steps
            .unwrap_or(cfg.training.lr_schedule.warmup_steps());
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

/// Sets `field` of any optimizer through its serialized form, so an optimizer from
/// another crate takes `--lr` the moment it has an `lr` field.
pub(super) fn set_optimizer_field(
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, FromArgMatches};

    fn parse(args: &[&str]) -> std::result::Result<Overrides, clap::Error> {
        let cmd = Overrides::augment_args(clap::Command::new("train"));
        let matches =
            cmd.try_get_matches_from(std::iter::once("train").chain(args.iter().copied()))?;
        Overrides::from_arg_matches(&matches)
    }

    #[test]
    fn flags_parse_into_their_groups_and_a_switch_only_turns_on() {
        assert_eq!(parse(&[]).unwrap(), Overrides::default());
        let o = parse(&[
            "--shuffle",
            "--steps",
            "3",
            "--optimizer-in-backward",
            "--recompute",
            "full",
            "--n-layer",
            "2",
            "--lora-rank",
            "8",
            "--lora-targets",
            "q_proj,v_proj",
            "--qlora",
        ])
        .unwrap();
        assert_eq!(o.shuffle, Some(true));
        assert_eq!(o.documents.document_mask, None);
        assert_eq!(o.steps, Some(3));
        assert_eq!(o.policy.optimizer_in_backward, Some(true));
        assert_eq!(o.policy.offload_activations, None);
        assert_eq!(o.policy.recompute.as_deref(), Some("full"));
        assert_eq!(o.shape.n_layer, Some(2));
        assert_eq!(o.lora.rank, Some(8));
        assert_eq!(
            o.lora.targets.as_deref(),
            Some(&["q_proj".to_string(), "v_proj".to_string()][..])
        );
        assert!(o.lora.qlora && !o.lora.use_dora);
        // A switch takes no value: it cannot turn a config's setting off.
        assert!(parse(&["--shuffle=false"]).is_err());
        assert!(parse(&["--optimizer-offload", "false"]).is_err());
    }
}
