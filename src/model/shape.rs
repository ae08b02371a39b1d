//! The one description of a decoder-only transformer's shape: everything a model family
//! differs by, from which the shared pre-norm block builder ([`super::decoder`]) makes
//! the parameters and the graph, and what the memory formulas, the presets and autofit
//! read. A family's config (GPT-2's, Llama's, Qwen's, with Hugging Face's field names)
//! converts to a [`Shape`] ([`super::Family::shape`]) and from one (the family's
//! `from_shape`, [`super::families::from_shape`]); nothing else about the family is needed
//! to build, run or count it.

use super::Rope;
use crate::error::{Error, Result};
use crate::estimate::formulas::{add, mul, playbook_params, ActivationShape};
use crate::ops::Heads;
use serde::{Deserialize, Serialize};

/// The feed-forward block of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mlp {
    /// Two matrices, `h×ffn` and `ffn×h`, around a GELU (GPT-2).
    Gelu,
    /// Three matrices of `h×ffn` (gate, up, down) around a SiLU-gated product (Llama).
    SwiGlu,
    /// Three matrices of `h×ffn` around a GELU-gated product (the tanh GELU: Gemma).
    GeGlu,
}

/// The normalisation layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    /// LayerNorm with a weight and a bias (`2h` parameters).
    LayerNorm,
    /// RMSNorm with a weight only (`h` parameters).
    RmsNorm,
}

/// Which linear projections carry a bias.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Biases {
    /// The query, key and value projections (GPT-2, Qwen2).
    pub qkv: bool,
    /// The attention output projection (GPT-2).
    pub o: bool,
    /// The MLP's projections (GPT-2).
    pub mlp: bool,
}

impl Biases {
    /// Every projection with a bias (GPT-2).
    pub const ALL: Biases = Biases {
        qkv: true,
        o: true,
        mlp: true,
    };
    /// No biases at all (Llama, Qwen3).
    pub const NONE: Biases = Biases {
        qkv: false,
        o: false,
        mlp: false,
    };
    /// Biases on the query, key and value projections only (Qwen2).
    pub const QKV: Biases = Biases {
        qkv: true,
        o: false,
        mlp: false,
    };

    /// Whether any projection carries a bias.
    pub fn any(&self) -> bool {
        self.qkv || self.o || self.mlp
    }
}

/// How tokens learn their position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Positions {
    /// A learned position embedding of `context` rows added to the token embedding
    /// (GPT-2).
    Learned,
    /// Rotary embeddings of the queries and keys (Llama, Qwen), with their base and
    /// scaling.
    Rotary(Rope),
    /// No position parameters at all: the GPT the playbook's formula counts. No family
    /// builds it; the memory estimates of raw dimensions start from it.
    None,
}

/// A decoder-only transformer: token embeddings (plus learned positions), `layers`
/// pre-norm blocks of attention (grouped-query when `kv_heads < heads`) and an MLP, a
/// final norm and the output head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// Transformer layers `L`.
    pub layers: usize,
    /// Width of the residual stream `h`.
    pub hidden: usize,
    /// Query heads `a`.
    pub heads: usize,
    /// Key and value heads (fewer than `heads` for grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head, independent of `hidden / heads` (Qwen3: 128 where
    /// `hidden / heads` is 64).
    pub head_dim: usize,
    /// Inner width of the MLP.
    pub ffn: usize,
    /// Vocabulary size `v` (the tokenizer's; the model's embedding and classifier hold
    /// [`Shape::padded_vocab`] rows).
    pub vocab: usize,
    /// Longest sequence (rows of a learned position embedding).
    pub context: usize,
    /// The normalisation layers.
    pub norm: Norm,
    /// Their epsilon.
    pub norm_eps: f64,
    /// Whether RMS norm gains are stored as their offset from 1 (`x · rstd · (1 + w)`,
    /// gains initialised to 0: Gemma).
    pub norm_offset: bool,
    /// How positions enter.
    pub positions: Positions,
    /// The MLP's form.
    pub mlp: Mlp,
    /// Which projections carry biases.
    pub bias: Biases,
    /// Whether each query and key head is RMS-normalised (over `head_dim`, one gain per
    /// query heads and one per key heads) before the rotary embedding (Qwen3).
    pub qk_norm: bool,
    /// Whether the output head shares the token embedding.
    pub tied_embeddings: bool,
    /// A constant the token embedding is multiplied by before the first layer (Gemma:
    /// `√hidden`); `None` for none.
    pub embedding_scale: Option<f32>,
    /// Standard deviation of the normal initialisation of weights.
    pub init_std: f64,
    /// Whether the residual projections (attention output, MLP down) start with
    /// `init_std / √(2·layers)` (GPT-2).
    pub scaled_residual_init: bool,
}

/// The embedding and the classifier hold the vocabulary rounded up to a multiple of
/// this many rows (llm.c's 50304 for GPT-2's 50257), so the classifier's products have
/// an aligned leading dimension; the padding rows stay zero and their logits never reach
/// the loss, sampling or saved files.
pub const VOCAB_MULTIPLE: usize = 64;

impl Shape {
    /// GPT-2's block at the given size: multi-head attention, a GELU MLP of width `4h`,
    /// LayerNorms (eps 1e-5) with biases, tied embeddings, learned positions of `context`
    /// rows, GPT-2's initialisation.
    pub const fn gpt(
        layers: usize,
        hidden: usize,
        heads: usize,
        vocab: usize,
        context: usize,
    ) -> Shape {
        Shape {
            layers,
            hidden,
            heads,
            kv_heads: heads,
            head_dim: match hidden.checked_div(heads) {
                Some(d) => d,
                None => 0,
            },
            ffn: hidden.saturating_mul(4),
            vocab,
            context,
            norm: Norm::LayerNorm,
            // GPT-2's config holds its epsilon as an f32.
            norm_eps: 1e-5_f32 as f64,
            norm_offset: false,
            positions: Positions::Learned,
            mlp: Mlp::Gelu,
            bias: Biases::ALL,
            qk_norm: false,
            tied_embeddings: true,
            embedding_scale: None,
            init_std: 0.02,
            scaled_residual_init: true,
        }
    }

    /// Rows of the token embedding and the classifier: [`Shape::vocab`] rounded up to a
    /// multiple of [`VOCAB_MULTIPLE`].
    pub fn padded_vocab(&self) -> usize {
        self.vocab.div_ceil(VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    }

    /// The heads of each attention layer.
    pub fn heads(&self) -> Heads {
        Heads {
            n_head: self.heads,
            n_kv_head: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Output width of the MLP's first product: `2·ffn` for a gated MLP (gate rows
    /// first), `ffn` otherwise.
    pub fn up_width(&self) -> usize {
        match self.mlp {
            Mlp::Gelu => self.ffn,
            Mlp::SwiGlu | Mlp::GeGlu => 2 * self.ffn,
        }
    }

    /// The rotary embedding, if positions are rotary.
    pub fn rope(&self) -> Option<&Rope> {
        match &self.positions {
            Positions::Rotary(r) => Some(r),
            Positions::Learned | Positions::None => None,
        }
    }

    /// Rows of the learned position embedding: the context, or 0 without one.
    pub fn position_rows(&self) -> usize {
        match self.positions {
            Positions::Learned => self.context,
            Positions::Rotary(_) | Positions::None => 0,
        }
    }

    /// The shape trainkit builds to run sequences of `seq_len` tokens: a model without a
    /// position table (rotary) takes a context of `seq_len`; one with a table keeps it.
    pub fn for_length(&self, seq_len: usize) -> Shape {
        match self.positions {
            Positions::Learned => *self,
            Positions::Rotary(_) | Positions::None => Shape {
                context: seq_len,
                ..*self
            },
        }
    }

    /// Checks that the shape can be counted; errors name the field and what would be
    /// valid. (Building checks more: [`super::families::from_shape`].)
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(Error::config(field, "must be at least 1"));
            }
        }
        if self.hidden % self.heads != 0 {
            return Err(Error::config(
                "hidden",
                format!(
                    "{} is not divisible by heads = {}; use a multiple of {}",
                    self.hidden, self.heads, self.heads
                ),
            ));
        }
        if self.kv_heads > self.heads || self.heads % self.kv_heads != 0 {
            return Err(Error::config(
                "kv_heads",
                format!(
                    "{} does not divide heads = {}; use a divisor of {} (equal for multi-head \
                     attention)",
                    self.kv_heads, self.heads, self.heads
                ),
            ));
        }
        Ok(())
    }

    /// Whether the playbook's GPT-style layer describes this model exactly: multi-head
    /// attention, a GELU MLP of width `4h`, LayerNorms and biases (the position embedding
    /// and tying do not matter for activations).
    pub fn is_gpt_like(&self) -> bool {
        self.kv_heads == self.heads
            && self.ffn == self.hidden.saturating_mul(4)
            && self.mlp == Mlp::Gelu
            && self.norm == Norm::LayerNorm
            && self.bias == Biases::ALL
            && !self.qk_norm
            && self.head_dim.saturating_mul(self.heads) == self.hidden
    }

    /// The exact number of parameters (validated first; the vocabulary unpadded, a tied
    /// head counted once).
    pub fn exact_params(&self) -> Result<u64> {
        self.validate()?;
        let what = "params";
        let n = |v: usize| v as u64;
        let (h, f) = (n(self.hidden), n(self.ffn));
        let head_dim = n(self.head_dim);
        let q = mul(head_dim, n(self.heads), what)?;
        let kv = mul(head_dim, n(self.kv_heads), what)?;
        let bias = |on: bool, n: u64| if on { n } else { 0 };
        let norm = match self.norm {
            Norm::LayerNorm => mul(2, h, what)?,
            Norm::RmsNorm => h,
        };
        // Attention: query h×q, key and value h×kv each, output q×h.
        let attn = add(
            mul(2, mul(h, q, what)?, what)?,
            mul(2, mul(h, kv, what)?, what)?,
            what,
        )?;
        let attn = add(
            attn,
            add(
                bias(self.bias.qkv, add(q, mul(2, kv, what)?, what)?),
                bias(self.bias.o, h),
                what,
            )?,
            what,
        )?;
        let attn = add(attn, bias(self.qk_norm, mul(2, head_dim, what)?), what)?;
        let mlp = match self.mlp {
            Mlp::Gelu => add(
                mul(2, mul(h, f, what)?, what)?,
                bias(self.bias.mlp, add(f, h, what)?),
                what,
            )?,
            Mlp::SwiGlu | Mlp::GeGlu => add(
                mul(3, mul(h, f, what)?, what)?,
                bias(self.bias.mlp, add(mul(2, f, what)?, h, what)?),
                what,
            )?,
        };
        let layer = add(add(attn, mlp, what)?, mul(2, norm, what)?, what)?;
        let embed = mul(n(self.vocab), h, what)?;
        let head = if self.tied_embeddings { 0 } else { embed };
        let mut total = add(embed, head, what)?;
        total = add(total, mul(n(self.position_rows()), h, what)?, what)?;
        total = add(total, mul(n(self.layers), layer, what)?, what)?;
        add(total, norm, what)
    }

    /// Parameters by the playbook's formula `h·v + L·(12h² + 13h) + 2h` (exact for a
    /// GPT-2 without position embeddings, an approximation for other shapes).
    pub fn playbook_params(&self) -> Result<u64> {
        playbook_params(self.layers as u64, self.hidden as u64, self.vocab as u64)
    }

    /// The dimensions of activation memory for `micro_batch` sequences of `seq_len` tokens.
    pub fn activation_shape(&self, seq_len: u64, micro_batch: u64) -> ActivationShape {
        ActivationShape {
            layers: self.layers as u64,
            hidden: self.hidden as u64,
            heads: self.heads as u64,
            seq_len,
            micro_batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Family, FamilyConfig, Gpt2Config, LlamaConfig, Qwen2Config, Qwen3Config};

    #[test]
    fn a_gpt_without_positions_is_the_playbook_formula() {
        for (l, h, a, v) in [
            (12, 768, 12, 50257),
            (2, 64, 4, 256),
            (80, 8192, 64, 128256),
        ] {
            let shape = Shape::gpt(l, h, a, v, 1024);
            assert!(shape.is_gpt_like());
            let none = Shape {
                positions: Positions::None,
                ..shape
            };
            assert_eq!(
                none.exact_params().unwrap(),
                none.playbook_params().unwrap()
            );
            assert_eq!(
                shape.exact_params().unwrap() - none.exact_params().unwrap(),
                1024 * h as u64
            );
        }
    }

    #[test]
    fn the_count_is_what_the_model_declares() {
        let families: Vec<Box<dyn crate::model::AnyFamily>> = vec![
            Box::new(Gpt2Config::gpt2_124m()),
            Box::new(Gpt2Config::small_bytes()),
            Box::new(LlamaConfig::small()),
            Box::new(Qwen2Config {
                base: LlamaConfig::small(),
            }),
            Box::new(Qwen3Config {
                base: LlamaConfig::small(),
                attention_bias: true,
            }),
        ];
        for family in families {
            let shape = family.shape();
            let declared: usize = family
                .param_shapes()
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            // The stored shapes hold the vocabulary padded to a multiple of 64 rows.
            let rows = if shape.tied_embeddings { 1 } else { 2 };
            let padding = rows * (shape.padded_vocab() - shape.vocab) * shape.hidden;
            let exact = shape.exact_params().unwrap();
            assert_eq!(exact + padding as u64, declared as u64, "{shape:?}");
        }
        let gpt2 = Gpt2Config::gpt2_124m();
        assert_eq!(
            gpt2.shape().exact_params().unwrap(),
            gpt2.num_params() as u64
        );
    }

    #[test]
    fn every_family_config_round_trips_through_its_shape() {
        let mut qwen3 = Qwen3Config {
            base: LlamaConfig::small(),
            attention_bias: false,
        };
        qwen3.base.rms_norm_eps = 1e-6;
        let configs = [
            crate::model::ModelConfig::from(Gpt2Config::gpt2_124m()),
            Gpt2Config {
                layer_norm_epsilon: 1e-6,
                ..Gpt2Config::small_bytes()
            }
            .into(),
            LlamaConfig::small().into(),
            crate::model::ModelConfig::preset("llama-3.2-1b").unwrap(),
            Qwen2Config::qwen2_5_0_5b().into(),
            qwen3.into(),
        ];
        for config in configs {
            let back = crate::model::families::from_shape(&config.shape()).unwrap();
            assert_eq!(back, config);
        }
    }

    #[test]
    fn shapes_no_family_builds_are_refused_by_name() {
        let llama = crate::estimate::preset("llama-1b").unwrap().shape;
        let e = Gpt2Config::from_shape(&llama).unwrap_err().to_string();
        for what in ["grouped-query attention", "MLP", "norm", "no biases"] {
            assert!(e.contains(what), "{e}");
        }
        let built = crate::model::build(&llama).unwrap();
        assert!(
            built.describe().starts_with("llama"),
            "{}",
            built.describe()
        );
        // A GPT-2 block with RMSNorm is neither model.
        let mixed = Shape {
            norm: Norm::RmsNorm,
            ..Shape::gpt(2, 64, 4, 256, 64)
        };
        let e = crate::model::build(&mixed).err().unwrap().to_string();
        assert!(e.contains("SwiGLU") && e.contains("biases"), "{e}");
        let no_positions = Shape {
            positions: Positions::None,
            ..Shape::gpt(2, 64, 4, 256, 64)
        };
        let e = crate::model::build(&no_positions)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no learned position") && e.contains("rotary"),
            "{e}"
        );
        // Another initialisation is not GPT-2's.
        let e = Gpt2Config::from_shape(&Shape {
            init_std: 0.01,
            ..Shape::gpt(2, 64, 4, 256, 64)
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("initialisation"), "{e}");
    }

    #[test]
    fn a_rotary_shape_takes_the_length_it_runs() {
        let llama = crate::estimate::preset("llama-1b").unwrap().shape;
        assert_eq!(llama.for_length(4096).context, 4096);
        let gpt2 = Shape::gpt(2, 64, 4, 256, 64);
        assert_eq!(gpt2.for_length(32), gpt2);
        assert_eq!(gpt2.position_rows(), 64);
        assert_eq!(llama.position_rows(), 0);
    }

    #[test]
    fn invalid_shapes_are_errors() {
        let ok = Shape::gpt(2, 64, 4, 256, 64);
        for bad in [
            Shape { layers: 0, ..ok },
            Shape { hidden: 66, ..ok },
            Shape { kv_heads: 3, ..ok },
            Shape { kv_heads: 8, ..ok },
            Shape { vocab: 0, ..ok },
        ] {
            assert!(bad.exact_params().is_err(), "{bad:?}");
        }
        assert!(Shape::gpt(2, 1 << 40, 1, 1 << 40, 1)
            .exact_params()
            .is_err());
    }
}
