//! A decoder's [`Adapter`]: which of its base parameters train, and the low-rank updates
//! of its projections, each named by the Hugging Face module it adapts (`q_proj` is a
//! block of trainkit's fused `qkv_proj`, `gate_proj` of `gate_up_proj`).

use super::super::{Family, Init, LayerSlot, Mlp, ParamInit, Shape, Slot};
use crate::adapter::{magnitude_name, param_names, Adapter, LowRank};
use crate::ops::lora::Adapted;

/// One linear projection as Hugging Face names it: a block of output rows of one of
/// trainkit's (possibly fused) projection weights.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Projection {
    /// Its layer.
    pub layer: usize,
    /// trainkit's weight that holds it.
    pub slot: LayerSlot,
    /// Its Hugging Face module name, e.g. `model.layers.0.self_attn.q_proj`.
    pub module: String,
    /// Its first output row in trainkit's weight.
    pub offset: usize,
    /// Its output features.
    pub width: usize,
    /// Its input features.
    pub in_features: usize,
}

/// Every linear projection of `shape`'s layers, named by `family`, in model order.
pub(crate) fn projections<F: Family>(family: &F, shape: &Shape) -> Vec<Projection> {
    let heads = shape.heads();
    let (q, kv, f, c) = (heads.q_width(), heads.kv_width(), shape.ffn, shape.hidden);
    let gated = matches!(shape.mlp, Mlp::SwiGlu | Mlp::GeGlu);
    let mut out = Vec::new();
    for l in 0..shape.layers {
        let mut add = |slot: LayerSlot, fused: &str, parts: &[(&str, usize)], in_features| {
            let name = family.param_name(Slot::Layer(l, slot));
            let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            if module.rsplit('.').next() == Some(fused) {
                let mut at = 0;
                for &(part, width) in parts {
                    out.push(Projection {
                        layer: l,
                        slot,
                        module: module.replacen(fused, part, 1),
                        offset: at,
                        width,
                        in_features,
                    });
                    at += width;
                }
            } else {
                out.push(Projection {
                    layer: l,
                    slot,
                    module,
                    offset: 0,
                    width: parts.iter().map(|p| p.1).sum(),
                    in_features,
                });
            }
        };
        add(
            LayerSlot::Qkv,
            "qkv_proj",
            &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            c,
        );
        add(LayerSlot::O, "o_proj", &[("o_proj", c)], q);
        if gated {
            add(
                LayerSlot::Up,
                "gate_up_proj",
                &[("gate_proj", f), ("up_proj", f)],
                c,
            );
        } else {
            add(LayerSlot::Up, "up_proj", &[("up_proj", f)], c);
        }
        add(LayerSlot::Down, "down_proj", &[("down_proj", c)], f);
    }
    out
}

/// The projections `adapter` updates, with their updates, in model order.
pub(crate) fn updates<F: Family>(
    family: &F,
    shape: &Shape,
    adapter: &dyn Adapter,
) -> Vec<(Projection, LowRank)> {
    projections(family, shape)
        .into_iter()
        .filter_map(|p| {
            let r = adapter.low_rank(&p.module, p.in_features, p.width)?;
            Some((p, r))
        })
        .collect()
}

/// The parameters of `updates`, in order: each update's `A` (`[rank, in]`, Kaiming-uniform
/// as `nn.Linear` initialises its weight: bound `1/√in`) then its `B` (`[width, rank]`,
/// zeros), named after PEFT's `lora_A` and `lora_B`, then a DoRA update's magnitude
/// (`[width]`, PEFT's `lora_magnitude_vector`; its value, the norms of the base weight's
/// rows, is set once the base weights are: [`crate::Trainer`] does it).
pub(crate) fn update_params(updates: &[(Projection, LowRank)]) -> Vec<ParamInit> {
    updates
        .iter()
        .flat_map(|(p, r)| {
            let [a, b] = param_names(&p.module);
            let magnitude = r.dora.then(|| ParamInit {
                name: magnitude_name(&p.module),
                shape: vec![p.width],
                init: Init::Constant(1.0),
                trains: true,
                dtype: None,
            });
            [
                ParamInit {
                    name: a,
                    shape: vec![r.rank, p.in_features],
                    init: Init::Uniform {
                        bound: 1.0 / (p.in_features as f64).sqrt(),
                    },
                    trains: true,
                    dtype: None,
                },
                ParamInit {
                    name: b,
                    shape: vec![p.width, r.rank],
                    init: Init::Constant(0.0),
                    trains: true,
                    dtype: None,
                },
            ]
            .into_iter()
            .chain(magnitude)
        })
        .collect()
}

/// One update as a layer's graph builder uses it: where it adds, its parameters (indices
/// in model order) and the label of its intermediate.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct UpdateRef {
    /// The columns, rank and scale.
    pub adapted: Adapted,
    /// Its `A`.
    pub a: usize,
    /// Its `B`.
    pub b: usize,
    /// Its magnitude, when it is DoRA's.
    pub magnitude: Option<usize>,
    /// The ledger label of its intermediate, e.g. `h.0.q_proj.lora`.
    pub label: String,
}

/// The updates of `updates` (whose parameters start at index `first`) grouped by layer
/// and trainkit weight.
pub(crate) fn update_refs(
    updates: &[(Projection, LowRank)],
    first: usize,
) -> Vec<(usize, LayerSlot, UpdateRef)> {
    let mut at = first;
    updates
        .iter()
        .map(|(p, r)| {
            let short = p.module.rsplit('.').next().unwrap_or(&p.module);
            let a = at;
            at += 2 + usize::from(r.dora);
            (
                p.layer,
                p.slot,
                UpdateRef {
                    adapted: Adapted {
                        offset: p.offset,
                        width: p.width,
                        rank: r.rank,
                        scale: r.scale,
                        dropout: r.dropout,
                        dora: r.dora,
                    },
                    a,
                    b: a + 1,
                    magnitude: r.dora.then_some(a + 2),
                    label: format!("h.{}.{short}.lora", p.layer),
                },
            )
        })
        .collect()
}
