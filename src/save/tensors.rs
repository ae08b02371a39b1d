//! Named tensors in the safetensors format.

use super::atomic::write_atomically;
use crate::error::{Error, Result};
use crate::tensor::DType;
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
    let typed: Vec<(&NamedTensor, DType)> = tensors.iter().map(|t| (t, DType::F32)).collect();
    write_typed(path, &typed, metadata)
}

/// Writes each tensor in its dtype: f32, bf16 or f16 (rounded to nearest even) or u8 (values
/// that are integers 0 to 255, as [`DType::round`] keeps them).
pub(crate) fn write_typed(
    path: &Path,
    tensors: &[(&NamedTensor, DType)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(t, dtype)| dtype.encode(&t.data))
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((t, dtype), b)| {
            let file_dtype = match dtype {
                DType::F32 => Dtype::F32,
                DType::Bf16 => Dtype::BF16,
                DType::F16 => Dtype::F16,
                DType::U8 => Dtype::U8,
                DType::Nf4(_) => {
                    return Err(Error::data(
                        &t.name,
                        "is NF4: a safetensors file holds it dequantized (save it as bf16 or \
                         f32)",
                    ))
                }
            };
            TensorView::new(file_dtype, t.shape.clone(), b)
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
    Ok(parse_typed(path, bytes, false)?
        .into_iter()
        .map(|(t, _)| t)
        .collect())
}

/// Reads every tensor of a safetensors file with the dtype a tensor of trainkit keeps it
/// in: u8 for u8 (optimizer codes), bf16 for bf16 (AdamW's bf16 moments), f32 for the
/// rest.
pub(crate) fn read_typed(path: &Path) -> Result<Vec<(NamedTensor, DType)>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_typed(path, &bytes, true)
}

/// The dtype of a tensor of floats in a file: f32, bf16 or f16; any other is an error
/// naming the file (`what`) and the tensor.
pub(super) fn float_dtype(what: &str, name: &str, dtype: Dtype) -> Result<DType> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::BF16 => Ok(DType::Bf16),
        Dtype::F16 => Ok(DType::F16),
        other => Err(Error::data(
            what,
            format!("tensor `{name}` is {other:?}; trainkit reads F32, BF16 and F16 weights"),
        )),
    }
}

fn parse_typed(path: &Path, bytes: &[u8], u8_ok: bool) -> Result<Vec<(NamedTensor, DType)>> {
    let what = path.display().to_string();
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        Error::data(
            &what,
            format!("is not a readable safetensors file ({e}); was it truncated or overwritten?"),
        )
    })?;
    let mut out: Vec<(NamedTensor, DType)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let raw = view.data();
            let file_dtype = match view.dtype() {
                Dtype::U8 if u8_ok => DType::U8,
                other => float_dtype(&what, &name, other)?,
            };
            let data = file_dtype.decode(raw, view.shape().iter().product());
            // u8 codes stay codes and bf16 stays bf16 (AdamW's bf16 moments); other floats
            // come back as f32.
            let dtype = match file_dtype {
                DType::U8 | DType::Bf16 => file_dtype,
                _ => DType::F32,
            };
            let t = NamedTensor {
                name,
                shape: view.shape().to_vec(),
                data,
            };
            Ok((t, dtype))
        })
        .collect::<Result<_>>()?;
    out.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    Ok(out)
}
