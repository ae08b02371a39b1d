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
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

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
        let state = p
            .state()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = if t.label().is_empty() {
                    format!("{}.state.{i}", p.name())
                } else {
                    t.label().to_string()
                };
                // u8 codes are stored as bytes, bf16 moments as bf16 (so that a resumed
                // run keeps them in bf16), other floats as f32: exact for all.
                let dtype = match t.dtype() {
                    DType::U8 => DType::U8,
                    DType::Bf16 => DType::Bf16,
                    _ => DType::F32,
                };
                saved(be, t, name, dtype)
            })
            .collect::<Result<Vec<_>>>()?;
        let compensation = p
            .compensation()
            // bf16 values, exact in f32.
            .map(|t| saved(be, t, t.label().to_string(), DType::F32))
            .transpose()?;
        Ok(SavedParam {
            value: match with_value {
                true => be.to_f32(p.value())?,
                false => Vec::new(),
            },
            state,
            compensation,
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

/// Tensor `t` as saved under `name` in `dtype`.
fn saved(
    be: &dyn crate::device::Backend,
    t: &Tensor,
    name: String,
    dtype: DType,
) -> Result<SavedTensor> {
    Ok(SavedTensor {
        name,
        shape: t.shape().to_vec(),
        dtype,
        data: be.to_f32(t)?,
    })
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
    /// none of the frozen base's). Under ZeRO-1 every rank must call it: the rank that
    /// updates a parameter sends it to rank 0, one parameter at a time.
    pub(super) fn saved_params(
        &self,
        wanted: fn(&Param) -> bool,
    ) -> Result<Option<Vec<SavedParam>>> {
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
                    all.push(SavedParam::read(be, p, wanted(p))?);
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
                all.push(SavedParam::decode(&bytes, numel)?);
            }
        }
        Ok((rank == 0).then_some(all))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
