//! The CPU backend: the reference implementation of every op.
//!
//! Arithmetic is f32; bf16 tensors are stored as `half::bf16` and rounded where a GPU
//! kernel stores its output. Every reduction runs in a fixed order (work is split into
//! chunks whose boundaries depend on the shape only, never on the thread count), so the same
//! inputs give bitwise-equal outputs, which the recompute policies rely on.
//!
//! Every op is one span in the ledger ([`Ledger::op`]) carrying the floating-point
//! operations it executed, each multiply, add, exp, square root or division counting
//! one: 2·m·n·k for a matmul (plus m·n with a bias); for attention, the products over the
//! causal triangle in whole blocks of 64 rows, as the kernels compute them (plus one per
//! score for the scaling), 5 per causal entry for the softmax and 4 for its backward; per
//! element, 1 for `add`, `scale`, `embedding` and `bias_backward`, 2 for `axpy`,
//! `sum_squares` and `embedding_backward`, 8 for `layernorm`, 19 for its backward, 9 for
//! `gelu`, 19 for its backward, 15 for `adamw`, and per logit 4 for `cross_entropy`
//! (5 with the gradient). Copies, casts, fills and transfers count 0.

pub(crate) mod adamw;
pub(crate) mod attention;
mod blas;
pub(crate) mod cross_entropy;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod gelu;
pub(crate) mod guard;
pub(crate) mod layernorm;
pub(crate) mod matmul;
mod pool;
mod simd;

use super::{AdamWStep, Backend, Device};
use crate::error::{Error, Result};
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Storage, Tensor};
pub use blas::{Blas, BLAS_ENV};
use half::bf16;
pub(crate) use pool::BufferPool;
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

/// Elements per parallel chunk of element-wise work.
const CHUNK: usize = 1 << 14;

/// Floating-point operations per element of the element-wise kernels (see the module
/// documentation).
pub(crate) mod per_element {
    pub const ADD: u64 = 1;
    pub const AXPY: u64 = 2;
    pub const SCALE: u64 = 1;
    pub const SUM_SQUARES: u64 = 2;
    pub const BIAS_BACKWARD: u64 = 1;
    pub const EMBEDDING: u64 = 1;
    pub const EMBEDDING_BACKWARD: u64 = 2;
    pub const LAYERNORM: u64 = 8;
    pub const LAYERNORM_BACKWARD: u64 = 19;
    pub const GELU: u64 = 9;
    pub const GELU_BACKWARD: u64 = 19;
    pub const ADAMW: u64 = 15;
    pub const CROSS_ENTROPY: u64 = 4;
    pub const CROSS_ENTROPY_GRAD: u64 = 5;
    pub const SOFTMAX: u64 = 5;
    pub const SOFTMAX_BACKWARD: u64 = 4;
}

/// `per` operations on each of `n` elements.
pub(crate) fn each(n: usize, per: u64) -> u64 {
    (n as u64).saturating_mul(per)
}

/// The reference backend, running on the host with rayon threads.
///
/// Matrix products run on the `gemm` crate, or on a CBLAS library loaded at run time
/// ([`CpuBackend::with_blas`], [`CpuBackend::from_env`]).
#[derive(Debug)]
pub struct CpuBackend {
    ledger: Ledger,
    pool: Arc<BufferPool>,
    blas: Option<Arc<Blas>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A CPU backend with its own ledger, running its matrix products on the `gemm`
    /// crate.
    pub fn new() -> Self {
        let ledger = Ledger::new();
        CpuBackend {
            pool: Arc::new(BufferPool::new(ledger.clone())),
            ledger,
            blas: None,
        }
    }

    /// A CPU backend whose matrix products run on `blas` (see [`Blas`]).
    pub fn with_blas(blas: Arc<Blas>) -> Self {
        CpuBackend {
            blas: Some(blas),
            ..Self::new()
        }
    }

    /// [`CpuBackend::with_blas`] with the library named by `$TRAINKIT_BLAS` when it is set
    /// and not empty, else [`CpuBackend::new`]. A library that cannot be used is an error
    /// naming the variable and what it should point at.
    pub fn from_env() -> Result<Self> {
        match Blas::path_from_env() {
            Some(path) => Ok(Self::with_blas(Arc::new(Blas::load(path)?))),
            None => Ok(Self::new()),
        }
    }

    /// The CBLAS library running the matrix products, if any.
    pub fn blas(&self) -> Option<&Blas> {
        self.blas.as_deref()
    }

    /// Host bytes the caching allocator holds for reuse (not in the ledger, which counts
    /// live tensors).
    pub fn cached_bytes(&self) -> u64 {
        self.pool.cached_bytes()
    }

    /// A tensor whose storage comes from the pool when possible; `zero` fills it.
    fn alloc(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
        zero: bool,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = (n * dtype.size()) as u64;
        // Ask the ledger first so a refused allocation never touches host memory.
        if let Some(err) = self.ledger.would_refuse(category, bytes, label) {
            return Err(err);
        }
        let storage = match dtype {
            DType::F32 => Storage::F32(match self.pool.take_f32(n) {
                Some(mut v) => {
                    if zero {
                        v.fill(0.0);
                    }
                    v
                }
                None => vec![0.0; n],
            }),
            DType::Bf16 => Storage::Bf16(match self.pool.take_bf16(n) {
                Some(mut v) => {
                    if zero {
                        v.fill(bf16::ZERO);
                    }
                    v
                }
                None => vec![bf16::ZERO; n],
            }),
        };
        Ok(Tensor::new(storage, shape, category, label, &self.ledger)?
            .with_pool(Arc::clone(&self.pool)))
    }
}

/// The elements of `t` as f32, borrowed when `t` is f32.
///
/// A tensor of the CUDA backend is copied from the device (slow, and only for mixing
/// backends in tests); a device failure during that copy panics, as there is no way to
/// return it here.
pub(crate) fn read(t: &Tensor) -> Cow<'_, [f32]> {
    match t.storage() {
        Storage::Device(d) => Cow::Owned(
            d.to_f32()
                .unwrap_or_else(|e| panic!("reading `{}` from the GPU failed: {e}", t.label())),
        ),
        Storage::Meta { len, .. } => Cow::Owned(vec![0.0; *len]),
        Storage::F32(v) => Cow::Borrowed(v.as_slice()),
        Storage::Bf16(v) => {
            let mut out = vec![0f32; v.len()];
            out.par_chunks_mut(CHUNK)
                .zip(v.par_chunks(CHUNK))
                .for_each(|(o, i)| {
                    for (o, i) in o.iter_mut().zip(i) {
                        *o = i.to_f32();
                    }
                });
            Cow::Owned(out)
        }
    }
}

/// Runs `f` on the elements of `t` as f32 and stores the result in `t`'s dtype.
/// With `load`, `f` sees the current contents (for accumulation); otherwise zeros.
pub(crate) fn write<R>(t: &mut Tensor, load: bool, f: impl FnOnce(&mut [f32]) -> R) -> R {
    match t.storage_mut() {
        Storage::Device(d) => {
            let fail = |e: Error| -> ! { panic!("writing a tensor on the GPU failed: {e}") };
            let mut tmp = if load {
                d.to_f32().unwrap_or_else(|e| fail(e))
            } else {
                vec![0f32; d.len()]
            };
            let r = f(&mut tmp);
            d.write_f32(&tmp).unwrap_or_else(|e| fail(e));
            r
        }
        Storage::Meta { len, .. } => f(&mut vec![0.0; *len]),
        Storage::F32(v) => f(v.as_mut_slice()),
        Storage::Bf16(v) => {
            let mut tmp = vec![0f32; v.len()];
            if load {
                tmp.par_chunks_mut(CHUNK)
                    .zip(v.par_chunks(CHUNK))
                    .for_each(|(o, i)| {
                        for (o, i) in o.iter_mut().zip(i) {
                            *o = i.to_f32();
                        }
                    });
            }
            let r = f(&mut tmp);
            v.par_chunks_mut(CHUNK)
                .zip(tmp.par_chunks(CHUNK))
                .for_each(|(o, i)| {
                    for (o, i) in o.iter_mut().zip(i) {
                        *o = bf16::from_f32(*i);
                    }
                });
            r
        }
    }
}

/// Fails with a shape error unless `ok`.
pub(crate) fn ensure(ok: bool, op: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::shape(op, message()))
    }
}

/// Fails unless `t` has exactly `shape`.
pub(crate) fn ensure_shape(t: &Tensor, shape: &[usize], op: &'static str) -> Result<()> {
    ensure(t.shape() == shape, op, || {
        format!(
            "`{}` has shape {:?}, expected {:?}",
            t.label(),
            t.shape(),
            shape
        )
    })
}

/// Fails unless `t` is f32.
pub(crate) fn ensure_f32(t: &Tensor, op: &'static str) -> Result<()> {
    ensure(t.dtype() == DType::F32, op, || {
        format!("`{}` must be f32, it is {}", t.label(), t.dtype())
    })
}

/// `[B, T, C]` of a rank-3 tensor.
pub(crate) fn btc(t: &Tensor, op: &'static str) -> Result<(usize, usize, usize)> {
    match *t.shape() {
        [b, tt, c] => Ok((b, tt, c)),
        _ => Err(Error::shape(
            op,
            format!("`{}` must be [B, T, C], it is {:?}", t.label(), t.shape()),
        )),
    }
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `SendPtr`).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label, true)
    }

    fn empty(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.alloc(shape, dtype, category, label, false)
    }

    fn upload(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        let op = self.ledger.op("upload", 0, label);
        let storage = match dtype {
            DType::F32 => Storage::F32(data.to_vec()),
            DType::Bf16 => Storage::Bf16(data.iter().map(|x| bf16::from_f32(*x)).collect()),
        };
        op.finish(Tensor::new(storage, shape, category, label, &self.ledger))
    }

    fn to_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        let _op = self.ledger.op("to_f32", 0, t.label());
        Ok(read(t).into_owned())
    }

    fn copy(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor> {
        let op = self.ledger.op("copy", 0, label);
        let storage = match t.storage() {
            Storage::F32(v) => Storage::F32(v.clone()),
            Storage::Bf16(v) => Storage::Bf16(v.clone()),
            Storage::Meta { len, dtype } => Storage::Meta {
                len: *len,
                dtype: *dtype,
            },
            Storage::Device(d) => {
                let v = d.to_f32()?;
                match d.dtype() {
                    DType::F32 => Storage::F32(v),
                    DType::Bf16 => Storage::Bf16(v.iter().map(|x| bf16::from_f32(*x)).collect()),
                }
            }
        };
        op.finish(Tensor::new(
            storage,
            t.shape(),
            category,
            label,
            &self.ledger,
        ))
    }

    fn cast(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        self.ledger
            .op("cast", 0, dst.label())
            .finish(elementwise::cast(dst, src))
    }

    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        let _op = self.ledger.op("fill", 0, t.label());
        elementwise::fill(t, value);
        Ok(())
    }

    fn add(&self, out: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
        let flops = each(out.numel(), per_element::ADD);
        self.ledger
            .op("add", flops, out.label())
            .finish(elementwise::add(out, a, b))
    }

    fn axpy(&self, y: &mut Tensor, alpha: f32, x: &Tensor) -> Result<()> {
        let flops = each(y.numel(), per_element::AXPY);
        self.ledger
            .op("axpy", flops, y.label())
            .finish(elementwise::axpy(y, alpha, x))
    }

    fn scale(&self, x: &mut Tensor, alpha: f32) -> Result<()> {
        let _op = self
            .ledger
            .op("scale", each(x.numel(), per_element::SCALE), x.label());
        elementwise::scale(x, alpha);
        Ok(())
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        let flops = each(x.numel(), per_element::SUM_SQUARES);
        let _op = self.ledger.op("sum_squares", flops, x.label());
        Ok(elementwise::sum_squares(x))
    }

    fn matmul(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        let flops = matmul::flops(out, a, bias.is_some(), trans_a);
        self.ledger
            .op("matmul", flops, out.label())
            .finish(matmul::matmul(
                self.blas(),
                out,
                a,
                b,
                bias,
                trans_a,
                trans_b,
                accumulate,
            ))
    }

    fn bias_backward(&self, dbias: &mut Tensor, dout: &Tensor) -> Result<()> {
        let flops = each(dout.numel(), per_element::BIAS_BACKWARD);
        self.ledger
            .op("bias_backward", flops, dbias.label())
            .finish(elementwise::bias_backward(dbias, dout))
    }

    fn embedding(
        &self,
        out: &mut Tensor,
        tokens: &[u32],
        wte: &Tensor,
        wpe: &Tensor,
    ) -> Result<()> {
        let flops = each(out.numel(), per_element::EMBEDDING);
        self.ledger
            .op("embedding", flops, out.label())
            .finish(embedding::forward(out, tokens, wte, wpe))
    }

    fn embedding_backward(
        &self,
        dwte: &mut Tensor,
        dwpe: &mut Tensor,
        dout: &Tensor,
        tokens: &[u32],
    ) -> Result<()> {
        let flops = each(dout.numel(), per_element::EMBEDDING_BACKWARD);
        self.ledger
            .op("embedding_backward", flops, dwte.label())
            .finish(embedding::backward(dwte, dwpe, dout, tokens))
    }

    fn layernorm(
        &self,
        out: &mut Tensor,
        stats: &mut Tensor,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
    ) -> Result<()> {
        let flops = each(x.numel(), per_element::LAYERNORM);
        self.ledger
            .op("layernorm", flops, out.label())
            .finish(layernorm::forward(out, stats, x, weight, bias, eps))
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
        let flops = each(x.numel(), per_element::LAYERNORM_BACKWARD);
        self.ledger
            .op("layernorm_backward", flops, dx.label())
            .finish(layernorm::backward(
                dx, dweight, dbias, dout, x, weight, stats,
            ))
    }

    fn gelu(&self, out: &mut Tensor, x: &Tensor) -> Result<()> {
        let flops = each(x.numel(), per_element::GELU);
        self.ledger
            .op("gelu", flops, out.label())
            .finish(gelu::forward(out, x))
    }

    fn gelu_backward(&self, dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()> {
        let flops = each(x.numel(), per_element::GELU_BACKWARD);
        self.ledger
            .op("gelu_backward", flops, dx.label())
            .finish(gelu::backward(dx, x, dout))
    }

    fn attention_scores(&self, scores: &mut Tensor, qkv: &Tensor, n_head: usize) -> Result<()> {
        let flops = attention::AttentionFlops::new(qkv, n_head).scores;
        self.ledger
            .op("attention_scores", flops, scores.label())
            .finish(attention::scores(self.blas(), scores, qkv, n_head))
    }

    fn attention_scores_backward(
        &self,
        dqkv: &mut Tensor,
        dscores: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()> {
        let flops = attention::AttentionFlops::new(qkv, n_head).scores_backward;
        self.ledger
            .op("attention_scores_backward", flops, dqkv.label())
            .finish(attention::scores_backward(
                self.blas(),
                dqkv,
                dscores,
                qkv,
                n_head,
            ))
    }

    fn softmax_causal(&self, probs: &mut Tensor, scores: &Tensor) -> Result<()> {
        let flops = attention::softmax_flops(scores, per_element::SOFTMAX);
        self.ledger
            .op("softmax_causal", flops, probs.label())
            .finish(attention::softmax(probs, scores))
    }

    fn softmax_causal_backward(
        &self,
        dscores: &mut Tensor,
        dprobs: &Tensor,
        probs: &Tensor,
    ) -> Result<()> {
        let flops = attention::softmax_flops(probs, per_element::SOFTMAX_BACKWARD);
        self.ledger
            .op("softmax_causal_backward", flops, dscores.label())
            .finish(attention::softmax_backward(dscores, dprobs, probs))
    }

    fn attention_values(
        &self,
        out: &mut Tensor,
        probs: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()> {
        let flops = attention::AttentionFlops::new(qkv, n_head).values;
        self.ledger
            .op("attention_values", flops, out.label())
            .finish(attention::values(self.blas(), out, probs, qkv, n_head))
    }

    fn attention_values_backward(
        &self,
        dprobs: &mut Tensor,
        dqkv: &mut Tensor,
        dout: &Tensor,
        probs: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()> {
        let flops = attention::AttentionFlops::new(qkv, n_head).values_backward;
        self.ledger
            .op("attention_values_backward", flops, dprobs.label())
            .finish(attention::values_backward(
                self.blas(),
                dprobs,
                dqkv,
                dout,
                probs,
                qkv,
                n_head,
            ))
    }

    fn cross_entropy(
        &self,
        logits: &mut Tensor,
        targets: &[u32],
        vocab: usize,
        grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<()> {
        let per = match grad_scale {
            Some(_) => per_element::CROSS_ENTROPY_GRAD,
            None => per_element::CROSS_ENTROPY,
        };
        let flops = each(targets.len().saturating_mul(vocab), per);
        self.ledger
            .op("cross_entropy", flops, logits.label())
            .finish(cross_entropy::cross_entropy(
                logits, targets, vocab, grad_scale, losses,
            ))
    }

    fn grad_guard(
        &self,
        record: &mut Tensor,
        grads: &[&Tensor],
        losses: &Tensor,
        max_norm: f32,
        loss_scale: f32,
    ) -> Result<()> {
        let n: usize = grads.iter().map(|g| g.numel()).sum();
        let flops = each(n, per_element::SUM_SQUARES);
        let op = self.ledger.op("grad_guard", flops, record.label());
        op.finish(guard::grad_guard(
            record, grads, losses, max_norm, loss_scale,
        ))
    }

    fn adamw(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: &AdamWStep,
        scale: Option<&Tensor>,
        compute: Option<&mut Tensor>,
    ) -> Result<()> {
        let flops = each(param.numel(), per_element::ADAMW);
        let op = self.ledger.op("adamw", flops, param.label());
        let updated = adamw::adamw(param, grad, m, v, hp, scale).and_then(|()| match compute {
            Some(c) => elementwise::cast(c, param),
            None => Ok(()),
        });
        op.finish(updated)
    }

    fn custom(
        &self,
        kernel: &dyn super::CustomKernel,
        outputs: &mut [&mut Tensor],
        inputs: &[&Tensor],
        scalars: &[f32],
    ) -> Result<()> {
        let n = outputs.first().map_or(0, |t| t.numel());
        let label = outputs.first().map_or("", |t| t.label()).to_string();
        self.ledger
            .op(kernel.name(), each(n, kernel.flops_per_element()), &label)
            .finish(super::custom::run_on_host(
                kernel,
                outputs,
                inputs,
                scalars,
                &|t| Ok(read(t).into_owned()),
                &|t, v| {
                    write(t, false, |out| out.copy_from_slice(v));
                    Ok(())
                },
            ))
    }
}
