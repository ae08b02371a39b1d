//! Token embeddings, with learned position embeddings (GPT-2's input) or alone (Llama's).
//!
//! The family: the graph nodes [`LearnedEmbedding`] and [`TokenEmbedding`], the kernel
//! calls [`forward`] and [`backward`] with their operand checks and FLOP counts, the CPU
//! twin (`cpu.rs`) and the CUDA launches (`cuda.rs`, over `kernels/embedding.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

pub use cuda::TokenBuckets;

use super::{BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{btc, each, ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Floating-point operations per output element of the forward with position embeddings
/// (0 without), and of the backward with them (half without).
const FLOPS: u64 = 1;
const FLOPS_BACKWARD: u64 = 2;

/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`, or `wte[tokens[b, t]]` alone without
/// position embeddings (`wpe` `None`, as Llama); `out` is `[B, T, C]`.
pub fn forward(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    tokens: &[u32],
    wte: &Tensor,
    wpe: Option<&Tensor>,
) -> Result<()> {
    forward_in_documents(be, out, tokens, wte, wpe, None)
}

/// [`forward`] with each token's position embedding that of its position in its document
/// (`positions` `[B·T]`, see [`crate::ops::positions`]; `None` is [`forward`]).
pub fn forward_in_documents(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    tokens: &[u32],
    wte: &Tensor,
    wpe: Option<&Tensor>,
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Forward {
        out,
        tokens,
        wte,
        wpe,
        positions,
    })
}

/// `dwte[tokens[b, t]] += dout[b, t]` and, with position embeddings,
/// `dwpe[t] += dout[b, t]`.
pub fn backward(
    be: &(impl Backend + ?Sized),
    dwte: &mut Tensor,
    dwpe: Option<&mut Tensor>,
    dout: &Tensor,
    tokens: &[u32],
) -> Result<()> {
    backward_in_documents(be, dwte, dwpe, dout, tokens, None)
}

/// Backward of [`forward_in_documents`] (the same `positions`).
pub fn backward_in_documents(
    be: &(impl Backend + ?Sized),
    dwte: &mut Tensor,
    dwpe: Option<&mut Tensor>,
    dout: &Tensor,
    tokens: &[u32],
    positions: Option<&[u32]>,
) -> Result<()> {
    be.run(&mut Backward {
        dwte,
        dwpe,
        dout,
        tokens,
        positions,
    })
}

struct Forward<'a> {
    out: &'a mut Tensor,
    tokens: &'a [u32],
    wte: &'a Tensor,
    wpe: Option<&'a Tensor>,
    positions: Option<&'a [u32]>,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        ensure_float("embedding", &[self.out, self.wte])?;
        ensure_float("embedding", self.wpe.as_slice())?;
        let (b, t, ..) = check("embedding", self.out, self.tokens, self.wte, self.wpe)?;
        super::positions::check_continued("embedding", self.positions, b, t)
    }

    fn flops(&self) -> u64 {
        each(self.out.numel(), if self.wpe.is_some() { FLOPS } else { 0 })
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::forward(self.out, self.tokens, self.wte, self.wpe, self.positions);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::forward(
            be,
            self.out,
            self.tokens,
            self.wte,
            self.wpe,
            self.positions,
        )
    }
}

struct Backward<'a> {
    dwte: &'a mut Tensor,
    dwpe: Option<&'a mut Tensor>,
    dout: &'a Tensor,
    tokens: &'a [u32],
    positions: Option<&'a [u32]>,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "embedding_backward"
    }

    fn label(&self) -> &str {
        self.dwte.label()
    }

    fn check(&self) -> Result<()> {
        let op = "embedding_backward";
        ensure_float(op, &[self.dwte, self.dout])?;
        ensure_float(op, self.dwpe.as_deref().as_slice())?;
        let (b, t, ..) = check(op, self.dout, self.tokens, self.dwte, self.dwpe.as_deref())?;
        super::positions::check_continued(op, self.positions, b, t)
    }

    fn flops(&self) -> u64 {
        let per = if self.dwpe.is_some() {
            FLOPS_BACKWARD
        } else {
            FLOPS_BACKWARD / 2
        };
        each(self.dout.numel(), per)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let dwpe = self.dwpe.as_deref_mut();
        cpu::backward(self.dwte, dwpe, self.dout, self.tokens, self.positions);
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        let dwpe = self.dwpe.as_deref_mut();
        cuda::backward(be, self.dwte, dwpe, self.dout, self.tokens, self.positions)
    }
}

/// Checks the operands of `embedding` (`x` the output) and `embedding_backward` (`x`
/// the output's gradient), the contract every backend shares, and returns
/// `(B, T, C, vocab)`.
pub(crate) fn check(
    op: &'static str,
    x: &Tensor,
    tokens: &[u32],
    wte: &Tensor,
    wpe: Option<&Tensor>,
) -> Result<(usize, usize, usize, usize)> {
    let (b, t, c) = btc(x, op)?;
    let (v, cw) = wte.rows_cols();
    ensure(cw == c, op, || {
        format!("embedding width differs: activations {c}, wte {cw}")
    })?;
    if let Some(wpe) = wpe {
        let (p, cp) = wpe.rows_cols();
        ensure(cp == c, op, || {
            format!("embedding width differs: activations {c}, wpe {cp}")
        })?;
        ensure(t <= p, op, || {
            format!("sequence length {t} exceeds the {p} positions of wpe")
        })?;
    }
    ensure(tokens.len() == b * t, op, || {
        format!("{} tokens for a [{b}, {t}] batch", tokens.len())
    })?;
    if let Some(bad) = tokens.iter().find(|&&tok| tok as usize >= v) {
        return Err(Error::data(
            "tokens",
            format!("token id {bad} is beyond the vocabulary of {v}; use a tokenizer that matches the model's vocab_size"),
        ));
    }
    Ok((b, t, c, v))
}

/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`, `[B, T, C]`.
///
/// No activation inputs (it reads the batch's tokens). Parameters: wte `[V, C]`, wpe
/// `[P, C]`. Output: `out`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LearnedEmbedding;

impl Op for LearnedEmbedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn output_shapes(
        &self,
        _inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        [b, t]: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let (_, c) = weights
            .first()
            .map(|w| w.rows_cols())
            .ok_or_else(|| Error::shape("embedding", "needs the token embedding"))?;
        Ok(vec![(vec![b, t, c], dtype)])
    }

    fn saves(&self) -> Saves {
        Saves::default()
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut out = cx.alloc(0)?;
        forward_in_documents(
            cx.backend,
            &mut out,
            cx.tokens,
            cx.weights[0],
            Some(cx.weights[1]),
            cx.positions,
        )?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let (wte, wpe) = cx.params.split_at_mut(1);
        let (wte, wpe) = (&mut wte[0], &mut wpe[0]);
        match (wte.wants_grad(), wpe.wants_grad()) {
            // Frozen embeddings: nothing to compute.
            (false, false) => Ok(()),
            (true, false) => backward(be, wte.grad_mut(be)?, None, &dout, cx.tokens),
            // The kernel writes both (a frozen wte's gradient is freed after this node).
            (_, true) => {
                let dwpe = wpe.grad_mut(be)?;
                let (tokens, positions) = (cx.tokens, cx.positions);
                backward_in_documents(be, wte.grad_mut(be)?, Some(dwpe), &dout, tokens, positions)
            }
        }
    }
}

/// `out[b, t] = wte[tokens[b, t]]`, `[B, T, C]`: token embeddings alone, for models whose
/// positions enter elsewhere (rotary embeddings).
///
/// No activation inputs (it reads the batch's tokens). Parameter: wte `[V, C]`. Output:
/// `out`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenEmbedding;

impl Op for TokenEmbedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        LearnedEmbedding.output_shapes(inputs, weights, dtype, batch)
    }

    fn saves(&self) -> Saves {
        Saves::default()
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut out = cx.alloc(0)?;
        forward(cx.backend, &mut out, cx.tokens, cx.weights[0], None)?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        if !cx.params[0].wants_grad() {
            return Ok(());
        }
        let dwte = cx.params[0].grad_mut(be)?;
        backward(be, dwte, None, &dout, cx.tokens)
    }
}

/// The embedding times a constant (Gemma's `√hidden`): `out = factor · x`, and
/// `dx += factor · dy`. Input: `x`. Output: `out`. Backward reads nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingScale {
    /// The constant.
    pub factor: f32,
}

impl Op for EmbeddingScale {
    fn name(&self) -> &'static str {
        "embedding_scale"
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
        Saves {
            inputs: 0,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let x = cx.input(0)?;
        let mut out = cx.alloc(0)?;
        cx.backend.cast(&mut out, x)?;
        cx.backend.scale(&mut out, self.factor)?;
        cx.outputs[0] = Some(out);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let dx = cx.grads_in[0].accumulate(be)?;
        be.axpy(dx, self.factor, &dout)?;
        drop(dout);
        Ok(())
    }
}
