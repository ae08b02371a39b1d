//! Tensors read from their files when asked: a model directory's weights mapped into
//! memory, each converted to f32 only when its parameter takes it.
//!
//! Reading a model whole (every shard into memory, every tensor converted to f32) needs
//! 4 bytes per parameter of host memory at once on top of what training keeps: 282 GB for
//! a 70B model, 32 GB for an 8B one. A [`StoredTensor`] instead points into its file,
//! mapped read-only; [`StoredTensor::values`] reads and converts that one tensor (and
//! drops its pages from the process again), so loading a model holds one tensor's f32
//! values beside the parameters at a time. Stacking Hugging Face's separate projections
//! into trainkit's fused ones ([`StoredTensor::stack`]) and padding the vocabulary's rows
//! ([`StoredTensor::pad_rows`]) are recorded, not done, until then.

use super::tensors::{float_dtype, NamedTensor};
use crate::error::{Error, Result};
use crate::tensor::DType;
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// A tensor's name and shape, and where its values come from: a file mapped into memory,
/// values held in memory, or others stacked or padded. Cloning it copies no values.
#[derive(Clone)]
pub struct StoredTensor {
    /// Its name (in the file, or as the model reads it once renamed).
    pub name: String,
    shape: Vec<usize>,
    source: Source,
}

#[derive(Clone)]
enum Source {
    /// Values held in memory.
    Held(Arc<Vec<f32>>),
    /// Bytes `start..end` of a mapped file, in `dtype`.
    File {
        map: Arc<Mmap>,
        start: usize,
        end: usize,
        dtype: DType,
    },
    /// Tensors stacked along the first dimension, in order.
    Rows(Vec<StoredTensor>),
    /// A tensor with zeros after its values up to the shape's size.
    Padded(Box<StoredTensor>),
}

impl StoredTensor {
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its number of values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same tensor under another name.
    pub fn renamed(self, name: impl Into<String>) -> StoredTensor {
        StoredTensor {
            name: name.into(),
            ..self
        }
    }

    /// `parts` stacked along their first dimension under `name`; every part must have the
    /// same trailing dimensions (the first part's).
    pub fn stack(name: impl Into<String>, parts: Vec<StoredTensor>) -> Result<StoredTensor> {
        let name = name.into();
        let tail = parts
            .first()
            .map_or(&[][..], |p| &p.shape[1.min(p.shape.len())..]);
        let mut rows = 0;
        for p in &parts {
            if p.shape.is_empty() || &p.shape[1..] != tail {
                return Err(Error::data(
                    "model weights",
                    format!(
                        "`{}` has shape {:?}; stacking it into `{name}` needs rows of shape \
                         {tail:?}",
                        p.name, p.shape
                    ),
                ));
            }
            rows += p.shape[0];
        }
        let shape = std::iter::once(rows).chain(tail.iter().copied()).collect();
        Ok(StoredTensor {
            name,
            shape,
            source: Source::Rows(parts),
        })
    }

    /// The tensor with zero rows after its own, `rows` in all (at least its own).
    pub fn pad_rows(self, rows: usize) -> StoredTensor {
        match self.shape.first() {
            Some(&own) if rows > own => {
                let mut shape = self.shape.clone();
                shape[0] = rows;
                StoredTensor {
                    name: self.name.clone(),
                    shape,
                    source: Source::Padded(Box::new(self)),
                }
            }
            _ => self,
        }
    }

    /// Its values as f32, read and converted now (a mapped file's pages are dropped from
    /// the process again after the read).
    pub fn values(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        self.append_to(&mut out);
        out
    }

    /// Its name, shape and values (see [`StoredTensor::values`]).
    pub fn read(&self) -> NamedTensor {
        NamedTensor {
            name: self.name.clone(),
            shape: self.shape.clone(),
            data: self.values(),
        }
    }

    fn append_to(&self, out: &mut Vec<f32>) {
        match &self.source {
            Source::Held(values) => out.extend_from_slice(values),
            Source::File {
                map,
                start,
                end,
                dtype,
            } => {
                dtype.decode_into(&map[*start..*end], self.len(), out);
                crate::mapped::release(map, *start, end - start);
            }
            Source::Rows(parts) => parts.iter().for_each(|p| p.append_to(out)),
            Source::Padded(inner) => {
                let end = out.len() + self.len();
                inner.append_to(out);
                out.resize(end, 0.0);
            }
        }
    }
}

impl From<NamedTensor> for StoredTensor {
    /// Values already in memory.
    fn from(t: NamedTensor) -> StoredTensor {
        StoredTensor {
            name: t.name,
            shape: t.shape,
            source: Source::Held(Arc::new(t.data)),
        }
    }
}

impl fmt::Debug for StoredTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let from = match &self.source {
            Source::Held(_) => "memory".to_string(),
            Source::File { dtype, .. } => format!("file, {dtype}"),
            Source::Rows(parts) => format!("{} stacked", parts.len()),
            Source::Padded(_) => "padded".to_string(),
        };
        f.debug_struct("StoredTensor")
            .field("name", &self.name)
            .field("shape", &self.shape)
            .field("from", &from)
            .finish()
    }
}

/// Every tensor of a safetensors file, mapped into memory and read when asked; f32, bf16
/// and f16 tensors are taken (as [`super::read_safetensors`] takes them), any other dtype
/// is refused by name.
pub fn open_safetensors(path: &Path) -> Result<Vec<StoredTensor>> {
    let what = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only; a model file changed by another process while a run
    // reads it is outside what trainkit guards against (trainkit itself replaces files by
    // renaming new ones over them, which leaves a mapped file's contents as they were).
    let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
    let st = SafeTensors::deserialize(&map).map_err(|e| {
        Error::data(
            &what,
            format!("is not a readable safetensors file ({e}); was it truncated or overwritten?"),
        )
    })?;
    let base = map.as_ptr() as usize;
    let mut out = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = float_dtype(&what, &name, view.dtype())?;
            let start = view.data().as_ptr() as usize - base;
            Ok(StoredTensor {
                name,
                shape: view.shape().to_vec(),
                source: Source::File {
                    map: Arc::clone(&map),
                    start,
                    end: start + view.data().len(),
                    dtype,
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::save::{read_safetensors, write_typed};

    fn tensor(name: &str, shape: &[usize], from: f32) -> NamedTensor {
        let n: usize = shape.iter().product();
        NamedTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: (0..n).map(|i| from + i as f32 * 0.25).collect(),
        }
    }

    /// A mapped file's tensors read what reading the file whole reads, in every dtype;
    /// stacking and padding give the rows in order and then zeros.
    #[test]
    fn mapped_tensors_read_what_the_whole_file_reads() {
        let dir = std::env::temp_dir().join(format!("trainkit-stored-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let (a, b, c) = (
            tensor("a", &[3, 4], 1.0),
            tensor("b", &[2, 4], -3.0),
            tensor("c", &[5], 0.5),
        );
        let typed = [(&a, DType::F32), (&b, DType::Bf16), (&c, DType::F16)];
        write_typed(&path, &typed, None).unwrap();
        let whole = read_safetensors(&path).unwrap();
        let mapped = open_safetensors(&path).unwrap();
        assert_eq!(mapped.len(), 3);
        for (m, w) in mapped.iter().zip(&whole) {
            assert_eq!(m.read(), *w);
        }
        let stacked = StoredTensor::stack("ab", vec![mapped[0].clone(), mapped[1].clone()])
            .unwrap()
            .pad_rows(7);
        assert_eq!(stacked.shape(), [7, 4]);
        let v = stacked.values();
        assert_eq!(v[..12], whole[0].data[..]);
        assert_eq!(v[12..20], whole[1].data[..]);
        assert!(v[20..].iter().all(|&x| x == 0.0) && v.len() == 28);
        // A part whose rows differ is refused by name.
        let e = StoredTensor::stack("ac", vec![mapped[0].clone(), mapped[2].clone()])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`c`") && e.contains("`ac`"), "{e}");
        // Held values read as themselves; padding to fewer rows keeps the tensor.
        let held = StoredTensor::from(c.clone()).pad_rows(2);
        assert_eq!(held.read(), c);
        let junk = dir.join("junk.safetensors");
        std::fs::write(&junk, b"not a safetensors file").unwrap();
        let e = open_safetensors(&junk).unwrap_err().to_string();
        assert!(e.contains("not a readable safetensors file"), "{e}");
        // A dtype trainkit does not read is refused by name.
        let ints = dir.join("ints.safetensors");
        let bytes = [0u8; 16];
        let view =
            safetensors::tensor::TensorView::new(safetensors::tensor::Dtype::I64, vec![2], &bytes)
                .unwrap();
        std::fs::write(
            &ints,
            safetensors::serialize([("ids", view)], None).unwrap(),
        )
        .unwrap();
        let e = open_safetensors(&ints).unwrap_err().to_string();
        assert!(e.contains("`ids` is I64"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
