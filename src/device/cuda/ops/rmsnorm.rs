//! rmsnorm on the GPU (kernels to come).

use super::super::backend::CudaBackend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub(crate) fn forward(
    _be: &CudaBackend,
    _out: &mut Tensor,
    _rstd: &mut Tensor,
    _x: &Tensor,
    _weight: &Tensor,
    _eps: f32,
) -> Result<()> {
    Err(Error::Backend {
        backend: "cuda",
        message: "rmsnorm has no CUDA kernel yet".into(),
    })
}

pub(crate) fn backward(
    _be: &CudaBackend,
    _dx: &mut Tensor,
    _dweight: &mut Tensor,
    _dout: &Tensor,
    _x: &Tensor,
    _weight: &Tensor,
    _rstd: &Tensor,
) -> Result<()> {
    Err(Error::Backend {
        backend: "cuda",
        message: "rmsnorm has no CUDA kernel yet".into(),
    })
}
