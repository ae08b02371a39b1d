//! The one description of a decoder-only transformer's shape: what builds a model
//! ([`super::build`]), what the playbook's formulas, the presets and autofit read, and
//! what a model's config file converts to and from.

use crate::error::{Error, Result};
use crate::estimate::formulas::{add, mul, playbook_params, ActivationShape};
use crate::model::Gpt2Config;
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

/// A decoder-only transformer: embeddings, `layers` pre-norm blocks of attention (with
/// grouped-query attention when `kv_heads < heads`) and an MLP, a final norm and the
/// output head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Architecture {
    /// Transformer layers `L`.
    pub layers: u64,
    /// Width of the residual stream `h`.
    pub hidden: u64,
    /// Attention (query) heads `a`.
    pub heads: u64,
    /// Key and value heads (`heads` for multi-head attention, fewer for grouped-query).
    pub kv_heads: u64,
    /// Width of one attention head (`hidden / heads` unless a family says otherwise).
    pub head_dim: u64,
    /// Inner width of the MLP.
    pub ffn: u64,
    /// Vocabulary size `v`.
    pub vocab: u64,
    /// Rows of a learned position embedding (0 for rotary or no position parameters).
    pub positions: u64,
    /// The MLP's form.
    pub mlp: Mlp,
    /// The normalisation layers.
    pub norm: Norm,
    /// Which linear projections carry biases.
    pub bias: Biases,
    /// Whether each query and key head is RMS-normalised before attention (Qwen3).
    pub qk_norm: bool,
    /// Whether the output head shares the token embedding.
    pub tied_embeddings: bool,
}

impl Architecture {
    /// A GPT-2 style model of the given size, as the playbook's formula assumes:
    /// multi-head attention, a GELU MLP of width `4h`, LayerNorms, biases, tied
    /// embeddings, and no learned position embedding.
    pub fn gpt(layers: u64, hidden: u64, heads: u64, vocab: u64) -> Self {
        Architecture {
            layers,
            hidden,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads.max(1),
            ffn: hidden.saturating_mul(4),
            vocab,
            positions: 0,
            mlp: Mlp::Gelu,
            norm: Norm::LayerNorm,
            bias: Biases::ALL,
            qk_norm: false,
            tied_embeddings: true,
        }
    }

    /// Checks that the shape is buildable; errors name the field and what would be valid.
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

    /// Width of one attention head.
    pub fn head_dim(&self) -> u64 {
        self.head_dim
    }

    /// The exact number of parameters of this architecture (validated first).
    pub fn exact_params(&self) -> Result<u64> {
        self.validate()?;
        let what = "params";
        let (h, f) = (self.hidden, self.ffn);
        let q = mul(self.head_dim, self.heads, what)?;
        let kv = mul(self.head_dim, self.kv_heads, what)?;
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
        let attn = add(attn, bias(self.qk_norm, mul(2, self.head_dim, what)?), what)?;
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
        let embed = mul(self.vocab, h, what)?;
        let head = if self.tied_embeddings { 0 } else { embed };
        let mut total = add(embed, head, what)?;
        total = add(total, mul(self.positions, h, what)?, what)?;
        total = add(total, mul(self.layers, layer, what)?, what)?;
        add(total, norm, what)
    }

    /// Parameters by the playbook's formula `h·v + L·(12h² + 13h) + 2h` (exact for a
    /// GPT-2 without position embeddings, an approximation for other architectures).
    pub fn playbook_params(&self) -> Result<u64> {
        playbook_params(self.layers, self.hidden, self.vocab)
    }

    /// The dimensions of activation memory for `micro_batch` sequences of `seq_len` tokens.
    pub fn activation_shape(&self, seq_len: u64, micro_batch: u64) -> ActivationShape {
        ActivationShape {
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            seq_len,
            micro_batch,
        }
    }
}

impl From<&Gpt2Config> for Architecture {
    fn from(c: &Gpt2Config) -> Self {
        Architecture {
            positions: c.n_positions as u64,
            ..Architecture::gpt(
                c.n_layer as u64,
                c.n_embd as u64,
                c.n_head as u64,
                c.vocab_size as u64,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpt_without_positions_is_the_playbook_formula() {
        for (l, h, a, v) in [
            (12, 768, 12, 50257),
            (2, 64, 4, 256),
            (80, 8192, 64, 128256),
        ] {
            let arch = Architecture::gpt(l, h, a, v);
            assert!(arch.is_gpt_like());
            assert_eq!(
                arch.exact_params().unwrap(),
                arch.playbook_params().unwrap()
            );
        }
    }

    #[test]
    fn trainkit_gpt2_counts_agree() {
        for config in [Gpt2Config::gpt2_124m(), Gpt2Config::small_bytes()] {
            let shapes: usize = config
                .param_shapes()
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            let exact = Architecture::from(&config).exact_params().unwrap();
            assert_eq!(exact, config.num_params() as u64);
            // The stored shapes hold the vocabulary padded to a multiple of 64 rows.
            let shape = crate::model::Family::shape(&config);
            let padding = (shape.padded_vocab() - shape.vocab) * shape.hidden;
            assert_eq!(exact + padding as u64, shapes as u64);
        }
    }

    #[test]
    fn a_gpt2_config_round_trips_and_other_shapes_are_refused_by_name() {
        let c = Gpt2Config::gpt2_124m();
        assert_eq!(Gpt2Config::from_architecture(&c.architecture()).unwrap(), c);
        assert!(crate::model::build(&c.architecture(), 1024).is_ok());
        let llama = crate::estimate::preset("llama-1b").unwrap().architecture;
        let e = Gpt2Config::from_architecture(&llama)
            .unwrap_err()
            .to_string();
        for what in ["grouped-query attention", "MLP", "norm", "no biases"] {
            assert!(e.contains(what), "{e}");
        }
        let built = crate::model::build(&llama, 4096).unwrap();
        assert!(
            built.describe().starts_with("llama"),
            "{}",
            built.describe()
        );
        // A GPT-2 block with RMSNorm is neither model.
        let mixed = Architecture {
            norm: Norm::RmsNorm,
            ..Architecture::gpt(2, 64, 4, 256)
        };
        let e = crate::model::build(&mixed, 64).err().unwrap().to_string();
        assert!(e.contains("SwiGLU") && e.contains("biases"), "{e}");
        let no_positions = Architecture::gpt(2, 64, 4, 256);
        let e = Gpt2Config::from_architecture(&no_positions)
            .unwrap_err()
            .to_string();
        assert!(e.contains("position"), "{e}");
    }

    #[test]
    fn invalid_shapes_are_errors() {
        let ok = Architecture::gpt(2, 64, 4, 256);
        for bad in [
            Architecture { layers: 0, ..ok },
            Architecture { hidden: 66, ..ok },
            Architecture { kv_heads: 3, ..ok },
            Architecture { kv_heads: 8, ..ok },
            Architecture { vocab: 0, ..ok },
        ] {
            assert!(bad.exact_params().is_err(), "{bad:?}");
        }
        assert!(Architecture::gpt(2, 1 << 40, 1, 1 << 40)
            .exact_params()
            .is_err());
    }
}
