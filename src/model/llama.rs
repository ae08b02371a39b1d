//! Llama with Hugging Face `LlamaForCausalLM` semantics: pre-norm blocks with RMSNorm,
//! rotary position embeddings (rotate-half), grouped-query attention, a SwiGLU MLP, no
//! biases, a tied or untied output head, no dropout.
//!
//! The query, key and value projections run as one product over a fused weight
//! `self_attn.qkv_proj.weight` (`[(H + 2·KV)·D, C]`, q rows first), and the gate and up
//! projections as one over `mlp.gate_up_proj.weight` (`[2F, C]`, gate rows first): one
//! larger matrix product each, as Megatron-LM and vLLM run them. Files hold Hugging Face's
//! separate `q_proj`, `k_proj`, `v_proj`, `gate_proj` and `up_proj`
//! ([`Llama::export_tensors`], [`Llama::import_tensors`]).

use super::exec;
use super::graph::{
    attention_node, attention_stats, overridden, Graph, OpOverride, Section, Value,
};
use super::{Architecture, Batch, Init, LlamaConfig, Mlp, Model, Norm, ParamInit, Pass};
use super::{PassStats, Rope, RopeScaling};
use crate::checkpoint::Tags;
use crate::device::Heads;
use crate::error::{Error, Result};
use crate::ops::{
    AttentionPath, Classifier, Linear, LinearCrossEntropy, LinearResidual, LossPath, RmsNorm,
    Rope as RopeOp, SwiGlu, TokenEmbedding,
};
use crate::save::NamedTensor;
use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// The fused projections and the Hugging Face tensors they hold, in row order.
const FUSED: [(&str, [&str; 3]); 2] = [
    ("self_attn.qkv_proj.weight", ["q_proj", "k_proj", "v_proj"]),
    ("mlp.gate_up_proj.weight", ["gate_proj", "up_proj", ""]),
];

impl LlamaConfig {
    /// The heads of each attention layer.
    pub fn heads(&self) -> Heads {
        Heads {
            n_head: self.num_attention_heads,
            n_kv_head: self.num_key_value_heads,
            head_dim: self.head_dim,
        }
    }

    /// Every parameter's name and shape in model order, with the fused projections
    /// (see the module documentation); `lm_head.weight` last when the head is untied.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (c, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let heads = self.heads();
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, c])];
        for i in 0..self.num_hidden_layers {
            let l = |s: &str| format!("model.layers.{i}.{s}");
            out.extend([
                (l("input_layernorm.weight"), vec![c]),
                (l("self_attn.qkv_proj.weight"), vec![heads.qkv_width(), c]),
                (l("self_attn.o_proj.weight"), vec![c, heads.q_width()]),
                (l("post_attention_layernorm.weight"), vec![c]),
                (l("mlp.gate_up_proj.weight"), vec![2 * f, c]),
                (l("mlp.down_proj.weight"), vec![c, f]),
            ]);
        }
        out.push(("model.norm.weight".to_string(), vec![c]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, c]));
        }
        out
    }

    /// The number of parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        self.param_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// The Llama config of `arch`, if it is Llama shaped: RMSNorm, a SwiGLU MLP, no
    /// biases and no learned positions. Rotary embeddings take θ = 10000 without
    /// scaling, heads `hidden / heads` wide, RMSNorm eps 1e-5, initializer range 0.02 and
    /// a context of `context`; otherwise an error naming what differs.
    pub fn from_architecture(arch: &Architecture, context: usize) -> Result<Self> {
        arch.validate()?;
        let mut differs = Vec::new();
        if arch.mlp != Mlp::SwiGlu {
            differs.push("an MLP other than SwiGLU");
        }
        if arch.norm != Norm::RmsNorm {
            differs.push("a norm other than RMSNorm");
        }
        if arch.biases {
            differs.push("biases");
        }
        if arch.positions != 0 {
            differs.push("a learned position embedding");
        }
        if !differs.is_empty() {
            return Err(Error::config(
                "model",
                format!("a Llama model has none of: {}", differs.join(", ")),
            ));
        }
        let size = |field: &str, v: u64| {
            usize::try_from(v).map_err(|_| Error::config(field, format!("{v} is too large")))
        };
        let config = LlamaConfig {
            hidden_size: size("model.hidden_size", arch.hidden)?,
            intermediate_size: size("model.intermediate_size", arch.ffn)?,
            num_hidden_layers: size("model.num_hidden_layers", arch.layers)?,
            num_attention_heads: size("model.num_attention_heads", arch.heads)?,
            num_key_value_heads: size("model.num_key_value_heads", arch.kv_heads)?,
            head_dim: size("model.head_dim", arch.head_dim())?,
            vocab_size: size("model.vocab_size", arch.vocab)?,
            max_position_embeddings: context,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: arch.tied_embeddings,
            initializer_range: 0.02,
            rope: Rope {
                theta: 10_000.0,
                scaling: RopeScaling::Default,
            },
        };
        config.validate()?;
        Ok(config)
    }
}

/// A Llama-family model (Llama 2 and 3, SmolLM2, TinyLlama), trainable on any backend with
/// any checkpoint policy and precision: its config, its parameters and its graph of op
/// nodes, run by the executor ([`super::exec`]).
#[derive(Debug)]
pub struct Llama {
    config: LlamaConfig,
    loss: LossPath,
    loss_chunk: Option<usize>,
    attention: AttentionPath,
    overrides: Vec<Arc<dyn OpOverride>>,
    graph: Graph,
}

impl Clone for Llama {
    fn clone(&self) -> Self {
        Llama {
            config: self.config.clone(),
            loss: self.loss,
            loss_chunk: self.loss_chunk,
            attention: self.attention,
            overrides: self.overrides.clone(),
            graph: self.build_graph(),
        }
    }
}

impl PartialEq for Llama {
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

impl Llama {
    /// A Llama of the given shape (validated).
    pub fn new(config: LlamaConfig) -> Result<Self> {
        config.validate()?;
        for (field, v) in [
            ("hidden_size", config.hidden_size),
            ("intermediate_size", config.intermediate_size),
            ("num_hidden_layers", config.num_hidden_layers),
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
            ("head_dim", config.head_dim),
            ("vocab_size", config.vocab_size),
            ("max_position_embeddings", config.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(Error::config(
                    format!("model.{field}"),
                    "must be at least 1",
                ));
            }
        }
        let attention = AttentionPath::Fused;
        let graph = graph(&config, Some(LinearCrossEntropy::default()), attention);
        Ok(Llama {
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
            graph(&self.config, self.fused_loss(), self.attention),
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

    /// The head's fused loss, `None` for the materialized logits.
    fn fused_loss(&self) -> Option<LinearCrossEntropy> {
        (self.loss == LossPath::Fused).then_some(LinearCrossEntropy {
            chunk: self.loss_chunk,
        })
    }

    /// The shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The graph of op nodes the executor runs.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        batch.check(
            self.config.max_position_embeddings,
            "max_position_embeddings",
        )
    }

    /// The parameters as Hugging Face names them: each fused projection split into its
    /// `q_proj`, `k_proj`, `v_proj` (or `gate_proj`, `up_proj`) rows, what
    /// `LlamaForCausalLM.from_pretrained` loads.
    pub fn export_tensors(&self, tensors: Vec<NamedTensor>) -> Result<Vec<NamedTensor>> {
        let heads = self.config.heads();
        let mut out = Vec::with_capacity(tensors.len() + 3 * self.config.num_hidden_layers);
        for t in tensors {
            let Some((prefix, parts)) = fused_parts(&t.name) else {
                out.push(t);
                continue;
            };
            let rows = self.part_rows(parts, heads);
            let cols = t.shape.get(1).copied().unwrap_or(0);
            let mut at = 0;
            for (part, rows) in parts.iter().zip(rows).filter(|(p, _)| !p.is_empty()) {
                let data = t
                    .data
                    .get(at * cols..(at + rows) * cols)
                    .ok_or_else(|| Error::data(&t.name, "holds fewer values than its shape says"))?
                    .to_vec();
                at += rows;
                out.push(NamedTensor {
                    name: format!("{prefix}.{part}.weight"),
                    shape: vec![rows, cols],
                    data,
                });
            }
        }
        Ok(out)
    }

    /// The parameters from Hugging Face's tensors: `q_proj`, `k_proj` and `v_proj` (and
    /// `gate_proj`, `up_proj`) of each layer stacked into the fused projections; other
    /// names pass through, and a tied head's `lm_head.weight` (a copy of the embedding in
    /// some files) is dropped. A missing part is an error naming it.
    pub fn import_tensors(
        &self,
        mut tensors: BTreeMap<String, NamedTensor>,
    ) -> Result<BTreeMap<String, NamedTensor>> {
        let heads = self.config.heads();
        if self.config.tie_word_embeddings {
            tensors.remove("lm_head.weight");
        }
        for i in 0..self.config.num_hidden_layers {
            for (fused, parts) in FUSED {
                let (block, _) = fused.split_once('.').unwrap_or((fused, ""));
                let prefix = format!("model.layers.{i}.{block}");
                let rows = self.part_rows(&parts, heads);
                let mut shape = vec![0, self.config.hidden_size];
                let mut data = Vec::new();
                for (part, rows) in parts.iter().zip(rows).filter(|(p, _)| !p.is_empty()) {
                    let name = format!("{prefix}.{part}.weight");
                    let t = tensors.remove(&name).ok_or_else(|| {
                        Error::data(
                            "model weights",
                            format!(
                                "`{name}` is missing; a Llama checkpoint of this config \
                                 holds it (do the weights and config.json belong together?)"
                            ),
                        )
                    })?;
                    if t.shape != [rows, self.config.hidden_size] {
                        return Err(Error::data(
                            "model weights",
                            format!(
                                "`{name}` has shape {:?}, config.json implies [{rows}, {}]",
                                t.shape, self.config.hidden_size
                            ),
                        ));
                    }
                    shape[0] += rows;
                    data.extend_from_slice(&t.data);
                }
                let name = format!("model.layers.{i}.{fused}");
                tensors.insert(name.clone(), NamedTensor { name, shape, data });
            }
        }
        Ok(tensors)
    }

    /// Rows of each part of a fused projection.
    fn part_rows(&self, parts: &[&str; 3], heads: Heads) -> [usize; 3] {
        if parts[0] == "q_proj" {
            [heads.q_width(), heads.kv_width(), heads.kv_width()]
        } else {
            let f = self.config.intermediate_size;
            [f, f, 0]
        }
    }
}

/// The prefix (`model.layers.3.self_attn`) and part names of a fused parameter's name.
fn fused_parts(name: &str) -> Option<(&str, &'static [&'static str; 3])> {
    FUSED.iter().find_map(|(suffix, parts)| {
        let rest = name.strip_suffix(suffix)?.strip_suffix('.')?;
        let block = suffix.split_once('.').map_or("", |(b, _)| b);
        Some((&name[..rest.len() + 1 + block.len()], parts))
    })
}

/// Llama's graph: token embeddings; per layer a pre-norm attention block (RMS norm, fused
/// q/k/v projection, rotary embedding of q and k, causal grouped-query attention, output
/// projection added to the residual) and a pre-norm MLP block (RMS norm, fused gate/up
/// projection, SwiGLU, down projection added to the residual); the final norm and the
/// classifier (the embedding when tied), fused with the loss (`fused_loss`) or producing the
/// logits.
fn graph(
    c: &LlamaConfig,
    fused_loss: Option<LinearCrossEntropy>,
    attention: AttentionPath,
) -> Graph {
    let names: HashMap<String, usize> = c
        .param_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, _))| (name, i))
        .collect();
    let p = |name: &str| names[name];
    let eps = c.rms_norm_eps as f32;
    let heads = c.heads();
    let inv_freq = c.rope.inv_freq(c.head_dim);
    let linear = Linear {
        bias: false,
        transposed: true,
    };
    let residual_proj = LinearResidual {
        bias: false,
        transposed: true,
    };
    let embed = p("model.embed_tokens.weight");

    let mut embedding = Section::new(Value::new("tokens", "tokens", Tags::NONE));
    let x = embedding.value("input", "h.0.input", Tags::LAYER_INPUT);
    embedding.node(TokenEmbedding, &[], &[x], &[embed]);
    embedding.output = x;

    let layers = (0..c.num_hidden_layers)
        .map(|l| {
            let w = |s: &str| p(&format!("model.layers.{l}.{s}"));
            let label = |s: &str| format!("h.{l}.{s}");
            let (attn, mlp) = (Tags::ATTENTION, Tags::MLP);
            let mut s = Section::new(Value::new("input", label("input"), Tags::LAYER_INPUT));
            let input = 0;
            let ln1_out = s.value("ln1_out", label("ln1_out"), attn | Tags::NORM_OUT);
            let ln1_rstd = s.value("ln1_rstd", label("ln1_rstd"), attn | Tags::NORM_STATS);
            let qkv_pre = s.value("qkv_pre", label("qkv_pre"), attn | Tags::PROJECTION);
            let qkv = s.value("qkv", label("qkv"), attn | Tags::PROJECTION);
            let stats = attention_stats(&mut s, attention, &format!("h.{l}"));
            let attn_out = s.value("attn_out", label("attn_out"), attn);
            let residual = s.value("residual", label("residual"), Tags::RESIDUAL);
            let ln2_out = s.value("ln2_out", label("ln2_out"), mlp | Tags::NORM_OUT);
            let ln2_rstd = s.value("ln2_rstd", label("ln2_rstd"), mlp | Tags::NORM_STATS);
            let gate_up = s.value(
                "gate_up",
                label("gate_up"),
                mlp | Tags::WIDE | Tags::PROJECTION,
            );
            let act = s.value("swiglu_out", label("swiglu_out"), mlp | Tags::WIDE);
            let next = if l + 1 < c.num_hidden_layers {
                format!("h.{}.input", l + 1)
            } else {
                "norm.input".to_string()
            };
            let output = s.value("output", next, Tags::LAYER_INPUT);
            s.node(
                RmsNorm { eps },
                &[input],
                &[ln1_out, ln1_rstd],
                &[w("input_layernorm.weight")],
            );
            s.node(
                linear,
                &[ln1_out],
                &[qkv_pre],
                &[w("self_attn.qkv_proj.weight")],
            );
            s.node(
                RopeOp {
                    heads,
                    inv_freq: inv_freq.clone(),
                },
                &[qkv_pre],
                &[qkv],
                &[],
            );
            attention_node(&mut s, attention, heads, qkv, stats, attn_out);
            s.node(
                residual_proj,
                &[input, attn_out],
                &[residual],
                &[w("self_attn.o_proj.weight")],
            );
            s.node(
                RmsNorm { eps },
                &[residual],
                &[ln2_out, ln2_rstd],
                &[w("post_attention_layernorm.weight")],
            );
            s.node(
                linear,
                &[ln2_out],
                &[gate_up],
                &[w("mlp.gate_up_proj.weight")],
            );
            s.node(SwiGlu, &[gate_up], &[act], &[]);
            s.node(
                residual_proj,
                &[residual, act],
                &[output],
                &[w("mlp.down_proj.weight")],
            );
            s.output = output;
            s
        })
        .collect();

    let mut head = Section::new(Value::new("input", "norm.input", Tags::NONE));
    let out = head.value("out", "norm.out", Tags::NORM_OUT);
    let rstd = head.value("rstd", "norm.rstd", Tags::NORM_STATS);
    head.node(
        RmsNorm { eps },
        &[0],
        &[out, rstd],
        &[p("model.norm.weight")],
    );
    let classifier = if c.tie_word_embeddings {
        embed
    } else {
        p("lm_head.weight")
    };
    match fused_loss {
        Some(loss) => {
            head.node(loss, &[out], &[], &[classifier]);
            head.output = out;
        }
        None => {
            let logits = head.value("logits", "logits", Tags::NONE);
            head.node(Classifier, &[out], &[logits], &[classifier]);
            head.output = logits;
        }
    }

    Graph {
        embedding,
        layers,
        head,
    }
}

impl Model for Llama {
    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "llama: {} layers, {} heads ({} key/value) of {}, {} wide, MLP {}, vocab {}, \
             context {}, {} head ({:.2}M parameters)",
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
            c.max_position_embeddings,
            if c.tie_word_embeddings {
                "tied"
            } else {
                "untied"
            },
            c.num_params() as f64 / 1e6
        )
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn init_params(&self) -> Vec<ParamInit> {
        // transformers' `_init_weights`: every linear and embedding weight normal(0,
        // initializer_range), every RMSNorm weight 1.
        let std = self.config.initializer_range;
        self.config
            .param_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let init = if name.ends_with("layernorm.weight") || name == "model.norm.weight" {
                    Init::Constant(1.0)
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
        crate::save::write_llama_config(&dir.join(crate::save::CONFIG_FILE), &self.config)
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let c = &self.config;
        6.0 * c.num_params() as f64
            + 6.0 * (c.num_hidden_layers * c.heads().q_width() * seq_len) as f64
    }

    fn export_tensors(&self, tensors: Vec<NamedTensor>) -> Result<Vec<NamedTensor>> {
        Llama::export_tensors(self, tensors)
    }

    fn import_tensors(
        &self,
        tensors: BTreeMap<String, NamedTensor>,
    ) -> Result<BTreeMap<String, NamedTensor>> {
        Llama::import_tensors(self, tensors)
    }
}
