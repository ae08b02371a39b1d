//! GPT-2 with Hugging Face semantics: pre-norm blocks, learned positions, GELU (tanh),
//! LayerNorm eps 1e-5, tied input and output embeddings, no dropout.

use super::exec;
use super::graph::{
    attention_node, attention_stats, overridden, Graph, OpOverride, Section, Value,
};
use super::{Architecture, Batch, Init, Mlp, Model, Norm, ParamInit, Pass, PassStats};
use crate::checkpoint::Tags;
use crate::device::Heads;
use crate::error::{Error, Result};
use crate::ops::{
    AttentionPath, Classifier, LayerNorm, LearnedEmbedding, Linear, LinearCrossEntropy, LinearGelu,
    LinearResidual, LossPath,
};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;

/// GPT-2's shape, with the field names of Hugging Face's `GPT2Config`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpt2Config {
    /// Transformer layers.
    pub n_layer: usize,
    /// Attention heads per layer.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Longest sequence (rows of the position embedding).
    pub n_positions: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f32,
}

fn default_eps() -> f32 {
    1e-5
}

impl Gpt2Config {
    /// Every parameter's Hugging Face name and shape, in model order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (e, v, p) = (self.n_embd, self.vocab_size, self.n_positions);
        let mut out = vec![
            ("transformer.wte.weight".to_string(), vec![v, e]),
            ("transformer.wpe.weight".to_string(), vec![p, e]),
        ];
        for i in 0..self.n_layer {
            let h = |s: &str| format!("transformer.h.{i}.{s}");
            out.extend([
                (h("ln_1.weight"), vec![e]),
                (h("ln_1.bias"), vec![e]),
                (h("attn.c_attn.weight"), vec![e, 3 * e]),
                (h("attn.c_attn.bias"), vec![3 * e]),
                (h("attn.c_proj.weight"), vec![e, e]),
                (h("attn.c_proj.bias"), vec![e]),
                (h("ln_2.weight"), vec![e]),
                (h("ln_2.bias"), vec![e]),
                (h("mlp.c_fc.weight"), vec![e, 4 * e]),
                (h("mlp.c_fc.bias"), vec![4 * e]),
                (h("mlp.c_proj.weight"), vec![4 * e, e]),
                (h("mlp.c_proj.bias"), vec![e]),
            ]);
        }
        out.push(("transformer.ln_f.weight".to_string(), vec![e]));
        out.push(("transformer.ln_f.bias".to_string(), vec![e]));
        out
    }

    /// GPT-2 small (124M): 12 layers, 12 heads, 768 wide, 1024 positions, vocab 50257.
    pub fn gpt2_124m() -> Self {
        Gpt2Config {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            n_positions: 1024,
            vocab_size: 50257,
            layer_norm_epsilon: 1e-5,
        }
    }

    /// The default model of `trainkit train`: a byte-level model that learns the built-in
    /// corpus in a couple of minutes on two CPU cores.
    pub fn small_bytes() -> Self {
        Gpt2Config {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            n_positions: 128,
            vocab_size: 256,
            layer_norm_epsilon: 1e-5,
        }
    }

    /// Checks that the shape is buildable; errors name the field and what would be valid.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.n_embd", self.n_embd),
            ("model.n_positions", self.n_positions),
            ("model.vocab_size", self.vocab_size),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(Error::config(field, "must be at least 1"));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(Error::config(
                "model.n_embd",
                format!(
                    "{} is not divisible by n_head = {}; use a multiple of {}",
                    self.n_embd, self.n_head, self.n_head
                ),
            ));
        }
        if !(self.layer_norm_epsilon > 0.0 && self.layer_norm_epsilon.is_finite()) {
            return Err(Error::config(
                "model.layer_norm_epsilon",
                "must be a finite value > 0",
            ));
        }
        Ok(())
    }

    /// The architecture this config describes.
    pub fn architecture(&self) -> Architecture {
        Architecture::from(self)
    }

    /// The GPT-2 config of `arch`, if it is GPT-2 shaped: multi-head attention, a GELU MLP
    /// of width 4h, LayerNorms, biases, tied embeddings and learned positions (LayerNorm
    /// eps 1e-5). Otherwise an error naming what differs.
    pub fn from_architecture(arch: &Architecture) -> Result<Self> {
        arch.validate()?;
        let mut differs = Vec::new();
        if arch.kv_heads != arch.heads {
            differs.push("grouped-query attention");
        }
        if arch.mlp != Mlp::Gelu || arch.ffn != arch.hidden.saturating_mul(4) {
            differs.push("an MLP other than GELU of width 4 × hidden");
        }
        if arch.norm != Norm::LayerNorm {
            differs.push("a norm other than LayerNorm");
        }
        if !arch.biases {
            differs.push("no biases");
        }
        if !arch.tied_embeddings {
            differs.push("an untied output head");
        }
        if arch.positions == 0 {
            differs.push("no learned position embedding");
        }
        if !differs.is_empty() {
            return Err(Error::config(
                "model",
                format!(
                    "a GPT-2 model has none of: {} (a Llama-shaped model takes RMSNorm, a \
                     SwiGLU MLP and no biases)",
                    differs.join(", ")
                ),
            ));
        }
        let size = |field: &str, v: u64| {
            usize::try_from(v).map_err(|_| Error::config(field, format!("{v} is too large")))
        };
        let config = Gpt2Config {
            n_layer: size("model.n_layer", arch.layers)?,
            n_head: size("model.n_head", arch.heads)?,
            n_embd: size("model.n_embd", arch.hidden)?,
            n_positions: size("model.n_positions", arch.positions)?,
            vocab_size: size("model.vocab_size", arch.vocab)?,
            layer_norm_epsilon: default_eps(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Number of parameters (embeddings tied, so counted once).
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        self.vocab_size * c + self.n_positions * c + l * (12 * c * c + 13 * c) + 2 * c
    }
}

/// GPT-2, trainable on any backend with any checkpoint policy and precision: its config,
/// its parameters and its graph of op nodes, run by the executor ([`super::exec`]).
#[derive(Debug)]
pub struct Gpt2 {
    config: Gpt2Config,
    loss: LossPath,
    loss_chunk: Option<usize>,
    attention: AttentionPath,
    overrides: Vec<Arc<dyn OpOverride>>,
    graph: Graph,
}

impl Clone for Gpt2 {
    fn clone(&self) -> Self {
        Gpt2 {
            config: self.config.clone(),
            loss: self.loss,
            loss_chunk: self.loss_chunk,
            attention: self.attention,
            overrides: self.overrides.clone(),
            graph: self.build_graph(),
        }
    }
}

impl PartialEq for Gpt2 {
    fn eq(&self, other: &Self) -> bool {
        self.config == other.config
            && self.loss == other.loss
            && self.loss_chunk == other.loss_chunk
            && self.attention == other.attention
            && self.overrides.len() == other.overrides.len()
            && self
                .overrides
                .iter()
                .zip(&other.overrides)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }
}

impl Gpt2 {
    /// A GPT-2 of the given shape (validated), with the fused attention
    /// ([`crate::ops::FlashAttention`]) and the fused loss ([`LinearCrossEntropy`], chunks
    /// chosen from the vocabulary).
    pub fn new(config: Gpt2Config) -> Result<Self> {
        config.validate()?;
        let attention = AttentionPath::Fused;
        let graph = graph(
            &config,
            Head::Fused(LinearCrossEntropy::default()),
            attention,
        );
        Ok(Gpt2 {
            config,
            loss: LossPath::Fused,
            loss_chunk: None,
            attention,
            overrides: Vec::new(),
            graph,
        })
    }

    /// The same model with its attention computed by `path`: fused (the default) or the
    /// materialized `[B, H, T, T]` probabilities.
    pub fn with_attention(mut self, path: AttentionPath) -> Self {
        self.attention = path;
        self.graph = self.build_graph();
        self
    }

    /// How attention is computed.
    pub fn attention_path(&self) -> AttentionPath {
        self.attention
    }

    /// The same model with some of its op nodes replaced by `o` (see [`OpOverride`]): a
    /// fused op or a variant of your own, run in place of trainkit's. The model keeps the
    /// override and applies it whenever it rebuilds its graph.
    pub fn with_override(mut self, o: impl OpOverride + 'static) -> Self {
        self.overrides.push(Arc::new(o));
        self.graph = self.build_graph();
        self
    }

    /// The graph of this model's config, attention and loss paths, with its overrides.
    fn build_graph(&self) -> Graph {
        overridden(
            graph(&self.config, self.head(), self.attention),
            &self.overrides,
        )
    }

    /// The same model with its loss computed by `path`: the fused linear cross-entropy
    /// in chunks of `chunk` positions (`None`: chosen from the vocabulary), or the
    /// materialized logits (where `chunk` is ignored). A chunk of 0 is an error naming
    /// `training.loss_chunk`.
    pub fn with_loss(mut self, path: LossPath, chunk: Option<usize>) -> Result<Self> {
        LinearCrossEntropy::new("training.loss_chunk", chunk)?;
        self.loss = path;
        self.loss_chunk = chunk;
        self.graph = self.build_graph();
        Ok(self)
    }

    /// How the loss is computed, and the fused loss's configured chunk.
    pub fn loss_path(&self) -> (LossPath, Option<usize>) {
        (self.loss, self.loss_chunk)
    }

    fn head(&self) -> Head {
        match self.loss {
            LossPath::Fused => Head::Fused(LinearCrossEntropy {
                chunk: self.loss_chunk,
            }),
            LossPath::Materialized => Head::Materialized,
        }
    }

    /// The shape.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// The graph of op nodes the executor runs.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        batch.check(self.config.n_positions, "n_positions")
    }
}

/// GPT-2's graph: learned token and position embeddings; per layer a pre-norm attention
/// block (layer norm, fused qkv projection, causal attention, output projection added to
/// the residual) and a pre-norm MLP block (layer norm, projection with GELU, projection
/// added to the residual); the final norm and the classifier tied to the token embedding,
/// fused with the loss or producing the logits (`head_kind`); attention fused or
/// materialized (`attention`).
fn graph(c: &Gpt2Config, head_kind: Head, attention: AttentionPath) -> Graph {
    let names: HashMap<String, usize> = c
        .param_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, _))| (name, i))
        .collect();
    let p = |name: &str| names[name];
    let (wte, wpe) = (p("transformer.wte.weight"), p("transformer.wpe.weight"));
    let eps = c.layer_norm_epsilon;
    let conv1d = LinearResidual {
        bias: true,
        transposed: false,
    };

    let mut embedding = Section::new(Value::new("tokens", "tokens", Tags::NONE));
    let x = embedding.value("input", "h.0.input", Tags::LAYER_INPUT);
    embedding.node(LearnedEmbedding, &[], &[x], &[wte, wpe]);
    embedding.output = x;

    let layers = (0..c.n_layer)
        .map(|l| {
            let h = |s: &str| p(&format!("transformer.h.{l}.{s}"));
            let label = |s: &str| format!("h.{l}.{s}");
            let (attn, mlp) = (Tags::ATTENTION, Tags::MLP);
            let mut s = Section::new(Value::new("input", label("input"), Tags::LAYER_INPUT));
            let input = 0;
            let ln1_out = s.value("ln1_out", label("ln1_out"), attn | Tags::NORM_OUT);
            let ln1_stats = s.value("ln1_stats", label("ln1_stats"), attn | Tags::NORM_STATS);
            let qkv = s.value("qkv", label("qkv"), attn | Tags::PROJECTION);
            let stats = attention_stats(&mut s, attention, &format!("h.{l}"));
            let attn_out = s.value("attn_out", label("attn_out"), attn);
            let residual = s.value("residual", label("residual"), Tags::RESIDUAL);
            let ln2_out = s.value("ln2_out", label("ln2_out"), mlp | Tags::NORM_OUT);
            let ln2_stats = s.value("ln2_stats", label("ln2_stats"), mlp | Tags::NORM_STATS);
            let fc_out = s.value(
                "fc_out",
                label("fc_out"),
                mlp | Tags::WIDE | Tags::PROJECTION,
            );
            let gelu_out = s.value("gelu_out", label("gelu_out"), mlp | Tags::WIDE);
            let next = if l + 1 < c.n_layer {
                format!("h.{}.input", l + 1)
            } else {
                "ln_f.input".to_string()
            };
            let output = s.value("output", next, Tags::LAYER_INPUT);
            s.node(
                LayerNorm { eps },
                &[input],
                &[ln1_out, ln1_stats],
                &[h("ln_1.weight"), h("ln_1.bias")],
            );
            s.node(
                Linear {
                    bias: true,
                    transposed: false,
                },
                &[ln1_out],
                &[qkv],
                &[h("attn.c_attn.weight"), h("attn.c_attn.bias")],
            );
            let heads = Heads::mha(c.n_head, c.n_embd);
            attention_node(&mut s, attention, heads, qkv, stats, attn_out);
            s.node(
                conv1d,
                &[input, attn_out],
                &[residual],
                &[h("attn.c_proj.weight"), h("attn.c_proj.bias")],
            );
            s.node(
                LayerNorm { eps },
                &[residual],
                &[ln2_out, ln2_stats],
                &[h("ln_2.weight"), h("ln_2.bias")],
            );
            s.node(
                LinearGelu { transposed: false },
                &[ln2_out],
                &[fc_out, gelu_out],
                &[h("mlp.c_fc.weight"), h("mlp.c_fc.bias")],
            );
            s.node(
                conv1d,
                &[residual, gelu_out],
                &[output],
                &[h("mlp.c_proj.weight"), h("mlp.c_proj.bias")],
            );
            s.output = output;
            s
        })
        .collect();

    let mut head = Section::new(Value::new("input", "ln_f.input", Tags::NONE));
    let out = head.value("out", "ln_f.out", Tags::NORM_OUT);
    let stats = head.value("stats", "ln_f.stats", Tags::NORM_STATS);
    head.node(
        LayerNorm { eps },
        &[0],
        &[out, stats],
        &[p("transformer.ln_f.weight"), p("transformer.ln_f.bias")],
    );
    match head_kind {
        Head::Fused(loss) => {
            head.node(loss, &[out], &[], &[wte]);
            head.output = out;
        }
        Head::Materialized => {
            let logits = head.value("logits", "logits", Tags::NONE);
            head.node(Classifier, &[out], &[logits], &[wte]);
            head.output = logits;
        }
    }

    Graph {
        embedding,
        layers,
        head,
    }
}

/// The end of the head: the fused loss, or the classifier's logits.
#[derive(Clone, Copy, Debug)]
enum Head {
    Fused(LinearCrossEntropy),
    Materialized,
}

impl Model for Gpt2 {
    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "gpt2: {} layers, {} heads, {} wide, vocab {}, context {} ({:.2}M parameters)",
            c.n_layer,
            c.n_head,
            c.n_embd,
            c.vocab_size,
            c.n_positions,
            c.num_params() as f64 / 1e6
        )
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.config.n_positions
    }

    fn init_params(&self) -> Vec<ParamInit> {
        let std = 0.02;
        // GPT-2 scales the residual projections by 1/√(2·n_layer).
        let proj_std = 0.02 / ((2 * self.config.n_layer) as f64).sqrt();
        self.config
            .param_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let init = if name.ends_with("c_proj.weight") {
                    Init::Normal { std: proj_std }
                } else if name.ends_with("ln_1.weight")
                    || name.ends_with("ln_2.weight")
                    || name.ends_with("ln_f.weight")
                {
                    Init::Constant(1.0)
                } else if name.ends_with(".bias") {
                    Init::Constant(0.0)
                } else {
                    Init::Normal { std }
                };
                ParamInit { name, shape, init }
            })
            .collect()
    }

    fn forward_backward(
        &self,
        pass: &mut Pass<'_>,
        batch: &Batch,
        grad_scale: f32,
        losses: &mut Tensor,
    ) -> Result<PassStats> {
        self.check_batch(batch)?;
        let vocab = self.config.vocab_size;
        exec::forward_backward(&self.graph, pass, batch, vocab, grad_scale, losses)
    }

    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<f64> {
        self.check_batch(batch)?;
        exec::loss(&self.graph, pass, batch, self.config.vocab_size)
    }

    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
        self.check_batch(batch)?;
        exec::logits(&self.graph, pass, batch)
    }

    fn write_config(&self, dir: &std::path::Path) -> Result<()> {
        crate::save::write_hf_config(&dir.join(crate::save::CONFIG_FILE), &self.config)
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let c = &self.config;
        6.0 * c.num_params() as f64 + 6.0 * (c.n_layer * c.n_embd * seq_len) as f64
    }
}
