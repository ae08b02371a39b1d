//! Rotary position embedding (Hugging Face's rotate-half layout) of the queries and keys
//! of a fused projection `[B, T, (H + 2·KV)·D]` (see [`Heads`]).
//!
//! The family: the graph node [`Rope`], the kernel calls [`forward`] and [`backward`] with
//! their operand checks and FLOP counts, the CPU twin (`cpu.rs`) and the CUDA launches
//! (`cuda.rs`, over `kernels/rope.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{btc, each, ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::ops::Heads;
use crate::tensor::{DType, Tensor};

/// Floating-point operations per rotated element (two products and a sum); the copied
/// values count 0.
const FLOPS: u64 = 3;

/// Rotary position embedding of the query and key heads of `x`
/// (`[B, T, (H + 2·KV)·D]`): in each query and key head, pair `(i, i + D/2)` of position
/// `t` turns by `t · inv_freq[i]`; the values are copied.
pub fn forward(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
) -> Result<()> {
    forward_in_documents(be, out, x, inv_freq, heads, None)
}

/// [`forward`] with each token turned by its position in its document (`positions`
/// `[B·T]`, see [`crate::ops::positions`]; `None` is [`forward`]).
pub fn forward_in_documents(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Rotate {
        name: "rope",
        out,
        x,
        inv_freq,
        heads,
        positions,
    })
}

/// Backward of [`forward`]: `dx` is `dout` turned back by the same angles (overwritten).
pub fn backward(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    dout: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
) -> Result<()> {
    backward_in_documents(be, dx, dout, inv_freq, heads, None)
}

/// Backward of [`forward_in_documents`] (the same `positions`).
pub fn backward_in_documents(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    dout: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Rotate {
        name: "rope_backward",
        out: dx,
        x: dout,
        inv_freq,
        heads,
        positions,
    })
}

/// One rotation: forward (`rope`) or back (`rope_backward`).
struct Rotate<'a> {
    name: &'static str,
    out: &'a mut Tensor,
    x: &'a Tensor,
    inv_freq: &'a [f32],
    heads: Heads,
    positions: Option<&'a [u32]>,
}

impl OpKernel for Rotate<'_> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float(self.name, &[self.out, self.x])?;
        check(self.name, self.out, self.x, self.inv_freq, self.heads)?;
        let s = self.x.shape();
        super::positions::check_continued(self.name, self.positions, s[0], s[1])
    }

    fn flops(&self) -> u64 {
        let w = self.heads.qkv_width().max(1);
        let rows = self.x.numel() / w;
        each(rows * (self.heads.q_width() + self.heads.kv_width()), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let (inv_freq, heads, positions) = (self.inv_freq, self.heads, self.positions);
        if self.name == "rope" {
            cpu::forward(self.out, self.x, inv_freq, heads, positions);
        } else {
            cpu::backward(self.out, self.x, inv_freq, heads, positions);
        }
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let (inv_freq, heads, positions) = (self.inv_freq, self.heads, self.positions);
        if self.name == "rope" {
            cuda::forward(be, self.out, self.x, inv_freq, heads, positions)
        } else {
            cuda::backward(be, self.out, self.x, inv_freq, heads, positions)
        }
    }
}

/// Checks the operands (the contract every backend shares): `x` and `out` alike, shaped
/// `[B, T, (H + 2·KV)·D]` for valid `heads` of even width, one frequency per pair.
pub(crate) fn check(
    op: &'static str,
    out: &Tensor,
    x: &Tensor,
    inv_freq: &[f32],
    heads: Heads,
) -> Result<()> {
    heads.check(op)?;
    let (_, _, w) = btc(x, op)?;
    ensure(out.shape() == x.shape(), op, || {
        format!(
            "`{}` {:?} and `{}` {:?} differ",
            out.label(),
            out.shape(),
            x.label(),
            x.shape()
        )
    })?;
    ensure(w == heads.qkv_width(), op, || {
        format!(
            "`{}` has rows of {w}; {} query and {} key/value heads of {} need {}",
            x.label(),
            heads.n_head,
            heads.n_kv_head,
            heads.head_dim,
            heads.qkv_width()
        )
    })?;
    ensure(heads.head_dim % 2 == 0, op, || {
        format!("head width {} must be even to rotate pairs", heads.head_dim)
    })?;
    ensure(inv_freq.len() == heads.head_dim / 2, op, || {
        format!(
            "{} frequencies for heads of {} (one per pair)",
            inv_freq.len(),
            heads.head_dim
        )
    })
}

/// Rotary position embedding in Hugging Face's rotate-half layout (see
/// [`forward`]) of the query and key heads of `x`
/// (`[B, T, (H + 2·KV)·D]`); the values pass through. Each token turns by its position in
/// its document where the batch has positions ([`ForwardCx::positions`]).
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
        forward_in_documents(
            cx.backend,
            &mut out,
            cx.input(0)?,
            &self.inv_freq,
            self.heads,
            cx.positions,
        )?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let positions = cx.positions;
        cx.grads_in[0].overwrite(be, |dx| {
            backward_in_documents(be, dx, &dout, &self.inv_freq, self.heads, positions)
        })
    }
}
