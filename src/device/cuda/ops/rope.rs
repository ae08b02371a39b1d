//! rope on the GPU (kernels to come).

use super::super::backend::CudaBackend;
use crate::device::Heads;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub(crate) fn forward(
    _be: &CudaBackend,
    _out: &mut Tensor,
    _x: &Tensor,
    _inv_freq: &[f32],
    _heads: Heads,
) -> Result<()> {
    Err(Error::Backend {
        backend: "cuda",
        message: "rope has no CUDA kernel yet".into(),
    })
}

pub(crate) fn backward(
    _be: &CudaBackend,
    _dx: &mut Tensor,
    _dout: &Tensor,
    _inv_freq: &[f32],
    _heads: Heads,
) -> Result<()> {
    Err(Error::Backend {
        backend: "cuda",
        message: "rope has no CUDA kernel yet".into(),
    })
}
