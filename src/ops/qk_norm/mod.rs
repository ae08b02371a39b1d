//! Per-head RMS normalization of the queries and keys (Qwen3's `q_norm` and `k_norm`):
//! inside the fused q/k/v projection `[tokens, (H + 2·KV)·D]`, each query head is
//! normalised over its `D` values with the gain `wq`, each key head with `wk`
//! (`x · rstd · w`, `rstd = 1/√(mean(x²) + eps)` in f32, saved as `[tokens, H + KV]`), and
//! the value heads pass through unchanged.
//!
//! The family: the graph node [`QkNorm`], the kernel calls ([`forward`], [`backward`]) with
//! their operand checks and FLOP counts, the CPU twin (`cpu.rs`, the rows of
//! [`super::rmsnorm`]) and the CUDA launches (`cuda.rs`, over `kernels/qk_norm.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{each, ensure, ensure_f32, ensure_float, ensure_shape};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::ops::Heads;
use crate::tensor::{DType, Tensor};

/// Floating-point operations per normalised element of the forward and of the backward
/// (as [`super::rmsnorm`]).
const FLOPS: u64 = 4;
const FLOPS_BACKWARD: u64 = 11;

/// Tokens of a `[tokens, (H + 2·KV)·D]` projection (0 when its width is not that).
fn tokens(qkv: &Tensor, heads: Heads) -> usize {
    let (rows, cols) = qkv.rows_cols();
    if cols == heads.qkv_width() {
        rows
    } else {
        0
    }
}

/// The checks every call shares: float operands, `qkv` `[tokens, (H + 2·KV)·D]`, `rstd`
/// `[tokens, H + KV]` f32, gains of `D` elements.
fn check_operands(
    op: &'static str,
    qkv: &Tensor,
    rstd: &Tensor,
    gains: [&Tensor; 2],
    heads: Heads,
) -> Result<()> {
    heads.check(op)?;
    ensure_f32(rstd, op)?;
    let (rows, cols) = qkv.rows_cols();
    ensure(cols == heads.qkv_width(), op, || {
        format!(
            "`{}` has rows of {cols}, not the (H + 2·KV)·D = {} of {heads:?}",
            qkv.label(),
            heads.qkv_width()
        )
    })?;
    ensure_shape(rstd, &[rows, heads.n_head + heads.n_kv_head], op)?;
    for w in gains {
        ensure(w.numel() == heads.head_dim, op, || {
            format!(
                "gain `{}` has {} elements for heads of {}",
                w.label(),
                w.numel(),
                heads.head_dim
            )
        })?;
    }
    Ok(())
}

/// Normalises the query and key heads of `qkv` into `out` (value heads copied) and writes
/// each head's reciprocal RMS to `rstd` (`[tokens, H + KV]` f32).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    rstd: &mut Tensor,
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    heads: Heads,
    eps: f32,
) -> Result<()> {
    be.run(&mut Forward {
        out,
        rstd,
        qkv,
        wq,
        wk,
        heads,
        eps,
    })
}

/// Backward of [`forward`]: accumulates into `dx`, `dwq` and `dwk`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    dwq: &mut Tensor,
    dwk: &mut Tensor,
    dout: &Tensor,
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    rstd: &Tensor,
    heads: Heads,
) -> Result<()> {
    be.run(&mut Backward {
        dx,
        dwq,
        dwk,
        dout,
        qkv,
        wq,
        wk,
        rstd,
        heads,
    })
}

/// The forward call of [`forward`].
struct Forward<'a> {
    out: &'a mut Tensor,
    rstd: &'a mut Tensor,
    qkv: &'a Tensor,
    wq: &'a Tensor,
    wk: &'a Tensor,
    heads: Heads,
    eps: f32,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "qk_norm"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        let op = "qk_norm";
        ensure_float(op, &[&*self.out, &*self.rstd, self.qkv, self.wq, self.wk])?;
        ensure_shape(self.out, self.qkv.shape(), op)?;
        check_operands(op, self.qkv, self.rstd, [self.wq, self.wk], self.heads)
    }

    fn flops(&self) -> u64 {
        let h = self.heads;
        each(
            tokens(self.qkv, h) * (h.n_head + h.n_kv_head) * h.head_dim,
            FLOPS,
        )
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(
            self.out, self.rstd, self.qkv, self.wq, self.wk, self.heads, self.eps,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(
            be, self.out, self.rstd, self.qkv, self.wq, self.wk, self.heads, self.eps,
        )
    }
}

/// The backward call of [`backward`].
struct Backward<'a> {
    dx: &'a mut Tensor,
    dwq: &'a mut Tensor,
    dwk: &'a mut Tensor,
    dout: &'a Tensor,
    qkv: &'a Tensor,
    wq: &'a Tensor,
    wk: &'a Tensor,
    rstd: &'a Tensor,
    heads: Heads,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "qk_norm_backward"
    }

    fn label(&self) -> &str {
        self.dx.label()
    }

    fn check(&self) -> Result<()> {
        let op = "qk_norm_backward";
        let all = [
            &*self.dx, &*self.dwq, &*self.dwk, self.dout, self.qkv, self.wq, self.wk, self.rstd,
        ];
        ensure_float(op, &all)?;
        ensure_shape(self.dx, self.qkv.shape(), op)?;
        ensure_shape(self.dout, self.qkv.shape(), op)?;
        check_operands(op, self.qkv, self.rstd, [self.wq, self.wk], self.heads)?;
        check_operands(op, self.qkv, self.rstd, [self.dwq, self.dwk], self.heads)
    }

    fn flops(&self) -> u64 {
        let h = self.heads;
        each(
            tokens(self.qkv, h) * (h.n_head + h.n_kv_head) * h.head_dim,
            FLOPS_BACKWARD,
        )
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::backward(
            self.dx, self.dwq, self.dwk, self.dout, self.qkv, self.wq, self.wk, self.rstd,
            self.heads,
        )
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::backward(
            be, self.dx, self.dwq, self.dwk, self.dout, self.qkv, self.wq, self.wk, self.rstd,
            self.heads,
        )
    }
}

/// Per-head RMS normalization of the queries and keys of a fused q/k/v projection
/// (Qwen3's `q_norm`, `k_norm`), the value heads passed through.
///
/// Input: `qkv`. Parameters: `wq`, `wk` (`D` each). Outputs: the normalised projection
/// (the compute dtype) and `rstd` (`[tokens, H + KV]` f32). Backward reads `qkv` and
/// `rstd`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QkNorm {
    /// The heads of the projection.
    pub heads: Heads,
    /// Added to the mean square.
    pub eps: f32,
}

impl Op for QkNorm {
    fn name(&self) -> &'static str {
        "qk_norm"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let x = inputs[0];
        let (rows, _) = x.rows_cols();
        let h = self.heads;
        Ok(vec![
            (x.shape().to_vec(), dtype),
            (vec![rows, h.n_head + h.n_kv_head], DType::F32),
        ])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0b10,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let x = cx.input(0)?;
        let mut out = cx.alloc(0)?;
        let mut rstd = cx.alloc(1)?;
        let (wq, wk) = (cx.weights[0], cx.weights[1]);
        forward(
            cx.backend, &mut out, &mut rstd, x, wq, wk, self.heads, self.eps,
        )?;
        cx.outputs[0] = Some(out);
        cx.outputs[1] = Some(rstd);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let dx = cx.grads_in[0].accumulate(be)?;
        let (first, second) = cx.params.split_at_mut(1);
        let (wq, dwq) = first[0].weight_and_grad(be)?;
        let (wk, dwk) = second[0].weight_and_grad(be)?;
        backward(
            be,
            dx,
            dwq,
            dwk,
            &dout,
            cx.inputs[0].get()?,
            wq,
            wk,
            cx.outputs[1].get()?,
            self.heads,
        )?;
        cx.inputs[0].release();
        cx.outputs[1].release();
        drop(dout);
        Ok(())
    }
}
