//! swiglu on the GPU (kernels to come).

use super::super::backend::CudaBackend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub(crate) fn forward(_be: &CudaBackend, _out: &mut Tensor, _gate_up: &Tensor) -> Result<()> {
    Err(Error::Backend {
        backend: "cuda",
        message: "swiglu has no CUDA kernel yet".into(),
    })
}

pub(crate) fn backward(
    _be: &CudaBackend,
    _dgate_up: &mut Tensor,
    _dout: &Tensor,
    _gate_up: &Tensor,
) -> Result<()> {
    Err(Error::Backend {
        backend: "cuda",
        message: "swiglu has no CUDA kernel yet".into(),
    })
}
