//! The classifier's padded vocabulary: the token embedding and the head hold
//! [`Shape::padded_vocab`] rows (a multiple of 64, llm.c's 50304 for GPT-2's 50257) so
//! their products have an aligned leading dimension. The padding rows start at zero and
//! stay there (no token reads them; their logits are kept out of the loss, whose gradient
//! for them is zero); files, sampling and parameter counts see the tokenizer's
//! vocabulary alone.

use super::super::{Family, Shape, Slot};
use crate::error::{Error, Result};
use crate::save::StoredTensor;
use std::collections::BTreeMap;

/// The names of the parameters with a row per token: the embedding, and the head when
/// it is not tied.
fn vocab_params<F: Family>(family: &F, shape: &Shape) -> Vec<String> {
    let mut names = vec![family.param_name(Slot::Embed)];
    if !shape.tied_embeddings {
        names.push(family.param_name(Slot::Head));
    }
    names
}

/// Parameters the padding adds (not counted as the model's).
pub(crate) fn padding_params(shape: &Shape) -> usize {
    let per_matrix = (shape.padded_vocab() - shape.vocab) * shape.hidden;
    per_matrix * if shape.tied_embeddings { 1 } else { 2 }
}

/// The parameters as files hold them: the embedding and the head cut to the
/// tokenizer's vocabulary.
pub(crate) fn unpad<'t, F: Family>(
    family: &F,
    tensors: Vec<StoredTensor<'t>>,
) -> Result<Vec<StoredTensor<'t>>> {
    let shape = family.shape();
    let names = vocab_params(family, &shape);
    tensors
        .into_iter()
        .map(|t| {
            match names.contains(&t.name) && t.shape().first() == Some(&shape.padded_vocab()) {
                true => t.rows(t.name.clone(), 0..shape.vocab),
                false => Ok(t),
            }
        })
        .collect()
}

/// A file's tensors (by parameter name) with the embedding and the head padded by zero
/// rows to [`Shape::padded_vocab`]; a tensor whose rows are not the config's vocabulary
/// is an error naming both.
pub(crate) fn pad<F: Family>(
    family: &F,
    mut tensors: BTreeMap<String, StoredTensor<'static>>,
) -> Result<BTreeMap<String, StoredTensor<'static>>> {
    let shape = family.shape();
    let (v, vp) = (shape.vocab, shape.padded_vocab());
    for name in vocab_params(family, &shape) {
        let Some(t) = tensors.remove(&name) else {
            continue;
        };
        let padded = match t.shape().first().copied() {
            Some(rows) if rows == vp => t,
            Some(rows) if rows == v => t.pad_rows(vp),
            _ => {
                return Err(Error::data(
                    "model weights",
                    format!(
                        "`{name}` has shape {:?}, but config.json's vocabulary has {v} \
                         tokens (its first dimension); the weights and config.json do not \
                         belong together",
                        t.shape()
                    ),
                ))
            }
        };
        tensors.insert(name, padded);
    }
    Ok(tensors)
}

/// Each row of `logits` (`[rows, padded_vocab]`) cut to the tokenizer's vocabulary.
pub(crate) fn unpad_logits(shape: &Shape, logits: Vec<f32>) -> Vec<f32> {
    let (v, vp) = (shape.vocab, shape.padded_vocab());
    if v == vp {
        return logits;
    }
    logits
        .chunks(vp)
        .flat_map(|row| &row[..v.min(row.len())])
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Gpt2Config;
    use crate::save::NamedTensor;

    #[test]
    fn gpt2_pads_to_50304_and_files_keep_50257() {
        let config = Gpt2Config::gpt2_124m();
        let shape = config.shape();
        assert_eq!(shape.padded_vocab(), 50304);
        assert_eq!(padding_params(&shape), 47 * 768);
        let wte = NamedTensor {
            name: "transformer.wte.weight".into(),
            shape: vec![2, 3],
            data: vec![1.0; 6],
        };
        let small = Gpt2Config {
            vocab_size: 2,
            n_embd: 3,
            ..config
        };
        let stored = StoredTensor::from(wte.clone());
        let padded = pad(&small, [(wte.name.clone(), stored)].into()).unwrap();
        let t = padded[&wte.name].read().unwrap();
        assert_eq!(t.shape, vec![64, 3]);
        assert_eq!(t.data[..6], [1.0; 6]);
        assert!(t.data[6..].iter().all(|&x| x == 0.0));
        let back = unpad(&small, vec![StoredTensor::from(t)]).unwrap();
        assert_eq!(back[0].read().unwrap(), wte);
        let logits: Vec<f32> = (0..128).map(|i| i as f32).collect();
        assert_eq!(
            unpad_logits(&small.shape(), logits),
            vec![0.0, 1.0, 64.0, 65.0]
        );
    }

    #[test]
    fn weights_of_another_vocabulary_are_refused_by_name() {
        let config = Gpt2Config::gpt2_124m();
        let wte = NamedTensor {
            name: "transformer.wte.weight".into(),
            shape: vec![50000, 768],
            data: Vec::new(),
        };
        let e = pad(&config, [(wte.name.clone(), wte.into())].into())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("transformer.wte.weight") && e.contains("50257"),
            "{e}"
        );
    }
}
