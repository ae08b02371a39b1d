//! Named tensors in the safetensors format.

use super::atomic::write_atomically_with;
use super::stored::StoredTensor;
use crate::error::{Error, Result};
use crate::tensor::DType;
use safetensors::tensor::{Dtype, View};
use safetensors::SafeTensorError;
use safetensors::SafeTensors;
use std::borrow::Cow;
use std::cell::RefCell;
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
/// that are integers 0 to 255, as [`DType::round`] keeps them). Each tensor is encoded as
/// it is written, so the file is never whole in memory.
pub(crate) fn write_typed(
    path: &Path,
    tensors: &[(&NamedTensor, DType)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let stored = tensors
        .iter()
        .map(|&(t, dtype)| {
            Ok((
                StoredTensor::borrowed(&t.name, t.shape.clone(), &t.data)?,
                dtype,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    write_stored(path, &stored, metadata)
}

/// Writes each tensor in its dtype (as [`write_typed`] does), reading its values only when
/// the file reaches it: a file of tensors computed when asked (a model's parameters read
/// from the device) holds one tensor's values in memory at a time. A tensor that fails to
/// read fails the write with its error and leaves no file.
pub(crate) fn write_stored(
    path: &Path,
    tensors: &[(StoredTensor<'_>, DType)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let failed = RefCell::new(None);
    let views = tensors
        .iter()
        .map(|(t, dtype)| Ok((t.name.as_str(), Encoded::new(t, *dtype, &failed)?)))
        .collect::<Result<Vec<_>>>()?;
    let written = write_atomically_with(path, |tmp| {
        safetensors::tensor::serialize_to_file(views, metadata, tmp).map_err(|e| match e {
            SafeTensorError::IoError(e) => e,
            e => std::io::Error::other(format!("cannot serialize: {e}")),
        })?;
        match failed.borrow().is_some() {
            true => Err(std::io::Error::other("a tensor could not be read")),
            false => Ok(()),
        }
    });
    match failed.into_inner() {
        Some(e) => Err(e),
        None => written,
    }
}

/// A tensor as a safetensors file stores it, read and encoded in its dtype only when the
/// file is written. The first tensor that fails to read leaves its error in `failed`
/// (zeros take its place, and no later tensor is read) for the write to return.
struct Encoded<'t, 'a> {
    tensor: &'t StoredTensor<'a>,
    dtype: DType,
    file_dtype: Dtype,
    failed: &'t RefCell<Option<Error>>,
}

impl<'t, 'a> Encoded<'t, 'a> {
    fn new(
        tensor: &'t StoredTensor<'a>,
        dtype: DType,
        failed: &'t RefCell<Option<Error>>,
    ) -> Result<Encoded<'t, 'a>> {
        let file_dtype = match dtype {
            DType::F32 => Dtype::F32,
            DType::Bf16 => Dtype::BF16,
            DType::F16 => Dtype::F16,
            DType::U8 => Dtype::U8,
            DType::Nf4(_) => {
                return Err(Error::data(
                    &tensor.name,
                    "is NF4: a safetensors file holds it dequantized (save it as bf16 or f32)",
                ))
            }
        };
        Ok(Encoded {
            tensor,
            dtype,
            file_dtype,
            failed,
        })
    }
}

impl View for Encoded<'_, '_> {
    fn dtype(&self) -> Dtype {
        self.file_dtype
    }

    fn shape(&self) -> &[usize] {
        self.tensor.shape()
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if self.failed.borrow().is_none() {
            match self.tensor.values() {
                Ok(values) => return Cow::Owned(self.dtype.encode(&values)),
                Err(e) => *self.failed.borrow_mut() = Some(e),
            }
        }
        Cow::Owned(vec![0; self.data_len()])
    }

    fn data_len(&self) -> usize {
        self.tensor.len() * self.file_dtype.bitsize() / 8
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// A file written tensor by tensor holds the bytes safetensors' whole-buffer
    /// serialization gives, in every dtype, metadata included; a tensor whose values do
    /// not fill its shape is refused by name and leaves no file.
    #[test]
    fn written_piece_by_piece_equals_the_whole_buffer() {
        let dir = std::env::temp_dir().join(format!("trainkit-typed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = |name: &str, shape: &[usize]| NamedTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: (0..shape.iter().product::<usize>())
                .map(|i| (i % 200) as f32 * 0.5)
                .collect(),
        };
        let (a, b, c, d) = (t("w", &[3, 5]), t("m", &[7]), t("v", &[2, 2]), t("q", &[9]));
        let typed = [
            (&a, DType::F32),
            (&b, DType::Bf16),
            (&c, DType::F16),
            (&d, DType::U8),
        ];
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let path = dir.join("t.safetensors");
        write_typed(&path, &typed, Some(meta.clone())).unwrap();
        let bytes: Vec<Vec<u8>> = typed.iter().map(|(t, d)| d.encode(&t.data)).collect();
        let views: Vec<(String, TensorView)> = typed
            .iter()
            .zip(&bytes)
            .map(|((t, d), b)| {
                let dtype = match d {
                    DType::F32 => Dtype::F32,
                    DType::Bf16 => Dtype::BF16,
                    DType::F16 => Dtype::F16,
                    _ => Dtype::U8,
                };
                (
                    t.name.clone(),
                    TensorView::new(dtype, t.shape.clone(), b).unwrap(),
                )
            })
            .collect();
        let whole = safetensors::serialize(views, Some(meta)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), whole);

        let short = NamedTensor {
            data: vec![0.0; 4],
            ..t("short", &[5])
        };
        let bad = dir.join("bad.safetensors");
        let e = write_typed(&bad, &[(&short, DType::F32)], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("short") && e.contains("4 values"), "{e}");
        assert!(!bad.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Computed tensors are read only as the file reaches them, in the file's order, and
    /// give the file the held tensors give; one that fails fails the write with its own
    /// error, leaves no file, and no tensor after it is read.
    #[test]
    fn computed_tensors_are_read_as_they_are_written() {
        use std::sync::{Arc, Mutex};
        let dir = std::env::temp_dir().join(format!("trainkit-lazy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let held: Vec<NamedTensor> = (0..4)
            .map(|k| NamedTensor {
                name: format!("t{k}"),
                shape: vec![3, 2],
                data: (0..6).map(|i| (k * 10 + i) as f32 * 0.25).collect(),
            })
            .collect();
        let reads = Arc::new(Mutex::new(Vec::new()));
        let computed = |fail_at: Option<usize>| -> Vec<(StoredTensor<'_>, DType)> {
            held.iter()
                .enumerate()
                .rev()
                .map(|(k, t)| {
                    let reads = Arc::clone(&reads);
                    let compute = Arc::new(move |rows: std::ops::Range<usize>| {
                        reads.lock().unwrap().push(k);
                        if fail_at == Some(k) {
                            return Err(Error::data(format!("t{k}"), "could not be read back"));
                        }
                        Ok(t.data[rows.start * 2..rows.end * 2].to_vec())
                    });
                    let s = StoredTensor::computed(&t.name, t.shape.clone(), compute);
                    (s, DType::Bf16)
                })
                .collect()
        };
        let lazy = dir.join("lazy.safetensors");
        let tensors = computed(None);
        assert!(reads.lock().unwrap().is_empty());
        write_stored(&lazy, &tensors, None).unwrap();
        assert_eq!(*reads.lock().unwrap(), [0, 1, 2, 3]);
        let typed: Vec<_> = held.iter().map(|t| (t, DType::Bf16)).collect();
        let whole = dir.join("whole.safetensors");
        write_typed(&whole, &typed, None).unwrap();
        assert_eq!(
            std::fs::read(&lazy).unwrap(),
            std::fs::read(&whole).unwrap()
        );

        reads.lock().unwrap().clear();
        let bad = dir.join("bad.safetensors");
        let e = write_stored(&bad, &computed(Some(1)), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t1") && e.contains("could not be read back"),
            "{e}"
        );
        assert!(!bad.exists());
        assert_eq!(*reads.lock().unwrap(), [0, 1]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
