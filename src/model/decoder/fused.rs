//! trainkit's fused projections and the separate ones Hugging Face files hold: the
//! query, key and value projections run as one product over `qkv_proj` (query rows
//! first), the gate and up projections over `gate_up_proj` (gate rows first), as
//! Megatron-LM and vLLM run them; files keep `q_proj`, `k_proj`, `v_proj`, `gate_proj`
//! and `up_proj` apart.

use super::super::{Family, LayerSlot, Mlp, Shape, Slot};
use crate::error::{Error, Result};
use crate::save::StoredTensor;
use std::collections::BTreeMap;

/// The fused parameters of layer `l` with the names and rows of their parts in files.
fn fused<F: Family>(family: &F, shape: &Shape, l: usize) -> Vec<(String, Vec<(String, usize)>)> {
    let heads = shape.heads();
    let (q, kv, f) = (heads.q_width(), heads.kv_width(), shape.ffn);
    let split = |slot: LayerSlot, from: &str, parts: &[(&str, usize)]| {
        let name = family.param_name(Slot::Layer(l, slot));
        let parts = parts
            .iter()
            .map(|(part, rows)| (name.replacen(from, part, 1), *rows))
            .collect();
        (name, parts)
    };
    let qkv = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)];
    let mut out = vec![split(LayerSlot::Qkv, "qkv_proj", &qkv)];
    if shape.bias.qkv {
        out.push(split(LayerSlot::QkvBias, "qkv_proj", &qkv));
    }
    if matches!(shape.mlp, Mlp::SwiGlu | Mlp::GeGlu) {
        let gate_up = [("gate_proj", f), ("up_proj", f)];
        out.push(split(LayerSlot::Up, "gate_up_proj", &gate_up));
        if shape.bias.mlp {
            out.push(split(LayerSlot::UpBias, "gate_up_proj", &gate_up));
        }
    }
    out
}

/// The parameters as Hugging Face names them: each fused projection (weight or bias)
/// split into its parts' rows.
pub(crate) fn split_fused<'t, F: Family>(
    family: &F,
    tensors: Vec<StoredTensor<'t>>,
) -> Result<Vec<StoredTensor<'t>>> {
    let shape = family.shape();
    let parts: BTreeMap<String, Vec<(String, usize)>> = (0..shape.layers)
        .flat_map(|l| fused(family, &shape, l))
        .collect();
    let mut out = Vec::with_capacity(tensors.len() + 3 * shape.layers);
    for t in tensors {
        let Some(parts) = parts.get(&t.name) else {
            out.push(t);
            continue;
        };
        let mut at = 0;
        for (name, rows) in parts {
            out.push(t.rows(name.clone(), at..at + rows)?);
            at += rows;
        }
    }
    Ok(out)
}

/// The parameters from Hugging Face's tensors: each layer's separate projections stacked
/// into the fused ones; other names pass through, and a tied head's `lm_head.weight` (a
/// copy of the embedding in some files) is dropped. A missing or misshapen part is an
/// error naming it.
pub(crate) fn stack_fused<F: Family>(
    family: &F,
    mut tensors: BTreeMap<String, StoredTensor<'static>>,
) -> Result<BTreeMap<String, StoredTensor<'static>>> {
    let shape = family.shape();
    if shape.tied_embeddings {
        tensors.remove(&family.param_name(Slot::Head));
    }
    for l in 0..shape.layers {
        for (fused, parts) in fused(family, &shape, l) {
            let bias = fused.ends_with(".bias");
            let cols = if bias { vec![] } else { vec![shape.hidden] };
            let mut stacked = Vec::with_capacity(parts.len());
            for (name, rows) in parts {
                let t = tensors.remove(&name).ok_or_else(|| {
                    Error::data(
                        "model weights",
                        format!(
                            "`{name}` is missing; a {} checkpoint of this config holds it \
                             (do the weights and config.json belong together?)",
                            F::MODEL_TYPE
                        ),
                    )
                })?;
                let want: Vec<usize> = std::iter::once(rows).chain(cols.clone()).collect();
                if t.shape() != want {
                    return Err(Error::data(
                        "model weights",
                        format!(
                            "`{name}` has shape {:?}, config.json implies {want:?}",
                            t.shape()
                        ),
                    ));
                }
                stacked.push(t);
            }
            tensors.insert(fused.clone(), StoredTensor::stack(fused, stacked)?);
        }
    }
    Ok(tensors)
}
