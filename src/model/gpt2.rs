//! GPT-2 with Hugging Face semantics: pre-norm blocks, learned positions, GELU (tanh),
//! LayerNorm eps 1e-5, tied input and output embeddings, no dropout.

use super::gpt2_graph::*;
use super::stash::{LayerStash, StashStats};
use super::{Batch, Init, Model, ParamInit, Pass, PassStats};
use crate::checkpoint::ActivationKind as K;
use crate::error::{Error, Result};
use crate::memory::{MemoryCategory, Phase};
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

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

    /// Number of parameters (embeddings tied, so counted once).
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        self.vocab_size * c + self.n_positions * c + l * (12 * c * c + 13 * c) + 2 * c
    }
}

/// GPT-2, trainable on any backend with any checkpoint policy and precision.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2 {
    config: Gpt2Config,
}

/// An activation buffer for an op to overwrite entirely.
fn act(pass: &Pass<'_>, shape: &[usize], label: String) -> Result<Tensor> {
    pass.backend
        .empty(shape, pass.dtype, MemoryCategory::Activations, &label)
}

/// Layer-norm statistics, `[rows, 2]` f32, for the op to overwrite.
fn stats_tensor(pass: &Pass<'_>, rows: usize, label: String) -> Result<Tensor> {
    pass.backend
        .empty(&[rows, 2], DType::F32, MemoryCategory::Activations, &label)
}

fn missing(kind: K, layer: usize) -> Error {
    Error::Backend {
        backend: "gpt2",
        message: format!(
            "activation h.{layer}.{} is missing from the stash",
            kind.name()
        ),
    }
}

fn slot(stash: &LayerStash, kind: K, layer: usize) -> Result<&Tensor> {
    stash.get(kind).ok_or_else(|| missing(kind, layer))
}

impl Gpt2 {
    /// A GPT-2 of the given shape (validated).
    pub fn new(config: Gpt2Config) -> Result<Self> {
        config.validate()?;
        Ok(Gpt2 { config })
    }

    /// The shape.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    fn lp(&self, layer: usize, j: usize) -> usize {
        2 + PER_LAYER * layer + j
    }

    fn lnf(&self) -> usize {
        2 + PER_LAYER * self.config.n_layer
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        let (b, t) = (batch.batch_size, batch.seq_len);
        if b == 0 || t == 0 {
            return Err(Error::config(
                "batch_size",
                format!("a batch of {b} rows of {t} tokens is empty; both must be at least 1"),
            ));
        }
        if t > self.config.n_positions {
            return Err(Error::config(
                "seq_len",
                format!(
                    "{t} exceeds the model's n_positions = {}; use at most {}",
                    self.config.n_positions, self.config.n_positions
                ),
            ));
        }
        if batch.inputs.len() != b * t || batch.targets.len() != b * t {
            return Err(Error::shape(
                "batch",
                format!(
                    "{} inputs and {} targets for {b} rows of {t}",
                    batch.inputs.len(),
                    batch.targets.len()
                ),
            ));
        }
        Ok(())
    }

    fn embed(&self, pass: &Pass<'_>, batch: &Batch) -> Result<Tensor> {
        let c = self.config.n_embd;
        let mut x = act(
            pass,
            &[batch.batch_size, batch.seq_len, c],
            "h.0.input".into(),
        )?;
        pass.backend.embedding(
            &mut x,
            &batch.inputs,
            pass.params[WTE].weight(),
            pass.params[WPE].weight(),
        )?;
        Ok(x)
    }

    /// Runs one node of layer `l`, storing its outputs in empty stash slots.
    /// Returns the bytes newly stored.
    fn run_node(
        &self,
        pass: &Pass<'_>,
        l: usize,
        node: Node,
        stash: &mut LayerStash,
    ) -> Result<u64> {
        let be = pass.backend;
        let w = |j: usize| pass.params[self.lp(l, j)].weight();
        let (n_head, c) = (self.config.n_head, self.config.n_embd);
        let label = |k: K| format!("h.{l}.{}", k.name());
        let mut outputs: Vec<(K, Tensor)> = Vec::with_capacity(2);
        match node {
            Node::Ln1 | Node::Ln2 => {
                let (src, stats_kind, out_kind, wj) = if node == Node::Ln1 {
                    (K::LayerInput, K::Ln1Stats, K::Ln1Out, LN1_W)
                } else {
                    (K::Residual, K::Ln2Stats, K::Ln2Out, LN2_W)
                };
                let x = slot(stash, src, l)?;
                let (rows, _) = x.rows_cols();
                let mut out = act(pass, x.shape(), label(out_kind))?;
                let mut st = stats_tensor(pass, rows, label(stats_kind))?;
                be.layernorm(
                    &mut out,
                    &mut st,
                    x,
                    w(wj),
                    w(wj + 1),
                    self.config.layer_norm_epsilon,
                )?;
                outputs.push((stats_kind, st));
                outputs.push((out_kind, out));
            }
            Node::Qkv => {
                let x = slot(stash, K::Ln1Out, l)?;
                let s = x.shape();
                let mut out = act(pass, &[s[0], s[1], 3 * c], label(K::Qkv))?;
                be.matmul(&mut out, x, w(QKV_W), Some(w(QKV_B)), false, false, false)?;
                outputs.push((K::Qkv, out));
            }
            Node::Probs => {
                let qkv = slot(stash, K::Qkv, l)?;
                let s = qkv.shape();
                let shape = [s[0], n_head, s[1], s[1]];
                let mut scores = act(pass, &shape, format!("h.{l}.attn_scores"))?;
                be.attention_scores(&mut scores, qkv, n_head)?;
                let mut probs = act(pass, &shape, label(K::AttnProbs))?;
                be.softmax_causal(&mut probs, &scores)?;
                outputs.push((K::AttnProbs, probs));
            }
            Node::AttnOut => {
                let qkv = slot(stash, K::Qkv, l)?;
                let probs = slot(stash, K::AttnProbs, l)?;
                let s = qkv.shape();
                let mut out = act(pass, &[s[0], s[1], c], label(K::AttnOut))?;
                be.attention_values(&mut out, probs, qkv, n_head)?;
                outputs.push((K::AttnOut, out));
            }
            Node::Residual => {
                let x = slot(stash, K::LayerInput, l)?;
                let a = slot(stash, K::AttnOut, l)?;
                let mut out = act(pass, x.shape(), label(K::Residual))?;
                be.matmul(&mut out, a, w(PROJ_W), Some(w(PROJ_B)), false, false, false)?;
                be.axpy(&mut out, 1.0, x)?;
                outputs.push((K::Residual, out));
            }
            Node::Fc => {
                let x = slot(stash, K::Ln2Out, l)?;
                let s = x.shape();
                let mut out = act(pass, &[s[0], s[1], 4 * c], label(K::FcOut))?;
                be.matmul(&mut out, x, w(FC_W), Some(w(FC_B)), false, false, false)?;
                outputs.push((K::FcOut, out));
            }
            Node::Gelu => {
                let x = slot(stash, K::FcOut, l)?;
                let mut out = act(pass, x.shape(), label(K::GeluOut))?;
                be.gelu(&mut out, x)?;
                outputs.push((K::GeluOut, out));
            }
        }
        let mut stored = 0;
        for (kind, t) in outputs {
            if !stash.has(kind) {
                stored += t.bytes();
                stash.put(kind, t);
            }
        }
        Ok(stored)
    }

    /// The MLP's first product and its GELU in one op: stores `FcOut` (the pre-activation)
    /// and `GeluOut`, both absent. Returns the bytes stored.
    fn fc_gelu(&self, pass: &Pass<'_>, l: usize, stash: &mut LayerStash) -> Result<u64> {
        let c = self.config.n_embd;
        let w = |j: usize| pass.params[self.lp(l, j)].weight();
        let label = |k: K| format!("h.{l}.{}", k.name());
        let x = slot(stash, K::Ln2Out, l)?;
        let s = x.shape();
        let mut pre = act(pass, &[s[0], s[1], 4 * c], label(K::FcOut))?;
        let mut out = act(pass, &[s[0], s[1], 4 * c], label(K::GeluOut))?;
        pass.backend
            .matmul_bias_gelu(&mut out, &mut pre, x, w(FC_W), w(FC_B))?;
        let stored = pre.bytes() + out.bytes();
        stash.put(K::FcOut, pre);
        stash.put(K::GeluOut, out);
        Ok(stored)
    }

    /// The layer's output (the next layer's input) from its residual and GELU output.
    fn layer_output(&self, pass: &Pass<'_>, l: usize, stash: &LayerStash) -> Result<Tensor> {
        let res = slot(stash, K::Residual, l)?;
        let g = slot(stash, K::GeluOut, l)?;
        let label = if l + 1 < self.config.n_layer {
            format!("h.{}.input", l + 1)
        } else {
            "ln_f.input".to_string()
        };
        let mut out = act(pass, res.shape(), label)?;
        let w = |j: usize| pass.params[self.lp(l, j)].weight();
        pass.backend.matmul(
            &mut out,
            g,
            w(FCPROJ_W),
            Some(w(FCPROJ_B)),
            false,
            false,
            false,
        )?;
        pass.backend.axpy(&mut out, 1.0, res)?;
        Ok(out)
    }

    /// Forward of layer `l` with its input in `stash`; the checkpoint policy settles each
    /// activation once forward is done with it. Returns the layer's output.
    fn layer_forward(
        &self,
        pass: &Pass<'_>,
        l: usize,
        stash: &mut LayerStash,
        stats: &mut StashStats,
    ) -> Result<Tensor> {
        let n_layer = self.config.n_layer;
        for node in NODES {
            match node {
                // The MLP's product and its GELU run as one op (`Backend::matmul_bias_gelu`).
                Node::Fc => {
                    self.fc_gelu(pass, l, stash)?;
                }
                Node::Gelu if stash.has(K::GeluOut) => {}
                _ => {
                    self.run_node(pass, l, node, stash)?;
                }
            }
            for &kind in node.settles() {
                stash.settle(kind, l, n_layer, pass.checkpoint, stats);
            }
        }
        let out = self.layer_output(pass, l, stash)?;
        stash.settle(K::Residual, l, n_layer, pass.checkpoint, stats);
        stash.settle(K::GeluOut, l, n_layer, pass.checkpoint, stats);
        Ok(out)
    }

    /// Makes `kind` present in the stash, recomputing it (and what it needs) if dropped.
    fn ensure(
        &self,
        pass: &Pass<'_>,
        l: usize,
        stash: &mut LayerStash,
        kind: K,
        stats: &mut StashStats,
    ) -> Result<()> {
        if stash.has(kind) {
            return Ok(());
        }
        if kind == K::GeluOut && !stash.has(K::FcOut) {
            // Both dropped: recompute them together, as forward made them.
            self.ensure(pass, l, stash, K::Ln2Out, stats)?;
            stats.recomputed_bytes += self.fc_gelu(pass, l, stash)?;
            return Ok(());
        }
        let node = Node::producing(kind).ok_or_else(|| missing(kind, l))?;
        for &dep in node.inputs() {
            self.ensure(pass, l, stash, dep, stats)?;
        }
        stats.recomputed_bytes += self.run_node(pass, l, node, stash)?;
        Ok(())
    }

    /// Makes layer `l`'s input present: if the policy dropped it, reruns the layers from
    /// the nearest kept input before it (or the embedding), keeping what they produce for
    /// their own backward.
    fn restore_input(
        &self,
        pass: &Pass<'_>,
        l: usize,
        stashes: &mut [LayerStash],
        batch: &Batch,
        stats: &mut StashStats,
    ) -> Result<()> {
        if stashes[l].has(K::LayerInput) {
            return Ok(());
        }
        let start = match (0..l).rev().find(|&j| stashes[j].has(K::LayerInput)) {
            Some(j) => j,
            None => {
                let x = self.embed(pass, batch)?;
                stats.recomputed_bytes += x.bytes();
                stashes[0].put(K::LayerInput, x);
                0
            }
        };
        for i in start..l {
            self.ensure(pass, i, &mut stashes[i], K::Residual, stats)?;
            self.ensure(pass, i, &mut stashes[i], K::GeluOut, stats)?;
            let out = self.layer_output(pass, i, &stashes[i])?;
            stats.recomputed_bytes += out.bytes();
            stashes[i + 1].put(K::LayerInput, out);
        }
        Ok(())
    }

    /// `dx = dy · Wᵀ` (when wanted), `dW += xᵀ · dy`, `db += Σ dy`.
    fn linear_backward(
        &self,
        pass: &mut Pass<'_>,
        w_idx: usize,
        x: &Tensor,
        dy: &Tensor,
        dx: Option<&mut Tensor>,
    ) -> Result<()> {
        let be = pass.backend;
        if let Some(dx) = dx {
            be.matmul(
                dx,
                dy,
                pass.params[w_idx].weight(),
                None,
                false,
                true,
                false,
            )?;
        }
        be.matmul(
            pass.params[w_idx].grad_mut(be)?,
            x,
            dy,
            None,
            true,
            false,
            true,
        )?;
        be.bias_backward(pass.params[w_idx + 1].grad_mut(be)?, dy)
    }

    /// LayerNorm backward for the norm whose weight is parameter `w_idx`; accumulates
    /// into `dx`.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        pass: &mut Pass<'_>,
        w_idx: usize,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        stats: &Tensor,
    ) -> Result<()> {
        let be = pass.backend;
        pass.params[w_idx + 1].grad_mut(be)?;
        let (head, tail) = pass.params.split_at_mut(w_idx + 1);
        let (weight, dweight) = head[w_idx].weight_and_grad(be)?;
        let dbias = tail[0].grad_mut(be)?;
        be.layernorm_backward(dx, dweight, dbias, dout, x, weight, stats)
    }

    /// Backward of layer `l`: consumes the incoming gradient `dout`, frees the stash as it
    /// goes, and returns the gradient of the layer's input.
    fn layer_backward(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        stash: &mut LayerStash,
        dout: Tensor,
        stats: &mut StashStats,
    ) -> Result<Tensor> {
        let be = pass.backend;
        let n_head = self.config.n_head;
        let p = |j: usize| 2 + PER_LAYER * l + j;
        let shape = dout.shape().to_vec();
        let (b, t, c) = (shape[0], shape[1], shape[2]);
        let label = |s: &str| format!("h.{l}.d_{s}");

        // MLP output projection.
        self.ensure(pass, l, stash, K::GeluOut, stats)?;
        let mut dgelu = act(pass, &[b, t, 4 * c], label("gelu_out"))?;
        let gelu_out = stash
            .take(K::GeluOut)
            .ok_or_else(|| missing(K::GeluOut, l))?;
        self.linear_backward(pass, p(FCPROJ_W), &gelu_out, &dout, Some(&mut dgelu))?;
        drop(gelu_out);

        // GELU.
        self.ensure(pass, l, stash, K::FcOut, stats)?;
        let mut dfc = act(pass, &[b, t, 4 * c], label("fc_out"))?;
        be.gelu_backward(&mut dfc, slot(stash, K::FcOut, l)?, &dgelu)?;
        stash.free(K::FcOut);
        drop(dgelu);

        // MLP input projection.
        self.ensure(pass, l, stash, K::Ln2Out, stats)?;
        let mut dln2 = act(pass, &[b, t, c], label("ln2_out"))?;
        let ln2_out = stash.take(K::Ln2Out).ok_or_else(|| missing(K::Ln2Out, l))?;
        self.linear_backward(pass, p(FC_W), &ln2_out, &dfc, Some(&mut dln2))?;
        drop(ln2_out);
        drop(dfc);

        // Second layer norm; the residual gradient accumulates into `dres`.
        self.ensure(pass, l, stash, K::Residual, stats)?;
        self.ensure(pass, l, stash, K::Ln2Stats, stats)?;
        let mut dres = dout;
        let residual = stash
            .take(K::Residual)
            .ok_or_else(|| missing(K::Residual, l))?;
        let ln2_stats = stash
            .take(K::Ln2Stats)
            .ok_or_else(|| missing(K::Ln2Stats, l))?;
        self.norm_backward(pass, p(LN2_W), &mut dres, &dln2, &residual, &ln2_stats)?;
        drop((residual, ln2_stats, dln2));

        // Attention output projection.
        self.ensure(pass, l, stash, K::AttnOut, stats)?;
        let mut datt = act(pass, &[b, t, c], label("attn_out"))?;
        let attn_out = stash
            .take(K::AttnOut)
            .ok_or_else(|| missing(K::AttnOut, l))?;
        self.linear_backward(pass, p(PROJ_W), &attn_out, &dres, Some(&mut datt))?;
        drop(attn_out);

        // Attention: values, softmax, scores.
        self.ensure(pass, l, stash, K::Qkv, stats)?;
        self.ensure(pass, l, stash, K::AttnProbs, stats)?;
        let mut dqkv = act(pass, &[b, t, 3 * c], label("qkv"))?;
        {
            let qkv = slot(stash, K::Qkv, l)?;
            let probs = slot(stash, K::AttnProbs, l)?;
            let mut dprobs = act(pass, &[b, n_head, t, t], label("attn_probs"))?;
            be.attention_values_backward(&mut dprobs, &mut dqkv, &datt, probs, qkv, n_head)?;
            drop(datt);
            let mut dscores = act(pass, &[b, n_head, t, t], label("attn_scores"))?;
            be.softmax_causal_backward(&mut dscores, &dprobs, probs)?;
            drop(dprobs);
            be.attention_scores_backward(&mut dqkv, &dscores, qkv, n_head)?;
        }
        stash.free(K::AttnProbs);
        stash.free(K::Qkv);

        // QKV projection.
        self.ensure(pass, l, stash, K::Ln1Out, stats)?;
        let mut dln1 = act(pass, &[b, t, c], label("ln1_out"))?;
        let ln1_out = stash.take(K::Ln1Out).ok_or_else(|| missing(K::Ln1Out, l))?;
        self.linear_backward(pass, p(QKV_W), &ln1_out, &dqkv, Some(&mut dln1))?;
        drop((ln1_out, dqkv));

        // First layer norm; `dres` becomes the input gradient.
        self.ensure(pass, l, stash, K::Ln1Stats, stats)?;
        let x = stash
            .take(K::LayerInput)
            .ok_or_else(|| missing(K::LayerInput, l))?;
        let ln1_stats = stash
            .take(K::Ln1Stats)
            .ok_or_else(|| missing(K::Ln1Stats, l))?;
        self.norm_backward(pass, p(LN1_W), &mut dres, &dln1, &x, &ln1_stats)?;
        stash.clear();
        Ok(dres)
    }

    /// Embedding and every layer, forward only: the last layer's output.
    fn forward_layers(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Tensor> {
        let mut x = self.embed(pass, batch)?;
        for l in 0..self.config.n_layer {
            let mut stash = LayerStash::new();
            stash.put(K::LayerInput, x);
            for node in NODES {
                self.run_node(pass, l, node, &mut stash)?;
            }
            x = self.layer_output(pass, l, &stash)?;
        }
        Ok(x)
    }

    /// The final layer norm of `x` and the tied classifier: the norm's output and
    /// statistics, and the logits `[rows, vocab]`.
    fn final_logits(&self, pass: &Pass<'_>, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let be = pass.backend;
        let lnf = self.lnf();
        let (rows, _) = x.rows_cols();
        let mut ln_out = act(pass, x.shape(), "ln_f.out".into())?;
        let mut st = stats_tensor(pass, rows, "ln_f.stats".into())?;
        be.layernorm(
            &mut ln_out,
            &mut st,
            x,
            pass.params[lnf].weight(),
            pass.params[lnf + 1].weight(),
            self.config.layer_norm_epsilon,
        )?;
        let mut logits = act(pass, &[rows, self.config.vocab_size], "logits".into())?;
        be.matmul(
            &mut logits,
            &ln_out,
            pass.params[WTE].weight(),
            None,
            false,
            true,
            false,
        )?;
        Ok((ln_out, st, logits))
    }

    /// Final norm, classifier, loss and their backward; consumes the last layer's output.
    /// Adds the per-position losses to `losses` and returns the gradient of that output.
    fn head(
        &self,
        pass: &mut Pass<'_>,
        x: Tensor,
        batch: &Batch,
        grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<Option<Tensor>> {
        let be = pass.backend;
        let lnf = self.lnf();
        let v = self.config.vocab_size;
        let (ln_out, st, mut logits) = self.final_logits(pass, &x)?;
        be.cross_entropy(&mut logits, &batch.targets, v, grad_scale, losses)?;
        if grad_scale.is_none() {
            return Ok(None);
        }
        // `logits` now holds the gradient of the loss with respect to the logits.
        let mut dln = act(pass, x.shape(), "ln_f.d_out".into())?;
        be.matmul(
            &mut dln,
            &logits,
            pass.params[WTE].weight(),
            None,
            false,
            false,
            false,
        )?;
        be.matmul(
            pass.params[WTE].grad_mut(be)?,
            &logits,
            &ln_out,
            None,
            true,
            false,
            true,
        )?;
        drop((logits, ln_out));
        // The layer-norm backward accumulates into its input gradient: start from zeros.
        let mut dx = pass.backend.zeros(
            x.shape(),
            pass.dtype,
            MemoryCategory::Activations,
            "ln_f.d_input",
        )?;
        self.norm_backward(pass, lnf, &mut dx, &dln, &x, &st)?;
        Ok(Some(dx))
    }
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
        let n_layer = self.config.n_layer;
        let ledger = pass.backend.ledger().clone();
        let mut stats = StashStats::default();
        let mut stashes: Vec<LayerStash> = (0..n_layer).map(|_| LayerStash::new()).collect();

        ledger.phase_begin(Phase::Embedding);
        let mut x = self.embed(pass, batch)?;
        ledger.phase_end(Phase::Embedding);

        for (l, stash) in stashes.iter_mut().enumerate() {
            ledger.phase_begin(Phase::Forward(l));
            stash.put(K::LayerInput, x);
            x = self.layer_forward(pass, l, stash, &mut stats)?;
            ledger.phase_end(Phase::Forward(l));
        }

        ledger.phase_begin(Phase::Loss);
        let dx = self.head(pass, x, batch, Some(grad_scale), losses)?;
        let mut dx = dx.ok_or_else(|| missing(K::LayerInput, n_layer))?;
        ledger.phase_end(Phase::Loss);

        for l in (0..n_layer).rev() {
            ledger.phase_begin(Phase::Backward(l));
            self.restore_input(pass, l, &mut stashes, batch, &mut stats)?;
            let mut stash = std::mem::take(&mut stashes[l]);
            dx = self.layer_backward(pass, l, &mut stash, dx, &mut stats)?;
            ledger.phase_end(Phase::Backward(l));
        }

        ledger.phase_begin(Phase::EmbeddingBackward);
        let be = pass.backend;
        pass.params[WPE].grad_mut(be)?;
        let (first, rest) = pass.params.split_at_mut(WPE);
        let dwte = first[WTE].grad_mut(be)?;
        let dwpe = rest[0].grad_mut(be)?;
        be.embedding_backward(dwte, dwpe, &dx, &batch.inputs)?;
        drop(dx);
        ledger.phase_end(Phase::EmbeddingBackward);
        Ok(PassStats { stash: stats })
    }

    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<f64> {
        self.check_batch(batch)?;
        let x = self.forward_layers(pass, batch)?;
        let mut losses = pass.backend.zeros(
            &[batch.tokens()],
            DType::F32,
            MemoryCategory::Workspace,
            "eval.losses",
        )?;
        self.head(pass, x, batch, None, &mut losses)?;
        let losses = pass.backend.to_f32(&losses)?;
        Ok(losses.iter().map(|&l| l as f64).sum())
    }

    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
        self.check_batch(batch)?;
        let x = self.forward_layers(pass, batch)?;
        let (_, _, logits) = self.final_logits(pass, &x)?;
        pass.backend.to_f32(&logits)
    }

    fn write_config(&self, dir: &std::path::Path) -> Result<()> {
        crate::save::write_hf_config(&dir.join(crate::save::CONFIG_FILE), &self.config)
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let c = &self.config;
        6.0 * c.num_params() as f64 + 6.0 * (c.n_layer * c.n_embd * seq_len) as f64
    }
}
