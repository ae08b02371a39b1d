//! Command-line settings laid over a run config.

use super::{DataConfig, LoraFlags, RunConfig};
use crate::accumulate::{AccumulationSchedule, Constant};
use crate::data::TokenizerKind;
use crate::error::{Error, Result};
use crate::model::{
    Gpt2Config, LlamaConfig, ModelConfig, Qwen2Config, Qwen3Config, Rope, RopeScaling,
};
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
    /// `data.document_mask`.
    pub document_mask: Option<bool>,
    /// `data.separator_id` (and `data.document_mask` on).
    pub separator_id: Option<u32>,
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
    /// Keep master weights and optimizer state in host memory, the update on the CPU.
    pub optimizer_offload: Option<bool>,
    /// `fp32`, `bf16` or `fp16`.
    pub precision: Option<String>,
    /// `f32` or `none` (pure bf16, [`crate::precision::PureBf16`]).
    pub master_weights: Option<String>,
    /// `nearest`, `stochastic` or `kahan`: how a pure-bf16 update is rounded.
    pub update_rounding: Option<String>,
    /// `none`, `full`, `selective` or `budget:SIZE`.
    pub recompute: Option<String>,
    /// Offload the activations the recompute policy keeps to host memory.
    pub offload_activations: Option<bool>,
    /// `fused` or `materialized`.
    pub loss: Option<String>,
    /// Positions per chunk of the fused loss.
    pub loss_chunk: Option<usize>,
    /// `fused` or `materialized` attention.
    pub attention: Option<String>,
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
    /// Context length (GPT-2's `n_positions`, Llama's `max_position_embeddings`).
    pub n_positions: Option<usize>,
    /// A preset shape for a model from scratch (`gpt2`, `smollm2-135m`, `llama-3.2-1b`,
    /// ...; [`ModelConfig::preset`]).
    pub model: Option<String>,
    /// The model family of a model from scratch: `gpt2` or `llama`.
    pub arch: Option<String>,
    /// Key/value heads (Llama).
    pub n_kv_head: Option<usize>,
    /// Inner width of the MLP (Llama).
    pub ffn: Option<usize>,
    /// Rotary embedding base θ (Llama).
    pub rope_theta: Option<f64>,
    /// Evaluate every N steps.
    pub eval_every: Option<u64>,
    /// Save every N steps.
    pub save_every: Option<u64>,
    /// JSON-lines log file.
    pub log_json: Option<PathBuf>,
    /// The LoRA flags.
    pub lora: LoraFlags,
}

impl Overrides {
    /// Lays the LoRA flags over `cfg.adapter` ([`LoraFlags::lora`]). Errors name the
    /// flag.
    fn apply_lora(&self, cfg: &mut RunConfig) -> Result<()> {
        let current = cfg.adapter.as_ref().and_then(|a| a.as_lora());
        let fused_qkv = cfg.model.arch() == "gpt2";
        if let Some(lora) = self.lora.lora(current, fused_qkv)? {
            cfg.adapter = Some(Box::new(lora));
        }
        Ok(())
    }
}

/// A Llama of the default run's size: 4 layers, 128 wide, 4 query heads sharing 2
/// key/value heads, a SwiGLU MLP of 352, bytes, a context of 128, tied embeddings.
pub fn small_llama() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 128,
        intermediate_size: 352,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        vocab_size: 256,
        max_position_embeddings: 128,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        initializer_range: 0.02,
        rope: Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
    }
}

impl Overrides {
    /// Lays the model flags over `model`: `--arch` switches the family (to a small model of
    /// it), the shape flags set the family's fields; a flag the family has no use for is an
    /// error naming the family that has it.
    pub fn apply_model(&self, model: &mut ModelConfig) -> Result<()> {
        if let Some(name) = &self.model {
            *model = ModelConfig::preset(name).map_err(|e| e.for_field("--model"))?;
            if let Some(arch) = self.arch.as_deref().filter(|a| *a != model.arch()) {
                return Err(Error::config(
                    "--arch",
                    format!(
                        "`{arch}` contradicts --model {name}, a {} model",
                        model.arch()
                    ),
                ));
            }
        }
        match self.arch.as_deref() {
            None => {}
            Some(a) if a == model.arch() => {}
            Some("gpt2") => *model = ModelConfig::Gpt2(Gpt2Config::small_bytes()),
            Some("llama") => *model = ModelConfig::Llama(small_llama()),
            Some("qwen2") => {
                *model = ModelConfig::Qwen2(Qwen2Config {
                    base: small_llama(),
                })
            }
            Some("qwen3") => {
                *model = ModelConfig::Qwen3(Qwen3Config {
                    base: small_llama(),
                    attention_bias: false,
                })
            }
            Some(other) => {
                return Err(Error::config(
                    "--arch",
                    format!(
                        "`{other}` is not a model family trainkit builds; use {} ({})",
                        crate::model::families::names(" or "),
                        crate::model::families::list()
                    ),
                ))
            }
        }
        match model {
            ModelConfig::Gpt2(m) => {
                for (flag, given) in [
                    ("--n-kv-head", self.n_kv_head.is_some()),
                    ("--ffn", self.ffn.is_some()),
                    ("--rope-theta", self.rope_theta.is_some()),
                ] {
                    if given {
                        return Err(Error::config(
                            flag,
                            "shapes a Llama model; add --arch llama (GPT-2 has multi-head \
                             attention, an MLP of 4 × n_embd and learned positions)",
                        ));
                    }
                }
                set(&mut m.n_layer, self.n_layer);
                set(&mut m.n_head, self.n_head);
                set(&mut m.n_embd, self.n_embd);
                set(&mut m.vocab_size, self.vocab_size);
                set(&mut m.n_positions, self.n_positions);
            }
            ModelConfig::Llama(m)
            | ModelConfig::Qwen2(Qwen2Config { base: m })
            | ModelConfig::Qwen3(Qwen3Config { base: m, .. }) => {
                set(&mut m.num_hidden_layers, self.n_layer);
                set(&mut m.hidden_size, self.n_embd);
                set(&mut m.vocab_size, self.vocab_size);
                set(&mut m.max_position_embeddings, self.n_positions);
                set(&mut m.intermediate_size, self.ffn);
                if let Some(h) = self.n_head {
                    m.num_attention_heads = h;
                    // Heads that the key/value heads no longer divide become multi-head.
                    if h % m.num_key_value_heads.max(1) != 0 {
                        m.num_key_value_heads = h;
                    }
                }
                set(&mut m.num_key_value_heads, self.n_kv_head);
                if self.n_head.is_some() || self.n_embd.is_some() {
                    let heads = m.num_attention_heads.max(1);
                    if m.hidden_size % heads != 0 {
                        return Err(Error::config(
                            "--n-embd",
                            format!(
                                "{} is not divisible by {heads} heads; use a multiple of {heads}",
                                m.hidden_size
                            ),
                        ));
                    }
                    m.head_dim = m.hidden_size / heads;
                }
                if let Some(theta) = self.rope_theta {
                    if !(theta > 1.0 && theta.is_finite()) {
                        return Err(Error::config(
                            "--rope-theta",
                            format!("{theta} must be a finite value > 1"),
                        ));
                    }
                    m.rope.theta = theta;
                }
            }
        }
        Ok(())
    }

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
        if self.document_mask.is_some() || self.separator_id.is_some() {
            cfg.data
                .set_document_mask(self.document_mask.unwrap_or(true), self.separator_id)?;
        }
        let t = &mut cfg.training;
        set(&mut t.init_from, self.init_from.clone().map(Some));
        set(&mut t.steps, self.steps);
        set(&mut t.batch_size, self.batch_size);
        set(&mut t.seq_len, self.seq_len);
        set(&mut t.grad_clip, self.grad_clip);
        set(&mut t.optimizer_in_backward, self.optimizer_in_backward);
        set(&mut t.offload_activations, self.offload_activations);
        set(&mut t.seed, self.seed);
        set(&mut cfg.optimizer_offload, self.optimizer_offload);
        set(&mut t.eval_every, self.eval_every);
        set(&mut cfg.output.out, self.out.clone().map(Some));
        set(&mut cfg.output.save_every, self.save_every);
        set(&mut cfg.output.log_json, self.log_json.clone().map(Some));
        self.apply_model(&mut cfg.model)?;
        self.apply_lora(cfg)?;
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
