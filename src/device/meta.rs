//! The meta backend: tensors with a shape, a dtype and ledger bytes but no elements, and
//! every kernel a no-op. The ops' shared checks and ledger spans are the trait's
//! ([`Backend`]), so a meta run checks every operand as the CPU does and records the same
//! op spans with the same FLOP counts.
//!
//! Running the real trainer on it reproduces the ledger of a training step byte for byte
//! (every allocation and free happens in the same order, with the same category, bytes
//! and label as on the CPU) without storing a single element, so the memory of a
//! multi-billion-parameter model is predicted exactly in milliseconds. See
//! [`crate::estimate::predict`].

use super::{Backend, Device};
use crate::error::Result;
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};
use std::sync::{Arc, OnceLock};

/// A backend whose tensors hold no data: allocations, frees, operand checks and op spans
/// only.
///
/// Reads ([`Backend::to_f32`]) return zeros, so a loop driven by values (a loss, a norm)
/// sees a finite, zero-valued step.
#[derive(Debug, Default)]
pub struct MetaBackend {
    ledger: Ledger,
    /// Host memory held for a device ([`Backend::host`]): every tensor is counted under
    /// [`MemoryCategory::Offloaded`], streamed weights under [`MemoryCategory::Streamed`].
    for_device: bool,
    /// This backend's [`Backend::host`], made on first use.
    host: OnceLock<Arc<MetaBackend>>,
}

impl MetaBackend {
    /// A meta backend with its own ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn alloc(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        let len = shape.iter().product();
        let category = if self.for_device {
            category.in_host_memory()
        } else {
            category
        };
        Tensor::new(
            Storage::Meta { len, dtype },
            shape,
            category,
            label,
            &self.ledger,
        )
    }
}

impl Backend for MetaBackend {
    fn name(&self) -> &'static str {
        "meta"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn holds_data(&self) -> bool {
        false
    }

    fn dispatch(&self, _call: &mut dyn crate::device::OpKernel) -> Result<()> {
        Ok(())
    }

    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label)
    }

    fn upload_kernel(
        &self,
        _data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label)
    }

    fn to_f32_kernel(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(vec![0.0; t.numel()])
    }

    fn copy_kernel(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        self.alloc(t.shape(), t.dtype(), category, label)
    }

    fn host(&self) -> Option<Arc<dyn Backend>> {
        if self.for_device {
            return None;
        }
        let host = self.host.get_or_init(|| {
            Arc::new(MetaBackend {
                ledger: self.ledger.clone(),
                for_device: true,
                host: OnceLock::new(),
            })
        });
        Some(Arc::clone(host) as Arc<dyn Backend>)
    }

    fn transfer_kernel(&self, _dst: &mut Tensor, _src: &Tensor) -> Result<()> {
        Ok(())
    }

    fn matmul_kernel(
        &self,
        _out: &mut Tensor,
        _a: &Tensor,
        _b: &Tensor,
        _bias: Option<&Tensor>,
        _trans_a: bool,
        _trans_b: bool,
        _accumulate: bool,
    ) -> Result<()> {
        Ok(())
    }
}
