//! The Llama family with Hugging Face `LlamaForCausalLM` semantics (Llama 2 and 3,
//! SmolLM2, TinyLlama): pre-norm blocks with RMSNorm, rotary position embeddings
//! (rotate-half), grouped-query attention, a SwiGLU MLP, no biases, a tied or untied
//! output head, no dropout. Its config is [`LlamaConfig`]; the model is the shared
//! [`Decoder`] with the family's default (Llama) names.

use super::shape_flags::set;
use super::{
    Biases, Decoder, Family, FamilyConfig, LlamaConfig, Mlp, Norm, Positions, Shape, ShapeFlags,
};
use crate::error::{Error, Result};
use crate::ops::Heads;
use serde_json::json;
use std::path::Path;

/// A Llama-family model, trainable on any backend with any checkpoint policy and
/// precision.
pub type Llama = Decoder<LlamaConfig>;

impl Family for LlamaConfig {
    const MODEL_TYPE: &'static str = "llama";

    fn reshape(&mut self, flags: &ShapeFlags) -> Result<()> {
        set(&mut self.num_hidden_layers, flags.n_layer);
        set(&mut self.hidden_size, flags.n_embd);
        set(&mut self.vocab_size, flags.vocab_size);
        set(&mut self.max_position_embeddings, flags.n_positions);
        set(&mut self.intermediate_size, flags.ffn);
        if let Some(h) = flags.n_head {
            self.num_attention_heads = h;
            // Heads that the key/value heads no longer divide become multi-head.
            if h % self.num_key_value_heads.max(1) != 0 {
                self.num_key_value_heads = h;
            }
        }
        set(&mut self.num_key_value_heads, flags.n_kv_head);
        if flags.n_head.is_some() || flags.n_embd.is_some() {
            let heads = self.num_attention_heads.max(1);
            if self.hidden_size % heads != 0 {
                return Err(Error::config(
                    "--n-embd",
                    format!(
                        "{} is not divisible by {heads} heads; use a multiple of {heads}",
                        self.hidden_size
                    ),
                ));
            }
            self.head_dim = self.hidden_size / heads;
        }
        if let Some(theta) = flags.rope_theta {
            if !(theta > 1.0 && theta.is_finite()) {
                return Err(Error::config(
                    "--rope-theta",
                    format!("{theta} must be a finite value > 1"),
                ));
            }
            self.rope.theta = theta;
        }
        Ok(())
    }

    fn shape(&self) -> Shape {
        Shape {
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            ffn: self.intermediate_size,
            vocab: self.vocab_size,
            context: self.max_position_embeddings,
            norm: Norm::RmsNorm,
            norm_eps: self.rms_norm_eps,
            norm_offset: false,
            positions: Positions::Rotary(self.rope),
            mlp: Mlp::SwiGlu,
            bias: Biases::NONE,
            qk_norm: false,
            tied_embeddings: self.tie_word_embeddings,
            embedding_scale: None,
            init_std: self.initializer_range,
            scaled_residual_init: false,
        }
    }

    fn validate(&self) -> Result<()> {
        LlamaConfig::validate(self)?;
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(Error::config(
                    format!("model.{field}"),
                    "must be at least 1",
                ));
            }
        }
        Ok(())
    }

    /// A transformers `LlamaConfig` (`LlamaForCausalLM`): the rope parameters in both
    /// transformers 5's `rope_parameters` and 4.x's `rope_theta` and `rope_scaling`, so
    /// either version loads it.
    fn hf_config(&self) -> serde_json::Value {
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
        });
        super::llama_config::write_rope(&mut v, &self.rope);
        v
    }
}

impl LlamaConfig {
    /// The heads of each attention layer.
    pub fn heads(&self) -> Heads {
        self.shape().heads()
    }

    /// Every parameter's name and shape in model order, with the fused projections
    /// (`self_attn.qkv_proj.weight`, `mlp.gate_up_proj.weight`); `lm_head.weight` last
    /// when the head is untied.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        super::decoder::param_shapes(self)
    }

    /// The number of parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        super::decoder::num_params(&self.shape())
    }
}

impl FamilyConfig for LlamaConfig {
    const MODELS: &'static str = "Llama, SmolLM2, TinyLlama";

    fn read_config(_: &Path, text: &str) -> Result<Self> {
        LlamaConfig::from_json(text)
    }

    /// The Llama config of `shape`, if it is Llama shaped: RMSNorm, a SwiGLU MLP, no
    /// biases, no q/k norm and rotary positions (its rotary embedding, norm epsilon,
    /// initialisation and context carried over); otherwise an error naming what differs.
    fn from_shape(shape: &Shape) -> Result<Self> {
        shape.validate()?;
        let mut differs = Vec::new();
        if shape.mlp != Mlp::SwiGlu {
            differs.push("an MLP other than SwiGLU");
        }
        if shape.norm != Norm::RmsNorm || shape.norm_offset {
            differs.push("a norm other than RMSNorm");
        }
        if shape.bias.any() {
            differs.push("biases");
        }
        if shape.qk_norm {
            differs.push("a per-head q/k norm");
        }
        let rope = match shape.positions {
            Positions::Rotary(rope) => Some(rope),
            Positions::Learned => {
                differs.push("a learned position embedding");
                None
            }
            Positions::None => {
                differs.push("no rotary embedding");
                None
            }
        };
        if shape.embedding_scale.is_some() {
            differs.push("a scaled token embedding");
        }
        if shape.scaled_residual_init {
            differs.push("scaled residual initialisation");
        }
        let Some(rope) = rope.filter(|_| differs.is_empty()) else {
            return Err(Error::config(
                "model",
                format!("a Llama model has none of: {}", differs.join(", ")),
            ));
        };
        let config = LlamaConfig {
            hidden_size: shape.hidden,
            intermediate_size: shape.ffn,
            num_hidden_layers: shape.layers,
            num_attention_heads: shape.heads,
            num_key_value_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            vocab_size: shape.vocab,
            max_position_embeddings: shape.context,
            rms_norm_eps: shape.norm_eps,
            tie_word_embeddings: shape.tied_embeddings,
            initializer_range: shape.init_std,
            rope,
        };
        config.validate()?;
        Ok(config)
    }

    fn small() -> Self {
        LlamaConfig::small()
    }

    fn set_context(&mut self, context: usize) {
        self.max_position_embeddings = context;
    }
}
