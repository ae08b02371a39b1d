//! A LoRA adapter merged into its base: `W + s·B·A` for every projection it updates (with
//! DoRA, each output feature's row of it rescaled to its magnitude), the full model PEFT's
//! `merge_and_unload` gives, as Hugging Face weights.

use super::Lora;
use crate::error::{Error, Result};
use crate::model::ModelDir;
use crate::save::stored::rows_of;
use crate::save::{NamedTensor, StoredTensor};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// The base's tensors (by their names in its files) with each update of `lora` merged in:
/// `W += s·B·A`, or `W += s·(B·A)ᵀ` when the base stores its projections `[in, out]`
/// (`fan_in_fan_out`, GPT-2's `Conv1D`). `updates` are the adapter's tensors named by
/// trainkit (`{module}.lora_A.weight`, `{module}.lora_B.weight`, as
/// [`super::peft::read`] returns them; a DoRA update's `{module}.lora_magnitude_vector`
/// `m` rescales each output feature's row of `W + s·B·A` to `m / ‖row‖`) and the modules it
/// saves whole (`modules_to_save`, by their own names), which replace the base's; `what`
/// names the adapter in errors. Products are summed in f64 and added to the f32 weight
/// once; DoRA's norms are taken in f64 of the merged f32 rows.
///
/// Every name and shape is checked now; the values are read and merged only when asked
/// (as [`write_merged`] writes them), one tensor at a time, so merging holds one base
/// tensor's f32 values in memory, not the model's.
pub fn merge<'a>(
    base: &ModelDir,
    lora: &Lora,
    updates: &'a [NamedTensor],
    fan_in_fan_out: bool,
    what: &str,
) -> Result<Vec<StoredTensor<'a>>> {
    let by_name: BTreeMap<&str, &NamedTensor> =
        updates.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut tensors: BTreeMap<String, StoredTensor<'a>> =
        base.tensors.clone().into_iter().collect();
    let scale = f64::from(lora.scale());
    let mut merged = 0;
    for (name, a) in &by_name {
        let Some(module) = name.strip_suffix(".lora_A.weight") else {
            if name.ends_with(".lora_B.weight") || name.ends_with(".lora_magnitude_vector") {
                continue;
            }
            // The head's copy of a tied embedding saved whole (PEFT's ensure_weight_tying):
            // a tied base has no head of its own, its embedding is the head.
            if !tensors.contains_key(*name) && tied_copy(name, a, &by_name) {
                continue;
            }
            // A module saved whole replaces the base's.
            let kept = tensors.get_mut(*name).filter(|_| lora.saves(name));
            let Some(w) = kept else {
                return Err(Error::data(
                    what,
                    format!(
                        "`{name}` is neither a `lora_A` nor a `lora_B` weight, nor a module the \
                         adapter saves that the base model has"
                    ),
                ));
            };
            if w.shape() != a.shape {
                return Err(Error::data(
                    what,
                    format!(
                        "`{name}` has shape {:?}, the base's {:?}: the adapter and the base \
                         do not belong together",
                        a.shape,
                        w.shape()
                    ),
                ));
            }
            *w = StoredTensor::borrowed(*name, a.shape.clone(), &a.data)?;
            continue;
        };
        let b_name = format!("{module}.lora_B.weight");
        let b = *by_name
            .get(b_name.as_str())
            .ok_or_else(|| Error::data(what, format!("has `{name}` but no `{b_name}`")))?;
        let w_name = format!("{module}.weight");
        let w = tensors.get_mut(&w_name).ok_or_else(|| {
            Error::data(
                what,
                format!(
                    "adapts `{module}`, which the base model has no weight for (`{w_name}`): \
                     is it the adapter of another model?"
                ),
            )
        })?;
        let (r, inputs) = match a.shape[..] {
            [r, i] => (r, i),
            _ => {
                return Err(Error::data(
                    what,
                    format!("`{name}` is not a matrix: {:?}", a.shape),
                ))
            }
        };
        let outputs = match b.shape[..] {
            [o, rb] if rb == r => o,
            _ => {
                return Err(Error::data(
                    what,
                    format!(
                        "`{b_name}` has shape {:?}, `{name}` {:?}: B must be [out, {r}]",
                        b.shape, a.shape
                    ),
                ))
            }
        };
        let want = if fan_in_fan_out {
            [inputs, outputs]
        } else {
            [outputs, inputs]
        };
        if w.shape() != want {
            return Err(Error::data(
                what,
                format!(
                    "`{module}`'s update is {outputs} × {inputs} but the base's `{w_name}` is \
                     {:?}: the adapter and the base do not belong together",
                    w.shape()
                ),
            ));
        }
        let m_name = super::magnitude_name(module);
        let m = match by_name.get(m_name.as_str()) {
            Some(m) if m.data.len() == outputs => Some(&m.data[..]),
            Some(m) => {
                return Err(Error::data(
                    what,
                    format!(
                        "`{m_name}` has shape {:?}: DoRA's magnitude must be [{outputs}]",
                        m.shape
                    ),
                ))
            }
            None if lora.dora => {
                return Err(Error::data(
                    what,
                    format!("is a DoRA adapter but has no `{m_name}`"),
                ))
            }
            None => None,
        };
        let update = Update {
            a: &a.data,
            b: &b.data,
            m,
            rank: r,
            inputs,
            outputs,
            scale,
            fan_in_fan_out,
        };
        let base_w = w.clone();
        let shape = base_w.shape().to_vec();
        let compute = Arc::new(move |rows: Range<usize>| {
            let mut values = base_w.values()?;
            update.apply(&mut values);
            Ok(rows_of(&shape, rows, values))
        });
        *w = StoredTensor::computed(w_name, want.to_vec(), compute);
        merged += 1;
    }
    if merged == 0 {
        return Err(Error::data(what, "holds no LoRA update to merge"));
    }
    Ok(tensors.into_values().collect())
}

/// One module's low-rank update: `s·B·A` (`B` `[outputs, rank]`, `A` `[rank, inputs]`),
/// DoRA's magnitudes `m` when it has them.
#[derive(Clone, Copy)]
struct Update<'a> {
    a: &'a [f32],
    b: &'a [f32],
    m: Option<&'a [f32]>,
    rank: usize,
    inputs: usize,
    outputs: usize,
    scale: f64,
    fan_in_fan_out: bool,
}

impl Update<'_> {
    /// Adds the update to `w` (`[outputs, inputs]`, or `[inputs, outputs]` when
    /// `fan_in_fan_out`), then rescales DoRA's rows.
    fn apply(&self, w: &mut [f32]) {
        let (r, inputs, outputs) = (self.rank, self.inputs, self.outputs);
        for o in 0..outputs {
            for i in 0..inputs {
                let mut d = 0f64;
                for k in 0..r {
                    d += f64::from(self.b[o * r + k]) * f64::from(self.a[k * inputs + i]);
                }
                let at = if self.fan_in_fan_out {
                    i * outputs + o
                } else {
                    o * inputs + i
                };
                w[at] += (self.scale * d) as f32;
            }
        }
        if let Some(m) = self.m {
            rescale_rows(w, m, self.fan_in_fan_out);
        }
    }
}

/// Whether `name` is the tied head's copy of an embedding the adapter saves whole: named
/// `lm_head.weight` and equal to a saved `…embed_tokens.weight` or `…wte.weight`.
fn tied_copy(name: &str, t: &NamedTensor, saved: &BTreeMap<&str, &NamedTensor>) -> bool {
    name == super::HEAD_WEIGHT
        && saved.iter().any(|(n, e)| {
            (n.ends_with("embed_tokens.weight") || n.ends_with("wte.weight")) && e.data == t.data
        })
}

/// DoRA's merge: each output feature's row of `w` (`[out, in]`, or `[in, out]` when
/// `fan_in_fan_out`) scaled by `m[o] / ‖row‖`, the norm in f64.
fn rescale_rows(w: &mut [f32], m: &[f32], fan_in_fan_out: bool) {
    let outputs = m.len();
    let inputs = w.len() / outputs.max(1);
    let at = |o: usize, i: usize| {
        if fan_in_fan_out {
            i * outputs + o
        } else {
            o * inputs + i
        }
    };
    for (o, &m) in m.iter().enumerate() {
        let norm = (0..inputs)
            .map(|i| f64::from(w[at(o, i)]).powi(2))
            .sum::<f64>()
            .sqrt();
        let g = f64::from(m) / norm;
        for i in 0..inputs {
            let v = &mut w[at(o, i)];
            *v = (f64::from(*v) * g) as f32;
        }
    }
}

/// Writes `tensors` (the merged weights, [`merge`]'s) as a Hugging Face model directory
/// `out`, in `dtype`, with the base directory's `config.json`, generation config and
/// tokenizer files; each tensor is read (and merged) as the file reaches it. The
/// directory is swapped in whole ([`crate::save::DirectoryWriter`]), so a failure leaves
/// `out` as it was. `out` must not be the base.
pub fn write_merged(
    out: &std::path::Path,
    base_dir: &std::path::Path,
    tensors: &[StoredTensor<'_>],
    dtype: crate::tensor::DType,
) -> Result<()> {
    let same = |a: &std::path::Path, b: &std::path::Path| {
        a.canonicalize()
            .ok()
            .is_some_and(|a| b.canonicalize().ok() == Some(a))
    };
    if same(out, base_dir) {
        return Err(Error::config(
            "--out",
            format!(
                "{} is the base model's directory: write the merged model elsewhere",
                out.display()
            ),
        ));
    }
    if out.join(super::peft::ADAPTER_CONFIG).is_file() {
        return Err(Error::config(
            "--out",
            format!(
                "{} holds an adapter ({}): transformers would apply it again on top of the \
                 merged weights; write the merged model to another directory",
                out.display(),
                super::peft::ADAPTER_CONFIG
            ),
        ));
    }
    if !dtype.is_float() {
        return Err(Error::config(
            "--dtype",
            format!("{dtype} is not a float dtype: use f32, bf16 or f16"),
        ));
    }
    let w = crate::save::DirectoryWriter::new(out)?;
    for f in crate::save::MODEL_SIDE_FILES {
        let from = base_dir.join(f);
        if from.is_file() {
            std::fs::copy(&from, w.path(f)).map_err(|e| Error::io(&from, e))?;
        }
    }
    let typed: Vec<(StoredTensor<'_>, crate::tensor::DType)> =
        tensors.iter().map(|t| (t.clone(), dtype)).collect();
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    crate::save::write_stored(&w.path(crate::save::WEIGHTS_FILE), &typed, Some(meta))?;
    w.commit()
}

/// The dtype of a model directory's weights: that of the first floating-point tensor in
/// `model.safetensors` (or its first shard), read from the file's header alone.
pub fn weights_dtype(dir: &std::path::Path) -> Result<crate::tensor::DType> {
    use std::io::Read;
    let single = dir.join(crate::save::WEIGHTS_FILE);
    let file = if single.is_file() {
        single
    } else {
        let index = dir.join(crate::save::WEIGHTS_INDEX_FILE);
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::data(index.display().to_string(), format!("is not JSON: {e}")))?;
        let shard = v["weight_map"]
            .as_object()
            .and_then(|m| m.values().next())
            .and_then(|s| s.as_str())
            .ok_or_else(|| Error::data(index.display().to_string(), "has no weight_map"))?;
        dir.join(shard)
    };
    let what = file.display().to_string();
    let mut f = std::fs::File::open(&file).map_err(|e| Error::io(&file, e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| Error::io(&file, e))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(Error::data(
            what,
            "has a header over 100 MiB: not a safetensors file",
        ));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(|e| Error::io(&file, e))?;
    let v: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| Error::data(&what, format!("has no readable header: {e}")))?;
    let dtypes = v
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, t)| t["dtype"].as_str());
    for d in dtypes {
        match d {
            "F32" => return Ok(crate::tensor::DType::F32),
            "BF16" => return Ok(crate::tensor::DType::Bf16),
            "F16" => return Ok(crate::tensor::DType::F16),
            _ => {}
        }
    }
    Err(Error::data(what, "holds no f32, bf16 or f16 tensor"))
}
