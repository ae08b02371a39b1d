//! Named tensors in the safetensors format.

use super::write_atomically;
use crate::error::{Error, Result};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::Path;

/// A tensor's name, shape and values (as f32, whatever the file stored).
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    /// Its name in the file.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values, row-major.
    pub data: Vec<f32>,
}

/// Writes `tensors` as f32 to a safetensors file (atomically), with `metadata` in its
/// header.
pub fn write_safetensors(
    path: &Path,
    tensors: &[NamedTensor],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(Dtype::F32, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| Error::data(&t.name, format!("cannot be stored: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let buffer = safetensors::serialize(views, metadata)
        .map_err(|e| Error::data(path.display().to_string(), format!("cannot serialize: {e}")))?;
    write_atomically(path, &buffer)
}

/// Reads every tensor of a safetensors file, converting f32, bf16 and f16 to f32.
pub fn read_safetensors(path: &Path) -> Result<Vec<NamedTensor>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_safetensors(path, &bytes)
}

/// Decodes the bytes of a safetensors file (what [`read_safetensors`] does after reading
/// it); `path` only names the file in errors.
pub fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<Vec<NamedTensor>> {
    let what = path.display().to_string();
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        Error::data(
            &what,
            format!("is not a readable safetensors file ({e}); was it truncated or overwritten?"),
        )
    })?;
    let mut out: Vec<NamedTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let raw = view.data();
            let data = match view.dtype() {
                Dtype::F32 => raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                Dtype::BF16 => raw
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::F16 => raw
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => {
                    return Err(Error::data(
                        &what,
                        format!(
                            "tensor `{name}` is {other:?}; trainkit reads F32, BF16 and F16 \
                             weights"
                        ),
                    ))
                }
            };
            Ok(NamedTensor {
                name,
                shape: view.shape().to_vec(),
                data,
            })
        })
        .collect::<Result<_>>()?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}
