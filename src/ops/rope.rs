//! Rotary position embedding of the queries and keys of a fused projection.

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::Heads;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Rotary position embedding in Hugging Face's rotate-half layout (see
/// [`crate::Backend::rope`]) of the query and key heads of `x`
/// (`[B, T, (H + 2·KV)·D]`); the values pass through.
///
/// Input: `x`. Output: the rotated projection, shaped as `x`. Backward reads nothing (the
/// rotation is linear), so `x` is freed as soon as it is rotated.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The heads of the projection.
    pub heads: Heads,
    /// One inverse frequency per pair of a head (`D/2` values), scaling applied
    /// ([`crate::model::Rope::inv_freq`]).
    pub inv_freq: Vec<f32>,
}

impl Op for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        Ok(vec![(inputs[0].shape().to_vec(), dtype)])
    }

    fn saves(&self) -> Saves {
        Saves::default()
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut out = cx.alloc(0)?;
        cx.backend
            .rope(&mut out, cx.input(0)?, &self.inv_freq, self.heads)?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        cx.grads_in[0].overwrite(be, |dx| {
            be.rope_backward(dx, &dout, &self.inv_freq, self.heads)
        })
    }
}
