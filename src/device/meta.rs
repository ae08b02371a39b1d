//! The meta backend: tensors with a shape, a dtype and ledger bytes but no elements, and
//! every op a check of its operands that computes nothing.
//!
//! Running the real trainer on it reproduces the ledger of a training step byte for byte
//! (every allocation and free happens in the same order, with the same category, bytes
//! and label as on the CPU) without storing a single element, so the memory of a
//! multi-billion-parameter model is predicted exactly in milliseconds. See
//! [`crate::estimate::predict`].

use super::cpu::{self, ensure};
use super::{AdamWStep, Backend, Device};
use crate::error::Result;
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};

/// A backend whose tensors hold no data: allocations, frees and operand checks only.
///
/// Reads ([`Backend::to_f32`]) return zeros, so a loop driven by values (a loss, a norm)
/// sees a finite, zero-valued step.
#[derive(Debug, Default)]
pub struct MetaBackend {
    ledger: Ledger,
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
        Tensor::new(
            Storage::Meta { len, dtype },
            shape,
            category,
            label,
            &self.ledger,
        )
    }
}

/// Fails unless `a` and `b` have as many elements.
fn same_len(a: &Tensor, b: &Tensor, op: &'static str) -> Result<()> {
    ensure(a.numel() == b.numel(), op, || {
        format!(
            "`{}` {:?} and `{}` {:?} differ in size",
            a.label(),
            a.shape(),
            b.label(),
            b.shape()
        )
    })
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

    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label)
    }

    fn upload(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        ensure(data.len() == numel, "upload", || {
            format!(
                "`{label}`: shape {shape:?} holds {numel} elements but {} were given",
                data.len()
            )
        })?;
        self.alloc(shape, dtype, category, label)
    }

    fn to_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(vec![0.0; t.numel()])
    }

    fn copy(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        self.alloc(t.shape(), t.dtype(), category, label)
    }

    fn cast(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        same_len(dst, src, "cast")
    }

    fn fill(&self, _t: &mut Tensor, _value: f32) -> Result<()> {
        Ok(())
    }

    fn add(&self, out: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
        same_len(out, a, "add")?;
        same_len(out, b, "add")
    }

    fn axpy(&self, y: &mut Tensor, _alpha: f32, x: &Tensor) -> Result<()> {
        same_len(y, x, "axpy")
    }

    fn scale(&self, _x: &mut Tensor, _alpha: f32) -> Result<()> {
        Ok(())
    }

    fn sum_squares(&self, _x: &Tensor) -> Result<f64> {
        Ok(0.0)
    }

    fn matmul(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        _accumulate: bool,
    ) -> Result<()> {
        cpu::matmul::dims(out, a, b, bias, trans_a, trans_b).map(|_| ())
    }

    fn bias_backward(&self, dbias: &mut Tensor, dout: &Tensor) -> Result<()> {
        let (_, cols) = dout.rows_cols();
        ensure(dbias.numel() == cols, "bias_backward", || {
            format!(
                "`{}` has {} elements for {cols} columns",
                dbias.label(),
                dbias.numel()
            )
        })
    }

    fn embedding(
        &self,
        out: &mut Tensor,
        tokens: &[u32],
        wte: &Tensor,
        wpe: &Tensor,
    ) -> Result<()> {
        cpu::embedding::check("embedding", out, tokens, wte, wpe).map(|_| ())
    }

    fn embedding_backward(
        &self,
        dwte: &mut Tensor,
        dwpe: &mut Tensor,
        dout: &Tensor,
        tokens: &[u32],
    ) -> Result<()> {
        cpu::embedding::check("embedding_backward", dout, tokens, dwte, dwpe).map(|_| ())
    }

    fn layernorm(
        &self,
        out: &mut Tensor,
        stats: &mut Tensor,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _eps: f32,
    ) -> Result<()> {
        cpu::layernorm::check_forward(out, stats, x, weight, bias).map(|_| ())
    }

    fn layernorm_backward(
        &self,
        dx: &mut Tensor,
        dweight: &mut Tensor,
        dbias: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        stats: &Tensor,
    ) -> Result<()> {
        cpu::layernorm::check_backward(dx, dweight, dbias, dout, x, weight, stats).map(|_| ())
    }

    fn gelu(&self, out: &mut Tensor, x: &Tensor) -> Result<()> {
        same_len(out, x, "gelu")
    }

    fn gelu_backward(&self, dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()> {
        same_len(dx, x, "gelu_backward")?;
        same_len(dx, dout, "gelu_backward")
    }

    fn attention_scores(&self, _scores: &mut Tensor, _qkv: &Tensor, _n_head: usize) -> Result<()> {
        Ok(())
    }

    fn attention_scores_backward(
        &self,
        _dqkv: &mut Tensor,
        _dscores: &Tensor,
        _qkv: &Tensor,
        _n_head: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn softmax_causal(&self, probs: &mut Tensor, scores: &Tensor) -> Result<()> {
        same_len(probs, scores, "softmax_causal")
    }

    fn softmax_causal_backward(
        &self,
        dscores: &mut Tensor,
        dprobs: &Tensor,
        probs: &Tensor,
    ) -> Result<()> {
        same_len(dscores, dprobs, "softmax_causal_backward")?;
        same_len(dscores, probs, "softmax_causal_backward")
    }

    fn attention_values(
        &self,
        _out: &mut Tensor,
        _probs: &Tensor,
        _qkv: &Tensor,
        _n_head: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn attention_values_backward(
        &self,
        _dprobs: &mut Tensor,
        _dqkv: &mut Tensor,
        _dout: &Tensor,
        _probs: &Tensor,
        _qkv: &Tensor,
        _n_head: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: &mut Tensor,
        targets: &[u32],
        vocab: usize,
        _grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<()> {
        let (rows, _) = cpu::cross_entropy::check(logits, targets, vocab)?;
        cpu::cross_entropy::check_losses(losses, rows)
    }

    fn grad_guard(
        &self,
        record: &mut Tensor,
        _grads: &[&Tensor],
        losses: &Tensor,
        _max_norm: f32,
        _loss_scale: f32,
    ) -> Result<()> {
        cpu::guard::check(record, losses)
    }

    fn adamw(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        _hp: &AdamWStep,
        scale: Option<&Tensor>,
        _compute: Option<&mut Tensor>,
    ) -> Result<()> {
        cpu::adamw::check(param, grad, m, v)?;
        if let Some(s) = scale {
            cpu::adamw::check_scale(s)?;
        }
        Ok(())
    }

    fn custom(
        &self,
        kernel: &dyn super::CustomKernel,
        outputs: &mut [&mut Tensor],
        inputs: &[&Tensor],
        _scalars: &[f32],
    ) -> Result<()> {
        let n = super::custom::check(kernel, outputs, inputs)?;
        let _op = self.ledger.op(
            kernel.name(),
            cpu::each(n, kernel.flops_per_element()),
            outputs[0].label(),
        );
        Ok(())
    }
}
