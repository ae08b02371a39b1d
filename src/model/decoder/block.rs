//! The shared pre-norm block builder: the graph of any [`Shape`] — embeddings, per layer
//! a norm, the attention block (fused q/k/v projection, per-head q/k norm, rotary
//! embedding, causal attention, output projection added to the residual) and a norm and
//! the MLP block (GELU or a gated product, down projection added to the residual), the
//! final norm and the classifier fused with the loss or producing the logits.

use super::super::graph::{attention_node, attention_stats, Graph, Section, Value};
use super::super::shape::{Positions, Shape};
use super::super::{LayerSlot, Mlp, Norm, Slot};
use super::adapters::UpdateRef;
use crate::checkpoint::Tags;
use crate::ops::lora::{Base, LoraDown, LoraProjection};
use crate::ops::{
    AttentionPath, Classifier, EmbeddingScale, GeluLinearResidual, Glu, LayerNorm,
    LearnedEmbedding, Linear, LinearCrossEntropy, LinearGelu, LinearResidual, OffsetRmsNorm,
    QkNorm, RmsNorm, Rope, TokenEmbedding,
};

/// How the parts of the graph that a family names are labelled.
pub(crate) struct Labels {
    /// The final norm's label scope (`norm`, GPT-2's `ln_f`).
    pub final_norm: &'static str,
}

/// What an adapter changes in the graph: the low-rank updates of each layer's weights, and
/// which parameters (by index in model order) train.
pub(crate) struct Adapters<'a> {
    /// The updates of a layer's weight (empty for none).
    pub updates: &'a dyn Fn(usize, LayerSlot) -> Vec<UpdateRef>,
    /// Whether a parameter trains.
    pub trains: &'a dyn Fn(usize) -> bool,
}

/// The graph of `shape` over parameters found by `p` (a slot's index in model order),
/// with the low-rank updates of `adapters`, weights stored `[out, in]` when `out_in`,
/// with the fused loss (`fused_loss`) or the logits, and attention computed by
/// `attention`.
pub(crate) fn graph(
    shape: &Shape,
    p: &dyn Fn(Slot) -> usize,
    adapters: &Adapters<'_>,
    out_in: bool,
    labels: &Labels,
    fused_loss: Option<LinearCrossEntropy>,
    attention: AttentionPath,
) -> Graph {
    let mut embedding = Section::new(Value::new("tokens", "tokens", Tags::NONE));
    let embedded = match shape.embedding_scale {
        Some(_) => embedding.value("embedded", "embedded", Tags::NONE),
        None => embedding.value("input", "h.0.input", Tags::LAYER_INPUT),
    };
    match shape.positions {
        Positions::Learned => embedding.node(
            LearnedEmbedding,
            &[],
            &[embedded],
            &[p(Slot::Embed), p(Slot::Positions)],
        ),
        Positions::Rotary(_) | Positions::None => {
            embedding.node(TokenEmbedding, &[], &[embedded], &[p(Slot::Embed)])
        }
    }
    embedding.output = embedded;
    if let Some(factor) = shape.embedding_scale {
        let x = embedding.value("input", "h.0.input", Tags::LAYER_INPUT);
        embedding.node(EmbeddingScale { factor }, &[embedded], &[x], &[]);
        embedding.output = x;
    }

    let layers = (0..shape.layers)
        .map(|l| {
            layer(
                shape,
                l,
                &|s| p(Slot::Layer(l, s)),
                adapters,
                out_in,
                labels,
                attention,
            )
        })
        .collect();

    let scope = labels.final_norm;
    let mut head = Section::new(Value::new("input", format!("{scope}.input"), Tags::NONE));
    let out = head.value("out", format!("{scope}.out"), Tags::NORM_OUT);
    let (stats_name, bias) = match shape.norm {
        Norm::LayerNorm => ("stats", Some(p(Slot::FinalNormBias))),
        Norm::RmsNorm => ("rstd", None),
    };
    let stats = head.value(
        stats_name,
        format!("{scope}.{stats_name}"),
        Tags::NORM_STATS,
    );
    norm_node(&mut head, shape, 0, [out, stats], p(Slot::FinalNorm), bias);
    let classifier = if shape.tied_embeddings {
        p(Slot::Embed)
    } else {
        p(Slot::Head)
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

/// A norm node of `shape`'s kind over value `input`, writing `outputs` (normalised values
/// and statistics), with gain `weight` and (LayerNorm) `bias`.
fn norm_node(
    s: &mut Section,
    shape: &Shape,
    input: usize,
    outputs: [usize; 2],
    weight: usize,
    bias: Option<usize>,
) {
    let eps = shape.norm_eps as f32;
    match (shape.norm, bias) {
        (Norm::LayerNorm, Some(b)) => s.node(LayerNorm { eps }, &[input], &outputs, &[weight, b]),
        _ if shape.norm_offset => s.node(OffsetRmsNorm { eps }, &[input], &outputs, &[weight]),
        _ => s.node(RmsNorm { eps }, &[input], &outputs, &[weight]),
    }
}

/// Layer `l`: the attention block and the MLP block, each pre-norm with a residual.
fn layer(
    shape: &Shape,
    l: usize,
    w: &dyn Fn(LayerSlot) -> usize,
    adapters: &Adapters<'_>,
    out_in: bool,
    labels: &Labels,
    attention: AttentionPath,
) -> Section {
    let label = |s: &str| format!("h.{l}.{s}");
    let (attn, mlp) = (Tags::ATTENTION, Tags::MLP);
    let layer_norm = shape.norm == Norm::LayerNorm;
    let stats = if layer_norm { "stats" } else { "rstd" };
    let norm_bias = |slot| layer_norm.then(|| w(slot));
    let mut s = Section::new(Value::new("input", label("input"), Tags::LAYER_INPUT));
    let input = 0;
    let ln1_out = s.value("ln1_out", label("ln1_out"), attn | Tags::NORM_OUT);
    let ln1_name = if layer_norm { "ln1_stats" } else { "ln1_rstd" };
    let ln1_stats = s.value(
        ln1_name,
        label(&format!("ln1_{stats}")),
        attn | Tags::NORM_STATS,
    );
    // The projection's output, then each transformation of it until attention reads it.
    let turned = shape.qk_norm || shape.rope().is_some();
    let mut qkv = if turned {
        s.value("qkv_pre", label("qkv_pre"), attn | Tags::PROJECTION)
    } else {
        s.value("qkv", label("qkv"), attn | Tags::PROJECTION)
    };
    let qkv_pre = qkv;
    let normed = shape.qk_norm.then(|| {
        let out = if shape.rope().is_some() {
            s.value("qk_normed", label("qk_normed"), attn | Tags::PROJECTION)
        } else {
            s.value("qkv", label("qkv"), attn | Tags::PROJECTION)
        };
        let rstd = s.value("qk_rstd", label("qk_rstd"), attn | Tags::NORM_STATS);
        (out, rstd)
    });
    if let Some((out, _)) = normed {
        qkv = out;
    }
    let roped = shape.rope().map(|_| {
        let out = s.value("qkv", label("qkv"), attn | Tags::PROJECTION);
        (qkv, out)
    });
    if let Some((_, out)) = roped {
        qkv = out;
    }
    let attn_stats = attention_stats(&mut s, attention, &format!("h.{l}"));
    let attn_out = s.value("attn_out", label("attn_out"), attn);
    let residual = s.value("residual", label("residual"), Tags::RESIDUAL);
    let ln2_out = s.value("ln2_out", label("ln2_out"), mlp | Tags::NORM_OUT);
    let ln2_name = if layer_norm { "ln2_stats" } else { "ln2_rstd" };
    let ln2_stats = s.value(
        ln2_name,
        label(&format!("ln2_{stats}")),
        mlp | Tags::NORM_STATS,
    );
    let (up_name, act_name) = match shape.mlp {
        Mlp::Gelu => ("fc_out", "gelu_out"),
        Mlp::SwiGlu => ("gate_up", "swiglu_out"),
        Mlp::GeGlu => ("gate_up", "geglu_out"),
    };
    let up = s.value(up_name, label(up_name), mlp | Tags::WIDE | Tags::PROJECTION);
    let act = s.value(act_name, label(act_name), mlp | Tags::WIDE);
    let next = if l + 1 < shape.layers {
        format!("h.{}.input", l + 1)
    } else {
        format!("{}.input", labels.final_norm)
    };
    let output = s.value("output", next, Tags::LAYER_INPUT);

    let with_bias = |weight: LayerSlot, bias: LayerSlot, on: bool| {
        if on {
            vec![w(weight), w(bias)]
        } else {
            vec![w(weight)]
        }
    };
    norm_node(
        &mut s,
        shape,
        input,
        [ln1_out, ln1_stats],
        w(LayerSlot::Norm1),
        norm_bias(LayerSlot::Norm1Bias),
    );
    let project = |s: &mut Section, slot: LayerSlot, p: Projection, io: (&[usize], &[usize])| {
        let updates = (adapters.updates)(l, slot);
        projection(s, p, io, &updates, adapters.trains, attn_or_mlp(slot));
    };
    project(
        &mut s,
        LayerSlot::Qkv,
        Projection {
            base: Base::Linear,
            bias: shape.bias.qkv,
            transposed: out_in,
            params: with_bias(LayerSlot::Qkv, LayerSlot::QkvBias, shape.bias.qkv),
        },
        (&[ln1_out], &[qkv_pre]),
    );
    if let Some((out, rstd)) = normed {
        qk_norm_node(
            &mut s,
            shape,
            qkv_pre,
            [out, rstd],
            [w(LayerSlot::QNorm), w(LayerSlot::KNorm)],
        );
    }
    if let (Some((from, out)), Some(rope)) = (roped, shape.rope()) {
        s.node(
            Rope {
                heads: shape.heads(),
                inv_freq: rope.inv_freq(shape.head_dim),
            },
            &[from],
            &[out],
            &[],
        );
    }
    attention_node(&mut s, attention, shape.heads(), qkv, attn_stats, attn_out);
    project(
        &mut s,
        LayerSlot::O,
        Projection {
            base: Base::Residual,
            bias: shape.bias.o,
            transposed: out_in,
            params: with_bias(LayerSlot::O, LayerSlot::OBias, shape.bias.o),
        },
        (&[input, attn_out], &[residual]),
    );
    norm_node(
        &mut s,
        shape,
        residual,
        [ln2_out, ln2_stats],
        w(LayerSlot::Norm2),
        norm_bias(LayerSlot::Norm2Bias),
    );
    let up_params = with_bias(LayerSlot::Up, LayerSlot::UpBias, shape.bias.mlp);
    match shape.mlp {
        Mlp::Gelu => project(
            &mut s,
            LayerSlot::Up,
            Projection {
                base: Base::Gelu,
                bias: true,
                transposed: out_in,
                params: up_params,
            },
            (&[ln2_out], &[up, act]),
        ),
        Mlp::SwiGlu | Mlp::GeGlu => {
            project(
                &mut s,
                LayerSlot::Up,
                Projection {
                    base: Base::Linear,
                    bias: shape.bias.mlp,
                    transposed: out_in,
                    params: up_params,
                },
                (&[ln2_out], &[up]),
            );
            let glu = match shape.mlp {
                Mlp::GeGlu => Glu::GEGLU,
                _ => Glu::SWIGLU,
            };
            s.node(glu, &[up], &[act], &[]);
        }
    }
    let down = Projection {
        base: Base::Residual,
        bias: shape.bias.mlp,
        transposed: out_in,
        params: with_bias(LayerSlot::Down, LayerSlot::DownBias, shape.bias.mlp),
    };
    let plain_down = (adapters.updates)(l, LayerSlot::Down).is_empty()
        && down.params.iter().any(|&i| (adapters.trains)(i));
    if shape.mlp == Mlp::Gelu && plain_down {
        // GPT-2's MLP: the output projection reads the GELU's input too, and carries its
        // input gradient through the GELU in the same product.
        let (bias, transposed) = (down.bias, down.transposed);
        s.node(
            GeluLinearResidual { bias, transposed },
            &[residual, act, up],
            &[output],
            &down.params,
        );
    } else {
        project(&mut s, LayerSlot::Down, down, (&[residual, act], &[output]));
    }
    s.output = output;
    s
}

/// The tags of a weight's values: its block's.
fn attn_or_mlp(slot: LayerSlot) -> Tags {
    match slot {
        LayerSlot::Up | LayerSlot::Down => Tags::MLP,
        _ => Tags::ATTENTION,
    }
}

/// A projection node before its updates: what it computes, its bias and layout, its
/// parameters (the weight, then the bias).
struct Projection {
    base: Base,
    bias: bool,
    transposed: bool,
    params: Vec<usize>,
}

/// Adds projection `p` reading and writing `(inputs, outputs)`: its plain node
/// ([`Linear`], [`LinearResidual`], [`LinearGelu`]) when it trains without updates; with
/// updates, a [`LoraDown`] node writing each update's intermediate (tagged `tags` and
/// low-rank), then a [`LoraProjection`] that adds them; frozen without updates, a
/// [`LoraProjection`] of none, which saves no input for a weight gradient.
fn projection(
    s: &mut Section,
    p: Projection,
    (inputs, outputs): (&[usize], &[usize]),
    updates: &[UpdateRef],
    trains: &dyn Fn(usize) -> bool,
    tags: Tags,
) {
    let (bias, transposed) = (p.bias, p.transposed);
    let base_trains = p.params.iter().any(|&i| trains(i));
    if updates.is_empty() && base_trains {
        match p.base {
            Base::Linear => s.node(Linear { bias, transposed }, inputs, outputs, &p.params),
            Base::Residual => s.node(
                LinearResidual { bias, transposed },
                inputs,
                outputs,
                &p.params,
            ),
            Base::Gelu => s.node(LinearGelu { transposed }, inputs, outputs, &p.params),
        }
        return;
    }
    // Updates, or a frozen projection (which keeps no input for a weight gradient).
    let hs: Vec<usize> = updates
        .iter()
        .map(|u| s.value("lora", u.label.clone(), tags | Tags::LOW_RANK))
        .collect();
    let adapted: Vec<_> = updates.iter().map(|u| u.adapted).collect();
    // DoRA with dropout: the base product of what each dropout took away.
    let zs: Vec<usize> = updates
        .iter()
        .filter(|u| u.adapted.drops_base_input())
        .map(|u| {
            s.value(
                "lora",
                format!("{}.dora_dropped", u.label),
                tags | Tags::LOW_RANK,
            )
        })
        .collect();
    if !updates.is_empty() {
        let x = inputs[usize::from(p.base == Base::Residual)];
        let mut a_params: Vec<usize> = updates.iter().map(|u| u.a).collect();
        if !zs.is_empty() {
            a_params.push(p.params[0]);
        }
        let outs: Vec<usize> = hs.iter().chain(&zs).copied().collect();
        s.node(
            LoraDown {
                adapters: adapted.clone(),
                transposed,
            },
            &[x],
            &outs,
            &a_params,
        );
    }
    let all_inputs: Vec<usize> = inputs.iter().copied().chain(hs).chain(zs).collect();
    let params: Vec<usize> = p
        .params
        .iter()
        .copied()
        .chain(updates.iter().map(|u| u.b))
        .chain(
            updates
                .iter()
                .filter_map(|u| u.magnitude.map(|m| [u.a, m]))
                .flatten(),
        )
        .collect();
    s.node(
        LoraProjection {
            base: p.base,
            bias,
            transposed,
            base_trains,
            adapters: adapted,
        },
        &all_inputs,
        outputs,
        &params,
    );
}

/// The per-head q/k norm of `shape` over `qkv`, writing `outputs` (the normalised
/// projection and its statistics), with gains `weights` (queries, keys).
fn qk_norm_node(
    s: &mut Section,
    shape: &Shape,
    qkv: usize,
    outputs: [usize; 2],
    weights: [usize; 2],
) {
    let op = QkNorm {
        heads: shape.heads(),
        eps: shape.norm_eps as f32,
    };
    s.node(op, &[qkv], &outputs, &weights);
}
