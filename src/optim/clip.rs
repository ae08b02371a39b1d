//! Global-norm gradient clipping.

use super::Param;
use crate::device::Backend;
use crate::error::Result;

/// The L2 norm of all gradients together (f64 accumulation). Parameters without a
/// gradient count as zero.
pub fn global_grad_norm(backend: &dyn Backend, params: &[Param]) -> Result<f64> {
    let grads: Vec<&crate::tensor::Tensor> = params.iter().filter_map(|p| p.grad()).collect();
    Ok(backend.sum_squares_all(&grads)?.sqrt())
}

/// PyTorch's `clip_grad_norm_` coefficient: `max_norm / (norm + 1e-6)` capped at 1;
/// 1 when clipping is off (`max_norm <= 0`).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (norm + 1e-6)).min(1.0) as f32
}
