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
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// A tensor's name and shape, and where its values come from: a file mapped into memory,
/// values held or borrowed in memory, values computed when asked (a parameter read from
/// the device as a save writes it), or others stacked, sliced or padded. Cloning it copies
/// no values. `'a` is how long borrowed values and computations live (`'static` for a
/// model directory's tensors).
#[derive(Clone)]
pub struct StoredTensor<'a> {
    /// Its name (in the file, or as the model reads it once renamed).
    pub name: String,
    shape: Vec<usize>,
    source: Source<'a>,
}

/// How a [`StoredTensor`]'s values are computed when asked: the rows `rows` (of its first
/// dimension; every row when the tensor is a scalar or empty) of the whole tensor as f32.
pub type Compute<'a> = Arc<dyn Fn(Range<usize>) -> Result<Vec<f32>> + Send + Sync + 'a>;

/// Rows `range` of a tensor of `shape` (of its first dimension; every value when it is a
/// scalar) whose every value is `all`: `all` itself when the range is every row, else a
/// copy of those rows. For a [`Compute`] that reads its tensor whole.
pub fn rows_of(shape: &[usize], range: Range<usize>, all: Vec<f32>) -> Vec<f32> {
    if range == (0..shape.first().copied().unwrap_or(1)) {
        return all;
    }
    let cols: usize = shape.iter().skip(1).product();
    all[range.start * cols..range.end * cols].to_vec()
}

/// A piece of the rows a read walks ([`StoredTensor::walk`]).
enum Piece<'t, 'a> {
    /// Rows of a tensor that holds, maps or computes its values.
    Own(&'t StoredTensor<'a>, Range<usize>),
    /// Rows of zeros, this many.
    Zeros(usize),
}

/// The identity of a computation: where its closure lives, shared by its clones.
fn identity(c: &Compute<'_>) -> usize {
    Arc::as_ptr(c) as *const () as usize
}

#[derive(Clone)]
enum Source<'a> {
    /// Values held in memory.
    Held(Arc<Vec<f32>>),
    /// Values borrowed.
    Borrowed(&'a [f32]),
    /// Bytes `start..end` of a mapped file, in `dtype`.
    File {
        map: Arc<Mmap>,
        start: usize,
        end: usize,
        dtype: DType,
    },
    /// Computed when asked.
    Computed(Compute<'a>),
    /// Tensors stacked along the first dimension, in order.
    Rows(Vec<StoredTensor<'a>>),
    /// Rows `start..` of another tensor (as many as the shape says).
    Slice(Box<StoredTensor<'a>>, usize),
    /// A tensor with zeros after its values up to the shape's size.
    Padded(Box<StoredTensor<'a>>),
}

impl<'a> StoredTensor<'a> {
    /// A tensor whose values `compute` gives when they are read (see [`Compute`]), called
    /// once per read; errors it returns are the read's.
    pub fn computed(
        name: impl Into<String>,
        shape: Vec<usize>,
        compute: Compute<'a>,
    ) -> StoredTensor<'a> {
        StoredTensor {
            name: name.into(),
            shape,
            source: Source::Computed(compute),
        }
    }

    /// Values borrowed from memory, read when asked; `values` must fill `shape`.
    pub fn borrowed(
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &'a [f32],
    ) -> Result<StoredTensor<'a>> {
        let name = name.into();
        let n: usize = shape.iter().product();
        if n != values.len() {
            return Err(Error::data(
                &name,
                format!(
                    "holds {} values, its shape {shape:?} says {n}",
                    values.len()
                ),
            ));
        }
        Ok(StoredTensor {
            name,
            shape,
            source: Source::Borrowed(values),
        })
    }

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
    pub fn renamed(self, name: impl Into<String>) -> StoredTensor<'a> {
        StoredTensor {
            name: name.into(),
            ..self
        }
    }

    /// `parts` stacked along their first dimension under `name`; every part must have the
    /// same trailing dimensions (the first part's).
    pub fn stack(
        name: impl Into<String>,
        parts: Vec<StoredTensor<'a>>,
    ) -> Result<StoredTensor<'a>> {
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

    /// Rows `rows` of the tensor (along its first dimension) under `name`: the inverse of
    /// [`StoredTensor::stack`]. Rows past the tensor's are an error naming both.
    pub fn rows(&self, name: impl Into<String>, rows: Range<usize>) -> Result<StoredTensor<'a>> {
        let name = name.into();
        match self.shape.first() {
            Some(&n) if rows.start <= rows.end && rows.end <= n => {
                let mut shape = self.shape.clone();
                shape[0] = rows.len();
                Ok(StoredTensor {
                    name,
                    shape,
                    source: Source::Slice(Box::new(self.clone()), rows.start),
                })
            }
            _ => Err(Error::data(
                &self.name,
                format!(
                    "has shape {:?}: it has no rows {rows:?} to give `{name}`",
                    self.shape
                ),
            )),
        }
    }

    /// The tensor with zero rows after its own, `rows` in all (at least its own).
    pub fn pad_rows(self, rows: usize) -> StoredTensor<'a> {
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

    /// The computation this tensor's values come from, when it is computed itself
    /// ([`StoredTensor::computed`]): an identity that [`StoredTensor::computed_reads`]
    /// reports too, the same for its clones.
    pub(crate) fn computation(&self) -> Option<usize> {
        match &self.source {
            Source::Computed(c) => Some(identity(c)),
            _ => None,
        }
    }

    /// Tells `asked`, for every computation a read of all its values calls (by
    /// [`StoredTensor::computation`]'s identity, in the order it calls them), the rows it
    /// asks of it; nothing is computed or read.
    pub(crate) fn computed_reads(&self, asked: &mut dyn FnMut(usize, Range<usize>)) {
        let every = 0..self.shape.first().copied().unwrap_or(1);
        let _ = self.walk(every, &mut |piece| {
            if let Piece::Own(t, rows) = piece {
                if let Some(id) = t.computation() {
                    asked(id, rows);
                }
            }
            Ok(())
        });
    }

    /// Its values as f32, read and converted now (a mapped file's pages are dropped from
    /// the process again after the read; a computed tensor computes them). Only a
    /// computed tensor can fail.
    pub fn values(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.len());
        self.append_rows(0..self.shape.first().copied().unwrap_or(1), &mut out)?;
        Ok(out)
    }

    /// Its name, shape and values (see [`StoredTensor::values`]).
    pub fn read(&self) -> Result<NamedTensor> {
        Ok(NamedTensor {
            name: self.name.clone(),
            shape: self.shape.clone(),
            data: self.values()?,
        })
    }

    /// Values in a row.
    fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Appends the values of rows `rows` (every value when the tensor has no rows:
    /// a scalar, `rows` is then `0..1`).
    fn append_rows(&self, rows: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        let cols = self.row_len();
        self.walk(rows, &mut |piece| match piece {
            Piece::Own(t, rows) => t.append_own(rows, out),
            Piece::Zeros(n) => {
                out.resize(out.len() + n * cols, 0.0);
                Ok(())
            }
        })
    }

    /// Hands `visit` the pieces rows `rows` are made of, in order: rows of tensors that
    /// hold, map or compute their values, and rows of padding.
    fn walk<'t>(
        &'t self,
        rows: Range<usize>,
        visit: &mut dyn FnMut(Piece<'t, 'a>) -> Result<()>,
    ) -> Result<()> {
        match &self.source {
            Source::Rows(parts) => {
                let mut at = 0;
                for p in parts {
                    let n = p.shape[0];
                    let (lo, hi) = (rows.start.max(at), rows.end.min(at + n));
                    if lo < hi {
                        p.walk(lo - at..hi - at, visit)?;
                    }
                    at += n;
                }
                Ok(())
            }
            Source::Slice(of, first) => of.walk(first + rows.start..first + rows.end, visit),
            Source::Padded(inner) => {
                let own = inner.shape[0];
                if rows.start < own {
                    inner.walk(rows.start..rows.end.min(own), visit)?;
                }
                match rows.end.saturating_sub(own.max(rows.start)) {
                    0 => Ok(()),
                    zeros => visit(Piece::Zeros(zeros)),
                }
            }
            _ => visit(Piece::Own(self, rows)),
        }
    }

    /// Appends rows `rows` of a tensor that holds, maps or computes its own values.
    fn append_own(&self, rows: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        let cols = self.row_len();
        match &self.source {
            Source::Held(values) => {
                out.extend_from_slice(&values[rows.start * cols..rows.end * cols])
            }
            Source::Borrowed(values) => {
                out.extend_from_slice(&values[rows.start * cols..rows.end * cols])
            }
            Source::File {
                map,
                start,
                end,
                dtype,
            } => {
                let width = dtype.bytes(cols);
                let from = start + rows.start * width;
                let to = (start + rows.end * width).min(*end);
                dtype.decode_into(&map[from..to], rows.len() * cols, out);
                crate::mapped::release(map, from, to - from);
            }
            Source::Computed(compute) => {
                let values = compute(rows.clone())?;
                if values.len() != rows.len() * cols {
                    return Err(Error::data(
                        &self.name,
                        format!(
                            "was computed as {} values where rows {rows:?} of shape {:?} \
                             hold {}",
                            values.len(),
                            self.shape,
                            rows.len() * cols
                        ),
                    ));
                }
                out.extend_from_slice(&values);
            }
            Source::Rows(_) | Source::Slice(..) | Source::Padded(_) => {
                self.append_rows(rows, out)?
            }
        }
        Ok(())
    }
}

impl From<NamedTensor> for StoredTensor<'static> {
    /// Values already in memory.
    fn from(t: NamedTensor) -> StoredTensor<'static> {
        StoredTensor {
            name: t.name,
            shape: t.shape,
            source: Source::Held(Arc::new(t.data)),
        }
    }
}

impl fmt::Debug for StoredTensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let from = match &self.source {
            Source::Held(_) | Source::Borrowed(_) => "memory".to_string(),
            Source::File { dtype, .. } => format!("file, {dtype}"),
            Source::Computed(_) => "computed".to_string(),
            Source::Rows(parts) => format!("{} stacked", parts.len()),
            Source::Slice(of, first) => format!("rows of `{}` from {first}", of.name),
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
pub fn open_safetensors(path: &Path) -> Result<Vec<StoredTensor<'static>>> {
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
    use crate::save::read_safetensors;
    use crate::save::tensors::write_typed;

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
            assert_eq!(m.read().unwrap(), *w);
        }
        let stacked = StoredTensor::stack("ab", vec![mapped[0].clone(), mapped[1].clone()])
            .unwrap()
            .pad_rows(7);
        assert_eq!(stacked.shape(), [7, 4]);
        let v = stacked.values().unwrap();
        assert_eq!(v[..12], whole[0].data[..]);
        assert_eq!(v[12..20], whole[1].data[..]);
        assert!(v[20..].iter().all(|&x| x == 0.0) && v.len() == 28);
        // Any rows of it read what the whole tensor holds there: across the stacked
        // parts, into the padding, a mapped file read in part.
        for lo in 0..=7 {
            for hi in lo..=7 {
                let part = stacked.rows("part", lo..hi).unwrap();
                assert_eq!(part.shape(), [hi - lo, 4]);
                assert_eq!(part.values().unwrap(), v[lo * 4..hi * 4], "rows {lo}..{hi}");
                let inner = part.rows("inner", 0..hi - lo).unwrap().values().unwrap();
                assert_eq!(inner, v[lo * 4..hi * 4]);
            }
        }
        let e = stacked.rows("past", 6..8).unwrap_err().to_string();
        assert!(e.contains("`past`") && e.contains("[7, 4]"), "{e}");
        // A part whose rows differ is refused by name.
        let e = StoredTensor::stack("ac", vec![mapped[0].clone(), mapped[2].clone()])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`c`") && e.contains("`ac`"), "{e}");
        // Held values read as themselves; padding to fewer rows keeps the tensor.
        let held = StoredTensor::from(c.clone()).pad_rows(2);
        assert_eq!(held.read().unwrap(), c);
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
