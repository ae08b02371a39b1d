//! A collective over a tensor wherever it lives: host tensors are summed in place, a
//! device tensor through a host copy ([`Backend::transfer`]).

use super::Collective;
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::tensor::{Storage, Tensor};
use half::{bf16, f16};
use std::sync::Arc;

/// Sums `t` over every rank, in place on every rank (a no-op for a world of one). Host
/// tensors of f32 are summed as they are; bf16 and f16 in f32, rounded once to their dtype
/// after the sum; a device tensor in place on the device where the engine sums device
/// memory (NCCL, in its dtype), else through a host copy of it.
pub fn all_reduce_tensor(c: &dyn Collective, be: &dyn Backend, t: &mut Tensor) -> Result<()> {
    if c.world() == 1 {
        return Ok(());
    }
    if c.all_reduce_device(t)? {
        return c.settle_device();
    }
    match t.storage_mut() {
        Storage::F32(v) => c.all_reduce_sum(v),
        Storage::Bf16(v) => sum_rounded(c, v, bf16::to_f32, bf16::from_f32),
        Storage::F16(v) => sum_rounded(c, v, f16::to_f32, f16::from_f32),
        Storage::Meta { .. } => Ok(()),
        Storage::Device(_) => {
            let (host, mut staged) = staging(be, t, "all_reduce")?;
            be.transfer(&mut staged, t)?;
            all_reduce_tensor(c, host.as_ref(), &mut staged)?;
            be.transfer(t, &staged)
        }
        Storage::U8(_) | Storage::Nf4 { .. } => Err(Error::config(
            t.label(),
            format!(
                "a {} tensor is not summed across ranks (only f32, bf16 and f16 are)",
                t.dtype()
            ),
        )),
    }
}

/// The host memory of `be`, through which device tensor `t` crosses ranks, and an empty
/// host tensor of its shape and dtype for it (labelled `{label}.{what}`).
fn staging(be: &dyn Backend, t: &Tensor, what: &str) -> Result<(Arc<dyn Backend>, Tensor)> {
    let host = host_of(be, t)?;
    let staged = host.empty(
        t.shape(),
        t.dtype(),
        MemoryCategory::Workspace,
        &format!("{}.{what}", t.label()),
    )?;
    Ok((host, staged))
}

/// The host memory of `be`, through which its tensor `t` crosses ranks.
pub(crate) fn host_of(be: &dyn Backend, t: &Tensor) -> Result<Arc<dyn Backend>> {
    be.host().ok_or_else(|| Error::Backend {
        backend: be.name(),
        message: format!(
            "{}: a device tensor crosses ranks through host memory, and this backend has none",
            t.label()
        ),
    })
}

/// Sums half-precision `values` across ranks in f32, rounding each sum once.
fn sum_rounded<T: Copy>(
    c: &dyn Collective,
    values: &mut [T],
    widen: fn(T) -> f32,
    round: fn(f32) -> T,
) -> Result<()> {
    let mut sum: Vec<f32> = values.iter().map(|&x| widen(x)).collect();
    c.all_reduce_sum(&mut sum)?;
    values.iter_mut().zip(sum).for_each(|(x, s)| *x = round(s));
    Ok(())
}

/// Rank `root`'s `t` on every rank, in place (a no-op for a world of one): host tensors
/// as they are, a device tensor through a host copy of it. Every rank's `t` has the same
/// shape and dtype.
pub fn broadcast_tensor(
    c: &dyn Collective,
    be: &dyn Backend,
    t: &mut Tensor,
    root: usize,
) -> Result<()> {
    if c.world() == 1 {
        return Ok(());
    }
    if c.broadcast_device(t, root)? {
        return c.settle_device();
    }
    match t.storage_mut() {
        Storage::F32(v) => broadcast_values(c, v, root, f32::to_le_bytes, f32::from_le_bytes),
        Storage::Bf16(v) => broadcast_values(
            c,
            v,
            root,
            |x| x.to_bits().to_le_bytes(),
            |b| bf16::from_bits(u16::from_le_bytes(b)),
        ),
        Storage::F16(v) => broadcast_values(
            c,
            v,
            root,
            |x| x.to_bits().to_le_bytes(),
            |b| f16::from_bits(u16::from_le_bytes(b)),
        ),
        Storage::U8(v) => c.broadcast(v, root),
        Storage::Meta { .. } => Ok(()),
        Storage::Device(_) => {
            let (host, mut staged) = staging(be, t, "broadcast")?;
            if c.rank() == root {
                be.transfer(&mut staged, t)?;
            }
            broadcast_tensor(c, host.as_ref(), &mut staged, root)?;
            if c.rank() != root {
                be.transfer(t, &staged)?;
            }
            Ok(())
        }
        Storage::Nf4 { .. } => Err(Error::config(
            t.label(),
            "an NF4 tensor is not sent across ranks (it never trains)",
        )),
    }
}

/// Rank `root`'s `values` on every rank, through their little-endian bytes.
fn broadcast_values<T: Copy, const N: usize>(
    c: &dyn Collective,
    values: &mut [T],
    root: usize,
    to_bytes: fn(T) -> [u8; N],
    from_bytes: fn([u8; N]) -> T,
) -> Result<()> {
    let mut bytes: Vec<u8> = values.iter().flat_map(|&x| to_bytes(x)).collect();
    c.broadcast(&mut bytes, root)?;
    for (x, b) in values.iter_mut().zip(bytes.chunks_exact(N)) {
        *x = from_bytes(b.try_into().expect("chunks of N bytes"));
    }
    Ok(())
}

/// Rank `root`'s `bytes` (of any length) on every rank: the other ranks pass anything
/// (their `bytes` are replaced).
pub fn broadcast_bytes(c: &dyn Collective, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
    if c.world() == 1 {
        return Ok(());
    }
    let mut len = (bytes.len() as u64).to_le_bytes();
    c.broadcast(&mut len, root)?;
    bytes.resize(u64::from_le_bytes(len) as usize, 0);
    c.broadcast(bytes, root)
}
