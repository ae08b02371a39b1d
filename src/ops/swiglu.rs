//! SwiGLU's gate: the activation of Llama's MLP.

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// `out = silu(gate) · up` from a fused `[.., 2F]` projection holding the gate in its first
/// `F` columns and the up projection in its last `F` (see [`crate::Backend::swiglu`]).
///
/// Input: `gate_up`. Output: `out` (`[.., F]`). Backward reads `gate_up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwiGlu;

impl Op for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let gate_up = inputs[0];
        let mut shape = gate_up.shape().to_vec();
        match shape.last_mut() {
            Some(last) if *last % 2 == 0 => *last /= 2,
            _ => {
                return Err(Error::shape(
                    "swiglu",
                    format!(
                        "`{}` {:?} must end in an even width: the gate and up projections \
                         side by side",
                        gate_up.label(),
                        gate_up.shape()
                    ),
                ))
            }
        }
        Ok(vec![(shape, dtype)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut out = cx.alloc(0)?;
        cx.backend.swiglu(&mut out, cx.input(0)?)?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let gate_up = cx.inputs[0].get()?;
        cx.grads_in[0].overwrite(be, |dgu| be.swiglu_backward(dgu, &dout, gate_up))?;
        cx.inputs[0].release();
        Ok(())
    }
}
