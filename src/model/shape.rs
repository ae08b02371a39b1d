//! The one vocabulary of a decoder-only transformer's shape: everything a model family
//! differs by, from which the shared pre-norm block builder ([`super::decoder`]) makes
//! the parameters and the graph. A family's config (GPT-2's, Llama's, Qwen's, with
//! Hugging Face's field names) converts to a [`Shape`]; nothing else about the family is
//! needed to build, run or count it.

use super::{Architecture, Biases, Mlp, Norm, Rope};
use crate::ops::Heads;

/// How tokens learn their position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Positions {
    /// A learned position embedding of `context` rows added to the token embedding
    /// (GPT-2).
    Learned,
    /// Rotary embeddings of the queries and keys (Llama, Qwen), with their base and
    /// scaling.
    Rotary(Rope),
}

/// A decoder-only transformer: token embeddings (plus learned positions), `layers`
/// pre-norm blocks of attention and an MLP, a final norm and the output head.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Transformer layers.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads (fewer than `heads` for grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head, independent of `hidden / heads` (Qwen3: 128 where
    /// `hidden / heads` is 64).
    pub head_dim: usize,
    /// Inner width of the MLP.
    pub ffn: usize,
    /// Vocabulary size (the tokenizer's; the model's embedding and classifier hold
    /// [`Shape::padded_vocab`] rows).
    pub vocab: usize,
    /// Longest sequence.
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

    /// The architecture the estimates and autofit read.
    pub fn architecture(&self) -> Architecture {
        Architecture {
            layers: self.layers as u64,
            hidden: self.hidden as u64,
            heads: self.heads as u64,
            kv_heads: self.kv_heads as u64,
            head_dim: self.head_dim as u64,
            ffn: self.ffn as u64,
            vocab: self.vocab as u64,
            positions: match self.positions {
                Positions::Learned => self.context as u64,
                Positions::Rotary(_) => 0,
            },
            mlp: self.mlp,
            norm: self.norm,
            bias: self.bias,
            qk_norm: self.qk_norm,
            tied_embeddings: self.tied_embeddings,
        }
    }

    /// The rotary embedding, if positions are rotary.
    pub fn rope(&self) -> Option<&Rope> {
        match &self.positions {
            Positions::Rotary(r) => Some(r),
            Positions::Learned => None,
        }
    }
}
