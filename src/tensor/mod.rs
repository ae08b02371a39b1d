//! `Tensor`: a shaped buffer on a device, tagged with its memory category and a label;
//! [`DType`], what its elements are, and [`nf4`], the packed NF4 layout.

pub mod nf4;

use crate::device::cuda::DeviceBuffer;
use crate::error::{Error, Result};
use crate::memory::{Ledger, MemoryCategory};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16: f32's exponent range with 8 bits of mantissa.
    Bf16,
    /// IEEE half precision: 11 bits of mantissa, values up to 65504, subnormals down to
    /// 2⁻²⁴ (the compute dtype of [`crate::precision::MixedFp16`]).
    F16,
    /// Unsigned bytes: codes, not numbers to compute with (the quantized moments of
    /// [`crate::optim::AdamW8bit`]). They are uploaded, copied, read back as f32 (0 to
    /// 255, exactly) and counted in the ledger at one byte each; the arithmetic ops
    /// refuse them with an error naming the op.
    U8,
    /// NF4, packed: frozen weights at 4.127 bits per element (QLoRA's base projections),
    /// as bitsandbytes stores them ([`nf4`], computed by [`crate::ops::nf4`]). Uploading f32 values quantizes
    /// them, reading back dequantizes; the ledger counts the packed bytes
    /// ([`DType::bytes`]). Only the NF4 family's kernels compute with it: the arithmetic
    /// ops refuse it with an error naming the op. A fused weight is quantized in
    /// [`Parts`](nf4::Parts), one per Hugging Face module ([`DType::NF4`]: one
    /// part).
    Nf4(nf4::Parts),
}

impl DType {
    /// NF4 in one part.
    pub const NF4: DType = DType::Nf4(nf4::Parts::WHOLE);

    /// Whether this is NF4 (in any parts).
    pub fn is_nf4(self) -> bool {
        matches!(self, DType::Nf4(_))
    }

    /// Bytes per element of the unpacked dtypes; NF4's half byte plus its share of the
    /// block statistics is counted by [`DType::bytes`], and here as 1.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
            DType::F16 => 2,
            DType::U8 | DType::Nf4(_) => 1,
        }
    }

    /// Exact bytes of `n` elements (for NF4, the packed layout: codes, absmax codes, their
    /// scales and the offset).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            DType::Nf4(parts) => parts.bytes(n),
            _ => n * self.size(),
        }
    }

    /// Rounds an f32 value to this dtype's precision (round to nearest even), as stored;
    /// for u8, to the nearest integer in 0..=255 (NaN to 0). NF4 rounds a block at a time
    /// ([`nf4::quantize`]), not a value: it is returned as it is.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::Bf16 => bf16::from_f32(x).to_f32(),
            DType::F16 => f16::from_f32(x).to_f32(),
            DType::U8 => x.round_ties_even().clamp(0.0, 255.0) as u8 as f32,
            DType::Nf4(_) => x,
        }
    }

    /// `values` rounded to this dtype as little-endian elements: safetensors' layout and
    /// the device's (NF4: quantized and packed).
    pub(crate) fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::Bf16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::U8 => values.iter().map(|v| DType::U8.round(*v) as u8).collect(),
            DType::Nf4(parts) => nf4::quantize_parts(values, parts),
        }
    }

    /// `n` little-endian elements of this dtype, widened to f32 (exactly; NF4 dequantized).
    pub(crate) fn decode(self, raw: &[u8], n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        self.decode_into(raw, n, &mut out);
        out
    }

    /// [`DType::decode`] appended to `out`, without a buffer of its own between.
    pub(crate) fn decode_into(self, raw: &[u8], n: usize, out: &mut Vec<f32>) {
        match self {
            DType::F32 => out.extend(
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            DType::Bf16 => out.extend(
                raw.chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            DType::F16 => out.extend(
                raw.chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            DType::U8 => out.extend(raw.iter().map(|&c| f32::from(c))),
            DType::Nf4(parts) if out.is_empty() => *out = nf4::dequantize_parts(raw, n, parts),
            DType::Nf4(parts) => out.extend(nf4::dequantize_parts(raw, n, parts)),
        }
    }

    /// Whether the dtype holds numbers the arithmetic ops compute with (f32, bf16, f16).
    pub fn is_float(self) -> bool {
        !matches!(self, DType::U8 | DType::Nf4(_))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
            DType::Nf4(_) => "nf4",
        })
    }
}

/// Where a tensor's elements live. Backends match on it; users never need to.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Host memory, f32 elements.
    F32(Vec<f32>),
    /// Host memory, bf16 elements.
    Bf16(Vec<bf16>),
    /// Host memory, f16 elements.
    F16(Vec<f16>),
    /// Host memory, u8 elements.
    U8(Vec<u8>),
    /// Host memory, `len` NF4 elements packed in `parts` as [`nf4::Layout`]
    /// says.
    Nf4 {
        /// The packed bytes.
        bytes: Vec<u8>,
        /// Elements.
        len: usize,
        /// The parts, each quantized on its own.
        parts: nf4::Parts,
    },
    /// GPU memory (or the emulator's host stand-in for it), any dtype.
    Device(DeviceBuffer),
    /// No elements at all: the meta backend's tensors, which have a shape, a dtype and
    /// ledger bytes but hold no data.
    Meta { len: usize, dtype: DType },
}

impl Storage {
    fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::Bf16(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::U8(v) => v.len(),
            Storage::Nf4 { len, .. } => *len,
            Storage::Device(d) => d.len(),
            Storage::Meta { len, .. } => *len,
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::Bf16(_) => DType::Bf16,
            Storage::F16(_) => DType::F16,
            Storage::U8(_) => DType::U8,
            Storage::Nf4 { parts, .. } => DType::Nf4(*parts),
            Storage::Device(d) => d.dtype(),
            Storage::Meta { dtype, .. } => *dtype,
        }
    }
}

/// A shaped buffer owned by a backend. Its bytes are in the backend's [`Ledger`] from
/// creation to drop, under its [`MemoryCategory`] and label.
///
/// Where a dropped tensor's storage goes instead of being freed: a backend's pool of host
/// buffers (`device::cpu::BufferPool`), which hands it to the next allocation of its
/// length.
pub(crate) trait StorageSink: std::fmt::Debug + Send + Sync {
    /// Takes the storage of a tensor being dropped.
    fn put(&self, storage: Storage);
}

/// Tensors are created by [`crate::Backend`] methods and read back with
/// [`crate::Backend::to_f32`]; they are not `Clone` (a copy is an allocation:
/// [`crate::Backend::copy`]).
#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    category: MemoryCategory,
    label: String,
    storage: Storage,
    ledger: Ledger,
    pool: Option<Arc<dyn StorageSink>>,
    id: u64,
}

impl Tensor {
    /// Wraps `storage`, registering its bytes in `ledger`.
    pub(crate) fn new(
        storage: Storage,
        shape: &[usize],
        category: MemoryCategory,
        label: impl Into<String>,
        ledger: &Ledger,
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        let label = label.into();
        if numel != storage.len() {
            return Err(Error::shape(
                "tensor",
                format!(
                    "`{label}`: shape {shape:?} holds {numel} elements but {} were given",
                    storage.len()
                ),
            ));
        }
        let bytes = storage.dtype().bytes(numel) as u64;
        let id = ledger.alloc(category, bytes, &label)?;
        Ok(Tensor {
            shape: shape.to_vec(),
            category,
            label,
            storage,
            ledger: ledger.clone(),
            pool: None,
            id,
        })
    }

    /// Returns the storage to `pool` when the tensor is dropped.
    pub(crate) fn with_pool(mut self, pool: Arc<dyn StorageSink>) -> Tensor {
        self.pool = Some(pool);
        self
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The memory category the ledger counts this tensor under.
    pub fn category(&self) -> MemoryCategory {
        self.category
    }

    /// The label the ledger and observers show for this tensor.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Exact bytes of the elements.
    pub fn bytes(&self) -> u64 {
        self.dtype().bytes(self.numel()) as u64
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Gives the tensor another shape with as many elements (its elements are untouched:
    /// a row-major tensor read as `[rows, cols]` instead of `[n]`, say).
    pub fn reshape(&mut self, shape: &[usize]) -> Result<()> {
        let numel: usize = shape.iter().product();
        if numel != self.numel() {
            return Err(Error::shape(
                "reshape",
                format!(
                    "`{}`: {:?} holds {} elements, {shape:?} would hold {numel}",
                    self.label,
                    self.shape,
                    self.numel()
                ),
            ));
        }
        self.shape = shape.to_vec();
        Ok(())
    }

    /// The shape as a matrix: all leading dimensions are rows, the last is columns.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape.split_last() {
            Some((&cols, rest)) => (rest.iter().product(), cols),
            None => (1, 1),
        }
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    pub(crate) fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        self.ledger
            .free(self.id, self.category, self.bytes(), &self.label);
        if let Some(pool) = self.pool.take() {
            pool.put(std::mem::replace(
                &mut self.storage,
                Storage::F32(Vec::new()),
            ));
        }
    }
}
