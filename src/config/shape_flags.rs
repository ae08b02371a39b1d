//! The flags that choose and shape a model trained from scratch (`--model`, `--arch`,
//! `--n-layer`, ...), and the one rule that lays them over a [`ModelConfig`].

use super::set;
use crate::error::{Error, Result};
use crate::model::{
    Gpt2Config, LlamaConfig, ModelConfig, Qwen2Config, Qwen3Config, Rope, RopeScaling,
};

/// The shape flags of `trainkit train`; `None` where a flag is absent. A model directory
/// (`--init-from`, `--resume`) fixes its own shape, which these may only repeat.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct ShapeFlags {
    /// A preset shape to train from scratch: gpt2, gpt2-medium, smollm2-135m, llama-3.2-1b,
    /// qwen2.5-0.5b, qwen3-0.6b, ... (the names `trainkit memory --model` takes); shape
    /// flags adjust it.
    #[arg(long)]
    pub model: Option<String>,
    /// Model family of a model from scratch: gpt2, llama, qwen2 or qwen3 (a directory's
    /// config.json names its own).
    #[arg(long)]
    pub arch: Option<String>,
    /// Layers (a model from scratch).
    #[arg(long)]
    pub n_layer: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub n_head: Option<usize>,
    /// Width of the residual stream.
    #[arg(long)]
    pub n_embd: Option<usize>,
    /// Vocabulary size (at least the tokenizer's: 50257 for gpt2, 256 for bytes).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Key/value heads of a Llama (grouped-query attention; --n-head for multi-head).
    #[arg(long)]
    pub n_kv_head: Option<usize>,
    /// Inner width of a Llama's SwiGLU MLP.
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Rotary embedding base θ of a Llama.
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Context length of a model from scratch (rows of its position embedding); by
    /// default the config's, raised to --seq-len when that is longer.
    #[arg(long)]
    pub n_positions: Option<usize>,
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

impl ShapeFlags {
    /// Whether no shape flag is given.
    pub fn is_empty(&self) -> bool {
        *self == ShapeFlags::default()
    }

    /// Lays the model flags over `model`: `--arch` switches the family (to a small model of
    /// it), the shape flags set the family's fields; a flag the family has no use for is an
    /// error naming the family that has it.
    pub fn apply(&self, model: &mut ModelConfig) -> Result<()> {
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
}
