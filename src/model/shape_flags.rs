//! The flags that choose and shape a model trained from scratch (`--model`, `--arch`,
//! `--n-layer`, ...). `ModelConfig::reshape` lays them over a config, each family over its
//! own fields (`Family::reshape`).

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

impl ShapeFlags {
    /// The first flag given that sets a dimension (`--n-layer`, ..., `--n-positions`;
    /// not `--model` or `--arch`), if any.
    pub fn first_given(&self) -> Option<&'static str> {
        [
            ("--n-layer", self.n_layer.is_some()),
            ("--n-head", self.n_head.is_some()),
            ("--n-embd", self.n_embd.is_some()),
            ("--vocab-size", self.vocab_size.is_some()),
            ("--n-kv-head", self.n_kv_head.is_some()),
            ("--ffn", self.ffn.is_some()),
            ("--rope-theta", self.rope_theta.is_some()),
            ("--n-positions", self.n_positions.is_some()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }
}

/// Sets `slot` to `value` when a flag gives one.
pub(crate) fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *slot = v;
    }
}
