//! The [`Backend`] trait on the CUDA backend: allocation and transfers through
//! [`CudaBackend`]'s own methods, each primitive (casts, fills, element-wise arithmetic,
//! reductions, the matrix product) launched through its kernels in `ops/`.

use super::backend::{ptr, CudaBackend, GpuPin};
use super::gpu::{DeviceBuffer, GpuMemory, HostPtr};
use super::ops::matmul;
use crate::device::cpu::{host_bytes, host_bytes_mut};
use crate::device::{Backend, CpuBackend, Device};
use crate::error::{Error, Result};
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        self.gpu.describe()
    }

    fn device(&self) -> Device {
        self.device
    }

    fn as_cuda(&self) -> Option<&CudaBackend> {
        Some(self)
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize().map_err(|e| self.explain(e))
    }

    fn device_memory(&self) -> Option<GpuMemory> {
        self.gpu.memory()
    }

    fn reset_device_peak(&self) {
        self.gpu.reset_peak()
    }

    fn dispatch(&self, call: &mut dyn crate::device::OpKernel) -> Result<()> {
        call.cuda(self).map_err(|e| self.explain(e))
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
        let t = self.alloc(shape, dtype, category, label, false)?;
        if let Storage::Device(d) = t.storage() {
            d.write_f32(data).map_err(|e| self.explain(e))?;
        }
        Ok(t)
    }

    fn to_f32_kernel(&self, t: &Tensor) -> Result<Vec<f32>> {
        match t.storage() {
            Storage::Device(d) => d.to_f32().map_err(|e| self.explain(e)),
            // A tensor of this backend's host memory (`Backend::host`).
            _ => Ok(crate::device::cpu::read(t).into_owned()),
        }
    }

    fn host(&self) -> Option<Arc<dyn Backend>> {
        let host = self.host.get_or_init(|| {
            let pin = Arc::new(GpuPin(Arc::clone(&self.gpu)));
            Arc::new(CpuBackend::host_for_pinned(&self.ledger, pin))
        });
        Some(Arc::clone(host) as Arc<dyn Backend>)
    }

    fn transfer_kernel(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        let label = dst.label().to_string();
        let (dst, src) = (dst.storage_mut(), src.storage());
        // Whether the host side is page-locked (the copy is queued), counted either way.
        let queued = |b: &[u8]| {
            let locked = self.gpu.host_registered(b.as_ptr() as HostPtr, b.len());
            let count = if locked {
                &self.queued_transfers
            } else {
                &self.waited_transfers
            };
            count.fetch_add(1, Ordering::Relaxed);
            locked
        };
        let done = match (dst, src) {
            (Storage::Device(d), host) => host_bytes(host).map(|b| {
                if queued(b) {
                    d.fetch_from_registered(b.as_ptr() as HostPtr)
                } else {
                    d.write_bytes(b)
                }
            }),
            (host, Storage::Device(s)) => host_bytes_mut(host).map(|b| {
                if queued(b) {
                    s.download_to_registered(b.as_mut_ptr() as HostPtr)
                } else {
                    s.read_bytes(b)
                }
            }),
            _ => None,
        };
        match done {
            Some(r) => r.map_err(|e| self.explain(e)),
            None => Err(Error::Backend {
                backend: "cuda",
                message: format!(
                    "`{label}`: a transfer copies between the GPU and its host memory, one \
                     tensor on each side"
                ),
            }),
        }
    }

    fn settle(&self, t: &Tensor) -> Result<()> {
        match host_bytes(t.storage()) {
            Some(b) if self.gpu.host_registered(b.as_ptr() as HostPtr, b.len()) => self
                .gpu
                .settle_host(b.as_ptr() as HostPtr)
                .map_err(|e| self.explain(e)),
            _ => Ok(()),
        }
    }

    fn copy_kernel(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        let out = self.alloc(t.shape(), t.dtype(), category, label, false)?;
        if t.bytes() > 0 {
            self.gpu
                .copy(ptr(&out)?, ptr(t)?, t.bytes() as usize)
                .map_err(|e| self.explain(e))?;
        }
        Ok(out)
    }

    fn offload_kernel(&self, t: Tensor) -> Result<Tensor> {
        let Storage::Device(d) = t.storage() else {
            return Err(Error::Backend {
                backend: "cuda",
                message: format!("`{}` lives in host memory, not on the GPU", t.label()),
            });
        };
        if d.is_host() {
            return Err(Error::Backend {
                backend: "cuda",
                message: format!("`{}` is offloaded already", t.label()),
            });
        }
        let host =
            DeviceBuffer::alloc_host(&self.gpu, d.len(), d.dtype()).map_err(|e| self.explain(e))?;
        d.offload_into(&host).map_err(|e| self.explain(e))?;
        let out = Tensor::new(
            Storage::Device(host),
            t.shape(),
            MemoryCategory::Offloaded,
            t.label(),
            &self.ledger,
        )?;
        drop(t);
        Ok(out)
    }

    fn fetch_kernel(&self, t: Tensor, category: MemoryCategory) -> Result<Tensor> {
        let label = t.label().to_string();
        let Storage::Device(h) = t.storage() else {
            return Err(Error::Backend {
                backend: "cuda",
                message: format!("`{label}` lives in host memory, not on the GPU"),
            });
        };
        if !h.is_host() {
            return self.copy_kernel(&t, category, &label);
        }
        let out = self.alloc(t.shape(), t.dtype(), category, &label, false)?;
        if let Storage::Device(d) = out.storage() {
            h.fetch_into(d).map_err(|e| self.explain(e))?;
        }
        drop(t);
        Ok(out)
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
        matmul::gemm(
            self,
            out,
            a,
            b,
            bias,
            trans_a,
            trans_b,
            accumulate,
            matmul::Epilogue::default(),
        )
    }
}
