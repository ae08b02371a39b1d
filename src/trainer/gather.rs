//! What a checkpoint saves of each parameter (its f32 values, optimizer state and Kahan
//! compensation), read where it lives: on this process, or under ZeRO-1 on the rank that
//! owns its update, from which rank 0 receives it. A checkpoint of a sharded run is the
//! same files as one of an unsharded run, written by rank 0 alone.

use super::Trainer;
use crate::accumulate::AccumulationSchedule;
use crate::checkpoint::CheckpointPolicy;
use crate::collective::broadcast_bytes;
use crate::error::{Error, Result};
use crate::memory::MemoryObserver;
use crate::model::Param;
use crate::optim::Optimizer;
use crate::precision::Precision;
use crate::save::stored::rows_of;
use crate::save::StoredTensor;
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// A tensor as a checkpoint saves it.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct SavedTensor {
    /// Its name in the state file.
    pub(super) name: String,
    /// Its shape.
    pub(super) shape: Vec<usize>,
    /// The dtype it is stored in (exact for its values).
    pub(super) dtype: DType,
    /// Its values.
    #[serde(skip)]
    pub(super) data: Vec<f32>,
}

/// One parameter as a checkpoint saves it.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
pub(super) struct SavedParam {
    /// The f32 values the optimizer updates (master weights, or the weights).
    #[serde(skip)]
    pub(super) value: Vec<f32>,
    /// The optimizer state slots, in order.
    pub(super) state: Vec<SavedTensor>,
    /// The Kahan compensation, when kept.
    pub(super) compensation: Option<SavedTensor>,
}

impl SavedParam {
    /// `p` as it is here, its values read only `with_value`.
    fn read(be: &dyn crate::device::Backend, p: &Param, with_value: bool) -> Result<SavedParam> {
        let read = |(name, dtype, t): (String, DType, &Tensor)| {
            Ok(SavedTensor {
                name,
                shape: t.shape().to_vec(),
                dtype,
                data: be.to_f32(t)?,
            })
        };
        Ok(SavedParam {
            value: match with_value {
                true => be.to_f32(p.value())?,
                false => Vec::new(),
            },
            state: state_layout(p)
                .into_iter()
                .map(read)
                .collect::<Result<_>>()?,
            compensation: compensation_layout(p).map(read).transpose()?,
        })
    }

    /// The bytes another rank rebuilds it from ([`SavedParam::decode`]): the length of a
    /// JSON header, the header (names, shapes, dtypes), then every value in order.
    fn encode(&self) -> Result<Vec<u8>> {
        let header = serde_json::to_vec(self).map_err(|e| Error::Serde(e.to_string()))?;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        for v in self.all_values() {
            bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
        Ok(bytes)
    }

    /// The parameter of `numel` values (0 when sent without them) [`SavedParam::encode`]
    /// wrote into `bytes`.
    fn decode(bytes: &[u8], numel: usize) -> Result<SavedParam> {
        let broken = |what: &str| Error::Backend {
            backend: "collective",
            message: format!("a parameter's saved state came across ranks {what}"),
        };
        let len = bytes
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| broken("without its header"))?;
        let header = bytes
            .get(8..8 + len)
            .ok_or_else(|| broken("with its header cut"))?;
        let mut p: SavedParam =
            serde_json::from_slice(header).map_err(|e| broken(&format!("unreadable: {e}")))?;
        let mut values = bytes[8 + len..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")));
        p.value = values.by_ref().take(numel).collect();
        let mut whole = p.value.len() == numel;
        for t in p.state.iter_mut().chain(p.compensation.as_mut()) {
            let n = t.shape.iter().product();
            t.data = values.by_ref().take(n).collect();
            whole &= t.data.len() == n;
        }
        if !whole || values.next().is_some() {
            return Err(broken("with the wrong number of values"));
        }
        Ok(p)
    }

    /// The value, then each state slot's, then the compensation's.
    fn all_values(&self) -> impl Iterator<Item = &Vec<f32>> {
        std::iter::once(&self.value)
            .chain(self.state.iter().map(|t| &t.data))
            .chain(self.compensation.iter().map(|t| &t.data))
    }
}

/// Each optimizer-state slot of `p` with its name in the state file and the dtype it is
/// saved in: u8 codes as bytes, bf16 moments as bf16 (so that a resumed run keeps them in
/// bf16), other floats as f32: exact for all.
fn state_layout(p: &Param) -> Vec<(String, DType, &Tensor)> {
    p.state()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = if t.label().is_empty() {
                format!("{}.state.{i}", p.name())
            } else {
                t.label().to_string()
            };
            let dtype = match t.dtype() {
                DType::U8 => DType::U8,
                DType::Bf16 => DType::Bf16,
                _ => DType::F32,
            };
            (name, dtype, t)
        })
        .collect()
}

/// The Kahan compensation of `p`, when kept: bf16 values, saved as f32 (exact).
fn compensation_layout(p: &Param) -> Option<(String, DType, &Tensor)> {
    p.compensation()
        .map(|t| (t.label().to_string(), DType::F32, t))
}

/// A tensor to write and the dtype the file stores it in.
pub(super) type Typed<'a> = (StoredTensor<'a>, DType);

/// A parameter as a checkpoint saves it: here, read from where training keeps it only as
/// the files are written (one tensor's values in host memory at a time), or received
/// from the rank that updates it (under ZeRO-1), its values held.
pub(super) enum Saved<'p> {
    /// A parameter this process holds.
    Here(&'p Param),
    /// A parameter received from its owner.
    Received(SavedParam),
}

impl<'p> Saved<'p> {
    /// Its f32 values (the master weights where the precision keeps them) as a tensor
    /// read when asked; `index` is its place in the model, the key of `cache`.
    pub(super) fn value<'a>(
        &'a self,
        p: &Param,
        index: usize,
        be: &'a dyn crate::device::Backend,
        cache: &'a RowCache,
    ) -> Result<StoredTensor<'a>> {
        let shape = p.shape().to_vec();
        match self {
            Saved::Here(p) => {
                let rows = shape.first().copied().unwrap_or(1);
                let compute = Arc::new(move |range: Range<usize>| {
                    cache.rows(index, rows, range, || be.to_f32(p.value()))
                });
                Ok(StoredTensor::computed(p.name(), shape, compute))
            }
            Saved::Received(s) => StoredTensor::borrowed(p.name(), shape, &s.value),
        }
    }

    /// Its optimizer-state slots and Kahan compensation as the state file names and
    /// types them, read when asked.
    pub(super) fn state<'a>(
        &'a self,
        be: &'a dyn crate::device::Backend,
    ) -> Result<(Vec<Typed<'a>>, Option<Typed<'a>>)> {
        let here = |(name, dtype, t): (String, DType, &'a Tensor)| {
            let compute =
                Arc::new(move |range: Range<usize>| Ok(rows_of(t.shape(), range, be.to_f32(t)?)));
            (
                StoredTensor::computed(name, t.shape().to_vec(), compute),
                dtype,
            )
        };
        let received = |t: &'a SavedTensor| {
            Ok((
                StoredTensor::borrowed(&t.name, t.shape.clone(), &t.data)?,
                t.dtype,
            ))
        };
        Ok(match self {
            Saved::Here(p) => (
                state_layout(p).into_iter().map(here).collect(),
                compensation_layout(p).map(here),
            ),
            Saved::Received(s) => (
                s.state.iter().map(received).collect::<Result<_>>()?,
                s.compensation.as_ref().map(received).transpose()?,
            ),
        })
    }
}

/// The parameters a save read in part, kept while a file still wants rows of them:
/// Hugging Face's files split a fused parameter (`qkv_proj`) into tensors (`q_proj`,
/// `k_proj`, `v_proj`) that a file does not write one after another, and each would read
/// the whole parameter from the device again. [`RowCache::plan`] counts the rows the
/// files will ask of each parameter; one leaves as soon as they were given, and one asked
/// once (read whole, or cut to the vocabulary) is not kept at all.
#[derive(Default)]
pub(super) struct RowCache {
    state: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    kept: Vec<Kept>,
    /// The rows each parameter (by index) will be asked in all, where planned.
    asked: HashMap<usize, usize>,
}

struct Kept {
    index: usize,
    values: Vec<f32>,
    rows_given: usize,
}

impl RowCache {
    /// Counts the rows `written` (the files' tensors, read from `read`: the parameters'
    /// tensors by index) ask of each parameter, so that each is let go as soon as its last
    /// rows were given. A parameter not planned is kept until every row of it was given.
    pub(super) fn plan(&self, read: &[StoredTensor], written: &[StoredTensor]) {
        let index: HashMap<usize, usize> = read
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((t.computation()?, i)))
            .collect();
        let mut asked = HashMap::new();
        for t in written {
            t.computed_reads(&mut |id, rows| {
                if let Some(&i) = index.get(&id) {
                    *asked.entry(i).or_default() += rows.len();
                }
            });
        }
        self.state.lock().unwrap_or_else(|e| e.into_inner()).asked = asked;
    }

    /// Rows `range` of parameter `index` (of `rows` rows), whose values `read` gives.
    fn rows(
        &self,
        index: usize,
        rows: usize,
        range: Range<usize>,
        read: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let asked = state.asked.get(&index).copied().unwrap_or(rows);
        let at = match state.kept.iter().position(|k| k.index == index) {
            Some(at) => at,
            None => {
                let values = read()?;
                if range.len() >= asked {
                    let cols = values.len() / rows.max(1);
                    return Ok(rows_of(&[rows, cols], range, values));
                }
                state.kept.push(Kept {
                    index,
                    values,
                    rows_given: 0,
                });
                state.kept.len() - 1
            }
        };
        let k = &mut state.kept[at];
        let cols = k.values.len() / rows.max(1);
        let out = k.values[range.start * cols..range.end * cols].to_vec();
        k.rows_given += range.len();
        if k.rows_given >= asked {
            state.kept.remove(at);
        }
        Ok(out)
    }

    /// The parameters kept now.
    #[cfg(test)]
    fn kept(&self) -> Vec<usize> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.kept.iter().map(|k| k.index).collect()
    }
}

impl<P, C, O, A, M> Trainer<P, C, O, A, M>
where
    P: Precision,
    C: CheckpointPolicy,
    O: Optimizer,
    A: AccumulationSchedule,
    M: MemoryObserver,
{
    /// Every parameter as a checkpoint saves it, in model order, on rank 0 (`None` on the
    /// other ranks), with its values where `wanted` says (an adapter's checkpoint reads
    /// none of the frozen base's). A parameter this process updates is read as the files
    /// are written. Under ZeRO-1 every rank must call it: the rank that updates a
    /// parameter sends it to rank 0, one parameter at a time.
    pub(super) fn saved_params(
        &self,
        wanted: fn(&Param) -> bool,
    ) -> Result<Option<Vec<Saved<'_>>>> {
        let c = self.collective.as_ref();
        let rank = c.rank();
        if self.owners.is_empty() && rank != 0 {
            return Ok(None);
        }
        let be = self.backend.as_ref();
        let mut all = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let owner = self.owner_of(i);
            if !p.trains() || owner == 0 {
                if rank == 0 {
                    all.push(Saved::Here(p));
                }
                continue;
            }
            let mut bytes = if owner == rank {
                SavedParam::read(be, p, wanted(p))?.encode()?
            } else {
                Vec::new()
            };
            broadcast_bytes(c, &mut bytes, owner)?;
            if rank == 0 {
                let numel = if wanted(p) { p.numel() } else { 0 };
                all.push(Saved::Received(SavedParam::decode(&bytes, numel)?));
            }
        }
        Ok((rank == 0).then_some(all))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parameter a file reads in parts is read from the device once while its parts
    /// are asked in turn, and let go once every row was given; one read whole is not
    /// kept; a failed read keeps nothing.
    #[test]
    fn the_row_cache_reads_a_split_parameter_once() {
        let cache = RowCache::default();
        let reads = std::cell::Cell::new(0);
        let read = |k: usize| {
            reads.set(reads.get() + 1);
            Ok((0..12).map(|i| (k * 100 + i) as f32).collect::<Vec<f32>>())
        };
        // Parameter 0: 6 rows of 2, asked as rows 0..2, 2..4, then 4..6.
        assert_eq!(
            cache.rows(0, 6, 0..2, || read(0)).unwrap(),
            [0.0, 1.0, 2.0, 3.0]
        );
        // Another, read whole in between, is not kept.
        assert_eq!(cache.rows(1, 6, 0..6, || read(1)).unwrap().len(), 12);
        assert_eq!(cache.kept(), [0]);
        assert_eq!(
            cache.rows(0, 6, 2..4, || read(0)).unwrap(),
            [4.0, 5.0, 6.0, 7.0]
        );
        assert_eq!(
            cache.rows(0, 6, 4..6, || read(0)).unwrap(),
            [8.0, 9.0, 10.0, 11.0]
        );
        assert_eq!(reads.get(), 2);
        assert!(cache.kept().is_empty());
        // Every row given: asked again, it is read again.
        cache.rows(0, 6, 0..1, || read(0)).unwrap();
        assert_eq!(reads.get(), 3);
        // A failed read is the caller's error and keeps nothing.
        let e = cache
            .rows(4, 6, 0..1, || Err(Error::data("w", "lost")))
            .unwrap_err();
        assert!(e.to_string().contains("lost"));
        assert_eq!(cache.kept(), [0]);
    }

    /// Planned from the files' tensors, the cache keeps a parameter split three ways
    /// (q, k, v) until its last part was written and one cut to the vocabulary's rows
    /// (asked once, in part) not at all; each is read once.
    #[test]
    fn a_planned_row_cache_keeps_a_parameter_until_its_last_rows_are_written() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let cache = RowCache::default();
        let reads = AtomicUsize::new(0);
        let param = |index: usize, rows: usize| {
            let (cache, reads) = (&cache, &reads);
            let compute = Arc::new(move |range: Range<usize>| {
                cache.rows(index, rows, range, || {
                    reads.fetch_add(1, Ordering::Relaxed);
                    Ok((0..rows * 2).map(|i| (index * 100 + i) as f32).collect())
                })
            });
            StoredTensor::computed(format!("p{index}"), vec![rows, 2], compute)
        };
        let params = [param(0, 6), param(1, 5)];
        let written = [
            params[0].rows("q", 0..2).unwrap(),
            params[1].rows("embedding", 0..4).unwrap(),
            params[0].rows("k", 2..4).unwrap(),
            params[0].rows("v", 4..6).unwrap(),
        ];
        cache.plan(&params, &written);
        let mut kept = Vec::new();
        for t in &written {
            let values = t.values().unwrap();
            assert_eq!(values.len(), t.len());
            kept.push(cache.kept());
        }
        assert_eq!(kept, [vec![0], vec![0], vec![0], vec![]]);
        assert_eq!(reads.load(Ordering::Relaxed), 2);
        assert_eq!(written[1].values().unwrap()[..3], [100.0, 101.0, 102.0]);
        assert_eq!(written[3].values().unwrap(), [8.0, 9.0, 10.0, 11.0]);
    }

    #[test]
    fn a_saved_parameter_comes_back_from_its_bytes_exactly() {
        let p = SavedParam {
            value: vec![1.5, -0.0, f32::NAN, f32::INFINITY],
            state: vec![
                SavedTensor {
                    name: "w.exp_avg".into(),
                    shape: vec![2, 2],
                    dtype: DType::F32,
                    data: vec![0.25, 1e-30, -3.0, 7.0],
                },
                SavedTensor {
                    name: "w.codes".into(),
                    shape: vec![3],
                    dtype: DType::U8,
                    data: vec![0.0, 255.0, 17.0],
                },
            ],
            compensation: Some(SavedTensor {
                name: "w.kahan".into(),
                shape: vec![4],
                dtype: DType::F32,
                data: vec![1e-3, 0.0, -1e-3, 2e-3],
            }),
        };
        let back = SavedParam::decode(&p.encode().unwrap(), 4).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.value), bits(&p.value));
        assert_eq!(back.state, p.state);
        assert_eq!(back.compensation, p.compensation);
        // A parameter of another size is refused, not misread.
        assert!(SavedParam::decode(&p.encode().unwrap(), 5).is_err());
        assert!(SavedParam::decode(&[1, 2, 3], 4).is_err());
    }
}
