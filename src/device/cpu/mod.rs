//! The CPU backend: the reference implementation of the backend's primitives and
//! products, and the host side of the kernel door (every op family's CPU twin runs here,
//! through [`crate::device::OpKernel::cpu`]).
//!
//! Arithmetic is f32; bf16 tensors are stored as `half::bf16` and rounded where a GPU
//! kernel stores its output. Every reduction runs in a fixed order (work is split into
//! chunks whose boundaries depend on the shape only, never on the thread count), so the same
//! inputs give bitwise-equal outputs, which the recompute policies rely on.
//!
//! The helpers every twin uses live here: [`read`] and [`write()`] (a tensor's elements as
//! f32), the shared checks (`ensure`, `ensure_shape`, `ensure_float`, `matmul::dims`,
//! `elementwise::same_len`) and the fixed-order lanes of `simd`.
//!
//! Every op is one span in the ledger ([`Ledger::op`]) carrying the floating-point
//! operations it executed, the same count on every backend, each multiply, add, exp,
//! square root or division counting one: 2·m·n·k for a matmul (plus m·n with a bias), 2
//! per element for `sum_squares`; each op family states its own counts beside its check
//! (`src/ops/<family>/mod.rs`). Copies, casts, fills and transfers count 0.

mod blas;
pub(crate) mod elementwise;
pub(crate) mod matmul;
mod pool;
pub(crate) mod product;
pub(crate) mod simd;

use super::{Backend, Device};
use crate::error::{Error, Result};
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};
pub use blas::{Blas, BLAS_ENV};
use half::{bf16, f16};
pub(crate) use pool::{BufferPool, HostPin};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

/// Elements per parallel chunk of element-wise work.
pub(crate) const CHUNK: usize = 1 << 14;

/// `per` operations on each of `n` elements.
pub(crate) fn each(n: usize, per: u64) -> u64 {
    (n as u64).saturating_mul(per)
}

/// The reference backend, running on the host with rayon threads.
///
/// Matrix products run on the `gemm` crate, or on a CBLAS library loaded at run time
/// ([`CpuBackend::with_blas`], [`CpuBackend::from_env`]).
#[derive(Debug)]
pub struct CpuBackend {
    ledger: Ledger,
    pool: Arc<BufferPool>,
    blas: Option<Arc<Blas>>,
    /// Host memory held for a device ([`Backend::host`]): every tensor is counted under
    /// [`MemoryCategory::Offloaded`].
    for_device: bool,
    /// This backend's [`Backend::host`], made on first use.
    host: OnceLock<Arc<CpuBackend>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A CPU backend with its own ledger, running its matrix products on the `gemm`
    /// crate.
    pub fn new() -> Self {
        let ledger = Ledger::new();
        CpuBackend {
            pool: Arc::new(BufferPool::new(ledger.clone())),
            ledger,
            blas: None,
            for_device: false,
            host: OnceLock::new(),
        }
    }

    /// Host memory held for a device whose ledger is `ledger`: a CPU backend counting
    /// every tensor it makes there under [`MemoryCategory::Offloaded`] (what
    /// [`Backend::host`] returns).
    pub fn host_for(ledger: &Ledger) -> Self {
        CpuBackend {
            pool: Arc::new(BufferPool::for_host(ledger.clone(), None)),
            ledger: ledger.clone(),
            blas: None,
            for_device: true,
            host: OnceLock::new(),
        }
    }

    /// [`CpuBackend::host_for`] whose weights and gradients (the tensors that cross to the
    /// device) are page-locked by `pin` when first made, so that the device copies them
    /// asynchronously; master weights and optimizer state stay pageable.
    pub(crate) fn host_for_pinned(ledger: &Ledger, pin: Arc<dyn HostPin>) -> Self {
        CpuBackend {
            pool: Arc::new(BufferPool::for_host(ledger.clone(), Some(pin))),
            ..Self::host_for(ledger)
        }
    }

    /// How many of this backend's buffers are page-locked now (a host memory held for a
    /// GPU locks the weights and gradients it makes).
    pub fn pinned_buffers(&self) -> usize {
        self.pool.pinned_buffers()
    }

    /// The category a tensor made as `category` is counted under.
    fn place(&self, category: MemoryCategory) -> MemoryCategory {
        if self.for_device {
            category.in_host_memory()
        } else {
            category
        }
    }

    /// A CPU backend whose matrix products run on `blas` (see [`Blas`]).
    pub fn with_blas(blas: Arc<Blas>) -> Self {
        CpuBackend {
            blas: Some(blas),
            ..Self::new()
        }
    }

    /// [`CpuBackend::with_blas`] with the library named by `$TRAINKIT_BLAS` when it is set
    /// and not empty, else [`CpuBackend::new`]. A library that cannot be used is an error
    /// naming the variable and what it should point at.
    pub fn from_env() -> Result<Self> {
        match Blas::path_from_env() {
            Some(path) => Ok(Self::with_blas(Arc::new(Blas::load(path)?))),
            None => Ok(Self::new()),
        }
    }

    /// The CBLAS library running the matrix products, if any.
    pub fn blas(&self) -> Option<&Blas> {
        self.blas.as_deref()
    }

    /// Host bytes the caching allocator holds for reuse (not in the ledger, which counts
    /// live tensors).
    pub fn cached_bytes(&self) -> u64 {
        self.pool.cached_bytes()
    }

    /// A tensor whose storage comes from the pool when possible; `zero` fills it.
    fn alloc(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
        zero: bool,
    ) -> Result<Tensor> {
        let crosses = crosses(category);
        let category = self.place(category);
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes(n) as u64;
        // Ask the ledger first so a refused allocation never touches host memory.
        if let Some(err) = self.ledger.would_refuse(category, bytes, label) {
            return Err(err);
        }
        let mut fresh = false;
        let storage = match dtype {
            DType::F32 => Storage::F32(match self.pool.take_f32(n) {
                Some(mut v) => {
                    if zero {
                        v.fill(0.0);
                    }
                    v
                }
                None => {
                    fresh = true;
                    vec![0.0; n]
                }
            }),
            DType::Bf16 => Storage::Bf16(match self.pool.take_bf16(n) {
                Some(mut v) => {
                    if zero {
                        v.fill(bf16::ZERO);
                    }
                    v
                }
                None => {
                    fresh = true;
                    vec![bf16::ZERO; n]
                }
            }),
            DType::F16 => Storage::F16(match self.pool.take_f16(n) {
                Some(mut v) => {
                    if zero {
                        v.fill(f16::ZERO);
                    }
                    v
                }
                None => {
                    fresh = true;
                    vec![f16::ZERO; n]
                }
            }),
            DType::U8 => {
                fresh = true;
                Storage::U8(vec![0; n])
            }
            DType::Nf4(parts) => {
                fresh = true;
                Storage::Nf4 {
                    bytes: vec![0; dtype.bytes(n)],
                    len: n,
                    parts,
                }
            }
        };
        let t = Tensor::new(storage, shape, category, label, &self.ledger)?
            .with_pool(self.pool.clone());
        if fresh && crosses {
            // Locked once it is the pool's to free (and unlock).
            self.pool.pin(t.storage());
        }
        Ok(t)
    }
}

/// Whether tensors of `category` cross between host memory held for a device and the
/// device (weights, streamed weights and gradients): locked where the pool locks buffers.
fn crosses(category: MemoryCategory) -> bool {
    matches!(
        category,
        MemoryCategory::Weights | MemoryCategory::Gradients | MemoryCategory::Streamed
    )
}

/// The bytes of a host tensor's elements, laid out as on a device (little-endian
/// elements, which is the host's order on every platform trainkit builds for); `None` for
/// a tensor that is not in host memory.
pub(crate) fn host_bytes(storage: &Storage) -> Option<&[u8]> {
    fn bytes_of<T>(v: &[T]) -> &[u8] {
        // SAFETY: f32, bf16, f16 and u8 are plain values without padding; the slice
        // covers exactly the vector's initialized elements.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    match storage {
        Storage::F32(v) => Some(bytes_of(v)),
        Storage::Bf16(v) => Some(bytes_of(v)),
        Storage::F16(v) => Some(bytes_of(v)),
        Storage::U8(v) => Some(v),
        Storage::Nf4 { bytes, .. } => Some(bytes),
        Storage::Device(_) | Storage::Meta { .. } => None,
    }
}

/// [`host_bytes`], writable.
pub(crate) fn host_bytes_mut(storage: &mut Storage) -> Option<&mut [u8]> {
    fn bytes_of<T>(v: &mut [T]) -> &mut [u8] {
        // SAFETY: as in `host_bytes`; every bit pattern is a valid f32, bf16, f16 or u8.
        unsafe {
            std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v))
        }
    }
    match storage {
        Storage::F32(v) => Some(bytes_of(v)),
        Storage::Bf16(v) => Some(bytes_of(v)),
        Storage::F16(v) => Some(bytes_of(v)),
        Storage::U8(v) => Some(v),
        Storage::Nf4 { bytes, .. } => Some(bytes),
        Storage::Device(_) | Storage::Meta { .. } => None,
    }
}

/// The elements of `t` as f32, borrowed when `t` is f32.
///
/// A tensor of the CUDA backend is copied from the device (slow, and only for mixing
/// backends in tests); a device failure during that copy panics, as there is no way to
/// return it here.
pub fn read(t: &Tensor) -> Cow<'_, [f32]> {
    match t.storage() {
        Storage::Device(d) => Cow::Owned(
            d.to_f32()
                .unwrap_or_else(|e| panic!("reading `{}` from the GPU failed: {e}", t.label())),
        ),
        Storage::Meta { len, .. } => Cow::Owned(vec![0.0; *len]),
        Storage::F32(v) => Cow::Borrowed(v.as_slice()),
        Storage::U8(v) => Cow::Owned(v.iter().map(|&c| f32::from(c)).collect()),
        Storage::Nf4 { bytes, len, parts } => {
            Cow::Owned(crate::tensor::nf4::dequantize_parts(bytes, *len, *parts))
        }
        Storage::Bf16(v) => Cow::Owned(widen(v, bf16::to_f32)),
        Storage::F16(v) => Cow::Owned(widen(v, f16::to_f32)),
    }
}

/// Host storage of `dtype` holding `data`, each value rounded to the dtype (f32 data
/// already owned is kept as it is).
fn host_storage(data: Cow<'_, [f32]>, dtype: DType) -> Storage {
    match dtype {
        DType::F32 => Storage::F32(data.into_owned()),
        DType::Bf16 => Storage::Bf16(data.iter().map(|x| bf16::from_f32(*x)).collect()),
        DType::F16 => Storage::F16(data.iter().map(|x| f16::from_f32(*x)).collect()),
        DType::U8 => Storage::U8(data.iter().map(|x| DType::U8.round(*x) as u8).collect()),
        DType::Nf4(parts) => Storage::Nf4 {
            bytes: crate::tensor::nf4::quantize_parts(&data, parts),
            len: data.len(),
            parts,
        },
    }
}

/// `v` widened to f32 in parallel chunks.
fn widen<T: Copy + Sync>(v: &[T], f: impl Fn(T) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    out.par_chunks_mut(CHUNK)
        .zip(v.par_chunks(CHUNK))
        .for_each(|(o, i)| {
            for (o, i) in o.iter_mut().zip(i) {
                *o = f(*i);
            }
        });
    out
}

/// Runs `f` on `v` widened to f32 (zeros unless `load`) and narrows the result back with
/// `narrow` (rounding to nearest even).
fn through_f32<T: Copy + Send + Sync, R>(
    v: &mut [T],
    load: bool,
    widen_one: impl Fn(T) -> f32 + Sync,
    narrow: impl Fn(f32) -> T + Sync,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    let mut tmp = if load {
        widen(v, widen_one)
    } else {
        vec![0f32; v.len()]
    };
    let r = f(&mut tmp);
    v.par_chunks_mut(CHUNK)
        .zip(tmp.par_chunks(CHUNK))
        .for_each(|(o, i)| {
            for (o, i) in o.iter_mut().zip(i) {
                *o = narrow(*i);
            }
        });
    r
}

/// Runs `f` on the elements of `t` as f32 and stores the result in `t`'s dtype.
/// With `load`, `f` sees the current contents (for accumulation); otherwise zeros.
pub fn write<R>(t: &mut Tensor, load: bool, f: impl FnOnce(&mut [f32]) -> R) -> R {
    match t.storage_mut() {
        Storage::Device(d) => {
            let fail = |e: Error| -> ! { panic!("writing a tensor on the GPU failed: {e}") };
            let mut tmp = if load {
                d.to_f32().unwrap_or_else(|e| fail(e))
            } else {
                vec![0f32; d.len()]
            };
            let r = f(&mut tmp);
            d.write_f32(&tmp).unwrap_or_else(|e| fail(e));
            r
        }
        Storage::Meta { len, .. } => f(&mut vec![0.0; *len]),
        Storage::F32(v) => f(v.as_mut_slice()),
        Storage::U8(v) => {
            let mut tmp: Vec<f32> = if load {
                v.iter().map(|&c| f32::from(c)).collect()
            } else {
                vec![0f32; v.len()]
            };
            let r = f(&mut tmp);
            for (o, i) in v.iter_mut().zip(&tmp) {
                *o = DType::U8.round(*i) as u8;
            }
            r
        }
        Storage::Nf4 { bytes, len, parts } => {
            let mut tmp: Vec<f32> = if load {
                crate::tensor::nf4::dequantize_parts(bytes, *len, *parts)
            } else {
                vec![0f32; *len]
            };
            let r = f(&mut tmp);
            *bytes = crate::tensor::nf4::quantize_parts(&tmp, *parts);
            r
        }
        Storage::Bf16(v) => through_f32(v, load, bf16::to_f32, bf16::from_f32, f),
        Storage::F16(v) => through_f32(v, load, f16::to_f32, f16::from_f32, f),
    }
}

/// Fails with a shape error unless `ok`.
pub(crate) fn ensure(ok: bool, op: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::shape(op, message()))
    }
}

/// Fails unless `t` has exactly `shape`.
pub(crate) fn ensure_shape(t: &Tensor, shape: &[usize], op: &'static str) -> Result<()> {
    ensure(t.shape() == shape, op, || {
        format!(
            "`{}` has shape {:?}, expected {:?}",
            t.label(),
            t.shape(),
            shape
        )
    })
}

/// Fails unless every tensor of `ts` holds numbers (f32 or bf16): the arithmetic ops
/// refuse u8 codes.
pub(crate) fn ensure_float(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    for t in ts {
        ensure(t.dtype().is_float(), op, || {
            format!(
                "`{}` is {}, which holds codes, not numbers: {op} takes f32 or bf16 tensors",
                t.label(),
                t.dtype()
            )
        })?;
    }
    Ok(())
}

/// Fails unless `t` is f32.
pub(crate) fn ensure_f32(t: &Tensor, op: &'static str) -> Result<()> {
    ensure(t.dtype() == DType::F32, op, || {
        format!("`{}` must be f32, it is {}", t.label(), t.dtype())
    })
}

/// `[B, T, C]` of a rank-3 tensor.
pub(crate) fn btc(t: &Tensor, op: &'static str) -> Result<(usize, usize, usize)> {
    match *t.shape() {
        [b, tt, c] => Ok((b, tt, c)),
        _ => Err(Error::shape(
            op,
            format!("`{}` must be [B, T, C], it is {:?}", t.label(), t.shape()),
        )),
    }
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `SendPtr`).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn dispatch(&self, call: &mut dyn super::OpKernel) -> Result<()> {
        call.cpu(self)
    }

    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label, true)
    }

    fn empty(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label, false)
    }

    fn upload_kernel(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        let t = Tensor::new(
            host_storage(Cow::Borrowed(data), dtype),
            shape,
            self.place(category),
            label,
            &self.ledger,
        )?;
        if !self.for_device || !crosses(category) {
            return Ok(t);
        }
        // Host memory held for a device, which copies it over: locked where the pool
        // locks buffers, as `alloc` locks them.
        let t = t.with_pool(self.pool.clone());
        self.pool.pin(t.storage());
        Ok(t)
    }

    fn to_f32_kernel(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(read(t).into_owned())
    }

    fn copy_kernel(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        let storage = match t.storage() {
            Storage::F32(v) => Storage::F32(v.clone()),
            Storage::Bf16(v) => Storage::Bf16(v.clone()),
            Storage::F16(v) => Storage::F16(v.clone()),
            Storage::U8(v) => Storage::U8(v.clone()),
            Storage::Nf4 { bytes, len, parts } => Storage::Nf4 {
                bytes: bytes.clone(),
                len: *len,
                parts: *parts,
            },
            Storage::Meta { len, dtype } => Storage::Meta {
                len: *len,
                dtype: *dtype,
            },
            Storage::Device(d) => host_storage(Cow::Owned(d.to_f32()?), d.dtype()),
        };
        Tensor::new(
            storage,
            t.shape(),
            self.place(category),
            label,
            &self.ledger,
        )
    }

    fn host(&self) -> Option<Arc<dyn Backend>> {
        if self.for_device {
            return None;
        }
        let host = self
            .host
            .get_or_init(|| Arc::new(CpuBackend::host_for(&self.ledger)));
        Some(Arc::clone(host) as Arc<dyn Backend>)
    }

    fn transfer_kernel(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        // Dtypes and sizes agree (the shared check), so the bytes do too.
        if let (Some(d), Some(s)) = (host_bytes_mut(dst.storage_mut()), host_bytes(src.storage())) {
            d.copy_from_slice(s);
            return Ok(());
        }
        Err(Error::Backend {
            backend: "cpu",
            message: format!(
                "`{}` and `{}` are not both in host memory",
                dst.label(),
                src.label()
            ),
        })
    }

    fn matmul_kernel(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        matmul::matmul(self.blas(), out, a, b, bias, trans_a, trans_b, accumulate)
    }
}
